"""``mia plan``: will a scoring run fit? Compile the step ahead of time on abstract parameters and read XLA's memory.

    mia plan --model DIR|CONFIG.json|pythia-12b --dtype bfloat16 --batch 8 --length 2048 \
        [--mesh data=1,model=8] [--topology v5e:2x4] [--attack stats|mope|condll] [--device-memory 80GiB]

Nothing is allocated: parameters are ``jax.ShapeDtypeStruct``s (from ``jax.eval_shape`` of the module's init)
carrying the shardings ``mia.engine.sharding`` would give them on the mesh, the step is
``jit(...).lower(...).compile()``d,
and ``compiled.memory_analysis()`` gives the per-device figures XLA's buffer assignment computed:

  params_bytes  bytes of this device's parameter shards (exact, from the shardings)
  peak_bytes    the larger of XLA's ``peak_memory_in_bytes`` and arguments + outputs + temporaries - aliased
                (the temporaries are one arena packed by liveness, so this bound is what the step needs at most;
                XLA:CPU's own peak figure leaves the arena out)
  device_bytes  the device's memory: the TPU chip's HBM for ``--topology``; the local device's ``bytes_limit``;
                or ``--device-memory``; unknown (null) on a CPU without ``--device-memory``
  fits          peak_bytes <= device_bytes (null when device_bytes is unknown)

With ``--topology`` (e.g. ``v5e:2x4``, ``v4:2x2x1``, ``v6e:2x2``) the step is compiled by libtpu for that TPU slice
through ``jax.experimental.topologies``, with no TPU present (``pip install libtpu``, ideally in a separate venv;
run it with networking disabled, e.g. under ``unshare -n``, since libtpu otherwise may look for a cloud metadata
server; we set ``TPU_SKIP_MDS_QUERY=1`` and ``JAX_PLATFORMS=cpu`` when jax is not imported yet). Without it, the step
is compiled for the local devices. XLA:CPU's memory analysis is NOT representative of bf16 on accelerators (it
upcasts bf16 arithmetic to float32 and fuses differently); use it for float32, or as an estimate only.

The last line printed is one JSON object ``{"params_bytes", "peak_bytes", "device_bytes", "fits", ...}``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..attacks.mope import build_mope_step
from ..models.common import ConfigError
from ..models.hub import Model, _dtypes, abstract_params, config_from_hf, family, read_config_json
from ..validate import check_hf_config
from .loop import build_token_stats_step
from .sharding import batch_sharding, make_mesh, param_shardings, replicated, sharded_bytes

GiB = 1 << 30

# Usable HBM per TPU chip by jax ``device_kind`` (lower case). v5e: 16 GiB of HBM, of which 15.75 GiB are available
# to programs; the others are the data-sheet HBM sizes.
TPU_HBM_BYTES = {
    "tpu v4": 32 * GiB,
    "tpu v5 lite": int(15.75 * GiB),
    "tpu v5": 95 * GiB,
    "tpu v6 lite": 32 * GiB,
}

# Shapes of the models our users score, so that ``--model pythia-12b`` works without a checkpoint on disk.
# Numbers from the public config.json files of EleutherAI/pythia-*-deduped and allenai/OLMo-7B-hf.
_PYTHIA = {  # name: (hidden, layers, heads, vocab)
    "70m": (512, 6, 8, 50304), "160m": (768, 12, 12, 50304), "410m": (1024, 24, 16, 50304),
    "1b": (2048, 16, 8, 50304), "1.4b": (2048, 24, 16, 50304), "2.8b": (2560, 32, 32, 50304),
    "6.9b": (4096, 32, 32, 50432), "12b": (5120, 36, 40, 50688),
}
NAMED_SHAPES = {
    **{f"pythia-{k}": {"model_type": "gpt_neox", "hidden_size": d, "num_hidden_layers": n, "num_attention_heads": h,
                       "intermediate_size": 4 * d, "vocab_size": v, "rotary_pct": 0.25, "max_position_embeddings": 2048,
                       "use_parallel_residual": True, "tie_word_embeddings": False}
       for k, (d, n, h, v) in _PYTHIA.items()},
    "olmo-7b": {"model_type": "olmo", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 50304,
                "max_position_embeddings": 2048, "tie_word_embeddings": False, "clip_qkv": None},
}


class PlanError(ValueError):
    """A request ``mia plan`` cannot compile; one line for the user."""


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """Per-device figures of one compiled step (bytes)."""

    params_bytes: int
    peak_bytes: int
    device_bytes: Optional[int]
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    devices: int
    device_kind: str
    mesh: dict
    peak_source: str
    group_bytes: Optional[int] = None  # MoPe: the largest leaf group perturbed at once (per device)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_bytes is None else self.peak_bytes <= self.device_bytes

    def to_json(self) -> dict:
        return {"params_bytes": self.params_bytes, "peak_bytes": self.peak_bytes, "device_bytes": self.device_bytes,
                "fits": self.fits, "temp_bytes": self.temp_bytes, "argument_bytes": self.argument_bytes,
                "output_bytes": self.output_bytes, "devices": self.devices, "device_kind": self.device_kind,
                "mesh": self.mesh, "peak_source": self.peak_source, "group_bytes": self.group_bytes}


# ----------------------------------------------------------------------------------------------- inputs
def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '16g', '17179869184' -> bytes (GB = 1e9, GiB = 2^30; a bare 'G' means GiB)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise PlanError(f"--device-memory {text!r}: expected a size such as 80GiB, 80GB or 16g")
    value, unit, binary, b = m.groups()
    power = " kmgt".index(unit) if unit else 0
    base = 1024 if (binary or not b) else 1000
    try:
        n = int(float(value) * base ** power)
    except (ValueError, OverflowError):  # "." or "1.2.3"; 400 nines (an infinite float)
        raise PlanError(f"--device-memory {text!r}: expected a size such as 80GiB, 80GB or 16g") from None
    if n < 1:
        raise PlanError(f"--device-memory {text!r}: must be more than 0 bytes")
    return n


def config_source(model: str) -> str:
    """What errors about ``--model``'s config name: the named shape, or the config.json path."""
    if model in NAMED_SHAPES:
        return model
    try:
        return str(Path(model) / "config.json") if Path(model).is_dir() else model
    except OSError:  # a name too long: read_hf_config says so
        return model


def read_hf_config(model: str) -> dict:
    """The HF config dict of a model directory, a config.json file, or a name in NAMED_SHAPES."""
    if model in NAMED_SHAPES:
        return dict(NAMED_SHAPES[model])
    path = Path(config_source(model))
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:
        raise PlanError(f"--model {model[:300]}: cannot be looked at ({e.strerror or e})") from None
    if not path.exists():
        raise PlanError(f"--model {model}: no such directory or config.json "
                        f"(or a named shape: {', '.join(NAMED_SHAPES)})")
    hf = read_config_json(path)  # the checks ``mia score`` runs: JSON, then every known field's type and range
    if "model_type" not in hf:
        raise PlanError(f"{path}: field 'model_type' is missing")
    return hf


def topology_devices(name: str):
    """Abstract devices of a TPU topology (e.g. 'v5e:2x4'), compiled for by libtpu without a TPU."""
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError("--topology needs the libtpu wheel (pip install libtpu, ideally in a separate venv); "
                        "it is not installed in this environment")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(name, platform="tpu").devices)
    except Exception as e:  # libtpu's INVALID_ARGUMENT for a name it does not know
        dims = re.fullmatch(r"[^:]+:(\d+)x(\d+)(?:x(\d+))?", name)
        if dims and "chips_per_host_bounds" in str(e):  # a slice smaller than one host, e.g. v5e:1x1
            bounds = tuple(int(d or 1) for d in dims.groups())
            try:
                return list(topologies.get_topology_desc(name, platform="tpu", chips_per_host_bounds=bounds).devices)
            except Exception as e2:
                e = e2
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"--topology {name!r}: libtpu does not know it ({msg}); examples: v5e:2x4, v4:2x2x1, "
                        "v6e:2x2") from None


def device_memory(device, override: Optional[int]) -> Optional[int]:
    """Bytes of memory of one device: the override, the TPU table, the runtime's bytes_limit, else None."""
    if override is not None:
        return override
    kind = str(getattr(device, "device_kind", "")).lower()
    if kind in TPU_HBM_BYTES:
        return TPU_HBM_BYTES[kind]
    try:
        stats = device.memory_stats()
    except Exception:  # abstract or CPU devices have none
        stats = None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


# ----------------------------------------------------------------------------------------------- the plan
def shard_bytes(abstract_tree) -> int:
    """Bytes of ONE device's shards of a pytree of ShapeDtypeStructs with shardings (max over devices)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def memory_figures(compiled) -> tuple[int, int, int, int, str]:
    """(peak, argument, temp, output, source) bytes per device from ``compiled.memory_analysis()``."""
    m = compiled.memory_analysis()
    if m is None:
        raise PlanError("this backend reports no memory analysis for compiled programs")
    arg, tmp, out = int(m.argument_size_in_bytes), int(m.temp_size_in_bytes), int(m.output_size_in_bytes)
    alias = int(getattr(m, "alias_size_in_bytes", 0))
    bound = arg + out + tmp - alias
    peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    # XLA:CPU reports a peak below arguments + temporaries (it leaves the temp arena out); take the larger figure,
    # so that "fits" is never claimed on an optimistic number.
    if peak >= bound:
        return peak, arg, tmp, out, "peak_memory_in_bytes"
    return bound, arg, tmp, out, "arguments+outputs+temporaries-aliased"


def mope_group_bytes(model, shapes, shardings) -> int:
    """Per-device bytes of the largest group MoPe perturbs at once: the non-layer leaves (embeddings, head, final
    norm) together, or one layer's slice of the stacked leaves."""
    layers = model.module.LAYERS
    top = {k: v for k, v in shapes.items() if k != layers}
    top_bytes = sharded_bytes(top, {k: v for k, v in shardings.items() if k != layers})
    stack = sharded_bytes(shapes[layers], shardings[layers])
    n_layers = int(model.config.num_hidden_layers)
    return max(top_bytes, stack // n_layers)


def abstract_model(hf: dict, dtype: str, source: str = "config"):
    """(Model with no params, abstract params pytree) of an HF config dict; nothing is allocated. The config is
    checked as ``mia score`` checks it (``mia.models.hub.config_from_hf``); errors name ``source``."""
    try:
        fam = family(hf["model_type"])
        cfg = config_from_hf(fam.config_cls, check_hf_config(hf, source, error=ConfigError), source, fam.harmless)
    except KeyError as e:
        raise PlanError(f"{source}: required field {e} is missing") from None
    except ConfigError as e:
        raise PlanError(f"{source}: {e}" if source not in str(e) else str(e)) from None
    act, param = _dtypes(dtype)  # the loader's policy (float16: fp16 parameters, float32 compute)
    module, shapes = abstract_params(fam, cfg, act, param)
    return Model(module, None, None, cfg, fam.model_type, None, "plan"), shapes


def plan_scoring(hf: dict, *, dtype: str = "bfloat16", batch: int = 8, length: int = 2048,
                 mesh_axes: Optional[dict] = None, devices=None, fsdp: Optional[bool] = None,
                 device_bytes: Optional[int] = None, attack: str = "stats", mope_n: int = 10,
                 mope_chunk: int = 2, source: str = "config") -> PlanResult:
    """Compile a scoring step ahead of time and read its memory.

    ``attack``: "stats" (the token-statistics pass every attack shares) or "mope" (MoPe's step with ``mope_n``
    perturbed models, ``mope_chunk`` of them vmapped at a time).

    ``devices``: the devices to compile for (default: the local ones; a TPU topology's abstract devices work).
    ``mesh_axes``: {"data": n, "model": m} (default: all devices on data). ``fsdp`` defaults to True when a mesh is
    given and False without one, as ``mia score`` does. ``source`` names the config in errors; ``length`` may not
    exceed the model's context (``max_position_embeddings``).
    """
    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh(mesh_axes, devices)
    fsdp = (mesh_axes is not None) if fsdp is None else fsdp
    n_data = dict(mesh.shape)["data"]
    if batch % n_data:
        raise PlanError(f"--batch {batch} must be a multiple of the mesh's data axis ({n_data})")
    model, shapes = abstract_model(hf, dtype, source)
    if length > model.max_length:
        raise PlanError(f"--length {length} is beyond the model's context: {source} has max_position_embeddings "
                        f"{model.max_length}")
    shardings = param_shardings(shapes, mesh, fsdp=fsdp)
    params = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    rows = batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=rows)
    valid = jax.ShapeDtypeStruct((batch, length), jnp.bool_, sharding=rows)
    if attack == "stats":
        lowered = build_token_stats_step(model, mesh, shardings).lower(params, tokens, valid)
    elif attack == "mope":
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated(mesh))
        lowered = build_mope_step(model, mesh, shardings, mope_n, 0.005, mope_chunk).lower(key, params, tokens, valid)
    else:
        raise PlanError(f"--attack {attack!r}: expected stats or mope")
    peak, arg, tmp, out, source = memory_figures(lowered.compile())
    return PlanResult(params_bytes=sharded_bytes(shapes, shardings), peak_bytes=peak,
                      device_bytes=device_memory(devices[0], device_bytes), argument_bytes=arg, temp_bytes=tmp,
                      output_bytes=out, devices=len(devices), device_kind=str(devices[0].device_kind),
                      mesh={k: int(v) for k, v in dict(mesh.shape).items()}, peak_source=source,
                      group_bytes=mope_group_bytes(model, shapes, shardings) if attack == "mope" else None)


# ----------------------------------------------------------------------------------------------- command line
def parse_plan_attack(text: str) -> tuple[str, dict]:
    """'stats' | 'mope' | 'mope:n=10,chunk=2' -> (name, plan_scoring keyword arguments)."""
    name, _, rest = text.partition(":")
    if name == "stats" and not rest:
        return "stats", {}
    if name != "mope":
        raise PlanError(f"--attack {text!r}: expected stats or mope[:n=10,chunk=2]")
    opts = {"mope_n": 10, "mope_chunk": 2}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("n", "chunk") or not (value.isascii() and value.isdigit()) or len(value) > 9 or int(value) < 1:
            raise PlanError(f"--attack {text[:80]!r}: expected n=INT,chunk=INT (both in [1, 999999999])")
        opts["mope_" + key] = int(value)
    return "mope", opts


def local_device_count() -> int:
    return len(jax.devices())
