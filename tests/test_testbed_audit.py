"""Testbeds for privacy auditing: canaries with exact membership, DP-SGD training and its accountant, exposure, and
the science checks (eps_lower <= accountant epsilon, AUC falls with epsilon, exposure grows with repetitions).

The module's testbeds are tiny (a 1-layer, 32-wide model on rows of 17 tokens, 40 steps of 8 rows): one ordinary
testbed with 48 canaries and its DP-SGD twin, built once. The larger science check is under ``slow``.
"""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from mia.privacy.one_run import check_lower_bound, one_run_audit
from mia.privacy.exposure import exposure_by_reps
from mia.metrics import auc, epsilon_bound
from mia.testbed import TestbedError, build_testbed, build_twin, preset
from mia.testbed import dp
from mia.testbed.canaries import (CANARY_FILE, Canaries, candidate_rows, canary_exposure, corpus_words, make_canaries,
                                  plan_canaries, sequence_nll)

TINY = dict(max_corpus_bytes=120_000, seq_len=16, vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
            batch_size=8, train_steps=40, checkpoints=(20,), warmup_steps=4, lr=5e-3)
CANARIES = dict(canaries=48, canary_reps=(1, 16))


@pytest.fixture(scope="module")
def canary_testbed(tmp_path_factory):
    """An ordinary tiny testbed with 48 token canaries (reps 1 and 16, alternating)."""
    return build_testbed("smoke", tmp_path_factory.mktemp("canary") / "tb", progress=False, **TINY, **CANARIES)


@pytest.fixture(scope="module")
def dp_twin(canary_testbed, tmp_path_factory):
    """The same data and canaries trained with DP-SGD (Poisson sampling, noise multiplier 1)."""
    return build_twin(canary_testbed, tmp_path_factory.mktemp("dp") / "tb", progress=False, dp_noise=1.0)


def _scores(tb) -> tuple:
    """(membership scores = -total NLL of each canary under the last checkpoint, the canaries)."""
    c = tb.canaries()
    return -sequence_nll(tb.load_model(), c.tokens), c


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------- config
def test_options_off_keep_todays_configs():
    """Without canaries and DP a config, its manifest dict and its hash are exactly those of before the options
    existed (hashes of the presets as they were), whatever the inactive options say."""
    legacy = {"smoke": "abe21287eb214a84", "default": "9299d383b8062909", "large": "4dd040c00f3181a9"}
    for name, h in legacy.items():
        assert preset(name).config_hash == h
        assert preset(name, canary_reps=(2, 3), canary_kind="words", dp_clip=5.0, dp_sampling="fixed").config_hash == h
        d = preset(name).to_dict()
        assert not {"canaries", "canary_reps", "canary_kind", "dp_noise", "dp_clip", "dp_sampling"} & set(d)
    on = preset("smoke", canaries=4)
    assert on.config_hash != legacy["smoke"] and on.to_dict()["canary_reps"] == [1, 4, 16, 64]
    assert preset("smoke", dp_noise=0.0).config_hash not in (legacy["smoke"], on.config_hash)


def test_config_refuses_bad_options():
    with pytest.raises(TestbedError, match="canaries"):
        preset("smoke", canaries=-1)
    with pytest.raises(TestbedError, match=r"canary_reps' must be in \[1, 100\], got 200"):
        preset("smoke", canaries=4, canary_reps=(1, 200))
    with pytest.raises(TestbedError, match="canary_kind.*tokens, words"):
        preset("smoke", canary_kind="bytes")
    with pytest.raises(TestbedError, match="dp_sampling.*poisson, fixed"):
        preset("smoke", dp_noise=1.0, dp_sampling="shuffle")
    with pytest.raises(TestbedError, match="dp_noise"):
        preset("smoke", dp_noise=-0.5)
    with pytest.raises(TestbedError, match="need reserved_tokens >= 3"):
        preset("smoke", canaries=4, canary_reps=(1,), canary_kind="new,tokens")
    with pytest.raises(TestbedError, match="without repeats"):
        preset("smoke", canary_kind="new,new")
    assert preset("smoke", canary_kind=" new , tokens", reserved_tokens=8).canary_kind == "new,tokens"
    # a pool may add more rows than the natural ones (each step trains its natural rows and its copies)
    many = plan_canaries(preset("smoke", canaries=100, canary_reps=(64,)))
    assert many.n_copies > 1600 and many.n_copies == 64 * many.included.sum()


def test_cli_options(tmp_path, capsys):
    from mia.testbed.__main__ import build_parser, check_args, main

    args = build_parser().parse_args(["--canaries", "8", "--canary-reps", "1,2", "--canary-kind", "words",
                                      "--dp-noise", "0.7", "--dp-sampling", "fixed", "--dp-clip", "0.5"])
    overrides = {"canaries": args.canaries, "dp_noise": args.dp_noise, "dp_clip": args.dp_clip}
    check_args(args, overrides)
    cfg = preset("smoke", **overrides)
    assert (cfg.canaries, cfg.canary_reps, cfg.canary_kind) == (8, (1, 2), "words")
    assert (cfg.dp_noise, cfg.dp_clip, cfg.dp_sampling) == (0.7, 0.5, "fixed")
    assert main(["--out", str(tmp_path / "t"), "--canaries", "4", "--canary-reps", "1,500", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "canary_reps" in err[0]


# ----------------------------------------------------------------------------------------------- canary plan
def test_plan_is_fair_recorded_and_from_the_config_alone():
    cfg = preset("default", canaries=400, canary_reps=(1, 4, 16, 64))
    plan, again = plan_canaries(cfg), plan_canaries(cfg)
    assert np.array_equal(plan.included, again.included)
    assert all(np.array_equal(a, b) for a, b in zip(plan.steps, again.steps))
    assert list(plan.reps[:6]) == [1, 4, 16, 64, 1, 4]
    k = int(plan.included.sum())  # Binomial(400, 1/2): within 4 standard deviations
    assert abs(k - 200) < 4 * 10
    for r, inc, st in zip(plan.reps, plan.included, plan.steps):
        assert len(st) == (r if inc else 0) and len(set(st.tolist())) == len(st)
        assert (st >= 0).all() and (st < cfg.train_steps).all()
    assert plan.n_copies == int(plan.reps[plan.included].sum())
    # steps are drawn for every canary, included or not: one canary's inclusion never moves another's copies
    rng = np.random.default_rng([cfg.seed, 0xCA7B])
    drawn = [np.sort(rng.choice(cfg.train_steps, int(r), replace=False)) for r in plan.reps]
    assert all(np.array_equal(st, d) for st, d, inc in zip(plan.steps, drawn, plan.included) if inc)
    other = plan_canaries(cfg.replace(seed=1))
    assert not np.array_equal(other.included, plan.included)


# ----------------------------------------------------------------------------------------------- canary testbed
def test_canary_file_and_batches(canary_testbed):
    tb = canary_testbed
    c = tb.canaries()
    plan = plan_canaries(tb.config)
    assert c.m == 48 and np.array_equal(c.included, plan.included) and np.array_equal(c.reps, plan.reps)
    vocab = tb.manifest["tokenizer"]["vocab_size"]
    assert c.tokens.shape == (48, tb.row_len) and c.tokens.min() >= 1 and c.tokens.max() < vocab
    assert len(np.unique(c.tokens, axis=0)) == 48
    raw = json.loads((tb.root / CANARY_FILE).read_text())
    assert [r["id"] for r in raw["canaries"]] == list(range(48))
    assert tb.manifest["canaries"]["sha256"] == _sha(tb.root / CANARY_FILE)
    # every copy has its own (step, slot); slots follow the batch's natural rows
    pos = [tuple(p) for r in raw["canaries"] for p in r["positions"]]
    assert len(pos) == len(set(pos)) == c.n_copies and all(slot >= tb.batch_size for _, slot in pos)
    # the trainer's batches: the order's natural rows, then the recorded copies; the log counts them
    from mia.testbed.train import BatchRows

    batches = BatchRows(tb.config, tb.dataset(), c)
    ds = tb.dataset()
    log = [json.loads(line) for line in (tb.root / "train_log.jsonl").read_text().splitlines()]
    for s in range(tb.train_steps):
        rows = batches(s)
        B = tb.batch_size
        np.testing.assert_array_equal(rows[:B], ds[s * B:(s + 1) * B])
        np.testing.assert_array_equal(rows[B:], c.tokens[c.copies_at(s)])
        assert log[s]["rows"] == len(rows)
    # membership at an intermediate checkpoint: copies trained before it
    seen = c.seen_before(20)
    assert all(seen[i] == sum(1 for x in c.steps[i] if x < 20) for i in range(48))
    assert (seen[~c.included] == 0).all()


def test_twin_shares_data_and_canaries(canary_testbed, dp_twin):
    for rel in ("data/order.bin", "data/order.idx", "data/order.perm.npy", "tokenizer.json", CANARY_FILE):
        assert _sha(canary_testbed.root / rel) == _sha(dp_twin.root / rel), rel
    with pytest.raises(TestbedError, match="cannot change canaries"):
        build_twin(canary_testbed, canary_testbed.root.parent / "x", canaries=3)


def test_word_canaries_are_corpus_words_in_the_testbed_tokenization(canary_testbed):
    from mia.data.corpus import load_corpus

    tb = canary_testbed
    tok = tb.tokenizer()
    texts = load_corpus(None, "text", TINY["max_corpus_bytes"]).texts
    cfg = tb.config.replace(canary_kind="words")
    c = make_canaries(cfg, tok, texts)
    words = set(corpus_words(texts))
    assert c.kind == "words" and c.tokens.shape == (48, tb.row_len) and set(c.words) == words
    for row in c.tokens[:5]:
        text = tok.decode(row.tolist())
        assert all(w in words for w in text.split()[:-1])  # the last word may be cut
    cand = candidate_rows(c, 10, seed=1, tokenizer=tok)
    assert cand.shape == (10, tb.row_len) and not any((cand == t).all(1).any() for t in c.tokens)
    again = Canaries.from_json(json.loads(json.dumps(c.to_json())))
    np.testing.assert_array_equal(again.tokens, c.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(again.steps, c.steps))


KINDS = "new,unigram,bigram,sampled,tokens,words"


@pytest.fixture(scope="module")
def kinds_world():
    """What the canary kinds draw from, without training anything: a tokenizer with 16 reserved ids, the packed
    corpus and an untrained sampler."""
    import jax.numpy as jnp

    from mia.data.corpus import load_corpus
    from mia.models import from_config
    from mia.models.hub import family
    from mia.testbed.build import model_config
    from mia.testbed.init import init_params
    from mia.testbed.packing import dedup_rows, pack_rows
    from mia.testbed.tokenizer import encode_documents, train_tokenizer

    texts = load_corpus(None, "text", 60_000).texts
    tok = train_tokenizer(texts, 300, reserved=16)
    cfg = preset("smoke", **{**TINY, "max_corpus_bytes": 60_000}, reserved_tokens=16, canaries=24, canary_reps=(1, 4),
                 canary_kind=KINDS)
    rows, _ = dedup_rows(pack_rows(encode_documents(tok, texts), cfg.row_len))
    mcfg = model_config(cfg, len(tok))
    sampler = from_config(mcfg, params=init_params(family("gpt_neox").module_cls(mcfg, dtype=jnp.float32,
                                                                                  param_dtype=jnp.float32), 0))
    return cfg, tok, texts, rows, sampler


def test_canary_kinds_are_recorded_and_reproducible(kinds_world):
    """Every kind of a mixed pool is drawn as its definition says, recorded in canaries.json (kind and secret of each
    canary, each kind's parameters) and drawn again identically from the seed (another seed: other rows)."""
    from mia.testbed.canaries import RARE_POOL, kind_params, rare_successors, rare_tokens
    from mia.testbed.tokenizer import reserved_ids

    cfg, tok, texts, rows, sampler = kinds_world
    c = make_canaries(cfg, tok, texts, rows=rows, sampler=sampler)
    again = make_canaries(cfg, tok, texts, rows=rows, sampler=sampler)
    np.testing.assert_array_equal(c.tokens, again.tokens)
    other = make_canaries(cfg.replace(seed=1), tok, texts, rows=rows, sampler=sampler)
    assert not np.array_equal(c.tokens, other.tokens)
    reserved = reserved_ids(tok)
    assert len(reserved) == 16 and reserved.stop == len(tok) and rows.max() < reserved.start  # never in the corpus
    # kinds cycle in blocks of len(canary_reps): every (kind, reps) pair has as many canaries
    kinds = list(KINDS.split(","))
    assert list(c.kind_of) == [kinds[(i // 2) % 6] for i in range(24)]
    assert all(((c.kind_of == k) & (c.reps == r)).sum() == 2 for k in kinds for r in (1, 4))
    by = {k: c.tokens[c.kind_of == k] for k in kinds}
    new_ids = by["new"][:, -1]
    assert list(new_ids) == list(range(reserved.start, reserved.start + 4))  # one reserved id each, in id order
    assert set(c.spare_ids) == set(range(reserved.start + 4, reserved.stop))
    assert (by["new"][:, :-1] < reserved.start).all() and (c.secrets[c.kind_of == "new"] == cfg.row_len - 1).all()
    assert (c.secrets[c.kind_of != "new"] == 0).all()
    counts = np.bincount(rows.ravel(), minlength=reserved.start)[:reserved.start]
    assert set(by["unigram"].ravel()) <= set(rare_tokens(counts).tolist()) and len(rare_tokens(counts)) == RARE_POOL
    assert all(counts[t] >= 1 for t in rare_tokens(counts)) and 0 not in rare_tokens(counts)
    for k in ("tokens", "sampled", "unigram", "bigram", "words"):
        assert (by[k] >= 1).all() and (by[k] < reserved.start).all(), k
    # bigram: each next token is one of the rarest successors of the previous one (the same seeded table)
    pairs = np.zeros((reserved.start, reserved.start), np.int64)
    np.add.at(pairs, (rows[:, :-1].ravel(), rows[:, 1:].ravel()), 1)
    succ = rare_successors(pairs, counts, 8, np.random.default_rng([cfg.seed, 0xCA7C, 5]))
    assert all(b in succ[a] for row in by["bigram"] for a, b in zip(row[:-1], row[1:]))
    # the record: kind, secret and parameters, read back exactly
    d = json.loads(json.dumps(c.to_json()))
    assert d["kinds"] == {k: kind_params(k) for k in kinds} and d["spare_ids"] == list(c.spare_ids)
    assert [r["kind"] for r in d["canaries"]] == list(c.kind_of)
    back = Canaries.from_json(d)
    np.testing.assert_array_equal(back.tokens, c.tokens)
    np.testing.assert_array_equal(back.secrets, c.secrets)
    assert list(back.kind_of) == list(c.kind_of) and back.spare_ids == c.spare_ids
    mask = back.secret_mask()  # a new-token canary's loss and score: its last prediction only
    assert mask[c.kind_of == "new"].sum(1).tolist() == [1.0] * 4 and (mask[c.kind_of == "tokens"] == 1).all()


def test_new_token_contrast_is_zero_without_training(kinds_world):
    """The reserved ids start equal (zero rows): before any training, every new-token canary's contrast is 0 exactly,
    and the other kinds get no score."""
    import jax.numpy as jnp

    from mia.models import from_config
    from mia.models.hub import family
    from mia.testbed.build import model_config, zero_reserved_rows
    from mia.testbed.canaries import new_token_contrast
    from mia.testbed.init import init_params
    from mia.testbed.tokenizer import reserved_ids

    cfg, tok, texts, rows, sampler = kinds_world
    c = make_canaries(cfg.replace(canary_kind="new,tokens"), tok, texts, rows=rows)
    mcfg = model_config(cfg, len(tok))
    params = init_params(family("gpt_neox").module_cls(mcfg, dtype=jnp.float32, param_dtype=jnp.float32), 3)
    model = from_config(mcfg, params=zero_reserved_rows(params, reserved_ids(tok).start))
    s = new_token_contrast(model, c)
    assert (s[c.kind_of == "new"] == 0).all() and np.isnan(s[c.kind_of == "tokens"]).all()
    # a canary whose reserved id's output row moved towards its context scores above 0, the others stay at 0. The
    # context is the final hidden state h that predicts the id (its last token), read through an identity head;
    # adding 2 h / |h|^2 to the id's output row raises its logit there by exactly 2, so its NLL falls and every
    # spare's rises: the contrast is positive by construction.
    i = int(np.flatnonzero(c.kind_of == "new")[0])
    kernel = model.params["embed_out"]["kernel"]
    probe = {**model.params, "embed_out": {"kernel": jnp.eye(mcfg.hidden_size, kernel.shape[1], dtype=kernel.dtype)}}
    h = np.asarray(model.logits(probe, jnp.asarray(c.tokens[i:i + 1, :-1])))[0, -1, :mcfg.hidden_size]
    moved = {**model.params, "embed_out": {"kernel": kernel.at[:, int(c.tokens[i, -1])].add(2 * h / (h @ h))}}
    s2 = new_token_contrast(from_config(mcfg, params=moved), c)
    assert s2[i] > 0.1 and np.count_nonzero(s2[c.kind_of == "new"]) == 1


def test_sequence_nll_is_the_training_loss(canary_testbed):
    import jax.numpy as jnp

    from mia.testbed.train import row_losses

    model = canary_testbed.load_model()
    rows = canary_testbed.canaries().tokens[:5]
    want = np.asarray(row_losses(model, model.params, jnp.asarray(rows, jnp.int32))) * (rows.shape[1] - 1)
    np.testing.assert_allclose(sequence_nll(model, rows, batch_size=2), want, rtol=1e-5)


def test_exposure_grows_with_repetitions(canary_testbed):
    """Non-private model: canaries trained 16 times are more exposed than those trained once, which are more
    exposed than excluded ones (the no-memorization baseline)."""
    tb = canary_testbed
    c = tb.canaries()
    e = canary_exposure(tb.load_model(), c, n_candidates=400, seed=0, method="skewnorm")
    rows = {r["reps"]: r for r in exposure_by_reps(e, c.reps, c.included)}
    excluded = float(np.mean(e[~c.included]))
    assert rows[16]["mean"] > rows[1]["mean"] > excluded, (rows, excluded)
    assert rows[16]["mean"] > excluded + 4


# ----------------------------------------------------------------------------------------------- DP twin
def test_dp_twin_records_its_accountant(dp_twin):
    p = dp_twin.manifest["privacy"]
    assert p["epsilon_pld"] == pytest.approx(dp.accountant_epsilon(dp_twin.config))
    assert p["records"] == 40 * 8 + dp_twin.canaries().n_copies
    assert p["delta"] == pytest.approx(1 / dp.max_records(dp_twin.config))
    assert dp.max_records(dp_twin.config) == 40 * 8 + int(dp_twin.canaries().reps.sum())  # every copy counted
    assert p["sample_rate"] == pytest.approx(1 / 40)  # fixed by the config, whatever the canaries
    assert dp_twin.dp_epsilon(20) < dp_twin.dp_epsilon() == pytest.approx(p["epsilon_pld"])
    log = [json.loads(line) for line in (dp_twin.root / "train_log.jsonl").read_text().splitlines()]
    sizes = [r["rows"] for r in log]
    assert sizes == [len(dp.poisson_batch(dp_twin.config, s)) for s in range(40)]
    assert 0 <= min(r["clipped"] for r in log) and max(r["clipped"] for r in log) <= 1
    with pytest.raises(TestbedError, match="memorization dial trains without privacy"):
        dp_twin.memorize([0], epochs=1)


def test_dp_audit_respects_the_accountant_and_hides_canaries(canary_testbed, dp_twin):
    """The science checks at the smallest size: no attack bound exceeds the accountant's epsilon (per record for
    canaries inserted once, by group privacy for those inserted 16 times), and DP lowers the canaries' AUC."""
    s_dp, c = _scores(dp_twin)
    s_plain, _ = _scores(canary_testbed)
    delta = dp.default_delta(dp_twin.config)
    eps = dp_twin.dp_epsilon()
    for r in (1, 16):
        sel = c.reps == r
        y = c.included[sel].astype(int)
        eps_r, delta_r = dp.canary_epsilon(dp_twin.config, r)
        if delta_r < 1:
            lower = epsilon_bound(s_dp[sel], y, delta=delta_r).epsilon
            check_lower_bound(lower, eps_r, what=f"reps {r}, Clopper-Pearson")
            check_lower_bound(one_run_audit(s_dp[sel], c.included[sel], delta=delta_r).epsilon, eps_r,
                              what=f"reps {r}, one run")
    one = c.reps == 1
    check_lower_bound(epsilon_bound(s_dp[one], c.included[one].astype(int), delta=delta).epsilon, eps)
    many = c.reps == 16
    auc_plain = auc(s_plain[many], c.included[many].astype(int))
    auc_dp = auc(s_dp[many], c.included[many].astype(int))
    assert auc_plain > 0.9 and auc_dp < auc_plain - 0.1, (auc_plain, auc_dp)


# ----------------------------------------------------------------------------------------------- DP mechanics
@pytest.fixture(scope="module")
def tiny_model():
    import jax.numpy as jnp

    from mia.models import from_config
    from mia.models.hub import family
    from mia.testbed.build import model_config
    from mia.testbed.init import init_params

    cfg = preset("smoke", vocab_size=300, seq_len=8, hidden_size=16, num_layers=1, num_heads=2)
    mcfg = model_config(cfg, 300)
    params = init_params(family("gpt_neox").module_cls(mcfg, dtype=jnp.float32, param_dtype=jnp.float32), 0)
    return from_config(mcfg, params=params)


def test_clipped_sum_matches_one_example_at_a_time(tiny_model):
    import jax
    import jax.numpy as jnp

    from mia.testbed.train import row_loss

    model = tiny_model
    rows = np.random.default_rng(0).integers(1, 300, (5, 9)).astype(np.int32)
    mask = np.array([1, 1, 1, 1, 0], np.float32)
    clip = 0.05  # small enough that every example is clipped
    summed, n_clipped, loss_sum = dp.make_clipped_sum(model, clip)(model.params, rows, mask)
    one_grad = jax.jit(jax.value_and_grad(lambda p, r: row_loss(model, p, r)))  # one row at a time: no vmap
    want = None
    norms = []
    losses = []
    for i in range(4):
        loss, g = one_grad(model.params, jnp.asarray(rows[i:i + 1]))
        losses.append(float(loss))
        leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(g)]
        norm = math.sqrt(sum(float((x ** 2).sum()) for x in leaves))
        norms.append(norm)
        scaled = [x * min(1.0, clip / norm) for x in leaves]
        want = scaled if want is None else [a + b for a, b in zip(want, scaled)]
    for got, ref in zip(jax.tree_util.tree_leaves(summed), want):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=1e-7)
    assert int(n_clipped) == sum(n > clip for n in norms) == 4
    assert float(loss_sum) == pytest.approx(sum(losses), rel=1e-5)


def test_noisy_update_adds_the_configured_noise(tiny_model):
    import jax
    import optax

    params = tiny_model.params
    zeros = jax.tree_util.tree_map(np.zeros_like, params)
    sigma, clip, B = 2.0, 0.5, 4
    update = dp.make_noisy_update(optax.sgd(1.0), sigma, clip, B)
    new, _, _ = update(params, optax.sgd(1.0).init(params), zeros, dp.noise_key(0, 3))
    delta = np.concatenate([np.ravel(np.asarray(a) - np.asarray(b)) for a, b in
                            zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(params))])
    assert delta.size > 5000
    assert np.std(delta) == pytest.approx(sigma * clip / B, rel=0.05) and abs(np.mean(delta)) < 0.02
    again, _, _ = update(params, optax.sgd(1.0).init(params), zeros, dp.noise_key(0, 3))
    other, _, _ = update(params, optax.sgd(1.0).init(params), zeros, dp.noise_key(0, 4))
    leaf = lambda t: np.asarray(jax.tree_util.tree_leaves(t)[0])  # noqa: E731
    np.testing.assert_array_equal(leaf(again), leaf(new))  # the key fixes the noise: resumable
    assert not np.array_equal(leaf(other), leaf(new))
    quiet = dp.make_noisy_update(optax.sgd(1.0), 0.0, clip, B)  # no noise: plain mean of the clipped sum
    ones = jax.tree_util.tree_map(np.ones_like, params)
    new0, _, _ = quiet(params, optax.sgd(1.0).init(params), ones, dp.noise_key(0, 0))
    np.testing.assert_allclose(leaf(params) - leaf(new0), 1.0 / B, rtol=1e-6)


def test_poisson_batches():
    cfg = preset("smoke", dp_noise=1.0)
    n = dp.n_records(cfg)
    sizes = [len(dp.poisson_batch(cfg, s)) for s in range(100)]
    assert abs(np.mean(sizes) - cfg.batch_size) < 4 * math.sqrt(cfg.batch_size / 100)
    np.testing.assert_array_equal(dp.poisson_batch(cfg, 7), dp.poisson_batch(cfg, 7))
    assert not np.array_equal(dp.poisson_batch(cfg, 7), dp.poisson_batch(cfg, 8))
    assert dp.poisson_batch(cfg, 3).max() < n


def test_accountant():
    from dp_accounting import get_epsilon_gaussian

    fixed = preset("smoke", dp_noise=1.5, dp_sampling="fixed")
    n = dp.n_records(fixed)
    # fixed batches: one Gaussian mechanism per record (the analytic Gaussian epsilon; PLD is a slightly larger bound)
    exact = get_epsilon_gaussian(1.5, 1 / n)
    assert exact <= dp.accountant_epsilon(fixed) <= exact * 1.01
    # a canary with 4 copies under fixed batches: one Gaussian with sigma / 2
    e4, d4 = dp.canary_epsilon(fixed, 4)
    assert d4 == pytest.approx(1 / n) and e4 == pytest.approx(get_epsilon_gaussian(0.75, 1 / n), rel=0.01)
    poisson = preset("smoke", dp_noise=1.5, train_steps=40, checkpoints=())
    e_pld, e_rdp = dp.accountant_epsilon(poisson), dp.accountant_epsilon(poisson, accountant="rdp")
    assert 0 < e_pld <= e_rdp  # both upper bounds, PLD the tighter
    assert e_pld < dp.accountant_epsilon(fixed)  # amplification by sampling
    assert dp.accountant_epsilon(poisson, steps=10) < e_pld
    assert dp.accountant_epsilon(poisson.replace(dp_noise=3.0)) < e_pld
    assert dp.accountant_epsilon(poisson.replace(dp_noise=0.0)) == math.inf
    sigma = dp.noise_for_epsilon(fixed, 2.0, tol=1e-3)  # fixed batches: one Gaussian, quick to account
    assert dp.accountant_epsilon(fixed.replace(dp_noise=sigma)) <= 2.0 < \
        dp.accountant_epsilon(fixed.replace(dp_noise=sigma * 0.995))
    with pytest.raises(TestbedError, match="not private"):
        dp.accountant_epsilon(preset("smoke"))


# ----------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_dp_resume_equals_uninterrupted(canary_testbed, dp_twin, tmp_path):
    from mia.models.hub import read_safetensors

    part = build_twin(canary_testbed, tmp_path / "dp", progress=False, dp_noise=1.0, stop_after=25, save_every=10)
    assert not json.loads((part.root / "testbed.json").read_text())["complete"]
    done = build_twin(canary_testbed, tmp_path / "dp", progress=False, dp_noise=1.0, save_every=10)
    a = read_safetensors(dp_twin.checkpoint_dir() / "model.safetensors")
    b = read_safetensors(done.checkpoint_dir() / "model.safetensors")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_science_checks(tmp_path):
    """A larger pool (96 canaries, reps 1, 4, 16, 64) on a 100-step testbed and its DP twins at three noise levels:
    eps_lower never exceeds the accountant's epsilon, the canaries' AUC falls as epsilon shrinks, and exposure grows
    with repetitions on the non-private model. Prints the measured numbers."""
    kw = dict(TINY, batch_size=16, train_steps=100, checkpoints=(), warmup_steps=10, canaries=96,
              canary_reps=(1, 4, 16, 64))
    plain = build_testbed("smoke", tmp_path / "plain", progress=False, **kw)
    s, c = _scores(plain)
    e = canary_exposure(plain.load_model(), c, n_candidates=1000, method="skewnorm")
    by_r = exposure_by_reps(e, c.reps, c.included)
    print("exposure by reps (non-private):", [(r["reps"], round(r["mean"], 2)) for r in by_r])
    means = [r["mean"] for r in by_r]
    assert means[-1] > means[0] and all(b >= a - 1.0 for a, b in zip(means, means[1:]))
    y = c.included.astype(int)
    for r in (1, 4, 16, 64):  # what the attack proves about the non-private model (per group of r copies)
        sel = c.reps == r
        print(f"non-private, reps {r}: AUC {auc(s[sel], y[sel]):.3f}, eps_lower "
              f"{epsilon_bound(s[sel], y[sel], delta=1e-5).epsilon:.3f} (Clopper-Pearson), "
              f"{one_run_audit(s[sel], c.included[sel], delta=1e-5).epsilon:.3f} (one run), delta 1e-5")
    aucs = [(math.inf, auc(s, y))]
    for sigma in (0.5, 1.0, 2.0):
        tb = build_twin(plain, tmp_path / f"dp{sigma}", progress=False, dp_noise=sigma)
        sd, _ = _scores(tb)
        eps = tb.dp_epsilon()
        aucs.append((eps, auc(sd, y)))
        for r in (1, 4, 16, 64):
            sel = c.reps == r
            eps_r, delta_r = dp.canary_epsilon(tb.config, r)
            if delta_r >= 1:
                continue
            lo = max(epsilon_bound(sd[sel], y[sel], delta=delta_r).epsilon,
                     one_run_audit(sd[sel], c.included[sel], delta=delta_r).epsilon)
            print(f"sigma {sigma}: eps {eps:.3f}; reps {r}: group eps {eps_r:.3f} at delta {delta_r:.2g}, "
                  f"eps_lower {lo:.3f}")
            check_lower_bound(lo, eps_r, what=f"sigma {sigma}, reps {r}")
    print("AUC by epsilon:", [(round(a, 3), round(b, 3)) for a, b in aucs])
    assert aucs[0][1] > aucs[-1][1] + 0.1 and abs(aucs[-1][1] - 0.5) < 0.2


def test_membership_at_checkpoints(canary_testbed, dp_twin):
    B, T = canary_testbed.batch_size, canary_testbed.train_steps
    c = canary_testbed.canaries()
    assert canary_testbed.natural_membership(20) == (20 * B, 20 * B)
    np.testing.assert_array_equal(canary_testbed.canary_membership(20), c.seen_before(20) > 0)
    np.testing.assert_array_equal(canary_testbed.canary_membership(), c.included)  # every included copy trained
    assert dp_twin.natural_membership(20) == (T * B, T * B) and dp_twin.natural_membership(0) == (0, 0)
    np.testing.assert_array_equal(dp_twin.canary_membership(20), c.included)
    assert not dp_twin.canary_membership(0).any()
