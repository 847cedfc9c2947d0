"""Con-ReCaLL (Wang et al. 2024, "Con-ReCall: Detecting Pre-training Data in LLMs via Contrastive Decoding",
arXiv 2409.03363; code WangCheng0116/CON-RECALL ``run.py``).

  ConReCaLL(x) = (LL(x | P_nm) - gamma * LL(x | P_m)) / LL(x)

P_nm: an n-shot prefix of known NON-members, P_m: an n-shot prefix of known MEMBERS (the official code takes the
first n = 12 of each class after its shuffle and joins each with "" as ReCaLL does). Each prefix is built and fitted
to the context the model was trained at exactly as ReCaLL's (``mia.attacks.recall.fitted_prefix``: the last whole
shots that fit, ``mia.attacks.fit``); the targets are cut to C - max(len(P_nm), len(P_m)) tokens when needed, so both
conditional LLs and LL(x) average over the same target tokens. LL(x | P) includes x's first token predicted from P
(L terms, the official ``get_conditional_ll``), from ``mia.engine.conditional`` with each prefix's KV cache computed
once;
the non-member pass is shared with ``recall`` when both run with the same prefix.

Sign: the official code computes the ROC with member = 1 on the raw score, so HIGHER = MEMBER, as here (a member's LL
drops more under a non-member prefix and rises more under a member prefix; both LLs are negative).
gamma: the official code reports every gamma in {0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0} and the paper the best
per setting (chosen with the evaluation labels); the mimir port in the SoK code fixes gamma = 1, our default (no labels
to tune on). gamma = 0 is ReCaLL.

Shots: non-members = the first n examples of the "prefix" partition (``--prefix-data``) not labelled member;
members = the first n of the "member_prefix" partition (``--member-prefix-data``), or, when there is none, the first
n examples labelled 1 of the "train" partition (``--train-data``), in file order. A note says which was used.

Definition and differences from the public code: docs/algorithms.md#conrecall.
"""
from __future__ import annotations

import numpy as np

from .fit import add_note
from .recall import conditional_ll, fitted_prefix, fitted_targets
from ..validate import Range
from .registry import AttackError, register


def conrecall_scores(ll_nonmember: np.ndarray, ll_member: np.ndarray, ll: np.ndarray, gamma: float) -> np.ndarray:
    """[N] (LL(x|P_nm) - gamma * LL(x|P_m)) / LL(x), float64 (higher = member)."""
    nm, m, u = (np.asarray(a, np.float64) for a in (ll_nonmember, ll_member, ll))
    return (nm - float(gamma) * m) / u


def nonmember_shots(ctx, n: int) -> list:
    """The first n examples of the 'prefix' partition that are not labelled member."""
    shots = [e for e in (ctx.partitions.get("prefix") or []) if e.label != 1]
    if len(shots) < n:
        raise AttackError(f"attack conrecall needs at least {n} non-member 'prefix' example(s), got {len(shots)} "
                          f"(give --prefix-data FILE or a split with a 'prefix' partition)")
    return shots[:n]


def select_member_shots(partitions: dict, n: int) -> tuple[str, list]:
    """(source, the first n member shots): the 'member_prefix' partition, else the members (label 1) of the 'train'
    partition; ``AttackError`` when a given member prefix holds a non-member or fewer than n shots exist. Pure: the
    CLI calls it before any attack runs, the attack when it runs."""
    given = partitions.get("member_prefix") or []
    if given:
        bad = [str(e.id) for e in given if e.label == 0]
        if bad:
            raise AttackError(f"attack conrecall: member prefix data hold non-members (label 0): {', '.join(bad[:5])}")
        source, shots = "the member_prefix partition", list(given)
    else:
        source, shots = "the members of the train partition", [e for e in (partitions.get("train") or [])
                                                               if e.label == 1]
    if len(shots) < n:
        raise AttackError(f"attack conrecall needs at least {n} member prefix example(s), got {len(shots)} from "
                          f"{source} (give --member-prefix-data FILE, or --train-data with label-1 rows)")
    return source, shots[:n]


def _check_member_shots(params: dict, inputs) -> None:
    """Enough member shots for ``n`` (``select_member_shots``), once the partitions are known."""
    if inputs.partitions is not None:
        select_member_shots(inputs.partitions, max(1, int(params.get("n", 1))))


def member_shots(ctx, n: int) -> list:
    """The first n member shots (``select_member_shots``), with a note saying where they came from."""
    source, shots = select_member_shots(ctx.partitions, n)
    add_note(ctx, f"conrecall: member prefix shots from {source}")
    return shots


@register("conrecall", needs=("model", "stats", "prefix", "member_prefix"), stats=("logprob",),
          check_inputs=_check_member_shots, n=12,
          gamma=1.0,
          limits={"n": Range(1), "gamma": Range(0)})
def _conrecall(ctx, *, n: int = 12, gamma: float = 1.0) -> np.ndarray:
    """Con-ReCaLL: (LL(x|non-member prefix) - gamma LL(x|member prefix)) / LL(x) (higher = member). Wang et al. 2024."""
    if n < 1:
        raise AttackError(f"attack conrecall: n must be >= 1, got {n}")
    if not np.isfinite(gamma) or gamma < 0:
        raise AttackError(f"attack conrecall: gamma must be a finite number >= 0, got {gamma}")
    p_nm = fitted_prefix(ctx, nonmember_shots(ctx, n), n, "conrecall (non-member)")
    p_m = fitted_prefix(ctx, member_shots(ctx, n), n, "conrecall (member)")
    targets, ll = fitted_targets(ctx, max(len(p_nm), len(p_m)), 1, "conrecall")
    ll_nm = conditional_ll(ctx, p_nm, targets, True, "conrecall: LL given the non-member prefix")
    ll_m = conditional_ll(ctx, p_m, targets, True, "conrecall: LL given the member prefix")
    return conrecall_scores(ll_nm, ll_m, ll, gamma)
