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
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for e in examples:
            e = dict(e)
            e.setdefault("partition", "eval")
            f.write(json.dumps(e) + "\n")
    os.replace(tmp, path)
    return path


def read_split(path) -> Split:
    """Read a split file; a file without a header line is read as plain examples (header = {})."""
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
            examples.append(obj)
    return Split(header or {}, examples)
