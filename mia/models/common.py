"""Building blocks shared by the decoder families: rotary embedding, norms, attention with a prefix cache.

Dimension legend (used in einsum strings and variable suffixes across ``mia.models``):
  B batch, T query length, S key length (cache + current), D model width, H query heads,
  K key/value heads (GQA: H = K * G), G query heads per kv head, E head dim, F MLP width, V vocabulary.

Masking is by *position ids*, not array index: a key may be attended to when it is valid and its
position is <= the query's position (and, for a local window, > q_pos - window). This makes right
padding, left-padded prefixes and a cached prefix all the same case.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .attention import MASK_VALUE, dot_product_attention, unrecorded  # noqa: F401  (re-exported: the families import them here)
from .errors import ConfigError  # noqa: F401  (re-exported)
from .rope import UNSCALED, RopeScaling, inv_freq, read_rope

Array = jax.Array


@struct.dataclass
class KVCache:
    """Keys/values of an already-processed prefix, stacked over the layers.

    keys, values: [L, B, S, K, E] (keys after rotary); positions: [B, S] int32; valid: [B, S] bool.
    Inside the layer scan each layer sees a *layer view*: the same class with keys/values [B, S, K, E] (that
    layer's slice), which is what ``join_cache`` takes.
    """

    keys: Array
    values: Array
    positions: Array
    valid: Array

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def next_positions(self) -> Array:
        """[B] position id that the first token after this prefix takes."""
        return jnp.max(jnp.where(self.valid, self.positions, -1), axis=1) + 1

    def broadcast_to(self, batch: int) -> "KVCache":
        """Repeat a batch-1 cache for ``batch`` targets."""
        per_layer = lambda a: jnp.broadcast_to(a, a.shape[:1] + (batch,) + a.shape[2:])
        per_row = lambda a: jnp.broadcast_to(a, (batch,) + a.shape[1:])
        return KVCache(per_layer(self.keys), per_layer(self.values), per_row(self.positions), per_row(self.valid))

    def take_rows(self, idx) -> "KVCache":
        """Rows ``idx`` ([B'] int) of the batch (axis 1 of keys/values, axis 0 of positions/valid)."""
        return KVCache(jnp.take(self.keys, idx, axis=1), jnp.take(self.values, idx, axis=1),
                       jnp.take(self.positions, idx, axis=0), jnp.take(self.valid, idx, axis=0))

    def slice_rows(self, start, size: int) -> "KVCache":
        """Rows [start, start + size) of the batch; ``start`` may be traced."""
        sl = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis)
        return KVCache(sl(self.keys, 1), sl(self.values, 1), sl(self.positions, 0), sl(self.valid, 0))


def activation(name: str) -> Callable[[Array], Array]:
    """HF ``hidden_act`` / ``activation_function`` name -> function."""
    table = {
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
    }
    if name not in table:
        raise ConfigError(f"unsupported activation {name!r}; supported: {sorted(table)}")
    return table[name]


def rope_theta_from(hf: dict, default: float = 10000.0, legacy_key: str = "rope_theta") -> float:
    """Rotary base of a family without RoPE scaling (``rope.read_rope`` with only the default rope_type; a
    ``rope_parameters.partial_rotary_factor`` is left to the family): any scaling is refused naming the field."""
    return read_rope(hf, legacy_key=legacy_key, default_theta=default, types=("default",), partial=True)[0]


def rotary_tables(positions_bt: Array, rot_dim: int, theta: float,
                  scaling: RopeScaling = UNSCALED) -> tuple[Array, Array]:
    """cos, sin of shape [B, T, rot_dim] in float32 (HF 'rotate_half' layout: frequencies repeated twice), from
    ``rope.inv_freq(rot_dim, theta, scaling)``."""
    angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rot_dim, theta, scaling))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x_bthe: Array, cos_bte: Array, sin_bte: Array) -> Array:
    """Rotate the first ``rot_dim`` channels of each head (partial rotary when rot_dim < E), rotate_half layout."""
    rot_dim = cos_bte.shape[-1]
    x_rot, x_pass = x_bthe[..., :rot_dim], x_bthe[..., rot_dim:]
    half = rot_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos_bte[:, :, None, :].astype(x_bthe.dtype), sin_bte[:, :, None, :].astype(x_bthe.dtype)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm: statistics in float32; ``use_scale``/``use_bias`` False gives OLMo's non-parametric LN."""

    eps: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        if self.use_scale:
            y = y * self.param("weight", nn.initializers.ones, (d,), self.param_dtype).astype(jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (d,), self.param_dtype).astype(jnp.float32)
        return y.astype(self.dtype)


class RMSNorm(nn.Module):
    """Llama/OLMo-2 RMSNorm: normalise in float32, cast back, then scale by ``weight``."""

    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + self.eps)
        return (w.astype(jnp.float32) * y).astype(self.dtype)


def join_cache(
    cache: Optional[KVCache], k_btke: Array, v_btke: Array, pos_bt: Array, valid_bt: Array
) -> tuple[Array, Array, Array, Array]:
    """Keys/values/positions/validity over [cached prefix ; current tokens].

    ``cache`` is one layer's view (keys/values [B, S, K, E], see ``KVCache``) or None.
    """
    if cache is None:
        return k_btke, v_btke, pos_bt, valid_bt
    return (
        jnp.concatenate([cache.keys.astype(k_btke.dtype), k_btke], axis=1),
        jnp.concatenate([cache.values.astype(v_btke.dtype), v_btke], axis=1),
        jnp.concatenate([cache.positions, pos_bt], axis=1),
        jnp.concatenate([cache.valid, valid_bt], axis=1),
    )


def attend(q_bthe: Array, k_btke: Array, v_btke: Array, pos_bt: Array, valid_bt: Array, cache: Optional[KVCache], *,
           scale, window=None, softcap: Optional[float] = None) -> Array:
    """One layer's attention over [cached prefix ; current tokens] (``join_cache`` then ``dot_product_attention``):
    q [B, T, H, E], this call's keys/values [B, T, K, E] (keys after rotary) -> [B, T, H, E]. ``window``: see
    ``layer_window``; ``softcap``: scores soft-capped before masking (Gemma-2)."""
    k_all, v_all, k_pos, k_valid = join_cache(cache, k_btke, v_btke, pos_bt, valid_bt)
    return dot_product_attention(q_bthe, k_all, v_all, pos_bt, k_pos, k_valid, scale=scale, window=window,
                                 softcap=softcap)


GLOBAL_WINDOW = np.iinfo(np.int32).max  # q_pos - k_pos < this always holds: a global layer in a window table


def checked_window(model_type: str, value, field: str = "sliding_window") -> Optional[int]:
    """A config's local-attention window: a positive int, or None (no window); ``ConfigError`` naming ``field``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{model_type}: config field {field}={value!r} must be a positive integer or null")
    return value


def layer_window(windows: Sequence[Optional[int]], layer):
    """The local-attention window of layer ``layer`` (a traced int32 index) from the per-layer ``windows`` (an int:
    a key is seen when q_pos - k_pos < it; None: a global layer): None when every layer is global, the static int
    when every layer has the same one, else a lookup in a constant int32 table (global layers get
    ``GLOBAL_WINDOW``), so mixed stacks (GPT-Neo, Gemma-2/3) need no Python branch on the layer."""
    kinds = set(windows)
    if kinds == {None}:
        return None
    if len(kinds) == 1:
        return int(next(iter(kinds)))
    table = np.array([GLOBAL_WINDOW if w is None else w for w in windows], np.int32)
    return jnp.asarray(table)[layer]


class DecoderLayer(nn.Module):
    """Base of a family's decoder layer (its ``__call__`` is the family's own, written against its HF file): the
    config, the dtypes, and makers of its submodules in those dtypes (call them inside the compact ``__call__``)."""

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def dense(self, features: int, name: str, bias: bool = True) -> nn.Dense:
        return nn.Dense(features, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    def rms_norm(self, eps: float, name: str) -> RMSNorm:
        return RMSNorm(eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    def layer_norm(self, eps: float, name: str) -> LayerNorm:
        return LayerNorm(eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)


def is_packed(valid_bt: Array) -> bool:
    """Integer ``valid`` arrays are segment ids of packed rows (0 = padding, 1, 2, ... = the texts of a row in
    order); boolean ones are plain validity. Decided when traced, from the dtype."""
    return jnp.issubdtype(valid_bt.dtype, jnp.integer)


def segment_positions(segments_bt: Array) -> Array:
    """[B, T] int32 positions that restart at 0 where the segment id changes (each packed text starts at 0);
    padding (segment 0) takes position 0, so a row's padded tail never indexes past a learned position table
    (GPT-2, GPT-Neo: an out-of-range embedding lookup is NaN, and NaN keys poison even masked attention)."""
    t = segments_bt.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segments_bt.shape)
    starts = jnp.concatenate([jnp.ones_like(segments_bt[:, :1], bool), segments_bt[:, 1:] != segments_bt[:, :-1]], 1)
    return jnp.where(segments_bt > 0, idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1), 0)


def default_positions(tokens_bt: Array, valid_bt: Array, cache: Optional[KVCache]) -> Array:
    """Position ids: count of valid tokens before each one (so left pads do not shift positions), offset by the
    cache; for packed rows (integer segment ids, no cache) the index within each text."""
    if is_packed(valid_bt):
        if cache is not None:
            raise ValueError("packed rows (integer segment ids) cannot follow a cached prefix")
        return segment_positions(valid_bt)
    pos = jnp.cumsum(valid_bt.astype(jnp.int32), axis=1) - 1
    pos = jnp.maximum(pos, 0)
    if cache is not None:
        pos = pos + cache.next_positions()[:, None]
    return pos


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """One HF tensor <-> one leaf of our params pytree, or one slice of a stacked leaf.

    ``transpose``: HF torch Linear stores [out, in]; flax Dense kernels are [in, out].
    ``layer``: for the decoder layers, whose leaves are stacked [L, ...]: the HF tensor is slice ``layer`` of the
    leaf at ``path`` (shapes compare without the leading L axis). None for unstacked leaves.
    """

    hf_name: str
    path: tuple[str, ...]
    transpose: bool = False
    layer: Optional[int] = None


def at_layer(layer: int, mappings: Sequence[ParamMapping]) -> list[ParamMapping]:
    """The same mappings, each onto slice ``layer`` of its stacked leaf."""
    return [dataclasses.replace(m, layer=layer) for m in mappings]


def linear_maps(hf_prefix: str, path: tuple[str, ...], bias: bool) -> list[ParamMapping]:
    """Mappings for a torch ``nn.Linear`` stored at ``hf_prefix`` and a flax ``Dense`` at ``path``."""
    out = [ParamMapping(f"{hf_prefix}.weight", path + ("kernel",), transpose=True)]
    if bias:
        out.append(ParamMapping(f"{hf_prefix}.bias", path + ("bias",)))
    return out


def norm_maps(hf_prefix: str, path: tuple[str, ...], scale: bool = True, bias: bool = True) -> list[ParamMapping]:
    out = []
    if scale:
        out.append(ParamMapping(f"{hf_prefix}.weight", path + ("weight",)))
    if bias:
        out.append(ParamMapping(f"{hf_prefix}.bias", path + ("bias",)))
    return out


def decoder_maps(lm, cfg, layer_maps: Callable[[str, tuple], list], norm: Sequence[str] = ("weight",)
                 ) -> list[ParamMapping]:
    """The mapping of a whole decoder checkpoint, from the names that ``lm`` (a ``DecoderLM`` class) declares:
    ``{HF_PREFIX}.{EMBED}`` (and ``.{POSITION_EMBED}``), ``layer_maps(f"{HF_PREFIX}.{LAYERS}.{i}", (LAYERS,))``
    for each layer i (stacked: slice i), the final norm's tensors ``norm`` (() when it has none) and an untied
    ``{HEAD}``."""
    pre = lm.HF_PREFIX
    embeds = [lm.EMBED] + ([lm.POSITION_EMBED] if lm.POSITION_EMBED else [])
    m = [ParamMapping(f"{pre}.{name}.weight", (name, "embedding")) for name in embeds]
    for i in range(cfg.num_hidden_layers):
        m += at_layer(i, layer_maps(f"{pre}.{lm.LAYERS}.{i}", (lm.LAYERS,)))
    m += [ParamMapping(f"{pre}.{lm.NORM}.{tensor}", (lm.NORM, tensor)) for tensor in norm]
    if not cfg.tie_word_embeddings:
        m.append(ParamMapping(f"{lm.HEAD}.weight", (lm.HEAD, "kernel"), transpose=True))
    return m


def refuse_values(model_type: str, hf: dict, refuse: dict[str, Callable[[Any], bool]]) -> None:
    """Raise ConfigError on any field in ``refuse`` whose value changes the math in a way we do not implement."""
    for field, is_bad in refuse.items():
        if field in hf and is_bad(hf[field]):
            raise ConfigError(f"{model_type}: config field {field}={hf[field]!r} is not supported")


_LAYER_SHAPES: dict = {}  # (decoder class, config, dtype, param_dtype) -> abstract stacked layer params


def stacked_layer_shapes(decoder, init: Callable):
    """The abstract (shape, dtype) tree of ``decoder``'s stacked layer params, from ``jax.eval_shape(init)``,
    traced once per (decoder class, config, dtypes) in a process; an unhashable config is traced every time."""
    key = (type(decoder), decoder.config, decoder.dtype, decoder.param_dtype)
    try:
        hash(key)
    except TypeError:
        return jax.eval_shape(init, jax.random.key(0))
    if key not in _LAYER_SHAPES:
        _LAYER_SHAPES[key] = jax.eval_shape(init, jax.random.key(0))
    return _LAYER_SHAPES[key]


class DecoderLM(nn.Module):
    """The top of every decoder family: embed -> layer scan (collecting this call's keys/values) -> final norm -> head.

    A family subclasses it, names its submodules with class attributes (HF-style names, so parameter paths mirror
    the checkpoint) and returns its final norm from ``final_norm()``; ``setup`` builds them all:
      EMBED           token ``nn.Embed`` [V, D]                LAYERS  name of the stacked layer params
      LAYER           the decoder-layer module class           NORM    final norm (``final_norm()``)
      HEAD            untied output ``nn.Dense`` without bias (tied: EMBED.attend; none built when
                      ``config.tie_word_embeddings``)
      POSITION_EMBED  learned position ``nn.Embed`` [max_position_embeddings + POSITION_OFFSET, D], or None;
                      position p reads row p + POSITION_OFFSET (OPT: 2)
      EMBED_WIDTH     config attribute with the token embedding's width (``hidden_size``; OPT projects it in/out)
      ROTARY_DIM      config attribute with the rotary width, or None (base ``config.rope_theta``, scaling
                      ``config.rope_scaling`` where the config has one: ``rope.inv_freq``)
      FINAL_NORM      the final norm's class (``RMSNorm``, ``LayerNorm``), its epsilon the config attribute NORM_EPS
                      (or override ``final_norm()``)
      HF_PREFIX       the checkpoint's prefix of every tensor but the head's (``decoder_maps``)

    The layers are ONE module applied in ``jax.lax.scan`` over stacked params: every leaf under ``params[LAYERS]``
    has a leading [L] axis (layer i is slice i), so the compiled program does not grow with depth. Each layer is
    called as ``layer(x, *(cos, sin if rotary), positions, valid, layer_index, cache_view) -> (x, (k, v))`` where
    ``layer_index`` is a traced int32 scalar (per-layer variation is a lookup in a constant [L] table, never a
    Python branch) and ``cache_view`` is that layer's slice of the prefix KVCache (or None).
    """

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    EMBED = "embed_tokens"
    LAYERS = "layers"
    LAYER = None
    NORM = "norm"
    HEAD = "lm_head"
    POSITION_EMBED = None
    POSITION_OFFSET = 0
    EMBED_WIDTH = "hidden_size"
    ROTARY_DIM = "head_dim"
    FINAL_NORM = None
    NORM_EPS = ""
    HF_PREFIX = "model"

    def setup(self):
        cfg = self.config
        embed = lambda rows, width: nn.Embed(rows, width, dtype=self.dtype, param_dtype=self.param_dtype)
        setattr(self, self.EMBED, embed(cfg.vocab_size, getattr(cfg, self.EMBED_WIDTH)))
        if self.POSITION_EMBED is not None:
            setattr(self, self.POSITION_EMBED,
                    embed(cfg.max_position_embeddings + self.POSITION_OFFSET, cfg.hidden_size))
        setattr(self, self.LAYERS, self.layer_stack())
        setattr(self, self.NORM, self.final_norm())
        if not cfg.tie_word_embeddings:
            setattr(self, self.HEAD, nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype,
                                              param_dtype=self.param_dtype))

    def final_norm(self) -> Optional[nn.Module]:
        """The norm after the last layer (built in ``setup``, named NORM): FINAL_NORM with epsilon NORM_EPS; None
        when the family has none (OPT's post-norm stacks)."""
        return self.FINAL_NORM(getattr(self.config, self.NORM_EPS), dtype=self.dtype, param_dtype=self.param_dtype)

    def embed(self, tokens_bt, positions_bt):
        """tokens [B, T] int, positions [B, T] int -> the first layer's input [B, T, D]: the token embedding plus,
        with learned positions, row ``position + POSITION_OFFSET`` of the position table (which must exist)."""
        x = getattr(self, self.EMBED)(tokens_bt)
        if self.POSITION_EMBED is not None:
            x = x + getattr(self, self.POSITION_EMBED)(positions_bt + self.POSITION_OFFSET)
        return x

    def to_head(self, x_btd):
        """The last layer's output [B, T, D] -> the head's input: the final norm (none: unchanged)."""
        norm = getattr(self, self.NORM)
        return x_btd if norm is None else norm(x_btd)

    def layer_template(self) -> nn.Module:
        """An unbound instance of the family's layer, applied functionally to one layer's params."""
        return self.LAYER(self.config, self.dtype, self.param_dtype, parent=None)

    def _rotary(self, positions_bt) -> tuple:
        if self.ROTARY_DIM is None:
            return ()
        cfg = self.config  # a config without ``rope_scaling`` (GPT-NeoX) is unscaled
        return rotary_tables(positions_bt, getattr(cfg, self.ROTARY_DIM), cfg.rope_theta,
                             getattr(cfg, "rope_scaling", UNSCALED))

    def layer_stack(self):
        """Declare the stacked layer params (call in ``setup``): each layer initialised with its own key."""
        n = self.config.num_hidden_layers

        def init(rng):
            pos, valid = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
            x = jnp.zeros((1, 1, self.config.hidden_size), self.dtype)
            rotary = self._rotary(pos)
            one = lambda key, i: self.layer_template().init(key, x, *rotary, pos, valid, i, None)["params"]
            with unrecorded():  # traced by flax's shape check, or here once per config: not an attention call
                return jax.vmap(one)(jax.random.split(rng, n), jnp.arange(n, dtype=jnp.int32))

        if self.is_initializing():
            return self.param(self.LAYERS, init)
        # In apply, flax checks the given params' shapes against jax.eval_shape(init) at every trace: that traces
        # a whole layer init. Checked against the shapes of one such trace per config instead (same check).
        shapes = stacked_layer_shapes(self, init)
        return self.param(self.LAYERS, lambda rng: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                                          shapes))

    def declare(self, tokens_bt):
        """Init only, ``module.init(key, tokens, method="declare")``: creates every param (same values as an init
        through ``__call__``) without running the layer scan, which eagerly would compile the scan just to init."""
        x = self.embed(tokens_bt, jnp.zeros(tokens_bt.shape, jnp.int32))
        getattr(self, self.LAYERS)
        return self.unembed(self.to_head(x))

    def hidden(self, tokens_bt, valid_bt=None, positions_bt=None, cache: Optional[KVCache] = None,
               layer_transform: Optional[Callable] = None):
        """tokens [B, T] int -> (the head's input [B, T, D] (``to_head``: the final norm; OPT: projected out to its
        embedding width), KVCache of this call's tokens only).

        ``valid_bt``: [B, T] bool (padding False), or int32 segment ids of packed rows (0 padding; a token attends
        only to earlier tokens of its own segment, and positions restart per segment; see ``is_packed``).

        ``layer_transform(layer_index, layer_params) -> layer_params``: optional pure function applied inside the
        scan body to each layer's params (one layer's subtree, no [L] axis; ``layer_index`` a traced int32 scalar)
        before that layer runs; it must return a subtree of the same structure and shapes. Only one layer's
        transformed copy exists at a time (e.g. MoPe noise drawn per layer).
        """
        if valid_bt is None:
            valid_bt = jnp.ones(tokens_bt.shape, bool)
        elif not is_packed(valid_bt):
            valid_bt = valid_bt.astype(bool)
        if positions_bt is None:
            positions_bt = default_positions(tokens_bt, valid_bt, cache)
        x = self.embed(tokens_bt, positions_bt)  # learned positions: must stay < max_position_embeddings
        rotary = self._rotary(positions_bt)
        layer = self.layer_template()

        def step(x_btd, per_layer):
            index, params, cached_keys, cached_values = per_layer
            if layer_transform is not None:
                params = layer_transform(index, params)
            view = None if cache is None else KVCache(cached_keys, cached_values, cache.positions, cache.valid)
            return layer.apply({"params": params}, x_btd, *rotary, positions_bt, valid_bt, index, view)

        n = self.config.num_hidden_layers
        per_layer = (jnp.arange(n, dtype=jnp.int32), getattr(self, self.LAYERS),
                     None if cache is None else cache.keys, None if cache is None else cache.values)
        x, (ks, vs) = jax.lax.scan(step, x, per_layer)
        return self.to_head(x), KVCache(ks, vs, positions_bt, valid_bt)

    def unembed(self, h_btd):
        """Hidden states [..., D] -> float32 logits [..., V].

        The head's operands stay in the activation dtype; the products are summed and returned in float32, so
        bf16 mode does not round logits to bf16 (at a logit of 20, a bf16 step is 0.125 nats of log-prob).
        """
        if self.config.tie_word_embeddings:
            w_dv = getattr(self, self.EMBED).embedding.T
            bias_v = None
        else:
            head = getattr(self, self.HEAD)
            if self.is_initializing():  # nn.Dense creates its kernel on its first call
                return head(h_btd).astype(jnp.float32)
            p = head.variables["params"]
            w_dv, bias_v = p["kernel"], p.get("bias")
        logits = jnp.einsum("...d,dv->...v", h_btd.astype(self.dtype), w_dv.astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return logits if bias_v is None else logits + bias_v.astype(jnp.float32)

    def __call__(self, tokens_bt, valid_bt=None, positions_bt=None, cache: Optional[KVCache] = None,
                 layer_transform: Optional[Callable] = None):
        h, _ = self.hidden(tokens_bt, valid_bt, positions_bt, cache, layer_transform)
        return self.unembed(h)
