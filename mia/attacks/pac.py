"""PAC, Polarized Augment Calibration (Ye et al. 2024, "Data Contamination Calibration for Black-box LLMs", ACL 2024;
official code yyy01/PAC ``attack.py``, ``src/eda.py``).

Polarized distance of the T-1 token log-probs l of a text, with far/local counts max(1, floor(k (T-1))):

  PD(x) = mean of the k_max-fraction LARGEST l  -  mean of the k_min-fraction SMALLEST l      (k_max 0.05, k_min 0.3)

Augmentation (EDA random swap, ``src/eda.py``): split the text on ' ', make n_swaps = max(1, floor(alpha * #words))
swaps, each of two distinct random positions (up to 3 draws of the second position; no swap if all 3 hit the
first), join with ' '. ``augment=tokens`` swaps the example's token ids the same way instead (no text or tokenizer
needed; our option). n augmented copies per example, alpha = 0.3, n = 10 (the SoK benchmark's ``pac_10`` setting; the
official script's N is 5). Each copy is tokenized with the target tokenizer, cut to the run's max length and scored
by the shared engine (n extra passes).

  official PAC(x) = PD(x) - mean_j PD(aug_j(x)), LOWER = member (its AUC is taken on -PAC; SoK returns -PAC).
  ours    pac(x)  = mean_j PD(aug_j(x)) - PD(x) = -PAC, HIGHER = MEMBER.

Seeded: example x's copies use ``numpy.random.default_rng([seed, h(x)])`` with h a hash of its text (or tokens), so a
score does not depend on the example's position or the batch. Copies with < 2 tokens are dropped; an example with
no usable copy scores NaN (noted).

Definition and differences from the public code: docs/algorithms.md#pac.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from ..engine.stats import pad_stats
from ._texts import stats_or_none, target_ids
from .mink import bottom_k_mean, check_k
from ..validate import Range
from ..engine.batching import pad_pow2
from .registry import AttackError, register

AUGMENTATIONS = ("words", "tokens")


def random_swaps(items: list, n_swaps: int, rng: np.random.Generator) -> list:
    """EDA random swap: ``n_swaps`` times swap two distinct random positions (3 tries for the second, else skip)."""
    out = list(items)
    for _ in range(n_swaps):
        i = int(rng.integers(len(out)))
        for _try in range(3):
            j = int(rng.integers(len(out)))
            if j != i:
                out[i], out[j] = out[j], out[i]
                break
    return out


def n_swaps(n_items: int, alpha: float) -> int:
    return max(1, int(alpha * n_items))


def augment_words(text: str, *, n: int, alpha: float, rng: np.random.Generator) -> list:
    """n copies of ``text`` with words (split on ' ') swapped."""
    words = text.split(" ")
    return [" ".join(random_swaps(words, n_swaps(len(words), alpha), rng)) for _ in range(n)]


def augment_tokens(tokens: np.ndarray, *, n: int, alpha: float, rng: np.random.Generator) -> list:
    """n copies of the token ids with ids swapped."""
    ids = [int(t) for t in tokens]
    return [np.asarray(random_swaps(ids, n_swaps(len(ids), alpha), rng), np.int32) for _ in range(n)]


def _polarized_distance(logprob_bl: jax.Array, mask_bl: jax.Array, *, k_max: float, k_min: float) -> jax.Array:
    """[B, L] log-probs and mask -> [B] mean of the k_max largest minus mean of the k_min smallest."""
    lp = logprob_bl.astype(jnp.float32)
    return -bottom_k_mean(-lp, mask_bl, k=k_max) - bottom_k_mean(lp, mask_bl, k=k_min)


polarized_distance = jax.jit(_polarized_distance, static_argnames=("k_max", "k_min"))


def pd_of_stats(stats: list, *, k_max: float, k_min: float) -> np.ndarray:
    """[len(stats)] float64 PD of each per-token stats dict."""
    if not stats:
        return np.zeros(0)
    p = pad_stats(stats, names=("logprob",))
    padded, n = pad_pow2({"logprob": p["logprob"], "mask": p["mask"]})
    return np.asarray(polarized_distance(padded["logprob"], padded["mask"], k_max=k_max, k_min=k_min), np.float64)[:n]


def _rng_for(seed: int, content: bytes) -> np.random.Generator:
    return np.random.default_rng([seed, int(hashlib.sha256(content).hexdigest()[:15], 16)])


def augmented_sequences(ctx, *, n: int, alpha: float, augment: str) -> list:
    """[N] lists of n token-id arrays: the augmented copies of each evaluated example."""
    if augment == "tokens":
        return [augment_tokens(e.tokens, n=n, alpha=alpha, rng=_rng_for(ctx.seed, e.tokens.astype(np.int32).tobytes()))
                for e in ctx.examples]
    texts = [augment_words(t, n=n, alpha=alpha, rng=_rng_for(ctx.seed, t.encode("utf-8"))) for t in ctx.texts()]
    flat = target_ids(ctx, [c for copies in texts for c in copies], "pac")
    return [flat[i * n:(i + 1) * n] for i in range(len(texts))]


@register(
    "pac",
    needs=("stats", "model", "text"), stats=("logprob",),
    cost="heavy",
    cost_note="10 augmented copies of every example at the default n=10, 10 extra scoring passes",
    n=10,
    alpha=0.3,
    k_max=0.05,
    k_min=0.3,
    augment="words",
    limits={
        "n": Range(1),
        "alpha": Range(0, 1, lo_open=True),
        "k_max": Range(0, 1, lo_open=True),
        "k_min": Range(0, 1, lo_open=True),
        "augment": AUGMENTATIONS,
    },
)
def _pac(ctx, *, n: int, alpha: float, k_max: float, k_min: float, augment: str) -> np.ndarray:
    """mean PD(swapped copies) - PD(x), PD = mean top-k_max minus mean bottom-k_min log-probs (higher = member).
    Ye et al. 2024."""
    if augment not in AUGMENTATIONS:
        raise AttackError(f"attack pac: unknown augmentation {augment!r}; valid: {', '.join(AUGMENTATIONS)}")
    if n < 1 or not 0 < alpha <= 1:
        raise AttackError(f"attack pac: need n >= 1 and 0 < alpha <= 1; got n={n}, alpha={alpha}")
    k_max, k_min = check_k("pac", k_max), check_k("pac", k_min)
    copies = augmented_sequences(ctx, n=n, alpha=alpha, augment=augment)
    flat = [c for cs in copies for c in cs]
    owner = np.repeat(np.arange(len(copies)), [len(cs) for cs in copies])
    stats = stats_or_none(ctx, flat, f"pac: scoring {n} augmented copies per example")
    ok = np.array([s is not None for s in stats], bool)
    pd_aug = np.full(len(flat), np.nan)
    pd_aug[ok] = pd_of_stats([s for s in stats if s is not None], k_max=k_max, k_min=k_min)
    total = np.bincount(owner[ok], weights=pd_aug[ok], minlength=len(copies))
    count = np.bincount(owner[ok], minlength=len(copies))
    if (count == 0).any():
        ctx.notes.append(f"pac: {int((count == 0).sum())} example(s) got no usable augmented copy; their score is NaN")
    pd_x = pd_of_stats(ctx.stats(), k_max=k_max, k_min=k_min)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / count - pd_x
