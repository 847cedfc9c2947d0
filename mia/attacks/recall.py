"""ReCaLL (Xie et al. 2024, "ReCaLL: Membership Inference via Relative Conditional Log-Likelihoods").

  ReCaLL(x) = LL(x | P) / LL(x)                                         (variant "official", the default)

P is an n-shot prefix of known NON-members (partition "prefix" or ``--prefix-data``, checked disjoint from the
evaluated examples by id and token content). LL(x) is the unconditional mean token log-likelihood (T-1 terms,
docs/algorithms.md#conventions). LL(x | P) averages over x's tokens only, x's tokens attending to P's cached keys/values
(``mia.engine.conditional``); by default it includes x's first token predicted from P (L terms), as the ReCaLL and mimir
code do (``include_first=False`` gives em-mia's L-1 terms). Both LLs are negative, so the ratio is positive.
HIGHER = MEMBER, as the official code (ROC with member = 1 on the raw ratio); mimir returns -ratio.

Prefix (docs/algorithms.md#recall):
  - the FIRST n examples of the prefix partition, in file order (the official code takes the first n non-members
    after its shuffle); n = 12 by default (ReCaLL options);
  - text shots are joined with "" (no separator, official code) and the joined text is tokenized once with the
    target tokenizer; when any shot has only token ids (or was truncated), the shots' token ids are concatenated;
  - context (``mia.attacks.fit``): the prefix may use R = min(len(P), max(C - L, C // 2)) tokens, C the model's
    trained context, L the longest target: the LAST k shots that fit in R are kept (ReCaLL/mimir fit the average
    target length; we fit every target); when not even the last shot fits, the last R tokens of the joined prefix.
    Targets longer than C - len(prefix) are cut to their first tokens, and LL(x) is taken over the same tokens.
    Notes say when shots were dropped or targets cut.

  ReCaLL-CheckMIA(x) = LL([P; x]) - LL(x)                               (``variant=checkmia``)

CheckMIABench's own ReCaLL (pandora ``ReCaLL`` feature, docs/algorithms.md#recall-checkmia; the paper: "we
use 100-token long prefixes"): P = the first ``tokens`` (100) tokens of the prefix partition's token ids
concatenated in file order (pandora: of the non-member training token stream); LL([P; x]) is the mean log-prob over
EVERY predicted position of the concatenation, the prefix's own P - 1 tokens included (pandora averages the whole
prefixed sequence), computed as (sum of P's log-probs alone + L * LL(x | P)) / (P - 1 + L) since the model is causal.
pandora's statistic is NLL([P; x]) - NLL(x) and the paper's tables predict member with its negative (pandora's
``plot_ROC`` assumes members have the lower statistic), which is exactly this score: HIGHER = MEMBER, and its AUC is
the paper's. (This is the opposite of ReCaLL's own hypothesis, under which a non-member prefix lowers a member's LL
more; the docs say so.) ``n`` and ``include_first`` do not apply. The same context rule fits P and x.

Definition and differences from the public code: docs/algorithms.md#recall, #recall-checkmia.
"""
from __future__ import annotations

import numpy as np

from ..engine.conditional import loglik_matrix
from ..data.examples import Example
from .context import assert_disjoint
from .fit import add_note, context_length, cut_note, cut_targets, prefix_room, truncated_ll
from .registry import AttackError, get, register
from ..validate import Range


def memo(ctx) -> dict:
    """Per-run memo shared by the attacks of one ``AttackContext`` (conditional-LL matrices, reference model)."""
    return ctx.__dict__.setdefault("_memo", {})


def unconditional_ll(ctx) -> np.ndarray:
    """[N] float64 LL(x): mean token log-likelihood from the shared stats pass (the ``loss`` attack)."""
    return get("loss").fn(ctx)


VARIANTS = ("official", "checkmia")


def build_prefix(shots: list, tokenizer, room: int) -> tuple[np.ndarray, int, str, bool]:
    """(prefix token ids, shots kept k, mode "text"|"tokens", partial): the last k shots with len(prefix) <= ``room``;
    when not even the last shot fits, its last ``room`` tokens (k = 1, partial = True)."""
    as_text = tokenizer is not None and all(e.text is not None and not e.truncated for e in shots)

    def ids_of(kept):
        if as_text:
            return np.asarray(tokenizer("".join(e.text for e in kept))["input_ids"], np.int32)
        return np.concatenate([np.asarray(e.tokens, np.int32) for e in kept])

    mode = "text" if as_text else "tokens"
    for k in range(len(shots), 0, -1):
        ids = ids_of(shots[len(shots) - k:])
        if 0 < len(ids) <= room:
            return ids, k, mode, False
    if room < 1:
        raise AttackError("recall: no room for a prefix in the model context")
    return ids_of(shots[-1:])[-room:], 1, mode, True


def recall_prefix(ctx, n: int) -> np.ndarray:
    """The n-shot prefix fitted to the model context (``mia.attacks.fit``), with a note."""
    if n < 1:
        raise AttackError(f"attack recall: n must be >= 1, got {n}")
    shots = ctx.partition("prefix", min_size=n, flag="--prefix-data")[:n]
    return fitted_prefix(ctx, shots, n, "recall")


def fitted_prefix(ctx, shots: list, n: int, what: str) -> np.ndarray:
    """Token ids of ``shots`` (the first n of a prefix partition) as a prefix fitted to the model context
    (``build_prefix`` + ``mia.attacks.fit``), checked disjoint from the evaluated examples, with a note."""
    assert_disjoint(ctx.examples, shots, f"{what}: prefix data")
    longest = max(len(e.tokens) for e in ctx.examples)
    C = context_length(ctx)
    wanted = len(build_prefix(shots, ctx.model.tokenizer, 1 << 62)[0])
    ids, k, mode, partial = build_prefix(shots, ctx.model.tokenizer, prefix_room(C, longest, wanted))
    how = "joined as text with no separator" if mode == "text" else "as concatenated token ids"
    note = f"{what}: prefix = {k} shot(s) {how}, {len(ids)} tokens"
    if partial:
        note += f" (the last {len(ids)} tokens of the last shot"
    elif k < n:
        note += f" (kept the last {k} of {n}"
    if partial or k < n:
        note += f" so that prefix + target fit the {C}-token context the model was trained at)"
    add_note(ctx, note)
    return ids


def conditional_ll(ctx, prefix: np.ndarray, targets: list, include_first: bool, desc: str) -> np.ndarray:
    """[N] LL(x | prefix) over ``targets`` (``mia.engine.conditional``, the prefix's KV cache computed once), memoized
    per
    run by (prefix tokens, include_first, target length) so attacks sharing a prefix share the pass."""
    key = ("recall", prefix.tobytes(), bool(include_first), max(len(t) for t in targets))
    m = memo(ctx)
    if key not in m:
        m[key] = loglik_matrix(ctx.model, [prefix], targets, include_first=include_first,
                               settings=ctx.settings, desc=desc)[0]
    return m[key]


def fitted_targets(ctx, prefix_len: int, min_tokens: int, what: str) -> tuple[list, np.ndarray]:
    """(evaluated targets cut to C - prefix_len tokens, [N] LL(x) over those same tokens), with a note when cut."""
    C = context_length(ctx)
    length = C - prefix_len
    targets, n_cut = cut_targets([e.tokens for e in ctx.examples], length, min_tokens, what)
    if n_cut:
        add_note(ctx, cut_note(what, n_cut, length, C, prefix_len))
        return targets, truncated_ll(ctx.padded(), length)
    return targets, unconditional_ll(ctx)


def recall_scores(ll_cond: np.ndarray, ll: np.ndarray) -> np.ndarray:
    """[N] LL(x|P) / LL(x) (higher = member)."""
    return np.asarray(ll_cond, np.float64) / np.asarray(ll, np.float64)


@register("recall", needs=("model", "stats", "prefix"), stats=("logprob",), n=12, include_first=True,
          variant="official", tokens=100, limits={"n": Range(1), "variant": VARIANTS, "tokens": Range(2)})
def _recall(
    ctx, *, n: int = 12, include_first: bool = True, variant: str = "official", tokens: int = 100
) -> np.ndarray:
    """ReCaLL: LL(x | n-shot non-member prefix) / LL(x) (higher = member), Xie et al. 2024; ``variant=checkmia``:
    CheckMIABench's LL([P; x]) - LL(x) with a ``tokens``-token prefix, the paper's orientation (higher = member)."""
    if variant not in VARIANTS:
        raise AttackError(f"attack recall: variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    if variant == "checkmia":
        return checkmia_recall(ctx, tokens)
    prefix = recall_prefix(ctx, n)
    targets, ll = fitted_targets(ctx, len(prefix), 1 if include_first else 2, "recall")
    return recall_scores(conditional_ll(ctx, prefix, targets, include_first, "recall: conditional LL"), ll)


# ------------------------------------------------------------------------------------------------ CheckMIABench's
def checkmia_prefix(ctx, tokens: int) -> np.ndarray:
    """The first ``tokens`` tokens of the prefix partition's token ids, concatenated in file order, fitted to the
    context (the first R tokens when R < tokens)."""
    if tokens < 2:
        raise AttackError(f"attack recall: tokens must be >= 2, got {tokens}")
    shots = ctx.partition("prefix", min_size=1, flag="--prefix-data")
    stream, used = [], 0
    for e in shots:
        if used >= tokens:
            break
        stream.append(np.asarray(e.tokens, np.int32))
        used += len(e.tokens)
    assert_disjoint(ctx.examples, shots[:len(stream)], "recall: prefix data")
    ids = np.concatenate(stream)[:tokens]
    C = context_length(ctx)
    room = prefix_room(C, max(len(e.tokens) for e in ctx.examples), len(ids))
    note = (
        f"recall:variant=checkmia: prefix = the first {min(len(ids), room)} tokens of {len(stream)} prefix example(s)"
    )
    if len(ids) < tokens:
        note += f" (only {len(ids)} of the {tokens} asked exist)"
    if room < len(ids):
        note += f" (of {len(ids)}, so that prefix + target fit the {C}-token context the model was trained at)"
        ids = ids[:room]
    add_note(ctx, note)
    return ids


def checkmia_recall_scores(prefix_logprob_sum: float, n_prefix: int, ll_cond: np.ndarray, n_target: np.ndarray,
                           ll: np.ndarray) -> np.ndarray:
    """[N] LL([P; x]) - LL(x), with LL([P; x]) = (sum of P's P-1 log-probs + L * LL(x|P)) / (P - 1 + L), L = len(x)
    (``ll_cond``: LL(x | P) over x's L tokens, its first predicted from P). Higher = member (the paper's prediction)."""
    n_target = np.asarray(n_target, np.float64)
    ll_all = (float(prefix_logprob_sum) + n_target * np.asarray(ll_cond, np.float64)) / (n_prefix - 1 + n_target)
    return ll_all - np.asarray(ll, np.float64)


def checkmia_recall(ctx, tokens: int) -> np.ndarray:
    prefix = checkmia_prefix(ctx, tokens)
    targets, ll = fitted_targets(ctx, len(prefix), 1, "recall:variant=checkmia")
    ll_cond = conditional_ll(ctx, prefix, targets, True, "recall: conditional LL")
    own = ctx.stats_for([Example("recall-prefix", tokens=prefix)], desc="recall: prefix")[0]["logprob"]
    return checkmia_recall_scores(float(np.sum(np.asarray(own, np.float64))), len(prefix), ll_cond,
                                  np.array([len(t) for t in targets]), ll)
