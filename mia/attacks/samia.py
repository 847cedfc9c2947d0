"""SaMIA (Kaneko et al. 2024, "Sampling-based Pseudo-Likelihood for Membership Inference Attacks", arXiv 2404.11262).

A black-box attack: it only samples text from the model. For an example x with words w_1..w_W (``str.split()``):

  prompt      the first k = int(W * prefix_ratio) words joined by " " (prefix_ratio 0.5), tokenized with the target
              tokenizer
  reference   the remaining words w_{k+1}..w_W
  candidates  n continuations of the prompt sampled from the model (``mia.engine.generate``: top-k 50, temperature 1.0,
              until EOS or ``max_length`` tokens in all, prompt included: 1024 as the official sampling script, cut
              to the context the model was trained at, with a note), decoded without special tokens, split into words;
              each call holds at most ``--token-budget`` key slots (rows x (prompt + continuation) tokens) per
              ``data`` device; on a mesh the prompts are split over ``data`` (the samples do not change)
  ROUGE-1     per candidate: recall of the reference unigrams, sum_w min(count_ref(w), count_cand(w)) / |reference|
              (0 when the candidate or the reference is empty), the official ``rouge_n(..., n=1)``
  samia       the mean ROUGE-1 over the n candidates (n = 10, the official default)
  samia_zlib  the mean over candidates of ROUGE-1 x len(zlib.compress(" ".join(candidate words))) in bytes (the
              official ``--zlib`` option: the product, not a ratio)

HIGHER = MEMBER, as the source (nlp-titech/samia ``eval_samia.py`` scores ROC with seen = 1 on the raw average).
Differences from the official script, none changing the definition: it cuts the candidate out of the decoded
prompt + continuation at word round(nominal length / 2), we take the continuation's own words; its reference splits
on " " only, ours on any whitespace (as its prompt does). Samples are seeded: sample j of an example is drawn with
fold_in(fold_in(PRNGKey(seed), crc32(example id)), j), so an example's score does not depend on the others.

Definition and differences from the public code: docs/algorithms.md#samia, #samia_zlib.
"""
from __future__ import annotations

import zlib as _zlib

import jax
import jax.numpy as jnp
import numpy as np

from ..engine.batching import pow2_ceil
from ..engine.generate import GenerationError, default_eos_ids, generate
from .fit import add_note, context_length
from .recall import memo
from .registry import AttackError, register
from ..validate import Range
from .zlib import zlib_length

PAPER_MAX_LENGTH = 1024  # the official sampling script's generate(max_length=1024): prompt + continuation tokens


# ------------------------------------------------------------------------------------------------ pure functions
def split_prompt(text: str, prefix_ratio: float) -> tuple[list, list]:
    """(prompt words, reference words): the first int(W * prefix_ratio) whitespace-separated words, and the rest."""
    words = text.split()
    k = int(len(words) * prefix_ratio)
    return words[:k], words[k:]


@jax.jit
def rouge1_recall(ref_ids_bw: jax.Array, ref_mask_bw: jax.Array, cand_ids_bnc: jax.Array,
                  cand_mask_bnc: jax.Array) -> jax.Array:
    """[B, n] ROUGE-1 recall of each candidate against its example's reference.

    Word ids are per example: a reference's words take ids in [0, W) (W = ``ref_ids.shape[1]``), a candidate word
    that is not in its reference takes the id W (it never matches); masks are False on padding. Recall =
    sum_w min(count_ref(w), count_cand(w)) / |reference|, 0 when the reference or the candidate is empty.
    """
    b, w = ref_ids_bw.shape
    n = cand_ids_bnc.shape[1]
    ref_counts = jnp.zeros((b, w + 1), jnp.float32).at[jnp.arange(b)[:, None], ref_ids_bw].add(
        ref_mask_bw.astype(jnp.float32))
    cand_counts = jnp.zeros((b, n, w + 1), jnp.float32).at[
        jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], cand_ids_bnc].add(cand_mask_bnc.astype(jnp.float32))
    overlap = jnp.sum(jnp.minimum(ref_counts[:, None, :], cand_counts), axis=-1)
    n_ref = jnp.sum(ref_mask_bw, axis=-1).astype(jnp.float32)[:, None]
    n_cand = jnp.sum(cand_mask_bnc, axis=-1)
    return jnp.where((n_ref > 0) & (n_cand > 0), overlap / jnp.maximum(n_ref, 1.0), 0.0)


def word_ids(references: list, candidates: list) -> tuple[np.ndarray, ...]:
    """Reference word lists [B] and candidate word lists [B][n] -> padded per-example id arrays and masks for
    ``rouge1_recall``: each reference's distinct words get ids 0.., a candidate word not in its reference gets
    the id W, the padded reference width (never matched)."""
    b, n = len(references), max((len(c) for c in candidates), default=1)
    w = pow2_ceil(max(8, max((len(r) for r in references), default=1)))  # power-of-two widths: few programs
    c = pow2_ceil(max(8, max((len(s) for cs in candidates for s in cs), default=1)))
    ref_ids, ref_mask = np.zeros((b, w), np.int32), np.zeros((b, w), bool)
    cand_ids, cand_mask = np.zeros((b, n, c), np.int32), np.zeros((b, n, c), bool)
    for i, (ref, cands) in enumerate(zip(references, candidates)):
        ids: dict = {}
        for j, word in enumerate(ref):
            ref_ids[i, j] = ids.setdefault(word, len(ids))
            ref_mask[i, j] = True
        for s, cand in enumerate(cands):
            cand_ids[i, s, :len(cand)] = [ids.get(word, w) for word in cand]
            cand_mask[i, s, :len(cand)] = True
    return ref_ids, ref_mask, cand_ids, cand_mask


def samia_scores(references: list, candidates: list, use_zlib: bool = False) -> np.ndarray:
    """[B] float64 mean over each example's candidates of ROUGE-1 recall (x the candidate's zlib length in bytes
    when ``use_zlib``). ``references``: word lists; ``candidates``: per example, n word lists."""
    rouge = np.asarray(rouge1_recall(*word_ids(references, candidates)), np.float64)
    if use_zlib:
        rouge = rouge * np.array([[zlib_length(" ".join(c)) for c in cands] for cands in candidates], np.float64)
    return rouge.mean(axis=1)


# ------------------------------------------------------------------------------------------------ the attack
def sampled_candidates(ctx, *, n: int, top_k: int, temperature: float, prefix_ratio: float,
                       max_length: int) -> tuple[list, list]:
    """(reference word lists [N], candidate word lists [N][n]) for the evaluated examples, sampled once per run and
    parameter set (shared by samia and samia_zlib)."""
    key = ("samia", n, top_k, float(temperature), float(prefix_ratio), max_length, ctx.seed)
    m = memo(ctx)
    if key in m:
        return m[key]
    if n < 1 or top_k < 0 or not temperature > 0 or not 0 < prefix_ratio < 1 or max_length < 2:
        raise AttackError(f"attack samia: need n >= 1, top_k >= 0, temperature > 0, 0 < prefix_ratio < 1 and "
                          f"max_length >= 2; got n={n}, top_k={top_k}, temperature={temperature}, "
                          f"prefix_ratio={prefix_ratio}, max_length={max_length}")
    tok = ctx.model.tokenizer
    if tok is None:
        raise AttackError("attack samia: needs the model's tokenizer (it prompts with text and decodes the samples)")
    texts = ctx.texts()
    prompts, references = [], []
    for e, text in zip(ctx.examples, texts):
        words, ref = split_prompt(text, prefix_ratio)
        if not words or not ref:
            raise AttackError(f"attack samia: example {e.id} has {len(text.split())} word(s); its prompt and its "
                              f"reference (the words before and after word {len(words)}) must both be non-empty")
        ids = np.asarray(tok(" ".join(words))["input_ids"], np.int32)
        if len(ids) == 0:
            raise AttackError(f"attack samia: example {e.id}: its prompt tokenizes to no tokens")
        prompts.append(ids)
        references.append(ref)
    C = context_length(ctx)
    total = min(max_length, C)
    if max_length > C:
        add_note(ctx, f"samia: samples end at {C} tokens (prompt + continuation), the context the model was trained "
                      f"at, instead of max_length={max_length}")
    budgets = [total - len(p) for p in prompts]
    if min(budgets) < 1:
        i = int(np.argmin(budgets))
        raise AttackError(f"attack samia: example {ctx.examples[i].id}: its {len(prompts[i])}-token prompt leaves no "
                          f"room to generate within {total} tokens")
    try:
        samples = generate(ctx.model, prompts, max_new=budgets, n=n, temperature=temperature, top_k=top_k,
                           seed=ctx.seed, prompt_ids=[_zlib.crc32(e.id.encode("utf-8")) for e in ctx.examples],
                           min_bucket=ctx.settings.min_bucket, token_budget=ctx.settings.token_budget)
    except GenerationError as err:
        raise AttackError(f"attack samia: {err}") from None
    eos = set(default_eos_ids(ctx.model))
    candidates = [[tok.decode([t for t in s.tolist() if t not in eos], skip_special_tokens=True).split()
                   for s in per_example] for per_example in samples]
    m[key] = (references, candidates)
    return m[key]


_DEFAULTS = dict(n=10, top_k=50, temperature=1.0, prefix_ratio=0.5, max_length=PAPER_MAX_LENGTH)
_LIMITS = dict(n=Range(1), top_k=Range(0), temperature=Range(0, lo_open=True),
               prefix_ratio=Range(0, 1, lo_open=True, hi_open=True), max_length=Range(2))  # checked at --attacks
_COST = ("10 sampled continuations per example at the default n=10 (~0.14 s per example at context 64 on 2 CPU "
         "cores, several times more at context 128)")


@register("samia", needs=("model", "text"), cost="heavy", cost_note=_COST, limits=_LIMITS, **_DEFAULTS)
def _samia(ctx, **params) -> np.ndarray:
    """SaMIA (Kaneko et al. 2024): mean ROUGE-1 recall of x's second half by n samples continuing its first half.
    Higher = member, as the source."""
    return samia_scores(*sampled_candidates(ctx, **params))


@register("samia_zlib", needs=("model", "text"), cost="heavy", cost_note=_COST, limits=_LIMITS, **_DEFAULTS)
def _samia_zlib(ctx, **params) -> np.ndarray:
    """SaMIA*zlib (Kaneko et al. 2024): mean over the n samples of ROUGE-1 x the sample's zlib-compressed bytes.
    Higher = member, as the source."""
    return samia_scores(*sampled_candidates(ctx, **params), use_zlib=True)
