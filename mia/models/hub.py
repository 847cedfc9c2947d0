"""Load and save Hugging Face-layout checkpoints from LOCAL directories. Never touches the network.

``load(path)`` reads ``config.json``, ``model.safetensors`` (or a sharded ``model.safetensors.index.json``; without
safetensors, ``pytorch_model.bin`` or its ``.index.json`` through ``torch_bin``, which runs nothing) and the
tokenizer, and returns a :class:`Model`. ``path`` may also be ``ORG/NAME[@REVISION]``, a snapshot of the Hugging
Face cache (``hf_cache``), and config.json may be a native layout read by a mapping (``layouts``: OLMo's
``hf_olmo``). Loading is strict: every parameter of our module must be filled with a
tensor of the right shape, and every tensor in the checkpoint must be used (a few known buffers excepted).
``save(model, path)`` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import mmap
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..files.atomic import atomic_write, write_text
from ..sharding import make_mesh, param_shardings, put_params, replicated
from ..files import hashing as file_hash  # called through the module so that tests can stand in for the hash
from ..validate import check_config, check_hf_config, safetensors_header
from . import hf_cache
from .common import ConfigError, ParamMapping
from .family import Family, family, family_of_config, read_config
from .attention import ENV_VAR as ATTENTION_ENV_VAR
from .adapter import adapter_digest, adapter_weight_file, merge_lora, read_adapter_config
from .layouts import native_layout
from .torch_bin import read_torch_bin

from ..offline import force_offline

force_offline()

class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or inconsistent with its config."""


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A Flax module, its params pytree, its tokenizer and config. ``params`` is passed explicitly everywhere.

    ``mesh``/``fsdp``: the layout the params were placed with (``mia.sharding``); None: the scoring engine's
    default (every device on ``data``, params replicated).
    """

    module: Any
    params: Any
    tokenizer: Any
    config: Any
    model_type: str
    path: Optional[str] = None
    content_address: Any = ""  # the fingerprint, or a zero-argument function computing it on first use
    mesh: Any = None
    fsdp: bool = False
    adapter: Optional[str] = None  # the PEFT LoRA adapter directory merged into the weights at load (``path``: base)

    @property
    def fingerprint(self) -> str:
        """The model's content address (``fingerprint`` of its directory, ``params_fingerprint`` in memory), computed
        on first use only: a run without the on-disk cache never hashes the weight files."""
        return resolve_lazy(self, "content_address")

    @property
    def compute_dtype(self) -> str:
        """The activations' dtype name ("float32", "bfloat16"); float16 mode computes in float32."""
        return jnp.dtype(self.module.dtype).name

    def hidden(self, params, tokens, valid=None, positions=None, cache=None, layer_transform=None):
        """Pure: (params, tokens [B,T], valid [B,T]) -> (final hidden [B,T,D], KVCache of these tokens).

        ``layer_transform(layer_index, layer_params) -> layer_params`` (optional, pure): applied inside the layer
        scan to each layer's params subtree (no [L] axis; ``layer_index`` a traced int32 scalar) just before that
        layer runs; same structure and shapes out (see ``common.DecoderLM.hidden``).
        """
        with self._precision():
            return self.module.apply({"params": params}, tokens, valid, positions, cache, layer_transform,
                                     method="hidden")

    def unembed(self, params, h):
        """Pure: hidden [..., D] -> logits [..., V], float32 whatever the activation dtype."""
        with self._precision():
            return self.module.apply({"params": params}, h, method="unembed")

    def logits(self, params, tokens, valid=None, positions=None, cache=None, layer_transform=None):
        """Pure: float32 logits [B, T, V]; ``layer_transform`` as in ``hidden``."""
        with self._precision():
            return self.module.apply({"params": params}, tokens, valid, positions, cache, layer_transform)

    @property
    def matmul_precision(self) -> Optional[str]:
        """"highest" when activations are float32 (the float32 and float16 modes), else None (backend default).

        Without it, "float32" matmuls run as TF32 on A100/H100 and as one bf16 pass on TPU, and parity with
        transformers (1e-4) would hold on CPU only. hidden, unembed and logits trace the module under it, so every
        matmul of the model (attention and LM head included) carries it into any jitted caller.
        """
        return "highest" if jnp.dtype(self.module.dtype) == jnp.float32 else None

    def _precision(self):
        p = self.matmul_precision
        return jax.default_matmul_precision(p) if p else contextlib.nullcontext()

    @property
    def max_length(self) -> int:
        """C: the context the model was trained at (positions 0 .. C-1)."""
        return int(getattr(self.config, "max_position_embeddings", 2048) or 2048)

    @property
    def max_tokens(self) -> int:
        """C + 1: the most tokens a scored text may hold. The model reads all but the last, which is only predicted
        (``mia.engine.stats.next_token_inputs``): Pythia's 2049-token rows make 2048 predictions in a 2048 context."""
        return self.max_length + 1

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


# ------------------------------------------------------------------------------------------ one program per shape
PROGRAM_MODELS_KEPT = 32  # stand-ins kept per process (``program_model``), least recently used dropped first
_PROGRAM_MODELS: "collections.OrderedDict[tuple, Model]" = collections.OrderedDict()


def program_signature(model: Model) -> Optional[tuple]:
    """What a program traced for ``model`` depends on besides the values of its params: the module (its class, and
    as fields its config, dtypes and kernel choices), the model type and config, the layout the params are placed
    with (mesh, FSDP), the params' tree with each leaf's shape and dtype, and the attention kernel asked for in
    ``MIA_ATTENTION`` (read when a step is traced). None when a part is not hashable."""
    leaves, treedef = jax.tree_util.tree_flatten(model.params)
    signature = (type(model.module), model.module, model.model_type, model.config, model.mesh, bool(model.fsdp),
                 treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves),
                 os.environ.get(ATTENTION_ENV_VAR, ""))
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


def program_model(model: Model) -> Model:
    """The stand-in the engine builds ``model``'s jitted programs for: a copy with abstract params
    (``jax.ShapeDtypeStruct``) and no tokenizer, path or fingerprint, shared by every Model of the same
    ``program_signature``. The programs take params as an argument, so one built for the stand-in runs any of those
    models: the checkpoints of one run (a checkpoint sweep, a suite's sizes' steps, a model loaded twice) trace,
    lower and compile each step once per process instead of once per load, and no cached program keeps a
    checkpoint's weights alive. A model whose signature is not hashable (or any other object) is its own
    stand-in."""
    signature = program_signature(model) if isinstance(model, Model) else None
    if signature is None:
        return model
    stand_in = _PROGRAM_MODELS.get(signature)
    if stand_in is None:
        params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), model.params)
        stand_in = dataclasses.replace(model, params=params, tokenizer=None, path=None, content_address="",
                                       adapter=None)
        _PROGRAM_MODELS[signature] = stand_in
        while len(_PROGRAM_MODELS) > PROGRAM_MODELS_KEPT:
            _PROGRAM_MODELS.popitem(last=False)
    _PROGRAM_MODELS.move_to_end(signature)
    return stand_in


def cached_per_architecture(maxsize: int = 32):
    """Decorator of a function ``build(model, *args)`` that builds a jitted program: its results are memoized per
    (``program_model(model)``, args), so every Model of one architecture, dtypes and layout shares one program
    (``wrapper.cache_clear()`` empties the memo)."""
    def decorate(build):
        cached = functools.lru_cache(maxsize=maxsize)(build)

        @functools.wraps(build)
        def wrapper(model, *args, **kwargs):
            return cached(program_model(model), *args, **kwargs)

        wrapper.cache_clear = cached.cache_clear
        return wrapper

    return decorate


# ----------------------------------------------------------------------------------------------- safetensors I/O
SAFETENSORS_DTYPES = {  # safetensors dtype name -> numpy dtype
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
SAFETENSORS_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-mapped numpy views of every tensor in a .safetensors file (bfloat16 via ml_dtypes). The header is
    checked whole first (``mia.validate.safetensors_header``): a corrupt file is one ``CheckpointError``."""
    header, data_start = safetensors_header(path, error=CheckpointError)
    if not header:
        return {}
    empty = Path(path).stat().st_size == data_start  # only zero-size tensors: nothing to map
    data = np.zeros(0, np.uint8) if empty else np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    return {name: data[lo:hi].view(SAFETENSORS_DTYPES[dtype]).reshape(shape)
            for name, (dtype, shape, (lo, hi)) in header.items()}


def mapped_pages_release(arrays) -> Optional[Callable[[], None]]:
    """A function that drops every page of the memory maps behind ``arrays`` from this process's resident set
    (``madvise(MADV_DONTNEED)`` on each distinct map: the file stays in the page cache, and a later read maps it
    again), or None when none of them is a memory map or the platform has no ``madvise``. The loader calls it after
    each block it reads, so peak host memory is the placed parameters plus about one block, not plus the whole
    checkpoint file as well."""
    maps = {}
    for a in arrays:
        for layer in getattr(a, "layers", None) or [a]:
            m = getattr(layer, "_mmap", None)  # np.memmap and its views keep the mmap.mmap they read from
            if m is not None and hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                maps[id(m)] = m
    if not maps:
        return None

    def release() -> None:
        for m in maps.values():
            with contextlib.suppress(ValueError, OSError):  # a map closed meanwhile: nothing left to drop
                m.madvise(mmap.MADV_DONTNEED)
    return release


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """Memory-mapped tensors of one weight file: safetensors, or a ``torch.save`` zip (``.bin``) read without
    running its pickle (``torch_bin``)."""
    if Path(path).suffix == ".bin":
        return read_torch_bin(path, error=CheckpointError)
    return read_safetensors(path)


def write_safetensors(tensors: dict[str, np.ndarray], path: Path, metadata: Optional[dict] = None) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name]).reshape(np.shape(tensors[name]))  # keeps a 0-d tensor 0-d
        blob = arr.tobytes()
        header[name] = {
            "dtype": SAFETENSORS_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_write(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def weight_files(root: Path) -> list[Path]:
    """The weight files of a checkpoint: safetensors when there are any, else PyTorch ``.bin`` (single or sharded)."""
    for single, index in ((root / "model.safetensors", root / "model.safetensors.index.json"),
                          (root / "pytorch_model.bin", root / "pytorch_model.bin.index.json")):
        if single.exists():
            return [single]
        if index.exists():
            return _indexed_files(root, index)
    if any(root.glob("*.bin")) or any(root.glob("*.pt")) or any(root.glob("*.ckpt")):
        raise CheckpointError(f"{root}: no model.safetensors, pytorch_model.bin or their .index.json; other pickled "
                              "files (.bin/.pt/.ckpt) are never loaded")
    raise CheckpointError(f"{root}: no model.safetensors, pytorch_model.bin or their .index.json found")


def _indexed_files(root: Path, index: Path) -> list[Path]:
    """The shard files a ``weight_map`` index names, each a plain file name present in ``root``."""
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: malformed shard index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    outside = [v for v in weight_map.values() if Path(v).name != v or v in ("", ".", "..")]
    if outside:
        raise CheckpointError(f"{index}: shard {outside[0][:80]!r} is not a file name in the model directory")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
    return [root / f for f in files]


# Files besides the weights whose content can change a result: the config (architecture, norms, rotary, ...), the
# shard index (which tensor lives where) and the tokenizer (token ids, hence every score of a text).
FINGERPRINT_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                     "tokenizer.model", "spiece.model")
FINGERPRINT_VERSION = "2"


def resolve_lazy(obj, field: str):
    """``obj.field`` of a frozen dataclass, computed and stored on first use when it holds a zero-argument function
    (a content address that needs every byte of the weights is only worth its cost when a cache uses it)."""
    v = getattr(obj, field)
    if callable(v):
        v = v()
        object.__setattr__(obj, field, v)
    return v


def fingerprint(root: Path) -> str:
    """Content address of a checkpoint directory: SHA-256 over every byte of every weight file (memoised per file
    by path, size, mtime and ctime: ``mia.files.hashing``) and of each of ``FINGERPRINT_FILES`` present. Any edit of a
    weight, the config or the tokenizer gives another fingerprint. The dtypes a model is loaded in are not part of
    it (``mia.engine.cache.cache_namespace`` adds them)."""
    root = Path(root)
    h = hashlib.sha256(f"mia-checkpoint|{FINGERPRINT_VERSION}".encode())
    for f in weight_files(root):
        h.update(f"|weights:{f.name}:{file_hash.file_sha256(f)}".encode())
    for name in FINGERPRINT_FILES:
        if (root / name).is_file():
            h.update(f"|{name}:{hashlib.sha256((root / name).read_bytes()).hexdigest()}".encode())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------------------------- params <-> HF
def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def init_method(module):
    """Decoders initialise through ``declare`` (every param, no layer scan); other modules through ``__call__``."""
    return "declare" if hasattr(type(module), "declare") else None


def abstract_params(fam: Family, cfg, dtype=jnp.float32, param_dtype=jnp.float32):
    """(the family's module for ``cfg`` at these dtypes, its params as a tree of ``jax.ShapeDtypeStruct``)."""
    module = fam.module_cls(cfg, dtype=dtype, param_dtype=param_dtype)
    return module, module_abstract_params(module)


def module_abstract_params(module):
    """The params of a family's module (built as ``module_cls(config, dtype=..., param_dtype=...)``) as a tree of
    ``jax.ShapeDtypeStruct``: traced once per (class, config, dtypes) in a process, fresh containers each call."""
    try:
        shapes = _abstract_params(type(module), module.config, module.dtype, module.param_dtype)
    except TypeError:  # an unhashable config: traced every time
        return _traced_params(module)
    return jax.tree_util.tree_map(lambda leaf: leaf, shapes)  # fresh containers: the cache's stay as they are


def _traced_params(module):
    init = lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32), method=init_method(module))
    return jax.eval_shape(init)["params"]


@functools.lru_cache(maxsize=64)
def _abstract_params(module_cls, cfg, dtype, param_dtype):
    """Traced once per (module class, config, dtypes) in a process: the trace of a whole init (every layer's)
    is the costly part of opening a small checkpoint (25 s of the test suite's trace time)."""
    return _traced_params(module_cls(cfg, dtype=dtype, param_dtype=param_dtype))


class StackedView:
    """A read-only [L, ...] host array assembled lazily from L per-layer arrays (memory maps stay on disk until
    read): ``view[i, ...]`` reads only that slice of each layer it covers, so a device's shard of a stacked leaf
    never needs the whole leaf in host memory."""

    def __init__(self, layers: list):
        self.layers = layers
        self.shape = (len(layers),) + tuple(layers[0].shape)
        self.dtype = layers[0].dtype
        self.ndim = len(self.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        first, rest = (index[0] if index else slice(None)), index[1:]
        if isinstance(first, (int, np.integer)):
            return np.asarray(self.layers[first][rest])
        return np.stack([np.asarray(self.layers[i][rest]) for i in range(len(self.layers))[first]])

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def params_from_hf(tensors: dict[str, np.ndarray], fam: Family, cfg, shapes, param_dtype, source: str = "checkpoint"):
    """HF-named numpy tensors -> our params pytree (on the default device, ``param_dtype``), strict on names and
    shapes (see ``host_params_from_hf``). Each leaf is built whole on the host and widened to float32 before it is
    converted: simple, and the reference the streaming loader (``load``: ``put_params`` with ``read_shard``) must
    match bit for bit, but a stacked leaf costs about 3x its float32 size in transient host memory. For small
    models (a masked-LM head, tests)."""
    views = host_params_from_hf(tensors, fam, cfg, shapes, source)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a).astype(np.float32), dtype=param_dtype), views)


def tied_head_copy(name: str, tensors: dict, fam: Family, cfg, source: str) -> bool:
    """Whether ``name`` is a tied model's head stored anyway as a copy of its token embedding (some conversions of
    OPT and Llama checkpoints write both; transformers drops it). Such a copy is accepted only when it equals the
    embedding element for element; a head that differs is a ``CheckpointError``: config.json says the two are one
    matrix, and scoring with either would be scoring another model than the checkpoint's."""
    lm = fam.module_cls
    if not getattr(cfg, "tie_word_embeddings", False) or name != f"{lm.HEAD}.weight":
        return False
    embedding = f"{lm.HF_PREFIX}.{lm.EMBED}.weight"
    found = next((n for n in (embedding, embedding.split(".", 1)[1]) if n in tensors), None)
    if found is None:
        return False
    head, emb = tensors[name], tensors[found]
    if tuple(head.shape) != tuple(emb.shape) or not np.array_equal(np.asarray(head), np.asarray(emb)):
        raise CheckpointError(f"{source}: tensor {name!r} differs from the token embedding {found!r}, but config.json "
                              "says tie_word_embeddings=true (one matrix): fix the config or the checkpoint")
    return True


def host_params_from_hf(tensors: dict[str, np.ndarray], fam: Family, cfg, shapes, source: str = "checkpoint",
                        origin: Optional[dict] = None):
    """HF-named numpy tensors -> our params pytree of host views, strict on names, shapes and dtypes. Nothing is
    copied or converted: memory maps stay memory maps, transposes are views, and a stacked [L, ...] leaf (the decoder
    layers) is a ``StackedView`` over its per-layer tensors.

    Every parameter is floating point: a tensor it is read from that holds integers or booleans (a LayerNorm weight
    saved as int32, say) would be cast and scored without a word, so it is a ``CheckpointError`` naming the tensor
    and its file (``origin``: tensor name -> file; else ``source``). Both weight formats (safetensors, and
    ``pytorch_model.bin`` read by ``torch_bin``) come through here.

    A mapping with ``layer`` fills slice ``layer`` of a stacked [L, ...] leaf; its tensor's shape is checked
    against the leaf's shape without the L axis.
    """
    mappings: list[ParamMapping] = fam.param_mappings(cfg)
    stacked: dict[tuple, list] = {}  # path -> per-layer views, None until filled
    params: dict = {}
    used = set()
    for m in mappings:
        name = m.hf_name
        if name not in tensors:
            # checkpoints saved from the base model (no "gpt_neox." / "model." prefix)
            alt = name.split(".", 1)[1] if "." in name else name
            if alt in tensors:
                name = alt
            else:
                raise CheckpointError(f"{source}: tensor {m.hf_name!r} is missing")
        arr = tensors[name]
        if np.dtype(arr.dtype) not in _FLOAT_DTYPES:
            raise CheckpointError(f"{(origin or {}).get(name, source)}: tensor {name!r} is {np.dtype(arr.dtype).name}; "
                                  f"{fam.model_type} weights are floating point (float32, bfloat16, float16 or "
                                  "float64), and integers would be cast to them unnoticed")
        if m.transpose:
            arr = arr.T
        leaf_shape = tuple(_get(shapes, m.path).shape)
        want = leaf_shape if m.layer is None else leaf_shape[1:]
        if tuple(arr.shape) != want:
            got = tuple(tensors[name].shape)
            raise CheckpointError(f"{source}: tensor {name!r} has shape {got}, expected "
                                  f"{tuple(want[::-1]) if m.transpose else want} for this config")
        if m.layer is None:
            _set(params, m.path, arr)
        else:
            stacked.setdefault(m.path, [None] * leaf_shape[0])[m.layer] = arr
        used.add(name)
    for path, layers in stacked.items():
        if any(x is None for x in layers):  # a mapping table bug, not a user error
            raise AssertionError(f"{fam.model_type}: layers {[i for i, x in enumerate(layers) if x is None]} of "
                                 f"{path} have no HF mapping")
        _set(params, path, StackedView(layers))
    extra = [k for k in tensors if k not in used and not any(re.search(p, k) for p in fam.ignored_keys)
             and not tied_head_copy(k, tensors, fam, cfg, source)]
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor(s) not used by {fam.model_type}: "
                              f"{', '.join(sorted(extra)[:8])}"
                              + (" ..." if len(extra) > 8 else ""))
    missing = [p for p in _leaf_paths(shapes) if p not in {m.path for m in mappings}]
    if missing:  # a mapping table bug, not a user error
        raise AssertionError(f"{fam.model_type}: no HF mapping for params {missing[:5]}")
    return params


_FLOAT_DTYPES = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)}


def nonfinite_tensor(tensors: dict[str, np.ndarray]) -> Optional[tuple[str, int, int]]:
    """(name, count, first flat index) of the first floating tensor of ``tensors`` holding a NaN or an inf, else None.
    Reads every floating tensor once on the host (only when ``check_finite`` found a non-finite leaf, or for a few
    small tensors such as a masked-LM head)."""
    for name, arr in tensors.items():
        if np.dtype(arr.dtype) not in _FLOAT_DTYPES:
            continue
        bad = ~np.isfinite(np.asarray(arr))
        if bad.any():
            return name, int(bad.sum()), int(np.flatnonzero(bad.reshape(-1))[0])
    return None


def finite_leaves(leaves: list) -> jax.Array:
    """Pure: bool [len(leaves)], whether each leaf is finite throughout (non-floating and empty leaves count as
    finite). Per leaf one fused reduction with no temporary: ``sum(x * 0) == 0``, since x * 0 is 0 for every finite x
    and NaN for a NaN or an inf, and a sum propagates NaN by IEEE arithmetic on every backend. A max-based rule
    (``max |x| < inf``) is not portable: XLA:CPU's max reduction drops NaN (all-NaN gives -inf, one NaN among ones
    gives 1). ``isfinite(x).all()`` is exact too, but XLA:CPU then holds a bool per parameter (about 1 GB of host
    memory for a 1B model); it is the fallback where the rule fails its check (``finite_rule_holds``), chosen by
    ``_finite_flags`` before tracing."""
    return jnp.stack([jnp.sum(x * 0, dtype=jnp.float32) == 0 if jnp.issubdtype(x.dtype, jnp.inexact) and x.size
                      else jnp.bool_(True) for x in leaves])


def finite_leaves_isfinite(leaves: list) -> jax.Array:
    """``finite_leaves`` by ``isfinite(x).all()``: exact on any backend, but not memory-frugal on XLA:CPU."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) and x.size
                      else jnp.bool_(True) for x in leaves])


@functools.lru_cache(maxsize=None)
def finite_rule_holds() -> bool:
    """Whether ``sum(x * 0) == 0`` tells finite from non-finite on jax's default backend, checked once per process
    on arrays large enough to be vectorised: all NaN, one NaN, +inf, -inf, a huge finite value, in float32 and
    bfloat16. A backend that simplified x * 0 to 0 (fast-math) fails, and ``finite_leaves`` falls back."""
    cases = []
    for dtype in (jnp.float32, jnp.bfloat16):
        base = np.ones((64, 256), np.float32)
        for value, finite in ((np.nan, False), (np.inf, False), (-np.inf, False), (3e38, True), (None, True)):
            x = base.copy()
            if value is not None:
                x[17, 101] = value
            cases.append((jnp.asarray(x, dtype), finite))
        cases.append((jnp.full((64, 256), jnp.nan, dtype), False))
    rule = jax.jit(lambda ls: jnp.stack([jnp.sum(x * 0, dtype=jnp.float32) == 0 for x in ls]))
    got = np.asarray(rule([x for x, _ in cases]))
    return got.tolist() == [finite for _, finite in cases]


HOST_FINITE_CHECK_BYTES = 64 << 20  # up to this many parameter bytes held by CPU devices, the check runs in NumPy


def _host_checkable(leaves: list, host_bytes: int = HOST_FINITE_CHECK_BYTES) -> bool:
    """Whether the finite check of ``leaves`` is cheaper in NumPy than compiled: every leaf a NumPy array or a jax
    array this process holds whole on CPU devices, ``host_bytes`` at most in all. A compiled check costs one XLA
    program per parameter tree (about 0.1 s to trace, lower and compile, more than reading a small model)."""
    total = 0
    for x in leaves:
        if isinstance(x, jax.Array):
            if not x.is_fully_addressable or any(d.platform != "cpu" for d in x.devices()):
                return False
        elif not isinstance(x, np.ndarray):
            return False
        total += x.nbytes
    return total <= host_bytes


def _finite_flags(params, mesh=None, host_bytes: int = HOST_FINITE_CHECK_BYTES) -> np.ndarray:
    """bool [n_leaves]: whether each floating leaf of ``params`` is finite throughout (one ``isfinite().all()``
    reduction per leaf, on the devices holding it, fetched together, replicated over ``mesh`` when given so that
    every process can read it; a model of at most ``host_bytes`` held by CPU devices is read in NumPy instead,
    ``_host_checkable``); non-floating leaves count as finite."""
    leaves = jax.tree_util.tree_leaves(params)
    if _host_checkable(leaves, host_bytes):
        return np.array([bool(np.isfinite(np.asarray(x)).all()) if jnp.issubdtype(x.dtype, jnp.inexact) and x.size
                         else True for x in leaves], dtype=bool)
    rule = finite_leaves if finite_rule_holds() else finite_leaves_isfinite
    flags = jax.jit(rule, out_shardings=None if mesh is None else replicated(mesh))(leaves)
    return np.asarray(jax.device_get(flags))


def check_finite(params, tensors: dict[str, np.ndarray], origin: dict[str, Path], source: str,
                 param_dtype=None, mesh=None) -> None:
    """Refuse a checkpoint whose weights hold a NaN or an inf: one ``CheckpointError`` line naming the tensor (its
    checkpoint name) and its file (``origin``: tensor name -> file; ``source`` when unknown). The check runs on the
    placed ``params`` (one reduction per leaf, so it also catches a value that overflows ``param_dtype``, e.g. a
    float32 weight beyond 65504 loaded in float16); only when a leaf fails are the host ``tensors`` searched for the
    culprit."""
    flags = _finite_flags(params, mesh)
    if flags.all():
        return
    found = nonfinite_tensor(tensors)
    if found is not None:
        name, count, first = found
        raise CheckpointError(f"{origin.get(name, source)}: tensor {name!r} holds {count} non-finite value(s) "
                              f"(NaN or inf; the first at flat index {first}); the weights are damaged")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    bad = paths[int(np.flatnonzero(~flags)[0])]
    raise CheckpointError(f"{source}: parameter {bad} is non-finite once converted to "
                          f"{jnp.dtype(param_dtype).name if param_dtype is not None else 'its dtype'} (a value "
                          "beyond that dtype's range); load it in a wider dtype")


def params_to_hf(params, fam: Family, cfg) -> dict[str, np.ndarray]:
    """Our params pytree -> HF-named numpy tensors (slice ``layer`` of a stacked leaf for per-layer tensors)."""
    out = {}
    host: dict[tuple, np.ndarray] = {}
    for m in fam.param_mappings(cfg):
        if m.path not in host:
            host[m.path] = np.asarray(jax.device_get(_get(params, m.path)))
        arr = host[m.path] if m.layer is None else host[m.path][m.layer]
        out[m.hf_name] = np.ascontiguousarray(arr.T if m.transpose else arr)
    return out


def _leaf_paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaf_paths(v, prefix + (k,))
    else:
        yield prefix


# ----------------------------------------------------------------------------------------------- public API
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
AUTO = "auto"  # the default mode: float32 on a CPU, bfloat16 on an accelerator (``default_dtype``)


def default_dtype(platform: Optional[str] = None) -> str:
    """The mode ``"auto"`` stands for on ``platform`` (default: jax's default backend): ``"float32"`` on a CPU (exact,
    and what the parity tests hold to 1e-4), ``"bfloat16"`` on a GPU or TPU, where float32 at "highest" precision
    runs about 16x below the bf16 peak (docs/models.md#precision has the measured cost in scores)."""
    platform = (platform or jax.default_backend()).lower()
    return "float32" if platform == "cpu" else "bfloat16"


def resolve_dtype(dtype, platform: Optional[str] = None):
    """``"auto"`` -> ``default_dtype(platform)``; any other value unchanged (checked later by ``_dtype``)."""
    return default_dtype(platform) if isinstance(dtype, str) and dtype == AUTO else dtype


def _dtype(x, what: str = "dtype"):
    """A dtype mode name (``DTYPES``) or a floating dtype object -> the dtype; anything else is one ``ConfigError``
    line listing the supported names."""
    if x is None:
        return None
    if isinstance(x, str):
        x = resolve_dtype(x)
        if x not in DTYPES:
            raise ConfigError(f"{what} {x!r} is not supported; supported: {AUTO}, {', '.join(DTYPES)}")
        return DTYPES[x]
    try:
        ok = jnp.issubdtype(jnp.dtype(x), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"{what} {x!r} is not a floating dtype; supported: {AUTO}, {', '.join(DTYPES)}")
    return x


def resolve_dtypes(dtype, param_dtype=None) -> tuple[Any, Any]:
    """A dtype mode -> (activation dtype, parameter dtype); docs/models.md#precision.

    auto      float32 on a CPU, bfloat16 on a GPU/TPU (``default_dtype``)
    float32   float32 parameters and activations (matmuls at "highest" precision, see Model.matmul_precision).
    bfloat16  bfloat16 parameters and activations; norms, softmax, attention sums and the LM head in float32.
    float16   float16 parameters, exactly as an fp16 checkpoint (Pythia) stores them, and float32 activations:
              fp16 activations can overflow (max 65504) in the residual stream of models trained in bf16, and a
              bf16 copy would round every weight to 8 bits of mantissa. Half the parameter memory of float32,
              the arithmetic of float32.
    ``param_dtype`` overrides the parameter dtype.
    """
    activations = _dtype(dtype)
    params = _dtype(param_dtype, "param_dtype") or activations
    if jnp.dtype(activations) == jnp.float16:
        activations = jnp.float32
    return activations, params


def load_config(path) -> tuple[Family, Any, dict]:
    """(family, config, raw config.json) of a checkpoint directory or ``ORG/NAME[@REVISION]`` in the Hugging Face
    cache; every field type- and range-checked (``mia.validate.check_hf_config`` by name, then ``check_config`` on
    the family config). A native layout's config (``layouts``) is mapped to its family's first."""
    root = hf_cache.model_dir(path, error=CheckpointError)
    if not root.is_dir():
        raise CheckpointError(f"model directory not found: {root}")
    cfg_file = root / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{root}: config.json is missing")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: is not a file")
    hf = read_config_json(cfg_file)
    if "model_type" not in hf:
        raise CheckpointError(f"{cfg_file}: field 'model_type' is missing")
    layout = native_layout(hf)
    try:
        fam = family(layout.family if layout else hf["model_type"])
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    return fam, config_from_hf(fam.config_cls, layout.hf_config(hf, str(cfg_file)) if layout else hf, cfg_file,
                               fam.harmless), hf


def read_config_json(cfg_file: Path) -> dict:
    """The config.json object: UTF-8 JSON, every known field type- and range-checked by name
    (``mia.validate.check_hf_config``); ``CheckpointError``/``ConfigError`` naming the file otherwise."""
    try:
        hf = json.loads(Path(cfg_file).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None
    return check_hf_config(hf, str(cfg_file), error=ConfigError)


def config_from_hf(config_cls, hf: dict, cfg_file, harmless=()) -> Any:
    """``config_cls.from_hf(hf)`` (``family.read_config``: a field neither read nor known to be harmless is refused)
    with each field of the result checked (``mia.validate.check_config``); a missing field, a refused setting or an
    unusable value is one ``CheckpointError``/``ConfigError`` naming the file."""
    try:
        cfg = read_config(config_cls, hf, harmless)
    except KeyError as e:
        raise CheckpointError(f"{cfg_file}: required field {e} is missing") from None
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:  # a field the by-name check does not know
        raise ConfigError(f"{cfg_file}: unusable field value ({type(e).__name__}: {e})") from None
    return check_config(cfg, str(cfg_file), error=ConfigError)


def load_tokenizer(path, tokenizer_class: Optional[str] = None):
    """The tokenizer files of a checkpoint directory through ``AutoTokenizer``, or through the transformers class
    ``tokenizer_class`` (a native layout whose files name remote code); None when there are none."""
    root = Path(path)
    if not any((root / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    import transformers

    cls = transformers.AutoTokenizer if tokenizer_class is None else getattr(transformers, tokenizer_class)
    try:
        return cls.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (corrupt tokenizer files raise many types; the user gets one line)
        bad = _bad_tokenizer_file(root)
        if bad is not None:
            raise CheckpointError(bad) from None
        msg = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{root}: tokenizer files could not be loaded ({type(e).__name__}: {msg})") from None


TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                        "added_tokens.json")


def _bad_tokenizer_file(root: Path) -> Optional[str]:
    """After the tokenizer failed to load: a one-line message naming the first JSON tokenizer file of ``root`` that
    is not a UTF-8 JSON object, or None (then the directory is named)."""
    for name in TOKENIZER_JSON_FILES:
        f = root / name
        if not f.exists():
            continue
        try:
            obj = json.loads(f.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            return f"{f}: tokenizer file is not valid JSON ({str(e)[:120]})"
        if not isinstance(obj, dict):
            return f"{f}: tokenizer file must hold a JSON object, got {type(obj).__name__}"
    return None


def load(path, dtype=AUTO, param_dtype=None, tokenizer: bool = True, mesh=None,
         fsdp: Optional[bool] = None, adapter=None) -> Model:
    """Load a local HF-layout checkpoint directory, or ``ORG/NAME[@REVISION]`` from the Hugging Face cache (offline,
    ``hf_cache``). ``dtype``: activations (``"auto"``: float32 on a CPU, bfloat16 on an accelerator);
    ``param_dtype`` defaults to ``dtype``.

    Parameters are placed once, with their shardings over ``mesh`` (``mia.sharding``: FSDP over ``data`` when
    ``fsdp``, the default with an explicit mesh; tensor parallel over ``model``); without a mesh, replicated on
    every device. Each device's shard is read from the memory-mapped safetensors and converted on its own, so a
    checkpoint never exists whole in host memory as a second copy. Logits are float32 and log-probabilities are
    computed from them in float32 whatever ``dtype`` is; in ``"bfloat16"`` the weights, hidden states and matmul
    operands feeding them are bf16 (docs/models.md#precision).

    ``adapter``: a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors`` or ``.bin``),
    merged into the base weights in float32 before they are cast and placed (``mia.models.adapter``). The model's
    ``path`` stays the base's (the default reference of ``ref``, ``ez_mia`` and ``wbc``); its fingerprint covers both.
    """
    dtype, param_dtype = resolve_dtypes(dtype, param_dtype)  # a bad dtype is refused before anything is read
    root = hf_cache.model_dir(path, error=CheckpointError)
    fam, cfg, raw = load_config(root)
    layout = native_layout(raw)
    files = weight_files(root)
    tensors: dict = {}
    origin: dict[str, Path] = {}
    for f in files:
        part = read_weights(f)
        tensors.update(part)
        origin.update(dict.fromkeys(part, f))
    # checkpoint names, for naming a damaged tensor (known buffers, e.g. a mask bias, may hold -inf and are unused)
    by_name = {k: v for k, v in tensors.items() if not any(re.search(p, k) for p in fam.ignored_keys)}
    if layout:
        tensors = layout.hf_tensors(tensors, cfg, str(root), CheckpointError)
    address: Any = functools.partial(fingerprint, root)
    if adapter is not None:
        tensors = with_adapter(Path(adapter), tensors, fam, cfg)
        address = functools.partial(adapted_fingerprint, root, Path(adapter))
    module, shapes = abstract_params(fam, cfg, dtype, param_dtype)
    views = host_params_from_hf(tensors, fam, cfg, shapes, source=str(root), origin=origin)
    fsdp = (mesh is not None) if fsdp is None else bool(fsdp)
    placed_on = make_mesh() if mesh is None else mesh
    params = put_params(views, param_shardings(shapes, placed_on, fsdp=fsdp), dtype=param_dtype,
                        release=mapped_pages_release(tensors.values()))
    check_finite(params, by_name, origin, str(root), param_dtype, placed_on)
    tok = load_tokenizer(root, layout.tokenizer_class if layout else None) if tokenizer else None
    return Model(module, params, tok, cfg, fam.model_type, str(root), address, placed_on, fsdp,
                 None if adapter is None else str(adapter))


def with_adapter(adapter: Path, tensors: dict, fam: Family, cfg) -> dict:
    """The base checkpoint's ``tensors`` with the PEFT LoRA adapter directory ``adapter`` merged
    (``mia.models.adapter``); ``AdapterError`` (one line) for an adapter that cannot be merged exactly."""
    if not adapter.is_dir():
        raise CheckpointError(f"adapter directory not found: {adapter}")
    conf = read_adapter_config(adapter)
    weights = adapter_weight_file(adapter)
    merged = merge_lora(tensors, conf, read_weights(weights), fam.param_mappings(cfg),
                        getattr(fam.module_cls, "HEAD", "lm_head"), str(weights))
    return merged


def adapted_fingerprint(root: Path, adapter: Path) -> str:
    """Content address of a base checkpoint with an adapter merged: the base's ``fingerprint`` and the adapter's
    digest (its config and weight file) together, so the score cache never mixes the two models."""
    both = f"mia-adapted|{fingerprint(root)}|{adapter_digest(adapter, file_hash.file_sha256)}"
    return hashlib.sha256(both.encode()).hexdigest()[:32]





def place(model: Model, mesh=None, fsdp: Optional[bool] = None) -> Model:
    """The same model with its params placed on ``mesh`` (as ``load(..., mesh=)`` does); e.g. for ``from_config``."""
    fsdp = (mesh is not None) if fsdp is None else bool(fsdp)
    mesh = make_mesh() if mesh is None else mesh
    params = put_params(model.params, param_shardings(model.params, mesh, fsdp=fsdp))
    return dataclasses.replace(model, params=params, mesh=mesh, fsdp=fsdp)


def from_config(cfg, params=None, tokenizer=None, key=None, dtype=AUTO, param_dtype=None) -> Model:
    """Build a Model from a config object (random init when ``params`` is None)."""
    fam = family_of_config(cfg)
    model_type = fam.model_type
    dtype, param_dtype = resolve_dtypes(dtype, param_dtype)
    module = fam.module_cls(cfg, dtype=dtype, param_dtype=param_dtype)
    if params is None:
        key = jax.random.PRNGKey(0) if key is None else key
        params = module.init(key, jnp.zeros((1, 2), jnp.int32), method=init_method(module))["params"]
    return Model(module, params, tokenizer, cfg, model_type, None, params_fingerprint(cfg, params))


def params_fingerprint(cfg, params) -> str:
    """Content address of an in-memory model: its config and every byte of every parameter (in its own dtype)."""
    h = hashlib.sha256(f"mia-params|{FINGERPRINT_VERSION}|".encode() + json.dumps(cfg.to_hf(), sort_keys=True).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(jax.device_get(leaf))
        h.update(f"|{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def save(model: Model, path, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors and the tokenizer so that transformers loads the same model back."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    fam = family(model.model_type)
    hf_cfg = dict(model.config.to_hf())
    hf_cfg["torch_dtype"] = dtype
    hf_cfg["dtype"] = dtype
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in params_to_hf(model.params, fam, model.config).items()}
    write_safetensors(tensors, root / "model.safetensors")
    write_text(root / "config.json", json.dumps(hf_cfg, indent=2, sort_keys=True))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(root))
    return root
