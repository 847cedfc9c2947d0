"""Fine-tuning a testbed on a private set with canaries (``mia.testbed.finetune``): the config and plan, the
accountant against the Gaussian mechanism's closed form, LoRA's merge and trainable mask, the clipped gradient sum
against one example at a time, and (slow) a fine-tune end to end."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mia.testbed import TestbedError
from mia.testbed import finetune as ft

V, R = 300, 8  # the tiny model's corpus vocabulary and reserved tokens


@pytest.fixture(scope="module")
def tiny():
    """A 1-layer, 16-wide GPT-NeoX with 8 reserved token ids (zero rows), untrained."""
    import jax.numpy as jnp

    from mia.models import from_config
    from mia.models.hub import family
    from mia.testbed import preset
    from mia.testbed.build import model_config, zero_reserved_rows
    from mia.testbed.init import init_params

    cfg = preset("smoke", vocab_size=V, seq_len=8, hidden_size=16, num_layers=1, num_heads=2)
    mcfg = model_config(cfg, V + R)
    params = init_params(family("gpt_neox").module_cls(mcfg, dtype=jnp.float32, param_dtype=jnp.float32), 0)
    return from_config(mcfg, params=zero_reserved_rows(params, V))


def test_config_and_pool_plan():
    cfg = ft.FinetuneConfig(canary_groups=(("new", 1, 30), ("tokens", 4, 10)), n_private=64, sample_rate=0.5)
    kinds, reps, included = ft.plan_pool(cfg)
    assert kinds == ("new",) * 30 + ("tokens",) * 10 and list(reps) == [1] * 30 + [4] * 10
    again = ft.plan_pool(cfg)[2]
    np.testing.assert_array_equal(included, again)  # a function of the config alone
    assert not np.array_equal(included, ft.plan_pool(cfg.replace(seed=1))[2])
    assert cfg.expected_records == 64 + (30 + 40) / 2 and cfg.kind_spec == "new,tokens" and cfg.m == 40
    assert cfg.config_hash != cfg.replace(lora_rank=4).config_hash == cfg.replace(lora_rank=4).config_hash
    assert cfg.replace(lora_rank=8, lora_alpha=16.0).lora_scale == 2.0 and cfg.replace(lora_rank=8).lora_scale == 1.0
    for bad, needle in ((dict(sample_rate=0.0), "sample_rate"), (dict(optimizer="rmsprop"), "optimizer"),
                        (dict(canary_groups=(("bytes", 1, 3),)), "canary group"), (dict(dp_noise=-1.0), "dp_noise"),
                        (dict(steps=0), "steps")):
        with pytest.raises(TestbedError, match=needle):
            ft.FinetuneConfig(**bad)
    sizes = [len(ft.poisson_batch(cfg, s, 400)) for s in range(50)]
    assert abs(np.mean(sizes) - 200) < 4 * math.sqrt(100 / 50) and ft.poisson_batch(cfg, 3, 400).tolist() == \
        ft.poisson_batch(cfg, 3, 400).tolist()
    assert len(ft.poisson_batch(cfg.replace(sample_rate=1.0), 0, 400)) == 400


def test_accountant_is_the_composed_gaussian():
    """Sample rate 1: T Gaussian mechanisms of noise sigma are one of sigma / sqrt(T), whose epsilon has a closed form
    (the PLD accountant is a pessimistic bound, within 1% of it). Below 1: dp_accounting's Poisson-subsampled event.
    Groups: group privacy."""
    import dp_accounting
    from dp_accounting import get_epsilon_gaussian, pld

    cfg = ft.FinetuneConfig(steps=8, sample_rate=1.0, dp_noise=3.0)
    exact = get_epsilon_gaussian(3.0 / math.sqrt(8), 1e-5)
    eps, delta = ft.finetune_epsilon(cfg)
    assert delta == 1e-5 and exact <= eps <= exact * 1.01
    sub = cfg.replace(sample_rate=0.25, steps=4)
    acc = pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(3.0)), 4))
    assert ft.finetune_epsilon(sub)[0] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    e4, d4 = ft.finetune_epsilon(cfg, group=4)
    assert e4 == pytest.approx(4 * eps) and d4 == pytest.approx(min(1.0, 4 * math.exp(3 * eps) * 1e-5))
    assert ft.finetune_epsilon(cfg.replace(dp_noise=None))[0] == math.inf
    assert ft.finetune_epsilon(cfg.replace(dp_noise=0.0))[0] == math.inf
    rec = ft.privacy_record(cfg)
    assert rec["epsilon_pld"] == pytest.approx(eps) and rec["epsilon_rdp"] >= eps and rec["sample_rate"] == 1.0


def test_lora_merge_and_trainable_mask(tiny):
    """LoRA: W + scale A B on the target kernels, the reserved rows replaced, nothing else touched; at the start
    (B = 0) the merged model is the base. The mask trains the base (full) or everything but it (LoRA)."""
    import jax
    import jax.numpy as jnp

    cfg = ft.FinetuneConfig(lora_rank=2, lora_alpha=3.0)
    tree = ft.start_tree(tiny.params, cfg, V)
    assert set(tree) == {"base", "lora", "new_in", "new_out"} and tree["new_in"].shape == (R, 16)
    assert ft.trainable_mask(tree, cfg) == {"base": False, "lora": True, "new_in": True, "new_out": True}
    assert ft.trainable_mask({"base": 0}, cfg.replace(lora_rank=0)) == {"base": True}
    same = ft.merged_params(tree, cfg, V)
    for a, b in zip(jax.tree_util.tree_leaves(same), jax.tree_util.tree_leaves(tiny.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rng = np.random.default_rng(0)
    name = ft.LORA_TARGETS[0]
    B = rng.standard_normal(tree["lora"][name]["B"].shape).astype(np.float32)
    tree["lora"][name]["B"] = jnp.asarray(B)
    tree["new_out"] = tree["new_out"] + 1.0
    p = ft.merged_params(tree, cfg, V)
    A = np.asarray(tree["lora"][name]["A"])
    want = np.asarray(tiny.params["layers"][name]["kernel"]) + 1.5 * np.einsum("lir,lro->lio", A, B)
    np.testing.assert_allclose(np.asarray(p["layers"][name]["kernel"]), want, rtol=1e-5, atol=1e-6)
    out = np.asarray(p["embed_out"]["kernel"])
    np.testing.assert_array_equal(out[:, :V], np.asarray(tiny.params["embed_out"]["kernel"])[:, :V])
    np.testing.assert_array_equal(out[:, V:], np.ones((16, R), np.float32))  # the reserved rows started at zero


def test_clipped_gradient_sum_matches_one_example_at_a_time(tiny):
    """DP: the sum of the per-example gradients of the masked mean loss, each clipped to dp_clip (padding weight 0
    adds nothing), equals clipping one example's gradient at a time."""
    import jax
    import jax.numpy as jnp

    cfg = ft.FinetuneConfig(lora_rank=2, dp_noise=1.0, dp_clip=0.05)
    tree = ft.start_tree(tiny.params, cfg, V)
    trainable, frozen = ft.split(tree, ft.trainable_mask(tree, cfg))
    rng = np.random.default_rng(1)
    rows = rng.integers(1, V + R, (5, 9)).astype(np.int32)
    masks = np.zeros((5, 8), np.float32)
    masks[:, 3:] = 1.0
    masks[2] = 1.0
    w = np.array([1, 1, 1, 1, 0], np.float32)
    summed, n_clipped, loss_sum = ft.make_gradient_sum(tiny, cfg, V)(trainable, frozen, jnp.asarray(rows),
                                                                   jnp.asarray(masks), jnp.asarray(w))

    def one(t, row, mask):
        p = ft.merged_params({**frozen, **t}, cfg, V)
        logp = jax.nn.log_softmax(tiny.logits(p, row[None, :-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, row[None, 1:, None], axis=-1)[0, :, 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    g1 = jax.jit(jax.value_and_grad(one))
    want, norms, losses = None, [], []
    for i in range(4):
        loss, g = g1(trainable, jnp.asarray(rows[i]), jnp.asarray(masks[i]))
        leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(g)]
        norm = math.sqrt(sum(float((x ** 2).sum()) for x in leaves))
        norms.append(norm)
        losses.append(float(loss))
        scaled = [x * min(1.0, 0.05 / norm) for x in leaves]
        want = scaled if want is None else [a + b for a, b in zip(want, scaled)]
    for got, ref in zip(jax.tree_util.tree_leaves(summed), want):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=1e-7)
    assert int(n_clipped) == sum(n > 0.05 for n in norms) and float(loss_sum) == pytest.approx(sum(losses), rel=1e-5)


def test_dp_finetune_adds_the_noise_the_accountant_counts(tiny):
    """Two DP-SGD steps (SGD, sample rate 1, full fine-tune) against the non-private twin on the same six records.
    Without noise the two runs could differ by at most what clipping allows: lr * sum over steps of (the clipped sum's
    norm, at most clip * rows, plus the twin's gradient sum's norm) / divisor. With noise multiplier sigma they differ
    by the noise, whose norm is lr * sigma * clip * sqrt(2 d) / divisor for d trainable coordinates (two independent
    draws; a chi distribution, within 2% at this d), far above that bound. A fine-tune that adds no noise, or noise of
    another scale, fails."""
    import jax

    rng = np.random.default_rng(2)
    n, seq = 6, 9
    records = ft.Records(rng.integers(1, V, (n, seq)).astype(np.int32), np.zeros((0, seq), np.int32),
                         np.zeros((0, seq - 1), np.float32), np.zeros(0, np.int64))
    lr, clip, sigma = 0.1, 0.05, 200.0
    cfg = ft.FinetuneConfig(n_private=n, canary_groups=(), steps=2, sample_rate=1.0, lr=lr, dp_clip=clip,
                            dp_noise=sigma)
    divisor = cfg.sample_rate * cfg.expected_records
    assert divisor == n
    private, log_dp, _ = ft.train_finetune(tiny, cfg, records, V, progress=False)
    twin, log_np, _ = ft.train_finetune(tiny, cfg.replace(dp_noise=None), records, V, progress=False)
    mask = ft.trainable_mask(ft.start_tree(tiny.params, cfg, V), cfg)
    a = ft.split(private, mask)[0]
    b = ft.split(twin, mask)[0]
    diff = [np.asarray(x, np.float64) - np.asarray(y, np.float64)
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
    d = sum(x.size for x in diff)
    gap = math.sqrt(sum(float((x ** 2).sum()) for x in diff))
    clipping_alone = lr * sum(clip * r["rows"] / divisor + t["grad_norm"] for r, t in zip(log_dp, log_np))
    noise = lr * sigma * clip * math.sqrt(2 * d) / divisor
    assert [r["rows"] for r in log_dp] == [n, n] and d > 10_000 and clipping_alone < 0.05 * noise
    assert gap > clipping_alone, f"the DP fine-tune is within {gap:.3g} of its non-private twin: no noise"
    assert gap == pytest.approx(noise, rel=0.02 + clipping_alone / noise)


# ----------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_noise_for_epsilon_is_the_smallest_noise_within_the_target():
    cfg = ft.FinetuneConfig(steps=8, sample_rate=1.0, dp_noise=1.0)
    sigma = ft.noise_for_epsilon(cfg, 4.0)
    assert ft.finetune_epsilon(cfg.replace(dp_noise=sigma))[0] <= 4.0 < \
        ft.finetune_epsilon(cfg.replace(dp_noise=sigma * 0.995))[0]


TINY_BASE = dict(max_corpus_bytes=120_000, seq_len=16, vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                 batch_size=8, train_steps=40, checkpoints=(), warmup_steps=4, lr=5e-3, reserved_tokens=40)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from mia.testbed import build_testbed

    return build_testbed("smoke", tmp_path_factory.mktemp("ftbase") / "tb", progress=False, **TINY_BASE)


@pytest.mark.slow
def test_finetune_end_to_end(base, tmp_path):
    """A LoRA fine-tune without privacy and its DP twin on one pool: the records, batches and accountant recorded;
    an untrained canary's contrast is exactly 0 and a trained one's above it (non-private); the directory reused."""
    from mia.testbed.canaries import new_token_contrast

    cfg = ft.FinetuneConfig(n_private=32, canary_groups=(("new", 1, 24), ("new", 4, 6), ("tokens", 1, 10)),
                            canary_len=9, steps=4, sample_rate=0.5, lora_rank=4, lora_alpha=4.0, lr=1.0)
    run = ft.build_finetune(base, tmp_path / "np", cfg, progress=False)
    c = run.canaries()
    kinds, reps, included = ft.plan_pool(cfg)
    assert list(c.kind_of) == list(kinds) and np.array_equal(c.included, included) and c.row_len == 9
    assert np.array_equal(c.copies, np.where(included, reps, 0)) and c.n_copies == int(reps[included].sum())
    m = run.manifest
    start = base.train_steps * base.batch_size
    assert m["private_set"]["rows"] == [start, start + 32] and run.natural_rows() == (start, start + 32)
    assert run.private_record()["records"] == 32 + c.n_copies and m["base"]["sha256"] == base.checkpoint_hash()
    log = [json.loads(x) for x in (run.private_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["rows"] for r in log] == [len(ft.poisson_batch(cfg, s, 32 + c.n_copies)) for s in range(4)]
    s = new_token_contrast(run.load_model(), c)
    new = c.kind_of == "new"
    copy_of = np.repeat(np.arange(c.m), c.copies)  # record 32 + j is copy j
    drawn = np.zeros(c.m, bool)
    for step in range(4):
        idx = ft.poisson_batch(cfg, step, 32 + c.n_copies)
        drawn[copy_of[idx[idx >= 32] - 32]] = True
    assert not drawn[~c.included].any() and drawn[c.included].mean() > 0.8
    # a canary never trained (excluded, or included but never drawn) scores 0 up to float32 rounding (its id's rows
    # equal the spares'; the head's matmul may round a column differently by its position), a trained one above it
    untrained, trained = s[new & ~drawn], s[new & drawn]
    assert np.abs(untrained).max() <= 1e-5, untrained
    assert trained.min() > 100 * 1e-5, trained
    assert ft.build_finetune(base, tmp_path / "np", cfg, progress=False).manifest == m  # reused, not retrained
    private = ft.build_finetune(base, tmp_path / "dp", cfg.replace(dp_noise=2.0), progress=False, canaries_from=run)
    assert private.manifest["canaries"]["sha256"] == m["canaries"]["sha256"]
    assert private.dp_epsilon() == pytest.approx(ft.finetune_epsilon(cfg.replace(dp_noise=2.0))[0])
    assert private.manifest["privacy"]["epsilon_pld"] == pytest.approx(private.dp_epsilon())
    assert 0 <= min(r["clipped"] for r in json.loads(json.dumps(
        [json.loads(x) for x in (private.private_dir / "train_log.jsonl").read_text().splitlines()]))) <= 1
    with pytest.raises(TestbedError, match="not the one this config plans"):
        ft.build_finetune(base, tmp_path / "x", cfg.replace(seed=5), progress=False, canaries_from=run)
