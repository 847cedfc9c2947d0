"""Split files: a JSONL header line describing how the split was drawn, then one example per line.

This module reads, writes and partitions them and holds the field checks every verifier shares; the checker
itself is ``mia.data.verify`` (it dispatches to the Pythia and OLMo order verifiers, which import this module).

Format (see docs/formats.md): header ``{"type": "header", "format": "mia-split/1", "source", "params", "counts",
"partitions"}``; examples ``{"id", "label", "partition", "tokens" | "text", "step", "batch_pos", "index"}``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..files.atomic import atomic_write
from ..validate import utf8_lines

FORMAT = "mia-split/1"


class SplitError(ValueError):
    pass


@dataclasses.dataclass
class Split:
    header: dict
    examples: list  # list of dicts

    def partition(self, name: str) -> list:
        return [e for e in self.examples if e.get("partition", "eval") == name]

    @property
    def partitions(self) -> list:
        return sorted({e.get("partition", "eval") for e in self.examples})


ROW_HASH = "row_sha256"
HEADER_HASH = "header_sha256"


def _row_body(e: dict) -> str:
    """The JSON text a row's hash covers: ``json.dumps`` of the row, keys in file order, without the hash."""
    return json.dumps({k: v for k, v in e.items() if k != ROW_HASH})


def row_digest(body: str) -> str:
    import hashlib

    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def write_split(path, header: dict, examples: Iterable[dict]) -> Path:
    """Write atomically (tmp file + rename) so an interrupted run never leaves a half split.

    Every example line ends with ``"row_sha256"``: the sha256 of the line's JSON without that field (every field:
    id, label, partition, text or tokens, positions), so ``check_split`` can tell a row edited after the draw; the
    header line likewise ends with ``"header_sha256"``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"type": "header", "format": FORMAT,
              **{k: v for k, v in header.items() if k not in ("type", "format", HEADER_HASH)}}

    with atomic_write(path) as f:
        body = json.dumps(header)
        f.write(f'{body[:-1]}, "{HEADER_HASH}": "{row_digest(body)}"}}\n')
        for e in examples:
            e = dict(e)
            e.pop("_line", None)  # added by read_split
            e.pop(ROW_HASH, None)  # recomputed for what is written now
            if isinstance(e.get("tokens"), np.ndarray):
                e["tokens"] = e["tokens"].tolist()
            e.setdefault("partition", "eval")
            body = _row_body(e)
            f.write(f'{body[:-1]}, "{ROW_HASH}": "{row_digest(body)}"}}\n')
    return path


def _split_lines(path: Path):
    """``(line number, object)`` of every non-blank line; one ``SplitError`` naming the line for anything that is
    not a JSON object (bad UTF-8, bad JSON, nesting too deep)."""
    if not path.exists():
        raise SplitError(f"split file not found: {path}")
    if path.is_dir():
        raise SplitError(f"{path}: is a directory, not a split file")
    for lineno, line in utf8_lines(path, SplitError):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SplitError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        except RecursionError:
            raise SplitError(f"{path}:{lineno}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise SplitError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, obj, line


def hash_matches(line: str, obj: dict, field: str) -> bool:
    """Whether ``obj[field]`` is the sha256 of the line's JSON without the field: the text before it as
    ``write_split`` wrote it (fast), or else ``json.dumps`` of the parsed object without it."""
    want = obj.get(field)
    if not isinstance(want, str):
        return False
    suffix = f', "{field}": "{want}"}}'
    text = line.rstrip()
    if text.endswith(suffix) and row_digest(text[: -len(suffix)] + "}") == want:
        return True
    return row_digest(json.dumps({k: v for k, v in obj.items() if k != field})) == want


def read_split_raw(path, compact_tokens: bool, on_line=None) -> "Split":
    """``on_line(lineno, obj, line)`` sees every line as parsed, before anything is changed."""
    path = Path(path)
    header: Optional[dict] = None
    examples = []
    for lineno, obj, line in _split_lines(path):
        if on_line is not None:
            on_line(lineno, obj, line)
        if obj.get("type") == "header":
            if header is not None or examples:
                raise SplitError(f"{path}:{lineno}: header must be the first line (and appear once)")
            header = obj
            continue
        obj.pop(ROW_HASH, None)
        obj.setdefault("partition", "eval")
        obj["_line"] = lineno
        if compact_tokens and isinstance(obj.get("tokens"), list):
            try:
                a = np.asarray(obj["tokens"])
            except (TypeError, ValueError, OverflowError):
                a = None
            if (
                a is not None
                and a.ndim == 1
                and a.dtype.kind in "iu"
                and (a.size == 0 or a.max() <= np.iinfo(np.int64).max)
            ):
                obj["tokens"] = a.astype(np.int64)
            elif a is not None and a.size == 0:
                obj["tokens"] = np.zeros(0, np.int64)
            # else: left as a list (floats, bools, nesting, huge ids): check_split reports it
        examples.append(obj)
    return Split(header or {}, examples)


def read_split(path, compact_tokens: bool = False) -> Split:
    """Read a split file; a file without a header line is read as plain examples (header = {}).

    ``compact_tokens=True`` stores each ``tokens`` list as an int64 numpy array while reading (about 5x less
    memory than Python lists for 2049-token rows). The ``row_sha256`` / ``header_sha256`` fields are dropped
    (``check_split`` checks them; ``write_split`` writes new ones). Every example's ``partition`` is a string
    (``Split.partition`` selects by it): another value is one ``SplitError`` naming the line."""
    split = read_split_raw(path, compact_tokens)
    split.header.pop(HEADER_HASH, None)
    for e in split.examples:
        if not isinstance(e["partition"], str):
            raise SplitError(f"{path}:{e['_line']}: partition {short_repr(e['partition'])} is not a string")
    return split


# ---------------------------------------------------------------------------------------------- sources

HASH_CHUNK = 1 << 20


def file_record(path, full_limit: Optional[int] = 64 << 20) -> dict:
    """``{"path", "bytes", "sha256", "hash_scope"}`` for a source file.

    Files up to ``full_limit`` bytes (``None``: no limit) are hashed fully (``hash_scope: "full"``); larger ones
    are hashed over their first and last MiB (``"head+tail:1048576"``), which is what a check re-computes."""
    import hashlib

    path = Path(path).resolve()
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if full_limit is None or size <= full_limit:
            scope = "full"
            for chunk in iter(lambda: f.read(HASH_CHUNK * 8), b""):
                h.update(chunk)
        else:
            scope = f"head+tail:{HASH_CHUNK}"
            h.update(f.read(HASH_CHUNK))
            f.seek(max(0, size - HASH_CHUNK))
            h.update(f.read(HASH_CHUNK))
    return {"path": str(path), "bytes": size, "sha256": h.hexdigest(), "hash_scope": scope}


def verify_file_record(rec: dict) -> Optional[str]:
    """None if the file still matches its record, else a one-line problem. ``rec``'s fields are of the kinds
    ``FILE_RECORD`` names (``source_file_records`` checks them)."""
    path = Path(rec["path"])
    shown = one_line(str(path), 300)
    try:
        if not path.is_file():
            return f"source file missing: {shown}"
        size = os.path.getsize(path)
        if rec.get("bytes") is not None and size != rec["bytes"]:
            return f"source file {shown} is {size} bytes, header says {rec['bytes']}"
        if rec.get("sha256"):
            scope = rec.get("hash_scope") or "full"
            now = file_record(path, full_limit=None if scope == "full" else -1)
            if now["hash_scope"] != scope and scope != "full":
                return f"source file {shown}: unknown hash_scope {short_repr(scope)}"
            if now["sha256"] != rec["sha256"]:
                return f"source file {shown}: sha256 ({one_line(scope, 40)}) differs from the header"
    except OSError as e:
        return f"source file {shown}: cannot read ({e.strerror or type(e).__name__})"
    return None


# ------------------------------------------------------------------------------------------- partitions

def parse_partitions(spec) -> dict:
    """``"train=4000,calib=500,eval=rest"`` -> ``{"train": 4000, "calib": 500, "eval": "rest"}`` (counts per class).

    At most one partition may be ``rest`` (whatever the class has left)."""
    if spec is None or spec == "" or isinstance(spec, dict):
        return dict(spec or {})
    out: dict = {}
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, val = part.partition("=")
        name, val = name.strip(), val.strip()
        if not sep or not name:
            raise SplitError(f"bad partition {part!r}: expected NAME=COUNT (e.g. train=4000,eval=1000)")
        if name in out:
            raise SplitError(f"partition {name!r} given twice")
        if val in ("rest", "*"):
            out[name] = "rest"
        else:
            try:
                n = int(val)
            except ValueError:
                raise SplitError(f"bad partition count {part!r}: expected an integer or 'rest'") from None
            if n < 0:
                raise SplitError(f"bad partition count {part!r}: negative")
            out[name] = n
    if sum(1 for v in out.values() if v == "rest") > 1:
        raise SplitError("at most one partition may be 'rest'")
    return out


def partition_total(partitions: dict) -> Optional[int]:
    """Examples per class the partitions ask for (None if one is ``rest``)."""
    partitions = parse_partitions(partitions)
    if any(v == "rest" for v in partitions.values()):
        return None
    return sum(partitions.values())


PARTITION_STREAM = 0x9A27  # the partition draw's own seed tag: independent of the row draw's stream


def assign_partitions(examples: list, partitions, seed: int, *, stream: int = PARTITION_STREAM) -> list:
    """Assign each example a partition, in place: per class (label), a seeded permutation, then consecutive
    blocks of the requested sizes in the order the partitions are named.

    ``partitions``: one spec for every class (``"train=4,eval=rest"`` or its dict), classes taken in label order
    (0, 1, then unlabelled); or a per-class plan ``{label: ((name, count), ...)}``, classes taken in the plan's
    order. One ``numpy.random.default_rng([seed, stream])`` serves the classes in that order. Counts must add up to
    each class's size unless a partition is ``rest``."""
    by_label: dict = {}
    for i, e in enumerate(examples):
        by_label.setdefault(e.get("label"), []).append(i)
    if isinstance(partitions, dict) and partitions and all(isinstance(v, (tuple, list)) for v in partitions.values()):
        plan = {label: dict(parts) for label, parts in partitions.items()}
    else:
        spec = parse_partitions(partitions)
        if not spec:
            return examples
        plan = {label: spec for label in sorted(by_label, key=lambda x: (x is None, x))}
    rng = np.random.default_rng([int(seed), int(stream)])
    for label, parts in plan.items():
        idx = by_label.get(label, [])
        fixed = sum(v for v in parts.values() if v != "rest")
        has_rest = any(v == "rest" for v in parts.values())
        what = {1: "members", 0: "non-members"}.get(label, f"label {label}")
        if fixed > len(idx) or (not has_rest and fixed != len(idx)):
            raise SplitError(f"partitions {_fmt_parts(parts)} need {fixed} per class but {len(idx)} {what} were drawn")
        order = rng.permutation(len(idx))
        pos = 0
        for name, count in parts.items():
            k = len(idx) - fixed if count == "rest" else count
            for j in order[pos: pos + k]:
                examples[idx[j]]["partition"] = name
            pos += k
    return examples


def _fmt_parts(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items())


def partition_counts(examples: list) -> dict:
    """``{"counts": {...}, "partitions": {...}}`` header fields for a list of examples."""
    parts: dict = {}
    for e in examples:
        p = parts.setdefault(e.get("partition", "eval"), {"members": 0, "nonmembers": 0})
        if e.get("label") == 1:
            p["members"] += 1
        elif e.get("label") == 0:
            p["nonmembers"] += 1
    counts = {"members": sum(1 for e in examples if e.get("label") == 1),
              "nonmembers": sum(1 for e in examples if e.get("label") == 0),
              "partitions": parts}
    return {"counts": counts, "partitions": {k: dict(v) for k, v in parts.items()}}


# ----------------------------------------------------------------------------------------- disjointness

def content_key(e: dict):
    """("tokens", digest) or ("text", digest): equal for equal token sequences / texts."""
    import hashlib

    if e.get("tokens") is not None:
        try:
            a = np.asarray(e["tokens"], dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return ("tokens", repr(e["tokens"]))
        return ("tokens", hashlib.blake2b(a.tobytes(), digest_size=16).digest())
    if e.get("text") is not None:
        return ("text", hashlib.blake2b(str(e["text"]).encode("utf-8", "surrogatepass"), digest_size=16).digest())
    return None


_INTERNED = None


def rows_to_lists(rows) -> list:
    """``[n, L]`` integer array -> list of Python lists. For (u)int8/16 data the int objects are shared from
    one table, so 20,000 2049-token rows cost ~330 MB of list slots instead of ~1.6 GB of int objects."""
    global _INTERNED
    rows = np.asarray(rows)
    if rows.dtype.kind in "iu" and rows.dtype.itemsize <= 2:
        if _INTERNED is None:
            _INTERNED = np.array(list(range(-32768, 65536)), dtype=object)
        table = _INTERNED
        return [table[r.astype(np.int64) + 32768].tolist() for r in rows]
    return [r.tolist() for r in rows]


# ------------------------------------------------------------------------------------------- field kinds

def is_int(v) -> bool:
    """An integer that is not a bool (JSON ``true`` reads as Python ``True``, an ``int``)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a header or row field must hold: ``accepts(value)``, and ``expected``, the words a problem line uses."""
    expected: str
    accepts: Callable[[Any], bool]

    def or_null(self) -> "Kind":
        return Kind(f"{self.expected} or null", lambda v: v is None or self.accepts(v))


INT = Kind("an integer", is_int)
NONNEG_INT = Kind("a non-negative integer", lambda v: is_int(v) and v >= 0)
POS_INT = Kind("a positive integer", lambda v: is_int(v) and v > 0)
STRING = Kind("a string", lambda v: isinstance(v, str))
PATH = Kind("a non-empty string", lambda v: isinstance(v, str) and v != "")
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))
OBJECTS = Kind("a list of objects", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v))
NONEMPTY_OBJECTS = Kind("a non-empty list of objects", lambda v: OBJECTS.accepts(v) and bool(v))
SEED = Kind("a non-negative integer or a non-empty list of them",
            lambda v: NONNEG_INT.accepts(v) or (isinstance(v, list) and bool(v) and all(map(NONNEG_INT.accepts, v))))


def one_line(text: str, limit: int = 400) -> str:
    """The first line of ``text`` cut to ``limit`` characters: a reader's error message or a path from a header,
    inside a problem line."""
    text = text.strip().splitlines()[0] if text.strip() else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_repr(v, limit: int = 80) -> str:
    """``repr(v)``, cut to ``limit`` characters (a problem line stays one short line whatever a file holds)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def checked_fields(obj: dict, kinds: dict, where: str, problems: list) -> Optional[dict]:
    """``{name: value}`` for the fields ``kinds`` names (``{name: Kind}``; an absent field reads as null) when every
    value is of its kind; else None, after one problem per bad field, ``f"{where}{name} is {value}, expected
    {kind}"``: ``where`` names the line and the object, e.g. ``"line 1: header params."`` or ``"line 7: "``."""
    out, ok = {}, True
    for name, kind in kinds.items():
        v = obj.get(name)
        if kind.accepts(v):
            out[name] = v
        else:
            have = short_repr(v) if name in obj else "missing"
            problems.append(f"{where}{name} is {have}, expected {kind.expected}")
            ok = False
    return out if ok else None


FILE_RECORD = {"path": PATH, "bytes": NONNEG_INT.or_null(), "sha256": STRING.or_null(),
               "hash_scope": STRING.or_null()}
"""The fields of a source file record (``file_record``) that ``verify_file_record`` reads."""

SOURCE_FILES = {"pythia": {"bin": NONEMPTY_OBJECTS, "idx": OBJECT},
                "testbed": {"bin": NONEMPTY_OBJECTS, "idx": OBJECT},  # the testbed's orders are Pythia-format files
                "olmo": {"global_indices": OBJECT, "data_paths": NONEMPTY_OBJECTS},
                "text": {"files": OBJECTS.or_null()}}
"""Per source kind, the header ``source`` fields that hold file records (one, or a list of them)."""


def source_file_records(kind: str, src: dict, problems: list) -> Optional[list]:
    """``[(field, record)]`` (``field`` as ``"bin[0]"``) of the source files a ``kind`` split's header names, every
    record's fields checked (``FILE_RECORD``); None, after one problem per bad field, when one is unusable."""
    fields = checked_fields(src, SOURCE_FILES[kind], "line 1: header source.", problems)
    if fields is None:
        return None
    named = []
    for name, v in fields.items():
        named += [(f"{name}[{i}]", r) for i, r in enumerate(v)] if isinstance(v, list) else [(name, v)] if v else []
    ok = [checked_fields(r, FILE_RECORD, f"line 1: header source.{name}.", problems) is not None for name, r in named]
    return named if all(ok) else None


def position_problems(e: dict, step_ranges: dict, batch_size: int, total: int, unit: str,
                      past: str) -> tuple[list, bool]:
    """Checks of one example's place in a training order: ``index == step * B + batch_pos``, the label's step range,
    and ``index < total``.

    ``step_ranges``: ``{1: (lo, hi), 0: (lo, hi)}``, the member / non-member steps ``[lo, hi)`` derived from the
    header's checked step parameters (never the header's own copies of them, which an edit may have broken).
    ``unit`` names a position ("row", "position"); ``past`` ends the message for one past the end. ``e`` is a row
    as ``verify_split``'s row checks left it: a position field of the wrong type was reported there (and is a
    string now), so only missing ones are reported here.
    Returns (problems, readable): ``readable`` is False when the content at ``index`` cannot be looked up.
    """
    ln = e.get("_line", "?")
    fields = {k: e.get(k) for k in ("index", "step", "batch_pos")}
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        return [f"line {ln}: no {'/'.join(missing)} (a training-order row needs index, step and batch_pos)"], False
    if not all(is_int(v) for v in fields.values()):
        return [], False  # reported by the row checks
    index, step, pos = fields["index"], fields["step"], fields["batch_pos"]
    out = []
    if index != step * batch_size + pos or not 0 <= pos < batch_size:
        out.append(f"line {ln}: index {index} != step {step} * {batch_size} + batch_pos {pos}")
    label = e.get("label")
    if label in (0, 1):
        name = "member" if label == 1 else "non-member"
        lo, hi = step_ranges[label]
        if not lo <= index // batch_size < hi:
            out.append(f"line {ln}: {name} {unit} {index} is at step {index // batch_size}, outside the "
                       f"{name} steps [{lo}, {hi})")
    if not 0 <= index < total:
        out.append(f"line {ln}: {unit} {index} is past the {past}")
        return out, False
    return out, True


# -------------------------------------------------------------------- helpers for the order verifiers

def derived_problems(params: dict, expected: dict, problems: list, why: str) -> bool:
    """Compare header ``params`` fields with the values ``expected`` from the header's own step parameters
    (``why`` names them); a missing field is a problem too. True when all agree."""
    ok = True
    for k, want in expected.items():
        have = params.get(k)
        if have != want:
            problems.append(f"line 1: header params.{k} is {short_repr(have)} but {why} give {want!r}")
            ok = False
    return ok


DROPPED_ROWS = "dropped_rows"
"""Header ``params`` field: drawn positions left out of the file after the draw, ``[{"label", "index"[,
"segment"]}]`` (an evaluated row with the same tokens as a learned-from row, ``mia.data.draw
.drop_learned_duplicates``). A re-draw from the seed counts them as drawn: they are neither missing nor extra."""

_LABEL = Kind("0 or 1", lambda v: is_int(v) and v in (0, 1))
_DROPPED_ROW = {"label": _LABEL, "index": NONNEG_INT, "segment": NONNEG_INT.or_null()}


def dropped_rows(params: dict, problems: list) -> list:
    """The well-formed entries of ``params[DROPPED_ROWS]`` (absent: none); one problem per malformed entry."""
    v = params.get(DROPPED_ROWS)
    if v is None:
        return []
    if not OBJECTS.accepts(v):
        problems.append(f"line 1: header params.{DROPPED_ROWS} is {short_repr(v)}, expected {OBJECTS.expected}")
        return []
    return [d for i, d in enumerate(v)
            if checked_fields(d, _DROPPED_ROW, f"line 1: header params.{DROPPED_ROWS}[{i}].", problems) is not None]


def draw_counts(counts: dict, examples: list, problems: list, not_verified: list, dropped: list = ()) -> Optional[dict]:
    """``{"members": n, "nonmembers": n}`` drawn, for a re-draw: the header's counts (the rows') plus the
    ``dropped`` rows of each class; or None: after a problem for a count that is not a non-negative integer, or
    with a note when the counts differ from the rows."""
    n = checked_fields(counts, {"members": NONNEG_INT, "nonmembers": NONNEG_INT}, "line 1: header counts.", problems)
    have = {k: sum(1 for e in examples if e.get("label") == v) for k, v in (("members", 1), ("nonmembers", 0))}
    if n is not None and n != have:
        not_verified.append("rows: not re-drawn from the seed (the header's counts differ from the rows)")
        return None
    if n is None:
        return None
    return {k: n[k] + sum(1 for d in dropped if d["label"] == v) for k, v in (("members", 1), ("nonmembers", 0))}


def _position_key(e: dict):
    return e.get("index") if e.get("segment") is None else (e.get("index"), e.get("segment"))


def redraw_problems(examples: list, drawn: dict, problems: list, what: str, dropped: list = ()) -> None:
    """Rows against a re-draw from the header's parameters. ``drawn``: ``{label: collection of positions}``
    (``index`` for rows, ``(index, segment)`` keys with a segment); ``what`` describes the draw; ``dropped``: the
    header's ``dropped_rows`` (drawn, left out of the file)."""
    names = {1: "member", 0: "non-member"}
    present: dict = {0: set(), 1: set()}
    for e in examples:
        label = e.get("label")
        if label not in (0, 1):
            continue
        key = _position_key(e)
        present[label].add(key)
        if key not in drawn[label]:
            problems.append(f"line {e.get('_line')}: {names[label]} position {short_repr(key)} is not one the "
                            f"header's draw gives ({what})")
    for i, d in enumerate(dropped):
        key = _position_key(d)
        if key in present[d["label"]] or key not in drawn[d["label"]]:
            problems.append(f"line 1: header params.{DROPPED_ROWS}[{i}] {names[d['label']]} position "
                            f"{short_repr(key)} is " + ("also a row of the file" if key in present[d["label"]] else
                                                        f"not one the header's draw gives ({what})"))
        present[d["label"]].add(key)
    for label in (1, 0):
        missing = [k for k in drawn[label] if k not in present[label]]
        if missing:
            problems.append(f"line 1: {len(missing)} of the {len(drawn[label])} {names[label]} positions the header's "
                            f"draw gives ({what}) are not in the file, e.g. {missing[0]}")


def token_id_problems(e: dict, vocab_size: Optional[int], dtype_note: str = "") -> list:
    """A row's token ids: negative ids always, ids >= ``vocab_size`` when it is known (a sign of a wrong
    dtype or another tokenizer's data)."""
    toks = e.get("tokens")
    if not isinstance(toks, np.ndarray) or toks.size == 0:
        return []
    ln = e.get("_line", "?")
    lo = int(toks.min())
    if lo < 0:
        j = int(np.argmax(toks < 0))
        return [f"line {ln}: token {j} is id {int(toks[j])}: negative{dtype_note}"]
    if vocab_size is not None:
        hi = int(toks.max())
        if hi >= vocab_size:
            j = int(np.argmax(toks >= vocab_size))
            return [f"line {ln}: token {j} is id {int(toks[j])}, outside the vocabulary ({vocab_size} ids): "
                    f"another tokenizer's data{dtype_note}?"]
    return []


def vocab_bound(params: dict, vocab_size: Optional[int], problems: list, not_verified: list) -> Optional[int]:
    """The vocabulary size to check ids against: the one given, else the header's ``params.vocab_size``."""
    if vocab_size is not None:
        return int(vocab_size)
    checked = checked_fields(params, {"vocab_size": POS_INT.or_null()}, "line 1: header params.", problems)
    if checked is None:
        return None
    if checked["vocab_size"] is not None:
        return checked["vocab_size"]
    not_verified.append("tokens: ids not checked against a vocabulary (the header records no vocab_size; "
                        "give --model DIR or --vocab-size N)")
    return None
