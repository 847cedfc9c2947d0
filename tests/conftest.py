"""Shared fixtures: a tiny GPT-NeoX checkpoint with a real (tiny) BPE tokenizer, built once per session."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/hf_tiny.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CLI entry points called in-process must not write JAX's persistent compilation cache into the user's home;
# tests/test_compile_cache.py turns it on explicitly in subprocesses.
os.environ.setdefault("MIA_COMPILE_CACHE", "0")


def fast_compile_flags(flags: str, level: str) -> str:
    """``XLA_FLAGS`` for the default test run: LLVM's code generation at optimisation level 0 and XLA:CPU's legacy
    fusion emitters, unless ``level`` is "default" or the flags already set a level. XLA's graph passes (fusion,
    layouts, the dot emitters) still run. Level 0 cut the CPU time of the compile-bound parity file by about a
    quarter (119 -> 88 s); the legacy emitters then cut the whole run's XLA compile time from 272 to 106 s (summed
    over both workers, from JAX's compile events; the new MLIR emitters compile each fusion more slowly). Both move
    float32 token statistics only in their last bits (no multiply-add contraction: at most 2e-6 on the tiny
    families' log-probs, far inside every tolerance; comparisons within one run see one setting). Loops that run one
    program many times (the testbed's training step, the blind MLP's step) pin their own level. ``make test-all``
    runs at XLA's defaults (``MIA_TEST_XLA_OPT=default``), so the code users compile is tested too."""
    if level == "default" or "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false".strip()


def one_thread_per_worker(environ) -> None:
    """Under pytest-xdist with at least as many workers as cores (CI: ``-n 2`` on 2 cores), every runtime of a
    worker runs on one thread: XLA's CPU ops (``--xla_cpu_multi_thread_eigen=false``), torch's and OpenBLAS's
    OpenMP pools. Otherwise each worker's pools span every core, and threads spinning for work that is not there
    take the core from the other worker (the default run: 538 -> 518 s of CPU time, 279 -> 269 s wall). XLA's
    compiler, too, gets one thread: it no longer splits each program's LLVM module into parts for a thread pool
    (``--xla_cpu_parallel_codegen_split_count=1``; the parity and attention files' compile time: 16 -> 13 s). Set before
    numpy, torch or jax load (they read these once; xdist sets the worker count before it loads this file), and
    inherited by the subprocesses tests start. A reduction split over fewer threads may round differently in its
    last bits; every tolerance holds either way (``make test-all``, in one process, keeps the pools)."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not workers or workers < (os.cpu_count() or 1):
        return
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        environ.setdefault(name, "1")
    for flag in ("xla_cpu_multi_thread_eigen=false", "xla_cpu_parallel_codegen_split_count=1"):
        if flag.split("=")[0] not in environ.get("XLA_FLAGS", ""):
            environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} --{flag}".strip()


# before jax starts its backend (it reads XLA_FLAGS once); subprocesses started by tests inherit it
one_thread_per_worker(os.environ)
os.environ["XLA_FLAGS"] = fast_compile_flags(os.environ.get("XLA_FLAGS", ""), os.environ.get("MIA_TEST_XLA_OPT", ""))


def pytest_configure(config):
    """Every mia cache (scores, conditional LLs, file hashes, compiled programs:
    ``mia.files.hashing.default_cache_dir``) goes to a fresh directory for the session, never to the user's
    ``~/.cache/mia``. Set in ``os.environ`` so that subprocesses started by tests inherit it; removed at the end of
    the session.

    JAX's own persistent compilation cache (every program, however quick to compile) goes to one directory shared by
    the session's processes (both xdist workers and every subprocess a test starts): the same tiny model's programs
    compile once per session, not once per process. It changes no number (an entry is keyed by the program, its
    options and the jax version) and is removed at the end; mia's own switch (``MIA_COMPILE_CACHE``) stays off."""
    import tempfile

    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6 (see LONGEST_FIRST)
        config.option.loadscopereorder = False
    shared = getattr(config, "workerinput", {}).get("mia_xla_cache")
    config._mia_cache_dir = tempfile.mkdtemp(prefix="mia-test-cache-")
    os.environ["MIA_CACHE_DIR"] = config._mia_cache_dir
    config._mia_xla_cache = shared or tempfile.mkdtemp(prefix="mia-test-xla-")
    config._mia_xla_owner = shared is None
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config._mia_xla_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def cpu_identity() -> str:
    """One line naming this machine's CPU (vendor string, family/model, cores, widest vector unit): two machines that
    both call themselves "AMD EPYC" can differ by a CPU generation, and test-time figures mean nothing without it."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        import platform

        return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    flags = info.get("flags", "").split()
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no avx")
    family = f"family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    clock = f"{info.get('cpu MHz', '?')} MHz"
    return f"cpu: {info.get('model name', '?')} ({family}), {os.cpu_count()} cores, {vector}, {clock}"


def pytest_report_header(config):
    return cpu_identity()


def pytest_terminal_summary(terminalreporter):
    """The CPU line again at the end, where ``-q`` runs (CI's) show it beside the wall time."""
    terminalreporter.write_line(cpu_identity())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist) Each worker gets the controller's shared compilation cache directory."""
    node.workerinput["mia_xla_cache"] = node.config._mia_xla_cache


# The default run is `pytest -n 2 --dist loadfile`: each file goes whole to one of two workers, in collection order,
# as they free up (pytest_configure turns off xdist's own reordering by test count, which would otherwise start the
# files with the most tiny tests first and leave the long ones for the end). Started first, the longest files no
# longer finish the run alone on one worker. The first file builds the smoke suite (session fixture, under a file
# lock); the next ones need no suite, so the other worker has work meanwhile instead of waiting for the lock; the
# files that read the suite come after them (by then it is built). Order: summed test time per file, longest first.
LONGEST_FIRST = ("test_checkmiabench.py", "test_families_parity.py", "test_attacks_model.py", "test_doctor.py",
                 "test_blind.py", "test_testbed_audit.py", "test_camia.py", "test_scoring.py", "test_plan.py",
                 "test_em_mia_experiment.py", "test_camia_experiment.py", "test_testbed.py", "test_checkmia.py",
                 "test_suite.py", "test_attention.py", "test_splash.py", "test_cli_score.py")


def pytest_collection_modifyitems(config, items):
    """``LONGEST_FIRST`` files first, in that order; the others after, in their own order (stable: the order within
    a file is kept, and every worker collects the same order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))


def freeze_heap() -> None:
    """Collect this process's cyclic garbage, then move every surviving object out of the garbage collector's sight
    (``gc.freeze``). A worker holds 1.6-1.9 million objects by the end of the default run (jax, torch, transformers,
    compiled programs), and each of the ~33 full collections Python starts on its own walked all of them: 10-13 s
    per worker, plus 6 s at exit, where pytest collects five times to find unraisable exceptions. Called after
    collection and after each test file, a full collection walks only what the current file made. Frozen objects
    are still freed by reference counting; only a cycle that reaches back into them lives until the process ends."""
    import gc

    gc.collect()
    gc.freeze()


def fewer_collections() -> None:
    """Start a young-generation collection after 20,000 allocations instead of Python's 700: tracing a program
    allocates tens of thousands of short-lived containers, and at the default each worker ran about 9,000 young
    collections. Set when this file loads, before the test modules are imported: collecting them (jax, torch,
    transformers, 90 test files) took another 3 s of collections per worker at the default."""
    import gc

    gc.set_threshold(20_000, 10, 10)


fewer_collections()


def pytest_collection_finish(session):
    """Freeze the heap (``freeze_heap``) once the test modules are imported."""
    freeze_heap()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is None or nextitem.path != item.path:
        freeze_heap()


def pytest_unconfigure(config):
    import shutil

    for path, owned in ((getattr(config, "_mia_cache_dir", None), True),
                        (getattr(config, "_mia_xla_cache", None), getattr(config, "_mia_xla_owner", False))):
        if path and owned:
            shutil.rmtree(path, ignore_errors=True)


def build_tiny_tokenizer(path: Path, vocab_size: int = 320):
    """A byte-level BPE trained on a few stdlib sources (no download), saved as tokenizer.json."""
    import textwrap

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [Path(textwrap.__file__).read_text(), Path(json.__file__).read_text()]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    return fast


@pytest.fixture(scope="session")
def tiny_neox_dir(tmp_path_factory) -> Path:
    """Directory with config.json, model.safetensors and tokenizer.json of a 2-layer random GPT-NeoX."""
    from transformers import GPTNeoXConfig

    from hf_tiny import save_tiny

    path = tmp_path_factory.mktemp("tiny_neox")
    tok = build_tiny_tokenizer(path)
    cfg = GPTNeoXConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=False)
    save_tiny(cfg, path)
    return path


@pytest.fixture(scope="session")
def tiny_neox_torch(tiny_neox_dir):
    """The same checkpoint loaded by transformers' PyTorch GPT-NeoX (float32, eval): the independent reference that
    tests compare mia's Flax model and attacks against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_neox_dir), local_files_only=True).float().eval()


@pytest.fixture(scope="session")
def ref_logits(tiny_neox_torch):
    """seq -> [T, V] float64 logits of transformers' PyTorch model of the same checkpoint: the reference for every
    attack that reads the unperturbed model (nothing in it comes from mia's Flax model)."""
    from hf_tiny import torch_sequence_logits

    return lambda seq: torch_sequence_logits(tiny_neox_torch, seq)


@pytest.fixture(scope="session")
def tiny_model(tiny_neox_dir):
    import mia.models as mm

    return mm.load(tiny_neox_dir)


def shared_run_dir(tmp_path_factory) -> Path:
    """A directory shared by every process of this pytest run: under pytest-xdist, the run's base temporary
    directory that holds each worker's own (``pytest-N/popen-gwK`` -> ``pytest-N``), else this session's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def smoke_suite(tmp_path_factory):
    """The smoke suite (mia.testbed.suite): three sizes on the smoke preset's data order, built once per run
    (~40 s on 2 busy cores). Every experiment's smoke test runs on it.

    Under pytest-xdist the workers share one build: the first to ask builds it under a file lock in the run's shared
    directory, the others wait for the lock and reuse the built suite (``build_suite`` on a built suite retrains
    nothing). Tests read the shared suite and may add to it only what mia itself adds concurrently-safely (cache
    files, checkpoints re-created on demand, the memorization dial's checkpoints); a test that damages or changes a
    suite's files works on its own copy."""
    from filelock import FileLock

    from mia.testbed import build_suite

    root = shared_run_dir(tmp_path_factory) / "suite_smoke"
    with FileLock(str(root) + ".lock"):
        return build_suite("smoke", root, progress=False)


@pytest.fixture(scope="session")
def smoke_testbed(smoke_suite):
    """The smoke-preset testbed (mia.testbed): the smoke suite's middle member, whose config is the smoke preset's."""
    from mia.testbed import preset

    tb = next(m for m in smoke_suite.members if m.config.config_hash == preset("smoke").config_hash)
    return tb
