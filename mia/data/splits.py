"""Split files: a JSONL header line describing how the split was drawn, then one example per line.

Format (see docs/formats.md): header ``{"type": "header", "format": "mia-split/1", "source", "params", "counts",
"partitions"}``; examples ``{"id", "label", "partition", "tokens" | "text", "step", "batch_pos", "index"}``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

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
    from ..atomic import atomic_write

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
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SplitError(f"{path}:{lineno}: not UTF-8 text (byte {e.start})") from None
            if not line.strip():
                continue
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


def _read(path, compact_tokens: bool, on_line=None) -> "Split":
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
            if a is not None and a.ndim == 1 and a.dtype.kind in "iu" and (a.size == 0 or a.max() <= np.iinfo(np.int64).max):
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
    (``check_split`` checks them; ``write_split`` writes new ones)."""
    split = _read(path, compact_tokens)
    split.header.pop(HEADER_HASH, None)
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
    """None if the file still matches its record, else a one-line problem."""
    if not isinstance(rec.get("path"), str) or not rec["path"]:
        return f"source record without a path: {rec!r}"[:300]
    if not (rec.get("sha256") is None or isinstance(rec["sha256"], str)):
        return f"source file {rec['path']}: sha256 {rec['sha256']!r} is not a string"[:300]
    path = Path(rec["path"])
    if not path.is_file():
        return f"source file missing: {path}"
    size = os.path.getsize(path)
    if rec.get("bytes") is not None and size != rec["bytes"]:
        return f"source file {path} is {size} bytes, header says {rec['bytes']}"
    if rec.get("sha256"):
        scope = rec.get("hash_scope", "full")
        now = file_record(path, full_limit=None if scope == "full" else -1)
        if now["hash_scope"] != scope and scope != "full":
            return f"source file {path}: unknown hash_scope {scope!r}"
        if now["sha256"] != rec["sha256"]:
            return f"source file {path}: sha256 ({scope}) differs from the header"
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

def _content_key(e: dict):
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


# ---------------------------------------------------------------------------------------------- checking

@dataclasses.dataclass
class SplitCheck:
    """What ``verify_split`` found: ``problems`` (each names a line; empty = nothing wrong found) and
    ``not_verified`` (one line per verification the file or the options did not allow)."""
    problems: list
    not_verified: list


_HEADER_OBJECTS = ("source", "params", "counts", "partitions")


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _row_problems(ex: list, h: dict, problems: list) -> None:
    """Per-row field checks; fields of the wrong type are replaced by their repr so later checks can run."""
    hp = h.get("partitions") if isinstance(h.get("partitions"), dict) else None
    seen_ids: dict = {}
    for e in ex:
        ln = e.get("_line")
        if "id" not in e or e["id"] is None:
            problems.append(f"line {ln}: no id")
        elif not isinstance(e["id"], (str, int)) or isinstance(e["id"], bool):
            problems.append(f"line {ln}: id {e['id']!r} is not a string or integer")
        else:
            i = str(e["id"])
            if i in seen_ids:
                problems.append(f"line {ln}: id {i} already used on line {seen_ids[i]}")
            else:
                seen_ids[i] = ln
        if isinstance(e.get("label"), bool) or e.get("label") not in (0, 1):
            problems.append(f"line {ln}: label {e.get('label')!r} is not 0 or 1")
            e["label"] = repr(e.get("label"))
        if not isinstance(e.get("partition"), str):
            problems.append(f"line {ln}: partition {e.get('partition')!r} is not a string")
            e["partition"] = repr(e.get("partition"))
        if e.get("tokens") is None and e.get("text") is None:
            problems.append(f"line {ln}: neither tokens nor text")
        if e.get("text") is not None and not isinstance(e["text"], str):
            problems.append(f"line {ln}: text is {type(e['text']).__name__}, not a string")
        toks = e.get("tokens")
        if toks is not None and not isinstance(toks, np.ndarray):
            problems.append(f"line {ln}: tokens must be a list of integer ids")
        for k in ("index", "step", "batch_pos", "segment", "offset", "instance"):
            if not _scalar(e.get(k)):
                problems.append(f"line {ln}: {k} {e[k]!r} is not a number")
                e[k] = repr(e[k])
        if hp is not None and e["partition"] not in hp:
            problems.append(f"line {ln}: partition {e['partition']!r} not in the header's partitions {sorted(hp)}")


def _header_problems(h: dict, ex: list, problems: list) -> None:
    """Header format and field types; header counts and partitions against the rows."""
    if not h:
        problems.append("line 1: no header line")
        return
    if h.get("format") != FORMAT:
        problems.append(f"line 1: format {h.get('format')!r}, expected {FORMAT!r}")
    for k in _HEADER_OBJECTS:
        if k in h and not isinstance(h[k], dict):
            problems.append(f"line 1: header field {k!r} is {type(h[k]).__name__}, expected an object")
            h[k] = {}
    now = partition_counts(ex)
    counts = h.get("counts")
    if counts:
        for k in ("members", "nonmembers"):
            if k in counts and counts[k] != now["counts"][k]:
                problems.append(f"line 1: header counts {k}={counts[k]!r} but the file has {now['counts'][k]}")
        if "partitions" in counts and counts["partitions"] != now["counts"]["partitions"]:
            problems.append(f"line 1: header per-partition counts {counts['partitions']} but the file has "
                            f"{now['counts']['partitions']}")
    hp = h.get("partitions")
    if hp and all(isinstance(v, dict) for v in hp.values()) and hp != now["partitions"]:
        problems.append(f"line 1: header partitions {hp} but the file has {now['partitions']}")


def _content_problems(ex: list, problems: list) -> None:
    """The same training position twice; identical content across classes or across partitions."""
    pos_seen: dict = {}
    for e in ex:
        key = (e.get("index"), e.get("segment"))
        if e.get("index") is not None:
            if key in pos_seen:
                problems.append(f"line {e.get('_line')}: training position {e.get('index')} also drawn on line {pos_seen[key]}")
            else:
                pos_seen[key] = e.get("_line")
    by_content: dict = {}
    for e in ex:
        k = _content_key(e)
        if k is not None and e.get("label") in (0, 1):
            by_content.setdefault(k, {}).setdefault(e["label"], []).append(e.get("_line"))
    for k, d in by_content.items():
        if 0 in d and 1 in d:
            problems.append(f"line {d[0][0]}: non-member has the same {k[0]} as member on line {d[1][0]}"
                            + (f" ({len(d[0]) + len(d[1]) - 2} more lines alike)" if len(d[0]) + len(d[1]) > 2 else ""))
    # the same content in two partitions (an attack learning from one would see a scored example)
    by_part: dict = {}
    for e in ex:
        k = _content_key(e)
        if k is not None:
            first = by_part.setdefault(k, e)
            if first.get("partition", "eval") != e.get("partition", "eval"):
                problems.append(f"line {e.get('_line')}: same {k[0]} as line {first.get('_line')} but in partition "
                                f"{e.get('partition', 'eval')!r} vs {first.get('partition', 'eval')!r}")


def _source_records(kind: str, src: dict) -> list:
    if kind in ("pythia", "testbed"):
        recs = list(src.get("bin") or []) + [src.get("idx")]
    elif kind == "olmo":
        recs = [src.get("global_indices")] + list(src.get("data_paths") or [])
    else:
        recs = list(src.get("files") or [])
    return recs


def verify_split(path, verify_sources: bool = True, verify_hashes: bool = True,
                 vocab_size: Optional[int] = None) -> SplitCheck:
    """Re-read a split and verify everything it claims (docs/splits.md#what-mia-split-check-verifies).

    * rows: unique ids, labels 0/1, partitions known to the header, field types; each row against the
      ``row_sha256`` written with it (id, label, partition, text or tokens: an edit after the draw);
    * header: format, counts and per-partition counts against the rows;
    * content: the same training position twice, the same tokens / text in both classes or in two partitions;
    * sources (``kind`` pythia / testbed / olmo / text): file sizes and hashes; for training orders the header's
      parameters against each other and the data (step ranges, checkpoint, rows, dtype), every row's position,
      label range and tokens re-read from the data, the drawn positions re-drawn from the seed, token ids
      non-negative and (with ``vocab_size`` or the header's) within the vocabulary.

    Never raises on a bad file: an unreadable one is one problem."""
    problems: list = []
    not_verified: list = []
    hash_missing: list = []

    def check_hash(ln, obj, line):
        if obj.get("type") == "header":
            if obj.get(HEADER_HASH) is None:
                not_verified.append(f"header: no {HEADER_HASH} (written before header hashes): fields that follow "
                                    "from no other field (seed, source notes, text-split parameters) are not "
                                    "checked against an edit")
            elif not hash_matches(line, obj, HEADER_HASH):
                problems.append(f"line {ln}: header differs from its {HEADER_HASH} (edited after the split was "
                                "written)")
        elif obj.get(ROW_HASH) is None:
            hash_missing.append(ln)
        elif not hash_matches(line, obj, ROW_HASH):
            problems.append(f"line {ln}: row differs from its {ROW_HASH} (id, label, partition, text or tokens "
                            "edited after the split was written)")

    try:
        split = _read(path, compact_tokens=True, on_line=check_hash)
    except SplitError as e:
        return SplitCheck([str(e)], [])
    h, ex = split.header, split.examples
    if hash_missing and len(hash_missing) == len(ex):
        not_verified.append(f"rows: no {ROW_HASH} (written before row hashes): edits of ids, labels, partitions and "
                            "texts are not detectable from the file itself")
    else:
        problems.extend(f"line {ln}: no {ROW_HASH} though the other rows have one (a row added by hand?)"
                        for ln in hash_missing)
    _row_problems(ex, h, problems)
    _header_problems(h, ex, problems)
    _content_problems(ex, problems)
    src = h.get("source") if isinstance(h.get("source"), dict) else {}
    kind = src.get("kind")
    if not verify_sources:
        not_verified.append("sources: not re-read (verify_sources=False)")
        return SplitCheck(problems, not_verified)
    if kind in ("pythia", "testbed", "olmo", "text"):
        recs = _source_records(kind, src)
        if not verify_hashes:
            not_verified.append("sources: file hashes not checked (--no-hash)")
        else:
            for r in recs:
                msg = verify_file_record(r) if isinstance(r, dict) else f"source record {r!r} is not an object"
                if msg:
                    problems.append(f"line 1: {msg}")
            if kind == "text" and not recs:
                not_verified.append("sources: the header names no source files")
    if kind in ("pythia", "testbed"):  # testbed orders are Pythia-format files
        from . import pythia
        pythia.verify_examples(h, ex, problems, not_verified, vocab_size)
    elif kind == "olmo":
        from . import olmo
        olmo.verify_examples(h, ex, problems, not_verified, vocab_size)
    elif kind != "text":
        not_verified.append(f"sources: source kind {kind!r} is not re-readable: rows are checked only against "
                            "the header and their row hashes")
    return SplitCheck(problems, not_verified)


def check_split(path, verify_sources: bool = True, verify_hashes: bool = True,
                vocab_size: Optional[int] = None) -> list:
    """The problems ``verify_split`` finds (empty = nothing wrong found; see ``verify_split`` for what could not
    be verified)."""
    return verify_split(path, verify_sources, verify_hashes, vocab_size).problems


def position_problems(e: dict, params: dict, batch_size: int, total: int, unit: str, past: str) -> tuple[list, bool]:
    """Checks of one example's place in a training order: ``index == step * B + batch_pos``, the label's step range
    (``params["member_steps"]`` / ``["nonmember_steps"]``), and ``index < total``.

    ``unit`` names a position ("row", "position"); ``past`` ends the message for one past the end.
    Returns (problems, readable): ``readable`` is False when the content at ``index`` cannot be looked up.
    """
    ln = e.get("_line", "?")
    index, step, pos = e.get("index"), e.get("step"), e.get("batch_pos")
    if not all(isinstance(v, int) for v in (index, step, pos)):
        return [f"line {ln}: index/step/batch_pos must be integers"], False
    out = []
    if index != step * batch_size + pos or not 0 <= pos < batch_size:
        out.append(f"line {ln}: index {index} != step {step} * {batch_size} + batch_pos {pos}")
    label = e.get("label")
    if label in (0, 1):
        name = "member" if label == 1 else "non-member"
        lo, hi = tuple(params.get("member_steps" if label == 1 else "nonmember_steps", (0, 0)))
        if not lo <= index // batch_size < hi:
            out.append(f"line {ln}: {name} {unit} {index} is at step {index // batch_size}, outside the "
                       f"{name} steps [{lo}, {hi})")
    if not 0 <= index < total:
        out.append(f"line {ln}: {unit} {index} is past the {past}")
        return out, False
    return out, True


# -------------------------------------------------------------------- helpers for the order verifiers

def int_fields(obj: dict, names: Sequence[str], where: str, problems: list) -> Optional[dict]:
    """``{name: int}`` for ``names`` of ``obj`` (a header object), or None after one problem per bad field."""
    out, ok = {}, True
    for n in names:
        v = obj.get(n)
        if not isinstance(v, int) or isinstance(v, bool):
            problems.append(f"line 1: header {where}.{n} is {v!r}, expected an integer")
            ok = False
        else:
            out[n] = v
    return out if ok else None


def derived_problems(params: dict, expected: dict, problems: list, why: str) -> bool:
    """Compare header ``params`` fields with the values ``expected`` from the header's own step parameters
    (``why`` names them); a missing field is a problem too. True when all agree."""
    ok = True
    for k, want in expected.items():
        have = params.get(k)
        if have != want:
            problems.append(f"line 1: header params.{k} is {have!r} but {why} give {want!r}")
            ok = False
    return ok


def seed_ok(seed, problems: list) -> bool:
    """True for a seed ``numpy.random.default_rng`` takes as the draw wrote it (an int or a list of ints)."""
    if isinstance(seed, bool) or not (isinstance(seed, int) or (isinstance(seed, list) and seed and all(
            isinstance(x, int) and not isinstance(x, bool) for x in seed))):
        problems.append(f"line 1: header params.seed is {seed!r}, expected an integer")
        return False
    return True


def redraw_problems(examples: list, drawn: dict, problems: list, what: str) -> None:
    """Rows against a re-draw from the header's parameters. ``drawn``: ``{label: collection of positions}``
    (``index`` for rows, ``(index, segment)`` keys with a segment); ``what`` describes the draw."""
    names = {1: "member", 0: "non-member"}
    present: dict = {0: set(), 1: set()}
    for e in examples:
        label = e.get("label")
        if label not in (0, 1):
            continue
        key = e.get("index") if e.get("segment") is None else (e.get("index"), e.get("segment"))
        present[label].add(key)
        if key not in drawn[label]:
            problems.append(f"line {e.get('_line')}: {names[label]} position {key} is not one the header's draw "
                            f"gives ({what})")
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
    v = params.get("vocab_size")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if v is not None:
        problems.append(f"line 1: header params.vocab_size is {v!r}, expected a positive integer")
        return None
    not_verified.append("tokens: ids not checked against a vocabulary (the header records no vocab_size; "
                        "give --model DIR or --vocab-size N)")
    return None
