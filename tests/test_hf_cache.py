"""Models from the Hugging Face cache (``ORG/NAME@REVISION``), resolved offline (``mia.models.hf_cache``).

The cache is built here the way huggingface_hub lays it out: ``models--ORG--NAME/blobs/<hash>`` holding the file
bytes, ``snapshots/<commit>/<file>`` relative links into blobs, ``refs/<branch>`` the commit of a branch.
"""
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

import mia.models as mm
from mia.models import hf_cache
from mia.models.hub import CheckpointError, read_safetensors, write_safetensors

MAIN = "a" * 8 + hashlib.sha1(b"main").hexdigest()[8:]
STEP = "b" * 8 + hashlib.sha1(b"step100").hexdigest()[8:]
TWIN = "b" * 8 + hashlib.sha1(b"twin").hexdigest()[8:]  # shares an 8-digit prefix with STEP


def _add_snapshot(repo: Path, commit: str, files: Path, refs=()):
    """Copy the files of ``files`` into blobs/ and link them from snapshots/<commit>/, as huggingface_hub does."""
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)


def _perturbed_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = {k: np.array(v) + np.float32(0.01) for k, v in read_safetensors(src / "model.safetensors").items()}
    (dst / "model.safetensors").unlink()
    write_safetensors(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def hub_cache(tiny_neox_dir, tmp_path_factory):
    """A hub cache holding org/tiny at main (= tiny_neox_dir), step100 (other weights), a third snapshot with no
    ref whose hash shares STEP's first 8 digits, and a branch whose snapshot is missing."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--org--tiny"
    other = _perturbed_copy(tiny_neox_dir, tmp_path_factory.mktemp("step100") / "m")
    _add_snapshot(repo, MAIN, tiny_neox_dir, refs=["main"])
    _add_snapshot(repo, STEP, other, refs=["step100", "refs/pr/1"])
    _add_snapshot(repo, TWIN, other)
    (repo / "refs" / "broken").write_text("c" * 40)
    (root / "models--someone--else").mkdir()
    return root


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection or hub download during the test fails it."""
    def refuse(*a, **k):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    import huggingface_hub
    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, refuse)


@pytest.fixture
def in_cache(hub_cache, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def _leaves(model):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(model.params)]


def test_revision_by_branch_commit_and_short_commit(in_cache, tiny_neox_dir):
    main = mm.load("org/tiny", tokenizer=False)
    assert Path(main.path) == in_cache / "models--org--tiny" / "snapshots" / MAIN
    step = mm.load("org/tiny@step100", tokenizer=False)
    assert Path(step.path).name == STEP
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(main), _leaves(mm.load(tiny_neox_dir, tokenizer=False))))
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(main), _leaves(step)))
    assert hf_cache.model_dir(f"org/tiny@{STEP}") == hf_cache.model_dir("org/tiny@step100")
    assert hf_cache.model_dir(f"org/tiny@{MAIN[:7]}").name == MAIN
    assert hf_cache.model_dir("org/tiny@refs/pr/1").name == STEP
    assert main.fingerprint == mm.hub.fingerprint(tiny_neox_dir)  # same bytes, same content address


def test_tokenizer_and_config_through_the_cache(in_cache, tiny_neox_dir):
    model = mm.load("org/tiny@main")
    ref = mm.load(tiny_neox_dir)
    assert model.tokenizer("def f(x): pass")["input_ids"] == ref.tokenizer("def f(x): pass")["input_ids"]
    fam, cfg, _ = mm.load_config("org/tiny@step100")
    assert cfg == ref.config


@pytest.mark.parametrize("ref, expect", [
    ("org/tiny@step999", ["revision 'step999' is not in the Hugging Face cache", "main (aaaaaaa)", "step100 (bbbbbbb)",
                          "refs/pr/1 (bbbbbbb)", TWIN[:12]]),
    ("org/tiny@bbbbbbbb", ["commit prefix 'bbbbbbbb' matches 2 snapshots"]),
    ("org/tiny@broken", ["refs/broken points to commit 'cccc", "no snapshot"]),
    ("org/tiny@../../etc", ["is not a branch, tag or commit name"]),
    ("org/absent@main", ["no local directory of that name", "not in the Hugging Face cache", "no models--org--absent/",
                         "org/tiny", "someone/else", "huggingface-cli download org/absent --revision main"]),
])
def test_missing_revisions_are_one_error_listing_what_is_there(in_cache, ref, expect):
    with pytest.raises(CheckpointError) as e:
        mm.load(ref)
    msg = str(e.value)
    assert "\n" not in msg
    for part in expect:
        assert part in msg, (part, msg)


def test_cli_score_with_a_cache_reference(in_cache, tmp_path):
    from mia.cli import main

    data = tmp_path / "d.jsonl"
    texts = ["def f(x):\n    return x\n", "import json\n", "for i in x: pass\n"]
    data.write_text("".join(json.dumps({"id": i, "text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "o.jsonl"
    assert main(["score", "--model", "org/tiny@step100", "--data", str(data), "--attacks", "loss", "--out", str(out),
                 "--no-cache", "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 3


def test_a_local_directory_wins_over_the_cache(in_cache, tiny_neox_dir, tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    shutil.copytree(tiny_neox_dir, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert hf_cache.model_dir("org/tiny") == Path("org/tiny")


def test_cache_location_follows_huggingface_hub(monkeypatch, tmp_path):
    for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_cache.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hf_cache.hub_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hf_cache.hub_cache_dir() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", "~/hubcache")
    assert hf_cache.hub_cache_dir() == tmp_path / "home" / "hubcache"


def test_hf_home_cache_is_used_by_load(hub_cache, monkeypatch, no_network, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    (tmp_path / "hfhome").mkdir()
    (tmp_path / "hfhome" / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert Path(mm.load("org/tiny@step100", tokenizer=False).path).name == STEP


@pytest.mark.parametrize("text, ref", [
    ("EleutherAI/pythia-70m-deduped@step1000", ("EleutherAI/pythia-70m-deduped", "step1000")),
    ("allenai/OLMo-7B@step1000-tokens4B", ("allenai/OLMo-7B", "step1000-tokens4B")),
    ("gpt2", ("gpt2", None)),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ("/abs/path", None), ("./rel", None), ("a/b/c", None), ("cfg.json", None), ("org/x@", None), ("", None),
])
def test_parse_ref(text, ref):
    got = hf_cache.parse_ref(text)
    assert (got if got is None else (got.repo_id, got.revision)) == ref


def test_revisions_listing(hub_cache):
    revs = hf_cache.revisions(hub_cache / "models--org--tiny")
    assert {k: v.name for k, v in revs.items() if not k.startswith(("a", "b"))} == {
        "main": MAIN, "step100": STEP, "refs/pr/1": STEP}  # "broken" has no snapshot
    assert {MAIN, STEP, TWIN} <= set(revs)
    assert hf_cache.cached_repos(hub_cache) == ["org/tiny", "someone/else"]


# ----------------------------------------------------------------------------------------------- --pythia discovery
@pytest.fixture(scope="module")
def pythia_cache(tiny_neox_dir, tmp_path_factory):
    """EleutherAI/pythia-70m-deduped at step100 and step200, pythia-160m-deduped at step100, one more repo."""
    root = tmp_path_factory.mktemp("pythia_hub")
    small = root / "models--EleutherAI--pythia-70m-deduped"
    _add_snapshot(small, MAIN, tiny_neox_dir, refs=["main", "step200"])
    _add_snapshot(small, STEP, tiny_neox_dir, refs=["step100"])
    _add_snapshot(root / "models--EleutherAI--pythia-160m-deduped", TWIN, tiny_neox_dir, refs=["step100"])
    _add_snapshot(root / "models--org--tiny", MAIN, tiny_neox_dir, refs=["step100"])
    return root


def test_pythia_checkpoints_are_discovered_in_the_hub_cache(pythia_cache):
    from mia.checkpoints import CheckpointError, pythia_checkpoint, pythia_checkpoints, select_pythia

    found = pythia_checkpoints(pythia_cache)
    assert {size: {s: p.name for s, p in steps.items()} for size, steps in found.items()} == {
        "70m": {100: STEP, 200: MAIN}, "160m": {100: TWIN}}
    assert list(select_pythia(pythia_cache, None, [100])) == ["70m", "160m"]
    assert pythia_checkpoint(pythia_cache, "70m", 200) == pythia_cache / "models--EleutherAI--pythia-70m-deduped" / \
        "snapshots" / MAIN
    with pytest.raises(CheckpointError, match="no checkpoint pythia-160m-deduped/step200.*70m-deduped: steps 100, 200"):
        pythia_checkpoint(pythia_cache, "160m", 200)


@pytest.mark.slow
def test_checkmiabench_pythia_from_the_hub_cache(tiny_neox_dir, tmp_path, no_network):
    """The CheckMIABench Pythia recipe with ``--pythia`` pointing at a hub cache (as huggingface-cli fills it)."""
    import transformers

    from experiments import checkmiabench as cmb

    from order_files import LAYOUT_B as B, LAYOUT_END as END, LAYOUT_STEP as STEP_N, pythia_layout

    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir)))
    _, shards, idx, _ = pythia_layout(tmp_path, tiny_neox_dir, vocab)
    cache = tmp_path / "hub"
    _add_snapshot(cache / "models--EleutherAI--pythia-70m-deduped", STEP, tiny_neox_dir, refs=[f"step{STEP_N}"])
    out = tmp_path / "out"
    assert cmb.main(["--pythia", str(cache), "--data", *shards, "--idx", idx, "--steps", str(STEP_N),
                     "--batch-size", str(B), "--end-step", str(END), "--n-members", "10", "--n-train", "10",
                     "--n-prefix", "0", "--attacks", "loss", "--no-blind", "--bootstrap", "20", "--no-progress",
                     "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert [t["model"] for t in s["targets"]] == ["70m"]


def test_olmo_checkpoint_from_a_cached_repository(tiny_neox_dir, tmp_path):
    from mia.checkpoints import CheckpointError, olmo_checkpoint

    repo = tmp_path / "models--allenai--OLMo-7B"
    _add_snapshot(repo, MAIN, tiny_neox_dir, refs=["main", "step1000-tokens4B"])
    _add_snapshot(repo, STEP, tiny_neox_dir, refs=["step2000-tokens9B"])
    assert olmo_checkpoint(repo, 2000) == repo / "snapshots" / STEP
    assert olmo_checkpoint(repo, 1000) == repo / "snapshots" / MAIN
    with pytest.raises(CheckpointError, match="no checkpoint at step 3000.*step1000, step2000"):
        olmo_checkpoint(repo, 3000)
