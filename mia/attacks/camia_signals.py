"""Per-example signals of CAMIA (Chang et al., "Context-Aware Membership Inference Attacks against Pre-trained LLMs").

Definitions follow the released code (changhongyan123/context_aware_mia ``util_features.py``), as written out in
docs/algorithms.md#camia. All values here are in the code's units (x = token log-probs, <= 0); orientation and
p-values live in ``camia.py``.

Window convention ("cut"): a signal on x[0:T'] uses w = min(T', n) values of a series of n values;
``cut="T*"`` is the code's slice [0:-1] (w = n - 1) and ``cut=None`` means no cut (w = n).

Pure JAX ([B, L] zero-padded series with [B] valid lengths ``n_b``; padding never enters a result):
  cut_mean (f_Cut, code "loss"), cut_ppl, count_above (f_CB), count_above_mean (f_CBM, an integer count),
  count_above_prefix_mean (f_CBPM), slope (f_Slope), approximate_entropy (f_ApEn), token_diversity (d).
Host NumPy (inherently sequential, or cheap): lempel_ziv (f_LZ, a phrase parse), locate_copies (sub-sequence search
in the repeated text's ids), window_plan (mimir's sliding window for texts longer than the context),
empirical_pvalues (exact, float64: a sort and two binary searches per signal; no compile for each calibration size).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..engine.batching import pow2_ceil

Cut = Union[int, str, None]
T_STAR = "T*"


# ------------------------------------------------------------------------------------------------ pure JAX
def window(n_b: jax.Array, cut: Cut) -> jax.Array:
    """[B] number of values that x[0:T'] keeps of a series of n_b values."""
    if cut == T_STAR:
        return jnp.maximum(n_b - 1, 0)
    if cut is None:
        return n_b
    return jnp.minimum(n_b, cut)


def _prefix(x_bl: jax.Array, n_b: jax.Array, cut: Cut) -> tuple[jax.Array, jax.Array]:
    w_b = window(n_b, cut)
    return jnp.arange(x_bl.shape[1])[None, :] < w_b[:, None], w_b


def cut_mean(x_bl: jax.Array, n_b: jax.Array, *, cut: Cut) -> jax.Array:
    """[B] mean(x[0:T']) (code "loss"; NaN for an empty window, as np.mean)."""
    m, w = _prefix(x_bl, n_b, cut)
    return jnp.sum(jnp.where(m, x_bl, 0.0), axis=1) / w.astype(jnp.float32)


def cut_ppl(x_bl: jax.Array, n_b: jax.Array, *, cut: Cut) -> jax.Array:
    """[B] exp(-mean(x[0:T']))."""
    return jnp.exp(-cut_mean(x_bl, n_b, cut=cut))


def count_above(x_bl: jax.Array, n_b: jax.Array, *, tau: float, cut: Cut = 200) -> jax.Array:
    """[B] mean(x[0:T'] >= -tau): the share of the first T' tokens with loss <= tau."""
    m, w = _prefix(x_bl, n_b, cut)
    return jnp.sum(m & (x_bl >= -tau), axis=1) / w.astype(jnp.float32)


def count_above_mean(x_bl: jax.Array, n_b: jax.Array, *, cut: Cut) -> jax.Array:
    """[B] the integer count of t < T' with x_t > mean(x[0:T']) (returned as float32)."""
    m, _ = _prefix(x_bl, n_b, cut)
    mean_b = cut_mean(x_bl, n_b, cut=cut)
    return jnp.sum(m & (x_bl > mean_b[:, None]), axis=1).astype(jnp.float32)


def count_above_prefix_mean(x_bl: jax.Array, n_b: jax.Array, *, cut: Cut = None) -> jax.Array:
    """[B] mean over t = 1..min(T', n)-1 of 1[x_t > mean(x_0..x_{t-1})] (NaN when that range is empty)."""
    l = x_bl.shape[1]
    w_b = window(n_b, cut)
    t = jnp.arange(l)
    prev_sum = jnp.cumsum(x_bl, axis=1) - x_bl  # sum of x_0..x_{t-1}
    prev_mean = prev_sum / jnp.maximum(t, 1).astype(jnp.float32)[None, :]
    use = (t[None, :] >= 1) & (t[None, :] < w_b[:, None])
    return jnp.sum(use & (x_bl > prev_mean), axis=1) / (w_b - 1).astype(jnp.float32)


def slope(x_bl: jax.Array, n_b: jax.Array, *, cut: Cut) -> jax.Array:
    """[B] least-squares slope of x[0:T'] against 0, 1, ... (np.polyfit(range(w), x[:w], 1)[0]); NaN if w < 2."""
    m, w = _prefix(x_bl, n_b, cut)
    wf = w.astype(jnp.float32)
    i = jnp.arange(x_bl.shape[1], dtype=jnp.float32)[None, :] - (wf[:, None] - 1.0) / 2.0
    xc = x_bl - cut_mean(x_bl, n_b, cut=cut)[:, None]
    num = jnp.sum(jnp.where(m, i * xc, 0.0), axis=1)
    den = jnp.sum(jnp.where(m, i * i, 0.0), axis=1)
    return jnp.where(w >= 2, num / den, jnp.nan)


def _apen_row(x_l: jax.Array, n_c: jax.Array, m: int, r_factor: float) -> jax.Array:
    """ApEn of x[0:n] for each of the [C] window lengths n_c; the distance matrices are shared by all of them."""
    l = x_l.shape[0]
    pos = jnp.arange(l)
    d1_ll = jnp.abs(x_l[:, None] - x_l[None, :])

    def shifted(k):  # [i, j] -> |x_{i+k} - x_{j+k}|
        return jnp.pad(d1_ll[k:, k:], ((0, k), (0, k)))

    d_m = d1_ll
    for k in range(1, m):
        d_m = jnp.maximum(d_m, shifted(k))  # Chebyshev distance of the length-m windows starting at i and j
    d_m1 = jnp.maximum(d_m, shifted(m))

    def one(n):
        valid = pos < n
        nf = n.astype(jnp.float32)
        mean = jnp.sum(jnp.where(valid, x_l, 0.0)) / nf
        r = r_factor * jnp.sqrt(jnp.sum(jnp.where(valid, jnp.square(x_l - mean), 0.0)) / nf)  # population std

        def phi(dist_ll, mm):
            n_win = n - mm + 1
            win = pos < n_win
            close = (dist_ll <= r) & win[:, None] & win[None, :]  # self-matches included
            c = jnp.sum(close, axis=1) / n_win.astype(jnp.float32)
            return jnp.sum(jnp.where(win, jnp.log(jnp.where(win, c, 1.0)), 0.0)) / n_win.astype(jnp.float32)

        return jnp.where(n <= m + 1, 0.0, jnp.abs(phi(d_m, m) - phi(d_m1, m + 1)))

    return jnp.stack([one(n_c[i]) for i in range(n_c.shape[0])])


def approximate_entropy_multi(x_bl: jax.Array, n_b: jax.Array, *, cuts: tuple, m: int = 8, r: float = 0.8) -> jax.Array:
    """[B, len(cuts)] ``approximate_entropy`` for several cuts at the cost of one (shared distance matrices).

    Rows go one at a time through ``lax.map`` (memory O(L^2)); a row too short for any window (padding included)
    skips the work through ``lax.cond``."""
    w_bc = jnp.stack([window(n_b, c) for c in cuts], axis=1)

    def row(a):
        x_l, w_c = a
        return jax.lax.cond(jnp.max(w_c) > m + 1, lambda: _apen_row(x_l, w_c, m, r),
                            lambda: jnp.zeros(w_c.shape, jnp.float32))

    return jax.lax.map(row, (x_bl, w_bc))


def approximate_entropy(x_bl: jax.Array, n_b: jax.Array, *, cut: Cut, m: int = 8, r: float = 0.8) -> jax.Array:
    """[B] ApEn of x[0:T'] (code form): r = r * std(x[0:T']) (population), Chebyshev distance, self-matches
    counted, Phi^m = mean_i ln(C_i / (N - m + 1)), ApEn = |Phi^m - Phi^{m+1}|, 0 when N <= m + 1.

    Memory is O(L^2) (one row at a time).
    """
    return approximate_entropy_multi(x_bl, n_b, cuts=(cut,), m=m, r=r)[:, 0]


def token_diversity(ids_bl: jax.Array, t_b: jax.Array, *, cut: Cut) -> jax.Array:
    """[B] |set(ids[0:T'])| / len(ids[0:T']) on the token ids (T_b ids, first token included)."""
    m, w = _prefix(ids_bl, t_b, cut)
    big = jnp.iinfo(jnp.int32).max
    s = jnp.sort(jnp.where(m, ids_bl.astype(jnp.int32), big), axis=1)  # valid ids first, padding last
    new = jnp.concatenate([jnp.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=1)
    return jnp.sum(new & m, axis=1) / w.astype(jnp.float32)




CUTS = (T_STAR, 200, 300)
TAUS = (1, 2, 3)
LZ_BINS = (3, 4, 5)
REP_CUTS = (600, 800, 1000)
CBPM_CUTS = (None, 200, 300)
APEN_M, APEN_R = 8, 0.8


def _series_keys(x_bl: jax.Array, n_b: jax.Array) -> jax.Array:
    """[B, 12] loss x3 (CUTS), ppl x3, count_above x3 (TAUS, first 200), count_mean x3 (CUTS); code units."""
    cols = [cut_mean(x_bl, n_b, cut=c) for c in CUTS]
    cols += [cut_ppl(x_bl, n_b, cut=c) for c in CUTS]
    cols += [count_above(x_bl, n_b, tau=t, cut=200) for t in TAUS]
    cols += [count_above_mean(x_bl, n_b, cut=c) for c in CUTS]
    return jnp.stack(cols, axis=1)


def _repeat_keys(xrep_bl: jax.Array, n_b: jax.Array) -> jax.Array:
    """[B, 6] slope x3 (REP_CUTS), ApEn x3 (REP_CUTS) of the repeated text's log-prob series."""
    cols = [slope(xrep_bl, n_b, cut=c) for c in REP_CUTS]
    return jnp.concatenate([jnp.stack(cols, axis=1),
                            approximate_entropy_multi(xrep_bl, n_b, cuts=REP_CUTS, m=APEN_M, r=APEN_R)], axis=1)


def _original_keys(x_bl: jax.Array, n_b: jax.Array, ids_bl: jax.Array, t_b: jax.Array) -> jax.Array:
    """[B, 6] token_diversity x3 (CUTS, on ids), count_above_prefix_mean x3 (CBPM_CUTS, on x)."""
    cols = [token_diversity(ids_bl, t_b, cut=c) for c in CUTS]
    cols += [count_above_prefix_mean(x_bl, n_b, cut=c) for c in CBPM_CUTS]
    return jnp.stack(cols, axis=1)


series_keys = jax.jit(_series_keys)
repeat_keys = jax.jit(_repeat_keys)
original_keys = jax.jit(_original_keys)


# ------------------------------------------------------------------------------------------------ host helpers
def pad_rows(rows: Sequence[np.ndarray], dtype=np.float32, min_len: int = 16,
             n_rows: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Variable-length rows -> ([n_rows or pow2_ceil(N), pow2_ceil(max len)] zero-padded array, lengths; padded rows
    have 0)."""
    n = len(rows)
    width = pow2_ceil(max((len(r) for r in rows), default=1), min_len)
    n_rows = n_rows or pow2_ceil(n)
    out = np.zeros((n_rows, width), dtype)
    lens = np.zeros(n_rows, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        lens[i] = len(r)
    return out, lens


ROW_CHUNK = 16


def map_rows(fn, *row_sets: tuple) -> np.ndarray:
    """Apply ``fn(a_1, n_1, a_2, n_2, ...)`` to (rows, dtype) sets, padded to power-of-two lengths and fed in chunks of
    ROW_CHUNK rows: any number of examples reuses one compiled function per length bucket. Returns [N, ...]."""
    n = len(row_sets[0][0])
    total = max(1, -(-n // ROW_CHUNK)) * ROW_CHUNK
    arrays = []
    for rows, dtype in row_sets:
        arrays += list(pad_rows(rows, dtype, n_rows=total))
    outs = [np.asarray(fn(*[a[i : i + ROW_CHUNK] for a in arrays])) for i in range(0, total, ROW_CHUNK)]
    return np.concatenate(outs)[:n]


def lz_phrase_count(symbols: Sequence[int]) -> int:
    """Number of phrases of the code's LZ parse: S = {}, i = 0, w = 1; while i + w <= n: if s[i:i+w] in S then
    w += 1 else add it, i += w, w = 1. A trailing incomplete phrase is not counted."""
    s = tuple(int(v) for v in symbols)
    seen: set = set()
    i, w = 0, 1
    while i + w <= len(s):
        phrase = s[i : i + w]
        if phrase in seen:
            w += 1
        else:
            seen.add(phrase)
            i, w = i + w, 1
    return len(seen)


def lz_symbols(x: np.ndarray, bins: int) -> np.ndarray:
    """Binning of the code: 100 edges on [min x, 0] (digitize, right=True), then ``bins`` equal-width groups of those
    bin indices (searchsorted, left)."""
    x = np.asarray(x, np.float64)
    d = np.digitize(x, np.linspace(np.min(x), 0, 100), right=True)
    edges = np.linspace(np.min(d), np.max(d), bins + 1)[1:]
    return np.searchsorted(edges, d, side="left")


def lempel_ziv(x: np.ndarray, bins: int) -> float:
    """f_LZ: phrase count of the binned series divided by its length (NaN for an empty series)."""
    x = np.asarray(x)
    if x.size == 0:
        return float("nan")
    return lz_phrase_count(lz_symbols(x, bins)) / x.size


def locate_copies(ids: np.ndarray, rep_ids: np.ndarray, n_copies: int = 3, drop_last: int = 2,
                  min_len: int = 2) -> Optional[tuple[list, int]]:
    """Starts of the first ``n_copies`` copies of b = ids[2:] in the repeated text's ids, and |b|.

    Every start s >= 1 of b is found; the last ``drop_last`` are discarded. While fewer than ``n_copies`` remain, b is
    shortened from the front by one token and the search repeated (down to ``min_len`` tokens); None if that fails.
    The copy's log-probs are then xrep[s - 1 : s - 1 + |b|] (xrep[j] predicts token j + 1).
    """
    ids = np.asarray(ids)
    rep = np.asarray(rep_ids)
    b = ids[2:]
    while len(b) >= min_len:
        lb = len(b)
        cand = np.flatnonzero(rep[1 : len(rep) - lb + 1] == b[0]) + 1 if len(rep) >= lb + 1 else np.zeros(0, int)
        starts = [int(s) for s in cand if np.array_equal(rep[s : s + lb], b)]
        starts = starts[: max(0, len(starts) - drop_last)]
        if len(starts) >= n_copies:
            return starts[:n_copies], lb
        b = b[1:]
    return None


def window_plan(n_tokens: int, max_length: int) -> list[tuple[int, int, int]]:
    """mimir's sliding window for a sequence longer than the context: (begin, end, keep) per window, where the window
    is tokens[begin:end] and its last ``keep`` log-probs are kept; concatenated they give the n_tokens - 1 values.

    Window max_length, stride max_length // 2; each token is predicted with the context back to its window's begin.
    A sequence that fits is one window (the same values as one pass).
    """
    if n_tokens <= max_length:
        return [(0, n_tokens, n_tokens - 1)]
    stride = max_length // 2
    if stride < 2:
        raise ValueError(f"context length {max_length} is too short for a sliding window")
    plan = []
    for i in range(0, n_tokens, stride):
        begin, end = max(i + stride - max_length, 0), min(i + stride, n_tokens)
        plan.append((begin, end, min(end - i, end - begin - 1)))
    return plan


def empirical_pvalues(target_nf, calib_mf) -> np.ndarray:
    """[N, F] float64 p-values of targets against a [M, F] calibration sample, per column:
    scipy.stats.percentileofscore(calib, target, kind='rank') / 100 = (#< + #<= + 1[#< < #<=]) / (2M).
    Small p = target small relative to the calibration sample."""
    t, c = np.asarray(target_nf, np.float64), np.sort(np.asarray(calib_mf, np.float64), axis=0)
    lo = np.stack([np.searchsorted(c[:, j], t[:, j], side="left") for j in range(t.shape[1])], axis=1)
    hi = np.stack([np.searchsorted(c[:, j], t[:, j], side="right") for j in range(t.shape[1])], axis=1)
    return (lo + hi + (lo < hi)) / (2.0 * c.shape[0])
