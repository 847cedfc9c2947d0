"""WBC, Window-Based Comparison (Chen et al., USENIX Security 2026, arXiv 2601.02751); docs/attacks.md#wbc.

One target pass and one reference pass (log-probs of the same token ids; with ``--adapter`` the base model). With the
per-token losses l_t = -log p_target(x_t) and r_t = -log p_ref(x_t) over the n scored positions (the common ones when
the reference context is shorter), for each window size w of ``windows`` (geometrically spaced; w_eff = min(w, n)),
every window of w_eff consecutive positions casts a vote

    vote_j = 1  if  sum_{t in window j} r_t  >  sum_{t in window j} l_t   (a tie votes 0),   j = 1 .. n - w_eff + 1

the size's score is the mean vote, and WBC(x) is the mean over the sizes (0 when n = 0). HIGHER = MEMBER: the
fine-tune's loss is below the reference's in most local windows.

The window sums are float64 (of the float32 losses), as the official ``np.convolve`` computes them, so that a vote is
the official's vote: a float32 running sum could flip a near-tie, and one vote moves a score by 1/(n - w_eff + 1).
This is why WBC is a NumPy host function and not a jitted one: its cost is N x L x |windows| additions, nothing
beside the two passes.
"""
from __future__ import annotations

import numpy as np

from .ez_mia import padded_reference
from .reference import aligned_reference_logprobs
from .registry import AttackError, register

# the official repository's default ``context_window_lengths`` (README), roughly x1.4 apart from 2 to 40
WINDOWS = "2/3/4/6/9/13/18/25/32/40"


def window_sizes(text: str) -> tuple[int, ...]:
    """``"2/3/4"`` -> (2, 3, 4): positive integers separated by ``/``; ``AttackError`` otherwise."""
    try:
        sizes = tuple(int(w) for w in text.split("/"))
    except ValueError:
        sizes = ()
    if not sizes or any(w < 1 for w in sizes):
        raise AttackError(f"attack wbc, parameter windows: expected positive integers separated by '/', e.g. "
                          f"{WINDOWS}; got {text!r}")
    return sizes


def wbc_score(target_loss: np.ndarray, ref_loss: np.ndarray, sizes) -> float:
    """WBC of one text: its [n] target and reference token losses (module docstring)."""
    n = min(len(target_loss), len(ref_loss))
    if n == 0:
        return 0.0
    t, r = np.asarray(target_loss[:n], np.float64), np.asarray(ref_loss[:n], np.float64)
    votes = []
    for w in sizes:
        k = min(w, n)
        t_sums = np.lib.stride_tricks.sliding_window_view(t, k).sum(-1)
        r_sums = np.lib.stride_tricks.sliding_window_view(r, k).sum(-1)
        votes.append(np.mean(r_sums > t_sums))
    return float(np.mean(votes))


@register("wbc", needs=("stats", "ref"), stats=("logprob",), windows=WINDOWS)
def _wbc(ctx, *, windows: str = WINDOWS) -> np.ndarray:
    """WBC: sign votes of target-vs-reference loss sums in sliding windows of several sizes, averaged (higher =
    member). windows: sizes separated by '/'. Needs a reference model: --ref-model, or the base of --adapter."""
    sizes = window_sizes(windows)
    p = ctx.padded(("logprob",))
    ref, have = padded_reference(aligned_reference_logprobs(ctx, "wbc"), p["mask"].shape)
    keep = p["mask"] & have
    return np.array([wbc_score(-p["logprob"][i][keep[i]], -ref[i][keep[i]], sizes) for i in range(len(keep))])
