"""The testbed suite: sizes trained on one data order (mia.testbed.suite), and the testbed's model context."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_smoke_suite_members_share_one_data_order(smoke_suite):
    from mia.testbed import open_testbed
    from mia.testbed.config import DATA_FIELDS

    s = smoke_suite
    assert s.name == "smoke" and len(s.members) == 3
    assert s.sizes == sorted(s.sizes) and s.sizes[-1] >= 10 * s.sizes[0]
    assert [s.member(n) for n in s.names] == s.members
    first = s.members[0]
    for tb in s.members:
        # a normal testbed directory, with byte-identical tokenizer and order files (not only equal manifests)
        again = open_testbed(tb.root)
        assert again.config == tb.config
        for rel in ("tokenizer.json", "data/order.bin", "data/order.idx", "data/order.perm.npy"):
            assert _sha(tb.root / rel) == _sha(first.root / rel), rel
        assert tb.manifest["tokenizer"]["sha256"] == _sha(tb.root / "tokenizer.json")
        assert tb.manifest["data"]["bin"]["sha256"] == _sha(tb.root / "data/order.bin")
        assert all(getattr(tb.config, k) == getattr(first.config, k) for k in DATA_FIELDS)
        # the configured checkpoints (other tests sharing the suite may re-create steps in between on demand)
        assert {0, 50, 100} <= set(s.steps) <= set(tb.steps)
    # the sizes differ in the model only, and the larger ones fit the same data better
    widths = [tb.config.hidden_size for tb in s.members]
    assert len(set(widths)) == 3
    losses = [tb.manifest["train"]["final_loss"] for tb in s.members]
    assert losses == sorted(losses, reverse=True)


def test_suite_parameter_counts_and_context_are_the_models(smoke_suite):
    """``sizes`` are the real parameter counts, and the model context is the trained one (rows of seq_len + 1)."""
    import jax

    for tb in smoke_suite.members:
        model = tb.load_model(0)
        assert sum(x.size for x in jax.tree_util.tree_leaves(model.params)) == tb.n_params
        assert model.max_length == tb.config.seq_len == tb.row_len - 1
        assert json.loads((tb.checkpoint_dir(0) / "config.json").read_text())["max_position_embeddings"] == 64


def test_rebuilding_a_built_suite_reuses_it(smoke_suite, monkeypatch):
    import mia.testbed.suite as suite
    from mia.testbed import build_suite

    logs = [tb.root / "train_log.jsonl" for tb in smoke_suite.members]
    before = [p.stat().st_mtime_ns for p in logs]
    real, written = suite.write_json, []
    monkeypatch.setattr(suite, "write_json", lambda path, obj, **kw: (written.append(path), real(path, obj, **kw)))
    again = build_suite("smoke", smoke_suite.root, progress=False)
    assert [p.stat().st_mtime_ns for p in logs] == before  # nothing retrained
    # nor rewritten: the suite never showed "incomplete" to another process opening it meanwhile
    assert written == []
    assert again.sizes == smoke_suite.sizes and again.manifest["data"] == smoke_suite.manifest["data"]


def test_open_suite_verifies_members(smoke_suite, tmp_path):
    from mia.testbed import TestbedError, open_suite

    s = open_suite(smoke_suite.root)
    assert s.names == smoke_suite.names and s.sizes == smoke_suite.sizes
    with pytest.raises(TestbedError, match=r"suite smoke has no member 'big'; members: "):
        s.member("big")
    # a member whose order differs (its file and its record agree, but not with the others) is refused, by name
    copy = tmp_path / "suite"
    shutil.copytree(smoke_suite.root, copy, ignore=shutil.ignore_patterns("checkpoints", "resume", "cache", ".*.tmp"))
    big = copy / s.names[-1] / "testbed.json"
    order = copy / s.names[-1] / "data" / "order.bin"
    data = bytearray(order.read_bytes())
    data[0] ^= 1
    order.write_bytes(bytes(data))
    m = json.loads(big.read_text())
    m["data"]["bin"]["sha256"] = _sha(order)
    big.write_text(json.dumps(m))
    for tb_dir in copy.iterdir():  # the checkpoints are not needed to open, only to be complete
        if tb_dir.is_dir():
            for step in s.steps:
                (tb_dir / "checkpoints" / f"step{step}").mkdir(parents=True)
                (tb_dir / "checkpoints" / f"step{step}" / "model.safetensors").write_bytes(b"")
    with pytest.raises(TestbedError, match=rf"{s.names[-1]}: its order_bin differ\(s\) from the suite's shared data"):
        open_suite(copy)
    with pytest.raises(TestbedError, match="not a testbed suite"):
        open_suite(tmp_path)
    # a member's order file damaged behind its manifest (the record unchanged): refused naming the file
    m["data"]["bin"]["sha256"] = smoke_suite.members[-1].manifest["data"]["bin"]["sha256"]
    big.write_text(json.dumps(m))
    with pytest.raises(TestbedError, match=rf"{order}: damaged: sha256 {_sha(order)[:12]}, testbed.json records "
                                           rf"{m['data']['bin']['sha256'][:12]}"):
        open_suite(copy)


def test_suite_configs_and_cli_errors(tmp_path, capsys):
    from mia.testbed import SUITES, TestbedError, build_suite, preset
    from mia.testbed.__main__ import main
    from mia.testbed.suite import check_same_data, size_name

    for name, configs in SUITES.items():
        check_same_data(configs)
        sizes = [c.n_params() for c in configs]
        assert len(configs) >= 3 and max(sizes) >= 10 * min(sizes), name
    assert preset("smoke").config_hash in {c.config_hash for c in SUITES["smoke"]}  # the smoke testbed is a member
    assert [size_name(n) for n in (19_696, 165_632, 2_628_608, 3_000_000)] == ["20k", "166k", "2.6m", "3m"]
    with pytest.raises(TestbedError, match="differ in data field"):
        check_same_data([preset("smoke"), preset("smoke", seed=1)])
    with pytest.raises(TestbedError, match="unknown suite 'nope'; suites: smoke, default"):
        build_suite("nope", tmp_path)
    assert main(["--suite", "smoke", "--out", str(tmp_path / "s"), "--hidden-size", "8"]) == 2
    assert "--suite takes no testbed options (got hidden_size)" in capsys.readouterr().err


_FMT = {"testbed.json": "mia-testbed/3", "suite.json": "mia-suite/1"}


@pytest.mark.parametrize("manifest", ["testbed.json", "suite.json"])
@pytest.mark.parametrize("content, names", [
    (b'{"format": ', ("not valid JSON",)),
    (b"\xff\xfe", ("not valid JSON",)),
    (b"[1, 2]", ("expected a JSON object",)),
    (b'{"complete": "yes"}', ("'complete'", "bool")),
    (b'{"format": 3}', ("'format'", "str")),
])
def test_corrupt_manifest_is_one_line_naming_it(manifest, content, names, tmp_path, capsys, monkeypatch):
    """A testbed.json / suite.json that is not JSON, not an object, or has a field of the wrong type: one
    ``error:`` line naming the file (opening it, building into its directory, and from the CLI)."""
    from mia.checkpoints import open_suite_members as open_experiment_suite
    from mia.testbed import TestbedError, build_testbed, open_suite, open_testbed
    from mia.testbed.__main__ import main

    mf = tmp_path / "d" / manifest
    mf.parent.mkdir()
    mf.write_bytes(content)
    if manifest == "testbed.json":
        calls = (lambda: open_testbed(mf.parent), lambda: build_testbed("smoke", mf.parent, progress=False))
    else:
        calls = (lambda: open_suite(mf.parent), lambda: open_experiment_suite("smoke", mf.parent))
    for call in calls:
        with pytest.raises(TestbedError) as e:
            call()
        assert "\n" not in str(e.value) and str(mf) in str(e.value) and all(n in str(e.value) for n in names)
    flag = ["--preset", "smoke"] if manifest == "testbed.json" else ["--suite", "smoke"]
    capsys.readouterr()
    assert main([*flag, "--out", str(mf.parent), "--no-progress"]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(mf) in lines[0], lines


@pytest.mark.parametrize("manifest, m, names", [
    ("testbed.json", {"complete": True, "format": _FMT["testbed.json"], "config": {"nosuch": 1, "checkpoints": []}},
     ("'config'",)),
    ("testbed.json", {"complete": True, "format": _FMT["testbed.json"], "config": {"checkpoints": 5}}, ("'config'",)),
    ("suite.json", {"complete": True, "format": _FMT["suite.json"], "members": [3], "data": {}}, ("'members'",)),
    ("suite.json", {"complete": True, "format": _FMT["suite.json"], "members": [], "data": []}, ("'data'",)),
])
def test_manifest_with_wrong_inner_types_is_one_line(manifest, m, names, tmp_path):
    from mia.testbed import TestbedError, open_suite, open_testbed

    (tmp_path / manifest).write_text(json.dumps(m))
    with pytest.raises(TestbedError) as e:
        (open_testbed if manifest == "testbed.json" else open_suite)(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path / manifest) in str(e.value)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_old_testbed_format_is_refused(smoke_testbed, tmp_path):
    from mia.testbed import TestbedError, build_testbed, open_testbed

    old = tmp_path / "old"
    old.mkdir()
    m = dict(smoke_testbed.manifest, format="mia-testbed/2")
    (old / "testbed.json").write_text(json.dumps(m))
    with pytest.raises(TestbedError, match=r"another version of mia.testbed \('mia-testbed/2', now mia-testbed/3\)"):
        open_testbed(old)
    with pytest.raises(TestbedError, match="delete it to rebuild"):
        build_testbed("smoke", old, progress=False)
    # a format field holding a line break (found by test_surface_fuzz's long run) is shown quoted: still one line
    (old / "testbed.json").write_text(json.dumps(dict(m, format="mia-testbed/2\nnow")))
    for call in (lambda: open_testbed(old), lambda: build_testbed("smoke", old, progress=False)):
        with pytest.raises(TestbedError, match=r"\('mia-testbed/2\\nnow', now") as e:
            call()
        assert "\n" not in str(e.value)


def _init_leaves(hidden: int = 128):
    import jax
    import jax.numpy as jnp

    from mia.models.hub import family
    from mia.testbed import model_config, preset
    from mia.testbed.init import init_params

    cfg = model_config(preset("smoke", hidden_size=hidden), 512)
    module = family("gpt_neox").module_cls(cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    return module, jax.tree_util.tree_flatten_with_path(init_params(module, 0))[0]


def test_numpy_init_draws_the_stated_distributions():
    import jax

    _, leaves = _init_leaves()
    seen = set()
    for path, x in leaves:
        x = np.asarray(x)
        name = str(path[-1].key)
        seen.add(name)
        assert x.dtype == np.float32
        if name == "kernel":  # truncated normal on 2 sigma, std 1/sqrt(fan_in)
            sd = 1 / np.sqrt(x.shape[-2])
            assert abs(x.std() / sd - 1) < 0.05 and np.abs(x).max() <= 2 / 0.87962566 * sd * (1 + 1e-6)
        elif name == "embedding":  # normal, std 1/sqrt(D): not truncated
            assert abs(x.std() * np.sqrt(x.shape[-1]) - 1) < 0.05 and np.abs(x).max() * np.sqrt(x.shape[-1]) > 3
        else:
            assert np.array_equal(x, np.zeros_like(x) if name == "bias" else np.ones_like(x)), jax.tree_util.keystr(
                path
            )
    assert seen == {"kernel", "embedding", "bias", "weight"}
    again = _init_leaves()[1]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(leaves, again))


@pytest.mark.slow
def test_numpy_init_matches_flax_default_init():
    """Same tree, per-leaf std and bounds as Flax's own ``module.init`` (which compiles: slow)."""
    import jax
    import jax.numpy as jnp

    module, ours = _init_leaves()
    flax = jax.tree_util.tree_flatten_with_path(
        jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"])[0]
    assert [p for p, _ in ours] == [p for p, _ in flax]
    for (path, x), (_, y) in zip(ours, flax):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        if y.std() == 0:
            assert np.array_equal(x, y)
        else:
            assert abs(x.std() / y.std() - 1) < 0.05 and abs(np.abs(x).max() / np.abs(y).max() - 1) < 0.3


def test_open_suite_members_leaves_a_complete_suite_and_refuses_another(smoke_suite, tmp_path):
    """``open_suite_members`` (what every experiment opens a suite with) on a complete suite opens it and leaves
    suite.json complete and unchanged; a directory holding another suite is refused naming both (it used to be
    opened as if it were the suite asked for); an interrupted build (suite.json incomplete) is finished."""
    import json
    import shutil

    from mia.checkpoints import CheckpointError, open_suite_members

    before = (smoke_suite.root / "suite.json").read_bytes()
    members, desc = open_suite_members("smoke", smoke_suite.root, progress=False)
    assert (smoke_suite.root / "suite.json").read_bytes() == before and json.loads(before)["complete"]
    assert [m.n_params for m in members] == sorted(m.n_params for m in members) and "smoke" in desc
    with pytest.raises(CheckpointError, match=r"holds the testbed suite 'smoke', not 'default'"):
        open_suite_members("default", smoke_suite.root, progress=False)
    copy = tmp_path / "s"
    shutil.copytree(smoke_suite.root, copy, symlinks=True)
    m = json.loads((copy / "suite.json").read_text())
    (copy / "suite.json").write_text(json.dumps(dict(m, complete=False)))
    open_suite_members("smoke", copy, progress=False)
    assert json.loads((copy / "suite.json").read_text())["complete"] is True
