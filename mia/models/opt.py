"""OPT as a Flax module, following transformers' ``modeling_opt.py``.

Layout notes:
- Learned positions with an offset of 2: position p reads row p + 2 of ``embed_positions`` (a table of
  ``max_position_embeddings + 2`` rows); transformers' position ids are the count of real tokens before a token, as
  mia's own (``common.default_positions``), so left padding does not shift them.
- ``word_embed_proj_dim`` != ``hidden_size`` (OPT-350m): the token embedding (and the tied head) is that narrower
  width, ``project_in`` widens the token embedding before the positions are added and ``project_out`` narrows the
  final hidden states before the head (both torch Linear without bias).
- ``do_layer_norm_before``: pre-norm blocks and a final ``final_layer_norm`` (125m, 1.3b, 6.7b, ...); False (350m):
  post-norm blocks, x = norm(x + attn(x)), x = norm(x + mlp(x)), and no final norm. ``_remove_final_layer_norm``
  drops the final norm of a pre-norm stack too.
- Separate q/k/v/out projections (``enable_bias``: all with biases, and fc1/fc2); q is scaled by 1/sqrt(E) right after
  its projection and the scores are not scaled again (transformers' order of rounding).
- ``layer_norm_elementwise_affine`` False: LayerNorms without weight or bias. Every LayerNorm has eps 1e-5.
- The head ``lm_head`` (no bias) is tied to ``embed_tokens`` by default.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn

from .common import (ConfigError, DecoderLayer, DecoderLM, KVCache, LayerNorm, ParamMapping, activation, attend,
                     decoder_maps, linear_maps, norm_maps)
from .family import TransformerConfig, hf_field, register_family

LN_EPS = 1e-5  # torch.nn.LayerNorm's default: transformers' OPT never sets another
POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding.offset


@dataclasses.dataclass(frozen=True)
class OPTConfig(TransformerConfig):
    """OPT's fields; the MLP width is config.json's ``ffn_dim`` (read into ``intermediate_size``), and
    ``word_embed_proj_dim`` absent or null means ``hidden_size`` (as transformers' ``OPTConfig``)."""

    MODEL_TYPE, ARCHITECTURE = "opt", "OPTForCausalLM"

    intermediate_size: int = hf_field(key="ffn_dim")
    word_embed_proj_dim: Optional[int] = hf_field(None)
    max_position_embeddings: int = hf_field(2048)
    do_layer_norm_before: bool = hf_field(True)
    remove_final_layer_norm: bool = hf_field(False, key="_remove_final_layer_norm")
    activation_function: str = hf_field("relu")
    enable_bias: bool = hf_field(True)
    layer_norm_elementwise_affine: bool = hf_field(True)
    tie_word_embeddings: bool = hf_field(True)
    bos_token_id: Optional[int] = hf_field(2)
    eos_token_id: Any = hf_field(2)
    pad_token_id: Optional[int] = hf_field(1)

    @property
    def projects(self) -> bool:
        """The embedding width differs from the layers' (``project_in`` / ``project_out`` exist)."""
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def final_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ConfigError(f"opt: hidden_size={values['hidden_size']} must be divisible by "
                              f"num_attention_heads={values['num_attention_heads']}")
        try:
            activation(values["activation_function"])
        except ConfigError as e:
            raise ConfigError(f"opt: config field activation_function: {e}") from None
        width = values["word_embed_proj_dim"]
        return {**values, "word_embed_proj_dim": values["hidden_size"] if width is None else width}


class OPTDecoderLayer(DecoderLayer):
    @nn.compact
    def __call__(self, x_btd, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg = self.config
        dense = lambda n, name: self.dense(n, name, cfg.enable_bias)
        affine = cfg.layer_norm_elementwise_affine
        norm = lambda name: LayerNorm(LN_EPS, affine, affine, self.dtype, self.param_dtype, name=name)
        pre = (lambda name, y: norm(name)(y)) if cfg.do_layer_norm_before else (lambda name, y: y)
        post = (lambda name, y: y) if cfg.do_layer_norm_before else (lambda name, y: norm(name)(y))
        b, t, d = x_btd.shape
        h, e = cfg.num_attention_heads, cfg.head_dim

        y = pre("self_attn_layer_norm", x_btd)
        q = (dense(d, "self_attn_q_proj")(y) * e ** -0.5).reshape(b, t, h, e)
        k, v = (dense(d, f"self_attn_{n}_proj")(y).reshape(b, t, h, e) for n in "kv")
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=1.0)
        x_btd = post("self_attn_layer_norm", x_btd + dense(d, "self_attn_out_proj")(attn.reshape(b, t, d)))

        y = activation(cfg.activation_function)(dense(cfg.intermediate_size, "fc1")(pre("final_layer_norm", x_btd)))
        return post("final_layer_norm", x_btd + dense(d, "fc2")(y)), (k, v)


class OPTForCausalLM(DecoderLM):
    """OPT causal LM; the layer scan, head and prefix cache come from ``common.DecoderLM``, with OPT's embedding
    (``project_in``, positions offset by 2) and head input (optional final norm, ``project_out``)."""

    NORM, POSITION_EMBED, ROTARY_DIM, POSITION_OFFSET = "final_layer_norm", "embed_positions", None, POSITION_OFFSET
    LAYER, EMBED_WIDTH, HF_PREFIX = OPTDecoderLayer, "word_embed_proj_dim", "model.decoder"

    def setup(self):
        super().setup()
        cfg = self.config
        if cfg.projects:
            proj = lambda n: nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
            self.project_in, self.project_out = proj(cfg.hidden_size), proj(cfg.word_embed_proj_dim)

    def final_norm(self):
        affine = self.config.layer_norm_elementwise_affine
        return LayerNorm(LN_EPS, affine, affine, self.dtype, self.param_dtype) if self.config.final_norm else None

    def embed(self, tokens_bt, positions_bt):
        x = self.embed_tokens(tokens_bt)
        if self.config.projects:
            x = self.project_in(x)
        return x + self.embed_positions(positions_bt + POSITION_OFFSET)

    def to_head(self, x_btd):
        x_btd = super().to_head(x_btd)
        return self.project_out(x_btd) if self.config.projects else x_btd


def param_mappings(cfg: OPTConfig) -> list[ParamMapping]:
    affine = cfg.layer_norm_elementwise_affine
    norms = lambda hf, p: norm_maps(hf, p, scale=affine, bias=affine)

    def layer(hf: str, p: tuple):
        m = norms(f"{hf}.self_attn_layer_norm", p + ("self_attn_layer_norm",))
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            m += linear_maps(f"{hf}.self_attn.{proj}", p + (f"self_attn_{proj}",), cfg.enable_bias)
        m += norms(f"{hf}.final_layer_norm", p + ("final_layer_norm",))
        return m + linear_maps(f"{hf}.fc1", p + ("fc1",), cfg.enable_bias) + linear_maps(f"{hf}.fc2", p + ("fc2",),
                                                                                         cfg.enable_bias)
    final = ("weight", "bias") if cfg.final_norm and affine else ()
    m = decoder_maps(OPTForCausalLM, cfg, layer, norm=final)
    if cfg.projects:
        pre = OPTForCausalLM.HF_PREFIX
        m += linear_maps(f"{pre}.project_in", ("project_in",), False) + linear_maps(f"{pre}.project_out",
                                                                                     ("project_out",), False)
    return m


# dropout, activation_dropout, layerdrop: training only; init_std: initialisation
HARMLESS_HF_FIELDS = ("dropout", "activation_dropout", "layerdrop", "init_std")

# the doctor's tiny model (``family.tiny_config``): post-norm blocks with project_in/out (OPT-350m's options)
TINY = dict(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, do_layer_norm_before=False, max_position_embeddings=512)

register_family(OPTConfig.MODEL_TYPE, OPTConfig, OPTForCausalLM, param_mappings, harmless=HARMLESS_HF_FIELDS,
                tiny=TINY)
