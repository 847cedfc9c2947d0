"""Parity of every decoder family with transformers' PyTorch model, on tiny random configs (prime-ish dims).

One checkpoint per case is built once per module; each case is checked for logits parity on a right-padded batch,
a save -> transformers round trip, and prefix-cache equivalence of ``hidden``.
"""
import json

import jax
import numpy as np
import pytest
import transformers as tf

import mia.models as mm
from mia.models.common import ConfigError

from hf_tiny import padded_batch, save_tiny, torch_logits
from tiny_configs import PARITY as CASES, V

LENGTHS = [13, 7, 1, 10]


_BUILT: dict = {}  # case name -> (name, checkpoint dir, transformers model, our model), built once per session


def _build(name, tmp_path_factory):
    if name not in _BUILT:
        path = tmp_path_factory.mktemp(name)
        ref = save_tiny(CASES[name](), path, seed=1)
        _BUILT[name] = (name, path, ref, mm.load(path))
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def default_run_only(names, keep, ids=None):
    """``names`` as pytest params, those not in ``keep`` marked slow: a path every family shares (save, prefix cache,
    bf16, packed rows, ...) runs for the representative families ``keep`` in the default run and for every family
    in ``make test-all`` (docs/testing.md); each family's own float32 parity always runs in the default run."""
    assert set(keep) <= set(names), sorted(set(keep) - set(names))
    return [pytest.param(n, id=n) if n in keep else pytest.param(n, id=n, marks=pytest.mark.slow) for n in names]


def _assert_real_close(got, want, mask, atol):
    worst = 0.0
    for i, n in enumerate(mask.sum(1)):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=atol, rtol=0)
        worst = max(worst, float(np.abs(got[i, :n] - want[i, :n]).max()))
    return worst


def test_logits_match_transformers(case):
    name, _, ref, model = case
    tokens, mask = padded_batch(V, LENGTHS, seed=2)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    worst = _assert_real_close(got, torch_logits(ref, tokens, mask), mask, 1e-4)
    print(f"{name}: max |logit diff| = {worst:.2e}")


# tied embeddings (Llama), OPT's project_in/out and post-norm, Gemma 3's per-layer norms and rotary bases: the save
# mapping's odd cases in the default run; every family in make test-all
SAVE_KEEP = ("llama_tied", "opt_post", "gemma3_text")


@pytest.mark.parametrize("name", default_run_only(sorted(CASES), SAVE_KEEP))
def test_save_roundtrip_loads_in_transformers(name, tmp_path, tmp_path_factory):
    name, _, _, model = _build(name, tmp_path_factory)
    mm.save(model, tmp_path)
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert type(back).__name__ == mm.FAMILIES[model.model_type].module_cls.__name__
    tokens, mask = padded_batch(V, [11, 5], seed=3)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    _assert_real_close(got, torch_logits(back, tokens, mask), mask, 1e-4)
    again = mm.load(tmp_path)
    assert again.config == model.config


# GPT-NeoX's prefix cache is also checked against transformers by tests/test_conditional.py. The default run keeps
# learned positions offset by the cache (gpt2), RoPE with grouped KV heads (llama_gqa) and sliding windows with soft
# caps (gemma2); every family in make test-all
PREFIX_CASES = default_run_only(sorted(CASES), ("gpt2", "llama_gqa", "gemma2"))


@pytest.mark.parametrize("name", PREFIX_CASES)
def test_prefix_cache_matches_full_sequence(name, tmp_path_factory):
    name, _, _, model = _build(name, tmp_path_factory)
    prefix, _ = padded_batch(V, [6, 6], seed=4)
    target, tmask = padded_batch(V, [7, 4], seed=5)
    full = np.concatenate([prefix, target], axis=1)
    fmask = np.concatenate([np.ones_like(prefix, bool), tmask.astype(bool)], axis=1)
    h_full, _ = model.hidden(model.params, full, fmask)
    _, cache = model.hidden(model.params, prefix)
    h_cached, _ = model.hidden(model.params, target, tmask.astype(bool), cache=cache)
    _assert_real_close(np.asarray(h_cached), np.asarray(h_full)[:, prefix.shape[1]:], tmask, 1e-5)


BF16_EPS = 2.0 ** -8  # bfloat16 keeps 8 significant bits: relative rounding of one value is at most 2^-8
# Gemma: the final soft cap (1.0 in the tiny configs) shrinks the largest logit, not the rounding before it; these
# measure 7.5 (gemma2) and 6.1 (gemma3_text) roundings of the capped logit
BF16_ROUNDINGS = {"gemma2": 10, "gemma3_text": 10}


# the default run: a Llama and Gemma 2 (soft caps: its own tolerance); every family in make test-all
@pytest.mark.parametrize("name", default_run_only(
    ["gpt2", "gpt_neo", "llama_gqa", "llama_tied", "llama3_rope", "olmo", "olmo2", "qwen2", "qwen3", "opt", "opt_post",
     "phi3", "mistral", "gemma2", "gemma3_text"], ("llama_gqa", "gemma2")))
def test_bfloat16_close_to_float32(name, tmp_path_factory):
    """bf16 weights and activations: logits within 6 bf16 roundings of the row's largest float32 logit (these 2-3
    layer nets measure 1.3-3.4; Gemma's: ``BF16_ROUNDINGS``); and not equal to float32, so the bf16 path really runs
    in bf16."""
    name, path, _, m32 = _build(name, tmp_path_factory)  # the parity tests' checkpoint and float32 model
    m16 = mm.load(path, dtype="bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(m16.params)} == {np.dtype("bfloat16")}
    tokens, mask = padded_batch(V, LENGTHS, seed=2)  # the parity test's batch: the float32 logits are compiled
    a = np.asarray(m32.logits(m32.params, tokens, mask.astype(bool)))
    b = np.asarray(m16.logits(m16.params, tokens, mask.astype(bool)).astype(np.float32))
    assert np.isfinite(b).all()
    worst = 0.0
    for i, n in enumerate(mask.sum(1)):
        err, scale = np.abs(b[i, :n] - a[i, :n]).max(), np.abs(a[i, :n]).max()
        assert err <= BF16_ROUNDINGS.get(name, 6) * BF16_EPS * scale, (name, i, err, scale)
        worst = max(worst, err / (BF16_EPS * scale))
    assert worst > 0.05, f"{name}: bf16 logits equal float32 ones (max {worst:.3f} roundings): bf16 is not in use"
    print(f"{name}: bf16 max |logit diff| = {worst:.2f} bf16 roundings of the row's largest logit")


def _write_config(path, hf):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    return path


LLAMA_HF = dict(model_type="llama", vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=2,
                num_attention_heads=5)


@pytest.mark.parametrize("extra, field", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "low_freq_factor"),
    (dict(sliding_window=4), "sliding_window"),
])
def test_math_changing_config_is_refused(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=field):
        mm.load_config(_write_config(tmp_path, {**LLAMA_HF, **extra}))


@pytest.mark.parametrize("hf, field", [
    (dict(model_type="olmo", rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(model_type="olmo2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
    (dict(model_type="gpt2", n_embd=40, n_layer=2, n_head=5, add_cross_attention=True), "add_cross_attention"),
    (dict(model_type="gpt_neo", hidden_size=40, num_layers=2, num_heads=5, attention_types=[[["global", "sparse"], 1]]),
     "attention_types"),
    (dict(model_type="gpt_neo", hidden_size=40, num_layers=3, num_heads=5, attention_types=[[["global", "local"], 1]]),
     "attention_types"),
])
def test_other_families_refuse(tmp_path, hf, field):
    base = dict(vocab_size=V, hidden_size=40, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ConfigError, match=field):
        mm.load_config(_write_config(tmp_path, {**base, **hf}))


def test_unsupported_model_type_lists_supported(tmp_path):
    with pytest.raises(ConfigError) as e:
        mm.load_config(_write_config(tmp_path, {"model_type": "mamba", "vocab_size": V}))
    for supported in ("gpt2", "gpt_neo", "gpt_neox", "llama", "olmo", "olmo2", "opt", "phi3", "mistral", "gemma2",
                      "gemma3_text", "qwen2", "qwen3"):
        assert supported in str(e.value)


def test_every_registered_family_has_tiny_configs():
    """A new family adds one entry to tests/tiny_configs.py (both tables) and is then parity- and mesh-tested."""
    from mia.models.family import FAMILIES

    from tiny_configs import shardable

    covered = {CASES[name]().model_type for name in CASES}
    assert set(FAMILIES) <= covered, sorted(set(FAMILIES) - covered)
    for family in FAMILIES:
        assert shardable(family)["model_type"] == family


# Packed rows, both attention kernels: the default run keeps learned positions with a padded tail longer than the
# position table (gpt2) and the windows (Gemma 2's, Qwen2's sliding layer); every family in make test-all. GPT-NeoX's
# whole packed scores are also checked by test_cli_score's --pack check.
BOTH = ("exact", "blocked")
PACKED_KEEP = ("gpt2", "gemma2", "qwen2")
PACKED_CASES = [pytest.param(p.values[0], BOTH, id=p.id, marks=p.marks)
                for p in default_run_only(sorted(CASES), PACKED_KEEP)]


@pytest.mark.parametrize("name, kernels", PACKED_CASES)
def test_packed_rows_score_as_separate_rows(name, kernels, tmp_path_factory, monkeypatch):
    """Token stats with several texts per row (segment ids, positions restarting per text) equal one text per row,
    per family and for every attention kernel: a text never sees its row neighbours."""
    import dataclasses

    from mia.engine.batching import ScoringSettings, pack_rows
    from mia.engine import loop
    from mia.engine.stats import STAT_NAMES
    from mia.models import attention as A

    name, _, _, model = _build(name, tmp_path_factory)
    rng = np.random.default_rng(6)
    texts = [rng.integers(0, V, n).astype(np.int32) for n in (13, 7, 2, 10, 5, 3, 9)]
    plain = ScoringSettings(progress=False, pack=False)
    # rows of 128 hold every text (49 tokens) and a padded tail of 79, longer than the tiny configs' 32 learned
    # positions (GPT-2, GPT-Neo): the tail must not index past the position table
    packed = dataclasses.replace(plain, pack=True, pack_length=128)
    assert any(len({r for r, _ in b.slots}) < len(b.members) for b in pack_rows([len(t) for t in texts], packed))
    want = loop.compute_token_stats(model, texts, plain)
    monkeypatch.setattr(A, "BLOCK_Q", 4)  # several query and key blocks per row
    monkeypatch.setattr(A, "BLOCK_K", 4)
    for kernel in kernels:
        monkeypatch.setenv(A.ENV_VAR, kernel)  # read when traced: a fresh jitted step per kernel
        loop.jitted_token_stats.cache_clear()
        got = loop.compute_token_stats(model, texts, packed)
        for g, w in zip(got, want):
            for s in STAT_NAMES:
                np.testing.assert_allclose(g[s], w[s], atol=2e-5, rtol=0, err_msg=f"{name} {kernel} {s}")
    loop.jitted_token_stats.cache_clear()


# the check reads the checkpoint's tensors before any family code: two families in the default run, all in test-all
@pytest.mark.parametrize("name", default_run_only(sorted(CASES), ("gpt_neox", "gemma3_text")))
def test_nonfinite_weights_are_refused_naming_the_tensor(name, tmp_path, tmp_path_factory):
    """Every family: its largest tensor all NaN, one NaN in it, or one -inf: ``load`` refuses the checkpoint in one
    line naming that tensor (by its checkpoint name) and the file, never a model that scores NaN."""
    from mia.models.hub import CheckpointError, read_safetensors, write_safetensors

    name, path, _, _ = _build(name, tmp_path_factory)
    tensors = {k: np.array(v) for k, v in read_safetensors(path / "model.safetensors").items()}
    big = max((k for k, v in tensors.items() if v.dtype.kind == "f"), key=lambda k: (tensors[k].size, k))
    for damage in ("all nan", "one nan", "one -inf"):
        bad = dict(tensors)
        bad[big] = tensors[big].copy()
        if damage == "all nan":
            bad[big][...] = np.nan
        else:
            bad[big].flat[bad[big].size // 2] = np.nan if damage == "one nan" else -np.inf
        d = tmp_path / damage.replace(" ", "_")
        d.mkdir()
        (d / "config.json").write_text((path / "config.json").read_text())
        write_safetensors(bad, d / "model.safetensors")
        with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{big}' holds \d+ non-finite"):
            mm.load(d)


@pytest.mark.parametrize("name", ["gpt2", pytest.param("gpt_neo", marks=pytest.mark.slow),
                                  pytest.param("opt", marks=pytest.mark.slow)])
def test_a_text_of_context_plus_one_tokens_is_scored_inside_the_context(name, tmp_path_factory):
    """A model with a learned position table of C entries scores a text of C + 1 tokens (Pythia's 2049-token rows,
    a testbed's seq_len + 1): C predictions, each equal to transformers' on the first C tokens, whether the text
    fills its row, sits in a longer padded row or is packed beside others (a text's last token is never read, so
    no position reaches C); a text of C + 2 tokens is refused."""
    import dataclasses

    from hf_tiny import log_softmax, torch_sequence_logits
    from mia.engine import loop
    from mia.engine.batching import ScoringSettings

    _, _, ref, model = _build(name, tmp_path_factory)
    c = model.max_length
    rng = np.random.default_rng(8)
    texts = [rng.integers(0, V, n).astype(np.int32) for n in (c + 1, 7, c + 1, 5, c)]
    plain = ScoringSettings(progress=False, pack=False, bucket_step=0)
    for settings in (plain, dataclasses.replace(plain, min_bucket=2 * c),  # rows of 2C + 1: padding after the text
                     dataclasses.replace(plain, pack=True, pack_length=4 * c)):  # C + 1 texts mid-row
        got = loop.compute_token_stats(model, texts, settings)
        for t, g in zip(texts, got):
            lp = log_softmax(torch_sequence_logits(ref, t[:c]))  # transformers reads at most C positions
            want = lp[np.arange(len(t) - 1), t[1:]]
            assert len(g["logprob"]) == len(t) - 1
            np.testing.assert_allclose(g["logprob"], want, atol=1e-4, rtol=0, err_msg=f"{name} {settings}")
    with pytest.raises(ValueError, match=f"has {c + 2} tokens; the model's context of {c} positions scores at most"):
        loop.compute_token_stats(model, [rng.integers(0, V, c + 2).astype(np.int32)], plain)
