"""Con-ReCaLL against an independent NumPy reference on the tiny model, its input checks, CLI and listing."""
import json

import numpy as np
import pytest

from mia.attacks import AttackContext, AttackError, get, parse_attack
from mia.data.examples import Example

from attack_helpers import SETTINGS, WORDS, make_examples, np_ll


# ------------------------------------------------------------------------------------------------ Con-ReCaLL
def test_conrecall_matches_numpy(tiny_model, ref_logits):
    tok = tiny_model.tokenizer
    data = make_examples(tok, 4, 0)
    nm = make_examples(tok, 3, 1, words=(2, 5), partition="prefix", prefix="n", label=0)
    # labels 0, 1, ...: members t1, t3, t5
    train = make_examples(tok, 6, 2, words=(2, 5), partition="train", prefix="t")
    ctx = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "train": train}, {})
    got = get("conrecall").fn(ctx, n=3, gamma=0.6)
    p_nm = np.asarray(tok("".join(e.text for e in nm))["input_ids"])
    p_m = np.asarray(tok("".join(e.text for e in train[1::2]))["input_ids"])
    want = [(np_ll(ref_logits, np.concatenate([p_nm, e.tokens]), len(p_nm))
             - 0.6 * np_ll(ref_logits, np.concatenate([p_m, e.tokens]), len(p_m))) / np_ll(ref_logits, e.tokens)
            for e in data]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    # gamma = 0 is ReCaLL with the same non-member prefix (and shares its conditional pass)
    np.testing.assert_allclose(get("conrecall").fn(ctx, n=3, gamma=0.0), get("recall").fn(ctx, n=3), rtol=1e-6)
    assert any("member prefix shots from the members of the train partition" in n for n in ctx.notes)


def test_conrecall_bad_input(tiny_model):
    """Every refusal comes before any model call, as one line."""
    tok = tiny_model.tokenizer
    data = make_examples(tok, 4, 0)
    nm = make_examples(tok, 4, 1, partition="prefix", prefix="n", label=0)
    train = make_examples(tok, 6, 3, partition="train", prefix="t")  # 3 members
    ctx = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "train": train}, {})
    with pytest.raises(
        AttackError, match="needs at least 4 member prefix example.*got 3 from the members of the train"
    ):
        get("conrecall").fn(ctx, n=4, gamma=1.0)
    with pytest.raises(AttackError, match="needs at least 5 non-member 'prefix' example"):
        get("conrecall").fn(ctx, n=5, gamma=1.0)
    with pytest.raises(AttackError, match="gamma must be a finite number >= 0"):
        get("conrecall").fn(ctx, n=3, gamma=-1.0)
    bad = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "member_prefix": nm}, {})
    with pytest.raises(AttackError, match="member prefix data hold non-members"):
        get("conrecall").fn(bad, n=3, gamma=1.0)
    copies = [Example(f"x{i}", tokens=data[0].tokens, label=1) for i in range(3)]
    clash = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "member_prefix": copies}, {})
    with pytest.raises(AttackError, match=r"conrecall \(member\): prefix data overlaps the evaluated examples"):
        get("conrecall").fn(clash, n=3, gamma=1.0)
    with pytest.raises(AttackError, match="valid parameters: n, gamma"):
        parse_attack("conrecall:alpha=1")


@pytest.mark.slow
def test_conrecall_cli_and_listing(tiny_neox_dir, tmp_path, capsys):
    from mia.cli import main

    def write(path, rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    rng = np.random.default_rng(0)
    text = lambda: " ".join(rng.choice(WORDS, 8))  # noqa: E731
    data = write(tmp_path / "d.jsonl", [{"id": f"e{i}", "text": text(), "label": i % 2} for i in range(6)])
    pre = write(tmp_path / "p.jsonl", [{"id": f"p{i}", "text": text()} for i in range(2)])
    mem = write(tmp_path / "m.jsonl", [{"id": f"m{i}", "text": text(), "label": 1} for i in range(2)])
    base = ["score", "--model", str(tiny_neox_dir), "--data", data, "--out", str(tmp_path / "o.jsonl"), "--no-cache",
            "--no-progress", "--bootstrap", "10", "--prefix-data", pre, "--attacks", "conrecall:n=2"]
    assert main(base + ["--member-prefix-data", mem]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    assert len(rows) == 6 and all(np.isfinite(r["scores"]["conrecall:n=2"]) for r in rows)
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs at least 2 member prefix example(s), got 0" in err[0]
    # the same member shots as a member_prefix partition of the data file give the same scores
    inline = write(tmp_path / "d2.jsonl", [json.loads(line) for line in open(data)] +
                   [dict(json.loads(line), partition="member_prefix") for line in open(mem)])
    assert main([a if a != data else inline for a in base] + ["--out", str(tmp_path / "o2.jsonl")]) == 0
    rows2 = [json.loads(line) for line in open(tmp_path / "o2.jsonl")]
    assert [r["scores"] for r in rows2] == [r["scores"] for r in rows]


def test_attacks_listing_names_the_new_parameters(capsys):
    from mia.cli import main

    assert main(["attacks"]) == 0
    listing = capsys.readouterr().out
    want = "conrecall (n=12, gamma=1.0; needs model, stats, prefix, member_prefix; reads logprob; cost model)"
    assert want in listing
    assert "orient='label_free'" in listing and "prefix_score='auc'" in listing and "skip_eos=False" in listing
    assert get("camia").defaults["min_calib"] <= 18  # accepts the official protocol's 30% of 60 non-members
