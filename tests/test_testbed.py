"""The testbed: corpus, tokenizer, packing, training order, checkpoints, resume, memorization dial."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mia.data.corpus import CorpusError, load_corpus, stdlib_files


# ----------------------------------------------------------------------------------------------- corpus
def test_stdlib_corpus_is_deterministic_and_library_only():
    a = load_corpus(max_bytes=200_000)
    b = load_corpus(max_bytes=200_000)
    assert a.sha256 == b.sha256 and len(a) > 1
    paths = [d.path for d in a.documents]
    assert paths == sorted(paths)
    files = stdlib_files()
    assert not any(part in ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo")
                   for f in files for part in f.split("/")[:-1])
    m = a.manifest()
    assert m["n_documents"] == len(a) and len(m["documents"][0]["sha256"]) == 64


def test_directory_and_jsonl_corpora(tmp_path, monkeypatch):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_text("# title\nbody\n")
    (d / "sub" / "a.txt").write_text("hello world\n")
    (d / "skip.bin").write_bytes(b"\x00\x01")
    c = load_corpus(d)
    assert [x.path for x in c.documents] == ["b.md", "sub/a.txt"]
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(3)))
    import datasets

    hf_cache = tmp_path / "hf-datasets-cache"  # datasets' default cache: the corpus reader must not write there
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache)
    c2 = load_corpus(f, text_column="body")
    assert c2.texts == ["doc 0", "doc 1", "doc 2"]
    assert not hf_cache.exists() or not any(hf_cache.iterdir())
    with pytest.raises(CorpusError, match="no column 'text'.*body"):
        load_corpus(f)


def test_corpus_errors(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(empty)
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(tmp_path / "missing")
    (empty / "a.txt").write_text("x")
    real = Path.read_bytes

    def deny(self):
        if self.name == "a.txt":
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(CorpusError, match="a.txt: cannot read"):
        load_corpus(empty)


# ----------------------------------------------------------------------------------------------- testbed
def test_tokenizer_loads_with_autotokenizer(smoke_testbed):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smoke_testbed.root), local_files_only=True)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0 and tok.eos_token_id == 0
    assert len(tok) == smoke_testbed.manifest["tokenizer"]["vocab_size"] <= smoke_testbed.config.vocab_size
    ids = tok("def f(x):\n    return x\n", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "def f(x):\n    return x\n"


def test_order_is_packed_pythia_style(smoke_testbed):
    tb = smoke_testbed
    ds = tb.dataset()
    assert len(ds) == tb.n_rows and ds.uniform_row_len() == tb.config.seq_len + 1
    perm = np.load(tb.data_prefix.with_name("order.perm.npy"))
    assert sorted(perm.tolist()) == list(range(tb.n_rows))
    # un-permuting gives the EOD-joined stream of the documents in corpus order
    from mia.data.corpus import load_corpus
    from mia.testbed.tokenizer import encode_documents

    rows = ds.get_rows(np.argsort(perm)[:20]).reshape(-1)
    corpus = load_corpus(None, max_bytes=tb.config.max_corpus_bytes)
    docs = encode_documents(tb.tokenizer(), corpus.texts[:3])
    stream = np.concatenate([np.r_[d, 0] for d in docs])[: len(rows)]
    np.testing.assert_array_equal(rows[: len(stream)], stream)
    m = json.loads((tb.root / "testbed.json").read_text())
    assert m["complete"] and m["data"]["epoch_steps"] == tb.n_rows // tb.batch_size
    assert (tb.root / "loss.png").stat().st_size > 0
    log = [json.loads(l) for l in (tb.root / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, tb.train_steps + 1))
    assert log[-1]["loss"] < log[0]["loss"] - 0.5


def test_checkpoints_load_in_transformers_with_same_logits(smoke_testbed):
    import torch
    from transformers import AutoModelForCausalLM

    tb = smoke_testbed
    assert tb.steps == [0, 50, 100]
    tokens = np.asarray(tb.dataset().get_rows([0, 1, 2]), np.int64)[:, :40]
    for step in (0, tb.train_steps):
        ours = tb.load_model(step)
        got = np.asarray(ours.logits(ours.params, tokens.astype(np.int32)))
        ref = AutoModelForCausalLM.from_pretrained(str(tb.checkpoint_dir(step))).float().eval()
        with torch.no_grad():
            want = ref(torch.tensor(tokens)).logits.numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_checkpoint_has_trained_on_rows_in_order(smoke_testbed):
    """step1 (re-created on demand from step0) == one AdamW step on rows [0, B) from step0."""
    import jax

    from mia.models import load
    from mia.testbed.train import make_optimizer, make_train_step

    tb = smoke_testbed
    p1 = tb.checkpoint_dir(1)  # not saved by the run: trained from step0 and saved now
    m0 = load(tb.checkpoint_dir(0))
    opt = make_optimizer(tb.config)
    params, _, _ = make_train_step(m0, opt)(m0.params, opt.init(m0.params),
                                            np.asarray(tb.dataset()[0:tb.batch_size], np.int32))
    m1 = load(p1)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(m1.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the run's log was not rewritten by re-creating an intermediate checkpoint
    assert len((tb.root / "train_log.jsonl").read_text().splitlines()) == tb.train_steps


def test_a_checkpoint_placed_first_by_another_process_is_kept(smoke_testbed, tmp_path, monkeypatch):
    """Two processes re-creating the same checkpoint, or the same dial checkpoint, of one testbed: the copy placed
    first stays (never removed under its readers), the later one is dropped and no temporary is left; a stale
    directory of another run at that step is still replaced."""
    import shutil

    from mia.models import load
    from mia.testbed import build, open_testbed
    from mia.testbed.train import make_optimizer, save_checkpoint

    root = tmp_path / "tb"
    m0 = load(smoke_testbed.checkpoint_dir(0))
    opt_state = make_optimizer(smoke_testbed.config).init(m0.params)
    h = smoke_testbed.config.config_hash
    first = save_checkpoint(m0, m0.params, opt_state, 0, root, h)
    ino = (first / "model.safetensors").stat().st_ino
    assert save_checkpoint(m0, m0.params, opt_state, 0, root, h) == first
    assert (first / "model.safetensors").stat().st_ino == ino
    assert [p.name for p in (root / "checkpoints").iterdir()] == ["step0"]
    stale = save_checkpoint(m0, m0.params, opt_state, 0, root, "another-run")
    assert (stale / "model.safetensors").stat().st_ino != ino

    # the dial: while this process trains, "another process" places the same dial checkpoint first
    copy = Path(shutil.copytree(smoke_testbed.root, tmp_path / "copy",
                                ignore=shutil.ignore_patterns("*-mem*", "cache", ".*.tmp")))
    tb = open_testbed(copy)
    calls = []

    def other_process_first(base, params, cfg, rows, epochs, **kw):
        calls.append(len(calls))
        if len(calls) == 1:
            placed.append(tb.memorize([0], 1, progress=False))
        return params, []

    placed = []
    monkeypatch.setattr(build, "run_memorize", other_process_first)
    path = tb.memorize([0], 1, progress=False)
    assert calls == [0, 1] and placed == [path]
    assert (path / "memorize.json").exists()
    assert not [p.name for p in (copy / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_the_dial_traces_its_training_step_once(smoke_suite, monkeypatch):
    """``memorize`` from a loaded checkpoint (params placed on the engine's mesh) traces its step once for all its
    steps (the loss is called once per trace): the first call's inputs are typed as its outputs will be."""
    from mia.models import load
    from mia.testbed import train

    traced, row_loss = [], train.row_loss
    monkeypatch.setattr(train, "row_loss", lambda *a: traced.append(1) or row_loss(*a))
    tb = min(smoke_suite.members, key=lambda m: m.config.hidden_size)  # the smallest: the quickest to compile
    base = load(tb.checkpoint_dir(tb.train_steps), tokenizer=False)
    rows = tb.dataset().get_rows(np.arange(3 * tb.batch_size // 2))  # 2 steps an epoch
    params, log = train.memorize(base, base.params, tb.config, rows, epochs=2, progress=False)
    assert len(log) == 2 and len(traced) == 1


def test_reuse_does_not_retrain(smoke_testbed):
    from mia.testbed import TestbedError, build_testbed

    before = (smoke_testbed.root / "train_log.jsonl").stat().st_mtime_ns
    tb = build_testbed("smoke", smoke_testbed.root, progress=False)
    assert tb.config.config_hash == smoke_testbed.config.config_hash
    assert (smoke_testbed.root / "train_log.jsonl").stat().st_mtime_ns == before
    with pytest.raises(TestbedError, match="another config.*train_steps"):
        build_testbed("smoke", smoke_testbed.root, progress=False, train_steps=70)


@pytest.mark.parametrize("damage", ["order-bit-flipped", "tokenizer-emptied"])
def test_damaged_data_files_are_refused(damage, smoke_testbed, tmp_path, capsys):
    """One bit flipped in data/order.bin (same size), or tokenizer.json emptied: opening the testbed, building over
    it again and the CLI refuse it in one line naming the file with the recorded and actual sha256 prefixes,
    instead of reporting it done (nothing is retrained)."""
    import shutil

    from mia.testbed import TestbedError, build_testbed, open_testbed
    from mia.testbed.__main__ import main

    # the session's testbed is shared with other test processes, which may be adding dial checkpoints and score
    # caches to it meanwhile: those (and their temporaries) are not copied
    copy = Path(shutil.copytree(smoke_testbed.root, tmp_path / "tb",
                                ignore=shutil.ignore_patterns("*-mem*", "cache", ".*.tmp")))
    open_testbed(copy)  # the intact copy opens
    rel = "data/order.bin" if damage == "order-bit-flipped" else "tokenizer.json"
    m = json.loads((copy / "testbed.json").read_text())
    want = (m["data"]["bin"] if rel == "data/order.bin" else m["tokenizer"])["sha256"][:12]
    if damage == "order-bit-flipped":
        data = bytearray((copy / rel).read_bytes())
        data[len(data) // 2] ^= 1
        (copy / rel).write_bytes(bytes(data))
    else:
        (copy / rel).write_text("")
    pattern = rf"{copy / rel}: damaged: sha256 [0-9a-f]{{12}}, testbed.json records {want}; .*delete it"
    with pytest.raises(TestbedError, match=pattern):
        open_testbed(copy)
    log = (copy / "train_log.jsonl").stat().st_mtime_ns
    with pytest.raises(TestbedError, match=pattern):
        build_testbed("smoke", copy, progress=False)
    capsys.readouterr()
    assert main(["--preset", "smoke", "--out", str(copy), "--no-progress"]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("error:") and str(copy / rel) in err[0] and "damaged" in err[0], err
    assert (copy / "train_log.jsonl").stat().st_mtime_ns == log  # nothing retrained


def test_resume_equals_uninterrupted(tmp_path):
    from mia.models.hub import read_safetensors
    from mia.testbed import build_testbed

    kw = dict(progress=False, save_every=3, max_corpus_bytes=120_000, train_steps=10, checkpoints=(4,),
              warmup_steps=2)
    full = build_testbed("smoke", tmp_path / "a", **kw)
    part = build_testbed("smoke", tmp_path / "b", stop_after=7, **kw)  # "interrupted" after step 7
    assert not json.loads((part.root / "testbed.json").read_text())["complete"]
    log = (part.root / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 7
    resumed = build_testbed("smoke", tmp_path / "b", **kw)  # resumes from the resume state at step 6
    assert json.loads((resumed.root / "testbed.json").read_text())["complete"]
    for step in (4, 10):
        a = read_safetensors(full.checkpoint_dir(step) / "model.safetensors")
        b = read_safetensors(resumed.checkpoint_dir(step) / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        sa = read_safetensors(full.checkpoint_dir(step) / "train_state.safetensors")
        sb = read_safetensors(resumed.checkpoint_dir(step) / "train_state.safetensors")
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    la = [json.loads(l)["loss"] for l in (full.root / "train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(l)["loss"] for l in (resumed.root / "train_log.jsonl").read_text().splitlines()]
    assert la == lb


@pytest.mark.slow  # (15 s) the default run keeps the dial on a suite member (test_checkmiabench)
def test_memorization_dial_gives_real_signal(smoke_testbed, tmp_path):
    from experiments.checkmia import draw_split
    from mia.attacks.loss import loss
    from mia.metrics import auc
    from mia.models import load
    from mia.engine.batching import ScoringSettings
    from mia.engine.loop import compute_token_stats
    from mia.engine.stats import pad_stats

    tb = smoke_testbed
    c = tb.train_steps
    header, ex = draw_split(tb, c, 100, 100, 0, 0, 0, seed=1)
    members = [e["index"] for e in ex if e["label"] == 1]
    path = tb.memorize(members, epochs=8, step=c, seed=1, progress=False)
    assert path.name.startswith(f"step{c}-mem8-") and (path / "memorize.json").exists()
    assert tb.memorize(members, epochs=8, step=c, seed=1, progress=False) == path  # reused
    y = np.array([e["label"] for e in ex])
    toks = [np.asarray(e["tokens"], np.int32) for e in ex]
    settings = ScoringSettings(progress=False)
    res = {}
    for name, d in (("clean", tb.checkpoint_dir(c)), ("dial", path)):
        p = pad_stats(compute_token_stats(load(d), toks, settings))
        res[name] = auc(np.asarray(loss(p["logprob"], np.zeros_like(p["mask"]), p["mask"])), y)
    assert res["dial"] >= 0.8, res
    assert res["dial"] > res["clean"]
    from mia.testbed import TestbedError

    with pytest.raises(TestbedError, match="must be members"):
        tb.memorize([c * tb.batch_size], epochs=1, step=c)


def test_bad_inputs(tmp_path):
    from mia.data.corpus import CorpusError
    from mia.testbed import TestbedError, build_testbed

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="empty"):
        build_testbed("smoke", tmp_path / "t1", corpus=str(empty), progress=False)
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    with pytest.raises(TestbedError, match=r"corpus too small: 1 documents made \d+ rows of 65 tokens, but 100 steps x "
                                           r"batch 16 need 1600 rows"):
        build_testbed("smoke", tmp_path / "t2", corpus=str(small), progress=False)
    with pytest.raises(TestbedError, match="unknown preset 'nope'; presets: smoke, default, audit, large"):
        build_testbed("nope", tmp_path / "t3")


def test_cli_one_line_error(tmp_path, capsys):
    from mia.testbed.__main__ import main

    empty = tmp_path / "e"
    empty.mkdir()
    assert main(["--preset", "smoke", "--out", str(tmp_path / "tb"), "--corpus", str(empty), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: corpus directory") and "empty" in err[0]


def test_presets_are_consistent():
    """Every preset builds a valid model config; the large one only through jax.eval_shape (no memory)."""
    import jax
    import jax.numpy as jnp

    from mia.models.gpt_neox import GPTNeoXForCausalLM
    from mia.testbed import PRESETS, TestbedError, model_config, preset

    # the sizes the preset comments and docs/testbed.md promise, as ranges that round to them (smoke "0.17M", default
    # "0.9M", large "27.3M")
    promised = {"smoke": (0.165e6, 0.175e6), "default": (0.85e6, 0.95e6), "large": (27.25e6, 27.35e6),
                "audit": (0.325e6, 0.335e6)}  # audit: smoke with 1,280 reserved tokens
    assert set(PRESETS) == set(promised)
    for name, cfg in PRESETS.items():
        assert cfg.preset == name and cfg.checkpoint_steps[0] == 0 and cfg.checkpoint_steps[-1] == cfg.train_steps
        assert list(cfg.checkpoints) == sorted(set(cfg.checkpoints)) and all(
            0 < c < cfg.train_steps for c in cfg.checkpoints
        )
        assert 0 < cfg.warmup_steps < cfg.train_steps and cfg.hidden_size % cfg.num_heads == 0
        mc = model_config(cfg, cfg.vocab_size + cfg.reserved_tokens)
        assert (mc.vocab_size, mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.intermediate_size) == (
            cfg.vocab_size + cfg.reserved_tokens, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.ffn_size)
        assert mc.max_position_embeddings == cfg.seq_len == cfg.row_len - 1  # trained context = the model's context
        shapes = jax.eval_shape(
            lambda: GPTNeoXForCausalLM(mc).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
        )
        n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
        # the model the preset builds has exactly the parameters its formula counts, at its promised size
        v, h, f, L = cfg.vocab_size + cfg.reserved_tokens, cfg.hidden_size, cfg.ffn_size, cfg.num_layers
        by_hand = 2 * v * h + 2 * h + L * (4 * h * h + 2 * h * f + 9 * h + f)  # embed + head, final LN, layers
        assert n == cfg.n_params() == by_hand, (name, n, cfg.n_params(), by_hand)
        assert promised[name][0] <= n < promised[name][1], (name, n)
    assert preset("smoke", train_steps=20).checkpoints == ()  # preset checkpoints past the run are dropped
    assert preset("smoke").config_hash != preset("smoke", seed=1).config_hash
    with pytest.raises(TestbedError, match="unknown testbed option"):
        preset("smoke", vocab=3)


def test_training_compile_level_follows_the_run_size_not_xla_flags():
    """On CPU the training step's optimisation level is pinned by the run's size (steps x batch x seq_len x width^2):
    level 0 for the tests' tiny runs and the smoke suite's 16-wide member (compile time dominates), XLA's default 3
    for the 64- and 96-wide members (the step runs 1.4-3x faster), whatever XLA_FLAGS say (the tests set level 0)."""
    import jax

    from mia.testbed import SUITES, preset
    from mia.testbed.train import SMALL_RUN_WORK, compiler_options

    if jax.default_backend() != "cpu":
        pytest.skip("the pinned level is a CPU rule")
    levels = [compiler_options(c, c.train_steps)["xla_backend_optimization_level"] for c in SUITES["smoke"]]
    assert [c.hidden_size for c in SUITES["smoke"]] == [16, 64, 96] and levels == [0, 3, 3]
    tiny = preset("smoke", seq_len=16, hidden_size=32, batch_size=8, train_steps=40)
    assert compiler_options(tiny, tiny.train_steps) == {"xla_backend_optimization_level": 0}
    # the boundary: exactly SMALL_RUN_WORK is small, one step more is not
    cfg = preset("smoke", seq_len=64, hidden_size=32, batch_size=16)
    steps = SMALL_RUN_WORK // (16 * 64 * 32 ** 2)
    assert compiler_options(cfg, steps)["xla_backend_optimization_level"] == 0
    assert compiler_options(cfg, steps + 1)["xla_backend_optimization_level"] == 3
