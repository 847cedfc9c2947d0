"""Testbed checkpoints are opened and checked before any split work, as real ones are (``check_testbed_checkpoints``:
``check_checkpoint`` on config, tensor names, shapes and dtypes, then config.json against the testbed's own model
config and model.safetensors against the sha256 its testbed.json records). A damaged one is one line naming the
file, and no split is written."""
import json
import shutil
from pathlib import Path

import pytest

from experiments import camia, checkmia, checkmiabench, em_mia
from mia.checkpoints import check_testbed_checkpoints
from mia.checkpoints import CheckpointError
from mia.testbed import open_testbed


def _copy(smoke_testbed, tmp_path) -> Path:
    return Path(shutil.copytree(smoke_testbed.root, tmp_path / "tb", ignore=shutil.ignore_patterns("*-mem*", "cache")))


def _damage(copy: Path, step: int, kind: str) -> tuple:
    """Damage checkpoint ``step`` of the testbed copy; returns (the file the message must name, a fragment)."""
    ckpt = copy / "checkpoints" / f"step{step}"
    weights = ckpt / "model.safetensors"
    if kind == "truncated":  # a download or copy cut short
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return weights, "lie outside"
    if kind == "missing":
        weights.unlink()
        return ckpt, "no model.safetensors"
    if kind == "bit-flipped":  # same size, same header: only the recorded sha256 tells
        data = bytearray(weights.read_bytes())
        data[-5] ^= 1
        weights.write_bytes(bytes(data))
        return weights, "damaged: sha256"
    if kind == "config":  # a config.json of another model: the shapes still fit, the context does not
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["max_position_embeddings"] = cfg["max_position_embeddings"] * 2
        (ckpt / "config.json").write_text(json.dumps(cfg))
        return ckpt / "config.json", "max_position_embeddings"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "missing", "bit-flipped", "config"])
def test_a_damaged_testbed_checkpoint_is_refused_naming_the_file(kind, smoke_testbed, tmp_path):
    copy = _copy(smoke_testbed, tmp_path)
    tb = open_testbed(copy)
    step = tb.train_steps
    records, identical = check_testbed_checkpoints([(f"step{step}", tb, step)])  # the intact copy passes
    assert records[f"step{step}"]["digest"] and identical == []
    path, fragment = _damage(copy, step, kind)
    with pytest.raises(CheckpointError) as e:
        check_testbed_checkpoints([(f"step{step}", open_testbed(copy), step)])
    msg = str(e.value)
    assert str(path) in msg and fragment in msg and "\n" not in msg, msg


def test_the_memorization_dial_checkpoint_is_checked(smoke_testbed, tmp_path):
    """The dial's checkpoint is checked before it is scored, built or reused: weights against the sha256 its
    memorize.json records, config against the testbed's, and refused when its weights equal the checkpoint it was
    trained from (the dial did nothing). The experiments got it from ``Testbed.memorize`` unchecked."""
    from mia.checkpoints import memorized_checkpoint

    copy = _copy(smoke_testbed, tmp_path)
    tb = open_testbed(copy)
    step = tb.train_steps
    rows = tb.default_memorize_rows(4, step=step)
    dial = memorized_checkpoint(tb, rows, 1, step=step, progress=False)
    assert json.loads((dial / "memorize.json").read_text())["weights_sha256"]
    assert memorized_checkpoint(tb, rows, 1, step=step, progress=False) == dial  # reused, and still passes
    weights, config = dial / "model.safetensors", dial / "config.json"
    good_weights, good_config = weights.read_bytes(), config.read_text()
    for kind in ("bit-flipped", "identical to its base", "config"):
        if kind == "bit-flipped":
            data = bytearray(good_weights)
            data[-5] ^= 1
            weights.write_bytes(bytes(data))
            named, fragment = weights, "damaged: sha256"
        elif kind == "identical to its base":
            shutil.copy(copy / "checkpoints" / f"step{step}" / "model.safetensors", weights)
            named, fragment = dial, "identical weights"
        else:
            cfg = json.loads(good_config)
            cfg["max_position_embeddings"] *= 2
            config.write_text(json.dumps(cfg))
            named, fragment = config, "max_position_embeddings"
        with pytest.raises(CheckpointError) as e:
            memorized_checkpoint(open_testbed(copy), rows, 1, step=step, progress=False)
        msg = str(e.value)
        assert str(named) in msg and fragment in msg and "\n" not in msg, (kind, msg)
        weights.write_bytes(good_weights)
        config.write_text(good_config)


def _argv(module: str, copy: Path, step: int, out: Path) -> list:
    common = ["--testbed", str(copy), "--steps", str(step), "--no-progress", "--out", str(out)]
    return {"checkmiabench": common + ["--attacks", "loss", "--no-blind", "--n-members", "10", "--n-train", "0",
                                       "--n-prefix", "0"],
            "em_mia": common,
            "camia": common,
            "checkmia": common + ["--preset", "smoke", "--attacks", "loss", "--no-blind"]}[module]


@pytest.mark.parametrize("module", [checkmiabench, em_mia, camia, checkmia], ids=lambda m: m.__name__.split(".")[-1])
def test_every_experiment_refuses_it_before_any_split(module, smoke_testbed, tmp_path, capsys):
    copy = _copy(smoke_testbed, tmp_path)
    step = open_testbed(copy).train_steps
    path, _ = _damage(copy, step, "truncated")
    out = tmp_path / "out"
    assert module.main(_argv(module.__name__.split(".")[-1], copy, step, out)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and str(path) in err[0], err
    written = sorted(p.name for p in out.rglob("*")) if out.exists() else []
    assert not [n for n in written if n.endswith(".jsonl")], written  # no split, pool or scores file
