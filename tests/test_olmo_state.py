"""The OLMo order settings (batch size, instance length, first-step position) checked against what a checkpoint
directory states: allenai/OLMo's config.yaml and trainer state (train.pt), and a stepN-tokensX revision name.

The stand-ins are written as OLMo writes them: config.yaml as OmegaConf's block YAML of a TrainConfig (the fields
read here among others), train.pt as ``torch.save`` of a dict shaped like OLMo's ``Trainer.trainer_state_dict()``
(ints, a list of PosixPath checkpoints, python/numpy/torch RNG states)."""
import io
import pickle
import random
import zipfile
from pathlib import Path, PosixPath

import numpy as np
import pytest

from mia.checkpoints import olmo_order_settings
from mia.checkpoints import CheckpointError
from mia.data.olmo_state import OlmoStateError, check_order, checkpoint_facts, read_config_yaml, read_trainer_state

torch = pytest.importorskip("torch")


def write_config_yaml(d: Path, batch: int = 2160, seq_len: int = 2048) -> Path:
    """A TrainConfig's config.yaml as OmegaConf saves it (abridged; nested blocks, lists, nulls, quoted strings)."""
    d.mkdir(parents=True, exist_ok=True)
    text = f"""run_name: OLMo-7B
seed: 6198
epoch: null
dry_run: false
model:
  d_model: 4096
  n_heads: 32
  n_layers: 32
  mlp_ratio: 4
  max_sequence_length: {seq_len}
  vocab_size: 50280
  embedding_size: 50304
  eos_token_id: 50279
  pad_token_id: 1
optimizer:
  name: adamw
  learning_rate: 0.0003
data:
  paths:
  - s3://ai2-llm/preprocessed/part-0-00000.npy
  - s3://ai2-llm/preprocessed/part-0-00001.npy
  drop_last: true
  num_workers: 0
tokenizer:
  identifier: 'tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json'
save_folder: runs/OLMo-7B
global_train_batch_size: {batch}
device_train_batch_size: 8
device_train_microbatch_size: 2
max_duration: 2e12T
"""
    (d / "config.yaml").write_text(text)
    return d / "config.yaml"


def write_trainer_state(d: Path, step: int, examples_seen: int, epoch: int = 0, rel: str = "train.pt") -> Path:
    """``torch.save`` of a dict shaped like OLMo's ``trainer_state_dict()``."""
    path = d / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"epoch": epoch, "global_step": step, "global_train_examples_seen_this_epoch": examples_seen,
             "global_train_tokens_seen": examples_seen * 2048, "world_size": 8,
             "checkpoints": [PosixPath(f"runs/OLMo-7B/step{step}")], "unsharded_checkpoints": [],
             "ephemeral_checkpoints": [],
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state(),
                     "cuda": None, "mps": None}}
    torch.save(state, path)
    return path


# ------------------------------------------------------------------------------------------------ readers
def test_config_yaml_reader_takes_the_two_fields(tmp_path):
    f = write_config_yaml(tmp_path, batch=2048, seq_len=4096)
    assert read_config_yaml(f) == {"global_train_batch_size": 2048, "max_sequence_length": 4096}
    f.write_text(f.read_text().replace("global_train_batch_size: 2048", "global_train_batch_size: big"))
    with pytest.raises(OlmoStateError, match=r"config\.yaml:\d+: global_train_batch_size is 'big'"):
        read_config_yaml(f)


@pytest.mark.parametrize("rel", ["train.pt", "train/rank0.pt"])  # unsharded and sharded saves
def test_trainer_state_reader_keeps_the_integers(tmp_path, rel):
    write_trainer_state(tmp_path, 400000, 400000 * 2160, rel=rel)
    state = read_trainer_state(tmp_path / rel)
    assert state == {"epoch": 0, "global_step": 400000, "global_train_examples_seen_this_epoch": 864000000}
    facts = {f.field: f.value for f in checkpoint_facts(tmp_path)}
    assert facts["global_step"] == 400000


def test_trainer_state_pickle_runs_nothing(tmp_path):
    """A trainer state whose pickle calls functions (here: one that would delete a file, one that would write one) is
    read without calling them: every global becomes an inert placeholder."""
    import os

    victim, marker = tmp_path / "keep", tmp_path / "ran"
    victim.write_text("x")

    class Evil:
        def __reduce__(self):
            return (os.remove, (str(victim),))

    class Evil2:
        def __reduce__(self):
            return (Path.touch, (marker,))

    buf = io.BytesIO()
    pickle.dump({"global_step": 3, "epoch": 0, "payload": Evil(), "more": Evil2()}, buf, protocol=2)
    with zipfile.ZipFile(tmp_path / "train.pt", "w") as zf:
        zf.writestr("archive/data.pkl", buf.getvalue())
    assert read_trainer_state(tmp_path / "train.pt") == {"global_step": 3, "epoch": 0}
    assert victim.exists() and not marker.exists()


def test_damaged_trainer_state_is_one_line_naming_it(tmp_path):
    p = write_trainer_state(tmp_path, 10, 10 * 4)
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(OlmoStateError, match="train.pt"):
        read_trainer_state(p)


# ------------------------------------------------------------------------------------------------ the check
def test_matching_settings_are_checked_and_recorded(tmp_path):
    d = tmp_path / "step400000-tokens1769B"
    write_config_yaml(d)
    write_trainer_state(d, 400000, 400000 * 2160)
    b, L, record, note = olmo_order_settings({400000: d})
    assert (b, L, note) == (2160, 2048, None)
    assert record["batch_size_from"] == str(d / "config.yaml")
    assert record["checked"]["step400000"] == ["batch size (config.yaml)", "instance length (config.yaml)",
                                              "step (trainer state)", "first-step position (trainer state)",
                                              "tokens in the name"]


def test_batch_size_mismatch_names_both_values_and_the_file(tmp_path):
    d = tmp_path / "ckpt"
    write_config_yaml(d, batch=2048)
    with pytest.raises(CheckpointError) as e:
        olmo_order_settings({400000: d}, batch_size=2160)
    msg = str(e.value)
    assert "--batch-size 2160" in msg and "global_train_batch_size 2048" in msg and str(d / "config.yaml") in msg
    assert "\n" not in msg
    assert olmo_order_settings({400000: d})[0] == 2048  # not given: the config's


def test_seq_len_mismatch_is_refused(tmp_path):
    write_config_yaml(tmp_path / "c", seq_len=4096)
    with pytest.raises(CheckpointError, match="--seq-len 2048 does not match model.max_sequence_length 4096"):
        olmo_order_settings({10: tmp_path / "c"}, seq_len=2048)


def test_step_mismatch_is_refused(tmp_path):
    write_trainer_state(tmp_path, 399000, 399000 * 2160)
    with pytest.raises(CheckpointError, match=r"--steps 400000 does not match global_step 399000 in .*train\.pt"):
        olmo_order_settings({400000: tmp_path})


def test_first_step_position_mismatch_is_refused(tmp_path):
    """A run that started one batch into the order (or fast-forwarded) has seen (s + 1) * B examples at step s."""
    write_trainer_state(tmp_path, 1000, 1001 * 2160)
    with pytest.raises(CheckpointError, match="the first step does not start at position 0"):
        olmo_order_settings({1000: tmp_path}, batch_size=2160)
    write_trainer_state(tmp_path, 1000, 1000 * 2048)  # the other batch size: the implied one is said
    with pytest.raises(CheckpointError, match=r"2048000 / 1000 = batch 2048"):
        olmo_order_settings({1000: tmp_path}, batch_size=2160)


def test_a_later_epoch_is_refused(tmp_path):
    write_trainer_state(tmp_path, 500000, 10 * 2160, epoch=1)
    with pytest.raises(CheckpointError, match="epoch 1"):
        olmo_order_settings({500000: tmp_path})


def test_revision_name_tokens_check_the_batch_size(tmp_path):
    """allenai/OLMo-7B's revision names carry s * B * L in billions: 2160 fits step400000-tokens1769B, 2048 not."""
    d = tmp_path / "step400000-tokens1769B"
    d.mkdir()
    b, _, record, note = olmo_order_settings({400000: d})
    assert b == 2160 and record["checked"]["step400000"] == ["tokens in the name"]
    assert "first step at position 0 assumed, not checked" in note and "batch size" not in note.split("assumed")[0]
    with pytest.raises(CheckpointError, match=r"step400000-tokens1769B: the name says 1769B tokens, but step 400000 x "
                                              r"--batch-size 2048 x --seq-len 2048 = 1677\.7B"):
        olmo_order_settings({400000: d}, batch_size=2048)


def test_nothing_to_check_against_is_said_once(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    b, L, record, note = olmo_order_settings({100: d, 200: d})
    assert (b, L) == (2160, 2048) and record["batch_size_from"] == "default (OLMo-7B)"
    assert note == ("OLMo order: batch size 2160 and the first step at position 0 assumed, not checked (no "
                    "config.yaml, trainer state (train.pt) or stepN-tokensX name in the checkpoint directory)")
    assert record["unchecked"] == note


def test_check_order_with_nothing_stated_checks_nothing():
    assert check_order([], 5, 4, 8) == []


# ------------------------------------------------------------------------------------------------ in the experiments
def _olmo_dir(tmp_path: Path, tiny_neox_dir, name: str = "step20") -> tuple:
    """A checkpoint folder ``olmo/<name>`` (the tiny model) and a small OLMo order (files that exist)."""
    import shutil

    ckpt = tmp_path / "olmo" / name
    shutil.copytree(tiny_neox_dir, ckpt)
    gi = tmp_path / "global_indices.npy"
    np.arange(40 * 4, dtype=np.uint32).tofile(gi)
    tok = tmp_path / "part-0.npy"
    np.ones(40 * 4 * 64, np.uint16).tofile(tok)
    (tmp_path / "paths.txt").write_text(f"{tok}\n")
    return ckpt, gi, tmp_path / "paths.txt"


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_checkmiabench_refuses_a_batch_size_the_config_contradicts_before_any_split(tmp_path, tiny_neox_dir, capsys):
    from experiments import checkmiabench as cmb

    ckpt, gi, paths = _olmo_dir(tmp_path, tiny_neox_dir)
    write_config_yaml(ckpt, batch=8, seq_len=64)
    out = tmp_path / "o"
    argv = ["--olmo", str(tmp_path / "olmo"), "--global-indices", str(gi), "--data-paths", str(paths), "--steps",
            "20", "--seq-len", "64", "--attacks", "loss", "--no-blind", "--no-progress", "--out", str(out)]
    assert cmb.main(argv + ["--batch-size", "4"]) == 2
    e = _one_error(capsys)
    assert "--batch-size 4" in e and "global_train_batch_size 8" in e and str(ckpt / "config.yaml") in e
    assert not (out / "splits").exists()
    write_trainer_state(ckpt, 20, 21 * 8)  # config.yaml's batch, but one batch further on than step 20 x 8
    assert cmb.main(argv) == 2
    assert "the first step does not start at position 0" in _one_error(capsys)
    assert not (out / "splits").exists()


def test_em_mia_refuses_a_step_the_trainer_state_contradicts_before_the_pool(tmp_path, tiny_neox_dir, capsys):
    from experiments import em_mia

    ckpt, gi, paths = _olmo_dir(tmp_path, tiny_neox_dir)
    write_trainer_state(ckpt, 19, 19 * 4)
    out = tmp_path / "o"
    argv = ["--olmo", str(ckpt), "--global-indices", str(gi), "--data-paths", str(paths), "--seq-len", "64",
            "--batch-size", "4", "--member-steps", "0:10", "--nonmember-steps", "30:40", "--steps", "20",
            "--out", str(out), "--no-progress"]
    assert em_mia.main(argv) == 2
    e = _one_error(capsys)
    assert "--steps 20 does not match global_step 19" in e and str(ckpt / "train.pt") in e
    assert not (out / "splits" / "pool.jsonl").exists()
