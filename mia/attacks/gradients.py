"""Gradient attacks (pandora_llm's GradNorm, ALoRa and JL): pure jitted functions of (params, tokens, mask).
docs/algorithms.md#gradnorm, #alora, #jl.

Every attack differentiates one example's loss, the mean token NLL over its T-1 predicted positions (padding
masked; the loss transformers' ``labels=input_ids`` gives on the unpadded text):

  L(theta; x) = -1/|M| sum_{i in M} log p_theta(x_{i+1} | x_<=i)          g(x) = grad_theta L(theta; x)

``vmap`` over a chunk of ``chunk`` rows gives the per-example gradients of that chunk, and ``lax.map`` runs the
chunks of a batch one after another, so at most ``chunk`` gradients (each the size of the parameters) exist at once:
the peak is about the params + chunk x (params + one example's activations) (``mia plan --attack gradnorm``). The
parameters are never changed: a step is a new value.

Tensors: the parameters' leaves outside the layer stack (embeddings, final norm, head), in tree order, then for each
decoder layer l = 0 .. L-1 its slice of every stacked leaf, in tree order (``tensor_names``). They are one-to-one
with transformers' ``named_parameters()`` (the family's ``param_mappings``; a transposed kernel has the same norms).

  gradnorm  features [n_tensors, 3]: ||g_t||_1, ||g_t||_2, ||g_t||_inf of every tensor t (pandora's
            ``layerwise_grad_p``). Score: -||g||_p of the WHOLE gradient (pandora's ``theta_grad_p``, which is the
            p-norm of the per-tensor p-norms), p = 2 by default. HIGHER = MEMBER (members sit near a minimum: smaller
            gradients). Not mimir's scalar (the mean over tensors of the per-tensor norms, p = inf): that one depends
            on how a framework cuts the parameters into tensors (a fused QKV, a tied head, a bias of 512 numbers
            weighted like an embedding of 25 million), the whole-gradient norm does not.
  alora     L(theta - lr g(x); x) - L(theta; x): the loss after one SGD step on x minus the loss before (pandora's
            stepped and base losses), one step per example. HIGHER = MEMBER (to first order the change is
            -lr ||g||_2^2, and members have small gradients, so their loss falls less).
  jl        features [n_tensors * k]: each tensor's flattened gradient times a fixed random matrix R_t [d_t, k]
            (pandora's per-tensor Johnson-Lindenstrauss projection; entries N(0, 1), or +-1 for rademacher, not
            rescaled), seeded: R_t's rows come in blocks of ``PROJ_BLOCK // k`` rows,
            block b = normal(fold_in(fold_in(PRNGKey(seed), t), b), [rows, k]), the last block cut to d_t. The same
            seed gives the same R_t in every batch and for every chunk.

Not here: pandora's gradient with respect to the input embeddings (``x_grad``): mia's models take token ids.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ..engine.batching import ScoringSettings, plan_batches, put_padded, row_length
from ..engine.conditional import token_logprobs
from ..engine.failsafe import fail_safe
from ..engine.loop import engine_layout, pipelined, placed_params, show_progress
from ..engine.plan import register_planned_attack, row_args
from ..models.hub import cached_per_architecture
from ..sharding import batch_sharding, data_size, replicated
from ..validate import Range
from .combine import CLASSIFIERS, labelled_rows, register_features, supervised_scores
from .registry import AttackError, register

NORMS = ("1", "2", "inf")  # feature columns of gradnorm, in this order
PROJ_TYPES = ("normal", "rademacher")
PROJ_BLOCK = 1 << 22  # elements of one block of a projection matrix
JL_SEED = 229  # pandora's default projection seed


# ------------------------------------------------------------------------------------------------ pure functions
def row_loss(model, params, tokens_t: jax.Array, valid_t: jax.Array, layer_transform=None) -> jax.Array:
    """Scalar mean token NLL of one row (tokens [T], valid [T] bool) over its valid predicted positions."""
    lp = token_logprobs(model, params, tokens_t[None], valid_t[None], layer_transform=layer_transform)[0]
    m = (valid_t[1:] & valid_t[:-1]).astype(jnp.float32)
    return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)


def split_layers(tree: dict, layers: str) -> tuple[dict, dict]:
    """(the tree without the layer stack, the stacked layer subtree [L, ...])."""
    return {k: v for k, v in tree.items() if k != layers}, tree[layers]


def tensor_names(params: dict, layers: str) -> list[str]:
    """Names of the tensors, in feature order: 'path' of each leaf outside the stack, then 'layers.l.path'."""
    top, stack = split_layers(params, layers)
    key = lambda path: ".".join(str(getattr(k, "key", k)) for k in path)  # noqa: E731
    top_names = [key(p) for p, _ in jax.tree_util.tree_flatten_with_path(top)[0]]
    stacked = jax.tree_util.tree_flatten_with_path(stack)[0]
    n_layers = stacked[0][1].shape[0] if stacked else 0
    return top_names + [f"{layers}.{i}.{key(p)}" for i in range(n_layers) for p, _ in stacked]


def per_tensor(fn: Callable, grads: dict, layers: str) -> jax.Array:
    """``fn(x [R, d]) -> [R, F]`` applied to every tensor of one example's gradient, in ``tensor_names`` order:
    [n_tensors, F] (a stacked leaf [L, ...] is L tensors of one row each)."""
    top, stack = split_layers(grads, layers)
    parts = [fn(x.reshape(1, -1)) for x in jax.tree_util.tree_leaves(top)]
    stacked = [fn(x.reshape(x.shape[0], -1)) for x in jax.tree_util.tree_leaves(stack)]  # each [L, F]
    if stacked:
        parts.append(jnp.stack(stacked, axis=1).reshape(-1, stacked[0].shape[-1]))  # [L * S, F], layer-major
    return jnp.concatenate(parts, axis=0)


def norms3(x_rd: jax.Array) -> jax.Array:
    """[R, 3] float32: the 1-, 2- and inf-norms of each row of x [R, d]."""
    a = jnp.abs(x_rd.astype(jnp.float32))
    return jnp.stack([a.sum(1), jnp.sqrt(jnp.sum(a * a, 1)), a.max(1)], axis=1)


def gradnorm_score(features_bn3: jax.Array, p: str = "2") -> jax.Array:
    """[B] -||g||_p of the whole gradient from the per-tensor norms [B, n_tensors, 3] (a p-norm of per-tensor
    p-norms is the p-norm of the whole vector)."""
    if p == "1":
        total = features_bn3[..., 0].sum(-1)
    elif p == "2":
        total = jnp.sqrt(jnp.sum(features_bn3[..., 1] ** 2, -1))
    elif p == "inf":
        total = features_bn3[..., 2].max(-1)
    else:
        raise AttackError(f"attack gradnorm: p must be one of {', '.join(NORMS)}; got {p!r}")
    return -total


def row_chunks(tokens_bt, valid_bt, chunk: int):
    """[B, T] tokens and validity -> ([N, c, T], [N, c, T] bool) chunks of c = min(chunk, B) rows, B padded with
    empty rows to a multiple of c (cut the results back to the first B rows)."""
    b, t = tokens_bt.shape
    c = max(1, min(chunk, b))
    pad = -b % c
    tok = jnp.pad(tokens_bt, ((0, pad), (0, 0))).reshape(-1, c, t)
    val = jnp.pad(valid_bt.astype(bool), ((0, pad), (0, 0))).reshape(-1, c, t)
    return tok, val


def chunked_rows(fn: Callable, chunk: int) -> Callable:
    """``fn(params, tokens [T], valid [T]) -> pytree`` over a batch [B, T]: ``vmap`` over ``chunk`` rows at a time,
    ``lax.map`` over the chunks (``row_chunks``)."""

    def run(params, tokens_bt, valid_bt):
        out = jax.lax.map(lambda a: jax.vmap(lambda x, v: fn(params, x, v))(*a), row_chunks(tokens_bt, valid_bt, chunk))
        return jax.tree_util.tree_map(lambda y: y.reshape((-1,) + y.shape[2:])[:tokens_bt.shape[0]], out)

    return run


def make_gradnorm(model, chunk: int = 1) -> Callable:
    """``fn(params, tokens [B, T], valid [B, T]) -> [B, n_tensors, 3]`` float32 per-tensor gradient norms."""
    layers = model.module.LAYERS

    def one(params, tok, val):
        g = jax.grad(lambda p: row_loss(model, p, tok, val))(params)
        return per_tensor(norms3, g, layers)

    return chunked_rows(one, chunk)


def make_alora(model, lr: float, chunk: int = 1) -> Callable:
    """``fn(params, tokens [B, T], valid [B, T]) -> [B]`` float32 L(theta - lr g(x); x) - L(theta; x). The stepped
    layers are made one at a time inside the layer scan (``layer_transform``), so only the leaves outside the stack
    and one layer are copied; the stepped values keep the parameter dtype."""
    layers = model.module.LAYERS

    def sgd(p, g):
        return (p - lr * g).astype(p.dtype)

    def one(params, tok, val):
        l0, g = jax.value_and_grad(lambda p: row_loss(model, p, tok, val))(params)
        top, stack = split_layers(params, layers)
        g_top, g_stack = split_layers(g, layers)
        stepped = jax.tree_util.tree_map(sgd, top, g_top)
        stepped[layers] = stack

        def step_layer(i, lp):  # lp: a FrozenDict inside the scan, g_stack a dict; both flatten in sorted order
            leaves, treedef = jax.tree_util.tree_flatten(lp)
            return treedef.unflatten([sgd(p, gs[i]) for p, gs in zip(leaves, jax.tree_util.tree_leaves(g_stack))])

        return row_loss(model, stepped, tok, val, layer_transform=step_layer) - l0

    return chunked_rows(one, chunk)


def project(x_cd: jax.Array, key: jax.Array, k: int, proj_type: str = "normal", block: int = PROJ_BLOCK):
    """[C, k] float32 x [C, d] @ R [d, k], R drawn block by block (module docstring), never whole."""
    c, d = x_cd.shape
    rows = max(1, min(d, block // k))
    n_blocks = -(-d // rows)
    x = jnp.pad(x_cd.astype(jnp.float32), ((0, 0), (0, n_blocks * rows - d))).reshape(c, n_blocks, rows)

    def draw(b):
        kb = jax.random.fold_in(key, b)
        if proj_type == "rademacher":
            return jax.random.rademacher(kb, (rows, k), jnp.float32)
        return jax.random.normal(kb, (rows, k), jnp.float32)

    def body(b, acc):
        return acc + jax.lax.dynamic_index_in_dim(x, b, 1, keepdims=False) @ draw(b)

    return jax.lax.fori_loop(0, n_blocks, body, jnp.zeros((c, k), jnp.float32))


def make_jl(model, k: int = 8, seed: int = JL_SEED, proj_type: str = "normal", chunk: int = 1,
            block: int = PROJ_BLOCK) -> Callable:
    """``fn(params, tokens [B, T], valid [B, T]) -> [B, n_tensors * k]`` float32 projections of each tensor's
    gradient (tensor-major: tensor t's k numbers at t*k .. t*k + k-1). The chunk's gradients are projected together,
    each R_t drawn once per chunk."""
    if proj_type not in PROJ_TYPES:
        raise AttackError(f"attack jl: proj_type must be one of {', '.join(PROJ_TYPES)}; got {proj_type!r}")
    layers = model.module.LAYERS
    base = jax.random.PRNGKey(seed)

    def chunk_features(params, tok_ct, val_ct):
        g = jax.vmap(jax.grad(lambda p, t, v: row_loss(model, p, t, v)), in_axes=(None, 0, 0))(params, tok_ct, val_ct)
        top, stack = split_layers(g, layers)
        c = tok_ct.shape[0]
        out = []
        top_leaves = jax.tree_util.tree_leaves(top)
        for t, x in enumerate(top_leaves):
            out.append(project(x.reshape(c, -1), jax.random.fold_in(base, t), k, proj_type, block))
        stack_leaves = jax.tree_util.tree_leaves(stack)
        if stack_leaves:
            n_layers, s = stack_leaves[0].shape[1], len(stack_leaves)
            per_leaf = []
            for j, x in enumerate(stack_leaves):  # x [c, L, ...] -> [L, c, k], tensor id len(top) + l * S + j
                ids = len(top_leaves) + jnp.arange(n_layers) * s + j
                xl = jnp.swapaxes(x.reshape(c, n_layers, -1), 0, 1)
                per_leaf.append(jax.vmap(lambda xi, i: project(xi, jax.random.fold_in(base, i), k, proj_type,
                                                               block))(xl, ids))
            out.append(jnp.stack(per_leaf, axis=1).transpose(2, 0, 1, 3).reshape(c, -1))  # [c, L * S * k]
        return jnp.concatenate(out, axis=1)

    def run(params, tokens_bt, valid_bt):
        out = jax.lax.map(lambda a: chunk_features(params, *a), row_chunks(tokens_bt, valid_bt, chunk))
        return out.reshape(-1, out.shape[-1])[:tokens_bt.shape[0]]

    return run


# ------------------------------------------------------------------------------------------------ jitted steps
def build_gradient_step(model, mesh, shardings, kind: str, chunk: int, lr: float = 1e-4, k: int = 8,
                        seed: int = JL_SEED, proj_type: str = "normal"):
    """jit of one gradient attack ``kind`` (gradnorm | alora | jl): (params [``shardings``], tokens [B, T], valid
    [B, T] rows over ``data``) -> per-row results, replicated. Lowers on abstract arguments for ``mia plan``."""
    if kind == "gradnorm":
        fn = make_gradnorm(model, chunk)
    elif kind == "alora":
        fn = make_alora(model, lr, chunk)
    elif kind == "jl":
        fn = make_jl(model, k, seed, proj_type, chunk)
    else:
        raise ValueError(f"unknown gradient attack {kind!r}")
    rows = batch_sharding(mesh)
    return fail_safe(lambda: jax.jit(fn, in_shardings=(shardings, rows, rows), out_shardings=replicated(mesh)))


@cached_per_architecture(maxsize=16)
def jitted_gradient_step(model, kind: str, chunk: int, lr: float = 1e-4, k: int = 8, seed: int = JL_SEED,
                         proj_type: str = "normal"):
    """``build_gradient_step`` on the engine's layout for ``model``, built once per architecture, dtypes and layout
    (``mia.models.hub.program_model``)."""
    mesh, shardings = engine_layout(model)
    return build_gradient_step(model, mesh, shardings, kind, chunk, lr, k, seed, proj_type)


def run_rows(ctx, examples: list, step, desc: str) -> np.ndarray:
    """``step(params, tokens, valid)`` over ``examples`` in length-bucketed batches -> [N, ...] float64 rows in
    example order. The batch shrinks to what one chunk of rows is likely to hold (gradients are per row)."""
    model = ctx.model
    mesh, _ = engine_layout(model)
    params = placed_params(model)
    toks = [np.asarray(e.tokens, np.int32) for e in examples]
    settings = dataclasses.replace(ctx.settings, token_budget=max(16, min(ctx.settings.token_budget, 4096)))
    out: dict = {}
    rows_sharding = batch_sharding(mesh)
    with tqdm(total=len(toks), desc=desc, disable=not show_progress(ctx.settings), leave=False) as bar:
        def consume(batch, r):
            r = np.asarray(r, np.float64)
            for j, i in enumerate(batch.members):
                out[i] = r[j]
            bar.update(len(batch.members))

        pipelined(plan_batches([len(t) for t in toks], settings, data_size(mesh)),
                  lambda b: step(params, *put_padded([toks[i] for i in b.members], b.rows, b.length, rows_sharding)),
                  consume)
    return np.stack([out[i] for i in range(len(toks))]) if toks else np.zeros((0,))


def gradnorm_features(ctx, examples: Optional[list] = None, *, chunk: int = 1, **_) -> np.ndarray:
    """[N, n_tensors, 3] per-tensor gradient norms (p = 1, 2, inf) of ``examples`` (default: the evaluated ones),
    memoized on the run's context by token content."""
    examples = ctx.examples if examples is None else examples
    memo = ctx.options.setdefault("_gradnorm_features", {})
    key = tuple(np.asarray(e.tokens).tobytes() for e in examples)
    if key not in memo:
        memo[key] = run_rows(ctx, examples, jitted_gradient_step(ctx.model, "gradnorm", int(chunk)), "gradnorm")
    return memo[key]


# ------------------------------------------------------------------------------------------------ mia plan
def _planned(kind: str):
    def lower(model, mesh, shardings, params, batch, length, *, chunk: int = 1, k: int = 8):
        step = build_gradient_step(model, mesh, shardings, kind, chunk, k=k)
        t = row_length(length, ScoringSettings().min_bucket, ScoringSettings().bucket_step)
        return [(kind, (batch, t), step.lower(params, *row_args(batch, t, batch_sharding(mesh))))]
    return lower


for _kind in ("gradnorm", "alora"):
    register_planned_attack(_kind, _planned(_kind), options={"chunk": ("chunk", 1)},
                            describe=lambda o, _k=_kind: f"{_k} per-example gradients (chunk={o.get('chunk', 1)})")
register_planned_attack("jl", _planned("jl"), options={"chunk": ("chunk", 1), "k": ("k", 8)},
                        describe=lambda o: f"jl per-example gradient projections (chunk={o.get('chunk', 1)}, "
                                           f"k={o.get('k', 8)})")


# ------------------------------------------------------------------------------------------------ attacks
_COST = "one forward and one backward pass per example, per-example gradients of chunk rows at a time"


@register("gradnorm", needs=("model",), cost="heavy", cost_note=_COST, p="2", chunk=1,
          limits={"p": NORMS, "chunk": Range(1)})
def _gradnorm(ctx, *, p: str, chunk: int) -> np.ndarray:
    """GradNorm: minus the p-norm of the gradient of the example's mean token loss (higher = member). pandora_llm."""
    return np.asarray(gradnorm_score(jnp.asarray(gradnorm_features(ctx, chunk=chunk)), p), np.float64)


@register("alora", needs=("model",), cost="heavy", cost_note=_COST + ", and a second forward pass",
          lr=1e-4, chunk=1, limits={"lr": Range(0, lo_open=True), "chunk": Range(1)})
def _alora(ctx, *, lr: float, chunk: int) -> np.ndarray:
    """ALoRa: the loss after one SGD step on the example minus the loss before (higher = member). pandora_llm."""
    return run_rows(ctx, ctx.examples, jitted_gradient_step(ctx.model, "alora", int(chunk), float(lr)), "alora")


def jl_features(ctx, examples: Optional[list] = None, *, k: int = 8, seed: int = JL_SEED,
                proj_type: str = "normal", chunk: int = 1, **_) -> np.ndarray:
    """[N, n_tensors * k] projected per-tensor gradients of ``examples`` (default: the evaluated ones)."""
    examples = ctx.examples if examples is None else examples
    step = jitted_gradient_step(ctx.model, "jl", int(chunk), k=int(k), seed=int(seed), proj_type=proj_type)
    return run_rows(ctx, examples, step, "jl")


_JL_LIMITS = {"k": Range(1), "seed": Range(0), "proj_type": PROJ_TYPES, "chunk": Range(1),
              "classifier": CLASSIFIERS}


@register("jl", needs=("model", "train"), cost="heavy", cost_note=_COST + ", for the train partition too",
          k=8, seed=JL_SEED, proj_type="normal", chunk=1, classifier="lr", limits=_JL_LIMITS)
def _jl(ctx, *, k: int, seed: int, proj_type: str, chunk: int, classifier: str) -> np.ndarray:
    """JL: random projections of each tensor's gradient, a classifier trained on labelled --train-data (higher =
    member). pandora_llm."""
    train, y = labelled_rows(ctx, "jl")
    opts = dict(k=k, seed=seed, proj_type=proj_type, chunk=chunk)
    return supervised_scores(classifier, jl_features(ctx, train, **opts), y, jl_features(ctx, **opts), ctx.seed)


register_features("gradnorm", lambda ctx, examples, chunk=1, **_: gradnorm_features(ctx, examples, chunk=chunk)
                  .reshape(len(examples), -1))
register_features("jl", lambda ctx, examples, k=8, seed=JL_SEED, proj_type="normal", chunk=1, **_:
                  jl_features(ctx, examples, k=k, seed=seed, proj_type=proj_type, chunk=chunk))
