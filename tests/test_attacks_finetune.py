"""The attacks built for fine-tunes, ``ez_mia`` and ``wbc``, against obvious NumPy transcriptions of their official
formulas on the same torch models; the base of ``--adapter`` is their default reference; higher = member."""
import importlib.util

import numpy as np
import pytest

# skipped without peft, which is imported only by the tests that use it (importing it costs 2 s of
# collection on every worker)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

import mia  # noqa: E402
from mia.api import check_request  # noqa: E402
from mia.attacks.ez_mia import ez_scores  # noqa: E402
from mia.attacks.registry import AttackError, available, get, parse_attack  # noqa: E402
from mia.attacks.wbc import wbc_score, window_sizes  # noqa: E402

from hf_tiny import log_softmax, torch_sequence_logits  # noqa: E402
from test_adapter import make_adapter  # noqa: E402
from tiny_configs import V  # noqa: E402


# ------------------------------------------------------------------------------ NumPy transcriptions (the reference)
def numpy_ez(t_logits, r_logits, tokens) -> float:
    """JetBrains-Research/ez-mia ``error_zone_pos_neg_sum_ratio`` on one unpadded text: first prediction dropped
    (ignore_bos), error zone = target's top-1 != token, P / (N + 1e-12), 0 for < 2 error tokens, N = 0, NaN or < 0."""
    lp_t = log_softmax(t_logits[:-1]).astype(np.float32)
    lp_r = log_softmax(r_logits[:-1]).astype(np.float32)
    target = np.asarray(tokens[1:])
    correct_t = lp_t[np.arange(len(target)), target]
    correct_r = lp_r[np.arange(len(target)), target]
    mask = np.ones(len(target), np.float32)
    mask[0] = 0.0
    err = (lp_t.argmax(-1) != target) & (mask > 0.5)
    if err.sum() < 2:
        return 0.0
    d = (correct_t - correct_r)[err]
    pos, neg = d[d > 0].sum(), np.abs(d[d < 0]).sum()
    if neg == 0:
        return 0.0
    v = float(pos / (neg + np.float32(1e-12)))
    return 0.0 if v != v or v < 0 else v


def numpy_wbc(t_logits, r_logits, tokens, sizes) -> float:
    """Stry233/WBC ``_compute_window_score`` averaged over ``sizes``: np.convolve window sums, vote ref > target."""
    target = np.asarray(tokens[1:])
    lt = -log_softmax(t_logits[:-1])[np.arange(len(target)), target].astype(np.float32)
    lr = -log_softmax(r_logits[:-1])[np.arange(len(target)), target].astype(np.float32)
    scores = []
    for w in sizes:
        k = min(w, len(lt))
        scores.append(np.mean(np.convolve(lr, np.ones(k), "valid") > np.convolve(lt, np.ones(k), "valid")))
    return float(np.mean(scores))


# ------------------------------------------------------------------------------ through mia, against the reference
@pytest.fixture(scope="module")
def finetune(tmp_path_factory):
    """(base dir, adapter dir, torch fine-tune (merged), torch base, token rows of several lengths)."""
    import transformers as tf

    tmp = tmp_path_factory.mktemp("ft")
    base, adapter, merged = make_adapter("gpt_neox", tmp, r=4, lora_alpha=4, target_modules="all-linear")
    base_torch = tf.AutoModelForCausalLM.from_pretrained(str(base)).float().eval()
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, V, n) for n in (3, 9, 17, 30, 41, 12)]
    return base, adapter, merged, base_torch, rows


@pytest.mark.slow  # two compiled passes through mia.score (about 40 s on 2 busy cores); the pure parts run below
def test_ez_mia_and_wbc_equal_the_official_formulas_with_the_base_as_default_reference(finetune):
    base, adapter, merged, base_torch, rows = finetune
    model = mia.load(base, adapter=adapter, dtype="float32")
    sizes = (1, 2, 3, 5, 40)
    attacks = f"ez_mia,wbc,wbc:windows={'/'.join(map(str, sizes))},ref"
    run = mia.score(model, [{"tokens": r.tolist()} for r in rows], attacks, cache=False, progress=False)
    logits = [(torch_sequence_logits(merged, r), torch_sequence_logits(base_torch, r)) for r in rows]
    want_ez = [numpy_ez(t, b, r) for (t, b), r in zip(logits, rows)]
    assert sum(w > 0 for w in want_ez) >= 3  # the formula's main branch is exercised, not only its zeros
    np.testing.assert_allclose(run.scores["ez_mia"], want_ez, rtol=1e-5, atol=1e-6)
    default = window_sizes(get("wbc").defaults["windows"])
    np.testing.assert_allclose(run.scores["wbc"], [numpy_wbc(t, b, r, default) for (t, b), r in zip(logits, rows)],
                               atol=1e-12)
    np.testing.assert_allclose(run.scores[f"wbc:windows={'/'.join(map(str, sizes))}"],
                               [numpy_wbc(t, b, r, sizes) for (t, b), r in zip(logits, rows)], atol=1e-12)
    assert np.isfinite(run.scores["ref"]).all()  # ref needs no --ref-model with an adapter either


def test_pure_functions_equal_the_official_formulas_on_torch_logits(finetune):
    _, _, merged, base_torch, rows = finetune
    logits = [(torch_sequence_logits(merged, r), torch_sequence_logits(base_torch, r)) for r in rows]
    n, width = len(rows), max(map(len, rows)) - 1
    t, b, top1 = (np.zeros((n, width), np.float32) for _ in range(3))
    mask = np.zeros((n, width), bool)
    for i, ((lt, lb), r) in enumerate(zip(logits, rows)):
        k = len(r) - 1
        t[i, :k] = log_softmax(lt[:-1])[np.arange(k), r[1:]]
        b[i, :k] = log_softmax(lb[:-1])[np.arange(k), r[1:]]
        top1[i, :k] = lt[:-1].argmax(-1) == r[1:]
        mask[i, :k] = True
    want = [numpy_ez(lt, lb, r) for (lt, lb), r in zip(logits, rows)]
    assert sum(w > 0 for w in want) >= 3
    np.testing.assert_allclose(np.asarray(ez_scores(t, b, top1, mask)), want, rtol=1e-5, atol=1e-6)
    sizes = (1, 3, 40)
    np.testing.assert_allclose([wbc_score(-t[i][mask[i]], -b[i][mask[i]], sizes) for i in range(n)],
                               [numpy_wbc(lt, lb, r, sizes) for (lt, lb), r in zip(logits, rows)], atol=1e-12)


def test_ez_mia_branches_on_arrays():
    # row 0: error zone of 3 with gains +1, +2, -0.5 -> 6; row 1: one error token -> 0; row 2: no loss -> 0;
    # row 3: the first position is never counted (ignore_bos)
    t = np.array([[0, 1, 2, -0.5, 9], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [5, 1, 1, -1, 0]], np.float32)
    r = np.zeros_like(t)
    top1 = np.array([[0, 0, 0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 1, 0, 1]], np.float32)
    mask = np.ones_like(t, bool)
    got = np.asarray(ez_scores(t, r, top1, mask))
    np.testing.assert_allclose(got, [3 / (0.5 + 1e-12), 0, 0, 1 / (1 + 1e-12)], rtol=1e-6)


def test_orientation_higher_is_member():
    # a fine-tune whose loss is below the reference's (member-like) scores above one whose loss is above it
    rng = np.random.default_rng(0)
    ref = rng.uniform(1, 3, 50)
    member, nonmember = ref - 0.5, ref + 0.5
    assert wbc_score(member, ref, (2, 4, 8)) == 1.0 and wbc_score(nonmember, ref, (2, 4, 8)) == 0.0
    flip = rng.random(50) < 0.2  # a few tokens the other way (all gains and no loss scores 0, as officially)
    gain = np.where(flip, -0.1, 0.5).astype(np.float32)
    t = np.stack([gain, -gain])  # target log-probs over a reference at 0: gains (member) or losses (non-member)
    ez = np.asarray(ez_scores(t, np.zeros_like(t), np.zeros_like(t), np.ones(t.shape, bool)))
    assert ez[0] > ez[1]


def test_wbc_ties_vote_zero_and_short_texts_use_one_window():
    assert wbc_score(np.ones(5), np.ones(5), (1, 3)) == 0.0  # identical models: no window votes member
    assert wbc_score(np.array([1.0, 1.0]), np.array([2.0, 0.5]), (40,)) == 1.0  # w_eff = n = 2: one window, 2.5 > 2


def test_registration_parameters_and_needs():
    assert {"ez_mia", "wbc"} <= set(available())
    for name in ("ez_mia", "wbc"):
        assert "ref" in get(name).needs
    assert get("ez_mia").model_stats == ("logprob", "top1")
    assert parse_attack("wbc:windows=1/2/4")[1] == {"windows": "1/2/4"}
    for bad in ("0/2", "a/b", ""):
        with pytest.raises(AttackError, match="windows"):
            window_sizes(bad)
    with pytest.raises(AttackError, match="ez_mia needs a reference model"):
        check_request("ez_mia")


def test_top1_from_logits_is_one_exactly_at_the_argmax():
    from mia.engine.stats import stats_from_logits

    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 5, 300)).astype(np.float32)
    nxt = rng.integers(0, 300, (2, 5))
    nxt[0, 1] = logits[0, 1].argmax()
    logits[1, 3, [7, 9]] = logits[1, 3].max() + 1.0  # a tie of the two largest: either counts
    nxt[1, 3] = 9
    got = np.asarray(stats_from_logits(logits, nxt)["top1"])
    want = (np.take_along_axis(logits, nxt[..., None], -1)[..., 0] == logits.max(-1)).astype(np.float32)
    assert want[0, 1] == want[1, 3] == 1 and want.sum() < want.size
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # compiles the all-statistics pass of the tiny model (the ez_mia score test covers it too)
def test_top1_stat_marks_where_the_token_is_the_models_argmax(tiny_model):
    from mia.engine.batching import ScoringSettings
    from mia.engine.loop import compute_token_stats

    rows = np.random.default_rng(1).integers(0, tiny_model.vocab_size, (2, 11))
    rows[:, -1] = np.asarray(tiny_model.logits(tiny_model.params, rows))[:, -2].argmax(-1)  # causal: stays the argmax
    want = np.asarray(tiny_model.logits(tiny_model.params, rows))[:, :-1].argmax(-1) == rows[:, 1:]
    got = compute_token_stats(tiny_model, list(rows), ScoringSettings(progress=False, pack=False),
                              stats=("logprob", "top1"))
    assert want[:, -1].all() and not want.all()
    for g, w in zip(got, want):
        assert g["top1"].dtype == np.float32
        np.testing.assert_array_equal(g["top1"], w.astype(np.float32))
