"""OLMo's native ``hf_olmo`` checkpoints (e.g. the per-1000-step revisions of allenai/OLMo-7B) read into the OLMo
family (``mia.models.olmo``) by a mapping: no OLMo code is imported or run.

config.json has ``model_type: "hf_olmo"`` and OLMo's own field names; a field it omits takes OLMo's default
(``NATIVE_DEFAULTS``, as OLMo's ``ModelConfig`` declares it). ``hf_config`` turns it into the transformers OLMo
config that the family reads:

  d_model -> hidden_size            n_layers -> num_hidden_layers       n_heads -> num_attention_heads
  n_kv_heads / multi_query_attention -> num_key_value_heads           max_sequence_length -> max_position_embeddings
  (mlp_hidden_size or mlp_ratio * d_model) / 2 -> intermediate_size   embedding_size (else vocab_size) -> vocab_size
  weight_tying -> tie_word_embeddings    rope_theta, clip_qkv, eos_token_id, pad_token_id as they are

and refuses every setting the family does not compute exactly (``REQUIRED``: no ALiBi or learned positions, no
biases, non-parametric default LayerNorm with eps 1e-5, sequential pre-norm blocks, SwiGLU, rotary in full
precision, unscaled logits) and every field it does not know (``NATIVE_DEFAULTS`` lists the known ones).

Tensors, named as the Hugging Face-hosted repositories store them (the ``model.`` prefix may be absent); F is the
intermediate size, K*E the key/value width; every one is a view of the checkpoint, nothing is copied:

  model.transformer.wte.weight                 [V, D]          -> model.embed_tokens.weight
  model.transformer.blocks.N.att_proj.weight   [D + 2KE, D]    rows q | k | v -> self_attn.{q,k,v}_proj.weight
  model.transformer.blocks.N.attn_out.weight   [D, D]          -> self_attn.o_proj.weight
  model.transformer.blocks.N.ff_proj.weight    [2F, D]         rows up | gate -> mlp.{up,gate}_proj.weight
  model.transformer.blocks.N.ff_out.weight     [D, F]          -> mlp.down_proj.weight
  model.transformer.ff_out.weight              [V, D]          -> lm_head.weight (absent with weight_tying)

OLMo's SwiGLU splits the ff_proj output in two halves ``x, gate`` and computes ``silu(gate) * x``: the FIRST half
of the rows is the up projection and the SECOND the gate (as OLMo's own conversion script splits it).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..validate import boolean, integer, number
from .common import ConfigError

MODEL_TYPE = "hf_olmo"
FAMILY = "olmo"
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # the repositories name OLMo's own class (remote code): never run
LN_EPS = 1e-5  # the OLMo family's LayerNorm epsilon (fixed, as in transformers)

# Every field of OLMo's ModelConfig with its default (what OLMo itself uses when config.json omits it).
NATIVE_DEFAULTS: dict[str, Any] = {
    "d_model": 768, "n_heads": 12, "n_kv_heads": None, "clip_qkv": None, "n_layers": 12, "mlp_ratio": 4,
    "mlp_hidden_size": None, "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1,
    "alibi": False, "alibi_bias_max": 8.0, "rope": False, "rope_full_precision": True, "rope_theta": 10000,
    "flash_attention": False, "attention_dropout": 0.1, "multi_query_attention": None, "attention_layer_norm": False,
    "residual_dropout": 0.1, "embedding_dropout": 0.1, "embedding_layer_norm": False, "layer_norm_type": "default",
    "layer_norm_with_affine": True, "layer_norm_eps": 1e-5, "attention_layer_norm_with_affine": True,
    "max_sequence_length": 1024, "include_bias": True, "bias_for_layer_norm": None, "scale_logits": False,
    "vocab_size": 50257, "embedding_size": 50304, "weight_tying": True, "eos_token_id": 50256,
    "pad_token_id": 50256, "init_device": None, "init_fn": "normal", "init_std": 0.02, "init_cutoff_factor": None,
    "precision": None, "scale_emb_init": False, "emb_init_std": None, "norm_after": False,
}
# Settings the OLMo family computes; any other value is refused. Fields not listed here or mapped above
# (dropout, initialisation, flash attention, training precision, affine options of norms that are off) do not
# change the forward pass in evaluation.
REQUIRED: dict[str, Any] = {
    "rope": True, "alibi": False, "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1,
    "include_bias": False, "layer_norm_type": "default", "layer_norm_with_affine": False,
    "attention_layer_norm": False, "embedding_layer_norm": False, "norm_after": False, "scale_logits": False,
    "rope_full_precision": True,
}
# Fields transformers writes into any config.json; none changes the model.
HF_BOOKKEEPING = frozenset({"model_type", "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype",
                            "use_cache", "_name_or_path", "bos_token_id", "tie_word_embeddings"})


def hf_config(native: dict, source: str) -> dict:
    """A native ``hf_olmo`` config.json object -> the transformers ``olmo`` config dict of the same model; one
    ``ConfigError`` naming ``source`` and the field for an unknown field or a setting the family does not compute."""
    unknown = sorted(set(native) - set(NATIVE_DEFAULTS) - HF_BOOKKEEPING)
    if unknown:
        raise ConfigError(f"{source}: hf_olmo config field(s) {', '.join(unknown)[:200]} are unknown to mia; it cannot "
                          f"tell whether they change the model, so it does not load it")
    cfg = {**NATIVE_DEFAULTS, **native}
    for field, wanted in REQUIRED.items():
        if type(cfg[field]) is not type(wanted) or cfg[field] != wanted:
            note = " (OLMo's default, the field is absent)" if field not in native else ""
            raise ConfigError(f"{source}: hf_olmo config field {field}={cfg[field]!r}{note} is not supported "
                              f"(mia's OLMo computes only {field}={wanted!r})")
    at = lambda k: f"{source}: field {k!r}"
    eps = number(cfg["layer_norm_eps"], at("layer_norm_eps"), lo=0, lo_open=True, error=ConfigError)
    if eps != LN_EPS:
        raise ConfigError(f"{at('layer_norm_eps')} = {eps} is not supported (the OLMo family's LayerNorm uses "
                          f"{LN_EPS})")
    d = integer(cfg["d_model"], at("d_model"), lo=1, error=ConfigError)
    heads = integer(cfg["n_heads"], at("n_heads"), lo=1, error=ConfigError)
    if d % heads:
        raise ConfigError(f"{source}: d_model={d} is not a multiple of n_heads={heads}")
    kv = kv_heads(cfg, heads, source)
    ff = cfg["mlp_hidden_size"]
    ff = (integer(ff, at("mlp_hidden_size"), lo=2, error=ConfigError) if ff is not None
          else integer(cfg["mlp_ratio"], at("mlp_ratio"), lo=1, error=ConfigError) * d)
    if ff % 2:
        raise ConfigError(f"{source}: the SwiGLU projection width {ff} (mlp_hidden_size or mlp_ratio * d_model) is odd")
    vocab = integer(cfg["vocab_size"], at("vocab_size"), lo=1, error=ConfigError)
    rows = vocab if cfg["embedding_size"] is None else integer(cfg["embedding_size"], at("embedding_size"), lo=1,
                                                                  error=ConfigError)
    if rows < vocab:
        raise ConfigError(f"{source}: embedding_size={rows} is smaller than vocab_size={vocab}")
    clip = cfg["clip_qkv"]
    return {
        "model_type": FAMILY,
        "vocab_size": rows,  # the embedding and output rows: logits cover the padded vocabulary
        "hidden_size": d,
        "num_hidden_layers": integer(cfg["n_layers"], at("n_layers"), lo=1, error=ConfigError),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d // heads,
        "intermediate_size": ff // 2,
        "max_position_embeddings": integer(cfg["max_sequence_length"], at("max_sequence_length"), lo=1,
                                           error=ConfigError),
        "rope_theta": number(cfg["rope_theta"], at("rope_theta"), lo=0, lo_open=True, error=ConfigError),
        "hidden_act": "silu",
        "attention_bias": False,
        "clip_qkv": None if clip is None else number(clip, at("clip_qkv"), lo=0, lo_open=True, error=ConfigError),
        "tie_word_embeddings": boolean(cfg["weight_tying"], at("weight_tying"), error=ConfigError),
        "bos_token_id": None,
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
    }


def kv_heads(cfg: dict, heads: int, source: str) -> int:
    """Key/value heads as OLMo derives them from ``n_kv_heads`` and ``multi_query_attention``."""
    n_kv, mqa = cfg["n_kv_heads"], cfg["multi_query_attention"]
    if mqa is not None:
        boolean(mqa, f"{source}: field 'multi_query_attention'", error=ConfigError)
    implied = None if mqa is None else (1 if mqa else heads)
    if n_kv is None:
        kv = 1 if mqa else heads
    else:
        kv = integer(n_kv, f"{source}: field 'n_kv_heads'", lo=1, error=ConfigError)
        if implied is not None and kv != implied:
            raise ConfigError(f"{source}: n_kv_heads={kv} contradicts multi_query_attention={mqa}")
    if heads % kv:
        raise ConfigError(f"{source}: n_heads={heads} is not a multiple of the key/value heads ({kv})")
    return kv


def hf_tensors(tensors: dict[str, np.ndarray], cfg, source: str, error) -> dict[str, np.ndarray]:
    """Native tensors -> the transformers OLMo tensor names of ``cfg`` (an ``OlmoConfig``), as views. Every tensor
    is checked against the config's shape under its native name; a missing or an unused one is one ``error``."""
    prefix = "model." if "model.transformer.wte.weight" in tensors else ""
    if prefix + "transformer.wte.weight" not in tensors:
        raise error(f"{source}: tensor 'model.transformer.wte.weight' is missing (not an hf_olmo checkpoint?)")
    used: set[str] = set()

    def take(name: str, shape: tuple) -> np.ndarray:
        full = prefix + name
        if full not in tensors:
            raise error(f"{source}: tensor {full!r} is missing")
        if tuple(tensors[full].shape) != shape:
            raise error(f"{source}: tensor {full!r} has shape {tuple(tensors[full].shape)}, expected {shape} for this "
                        f"config")
        used.add(full)
        return tensors[full]

    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": take("transformer.wte.weight", (v, d))}
    for i in range(cfg.num_hidden_layers):
        native, hf = f"transformer.blocks.{i}", f"model.layers.{i}"
        qkv = take(f"{native}.att_proj.weight", (q_rows + 2 * kv_rows, d))
        out[f"{hf}.self_attn.q_proj.weight"] = qkv[:q_rows]
        out[f"{hf}.self_attn.k_proj.weight"] = qkv[q_rows:q_rows + kv_rows]
        out[f"{hf}.self_attn.v_proj.weight"] = qkv[q_rows + kv_rows:]
        out[f"{hf}.self_attn.o_proj.weight"] = take(f"{native}.attn_out.weight", (d, q_rows))
        up_gate = take(f"{native}.ff_proj.weight", (2 * f, d))
        out[f"{hf}.mlp.up_proj.weight"] = up_gate[:f]
        out[f"{hf}.mlp.gate_proj.weight"] = up_gate[f:]
        out[f"{hf}.mlp.down_proj.weight"] = take(f"{native}.ff_out.weight", (d, f))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("transformer.ff_out.weight", (v, d))
    extra = sorted(k for k in tensors if k not in used)
    if extra:
        raise error(f"{source}: unexpected tensor(s) for this hf_olmo config: {', '.join(extra[:8])}"
                    + (" ..." if len(extra) > 8 else ""))
    return out
