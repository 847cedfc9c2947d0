"""Gradient attacks (gradnorm, alora, jl) against an obvious PyTorch autograd loop at batch 1 on the same weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mia.attacks import get
from mia.attacks import gradients as G
from mia.models.family import family

from mia.data.examples import Example

from attack_helpers import ctx_for

LENGTHS = (5, 17, 9, 30)


@pytest.fixture(scope="module")
def rows(tiny_model):
    """Right-padded tokens [B, T], valid [B, T] and the unpadded sequences."""
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, tiny_model.vocab_size, n).astype(np.int32) for n in LENGTHS]
    t = 33
    tok, val = np.zeros((len(seqs), t), np.int32), np.zeros((len(seqs), t), bool)
    for i, s in enumerate(seqs):
        tok[i, :len(s)], val[i, :len(s)] = s, True
    return tok, val, seqs


def torch_reference(model, seq, lr=None):
    """pandora's way, one example at a time: {hf name: (||g||_1, ||g||_2, ||g||_inf)} and, with ``lr``, the loss
    after one SGD step minus the loss before (the parameters restored afterwards)."""
    import torch

    ids = torch.tensor(np.asarray(seq, np.int64))[None]
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    norms = {n: tuple(float(torch.linalg.vector_norm(p.grad.double().flatten(), o)) for o in (1, 2, float("inf")))
             for n, p in model.named_parameters()}
    delta = None
    if lr is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
            delta = float(model(input_ids=ids, labels=ids).loss) - float(out.loss)
            for p in model.parameters():
                p.add_(p.grad, alpha=lr)
    model.zero_grad()
    return norms, delta


def feature_index(model):
    """hf name -> column of mia's per-tensor features (through the family's own name mappings)."""
    names = G.tensor_names(model.params, model.module.LAYERS)
    out = {}
    for m in family(model.model_type).param_mappings(model.config):
        name = ".".join(m.path) if m.layer is None else f"{m.path[0]}.{m.layer}.{'.'.join(m.path[1:])}"
        out[m.hf_name] = names.index(name)
    return out


def hf_key(torch_name: str) -> str:
    """The checkpoint's tensor name of a torch parameter (transformers 5 calls GPT-NeoX's embed_out lm_head)."""
    return {"lm_head.weight": "embed_out.weight"}.get(torch_name, torch_name)


def on_every_device(step, model, tok, val) -> np.ndarray:
    """``step(params, tok, val)`` as the engine calls it: the rows padded with empty ones to a multiple of the
    mesh's data axis (each device holds whole rows; so it runs under 8 CPU devices too), the padding cut off."""
    from mia.engine.loop import engine_layout
    from mia.sharding import data_size

    n, pad = len(tok), -len(tok) % data_size(engine_layout(model)[0])
    tok, val = np.pad(np.asarray(tok), ((0, pad), (0, 0))), np.pad(np.asarray(val, bool), ((0, pad), (0, 0)))
    return np.asarray(step(model.params, tok, val), np.float64)[:n]


@pytest.fixture(scope="module")
def norms(tiny_model, rows):
    """gradnorm's features of the padded rows, 3 rows per vmapped chunk."""
    tok, val, _ = rows
    return on_every_device(G.jitted_gradient_step(tiny_model, "gradnorm", 3), tiny_model, tok, val)


@pytest.fixture(scope="module")
def alora(tiny_model, rows):
    """alora's scores of the padded rows at lr = 0.05 (large enough that the step changes the loss well beyond
    rounding), 2 rows per vmapped chunk."""
    tok, val, _ = rows
    return on_every_device(G.jitted_gradient_step(tiny_model, "alora", 2, 0.05), tiny_model, tok, val)


def test_gradnorm_matches_torch_autograd(tiny_model, tiny_neox_torch, rows, norms):
    """Padded rows in chunks of 3 against torch on each unpadded row alone."""
    _, _, seqs = rows
    feats = norms
    index = feature_index(tiny_model)
    assert feats.shape == (len(seqs), len(index), 3)
    assert sorted(index) == sorted(hf_key(n) for n, _ in tiny_neox_torch.named_parameters())
    for i, s in enumerate(seqs):
        ref, _ = torch_reference(tiny_neox_torch, s)
        ours = np.array([feats[i, index[hf_key(n)]] for n in ref])
        np.testing.assert_allclose(ours, np.array(list(ref.values())), rtol=1e-4, atol=1e-9)
        whole = {p: np.linalg.norm(np.array([v[k] for v in ref.values()]), o)
                 for k, (p, o) in enumerate((("1", 1), ("2", 2), ("inf", np.inf)))}
        for p, norm in whole.items():  # the scalar: pandora's theta_grad_p, negated
            np.testing.assert_allclose(float(G.gradnorm_score(jnp.asarray(feats[i:i + 1]), p)[0]), -norm, rtol=1e-4)


def test_alora_matches_torch_autograd(tiny_neox_torch, rows, alora):
    ours = alora
    ref = np.array([torch_reference(tiny_neox_torch, s, 0.05)[1] for s in rows[2]])
    assert (ref < 0).all()  # a descent step on the example lowers its loss
    np.testing.assert_allclose(ours, ref, rtol=1e-4)


def test_padding_and_chunking_change_nothing(tiny_model, rows, norms):
    """More padding, one row per chunk, a batch that is not a multiple of the chunk: the same features."""
    tok, val, _ = rows
    wide_t, wide_v = np.pad(tok, ((0, 1), (0, 15))), np.pad(val, ((0, 1), (0, 15)))
    wide_t[-1] = 7  # an extra row with no valid token: a zero gradient, cut from nothing else
    got = np.asarray(jax.jit(G.make_gradnorm(tiny_model, chunk=2))(tiny_model.params, wide_t, wide_v))
    np.testing.assert_allclose(got[:-1], norms, rtol=2e-5, atol=1e-9)
    assert not got[-1].any()


@pytest.mark.slow
def test_jl_is_a_fixed_projection_of_each_gradient(tiny_model, rows):
    tok, val, seqs = rows
    k = 3
    fn = G.make_jl(tiny_model, k=k, seed=7, chunk=2, block=900)  # small blocks: several per tensor
    feats = np.asarray(jax.jit(fn)(tiny_model.params, tok, val), np.float64)
    layers = tiny_model.module.LAYERS
    names = G.tensor_names(tiny_model.params, layers)
    assert feats.shape == (len(seqs), len(names) * k)
    # the reference: the whole gradient of row 1, each tensor times R_t built from the documented blocks
    g = jax.grad(lambda p: G.row_loss(tiny_model, p, jnp.asarray(tok[1]), jnp.asarray(val[1])))(tiny_model.params)
    top, stack = G.split_layers(g, layers)
    tensors = [np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(top)]
    stacked = jax.tree_util.tree_leaves(stack)
    tensors += [np.asarray(x[i]).ravel() for i in range(stacked[0].shape[0]) for x in stacked]
    for t, x in enumerate(tensors):
        rows_b = max(1, min(len(x), 900 // k))
        n_b = -(-len(x) // rows_b)
        key = jax.random.fold_in(jax.random.PRNGKey(7), t)
        r = np.concatenate([np.asarray(jax.random.normal(jax.random.fold_in(key, b), (rows_b, k)))
                            for b in range(n_b)])[:len(x)]
        np.testing.assert_allclose(feats[1, t * k:(t + 1) * k], x @ r, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_orientation_members_score_higher(tiny_model):
    """A few SGD steps on 'member' rows: gradnorm and alora rank them above unseen rows (higher = member)."""
    rng = np.random.default_rng(0)
    members = rng.integers(0, tiny_model.vocab_size, (6, 24)).astype(np.int32)
    others = rng.integers(0, tiny_model.vocab_size, (6, 24)).astype(np.int32)
    valid = np.ones_like(members, bool)
    loss = jax.jit(jax.grad(lambda p: jnp.mean(jax.vmap(lambda t, v: G.row_loss(tiny_model, p, t, v))(
        members, valid))))
    params = tiny_model.params
    for _ in range(30):
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, loss(params))
    both = np.concatenate([members, others])
    ok = np.ones_like(both, bool)
    norms = jax.jit(G.make_gradnorm(tiny_model, chunk=4))(params, both, ok)
    gn = np.asarray(G.gradnorm_score(norms, "2"))
    al = np.asarray(jax.jit(G.make_alora(tiny_model, 0.05, chunk=4))(params, both, ok))
    for s in (gn, al):
        assert s[:6].min() > s[6:].max()


def test_registered_attacks_follow_the_pure_functions(tiny_model, rows, norms, alora):
    ex = [Example(f"r{i}", seq, label=i % 2) for i, seq in enumerate(rows[2])]
    ctx = ctx_for(tiny_model, ex)
    np.testing.assert_allclose(get("gradnorm").fn(ctx, p="inf", chunk=3), -norms[:, :, 2].max(1), rtol=2e-5)
    np.testing.assert_allclose(get("alora").fn(ctx, lr=0.05, chunk=2), alora, rtol=1e-5, atol=1e-8)
    assert get("gradnorm").cost == get("alora").cost == get("jl").cost == "heavy"  # opt-in by cost


@pytest.mark.slow
def test_benchmark_runs_at_a_tiny_size(capsys):
    """experiments.bench_gradients end to end (both sides agree, or it raises) on a tiny model."""
    from experiments.bench_gradients import main

    main(["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "128", "--texts", "3", "--length", "20",
          "--chunk", "2"])
    out = capsys.readouterr().out
    assert "| gradnorm |" in out and "| alora |" in out
