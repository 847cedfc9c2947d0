"""Exposure of inserted canaries (Carlini et al. 2019, "The Secret Sharer").

A canary is one sequence drawn at random from a space R of sequences of the same format (here: random rows of
tokens or of words). Its rank is the number of sequences in R whose log-perplexity under the model is at most its
own (1 = the model prefers it to every other candidate); its exposure is

    exposure = log2 |R| - log2 rank        (bits; 0 = the least likely candidate, log2 |R| = the most likely).

|R| is astronomically large, so the rank is estimated from ``n`` candidates sampled from R:

- ``exposure_sampled`` (rank estimate): rank / |R| is estimated by (1 + #{candidates with loss <= canary loss}) /
  (n + 1), counting the canary as one of the sampled candidates. With p = rank / |R| the canary's true rank
  fraction, the count is Binomial(n, p), so the estimate's expectation is (1 + n p) / (n + 1): biased upwards by
  (1 - p) / (n + 1), and never below 1 / (n + 1). Exposure is therefore at most log2(n + 1) bits (a canary the
  model prefers to every candidate), however far beyond that its true exposure -log2 p goes; only for
  p >> 1 / n is the estimate close to p.
- ``exposure_skewnorm`` (extrapolation, the paper's Section 4.3 approach): fit a skew-normal distribution to the
  candidates' losses and take exposure = -log2 CDF(canary loss). Not capped; it trusts the fitted tail. Where the
  CDF underflows float64 (beyond ~1000 bits) it is +inf.

``losses`` here are any log-perplexity of the whole sequence (the total negative log-likelihood in nats or bits):
both estimators only compare or fit them, so the unit does not matter.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import skewnorm

from ..metrics import MetricError


def _check_losses(canary_losses, candidate_losses) -> tuple:
    c = np.atleast_1d(np.asarray(canary_losses, np.float64))
    r = np.asarray(candidate_losses, np.float64)
    if c.ndim != 1 or r.ndim != 1 or len(r) < 2:
        raise MetricError(f"need 1-D canary losses and at least 2 candidate losses, got {c.shape} and {r.shape}")
    for name, x in (("canary", c), ("candidate", r)):
        if not np.isfinite(x).all():
            raise MetricError(f"{int((~np.isfinite(x)).sum())} non-finite {name} loss(es) at positions "
                              f"{np.flatnonzero(~np.isfinite(x))[:10].tolist()}")
    return c, r


def exposure_sampled(canary_losses, candidate_losses) -> np.ndarray:
    """[m] exposure in bits of each canary, by its rank among ``candidate_losses`` [n] (see the module docstring);
    in [0, log2(n + 1)]."""
    c, r = _check_losses(canary_losses, candidate_losses)
    below = np.searchsorted(np.sort(r), c, side="right")  # candidates with loss <= canary loss
    return np.log2(len(r) + 1) - np.log2(1 + below)


def exposure_skewnorm(canary_losses, candidate_losses) -> np.ndarray:
    """[m] exposure in bits of each canary: -log2 of the skew-normal CDF fitted (maximum likelihood) to
    ``candidate_losses`` [n], at the canary's loss (see the module docstring)."""
    c, r = _check_losses(canary_losses, candidate_losses)
    a, loc, scale = skewnorm.fit(r)
    return np.maximum(-skewnorm.logcdf(c, a, loc, scale) / math.log(2), 0.0)


def exposure_by_reps(exposure, reps, included) -> list:
    """Exposure grouped by the number of insertions: one dict per distinct r (ascending) with ``reps``,
    ``n_included``, ``mean`` / ``median`` over the included canaries of that r, and ``excluded_mean`` over the
    excluded ones of that r (their exposure is the no-memorization baseline: about 1/ln 2 = 1.44 bits on average for
    ``exposure_sampled``)."""
    e, k, inc = np.asarray(exposure, np.float64), np.asarray(reps), np.asarray(included).astype(bool)
    if not (e.shape == k.shape == inc.shape) or e.ndim != 1:
        raise MetricError(f"exposure {e.shape}, reps {k.shape} and included {inc.shape} must be 1-D of equal length")
    out = []
    for r in np.unique(k):
        sel, out_sel = (k == r) & inc, (k == r) & ~inc
        out.append({"reps": int(r), "n_included": int(sel.sum()),
                    "mean": float(e[sel].mean()) if sel.any() else float("nan"),
                    "median": float(np.median(e[sel])) if sel.any() else float("nan"),
                    "excluded_mean": float(e[out_sel].mean()) if out_sel.any() else float("nan")})
    return out
