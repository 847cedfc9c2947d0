"""The validation layer at mia's edges: typed, range-checked readers of everything a user hands in.

Every reader takes the value, ``where`` (the file:line, field or option it came from, named in the message) and
``error`` (the one-line user error type of the caller: ``DataError``, ``ConfigError``, ``CheckpointError``,
``AttackError`` ..., all ``ValueError`` subclasses that ``mia.entry.run_for_user`` prints as ``error: ...`` with exit
status 2). A reader returns the value in its canonical type or raises; nothing past the edge sees a bad value.

Groups:
  fields       ``integer``, ``number``, ``boolean``, ``text``, ``token_ids``, ``Range`` (JSON / key=value values)
  options      ``arg_int``, ``arg_float``, ``OneLineParser`` (argparse: a bad option is one ``error:`` line)
  paths        ``input_file``, ``input_dir``, ``output_file``, ``output_dir`` (checked before the expensive work)
  config.json  ``check_hf_config`` (raw fields by name), ``check_config`` (the family config, by annotation)
  safetensors  ``safetensors_header`` (length, JSON, every entry's dtype/shape/offsets against the file size)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import stat
import os
import sys
import typing
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

INT32_MAX = 2 ** 31 - 1


class InputError(ValueError):
    """Bad user input; the message is one line naming the file, line, field or option."""


# ============================================================================================== fields
def _kind(value) -> str:
    return "null" if value is None else {bool: "a boolean", str: "a string", list: "a list", dict: "an object",
                                         float: "a number", int: "an integer"}.get(type(value), type(value).__name__)


def integer(value, where: str, *, lo: Optional[int] = None, hi: Optional[int] = None, error=InputError) -> int:
    """``value`` as an int in [lo, hi]; a bool, a string or any float (even 2.0, which would reach array shapes as
    a float) is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise error(f"{where} must be an integer, got {_kind(value)} {value!r}"[:300])
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise error(f"{where} must be {_bounds(lo, hi)}, got {value}")
    return value


def number(value, where: str, *, lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False,
           hi_open: bool = False, error=InputError) -> float:
    """``value`` as a finite float in the interval (``lo_open``/``hi_open``: bound excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"{where} must be a number, got {_kind(value)} {value!r}"[:300])
    value = float(value)
    if not math.isfinite(value):
        raise error(f"{where} must be a finite number, got {value!r}")
    Range(lo, hi, lo_open, hi_open).check(value, where, error)
    return value


def boolean(value, where: str, *, error=InputError) -> bool:
    if not isinstance(value, bool):
        raise error(f"{where} must be true or false, got {_kind(value)} {value!r}"[:300])
    return value


def text(value, where: str, *, choices: Optional[Iterable[str]] = None, error=InputError) -> str:
    """A string that is valid Unicode (no lone surrogate such as ``"\\ud800"``), one of ``choices`` if given."""
    if not isinstance(value, str):
        raise error(f"{where} must be a string, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(
            f"{where} is not valid Unicode: a lone surrogate {value[e.start]!r} at character {e.start}"
        ) from None
    if choices is not None and value not in tuple(choices):
        raise error(f"{where} must be one of {', '.join(map(repr, choices))}; got {value!r}"[:300])
    return value


def token_ids(value, where: str, *, error=InputError) -> np.ndarray:
    """A JSON list (or a 1-D integer array) of token ids -> int32 array; every id an integer in [0, 2**31 - 1] (the
    vocabulary bound is
    checked once the model is known: ``mia.data.examples.out_of_vocab``)."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and (value.dtype.kind in "iu" or value.size == 0):
        if value.size and (int(value.min()) < 0 or int(value.max()) > INT32_MAX):
            i = int(np.argmax((value < 0) | (value > INT32_MAX)))
            raise error(f"{where}[{i}] = {int(value[i])} is not a token id (0 <= id <= {INT32_MAX})")
        return value.astype(np.int32)
    if not isinstance(value, list):
        raise error(f"{where} must be a list of token ids, got {_kind(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise error(f"{where}[{i}] must be an integer token id, got {_kind(t)} {t!r}"[:300])
        if t < 0 or t > INT32_MAX:
            raise error(f"{where}[{i}] = {t} is not a token id (0 <= id <= {INT32_MAX})")
    return np.asarray(value, np.int32)


def _bounds(lo, hi, lo_open=False, hi_open=False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return "any value"


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric interval; ``check`` raises ``error`` naming ``where`` when a value lies outside."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True

    def check(self, v, where: str, error=InputError):
        if not self.contains(v):
            raise error(f"{where} must be {_bounds(self.lo, self.hi, self.lo_open, self.hi_open)}, got {v!r}")
        return v

    def __str__(self) -> str:
        return _bounds(self.lo, self.hi, self.lo_open, self.hi_open)


# ============================================================================================== options
def arg_int(lo: Optional[int] = None, hi: Optional[int] = None):
    """argparse ``type=`` for an int in [lo, hi]; argparse names the option in its one-line error."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if not Range(lo, hi).contains(v):
            raise argparse.ArgumentTypeError(f"must be {_bounds(lo, hi)}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def arg_int_list(lo: Optional[int] = None, hi: Optional[int] = None):
    """argparse ``type=`` for a comma-separated list of ints, each in [lo, hi] (``--steps 100,200``)."""
    one = arg_int(lo, hi)

    def parse(s: str) -> list:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {s!r}")
        return [one(x) for x in items]

    parse.__name__ = "integer list"
    return parse


def arg_float(lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False, hi_open: bool = False):
    """argparse ``type=`` for a finite float in the interval."""
    r = Range(lo, hi, lo_open, hi_open)

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
        if not r.contains(v):
            raise argparse.ArgumentTypeError(f"must be {r}, got {v}")
        return v

    parse.__name__ = "float"
    return parse


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``error: <prog>: <message> (see --help)``, exit status 2,
    like every other user error of mia (argparse's default prints the usage block first). Subparsers inherit it."""

    def error(self, message):
        msg = " ".join(str(message).split())
        print(f"error: {self.prog}: {msg} (see --help)", file=sys.stderr)
        raise SystemExit(2)


class _Renamed(argparse.Action):
    """An old flag spelling: refused with one line naming the flag it became (never silently accepted: argparse would
    otherwise take ``--step`` as an abbreviation of ``--steps``)."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {self.new}")


def add_renamed_flag(parser, old: str, new: str) -> None:
    """Refuse ``old`` with one usage error naming ``new`` (mia's one flag vocabulary: ``--steps``, ``--member``,
    ``--batch-tokens``, ``--bucket-step`` wherever a command takes them)."""
    parser.add_argument(old, action=_Renamed, new=new, dest=f"_renamed_{old.strip('-').replace('-', '_')}",
                        default=None)


# ============================================================================================== paths
def utf8_lines(path, error: type = InputError):
    """Yield ``(lineno, line)`` for every non-blank line of the file at ``path`` (1-based line numbers, the newline
    kept). A line that is not UTF-8 stops with one ``error`` naming ``path:lineno``, the bad byte and its offset. A
    byte-order mark opening the file (Windows editors write one) is not content and is dropped."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at byte {e.start} "
                            "of the line)") from None
            if line.strip():
                yield lineno, line


def check_json_file(path, error: type = InputError) -> None:
    """A ``.jsonl`` / ``.json`` file that a JSON reader (``datasets``' json loader) will be given, checked first so
    that a bad row is one ``error`` naming ``path:LINE`` (the loader's own message names neither line nor cause):
    JSON Lines (every non-blank line one JSON value) or, for ``.json``, one JSON document (an array or object over
    any number of lines). Compressed files are left to the loader."""
    p = Path(path)
    if p.name.lower().endswith((".gz", ".bz2", ".xz", ".zst", ".zip")):
        return
    if p.suffix.lower() == ".json":
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
            json.loads(text)
            return  # one JSON document
        except UnicodeDecodeError as e:
            raise error(f"{_shown(p)}:{raw[:e.start].count(bytes([10])) + 1}: not valid UTF-8") from None
        except (ValueError, RecursionError) as e:
            first = next((line for line in text.splitlines() if line.strip()), "")
            if not _is_json(first):  # not JSON Lines either: the document's own error, at its line
                raise error(f"{_shown(p)}:{getattr(e, 'lineno', 1)}: invalid JSON ({_json_problem(e)})") from None
    for lineno, line in utf8_lines(p, error):
        try:
            json.loads(line)
        except (ValueError, RecursionError) as e:
            raise error(f"{_shown(p)}:{lineno}: invalid JSON ({_json_problem(e)})") from None


def _json_problem(e: BaseException) -> str:
    """What a ``json`` error says, with its column: "Expecting value, column 12"."""
    if not isinstance(e, json.JSONDecodeError):
        return "nested too deeply" if isinstance(e, RecursionError) else str(e).split("\n")[0]
    return f"{e.msg}{'' if e.msg.endswith(' at') else ','} column {e.colno}"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _shown(p) -> str:
    """A path for a message: at most 300 characters (a name too long for the system is thousands)."""
    s = str(p)
    return s if len(s) <= 300 else s[:297] + "..."


def _kind_of_path(p: Path, what: str, error) -> str:
    """"missing", "dir" or "file" (anything else that exists); a path that cannot even be looked at (too long, a
    directory that may not be searched) is one ``error`` naming ``what``, not an ``OSError``."""
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except (OSError, ValueError) as e:  # ENAMETOOLONG, EACCES, ELOOP; ValueError: an embedded NUL
        raise error(f"{what} {_shown(p)}: cannot be looked at ({getattr(e, 'strerror', None) or e})") from None
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def input_file(path, what: str, *, error=InputError) -> Path:
    """An existing regular file (``what`` names the option or role, e.g. ``--data``)."""
    p = Path(path)
    kind = _kind_of_path(p, what, error)
    if kind == "missing":
        raise error(f"{what} {_shown(p)}: file not found")
    if kind == "dir":
        raise error(f"{what} {_shown(p)}: is a directory, expected a file")
    if not os.access(p, os.R_OK):
        raise error(f"{what} {_shown(p)}: not readable")
    return p


def input_dir(path, what: str, *, noun: str = "directory", error=InputError) -> Path:
    """An existing directory (``noun`` names it in the message, e.g. "model directory")."""
    p = Path(path)
    kind = _kind_of_path(p, what, error)
    if kind == "missing":
        raise error(f"{what} {_shown(p)}: {noun} not found")
    if kind != "dir":
        raise error(f"{what} {_shown(p)}: is a file, expected a directory")
    return p


def _check_writable_under(p: Path, what: str, error) -> None:
    """``p`` (missing) can be created: its first existing ancestor is a writable directory."""
    for parent in p.absolute().parents:
        kind = _kind_of_path(parent, what, error)
        if kind == "missing":
            continue
        if kind != "dir":
            raise error(f"{what} {_shown(p)}: cannot be created, {_shown(parent)} is a file")
        if not os.access(parent, os.W_OK):
            raise error(f"{what} {_shown(p)}: cannot be written ({_shown(parent)} is not writable)")
        return


def output_file(path, what: str, *, inputs: Iterable = (), error=InputError) -> Path:
    """A file that can be written: not an existing directory, no ancestor that is a file, not one of ``inputs``."""
    p = Path(path)
    kind = _kind_of_path(p, what, error)
    if kind == "dir":
        raise error(f"{what} {_shown(p)}: is a directory, expected a file path")
    _check_writable_under(p, what, error)
    for q in inputs:
        if q is not None and kind != "missing" and Path(q).exists() and p.resolve() == Path(q).resolve():
            raise error(f"{what} {_shown(p)}: is also an input file; it would be overwritten")
    return p


def output_dir(path, what: str, *, error=InputError) -> Path:
    """A directory that exists and is writable, or can be created: not an existing file, no ancestor that is a
    file."""
    p = Path(path)
    kind = _kind_of_path(p, what, error)
    if kind == "file":
        raise error(f"{what} {_shown(p)}: is a file, expected a directory")
    if kind == "missing":
        _check_writable_under(p, what, error)
    elif not os.access(p, os.W_OK | os.X_OK):
        raise error(f"{what} {_shown(p)}: directory is not writable")
    return p


# ============================================================================================== config.json
_POSITIVE_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head",
                 "n_positions", "n_ctx", "n_inner", "num_layers", "num_heads", "window_size", "type_vocab_size")
_POSITIVE_FLOAT = ("rope_theta", "rotary_emb_base", "layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon",
                   "clip_qkv")
_FRACTION = ("rotary_pct", "partial_rotary_factor")  # in (0, 1]
_BOOL = ("use_parallel_residual", "attention_bias", "mlp_bias", "tie_word_embeddings", "scale_attn_weights",
         "scale_attn_by_inverse_layer_idx", "use_cache")
_STRING = ("model_type", "hidden_act", "activation_function")
_TOKEN_ID = ("bos_token_id", "pad_token_id")  # eos_token_id may also be a list


def check_hf_config(hf, source: str, *, error=InputError) -> dict:
    """The raw ``config.json`` object: every known field that is present has the right JSON type and range
    (a size is an integer >= 1, a norm epsilon a number > 0, a rotary fraction in (0, 1], a flag a boolean ...).
    ``null`` is accepted where HF writes it (an optional size or token id)."""
    if not isinstance(hf, dict):
        raise error(f"{source}: expected a JSON object, got {_kind(hf)}")
    at = lambda k: f"{source}: field {k!r}"
    for k in _POSITIVE_INT:
        if hf.get(k) is not None:
            integer(hf[k], at(k), lo=1, hi=INT32_MAX, error=error)
    for k in _POSITIVE_FLOAT:
        if hf.get(k) is not None:
            number(hf[k], at(k), lo=0, lo_open=True, error=error)
    for k in _BOOL:
        if hf.get(k) is not None:
            boolean(hf[k], at(k), error=error)
    for k in _STRING:
        if hf.get(k) is not None:
            text(hf[k], at(k), error=error)
    for k in _TOKEN_ID:
        if hf.get(k) is not None:
            integer(hf[k], at(k), lo=0, hi=INT32_MAX, error=error)
    eos = hf.get("eos_token_id")
    for i, t in enumerate(eos if isinstance(eos, list) else [] if eos is None else [eos]):
        integer(t, at("eos_token_id") + (f"[{i}]" if isinstance(eos, list) else ""), lo=0, hi=INT32_MAX, error=error)
    rope = hf.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise error(f"{at('rope_parameters')} must be an object, got {_kind(rope)}")
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise error(f"{at('rope_scaling')} must be an object or null, got {_kind(scaling)}")
    for k in _FRACTION:
        for obj, name in ((hf, k), (rope or {}, f"rope_parameters.{k}")):
            if obj.get(k) is not None:
                number(obj[k], at(name), lo=0, hi=1, lo_open=True, error=error)
    if (rope or {}).get("rope_theta") is not None:
        number(rope["rope_theta"], at("rope_parameters.rope_theta"), lo=0, lo_open=True, error=error)
    layers = hf.get("attention_layers")
    if layers is not None and not (isinstance(layers, list) and all(isinstance(x, str) for x in layers)):
        raise error(f"{at('attention_layers')} must be a list of strings")
    return hf


def config_key(field: dataclasses.Field) -> str:
    """The config.json name of a family config's field (``hf_field(key=...)``: OPT's ``ffn_dim`` is the field
    ``intermediate_size``), else the field's own name: what an error must name for the user to find it."""
    spec = field.metadata.get("hf")
    return getattr(spec, "key", "") or field.name


def check_config(cfg, source: str, *, error=InputError):
    """A family config object (frozen dataclass) after ``from_hf``: each field has its annotated type (int, float,
    bool, str, Optional[...]) with sizes >= 1, and the head layout divides (hidden_size by heads, heads by kv heads)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v, hint = getattr(cfg, f.name), hints.get(f.name)
        where = f"{source}: config field {config_key(f)!r}"
        args = typing.get_args(hint)
        if v is None and type(None) in args:
            continue
        if f.name.endswith("_token_id") and isinstance(v, (list, tuple)):  # HF allows a list (several eos ids)
            for i, t in enumerate(v):
                integer(t, f"{where}[{i}]", lo=0, hi=INT32_MAX, error=error)
            continue
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        if base is bool:
            boolean(v, where, error=error)
        elif base is int:
            lo = 0 if f.name.endswith("_id") else 1
            integer(v, where, lo=lo, hi=INT32_MAX, error=error)
        elif base is float:
            number(v, where, error=error)
        elif base is str:
            text(v, where, error=error)
    get = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)
    d, h, kv = (
        get("hidden_size", "n_embd"),
        get("num_attention_heads", "n_head", "num_heads"),
        get("num_key_value_heads"),
    )
    head_dim_is_field = any(f.name == "head_dim" for f in dataclasses.fields(cfg))
    if d is not None and h and d % h and not head_dim_is_field:  # head_dim = hidden_size // heads
        raise error(f"{source}: hidden_size {d} is not divisible by num_attention_heads {h}")
    if head_dim_is_field and getattr(cfg, "head_dim") is not None:
        integer(
            cfg.head_dim, f"{source}: head_dim (hidden_size // num_attention_heads unless given)", lo=1, error=error
        )
    if kv and h and h % kv:
        raise error(f"{source}: num_attention_heads {h} is not divisible by num_key_value_heads {kv}")
    return cfg


# ============================================================================================== safetensors
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                           "BOOL": 1}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def safetensors_header(path, *, error=InputError, file_size: Optional[int] = None,
                       head: Optional[bytes] = None) -> tuple[dict, int]:
    """(tensors, data_start) of a .safetensors file, every entry checked before anything is allocated or mapped:
    the 8-byte length is at most the file size and 100 MiB; the header is a UTF-8 JSON object; each tensor entry
    is ``{"dtype": known code, "shape": [ints >= 0], "data_offsets": [begin, end]}`` with
    ``end - begin == prod(shape) * itemsize`` and ``end`` inside the file. ``tensors``: name -> (dtype code,
    shape tuple, (begin, end)) relative to ``data_start``; ``__metadata__`` is checked (an object) and dropped.

    ``head``/``file_size`` let a caller (the fuzz test) check bytes without a file."""
    where = str(path)
    if head is None:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            raw = f.read(n) if 0 <= n <= min(MAX_HEADER_BYTES, file_size - 8) else b""
    else:
        prefix = head[:8]
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        raw = head[8:8 + n] if n >= 0 else b""
        file_size = len(head) if file_size is None else file_size
    if n < 0:
        raise error(f"{where}: not a safetensors file ({file_size} bytes, shorter than the 8-byte header length)")
    if n > file_size - 8 or n > MAX_HEADER_BYTES:
        raise error(f"{where}: not a valid safetensors file (header length {n} exceeds the file size {file_size} or "
                    f"the 100 MiB limit)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{where}: not a valid safetensors file (header is not UTF-8 JSON: {str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise error(f"{where}: not a valid safetensors file (header is {_kind(header)}, not an object)")
    data_start, data_size = 8 + n, file_size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise error(f"{where}: __metadata__ must be an object, got {_kind(info)}")
            continue
        at = f"{where}: tensor {name[:80]!r}"
        if not isinstance(info, dict):
            raise error(f"{at}: entry must be an object, got {_kind(info)}")
        dtype = info.get("dtype")
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise error(f"{at}: unsupported dtype {str(dtype)[:40]!r}; supported: {', '.join(SAFETENSORS_DTYPE_BYTES)}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list):
            raise error(f"{at}: 'shape' must be a list of integers, got {_kind(shape)}")
        shape = tuple(integer(s, f"{at}: shape[{i}]", lo=0, error=error) for i, s in enumerate(shape))
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise error(f"{at}: 'data_offsets' must be [begin, end], got {str(offsets)[:60]}")
        lo, hi = (integer(o, f"{at}: data_offsets[{i}]", lo=0, error=error) for i, o in enumerate(offsets))
        if lo > hi:
            raise error(f"{at}: data_offsets [{lo}, {hi}] begin after they end")
        if hi > data_size:
            raise error(f"{at}: data_offsets [{lo}, {hi}] lie outside the {data_size} data bytes of the file")
        want = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        if hi - lo != want:
            raise error(f"{at}: data_offsets [{lo}, {hi}] hold {hi - lo} bytes, shape {list(shape)} of {dtype} "
                        f"needs {want}")
        out[name] = (dtype, shape, (lo, hi))
    return out, data_start


def nonempty(items: list, what: str, *, error=InputError) -> list:
    if not items:
        raise error(f"{what} is empty")
    return items


__all__ = ["InputError", "integer", "number", "boolean", "text", "token_ids", "Range", "arg_int", "arg_float",
           "OneLineParser", "input_file", "input_dir", "output_file", "output_dir", "check_hf_config",
           "check_config", "safetensors_header", "nonempty", "INT32_MAX"]
