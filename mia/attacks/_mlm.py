"""The neighbour search of Mattern et al. 2023 on a BERT masked language model (``mia.models.bert.load_mlm``, in
Flax: no torch at run time).

Neighbour search (Mattern et al. 2023 reference code, ``generate_neighbors``), for one text:
  tokens = MLM tokenizer(text, truncation at the MLM context); for every non-special position i:
    e = BERT embeddings(tokens) (word + position + type, LayerNorm) with dropout(p) on row i only;
    probs = softmax(MLM(inputs_embeds=e))[i]  -- as in the reference code, ``inputs_embeds`` goes through the
            embedding layer again (position/type embeddings added and LayerNorm applied a second time);
    for each of the top k+1 candidates c != t_i: score(c, i) = probs[c] / (1 - probs[t_i])
  neighbours = the n highest-scoring single-token replacements, decoded with the MLM tokenizer.
Ours vs the reference: special tokens ([CLS]/[SEP]/...) are neither replaced nor candidates, and neighbours are
decoded with ``skip_special_tokens`` (the reference decodes "[CLS] ... [SEP]" into the text); dropout uses a JAX
key (``fold_in(key, text index)``), so neighbours are reproducible for a seed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..models.bert import MaskedLM, embeddings, encode, mlm_head


def candidate_probs(cfg, params, tokens_t, valid_t, positions_c, key, *, p: float, k: int):
    """For each target position (one row each): (top-(k+1) probs [C, k+1], their ids [C, k+1], p(original) [C]).

    Row c sees the text with dropout(p) on the embedding row ``positions_c[c]`` (the reference's double embedding).
    """
    ep = params["encoder"]
    c = positions_c.shape[0]
    t = tokens_t.shape[0]
    e = embeddings(cfg, ep, ep["word_embeddings"]["embedding"][tokens_t][None])[0]  # [T, D]
    x = jnp.broadcast_to(e, (c, t, e.shape[-1]))
    if p > 0:
        keep = jax.random.bernoulli(key, 1.0 - p, (c, e.shape[-1]))
        row = x[jnp.arange(c), positions_c] * keep / (1.0 - p)
        x = x.at[jnp.arange(c), positions_c].set(row)
    x = embeddings(cfg, ep, x)  # inputs_embeds -> the embedding layer again, as the reference code does
    h = encode(cfg, ep, x, jnp.broadcast_to(valid_t, (c, t)))
    probs = jax.nn.softmax(mlm_head(cfg, params, h[jnp.arange(c), positions_c]), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k + 1)
    orig = jnp.take_along_axis(probs, tokens_t[positions_c][:, None], axis=1)[:, 0]
    return top_p, top_i, orig


@functools.lru_cache(maxsize=8)
def _jit_candidates(mlm: MaskedLM, p: float, k: int):
    return jax.jit(lambda params, tok, val, pos, key: candidate_probs(mlm.config, params, tok, val, pos, key, p=p, k=k))


def neighbours(mlm: MaskedLM, text: str, key, *, n: int = 10, k: int = 5, p: float = 0.7,
               rows: int = 32) -> list[str]:
    """The ``n`` best single-token MLM replacements of ``text`` (see module docstring), decoded as texts."""
    tok = mlm.tokenizer
    ids = list(tok(text, truncation=True, max_length=mlm.max_length)["input_ids"])
    special = set(tok.all_special_ids)
    positions = [i for i, t in enumerate(ids) if t not in special]
    if not positions:
        return []
    t = min(mlm.max_length, max(8, 1 << (len(ids) - 1).bit_length()))
    tokens = np.zeros(t, np.int32)
    tokens[:len(ids)] = ids
    valid = np.arange(t) < len(ids)
    fn = _jit_candidates(mlm, float(p), int(k))
    scores: dict = {}
    for lo in range(0, len(positions), rows):
        pos = np.asarray(positions[lo:lo + rows], np.int32)
        padded = np.full(rows, pos[0], np.int32)
        padded[:len(pos)] = pos
        top_p, top_i, orig = map(np.asarray, fn(mlm.params, tokens, valid, padded, jax.random.fold_in(key, lo)))
        for r, i in enumerate(pos):
            denom = (1.0 - float(orig[r])) if orig[r] < 1 else 1e-6
            for prob, cand in zip(top_p[r], top_i[r]):
                if int(cand) == ids[i] or int(cand) in special:
                    continue
                scores[(int(cand), int(i))] = float(prob) / denom
    best = sorted(scores, key=lambda ci: -scores[ci])[:n]  # stable: ties keep position order, like heapq.nlargest
    out = []
    for cand, i in best:
        new = list(ids)
        new[i] = cand
        out.append(tok.decode(new, skip_special_tokens=True))
    return out
