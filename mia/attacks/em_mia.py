"""EM-MIA (Kim et al. 2024, "Detecting Training Data of Large Language Models via Expectation Maximization") and
the ReCaLL-Avg baseline from the same code. docs/algorithms.md#em_mia, #recall_avg.

Pairwise ReCaLL matrix over the evaluated set D (N texts), every text once as a 1-shot prefix (p = x included):
  R[p, x] = LL(x | p) / LL(x)
LL(x | p) averages over x's tokens 2..L (em-mia: x's first token, predicted from p, is dropped), p's tokens alone
concatenated before x's ids with no separator (prefixes left-padded; ``mia.engine.conditional`` caches each prefix
once).
Context (``mia.attacks.fit``, C = the model's trained context, L = the longest text): every prefix keeps at most its
LAST R = min(L, max(C - L, C // 2)) tokens, and texts longer than C - R are cut, as targets, to their FIRST C - R
tokens, with LL(x) over the same tokens; so on full-context rows (Pythia/OLMo 2048-token rows) prefix and target get
half the context each instead of stopping with "no room for a prefix". Both cuts are noted.

em_mia, from an initial score f0 (higher = member; NaN -> 0), ``iters`` = 10 times, no convergence test:
  y_x = 1[f(x) > median(f)]              (strict >)
  r_p = AUC(R[p, :], y)                  (ties count 1/2; the official code's two alternatives:
                                          ``prefix_score=kendall``: Kendall's tau-b(R[p,:], f), scipy ``kendalltau``
                                          as em-mia's "Kendall-Tau"; NaN (a constant row or f) -> f = 0 below;
                                          ``prefix_score=rankdist``: 1 - mean|rank R[p,:] - rank f|/(N-1))
  f(x) = -r_x                            (a good non-member prefix is a non-member); NaN -> 0
Output f after the last iteration. HIGHER = MEMBER (em-mia's own convention too). The initial score is one of
loss | zlib | mink | minkpp | ref, computed by that registered attack with its defaults (em-mia: Min-K k = 0.2).

recall_avg(x) = mean_p R[p, x]  (ReCaLL-Avg; higher = member, as ReCaLL).
The iterations make no model call; with an on-disk cache a rerun with another ``init`` makes none at all.
"""
from __future__ import annotations

import numpy as np

from ..engine.conditional import loglik_matrix
from .fit import add_note, context_length, prefix_room
from .recall import fitted_targets, memo
from .registry import AttackError, check_attack_inputs, get, register
from ..validate import Range

INITS = ("loss", "zlib", "mink", "minkpp", "ref")


# ------------------------------------------------------------------------------------------------ pure numpy
def average_ranks(a_rn: np.ndarray) -> np.ndarray:
    """Row-wise 1-based ranks with ties given their average rank (scipy ``rankdata(axis=1)``)."""
    a = np.asarray(a_rn, np.float64)
    r, n = a.shape
    order = np.argsort(a, axis=1, kind="mergesort")
    s = np.take_along_axis(a, order, axis=1)
    new = np.ones((r, n), bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    gid = np.cumsum(new.ravel()) - 1  # tie-group id over the flattened rows (each row starts a group)
    pos = np.tile(np.arange(1, n + 1, dtype=np.float64), r)
    mean = np.bincount(gid, weights=pos) / np.bincount(gid)
    out = np.empty((r, n))
    np.put_along_axis(out, order, mean[gid].reshape(r, n), axis=1)
    return out


def rowwise_auc(scores_rn: np.ndarray, labels_n: np.ndarray) -> np.ndarray:
    """[R] AUC of each row of scores against the same 0/1 labels (ties 1/2); NaN when labels have one class."""
    y = np.asarray(labels_n, bool)
    n1 = float(y.sum())
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return np.full(len(scores_rn), np.nan)
    ranks = average_ranks(scores_rn)
    return (ranks[:, y].sum(1) - n1 * (n1 + 1) / 2) / (n1 * n0)


def rank_dist(scores_rn: np.ndarray, f_n: np.ndarray) -> np.ndarray:
    """[R] 1 - mean|rank(row) - rank(f)| / (N - 1), average ranks (em-mia's RankDist)."""
    n = len(f_n)
    return 1.0 - np.abs(average_ranks(scores_rn) - average_ranks(np.asarray(f_n)[None])).mean(1) / max(n - 1, 1)


def rowwise_kendall_tau(scores_rn: np.ndarray, f_n: np.ndarray) -> np.ndarray:
    """[R] Kendall's tau-b of each row with f (scipy ``kendalltau``, the em-mia "Kendall-Tau" prefix score; NaN when
    a row or f is constant). O(N log N) per row."""
    from scipy.stats import kendalltau

    f = np.asarray(f_n, np.float64)
    return np.array([kendalltau(row, f).statistic for row in np.asarray(scores_rn, np.float64)], np.float64)


PREFIX_SCORES = ("auc", "kendall", "rankdist")


def em_mia_scores(r_pn: np.ndarray, f0: np.ndarray, *, iters: int = 10, prefix_score: str = "auc") -> np.ndarray:
    """EM-MIA iterations on a ReCaLL matrix R [N, N] (rows = prefixes) from the initial score f0 [N]."""
    if iters < 1:  # zero iterations would return the initial score under em_mia's name
        raise AttackError(f"attack em_mia: iters must be >= 1, got {iters}")
    f = np.nan_to_num(np.asarray(f0, np.float64), nan=0.0)
    r_pn = np.asarray(r_pn, np.float64)
    for _ in range(iters):
        if prefix_score == "auc":
            r = rowwise_auc(r_pn, f > np.median(f))
        elif prefix_score == "kendall":
            r = rowwise_kendall_tau(r_pn, f)
        elif prefix_score == "rankdist":
            r = rank_dist(r_pn, f)
        else:
            raise AttackError(f"attack em_mia: prefix_score must be one of {', '.join(PREFIX_SCORES)}; "
                              f"got {prefix_score!r}")
        f = np.nan_to_num(-r, nan=0.0)
    return f


# ------------------------------------------------------------------------------------------------ host
def recall_matrix(ctx) -> np.ndarray:
    """R[p, x] = LL(x | p) / LL(x) over the evaluated examples, [N, N] float64 (computed once per run)."""
    m = memo(ctx)
    if "em_R" not in m:
        toks = [np.asarray(e.tokens, np.int32) for e in ctx.examples]
        C, longest = context_length(ctx), max(len(t) for t in toks)
        room = prefix_room(C, longest, longest)
        if room < 1:
            raise AttackError(f"em_mia: no room for a prefix in the {C}-token model context")
        prefixes = [t[-room:] for t in toks]
        cut = sum(len(t) > room for t in toks)
        if cut:
            add_note(ctx, f"em_mia: {cut} prefix(es) cut to their last {room} tokens so that prefix + target fit the "
                          f"{C}-token context the model was trained at")
        targets, ll = fitted_targets(ctx, room, 2, "em_mia")
        ll_cond = loglik_matrix(ctx.model, prefixes, targets, include_first=False, settings=ctx.settings,
                                desc="em_mia: pairwise conditional LL")
        m["em_R"] = ll_cond.astype(np.float64) / ll[None, :]
    return m["em_R"]


_QUADRATIC = "pairwise N x N conditional likelihoods (O(N^2) model calls)"


def _check_init(params: dict, inputs) -> None:
    """The inputs of the attack that gives EM-MIA's initial scores (``init=ref`` needs a reference model)."""
    init = params.get("init", "loss")
    check_attack_inputs(f"em_mia (init={init})", init, dict(get(init).defaults), inputs)


def initial_score(ctx, init: str) -> np.ndarray:
    if init not in INITS:
        raise AttackError(f"attack em_mia: init must be one of {', '.join(INITS)}; got {init!r}")
    spec = get(init)  # raises, listing the registered attacks, when that attack is not available
    return np.asarray(spec.fn(ctx, **spec.defaults), np.float64)


ITERS_MAX = 10_000  # em_mia:iters (the paper's 10 converge); a bound so a mistyped count cannot run forever


@register("em_mia", needs=("model", "stats"), cost="quadratic", cost_note=_QUADRATIC, check_inputs=_check_init,
          init="loss", iters=10, prefix_score="auc",
          limits={"init": INITS, "iters": Range(1, ITERS_MAX), "prefix_score": PREFIX_SCORES})
def _em_mia(ctx, *, init: str, iters: int, prefix_score: str) -> np.ndarray:
    """EM-MIA: prefix scores (AUC of R[p,:] vs median pseudo-labels; or kendall, rankdist) and membership f = -r,
    iterated (higher = member)."""
    if prefix_score not in PREFIX_SCORES:
        raise AttackError(f"attack em_mia: prefix_score must be one of {', '.join(PREFIX_SCORES)}; got "
                          f"{prefix_score!r}")
    f0 = initial_score(ctx, init)
    return em_mia_scores(recall_matrix(ctx), f0, iters=iters, prefix_score=prefix_score)


@register("recall_avg", needs=("model", "stats"), cost="quadratic", cost_note=_QUADRATIC)
def _recall_avg(ctx) -> np.ndarray:
    """ReCaLL-Avg: mean over every evaluated text p of LL(x|p)/LL(x) (higher = member). em-mia baseline."""
    return recall_matrix(ctx).mean(axis=0)
