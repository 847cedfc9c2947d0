"""PyTorch ``torch.save`` checkpoints (``pytorch_model.bin``) read without torch and without running their pickle.

A ``torch.save`` file (torch >= 1.6) is a zip archive: ``<prefix>/data.pkl`` is a pickle of the state dict in which
each tensor is a call ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` and each storage a
persistent id ``("storage", torch.<Kind>Storage, key, location, numel)`` whose bytes are the uncompressed member
``<prefix>/data/<key>``; ``<prefix>/byteorder`` says ``little`` or ``big`` (absent: little).

A pickle is a program: an ordinary ``pickle.load`` calls whatever global it names (``os.system`` included). Here
the unpickler resolves only the few globals a plain state dict uses (``ALLOWED_GLOBALS``) and refuses any other
one, naming it, before anything is called. Tensors come back as read-only NumPy views of a memory map of the zip
(bfloat16 via ml_dtypes), the storage offset and strides applied, so nothing is copied until a leaf is placed.
Legacy (pre-zip) files are refused with a message.
"""
from __future__ import annotations

import collections
import io
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

# torch.<Kind>Storage -> element dtype (complex, quantized and the rest are refused as unknown globals)
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}
REBUILD_FUNCTIONS = ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter")
ALLOWED_GLOBALS = (("collections", "OrderedDict"),
                   *(("torch._utils", f) for f in REBUILD_FUNCTIONS),
                   *(("torch", s) for s in STORAGE_DTYPES))

# The pickled magic number that opens a legacy (torch < 1.6, non-zip) file: PROTO 2, LONG1 of 10 bytes.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_STORAGE_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, 22 bytes we skip, file name length, extra field length


class _Sealed:
    """No pickle BUILD may rewrite these records (``__setstate__`` is what BUILD calls when it exists)."""

    __slots__ = ()

    def __setstate__(self, state):
        raise pickle.UnpicklingError(f"the pickle tries to set the state of a {type(self).__name__}")


class StorageType(_Sealed):
    """What the pickle's ``torch.<Kind>Storage`` global resolves to: a name and a dtype, nothing callable."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype):
        self.name, self.dtype = name, np.dtype(dtype)


class Storage(_Sealed):
    """One storage: its elements as a 1-D read-only array (a view of the file's memory map)."""

    __slots__ = ("key", "array")

    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


def read_torch_bin(path, *, error=ValueError) -> dict[str, np.ndarray]:
    """Tensor name -> read-only NumPy view of every tensor of a ``torch.save`` zip state dict (e.g. a transformers
    ``pytorch_model.bin``). Nothing of the pickle is executed: a global outside ``ALLOWED_GLOBALS`` is one
    ``error`` naming it. A corrupt archive, a legacy (non-zip) file, a view outside its storage or anything but a
    flat ``{str: tensor}`` dict is one ``error`` naming the file."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise error(_not_zip_message(path))
    try:
        with zipfile.ZipFile(path) as zf:
            prefix = _archive_prefix(zf, path, error)
            big_endian = _byteorder(zf, prefix, path, error) == "big"
            members = {i.filename: i for i in zf.infolist()}
            data_pkl = zf.read(f"{prefix}data.pkl")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        if isinstance(e, error):
            raise
        raise error(f"{path}: not a readable PyTorch zip checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
    whole = np.memmap(path, dtype=np.uint8, mode="r")

    def storage_array(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
        info = members.get(f"{prefix}data/{key}")
        if info is None:
            raise error(f"{path}: storage {key!r} has no member {prefix}data/{key} in the archive")
        array = _member_array(path, whole, info, dtype, numel, error)
        return _from_big_endian(array) if big_endian else array

    state = _unpickle(data_pkl, storage_array, f"{path}: {prefix}data.pkl", error)
    if not isinstance(state, dict):
        raise error(f"{path}: holds {type(state).__name__}, not a state dict (a {{name: tensor}} mapping)")
    dtypes = {np.dtype(d) for d in STORAGE_DTYPES.values()}
    bad = [k for k, v in state.items() if not (isinstance(k, str) and isinstance(v, np.ndarray) and v.dtype in dtypes)]
    if bad:
        raise error(f"{path}: entry {str(bad[0])[:80]!r} is not a tensor named by a string; only a flat state dict "
                    f"{{name: tensor}} can be read")
    return dict(state)


def _not_zip_message(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(len(LEGACY_MAGIC))
    if head == LEGACY_MAGIC:
        return (f"{path}: a legacy (torch < 1.6, non-zip) PyTorch checkpoint; mia reads only zip checkpoints and "
                f"safetensors. Re-save it with a recent torch (torch.save) or convert it to model.safetensors")
    return f"{path}: not a PyTorch zip checkpoint (no zip archive; {path.stat().st_size} bytes)"


def _archive_prefix(zf: zipfile.ZipFile, path: Path, error) -> str:
    """The folder holding ``data.pkl`` (torch names it after the file, or ``archive/``), with its slash."""
    pickles = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        what = "no <name>/data.pkl" if not pickles else f"{len(pickles)} data.pkl files"
        raise error(f"{path}: not a torch.save checkpoint ({what} in the zip; a TorchScript archive or another zip)")
    return pickles[0][: -len("data.pkl")]


def _byteorder(zf: zipfile.ZipFile, prefix: str, path: Path, error) -> str:
    name = f"{prefix}byteorder"
    if name not in zf.namelist():
        return "little"  # files from before torch wrote the record are little-endian
    order = zf.read(name).decode("ascii", "replace").strip()
    if order not in ("little", "big"):
        raise error(f"{path}: {name} says {order[:20]!r}, expected 'little' or 'big'")
    return order


def _from_big_endian(array: np.ndarray) -> np.ndarray:
    """A copy of big-endian elements in native (little-endian) order; any dtype, bfloat16 included."""
    if array.dtype.itemsize == 1:
        return array
    return array.view(np.dtype(f"u{array.dtype.itemsize}")).byteswap().view(array.dtype)


def _member_array(path: Path, whole: np.ndarray, info: zipfile.ZipInfo, dtype: np.dtype, numel: int,
                  error) -> np.ndarray:
    """The ``numel`` elements stored in zip member ``info``: a view of the file's memory map (torch stores members
    uncompressed), or a copy when a tool re-compressed the archive."""
    where = f"{path}: member {info.filename}"
    if info.file_size != numel * dtype.itemsize:
        raise error(f"{where} has {info.file_size} bytes; the pickle declares {numel} elements of "
                    f"{dtype.itemsize} bytes")
    if info.compress_type != zipfile.ZIP_STORED:
        with zipfile.ZipFile(path) as zf:
            return np.frombuffer(zf.read(info), dtype=dtype)
    head = bytes(whole[info.header_offset: info.header_offset + _LOCAL_HEADER.size])
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise error(f"{where}: local zip header is missing or damaged")
    _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > whole.size:
        raise error(f"{where}: data runs past the end of the file ({whole.size} bytes)")
    return whole[start: start + info.file_size].view(dtype)


def _unpickle(data: bytes, storage_array: Callable, where: str, error):
    unpickler = _StateDictUnpickler(io.BytesIO(data), storage_array, where, error)
    try:
        return unpickler.load()
    except RecursionError:
        raise error(f"{where}: nested too deeply to be a state dict") from None
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError, KeyError, ValueError,
            OverflowError, MemoryError) as e:
        if isinstance(e, error):
            raise
        raise error(f"{where}: not a readable state-dict pickle ({type(e).__name__}: {str(e)[:120]})") from None


class _StateDictUnpickler(pickle.Unpickler):
    """Resolves only ``ALLOWED_GLOBALS``: the storage kinds become ``StorageType`` records and the rebuild
    functions become this module's view builders; any other global raises before it could be called."""

    def __init__(self, file, storage_array: Callable, where: str, error):
        super().__init__(file)
        self._storage_array, self._where, self._error = storage_array, where, error
        self._storages: dict[str, Storage] = {}

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageType(name, STORAGE_DTYPES[name])
        if module == "torch._utils" and name in REBUILD_FUNCTIONS:
            return getattr(self, name)
        allowed = ", ".join(f"{m}.{n}" for m, n in ALLOWED_GLOBALS[:4]) + ", torch.<Kind>Storage"
        raise self._error(f"{self._where}: refused: the pickle asks for the global "
                          f"{str(module)[:80]}.{str(name)[:80]}, which a plain state dict never uses; nothing was run "
                          f"(allowed: {allowed})")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise self._error(f"{self._where}: unknown persistent id {str(pid)[:80]} (expected a storage record)")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, StorageType):
            raise self._error(f"{self._where}: storage record names {str(kind)[:60]}, not a torch.<Kind>Storage")
        if not (isinstance(key, str) and _STORAGE_KEY.match(key)):
            raise self._error(f"{self._where}: storage key {str(key)[:60]!r} is not a plain archive member name")
        if not (isinstance(numel, int) and not isinstance(numel, bool) and numel >= 0):
            raise self._error(f"{self._where}: storage {key!r} has element count {str(numel)[:40]}")
        known = self._storages.get(key)
        if known is None:
            known = self._storages[key] = Storage(key, self._storage_array(key, kind.dtype, numel))
        elif known.array.dtype.newbyteorder("=") != kind.dtype.newbyteorder("=") or known.array.size != numel:
            raise self._error(f"{self._where}: storage {key!r} is declared twice with different types or sizes")
        return known

    # ---- the rebuild functions the pickle may call (torch._utils names) ----
    def _rebuild_tensor_v2(self, storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                           metadata=None):
        if backward_hooks not in (None, {}) or metadata not in (None, {}):
            raise self._error(f"{self._where}: a tensor carries hooks or metadata; only plain tensors can be read")
        return self._rebuild_tensor(storage, storage_offset, size, stride)

    def _rebuild_tensor(self, storage, storage_offset, size, stride):
        if not isinstance(storage, Storage):
            raise self._error(f"{self._where}: a tensor is rebuilt from {type(storage).__name__}, not a storage")
        offset = _non_negative_int(storage_offset)
        shape, steps = _int_tuple(size), _int_tuple(stride)
        if offset is None or shape is None or steps is None or len(shape) != len(steps):
            raise self._error(f"{self._where}: tensor of storage {storage.key!r} has a malformed offset, size or "
                              f"stride ({str(storage_offset)[:20]}, {str(size)[:60]}, {str(stride)[:60]})")
        return strided_view(storage.array, offset, shape, steps, f"{self._where}: storage {storage.key!r}", self._error)

    def _rebuild_parameter(self, data, requires_grad=False, backward_hooks=None):
        if not isinstance(data, np.ndarray) or backward_hooks not in (None, {}):
            raise self._error(f"{self._where}: a parameter wraps something other than a plain tensor")
        return data


def strided_view(flat: np.ndarray, offset: int, shape: tuple, stride: tuple, where: str, error) -> np.ndarray:
    """The read-only tensor ``flat[offset + sum(i_k * stride_k)]`` of ``shape`` (torch's storage offset and strides,
    in elements), without a copy; the last element it reaches must lie inside ``flat``."""
    if 0 in shape:
        empty = np.zeros(shape, flat.dtype)
        empty.flags.writeable = False
        return empty
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    if last >= flat.size:
        raise error(f"{where}: a tensor view {shape} (offset {offset}, stride {stride}) reaches element {last}, "
                    f"past the storage's {flat.size}")
    itemsize = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=shape, strides=tuple(s * itemsize for s in stride),
                                           writeable=False)


def _non_negative_int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _int_tuple(v):
    if not isinstance(v, (tuple, list)):
        return None
    out = tuple(_non_negative_int(x) for x in v)
    return None if any(x is None for x in out) else out
