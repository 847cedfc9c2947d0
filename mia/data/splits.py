"""Split files: a JSONL header line describing how the split was drawn, then one example per line.

Format (see docs/formats.md): header ``{"type": "header", "format": "mia-split/1", "source", "params", "counts",
"partitions"}``; examples ``{"id", "label", "partition", "tokens" | "text", "step", "batch_pos", "index"}``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable, Optional

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


def write_split(path, header: dict, examples: Iterable[dict]) -> Path:
    """Write atomically (tmp file + rename) so an interrupted run never leaves a half split."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"type": "header", "format": FORMAT, **{k: v for k, v in header.items() if k not in ("type", "format")}}
    from ..atomic import atomic_write

    with atomic_write(path) as f:
        f.write(json.dumps(header) + "\n")
        for e in examples:
            e = dict(e)
            e.pop("_line", None)  # added by read_split
            if isinstance(e.get("tokens"), np.ndarray):
                e["tokens"] = e["tokens"].tolist()
            e.setdefault("partition", "eval")
            f.write(json.dumps(e) + "\n")
    return path


def read_split(path, compact_tokens: bool = False) -> Split:
    """Read a split file; a file without a header line is read as plain examples (header = {}).

    ``compact_tokens=True`` stores each ``tokens`` list as an int64 numpy array while reading (about 5x less
    memory than Python lists for 2049-token rows)."""
    path = Path(path)
    if not path.exists():
        raise SplitError(f"split file not found: {path}")
    header: Optional[dict] = None
    examples = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SplitError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise SplitError(f"{path}:{lineno}: expected a JSON object")
            if obj.get("type") == "header":
                if lineno != 1 and header is None and examples:
                    raise SplitError(f"{path}:{lineno}: header must be the first line")
                header = obj
                continue
            obj.setdefault("partition", "eval")
            obj["_line"] = lineno
            if compact_tokens and isinstance(obj.get("tokens"), list):
                try:
                    obj["tokens"] = np.asarray(obj["tokens"], dtype=np.int64)
                except (TypeError, ValueError, OverflowError):
                    pass  # left as a list: check_split reports it
            examples.append(obj)
    return Split(header or {}, examples)


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
    path = Path(rec.get("path", ""))
    if not path.exists():
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


def assign_partitions(examples: list, partitions, seed: int) -> list:
    """Assign each example a partition, in place: per class (label), a seeded shuffle, then consecutive blocks
    of the requested sizes in the order the partitions are named. Counts must add up to each class's size
    unless one partition is ``rest``."""
    import numpy as np

    partitions = parse_partitions(partitions)
    if not partitions:
        return examples
    by_label: dict = {}
    for i, e in enumerate(examples):
        by_label.setdefault(e.get("label"), []).append(i)
    rng = np.random.default_rng([int(seed), 0x9A27])  # independent of the draw's stream
    for label in sorted(by_label, key=lambda x: (x is None, x)):
        idx = by_label[label]
        fixed = sum(v for v in partitions.values() if v != "rest")
        has_rest = any(v == "rest" for v in partitions.values())
        what = {1: "members", 0: "non-members"}.get(label, f"label {label}")
        if fixed > len(idx) or (not has_rest and fixed != len(idx)):
            raise SplitError(f"partitions {_fmt_parts(partitions)} need {fixed} per class but {len(idx)} {what} were drawn")
        order = rng.permutation(len(idx))
        pos = 0
        for name, count in partitions.items():
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


def assert_disjoint(eval_examples: Iterable[dict], learned_examples: Iterable[dict], what: str = "ReCaLL prefix") -> None:
    """Raise ``SplitError`` if an example that an attack learns from (``what``) is also scored: same id, or the
    same token sequence / text under another id."""
    learned = list(learned_examples)
    ids = {str(e.get("id")): e for e in learned if e.get("id") is not None}
    contents = {}
    for e in learned:
        k = _content_key(e)
        if k is not None:
            contents.setdefault(k, str(e.get("id")))
    hits = []
    for e in eval_examples:
        eid = str(e.get("id"))
        if e.get("id") is not None and eid in ids:
            hits.append(f"{eid} (same id)")
            continue
        k = _content_key(e)
        if k is not None and k in contents:
            hits.append(f"{eid} (same {k[0]} as {what} example {contents[k]})")
    if hits:
        more = f" and {len(hits) - 5} more" if len(hits) > 5 else ""
        raise SplitError(f"{len(hits)} scored example(s) also used as {what}: {', '.join(hits[:5])}{more}")


# ---------------------------------------------------------------------------------------------- checking

def check_split(path, verify_sources: bool = True, verify_hashes: bool = True) -> list:
    """Re-read a split and return a list of problems (empty = clean). Each problem names the line.

    Checks: header format; unique ids; labels 0/1; partitions known to the header; counts; per kind, the
    index/step arithmetic, that members / non-members lie in their step ranges and that every line's tokens
    equal the rows re-read from the source files named in the header (sizes and hashes too); duplicate
    rows; exact duplicate token sequences (or texts) across the two classes."""
    problems: list = []
    try:
        split = read_split(path, compact_tokens=True)
    except SplitError as e:
        return [str(e)]
    h = split.header
    if not h:
        problems.append("line 1: no header line")
    elif h.get("format") != FORMAT:
        problems.append(f"line 1: format {h.get('format')!r}, expected {FORMAT!r}")
    ex = split.examples
    seen_ids: dict = {}
    for e in ex:
        ln = e.get("_line")
        if "id" not in e or e["id"] is None:
            problems.append(f"line {ln}: no id")
        else:
            i = str(e["id"])
            if i in seen_ids:
                problems.append(f"line {ln}: id {i} already used on line {seen_ids[i]}")
            else:
                seen_ids[i] = ln
        if e.get("label") not in (0, 1):
            problems.append(f"line {ln}: label {e.get('label')!r} is not 0 or 1")
        if e.get("tokens") is None and e.get("text") is None:
            problems.append(f"line {ln}: neither tokens nor text")
        hp = h.get("partitions")
        if hp and e.get("partition", "eval") not in hp:
            problems.append(f"line {ln}: partition {e.get('partition')!r} not in the header's partitions {sorted(hp)}")
    if h.get("counts"):
        now = partition_counts(ex)["counts"]
        for k in ("members", "nonmembers"):
            if k in h["counts"] and h["counts"][k] != now[k]:
                problems.append(f"line 1: header counts {k}={h['counts'][k]} but the file has {now[k]}")
        if "partitions" in h["counts"] and h["counts"]["partitions"] != now["partitions"]:
            problems.append(f"line 1: header per-partition counts {h['counts']['partitions']} but the file has {now['partitions']}")
    # same training position twice
    pos_seen: dict = {}
    for e in ex:
        key = (e.get("index"), e.get("segment"))
        if e.get("index") is not None:
            if key in pos_seen:
                problems.append(f"line {e.get('_line')}: training position {e.get('index')} also drawn on line {pos_seen[key]}")
            else:
                pos_seen[key] = e.get("_line")
    # exact duplicates across classes
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
    kind = (h.get("source") or {}).get("kind")
    if verify_sources and kind in ("pythia", "testbed", "olmo"):  # testbed orders are Pythia-format files
        src = h["source"]
        if verify_hashes:
            recs = []
            if kind in ("pythia", "testbed"):
                recs = list(src.get("bin", [])) + [src.get("idx", {})]
            else:
                recs = [src.get("global_indices", {})] + list(src.get("data_paths", []))
            for r in recs:
                msg = verify_file_record(r)
                if msg:
                    problems.append(f"line 1: {msg}")
        if kind in ("pythia", "testbed"):
            from . import pythia
            pythia.verify_examples(h, ex, problems)
        else:
            from . import olmo
            olmo.verify_examples(h, ex, problems)
    elif kind == "text" and verify_sources and verify_hashes:
        for r in (h.get("source") or {}).get("files", []):
            msg = verify_file_record(r)
            if msg:
                problems.append(f"line 1: {msg}")
    return problems


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
