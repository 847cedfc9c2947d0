"""A BERT masked language model in Flax (encoder from ``mia.models.bert`` + the ``cls.predictions`` head), and the
neighbour search of Mattern et al. 2023 on top of it. No torch at run time.

Head (transformers ``BertOnlyMLMHead``): dense D->D, activation, LayerNorm, then the decoder D->V tied to the word
embeddings (or ``cls.predictions.decoder.weight`` when the checkpoint unties it) plus ``cls.predictions.bias``.

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

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..models.bert import BertLayer, Encoder, load_encoder
from ..models.common import LayerNorm, activation
from ..models.hub import CheckpointError, fingerprint, nonfinite_tensor, read_safetensors, resolve_lazy


@dataclasses.dataclass(frozen=True, eq=False)
class MaskedLM:
    encoder: Encoder
    params: Any  # {"encoder": ..., "head": {dense_w, dense_b, ln_w, ln_b, bias, decoder?}}
    tokenizer: Any
    content_address: Any  # the fingerprint, or a zero-argument function computing it on first use

    @property
    def fingerprint(self) -> str:
        """Content address of the MLM's weights, hashed on first use only (the neighbour cache's key)."""
        return resolve_lazy(self, "content_address")

    @property
    def config(self):
        return self.encoder.config

    @property
    def max_length(self) -> int:
        return self.encoder.max_length


def load_mlm(path) -> MaskedLM:
    """Load a local BertForMaskedLM directory (config.json, model.safetensors with ``cls.predictions.*``, tokenizer)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"masked LM directory not found: {root}")
    enc = load_encoder(root)
    weights = Path(enc.path) if (Path(enc.path) / "model.safetensors").exists() else root
    t = read_safetensors(weights / "model.safetensors")
    pre = "cls.predictions."
    need = ["transform.dense.weight", "transform.dense.bias", "transform.LayerNorm.weight", "transform.LayerNorm.bias"]
    alt = {"transform.LayerNorm.weight": "transform.LayerNorm.gamma",
           "transform.LayerNorm.bias": "transform.LayerNorm.beta"}
    get = lambda k: t.get(pre + k, t.get(pre + alt.get(k, k)))  # noqa: E731
    missing = [pre + k for k in need if get(k) is None]
    bias = t.get(pre + "bias", t.get(pre + "decoder.bias"))
    if bias is None:
        missing.append(pre + "bias")
    if missing:
        raise CheckpointError(f"{weights}: not a masked LM checkpoint (missing {', '.join(missing)})")
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
    head = {
        "dense_w": f32(get("transform.dense.weight")).T,
        "dense_b": f32(get("transform.dense.bias")),
        "ln_w": f32(get("transform.LayerNorm.weight")),
        "ln_b": f32(get("transform.LayerNorm.bias")),
        "bias": f32(bias),
    }
    dec = t.get(pre + "decoder.weight")
    head_tensors = {k: v for k, v in t.items() if k.startswith(pre)}
    damaged = nonfinite_tensor(head_tensors)
    if damaged is not None:
        raise CheckpointError(f"{weights / 'model.safetensors'}: tensor {damaged[0]!r} holds {damaged[1]} non-finite "
                              "value(s) (NaN or inf); the weights are damaged")
    word = np.asarray(enc.params["word_embeddings"]["embedding"])
    if dec is not None and not np.array_equal(np.asarray(dec, np.float32), word):
        head["decoder"] = f32(dec)
    return MaskedLM(enc, {"encoder": enc.params, "head": head}, enc.tokenizer, functools.partial(fingerprint, weights))


# ------------------------------------------------------------------------------------------------ pure functions
def embeddings(cfg, enc_params, word_btd):
    """BERT embedding layer on given word vectors: + position + token type 0, then LayerNorm."""
    t = word_btd.shape[1]
    x = (word_btd + enc_params["position_embeddings"]["embedding"][:t][None]
         + enc_params["token_type_embeddings"]["embedding"][0][None, None])
    return LayerNorm(cfg.layer_norm_eps).apply({"params": enc_params["embeddings_LayerNorm"]}, x)


def encode(cfg, enc_params, x_btd, valid_bt):
    for i in range(cfg.num_hidden_layers):
        x_btd = BertLayer(cfg).apply({"params": enc_params[f"layer_{i}"]}, x_btd, valid_bt)
    return x_btd


def mlm_head(cfg, params, h_nd):
    """[N, D] final hidden states -> [N, V] float32 logits."""
    hp = params["head"]
    x = activation(cfg.hidden_act)(h_nd @ hp["dense_w"] + hp["dense_b"])
    x = LayerNorm(cfg.layer_norm_eps).apply({"params": {"weight": hp["ln_w"], "bias": hp["ln_b"]}}, x)
    w = hp.get("decoder", params["encoder"]["word_embeddings"]["embedding"])
    return (x @ w.T + hp["bias"]).astype(jnp.float32)


def mlm_logits(cfg, params, tokens_bt, valid_bt):
    """Plain MLM logits [B, T, V] (BertForMaskedLM(input_ids)); used by the parity test."""
    ep = params["encoder"]
    x = embeddings(cfg, ep, ep["word_embeddings"]["embedding"][tokens_bt])
    h = encode(cfg, ep, x, valid_bt)
    b, t, d = h.shape
    return mlm_head(cfg, params, h.reshape(b * t, d)).reshape(b, t, -1)


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
