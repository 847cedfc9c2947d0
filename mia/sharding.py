"""Where arrays live: the named device mesh, parameter partition rules, and explicit placement of params and batches.

The mesh always has two named axes, ``data`` (rows of a batch; FSDP shards of the parameters) and ``model`` (tensor
parallel: attention heads, MLP width, vocabulary). ``--mesh data=2,model=4`` asks for 2 x 4 devices; without
``--mesh`` every device is on ``data`` and the parameters are replicated once (``fsdp=False``).

Parameter rules (``partition_spec``), by the role of a leaf, read from its path, and its shape. Kernels are flax
``[in, out]``; an embedding is ``[vocab, width]``; a leaf may carry leading stacked axes (``[L, in, out]`` when the
layers are scanned), and those leading axes are never sharded.

  role      leaves (module name ends with ...)                        ``model`` splits    must divide
  column    q/k/v_proj, query_key_value, c_attn, gate/up_proj, c_fc,   kernel out, bias    yes
            dense_h_to_4h, fc_in, fc1, qkv_proj, gate_up_proj
  row       o_proj, out_proj, c_proj, attention_dense, down_proj,      kernel in           yes
            dense_4h_to_h, fc_out, fc2
  vocab     token embedding (embed_tokens, embed_in, wte) [V, D];      V                   no: replicated on
            untied head (lm_head, embed_out) [D, V]                                         ``model`` otherwise
  other     norms, biases of row layers, position tables                 -                   -

With ``fsdp`` every matrix (kernel, embedding) also splits one more dimension over ``data`` (ZeRO-3 style: the
largest dimension not taken by ``model`` that ``data`` divides; none: replicated over ``data``). Vectors (norms,
biases) stay replicated over ``data``: they are O(width) per layer. A sharding never changes a number, only where
it is stored and which collectives XLA inserts, so every layout gives the same scores (tests check it).

Everything here takes the mesh explicitly and works on abstract shapes (``jax.ShapeDtypeStruct``) too, so a step can
be compiled ahead of time for devices that are not attached (``mia plan``, ``jax.experimental.topologies``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "model")

COLUMN = re.compile(r"(q_proj|k_proj|v_proj|query_key_value|c_attn|gate_proj|up_proj|c_fc|dense_h_to_4h|fc_in|fc1)$")
ROW = re.compile(r"(o_proj|out_proj|c_proj|attention_dense|down_proj|dense_4h_to_h|fc_out|fc2)$")
VOCAB_EMBED = re.compile(r"(embed_tokens|embed_in|wte)$")
VOCAB_HEAD = re.compile(r"(lm_head|embed_out)$")
MATRIX_LEAVES = ("kernel", "embedding")  # logical rank 2; every other leaf has logical rank 1


class MeshError(ValueError):
    """A mesh that cannot be built on the visible devices, or a tensor that cannot be split over it (one line)."""


# ------------------------------------------------------------------------------------------------ the mesh
def parse_mesh(text: str, n_devices: Optional[int] = None) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (an axis left out has size 1).

    With ``n_devices`` the product must equal it (``--mesh data=3,model=4 needs 12 devices, 8 are visible``).
    """
    axes = {name: 1 for name in AXES}
    seen = set()
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise MeshError(f"--mesh {text}: {item!r} must be AXIS=SIZE (axes: {', '.join(AXES)})")
        if name not in AXES:
            raise MeshError(f"--mesh {text}: unknown axis {name!r} (axes: {', '.join(AXES)})")
        if name in seen:
            raise MeshError(f"--mesh {text}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            raise MeshError(f"--mesh {text}: size of {name!r} must be an integer, got {value.strip()!r}") from None
        if size < 1:
            raise MeshError(f"--mesh {text}: size of {name!r} must be >= 1, got {size}")
        axes[name] = size
        seen.add(name)
    if not seen:
        raise MeshError(f"--mesh {text!r}: give AXIS=SIZE pairs, e.g. data=2,model=4")
    if n_devices is not None and math.prod(axes.values()) != n_devices:
        raise MeshError(f"--mesh {text} needs {math.prod(axes.values())} devices, {visible(n_devices)}")
    return axes


def visible(n: int) -> str:
    return f"{n} {'is' if n == 1 else 'are'} visible"


def make_mesh(axes: Optional[Mapping[str, int]] = None, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``Mesh`` with axes ("data", "model") over ``devices`` (default: all devices, of every process).

    ``axes`` None: every device on ``data``. ``devices`` may be the abstract devices of a TPU topology.
    Device order comes from ``mesh_utils.create_device_mesh`` (topology-aware on TPU; process-major elsewhere,
    so with several processes each process holds whole rows of ``data`` when ``data`` >= the process count).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(axes or {"data": len(devices)})
    unknown = [a for a in sizes if a not in AXES]
    if unknown:
        raise MeshError(f"unknown mesh axis {unknown[0]!r} (axes: {', '.join(AXES)})")
    shape = tuple(int(sizes.get(a, 1)) for a in AXES)
    if math.prod(shape) != len(devices):
        text = ",".join(f"{a}={s}" for a, s in zip(AXES, shape))
        raise MeshError(f"--mesh {text} needs {math.prod(shape)} devices, {visible(len(devices))}")
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # an unusual device kind: plain process-major order
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES)


def mesh_axes(mesh) -> dict[str, int]:
    """{"data": n, "model": m} of a Mesh or AbstractMesh (missing axes are 1)."""
    shape = dict(mesh.shape)
    return {a: int(shape.get(a, 1)) for a in AXES}


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices ("cpu", "gpu", "tpu"; a TPU topology's abstract devices say "tpu"); an
    AbstractMesh, which holds no devices, gives jax's default backend."""
    devices = getattr(mesh, "devices", None)
    return devices.flat[0].platform if devices is not None else jax.default_backend()


def loop_compiler_options() -> Optional[dict]:
    """XLA compiler options of a program that one loop runs many times (the blind MLP's training step, a large
    testbed training run): on CPU, XLA's default optimisation level 3 whatever ``XLA_FLAGS`` say, so such a loop
    always runs the same, fast program (at level 0, which the default test run sets for everything else, the MLP's
    step ran 8x slower); None elsewhere (the platform's defaults). Not the encoder's embedding: its longer compile
    cost the test run's small embeddings as much as it saved on large ones (docs/testing.md)."""
    return {"xla_backend_optimization_level": 3} if jax.default_backend() == "cpu" else None


def describe(mesh) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh_axes(mesh).items())


# ------------------------------------------------------------------------------------------------ partition rules
def leaf_name(path) -> str:
    """'layers_0/attention_query_key_value/kernel' from a tree_flatten_with_path key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def leaf_role(name: str) -> str:
    """'column' | 'row' | 'vocab_embed' | 'vocab_head' | 'other' for a slash-separated leaf name."""
    parts = name.split("/")
    module, kind = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if kind == "embedding" and VOCAB_EMBED.search(module):
        return "vocab_embed"
    if kind == "kernel" and VOCAB_HEAD.search(module):
        return "vocab_head"
    if kind in ("kernel", "bias") and COLUMN.search(module):
        return "column"
    if kind == "kernel" and ROW.search(module):
        return "row"
    return "other"


def partition_spec(name: str, shape: Sequence[int], axes: Mapping[str, int], fsdp: bool = True) -> PartitionSpec:
    """PartitionSpec of one parameter leaf (see the module docstring for the rules).

    Raises MeshError when a dimension that must split over ``model`` (heads, MLP width) does not divide by it.
    """
    shape = tuple(int(s) for s in shape)
    kind = name.split("/")[-1]
    logical = 2 if kind in MATRIX_LEAVES else 1
    lead = max(0, len(shape) - logical)  # stacked-layer axes: never sharded
    dims = shape[lead:]
    spec: list = [None] * len(dims)
    model, data = int(axes.get("model", 1)), int(axes.get("data", 1))
    role = leaf_role(name)
    want = {"column": len(dims) - 1, "row": 0, "vocab_embed": 0, "vocab_head": len(dims) - 1}.get(role)
    if kind == "bias" and role == "column":
        want = 0
    if model > 1 and want is not None and want < len(dims):
        if dims[want] % model == 0:
            spec[want] = "model"
        elif role in ("column", "row"):
            raise MeshError(f"tensor {name} {list(shape)}: dimension {lead + want} ({dims[want]}) is not divisible "
                            f"by mesh axis model={model}")
    if fsdp and data > 1 and logical == 2 and len(dims) == 2:
        free = sorted((i for i in range(2) if spec[i] is None and dims[i] % data == 0), key=lambda i: -dims[i])
        if free:
            spec[free[0]] = "data"
    return PartitionSpec(*([None] * lead + spec))


def param_partition_specs(params, axes: Mapping[str, int], fsdp: bool = True):
    """Pytree of PartitionSpec for a params pytree (arrays or ShapeDtypeStructs; only shapes are read)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = [partition_spec(leaf_name(p), np.shape(x) if not hasattr(x, "shape") else x.shape, axes, fsdp)
             for p, x in flat]
    return jax.tree_util.tree_unflatten(treedef, specs)


def param_shardings(params, mesh, fsdp: bool = True):
    """Pytree of NamedSharding(mesh, spec) for a params pytree (arrays or ShapeDtypeStructs; nothing allocated).

    ``fsdp=False`` keeps every parameter replicated over ``data`` (the default layout without ``--mesh``).
    """
    specs = param_partition_specs(params, mesh_axes(mesh), fsdp)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def replicated(mesh) -> NamedSharding:
    """Every device holds the whole array (small outputs, keys, scalars)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh) -> NamedSharding:
    """Rows of a batch over ``data`` (each row whole on a device group; replicated over ``model``)."""
    return NamedSharding(mesh, PartitionSpec("data"))


def data_size(mesh) -> int:
    return mesh_axes(mesh)["data"]


def sharded_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of a pytree under ``shardings`` (the largest shard per leaf; nothing allocated)."""
    total = 0
    for x, s in zip(jax.tree_util.tree_leaves(abstract_tree), jax.tree_util.tree_leaves(shardings)):
        shard = s.shard_shape(tuple(x.shape))
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def without_data(spec: PartitionSpec) -> PartitionSpec:
    """The spec with its ``data`` (FSDP) entries dropped: what a device needs to compute with the leaf."""
    def drop(entry):
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != "data")
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if entry == "data" else entry
    return PartitionSpec(*(drop(e) for e in spec))


def layer_gather(params_shardings, layers: str) -> Optional[Callable]:
    """ZeRO-3 inside the layer scan: ``layer_transform(i, layer_params)`` that all-gathers one layer's FSDP shards
    (its slice of the stacked leaves, the leading [L] axis dropped) just before the layer runs, so only one
    layer's parameters are ever whole over ``data``. None when nothing is split over ``data``."""
    stack = params_shardings[layers]
    flat = jax.tree_util.tree_leaves(stack)
    if not any("data" in jax.tree_util.tree_leaves(tuple(s.spec)) for s in flat):
        return None
    targets = [NamedSharding(s.mesh, without_data(PartitionSpec(*tuple(s.spec)[1:]))) for s in flat]

    def transform(index, layer_params):
        leaves, treedef = jax.tree_util.tree_flatten(layer_params)  # dict / FrozenDict: sorted keys, as ``stack``
        return treedef.unflatten([jax.lax.with_sharding_constraint(x, t) for x, t in zip(leaves, targets)])

    return transform


def gather_outside_layers(params, params_shardings, layers: str):
    """Inside a jitted step: the leaves outside the layer stack (embeddings, head, final norm) all-gathered over
    ``data`` (their FSDP shards), so every matmul contracts whole dimensions on each device: no partial sums cross
    devices over ``data``, and an FSDP layout gives the same bits as a replicated one."""
    out = dict(params)
    for name, tree in params.items():
        if name == layers:
            continue
        out[name] = jax.tree_util.tree_map(
            lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(s.mesh, without_data(s.spec)))
            if "data" in jax.tree_util.tree_leaves(tuple(s.spec)) else x, tree, params_shardings[name])
    return out


def compose(*transforms: Optional[Callable]) -> Optional[Callable]:
    """Layer transforms applied left to right (None entries skipped); None when there are none."""
    fs = [f for f in transforms if f is not None]
    if not fs:
        return None

    def transform(index, layer_params):
        for f in fs:
            layer_params = f(index, layer_params)
        return layer_params

    return transform


# ------------------------------------------------------------------------------------------------ placement
BLOCK_BYTES = 64 << 20  # the most a shard is read and converted at once (host memory: about one block past the shard)
TILE = 256  # side of the tiles a transposed source is copied in


def convert(part: np.ndarray, dtype=None) -> np.ndarray:
    """``part`` in ``dtype`` (no copy when it already is). The result has the bits of ``part.astype(float32)
    .astype(dtype)`` (the whole-leaf loader's rounding): a float16/bfloat16/float32 source widens to float32 exactly,
    so a float32 target is one direct cast, and any other float target is rounded once from float32.
    A value beyond ``dtype``'s range becomes inf silently: ``mia.models.hub.check_finite`` names it after placing."""
    if dtype is None or part.dtype == np.dtype(dtype):
        return part
    out = np.empty(np.shape(part), dtype)
    convert_into(out, part)
    return out


def _is_float(dt) -> bool:
    return np.dtype(dt).kind == "f" or np.dtype(dt).name == "bfloat16"


def convert_into(out: np.ndarray, part) -> None:
    """Write ``part`` into the preallocated ``out`` in ``out``'s dtype, with ``convert``'s rounding: a same-dtype or
    float32-target copy is one cast; float -> another narrower float goes through float32 (only ``part``'s size is
    ever held in float32)."""
    part = np.asarray(part)
    if part.ndim >= 2 and not part.flags.c_contiguous and part.size > TILE * TILE:
        # a transposed source (an HF [out, in] weight read as [in, out]): copy tile by tile, which keeps both sides
        # in cache (a plain strided copy of a large matrix is several times slower)
        for i in range(0, part.shape[-2], TILE):
            for j in range(0, part.shape[-1], TILE):
                tile = (Ellipsis, slice(i, i + TILE), slice(j, j + TILE))
                _cast_into(out[tile], part[tile])
    else:
        _cast_into(out, part)


def _cast_into(out: np.ndarray, part: np.ndarray) -> None:
    src, dst = np.dtype(part.dtype), np.dtype(out.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        if src == dst or dst == np.float32 or src == np.float32 or not (_is_float(src) and _is_float(dst)):
            np.copyto(out, part, casting="unsafe")
        else:
            np.copyto(out, part.astype(np.float32), casting="unsafe")


def aligned_empty(shape: Sequence[int], dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary. A CPU device takes such
    a buffer over without copying it (``jax.device_put`` copies a numpy array whose data is not 64-byte aligned, and
    numpy's own large allocations are 16-byte aligned), so on a CPU the shard read is the parameter itself."""
    shape = tuple(int(n) for n in shape)
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(size + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + size].view(dtype).reshape(shape)


def _normalize(index: tuple, shape: Sequence[int]) -> tuple:
    """A shard index (slices, from ``addressable_devices_indices_map``) as one slice per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*i.indices(n)) if isinstance(i, slice) else slice(int(i), int(i) + 1) for i, n in
                 zip(index, shape))


def _outer_axis(host) -> int:
    """The axis a read should block along: the one with the largest stride of a numpy array (axis 1 of a transposed
    matrix, so that each block is a run of the file's rows, not a band of columns touching every page), else 0 (a
    stacked view: one layer per row)."""
    if isinstance(host, np.ndarray) and host.ndim > 1:
        return int(np.argmax([abs(st) if n > 1 else 0 for st, n in zip(host.strides, host.shape)]))
    return 0


def read_shard(host, index: tuple, dtype=None, release: Optional[Callable[[], None]] = None,
               block_bytes: Optional[int] = None) -> np.ndarray:
    """``host[index]`` in ``dtype`` (``convert``'s bits), built in place in one preallocated, 64-byte aligned array:
    ``host`` is read a block at a time along its outermost axis in memory (the leading axis of a stacked view: a
    layer; the file's rows of a transposed matrix) and each block is converted into the result, so a memory map (or
    a stacked view over per-layer maps, ``mia.models.hub.StackedView``) is never copied whole nor widened whole to
    float32. ``release()``, when given, is called after each block (the loader drops the memory-mapped pages just
    read from the process's resident set). ``index``: slices with positive steps (as a sharding gives), one per
    leading dimension at most; missing trailing dimensions are whole. ``block_bytes``: the most read at once
    (default ``BLOCK_BYTES``; at least one row of the blocking axis)."""
    shape = tuple(np.shape(host))
    dtype = np.dtype(host.dtype if dtype is None else dtype)
    if not shape:
        out = np.empty((), dtype)
        convert_into(out, np.asarray(host[()]) if hasattr(host, "__getitem__") else host)
        return out
    index = list(_normalize(index, shape))
    out = aligned_empty(tuple(len(range(n)[i]) for i, n in zip(index, shape)), dtype)
    axis = _outer_axis(host)
    rows = range(shape[axis])[index[axis]]
    row_bytes = max(1, out.size // max(1, len(rows)) * max(4, dtype.itemsize))
    per_block = max(1, (BLOCK_BYTES if block_bytes is None else block_bytes) // row_bytes)
    lead = (slice(None),) * axis
    layers = getattr(host, "layers", None)  # a StackedView: convert each layer's slice straight from its own map
    if layers is not None and axis == 0:
        per_block = 1
    for j in range(0, len(rows), per_block):
        k = min(len(rows), j + per_block)
        index[axis] = slice(rows[j], rows[k - 1] + 1, rows.step)
        if layers is not None and axis == 0:
            convert_into(out[j], layers[rows[j]][tuple(index[1:])])
        else:
            convert_into(out[lead + (slice(j, k),)], host[tuple(index)])
        if release is not None:
            release()
    return out


def put_array(host, sharding: NamedSharding, dtype=None, release: Optional[Callable[[], None]] = None) -> jax.Array:
    """Place one array explicitly. ``host``: numpy, a memory map or a stacked view (each device's shard is read and
    converted on its own, block by block: ``read_shard``) or a jax.Array. Works with several processes: each process
    transfers the shards of its own devices."""
    if isinstance(host, jax.Array):
        if dtype is not None and host.dtype != dtype:
            host = host.astype(dtype)
        if host.sharding.is_equivalent_to(sharding, host.ndim):
            return host
        if host.is_fully_addressable and sharding.is_fully_addressable:
            return jax.device_put(host, sharding)
        host = np.asarray(jax.device_get(host))
    return assemble(tuple(np.shape(host)), sharding, lambda index: read_shard(host, index, dtype, release))


def assemble(shape: Sequence[int], sharding: NamedSharding, shard: Callable[[tuple], np.ndarray]) -> jax.Array:
    """A global array from ``shard(index) -> np.ndarray``, called once per distinct shard this process's devices
    hold (a shard replicated on several devices is built once). Each shard is copied to its devices as soon as it is
    built and its host buffer dropped, so the host holds one shard at a time. The copies are explicit
    ``jax.device_put`` calls, so this works under ``jax.transfer_guard("disallow")`` and with several processes."""
    groups: dict = {}
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        key = tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)
        groups.setdefault(key, (index, []))[1].append(device)
    placed = {}
    for index, devices in groups.values():
        part = shard(index)
        value = np.ascontiguousarray(part).reshape(np.shape(part))  # (ascontiguousarray makes a 0-d array 1-d)
        for device, array in zip(devices, jax.device_put([value] * len(devices), devices)):
            placed[device] = array
        del value
    order = list(sharding.addressable_devices_indices_map(tuple(shape)))
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [placed[d] for d in order])


def put_params(params, shardings, dtype=None, release: Optional[Callable[[], None]] = None):
    """Place a params pytree with a matching pytree of shardings, leaf by leaf and shard by shard (``put_array``);
    already-placed leaves are returned as they are. ``release``: see ``read_shard``."""
    return jax.tree_util.tree_map(lambda x, s: put_array(x, s, dtype, release), params, shardings)


def put_rows(shape: Sequence[int], sharding: NamedSharding, make_rows: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
    """A global batch of ``shape`` whose leading axis is rows, placed with ``sharding``.

    ``make_rows(row_ids) -> np.ndarray [len(row_ids), *shape[1:]]`` is called only for the rows this process's
    devices hold (each process builds and sends its own shard of a global batch; one call per distinct shard).
    """
    def shard(index):
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(shape[0])
        return make_rows(np.arange(start, stop))[(slice(None),) + tuple(index[1:])]

    return assemble(shape, sharding, shard)


def fetch(tree):
    """Device -> host of (replicated) outputs, explicitly (allowed under ``jax.transfer_guard("disallow")``)."""
    return jax.device_get(tree)


def start_fetch(tree) -> None:
    """Begin copying outputs to the host without waiting (so the next ``fetch`` finds them there)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()
