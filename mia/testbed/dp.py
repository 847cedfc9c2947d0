"""Differentially private testbed training (DP-SGD) and its privacy accounting.

A testbed with ``dp_noise`` set trains with DP-SGD (Abadi et al. 2016). Its records are the rows it may train on:
the first ``train_steps * batch_size`` natural rows of the order and every copy of an included canary
(``n_records``). Each step:

1. forms a batch: ``dp_sampling="poisson"``: every record joins independently with probability
   q = 1 / train_steps (seeded per step: ``poisson_batch``), so each record is expected once over the run, as in
   ordinary training; ``"fixed"``: the batch that ordinary training uses at this step (its ``batch_size`` natural
   rows and the canary copies recorded for it);
2. computes each example's gradient (``jax.vmap``), clips it to L2 norm ``dp_clip`` over all parameters and sums
   (``optax.transforms.per_example_global_norm_clip``);
3. adds Gaussian noise of standard deviation ``dp_noise * dp_clip`` to every coordinate of the sum (key:
   ``noise_key(seed, step)``), and divides by ``batch_size`` (fixed, never the sampled size, which depends on the
   data);
4. hands the result to the testbed's optimiser (global-norm clip, AdamW, the same schedule as ordinary training):
   post-processing, which costs no privacy.

Accounting (``dp_accounting``; neighbouring datasets differ by adding or removing one record):

- poisson: ``train_steps``-fold composition of the Poisson-subsampled Gaussian mechanism (q, dp_noise), by the
  privacy-loss-distribution accountant (pessimistic: an upper bound); the RDP accountant is recorded beside it.
- fixed: every record is in the sum of exactly one step, fixed before training, and the other steps do not read it;
  so the run is, for that record, one Gaussian mechanism with noise multiplier ``dp_noise`` (no amplification by
  sampling). A canary with r copies (at r distinct steps) is r such mechanisms: one Gaussian with
  ``dp_noise / sqrt(r)``.

delta defaults to 1 / N with N = ``max_records``: the natural records and every canary copy (1 / records whatever
the inclusion). Every parameter of the mechanism
(q, the divisor, delta, the steps of canary copies) is fixed by the config, never by which canaries happen to be
included: the guarantee is about adding or removing a record, and a parameter that moved with the data would void
it. With ``dp_noise = 0`` the run is clipped but not noised: epsilon is infinite.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..privacy.one_run import group_privacy
from .canaries import plan_canaries
from .config import TestbedConfig, TestbedError

ACCOUNTANTS = ("pld", "rdp")
_NOISE_STREAM = 0xD9  # the noise keys' stream, folded into PRNGKey(seed)
_BATCH_STREAM = 0xD95A  # the Poisson batches' stream


# ----------------------------------------------------------------------------------------------- records
def n_records(cfg: TestbedConfig) -> int:
    """Records the private run may train on: natural rows [0, train_steps * batch_size) and the canary copies."""
    copies = plan_canaries(cfg).n_copies if cfg.canaries else 0
    return int(cfg.train_steps * cfg.batch_size + copies)


def sample_rate(cfg: TestbedConfig) -> float:
    """Poisson sampling probability q = 1 / train_steps: each record is expected once over the run, and the batch of
    natural rows has batch_size rows on average. It depends on the config only (not on the number of records, which
    moves with the canaries' inclusion)."""
    return 1.0 / cfg.train_steps


def max_records(cfg: TestbedConfig) -> int:
    """The most records a private run of ``cfg`` can hold: the natural rows [0, train_steps * batch_size) and every
    copy of every canary, included or not (a function of the config alone; ``n_records`` counts the included)."""
    copies = int(plan_canaries(cfg).reps.sum()) if cfg.canaries else 0
    return int(cfg.train_steps * cfg.batch_size + copies)


def default_delta(cfg: TestbedConfig) -> float:
    """1 / N with N = ``max_records``: the natural records and every canary copy, so that delta <= 1 / records
    whichever canaries are included (data-independent, like every parameter here). Without canaries,
    1 / (train_steps * batch_size)."""
    return 1.0 / max_records(cfg)


def poisson_batch(cfg: TestbedConfig, step: int, n: Optional[int] = None) -> np.ndarray:
    """Sorted record indices sampled at ``step`` (each of the ``n`` records, default ``n_records``, independently with
    probability ``sample_rate``); record i < train_steps * batch_size is natural row i, the rest are canary copies
    in (canary id, copy) order."""
    n = n_records(cfg) if n is None else int(n)
    return poisson_indices(cfg.seed, _BATCH_STREAM, step, n, sample_rate(cfg))


def poisson_indices(seed: int, stream: int, step: int, n: int, rate: float) -> np.ndarray:
    """Poisson sampling: the sorted indices among ``n`` records that are sampled at ``step``, each independently with
    probability ``rate``, from numpy's ``default_rng([seed, stream, step])`` (one stream per trainer)."""
    rng = np.random.default_rng([int(seed), int(stream), int(step)])
    return np.flatnonzero(rng.random(int(n)) < rate)


def noise_key(seed: int, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(int(seed)), _NOISE_STREAM), int(step))


# ----------------------------------------------------------------------------------------------- accounting
def _require_private(cfg: TestbedConfig) -> None:
    if not cfg.private:
        raise TestbedError(f"testbed config {cfg.config_hash} is not private (no dp_noise): it has no epsilon")


def dp_event(cfg: TestbedConfig, steps: Optional[int] = None, group: int = 1):
    """The ``dp_accounting`` event of ``steps`` (default: all) steps of the run for one record, or for a canary of
    ``group`` copies under fixed batches (Poisson groups go through ``canary_epsilon``). Under fixed batches a
    record is read by one step only, so any checkpoint after step 0 has the whole run's guarantee (a record whose
    step comes later has not been read yet: zero loss)."""
    import dp_accounting  # local: only private testbeds need the accountant

    _require_private(cfg)
    steps = cfg.train_steps if steps is None else int(steps)
    if steps <= 0:
        return dp_accounting.NoOpDpEvent()
    if cfg.dp_noise == 0:
        return dp_accounting.NonPrivateDpEvent()
    if cfg.dp_sampling == "fixed":
        return dp_accounting.GaussianDpEvent(cfg.dp_noise / math.sqrt(group))
    if group != 1:
        raise TestbedError("a Poisson-sampled group has no single event here; use canary_epsilon")
    return subsampled_gaussian_event(cfg.dp_noise, sample_rate(cfg), steps)


def subsampled_gaussian_event(noise: float, rate: float, steps: int):
    """The ``dp_accounting`` event of DP-SGD for one record: ``steps`` compositions of the Gaussian mechanism of noise
    multiplier ``noise``, Poisson-subsampled at ``rate`` (every step reads every record when ``rate`` is 1)."""
    import dp_accounting  # local: only private runs need the accountant

    event = dp_accounting.GaussianDpEvent(noise)
    if rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(rate, event)
    return dp_accounting.SelfComposedDpEvent(event, int(steps))


def event_epsilon(event, delta: float, accountant: str) -> float:
    """Epsilon of a ``dp_accounting`` event at ``delta`` by ``accountant`` ("pld" or "rdp"); inf for a non-private
    event, 0 for no event."""
    import dp_accounting  # local: only private runs need the accountant
    from dp_accounting import pld, rdp

    if accountant not in ACCOUNTANTS:
        raise TestbedError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    acc = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def accountant_epsilon(cfg: TestbedConfig, *, delta: Optional[float] = None, steps: Optional[int] = None,
                       accountant: str = "pld") -> float:
    """Epsilon of one record after ``steps`` (default: all) steps of the private run of ``cfg``, at ``delta``
    (default ``default_delta``). ``accountant``: "pld" (privacy loss distributions, pessimistic) or "rdp". A function
    of the config alone: no training needed."""
    if accountant not in ACCOUNTANTS:
        raise TestbedError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    delta = default_delta(cfg) if delta is None else float(delta)
    return event_epsilon(dp_event(cfg, steps), delta, accountant)


def canary_epsilon(cfg: TestbedConfig, reps: int, *, delta: Optional[float] = None) -> tuple:
    """(epsilon, delta) of a canary inserted ``reps`` times, over the whole run. Fixed batches: exact (one Gaussian
    mechanism with dp_noise / sqrt(reps)) at ``delta``. Poisson: group privacy of the per-record guarantee,
    (reps eps, reps e^((reps-1) eps) delta); its delta grows with reps."""
    delta = default_delta(cfg) if delta is None else float(delta)
    if cfg.dp_sampling == "fixed" or reps == 1:
        return event_epsilon(dp_event(cfg, group=int(reps)), delta, "pld"), delta
    return group_privacy(accountant_epsilon(cfg, delta=delta), delta, int(reps))


def noise_for_epsilon(cfg: TestbedConfig, epsilon: float, *, delta: Optional[float] = None, tol: float = 1e-3) -> float:
    """The smallest noise multiplier (to ``tol``, relative) at which ``cfg``'s private run has accountant epsilon
    <= ``epsilon`` at ``delta`` (default ``default_delta``); ``cfg`` needs ``dp_noise`` set (any value) for its
    sampling."""
    _require_private(cfg)
    if not epsilon > 0:
        raise TestbedError(f"target epsilon must be positive, got {epsilon!r}")

    return smallest_noise(lambda sigma: accountant_epsilon(cfg.replace(dp_noise=sigma), delta=delta), epsilon, tol)


def smallest_noise(eps_at: Callable[[float], float], epsilon: float, tol: float = 1e-3) -> float:
    """The smallest noise multiplier sigma (to ``tol``, relative) with ``eps_at(sigma) <= epsilon``, by doubling and
    then bisection (an accountant's epsilon falls as the noise grows)."""
    lo, hi = 0.0, 1.0
    while eps_at(hi) > epsilon:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            raise TestbedError(f"no noise multiplier up to 1e6 reaches epsilon {epsilon}")
    while hi - lo > tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps_at(mid) <= epsilon else (mid, hi)
    return hi


def privacy_record(cfg: TestbedConfig, delta: Optional[float] = None) -> dict:
    """What the manifest records about a private run: mechanism, sampling, records, delta and both accountants'
    epsilon."""
    delta = default_delta(cfg) if delta is None else float(delta)
    rec = {"mechanism": "DP-SGD (per-example clipping, Gaussian noise)", "noise_multiplier": cfg.dp_noise,
           "clip": cfg.dp_clip, "sampling": cfg.dp_sampling, "records": n_records(cfg), "steps": cfg.train_steps,
           "delta": delta, "delta_rule": "1 / (train_steps * batch_size + every canary copy)",
           "neighbouring": "add or remove one record (row)"}
    if cfg.dp_sampling == "poisson":
        rec["sample_rate"] = sample_rate(cfg)
    for acc in ACCOUNTANTS:
        eps = accountant_epsilon(cfg, delta=delta, accountant=acc)
        rec[f"epsilon_{acc}"] = eps if math.isfinite(eps) else "inf"
    rec["accountant"] = "dp_accounting PLD (pessimistic); RDP alongside"
    return rec


# ----------------------------------------------------------------------------------------------- training
def make_clipped_sum(model, clip: float, options: Optional[dict] = None):
    """jit((params, rows [P, T+1] int32, mask [P] float32) -> (sum of clipped per-example gradients, number clipped,
    sum of the rows' losses)). Rows with mask 0 contribute nothing (their gradient is zeroed before clipping)."""

    def example_loss(params, row):
        logits = model.logits(params, row[None, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, row[None, 1:, None], axis=-1))

    def clipped_sum(params, rows, mask):
        losses, grads = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0))(params, rows)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves = [g * mask.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype) for g in leaves]
        summed, n_clipped = optax.transforms.per_example_global_norm_clip(leaves, clip)
        return jax.tree_util.tree_unflatten(treedef, summed), n_clipped, jnp.sum(losses * mask)

    return jax.jit(clipped_sum, compiler_options=options or None)


def make_noisy_update(optimizer, noise_multiplier: float, clip: float, batch_size: int):
    """jit((params, opt_state, clipped_sum, key) -> (params, opt_state, norm of the noisy mean gradient)): adds
    N(0, (noise_multiplier * clip)^2) to every coordinate, divides by ``batch_size`` and applies ``optimizer``."""
    std = float(noise_multiplier) * float(clip)

    def update(params, opt_state, summed, key):
        leaves, treedef = jax.tree_util.tree_flatten(summed)
        sizes = [int(np.prod(g.shape)) for g in leaves]
        z = jax.random.normal(key, (sum(sizes),), jnp.float32)  # one draw for all coordinates (compiles fast)
        offsets = np.cumsum([0] + sizes)
        noisy = [(g + std * z[a:b].reshape(g.shape).astype(g.dtype)) / batch_size
                 for g, a, b in zip(leaves, offsets[:-1], offsets[1:])]
        grads = jax.tree_util.tree_unflatten(treedef, noisy)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.global_norm(grads)

    return jax.jit(update)


def chunk_rows(cfg: TestbedConfig, slots: int) -> int:
    """Rows per per-example-gradient chunk: a fixed batch in one chunk; a Poisson batch (mean batch_size, standard
    deviation about sqrt(batch_size)) in one chunk nearly always."""
    if cfg.dp_sampling == "fixed":
        return cfg.batch_size + slots
    mean = n_records(cfg) * sample_rate(cfg)  # batch_size plus the canary copies' share
    return int(math.ceil(mean + 4 * math.sqrt(mean)))


def dp_step(params, opt_state, rows: np.ndarray, step: int, *, clipped_sum, update, chunk: int, seed: int) -> tuple:
    """One DP-SGD step on ``rows`` [n, T+1] (any n, in chunks of ``chunk``): returns (params, opt_state, metrics
    with loss (mean over the rows), grad_norm, rows, clipped (fraction))."""
    total, n_clipped, loss_sum = None, 0, 0.0
    n = len(rows)
    for lo in range(0, max(n, 1), chunk):
        part = rows[lo:lo + chunk]
        mask = np.zeros(chunk, np.float32)
        mask[:len(part)] = 1.0
        if len(part) < chunk:
            part = np.concatenate([part, np.zeros((chunk - len(part), rows.shape[1]), rows.dtype)])
        s, c, l = clipped_sum(params, part, mask)
        total = s if total is None else jax.tree_util.tree_map(jnp.add, total, s)
        n_clipped += int(c)
        loss_sum += float(l)
    params, opt_state, norm = update(params, opt_state, total, noise_key(seed, step))
    return params, opt_state, {"loss": loss_sum / max(n, 1), "grad_norm": float(norm), "rows": int(n),
                               "clipped": n_clipped / max(n, 1)}
