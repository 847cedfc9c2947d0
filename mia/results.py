"""The result of a scoring run (``ScoreRun``) and the scores file: its one writer and its reader.

Scores file (``docs/formats.md``, "Scores file"): JSONL, one line per example of the scored partition, in input
order: ``{"id", "label", "n_tokens", "truncated", **meta, "scores": {attack label: float | null}}``; a line that
``skip_invalid`` set aside also has ``"invalid": reason`` and ``"scores": null``. A non-finite score is written as
null. Every score: higher = more likely member.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from .atomic import atomic_write
from .metrics import metric_rows
from .report import metrics_table


class MetricsTable(list):
    """``mia.metrics.metric_rows`` of a run: a list of row dicts that prints as a table."""

    def __str__(self) -> str:
        return metrics_table(self)

    def _repr_markdown_(self) -> str:  # notebooks
        return "```\n" + metrics_table(self) + "\n```"


@dataclasses.dataclass
class ScoreRun:
    """Scores of one model on the evaluated examples (``mia.score``).

    ``examples``  the evaluated examples (``mia.data.examples.Example``), in input order, all valid
    ``scores``    attack label -> float64 [N] in the order of ``examples`` (NaN: no score)
    ``seconds``   attack label -> wall seconds
    ``skipped``   attack label -> one-line reason, for attacks that could not run (``on_error="skip"``)
    ``notes``     what the run has to say with its results (truncations, decodings, fallbacks)
    ``rows``      every example of the scored partition(s) in input order, including the ones set aside by
                  ``skip_invalid`` (their ``invalid`` field says why); what ``write`` writes
    ``context``   the ``AttackContext`` (its token stats and memo serve further attack steps on the same examples)
    """

    examples: list
    scores: dict
    seconds: dict = dataclasses.field(default_factory=dict)
    skipped: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    rows: Optional[list] = None
    context: Any = None

    @property
    def ids(self) -> list:
        return [e.id for e in self.examples]

    @property
    def labels(self) -> np.ndarray:
        """[N] int: 1 member, 0 non-member, -1 unlabelled."""
        return np.array([-1 if e.label is None else e.label for e in self.examples], int)

    @property
    def labelled(self) -> bool:
        """True when every evaluated example has a label and both classes occur (metrics can be computed)."""
        y = self.labels
        return bool((y >= 0).all() and len(set(y.tolist())) == 2)

    def metrics(self, n_resamples: int = 1000, seed: int = 0, *, delta: Optional[float] = None,
                alpha: float = 0.05, **extra) -> MetricsTable:
        """AUC, bootstrap SE, TPR@1%/0.1%FPR per attack on its finite scores (non-finite ones dropped and counted
        in ``n_nonfinite``). ``delta``: also ``eps_lower``, the DP epsilon that the attack rules out at (delta,
        confidence 1 - alpha) (``mia.metrics.epsilon_lower_bound``; docs/auditing.md). ``extra`` fields go into
        every row."""
        if not self.labelled:
            raise ValueError("metrics need every evaluated example labelled (0/1) and both classes present")
        return MetricsTable(metric_rows(self.scores, self.labels, self.ids, n_resamples, seed, delta=delta,
                                        alpha=alpha, **extra))

    def write(self, path, meta: Optional[Mapping[str, dict]] = None, extra_scores: Optional[dict] = None) -> Path:
        """The scores file (see the module docstring); ``meta``: id -> fields added to that example's line;
        ``extra_scores``: more label -> [N] columns over ``examples``."""
        return write_scores(path, self.rows if self.rows is not None else self.examples, self.examples,
                            {**self.scores, **(extra_scores or {})}, meta)

    def to_pandas(self):
        """A DataFrame: one row per evaluated example (id, label, one column per attack). Needs pandas."""
        import pandas as pd  # optional dependency

        return pd.DataFrame(
            {"id": self.ids, "label": self.labels, **{k: np.asarray(v) for k, v in self.scores.items()}}
        )


def _finite_or_none(x) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


def write_scores(path, rows: list, evaluated: list, scores: Mapping[str, np.ndarray],
                 meta: Optional[Mapping[str, dict]] = None) -> Path:
    """Write the scores file: one line per example of ``rows`` (input order); ``scores`` are over ``evaluated``
    (the valid ones, in the same order); examples with ``invalid`` set get null scores and their reason."""
    row_of = {id(e): i for i, e in enumerate(evaluated)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        for e in rows:
            line = {"id": e.id, "label": e.label, "n_tokens": e.n_tokens, "truncated": e.truncated,
                    **(meta or {}).get(e.id, {})}
            if getattr(e, "invalid", None) is not None:
                line["invalid"] = e.invalid
                line["scores"] = None
            else:
                r = row_of[id(e)]
                line["scores"] = {k: _finite_or_none(v[r]) for k, v in scores.items()}
            f.write(json.dumps(line) + "\n")
    return path


def read_scores(path) -> tuple[list, dict]:
    """(lines, {attack label: [N] float64, NaN for null}) of a scores file; lines set aside as invalid have NaN
    everywhere."""
    path = Path(path)
    lines = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if raw.strip():
            try:
                lines.append(json.loads(raw))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a scores line ({e})") from None
    methods = list(dict.fromkeys(k for l in lines for k in (l.get("scores") or {})))
    scores = {m: np.array([np.nan if (l.get("scores") or {}).get(m) is None else l["scores"][m] for l in lines],
                          np.float64) for m in methods}
    return lines, scores
