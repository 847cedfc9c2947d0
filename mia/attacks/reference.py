"""Reference-model calibration (Carlini et al. 2021 "Ref"; em-mia's Ref init). docs/algorithms.md#ref.

  ref(x) = LL_target(x) - LL_ref(x)

LL = mean token log-likelihood (T-1 terms), each under its own model and tokenizer. HIGHER = MEMBER (the target
finds x likelier than a model that never saw it; em-mia's Ref = LL - LL_ref, the same sign).

The reference model is ``--ref-model DIR`` (a local HF-layout directory, loaded with ``mia.models.load``):
  - same vocabulary as the target (or no tokenizer in DIR and the same vocab size): the target token ids are
    scored as they are;
  - otherwise texts are re-tokenized with the reference tokenizer; examples given as token ids (or truncated)
    are first decoded ONCE with the target tokenizer (noted in the output);
  - sequences longer than the reference context are truncated to it (noted).
Reference stats go through the scoring engine, so they are cached on disk under the reference model's fingerprint.
"""
from __future__ import annotations

import numpy as np

from ..models import load
from ..engine.loop import compute_token_stats
from .recall import memo, unconditional_ll
from .registry import AttackError, register


def load_reference(ctx):
    """The reference Model for this run (loaded once). ``ctx.options["ref_model"]`` is a directory, or an already
    loaded ``mia.models.Model`` (so that runs over many evaluated sets share one model and its compiled code)."""
    m = memo(ctx)
    if "ref_model" not in m and hasattr(ctx.options.get("ref_model"), "params"):
        m["ref_model"] = ctx.options["ref_model"]
    if "ref_model" not in m:
        path = ctx.options.get("ref_model")
        if not path:
            raise AttackError("this attack needs a reference model: give --ref-model DIR (a local model directory), "
                              "or --adapter DIR (the base is the reference)")
        module = getattr(ctx.model, "module", None)
        dtypes = {} if module is None else {"dtype": module.dtype, "param_dtype": module.param_dtype}
        try:
            # the same layout (mesh and FSDP) and precision as the target model, so both score with the same batches
            # and a token-level comparison (ez_mia, wbc) never sees a precision difference as a fine-tuning one
            m["ref_model"] = load(path, mesh=ctx.model.mesh, fsdp=ctx.model.fsdp, **dtypes)
        except (FileNotFoundError, ValueError) as e:
            raise AttackError(f"--ref-model {path}: {e}") from None
    return m["ref_model"]


def reference_tokens(ctx, ref) -> list:
    """Token ids of each evaluated example for the reference model (see module docstring)."""
    tgt_tok, ref_tok = ctx.model.tokenizer, ref.tokenizer
    if ref_tok is None or (tgt_tok is not None and ref_tok.get_vocab() == tgt_tok.get_vocab()):
        if ref_tok is None and ref.vocab_size != ctx.model.vocab_size:
            raise AttackError(f"--ref-model {ref.path}: no tokenizer and a different vocabulary size "
                              f"({ref.vocab_size} vs {ctx.model.vocab_size}); cannot score the target token ids")
        toks = [np.asarray(e.tokens, np.int32) for e in ctx.examples]
    else:
        decoded = sum(e.text is None or e.truncated for e in ctx.examples)
        texts = ctx.texts()
        toks = [np.asarray(ref_tok(t)["input_ids"], np.int32) for t in texts]
        ctx.notes.append("ref: texts re-tokenized with the reference model's tokenizer"
                         + (f"; {decoded} example(s) given as token ids (or truncated) were decoded with the target "
                            "tokenizer first" if decoded else ""))
    limit = ref.max_tokens  # a text of C + 1 tokens fits a C-token context: its last token is only predicted
    cut = sum(len(t) > limit for t in toks)
    if cut:
        ctx.notes.append(f"ref: {cut} example(s) truncated to the reference context ({limit} tokens: "
                         f"{ref.max_length} positions + the last token, only predicted)")
    return [t[:limit] for t in toks]


def reference_logprobs(ctx) -> list:
    """Per evaluated example, the reference model's token log-probs [T_ref - 1] float32 (one pass, memoised: ``ref``,
    ``ez_mia`` and ``wbc`` share it); None where the reference tokenization has fewer than 2 tokens."""
    m = memo(ctx)
    if "ref_logprobs" not in m:
        ref = load_reference(ctx)
        toks = reference_tokens(ctx, ref)
        ok = [i for i, t in enumerate(toks) if len(t) >= 2]
        if len(ok) < len(toks):
            ctx.notes.append(f"ref: {len(toks) - len(ok)} example(s) have < 2 reference tokens; their ref score is NaN")
        stats = compute_token_stats(ref, [toks[i] for i in ok], ctx.settings, desc="reference model",
                                    stats=("logprob",))
        out: list = [None] * len(toks)
        for i, s in zip(ok, stats):
            out[i] = np.asarray(s["logprob"], np.float32)
        m["ref_logprobs"] = out
        m["ref_same_tokens"] = all(len(t) <= len(e.tokens) and np.array_equal(t, np.asarray(e.tokens)[:len(t)])
                                   for t, e in zip(toks, ctx.examples))
    return m["ref_logprobs"]


def aligned_reference_logprobs(ctx, attack: str) -> list:
    """``reference_logprobs`` for an attack that compares the two models token by token: the reference must have
    scored the target's own token ids (same vocabulary), else one ``AttackError``. Where the reference context is
    shorter, its arrays are shorter (the attack compares the common positions)."""
    lps = reference_logprobs(ctx)
    if not memo(ctx)["ref_same_tokens"]:
        raise AttackError(f"attack {attack} compares the target and reference models token by token: the reference "
                          "model must share the target's tokenizer (its texts were re-tokenized)")
    return lps


def reference_ll(ctx) -> np.ndarray:
    """[N] LL_ref(x) (NaN where the reference tokenization has fewer than 2 tokens)."""
    m = memo(ctx)
    if "ref_ll" not in m:
        m["ref_ll"] = np.array([np.nan if lp is None else float(np.mean(lp, dtype=np.float64))
                                for lp in reference_logprobs(ctx)])
    return m["ref_ll"]


@register("ref", needs=("stats", "ref"), stats=("logprob",))
def _ref(ctx) -> np.ndarray:
    """LL_target(x) - LL_ref(x) with --ref-model DIR (higher = member). Carlini et al. 2021."""
    return unconditional_ll(ctx) - reference_ll(ctx)
