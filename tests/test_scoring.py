"""Token stats against a plain NumPy computation from transformers' PyTorch logits; invariances; disk cache."""
import os
import subprocess
import sys

import numpy as np
import pytest
from xla_env import device_flags
from transformers import AutoModelForCausalLM

from hf_tiny import padded_batch, torch_logits
from mia.engine.batching import (BUCKETS_PER_OCTAVE, RowCost, bucket_length, pack_rows, packs_rows, plan_batches,
                                 plan_cost, pow2_ceil, row_cost, row_length, SCORE_OVERHEAD_FLOPS_DEFAULT,
                                 ScoringSettings)
from mia.engine.loop import compute_token_stats
from mia.engine.stats import token_stats


def numpy_stats(logits_tv: np.ndarray, tokens_t: np.ndarray) -> dict:
    """Obviously-correct reference for one sequence: loops over positions."""
    out = {k: [] for k in ("logprob", "mean_logp", "std_logp", "entropy")}
    for i in range(len(tokens_t) - 1):
        z = logits_tv[i].astype(np.float64)
        logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        p = np.exp(logp)
        mu = (p * logp).sum()
        out["logprob"].append(logp[tokens_t[i + 1]])
        out["mean_logp"].append(mu)
        out["std_logp"].append(np.sqrt((p * logp ** 2).sum() - mu ** 2))
        out["entropy"].append(-(p * logp).sum())
    return {k: np.array(v) for k, v in out.items()}


def test_token_stats_match_numpy_reference(tiny_neox_dir, tiny_model):
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_neox_dir)).float().eval()
    lengths = [17, 9, 2, 12]
    tokens, mask = padded_batch(tiny_model.vocab_size, lengths, seed=3)
    logits = torch_logits(ref, tokens, mask)
    got = token_stats(tiny_model, tiny_model.params, tokens, mask.astype(bool), chunk=4)  # chunk smaller than T
    for i, n in enumerate(lengths):
        want = numpy_stats(logits[i, :n], tokens[i, :n])
        for k, v in want.items():
            np.testing.assert_allclose(np.asarray(got[k])[i, : n - 1], v, atol=2e-4, rtol=1e-4, err_msg=k)
        assert np.asarray(got["mask"])[i].sum() == n - 1


def test_models_of_one_architecture_share_one_step_and_score_with_their_own_params(tiny_model, monkeypatch):
    """Checkpoints of one architecture (here the tiny model and a copy with other weights) share the engine's
    stand-in (abstract params, no tokenizer) and so one jitted step, traced once; each scores with its own params
    (against the NumPy reference on its own logits). Another dtype, or another attention kernel asked for in
    MIA_ATTENTION, gets its own stand-in."""
    import dataclasses

    import jax
    import mia.engine.loop as loop
    import mia.models as mm
    from mia.models.hub import program_model

    a = tiny_model
    b = dataclasses.replace(a, params=jax.tree_util.tree_map(lambda x: x * 0.7 + 0.01, a.params))
    assert program_model(a) is program_model(b) and program_model(a).tokenizer is None
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(program_model(a).params))
    assert loop.jitted_token_stats(a) is loop.jitted_token_stats(b)
    assert program_model(mm.load(a.path, dtype="bfloat16", tokenizer=False)) is not program_model(a)
    before, step = program_model(a), loop.jitted_token_stats(a)
    monkeypatch.setenv("MIA_ATTENTION", "exact")
    assert program_model(b) is not before and loop.jitted_token_stats(b) is not step
    monkeypatch.delenv("MIA_ATTENTION")
    assert program_model(b) is before
    seqs = _random_lists(a.vocab_size, [11, 6], seed=4)
    got_a, got_b = (compute_token_stats(m, seqs, ScoringSettings(progress=False)) for m in (a, b))
    for seq, ga, gb in zip(seqs, got_a, got_b):
        want = numpy_stats(np.asarray(b.logits(b.params, seq[None]))[0], seq)
        for k, v in want.items():
            np.testing.assert_allclose(gb[k], v, atol=2e-4, rtol=1e-4, err_msg=k)
        assert not np.allclose(ga["logprob"], gb["logprob"], atol=1e-3)


def _random_lists(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


def test_scores_do_not_depend_on_batch_padding_or_bucket(tiny_model):
    seqs = _random_lists(tiny_model.vocab_size, [5, 40, 17, 3, 64, 33, 8, 21])
    alone = [compute_token_stats(tiny_model, [s], ScoringSettings(progress=False))[0] for s in seqs]
    batched = compute_token_stats(tiny_model, seqs, ScoringSettings(progress=False, token_budget=256))
    other = compute_token_stats(
        tiny_model, seqs[::-1], ScoringSettings(progress=False, token_budget=4096, min_bucket=64)
    )[::-1]
    for a, b, c in zip(alone, batched, other):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0)
            np.testing.assert_allclose(a[k], c[k], atol=1e-5, rtol=0)


def test_scores_do_not_depend_on_the_bucket_rule(tiny_model):
    """Power-of-two buckets (``bucket_step=0``) and multiple-of-step buckets pad rows over 16 to other lengths (the
    model reads n - 1 tokens, bucketed, and the row holds one more: 150 -> 257 or 161, 40 -> 65 or 49, 90 -> 129 or
    97); the token stats agree within float tolerance."""
    seqs = _random_lists(tiny_model.vocab_size, [150, 40, 90, 17, 3, 129], seed=2)
    lengths = [len(s) for s in seqs]
    pow2, fine = ScoringSettings(progress=False, bucket_step=0), ScoringSettings(progress=False, bucket_step=16)
    assert {b.length for b in plan_batches(lengths, pow2)} == {17, 65, 129, 257}
    assert {b.length for b in plan_batches(lengths, fine)} == {17, 49, 97, 129, 161}
    a, b = (compute_token_stats(tiny_model, seqs, s) for s in (pow2, fine))
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_allclose(x[k], y[k], atol=1e-5, rtol=0, err_msg=k)


@pytest.mark.parametrize("step", [0, 16, 100, 128])
def test_bucket_length_covers_the_row_and_bounds_buckets_and_padding(step):
    lengths = range(1, 5000)
    got = {n: bucket_length(n, 16, step) for n in lengths}
    assert all(got[n] >= n for n in lengths)
    assert all(got[n] == pow2_ceil(n, 16) for n in lengths if step == 0 or pow2_ceil(n, 16) <= step)
    assert all(got[m] <= got[n] for m, n in zip(lengths, lengths[1:]))  # sorted rows stay sorted by bucket
    if step:
        for p in (256, 512, 1024, 2048, 4096):  # at most BUCKETS_PER_OCTAVE buckets in each octave (p/2, p]
            assert len({got[n] for n in range(p // 2 + 1, min(p, 4999) + 1)}) <= BUCKETS_PER_OCTAVE
        assert all(got[n] - n < max(step, n / 8) for n in lengths if n > step)
    if step == 128:  # the documented bound: 19 buckets up to 2048 at the defaults, 8 more per doubling
        assert len({got[n] for n in range(1, 2049)}) == 19 and len({got[n] for n in range(1, 4097)}) == 27
        assert bucket_length(129, 16, 128) == 256 and bucket_length(300, 16, 128) == 384
        assert bucket_length(2049, 16, 128) == 2304


@pytest.mark.parametrize("step", [0, 128])
def test_plan_batches_one_shape_per_length_bucket_and_a_per_device_budget(step):
    lengths = list(range(2, 600, 7))
    for n_data in (1, 8):
        plan = plan_batches(lengths, ScoringSettings(token_budget=2048, bucket_step=step), n_data)
        assert sorted(i for b in plan for i in b.members) == list(range(len(lengths)))
        n_buckets = len({row_length(n, 16, step) for n in lengths})  # 17 ... 1025, or 17 ... 129, 257 ... 641
        assert len({(b.length, b.rows) for b in plan}) == len({b.length for b in plan}) == n_buckets
        assert n_buckets == (7 if step == 0 else 8)
        for b in plan:
            assert all(lengths[i] <= b.length for i in b.members) and len(b.members) <= b.rows
            read = b.length - 1  # positions the model reads per row (the last token is only predicted)
            assert b.rows % n_data == 0 and (b.rows // n_data) * read <= max(2048, read)
    one, eight = (plan_batches([300] * 64, ScoringSettings(token_budget=2048, bucket_step=0), n) for n in (1, 8))
    assert [b.rows for b in one] == [4] * 16 and [b.rows for b in eight] == [32, 32]  # 8 devices: 8x the rows
    one = plan_batches([300] * 64, ScoringSettings(token_budget=2048), 1)  # reads 384: 5 rows -> 4 (a power of 2)
    assert [(b.length, b.rows) for b in one] == [(385, 4)] * 16


@pytest.mark.parametrize("n_data", [1, 8])
def test_bucket_rows_pad_a_small_set_by_an_eighth_not_to_a_power_of_two(n_data):
    """One row count per bucket, at most the per-device cap, a multiple of the data size; the padding rows of a
    bucket stay under 1/8 of its examples plus one granule per batch. Rounding to a power of two padded a set of 33
    to 64 rows and one of 260 (cap 256) to 512."""
    from mia.engine.batching import bucket_rows, pow2_floor

    for n in list(range(1, 80)) + [255, 256, 257, 260, 511, 513, 1000, 4097]:
        for cap in (1, 3, 8, 64, 256):
            rows = bucket_rows(n, cap, n_data)
            per = rows // n_data
            assert rows % n_data == 0 and 1 <= per <= pow2_floor(cap)
            batches = -(-n // rows)
            need = -(-n // (batches * n_data))  # rows per device the batches must hold
            assert per >= need and per - need <= max(0, need // 8), (n, cap, n_data, rows)
    assert bucket_rows(33, 256, 1) == 36 and bucket_rows(260, 256, 1) == 144


def _real_rows(valid) -> int:
    """Rows of a token-stats call that hold an example (not the padding rows a device count adds)."""
    return int(np.asarray(valid).any(axis=1).sum())


def test_disk_cache_is_reused_and_resumes(tiny_model, tmp_path, monkeypatch):
    seqs = _random_lists(tiny_model.vocab_size, [6, 9, 30, 12])
    s = ScoringSettings(progress=False, cache_dir=str(tmp_path), token_budget=32)
    first = compute_token_stats(tiny_model, seqs[:2], s)  # an "interrupted" run that finished two examples
    calls = []
    import mia.engine.loop as sc

    real = sc.jitted_token_stats

    def counting(model, *args):
        fn = real(model, *args)
        return lambda *a: calls.append(_real_rows(a[2])) or fn(*a)

    monkeypatch.setattr(sc, "jitted_token_stats", counting)
    full = compute_token_stats(tiny_model, seqs, s)
    assert sum(calls) == 2  # the two cached examples were not recomputed (padding rows of any device count aside)
    np.testing.assert_array_equal(first[0]["logprob"], full[0]["logprob"])
    calls.clear()
    again = compute_token_stats(tiny_model, seqs, s)
    assert calls == []
    for a, b in zip(full, again):
        np.testing.assert_array_equal(a["logprob"], b["logprob"])


SHARDED = r"""
import os, sys, numpy as np, jax
sys.path.insert(0, sys.argv[2])
import mia.models as mm
from mia.engine.batching import ScoringSettings
from mia.engine.loop import compute_token_stats
assert len(jax.devices()) == 8, jax.devices()
m = mm.load(sys.argv[1])
rng = np.random.default_rng(0)
seqs = [rng.integers(0, m.vocab_size, n).astype(np.int32) for n in [5, 40, 17, 3, 64, 33, 8, 21, 9, 11]]
out = compute_token_stats(m, seqs, ScoringSettings(progress=False))
np.savez(sys.argv[3], *[o["logprob"] for o in out])
"""


def test_scores_do_not_depend_on_device_count(tiny_neox_dir, tiny_model, tmp_path):
    env = dict(os.environ, XLA_FLAGS=device_flags(8), JAX_PLATFORMS="cpu")
    out = tmp_path / "sharded.npz"
    subprocess.run([sys.executable, "-c", SHARDED, str(tiny_neox_dir), os.path.dirname(__file__), str(out)],
                   check=True, env=env, timeout=300)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, tiny_model.vocab_size, n).astype(np.int32) for n in [5, 40, 17, 3, 64, 33, 8, 21, 9, 11]]
    single = compute_token_stats(tiny_model, seqs, ScoringSettings(progress=False))
    with np.load(out) as z:
        for i, s in enumerate(single):
            np.testing.assert_allclose(z[f"arr_{i}"], s["logprob"], atol=1e-5, rtol=0)


def test_interrupt_keeps_every_fetched_batch_on_disk(tiny_model, tmp_path, monkeypatch):
    """Interrupted mid-run (Ctrl-C, or any error): the batches already fetched are on disk (the cache writer is
    drained on the way out), and a rerun computes only the rest. On one device the batches are [6, 9], [12] (bucket
    16, 2 rows), [30], [40], [50]; on more (the budget is per device) the plan of that device count.
    (pytest lets a real KeyboardInterrupt through, so a stand-in exception interrupts here.)"""
    import jax

    import mia.engine.loop as sc

    lengths = [6, 9, 30, 12, 40, 50]
    seqs = _random_lists(tiny_model.vocab_size, lengths, seed=4)
    s = ScoringSettings(progress=False, cache_dir=str(tmp_path), token_budget=32, pack=False)
    plan = plan_batches(lengths, s, len(jax.devices()))
    assert len(plan) >= 3
    real, calls, interrupted = sc.jitted_token_stats, [], []

    class Interrupt(Exception):
        pass

    def interrupting(model, *args):
        fn = real(model, *args)

        def call(*a):
            calls.append(_real_rows(a[2]))
            if len(calls) == 3 and not interrupted:  # batch 1 is fetched, batch 2 is in flight
                interrupted.append(True)
                raise Interrupt
            return fn(*a)
        return call

    monkeypatch.setattr(sc, "jitted_token_stats", interrupting)
    with pytest.raises(Interrupt):
        compute_token_stats(tiny_model, seqs, s)
    on_disk = sc.StatsCache(str(tmp_path), sc.cache_namespace(tiny_model)).lookup([sc.example_key(t) for t in seqs])
    assert set(on_disk) == {sc.example_key(seqs[m]) for m in plan[0].members}
    calls.clear()
    resumed = compute_token_stats(tiny_model, seqs, s)
    assert sum(calls) == len(seqs) - len(plan[0].members)  # one device: [12], [30], [40], [50]
    fresh = compute_token_stats(tiny_model, seqs, ScoringSettings(progress=False, token_budget=32))
    for a, b in zip(resumed, fresh):
        np.testing.assert_allclose(a["logprob"], b["logprob"], atol=1e-6)


def test_auto_packing_follows_the_cost_estimate():
    """pack=None packs a mixed-length set when the dense layers dominate (a real model's shape), not when attention
    over pack_length keys dominates (a tiny model), never on a GPU; True / False always win; and the estimate is the
    sum of rows x length x (dense + attention x length) over the plan's batches (empty rows included)."""
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.choice([40, 60, 90, 200, 300], 400)]
    auto = ScoringSettings(progress=False)
    wide = RowCost(dense=2 * 1.0e9, attention=16 * 8 * (4 * 256 + 1024))  # about Pythia-1B on a CPU
    tiny = RowCost(dense=2 * 3.0e4, attention=4 * (4 * 8 + 1024))  # hidden 32, 1 layer of 4 heads
    assert packs_rows(auto, lengths, wide, backend="cpu") and packs_rows(auto, lengths, wide, backend="tpu")
    assert not packs_rows(auto, lengths, wide, backend="gpu")
    assert not packs_rows(auto, lengths, tiny, backend="cpu")
    assert not packs_rows(ScoringSettings(pack=False), lengths, wide, backend="cpu")
    assert packs_rows(ScoringSettings(pack=True), lengths, tiny, backend="gpu")
    plan = pack_rows(lengths, auto)
    by_hand = 0.0
    for b in plan:
        by_hand += b.rows * b.length * (wide.dense + wide.attention * b.length)
    assert plan_cost(plan, wide) == pytest.approx(by_hand)
    assert plan_cost(plan, wide) < 0.95 * plan_cost(plan_batches(lengths, auto), wide)
    same = [128] * 64  # equal lengths: packing only lengthens the rows
    assert not packs_rows(auto, same, wide, backend="cpu")


def test_row_cost_counts_parameters_and_attention_width(tiny_model):
    import jax

    cfg = tiny_model.config
    n = sum(x.size for x in jax.tree_util.tree_leaves(tiny_model.params))
    c = row_cost(tiny_model, backend="tpu")
    assert c.dense == 2 * n
    heads = cfg.num_attention_heads
    assert c.attention == cfg.num_hidden_layers * (4 * cfg.hidden_size + heads * SCORE_OVERHEAD_FLOPS_DEFAULT)
    assert row_cost(tiny_model, backend="cpu").attention > c.attention


def test_logits_chunks_fit_a_cpu_cache_and_stay_large_on_accelerators():
    """The LM head's logits chunk [B, C, V]: 32 MiB of float32 on a CPU (its last-level cache), 128 MiB elsewhere;
    the step picks the budget of its mesh's devices, not of the host it is traced on."""
    import jax

    from mia.engine.loop import mesh_chunk_size
    from mia.engine.stats import chunk_budget, chunk_size
    from mia.sharding import data_size, make_mesh, mesh_platform

    assert chunk_budget("cpu") * 4 == 32 << 20 and chunk_budget("tpu") * 4 == chunk_budget("gpu") * 4 == 128 << 20
    assert chunk_size(8, 511, 50304, platform="cpu") == 16  # 8 x 16 x 50304 x 4 B = 25.8 MB <= 32 MiB, 32 would not fit
    assert chunk_size(8, 511, 50304, platform="tpu") == 64
    assert chunk_size(1, 100, 50304, platform="tpu") == 100  # never more than the sequence
    for platform in ("cpu", "tpu"):
        b, v = 4, 1000
        c = chunk_size(b, 10_000, v, platform=platform)
        assert b * c * v <= chunk_budget(platform) < b * 2 * c * v and c & (c - 1) == 0
    assert mesh_platform(make_mesh()) == jax.default_backend() == "cpu"
    mesh = make_mesh()  # the step's chunk: one device's rows, the mesh's platform
    assert mesh_chunk_size(mesh, 8 * data_size(mesh), 511, 50304) == chunk_size(8, 511, 50304, platform="cpu")
