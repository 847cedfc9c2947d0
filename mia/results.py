"""The result of a scoring run (``ScoreRun``) and the scores file: its one writer and its reader.

Scores file (``docs/formats.md``, "Scores file"): JSONL, one line per example of the scored partition, in input
order: ``{"id", "label", "n_tokens", "truncated", **meta, "scores": {attack label: float | null}}``; a line that
``skip_invalid`` set aside also has ``"invalid": reason`` and ``"scores": null``. A non-finite score is written as
null. Every score: higher = more likely member.
"""
from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np

from .files.atomic import atomic_write
from .metrics import auc, metric_rows, paired_bootstrap_test, tpr_at_fpr
from .report import draw_roc, metrics_table


class MetricsTable(list):
    """``mia.metrics.metric_rows`` of a run: a list of row dicts that prints as a table."""

    def __str__(self) -> str:
        return metrics_table(self)

    def _repr_markdown_(self) -> str:  # notebooks
        return "```\n" + metrics_table(self) + "\n```"


OVERVIEW_RESAMPLES = 200  # bootstrap resamples of the AUC SE that ``repr(run)`` shows (``run.metrics()``: 1,000)
OVERVIEW_LINES = 40  # what ``repr(run)`` prints at most


@dataclasses.dataclass(repr=False)
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

    In a notebook, ``run`` shows one line (examples, members / non-members, attacks, skipped) and the metrics table
    (``OVERVIEW_RESAMPLES`` bootstrap resamples for the SE; without labels, a summary of each attack's scores), at most
    ``OVERVIEW_LINES`` lines; never the arrays. ``plot_roc`` draws the ROC curves, ``compare`` tests two attacks
    (or two runs) against each other, ``metrics`` gives the full table.
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
        return why_no_metrics(self.labels) is None

    def why_no_metrics(self) -> Optional[str]:
        """None when metrics can be computed (``labelled``), else one line saying why not, such as "the labels are
        all 1 (members); AUC and TPR need both classes (members and non-members)" (``no_metrics_reason``)."""
        return no_metrics_reason(self.labels)

    def metrics(self, n_resamples: int = 1000, seed: int = 0, *, delta: Optional[float] = None,
                alpha: float = 0.05, **extra) -> MetricsTable:
        """AUC, bootstrap SE, TPR@1%/0.1%FPR per attack on its finite scores (non-finite ones dropped and counted
        in ``n_nonfinite``). ``delta``: also ``eps_lower``, the DP epsilon that the attack rules out at (delta,
        confidence 1 - alpha) (``mia.metrics.epsilon_lower_bound``; docs/auditing.md). ``extra`` fields go into
        every row."""
        if not self.labelled:
            raise ValueError(f"no metrics: {self.why_no_metrics()}")
        return MetricsTable(metric_rows(self.scores, self.labels, self.ids, n_resamples, seed, delta=delta,
                                        alpha=alpha, **extra))

    # ------------------------------------------------------------------------------------------- reading a run
    def summary_line(self) -> str:
        """``ScoreRun: 300 examples (150 members, 150 non-members), 4 attacks, 1 skipped (ref)``."""
        y = self.labels
        n1, n0, nu = int((y == 1).sum()), int((y == 0).sum()), int((y < 0).sum())
        who = "unlabelled" if nu == len(y) else (
            f"{_count(n1, 'member')}, {_count(n0, 'non-member')}" + (f", {nu} unlabelled" if nu else ""))
        line = f"ScoreRun: {_count(len(y), 'example')} ({who}), {_count(len(self.scores), 'attack')}"
        invalid = sum(getattr(e, "invalid", None) is not None for e in self.rows or ())
        if invalid:
            line = line.replace(f" ({who})", f" ({who}; {invalid} more set aside as invalid)")
        if self.skipped:
            names = list(self.skipped)
            line += f", {len(names)} skipped ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
        return line

    def _overview_rows(self) -> list:
        """Metric rows (labelled: ``metric_rows`` with ``OVERVIEW_RESAMPLES``, seed 0) or score summaries (else) of
        every attack; computed once per set of scores and labels (the cache is keyed by their bytes)."""
        h = hashlib.blake2b(self.labels.tobytes(), digest_size=16)
        for k, v in self.scores.items():
            h.update(k.encode("utf-8", "replace") + b"\0" + np.asarray(v, np.float64).tobytes())
        key = h.hexdigest()
        cached = getattr(self, "_overview_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if self.labelled:
            rows = metric_rows(self.scores, self.labels, self.ids, OVERVIEW_RESAMPLES, 0)
        else:
            rows = [_score_summary(k, v) for k, v in self.scores.items()]
        self._overview_cache = (key, rows)
        return rows

    def _overview_parts(self) -> tuple[list, list]:
        """(rows shown, lines after the table): as many rows as fit in ``OVERVIEW_LINES``."""
        rows = self._overview_rows()
        after = [f"skipped {k}: {v}" for k, v in list(self.skipped.items())[:3]]
        if len(self.skipped) > 3:
            after.append(f"... {len(self.skipped) - 3} more skipped: run.skipped")
        if self.notes:
            after.append(f"{_count(len(self.notes), 'note')}: run.notes")
        if self.labelled and self.scores:
            after.append(f"AUC SE: {OVERVIEW_RESAMPLES} bootstrap resamples; run.metrics() for the full table")
        elif self.scores:
            after.append(f"no metrics ({why_no_metrics(self.labels)}): they need every example labelled 0/1 and "
                         "both classes")
        room = OVERVIEW_LINES - 1 - 2 - len(after) - 1  # the summary line, the table's head, the "more" line
        shown, used = [], 0
        for r in rows:
            used += 1 + bool(r.get("n_nonfinite") and "auc" in r)
            if used > room:
                break
            shown.append(r)
        if len(shown) < len(rows):
            after.insert(0, f"... {_count(len(rows) - len(shown), 'more attack')}: run.metrics()")
        return shown, after

    def __repr__(self) -> str:
        shown, after = self._overview_parts()
        table = (metrics_table(shown) if self.labelled else _summary_table(shown)) if self.scores else ""
        return "\n".join([self.summary_line(), *([table] if table else []), *after])

    def _repr_html_(self) -> str:
        shown, after = self._overview_parts()
        esc = html.escape
        parts = [f"<div><p><b>{esc(self.summary_line())}</b></p>"]
        if self.scores:
            head, body = (_metrics_cells(shown) if self.labelled else _summary_cells(shown))
            parts.append("<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>")
            for cells in body:  # a row of fewer cells (an attack without numbers) spans the rest with its reason
                wide = f" colspan='{len(head) - 1}'" if len(cells) < len(head) else ""
                parts.append(f"<tr><td style='text-align:left'>{esc(cells[0])}</td>"
                             + "".join(f"<td{wide}>{esc(c)}</td>" for c in cells[1:]) + "</tr>")
            parts.append("</tbody></table>")
        parts += [f"<p>{esc(line)}</p>" for line in after]
        return "".join(parts) + "</div>"

    def plot_roc(self, ax=None, log: bool = True, title: Optional[str] = None):
        """ROC curve of every attack (its finite scores) on the matplotlib axes ``ax`` (None: a new figure), AUC in
        the legend; ``log``: log-log axes, so that the low-FPR region shows (from half of 1 / the number of
        non-members). Returns the axes. Needs labels (``labelled``)."""
        if not self.labelled:
            raise ValueError("plot_roc needs every evaluated example labelled (0/1) and both classes present: "
                             f"{why_no_metrics(self.labels)}")
        if ax is None:
            import matplotlib.pyplot as plt  # the user's backend (a notebook's inline one), not forced

            _, ax = plt.subplots(figsize=(5, 5))
        y = self.labels
        curves = {}
        for name, s in self.scores.items():
            ok = np.isfinite(np.asarray(s, np.float64))
            if len(set(y[ok].tolist())) == 2:
                curves[name] = (np.asarray(s, np.float64)[ok], y[ok])
        return draw_roc(ax, curves, log=log, title=title)

    def compare(self, other: Union["ScoreRun", str], attack: Optional[str] = None, *,
                metric: Union[str, float] = "auc", n_resamples: int = 1000, seed: int = 0,
                alternative: str = "two-sided") -> "Comparison":
        """Paired bootstrap tests (``mia.metrics.paired_bootstrap_test``; delta = attack - against, each resample
        shared by both), one row per pair, on the examples where both scores are finite:

            run.compare("loss")              every other attack of this run against its ``loss``
            run.compare("loss", "minkpp")    ``minkpp`` against ``loss``, on this run
            run_b.compare(run_a)             each attack both runs have, run_b's against run_a's
            run_b.compare(run_a, "loss")     ``loss`` only

        Two runs must hold the same examples (ids and labels, in the same order): a paired test compares scores of
        the same examples. ``metric``: "auc" or an FPR such as 0.01 (TPR at that FPR); ``alternative``:
        "two-sided", "greater" (attack better) or "less". Several rows are several tests: see
        ``mia.metrics.bonferroni_significant``."""
        if not self.labelled:
            raise ValueError("compare needs every evaluated example labelled (0/1) and both classes present: "
                             f"{why_no_metrics(self.labels)}")
        if isinstance(other, ScoreRun):
            _check_same_examples(self, other)
            common = [k for k in self.scores if k in other.scores]
            if attack is not None:
                for run, where in ((self, "this run"), (other, "the other run")):
                    if attack not in run.scores:
                        raise ValueError(f"compare: no attack {attack!r} in {where} (attacks: "
                                         f"{', '.join(run.scores) or 'none'})")
                common = [attack]
            if not common:
                raise ValueError(f"compare: the runs have no attack in common (this run: {', '.join(self.scores)}; "
                                 f"the other: {', '.join(other.scores)})")
            pairs = [(k, self.scores[k], f"{k} (other run)", other.scores[k]) for k in common]
        elif isinstance(other, str):
            for name in (other, attack):
                if name is not None and name not in self.scores:
                    raise ValueError(f"compare: no attack {name!r} in this run (attacks: {', '.join(self.scores)})")
            names = [attack] if attack is not None else [k for k in self.scores if k != other]
            if not names or names == [other]:
                raise ValueError(f"compare: {other!r} needs another attack to compare with (this run has "
                                 f"{', '.join(self.scores)})")
            pairs = [(k, self.scores[k], other, self.scores[other]) for k in names]
        else:
            raise ValueError(f"compare: expected another ScoreRun or an attack label, got {type(other).__name__}")
        y = self.labels
        rows = [_paired_row(a, sa, b, sb, y, metric=metric, n_resamples=n_resamples, seed=seed,
                            alternative=alternative) for a, sa, b, sb in pairs]
        return Comparison(rows)

    def write(self, path, meta: Optional[Mapping[str, dict]] = None, extra_scores: Optional[dict] = None) -> Path:
        """The scores file (see the module docstring); ``meta``: id -> fields added to that example's line;
        ``extra_scores``: more label -> [N] columns over ``examples``."""
        return write_scores(path, self.rows if self.rows is not None else self.examples, self.examples,
                            {**self.scores, **(extra_scores or {})}, meta)

    def to_pandas(self):
        """A DataFrame: one row per evaluated example (id, label, one column per attack). Needs pandas."""
        try:
            import pandas as pd  # optional dependency
        except ImportError:
            raise ImportError("ScoreRun.to_pandas needs the pandas package (pip install pandas)") from None

        return pd.DataFrame(
            {"id": self.ids, "label": self.labels, **{k: np.asarray(v) for k, v in self.scores.items()}}
        )


# ----------------------------------------------------------------------------------------------- overview helpers
def why_no_metrics(labels) -> Optional[str]:
    """None when ``labels`` ([N]: 1 member, 0 non-member, -1 unlabelled) allow AUC and TPR (every example labelled,
    both classes present); else what is missing, in a few words: "the labels are all 1 (members)", "no example is
    labelled", "3 of 40 examples are unlabelled"."""
    y = np.asarray(labels).reshape(-1)
    n_unlabelled = int((y < 0).sum())
    if y.size == 0:
        return "no examples"
    if n_unlabelled == y.size:
        return "no example is labelled"
    if n_unlabelled:
        return f"{n_unlabelled} of {y.size} examples are unlabelled"
    if (y == 1).all():
        return "the labels are all 1 (members)"
    if (y == 0).all():
        return "the labels are all 0 (non-members)"
    return None


def no_metrics_reason(labels) -> Optional[str]:
    """``why_no_metrics`` with what the metrics need, one line for ``mia score``'s note and ``ScoreRun.metrics``'
    error: "the labels are all 1 (members); AUC and TPR need both classes (members and non-members)"."""
    why = why_no_metrics(labels)
    if why is None:
        return None
    if why.startswith("the labels are all"):
        return f"{why}; AUC and TPR need both classes (members and non-members)"
    return f"{why}; AUC and TPR need every example labelled (0/1) and both classes (members and non-members)"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _score_summary(name: str, scores) -> dict:
    """{"method", "n_finite", "mean", "std", "min", "median", "max"} of an attack's finite scores (unlabelled runs)."""
    s = np.asarray(scores, np.float64)
    s = s[np.isfinite(s)]
    row = {"method": name, "n_finite": int(len(s)), "n_nonfinite": int(len(scores) - len(s))}
    if len(s):
        row.update(mean=float(s.mean()), std=float(s.std()), min=float(s.min()), median=float(np.median(s)),
                   max=float(s.max()))
    return row


_SUMMARY_HEAD = ("attack", "finite", "mean", "std", "min", "median", "max")


def _summary_cells(rows) -> tuple[tuple, list]:
    body = []
    for r in rows:
        if "mean" not in r:
            body.append([str(r["method"]), f"no finite score ({r['n_nonfinite']} non-finite)"])
        else:
            body.append([str(r["method"]), str(r["n_finite"])]
                        + [f"{r[k]:.4f}" for k in ("mean", "std", "min", "median", "max")])
    return _SUMMARY_HEAD, body


def _summary_table(rows) -> str:
    """Score summaries as a plain-text table (the overview of an unlabelled run)."""
    head, body = _summary_cells(rows)
    fmt = lambda cells: f"{cells[0]:<28}" + "".join(f" {c:>9}" for c in cells[1:])  # noqa: E731
    lines = [fmt(head), "-" * len(fmt(head))]
    lines += [fmt(c) if len(c) == len(head) else f"{c[0]:<28} {c[1]}" for c in body]
    return "\n".join(lines)


_METRICS_HEAD = ("attack", "AUC", "AUC SE", "TPR@1%FPR", "TPR@0.1%FPR")


def _metrics_cells(rows) -> tuple[tuple, list]:
    """The cells of ``mia.report.metrics_table`` (for HTML): a method without metrics gets its reason."""
    body = []
    for r in rows:
        name = str(r["method"])
        if "auc" not in r:
            body.append([name, f"no metrics: {r.get('note', 'no scores')}"])
            continue
        if r.get("n_nonfinite"):
            name += f" ({r['n_nonfinite']} non-finite score(s) dropped)"
        se = "" if r.get("auc_se") is None else f"{r['auc_se']:.4f}"
        body.append([name, f"{r['auc']:.4f}", se, f"{r['tpr_at_1pct_fpr']:.4f}", f"{r['tpr_at_0.1pct_fpr']:.4f}"])
    return _METRICS_HEAD, body


# ----------------------------------------------------------------------------------------------- comparisons
def _check_same_examples(a: ScoreRun, b: ScoreRun) -> None:
    """Two runs hold the same examples (ids and labels, same order), or one ``ValueError`` says where not."""
    if len(a.examples) != len(b.examples):
        raise ValueError(f"compare: the runs hold different examples ({len(a.examples)} and {len(b.examples)}); a "
                         "paired test needs the same examples in the same order")
    for i, (ea, eb) in enumerate(zip(a.examples, b.examples)):
        if ea.id != eb.id:
            raise ValueError(f"compare: the runs hold different examples: position {i} is id {ea.id[:80]!r} here and "
                             f"{eb.id[:80]!r} in the other run; a paired test needs the same examples in the same "
                             "order")
        if ea.label != eb.label:
            raise ValueError(f"compare: example {ea.id[:80]!r} is labelled {ea.label} here and {eb.label} in the "
                             "other run")


def _metric_name(metric) -> str:
    return "AUC" if metric == "auc" else f"TPR@{float(metric) * 100:g}%FPR"


def _paired_row(a: str, sa, b: str, sb, y: np.ndarray, **test) -> dict:
    """One comparison row: ``paired_bootstrap_test`` of attack ``a`` against ``b`` on the examples where both are
    finite, with each one's metric on them."""
    sa, sb = np.asarray(sa, np.float64), np.asarray(sb, np.float64)
    ok = np.isfinite(sa) & np.isfinite(sb)
    row = {"attack": a, "against": b, "metric": test["metric"], "n": int(ok.sum()), "n_nonfinite": int((~ok).sum())}
    if len(set(y[ok].tolist())) < 2:
        return {**row, "note": "the examples where both scores are finite lack a class"}
    value = (lambda s: auc(s, y[ok])) if test["metric"] == "auc" else \
        (lambda s: tpr_at_fpr(s, y[ok], float(test["metric"])))  # noqa: E731
    r = paired_bootstrap_test(sa[ok], sb[ok], y[ok], **test)
    return {**row, "value": value(sa[ok]), "against_value": value(sb[ok]),
            **{k: r[k] for k in ("delta", "se", "ci_low", "ci_high", "p_value", "alternative", "n_resamples")}}


class Comparison(list):
    """Rows of ``ScoreRun.compare`` ({"attack", "against", "metric", "value", "against_value", "delta", "se",
    "ci_low", "ci_high", "p_value", "n", ...}) that print as a table."""

    def __str__(self) -> str:
        if not self:
            return "(no comparison)"
        m = _metric_name(self[0]["metric"])
        r0 = next((r for r in self if "delta" in r), {})
        head = (f"paired bootstrap test of {m} ({r0.get('n_resamples', '?')} resamples, "
                f"{r0.get('alternative', 'two-sided')}): delta = attack - against")
        cols = f"{'attack':<24} {'against':<24} {'attack':>8} {'against':>8} {'delta':>8} {'95% CI':>19} {'p':>7}"
        lines = [head, cols, "-" * len(cols)]
        for r in self:
            if "delta" not in r:
                lines.append(f"{r['attack']:<24} {r['against']:<24} {r['note']}")
                continue
            ci = f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]"
            lines.append(f"{r['attack']:<24} {r['against']:<24} {r['value']:8.4f} {r['against_value']:8.4f} "
                         f"{r['delta']:+8.4f} {ci:>19} {r['p_value']:7.2g}")
        dropped = max((r["n_nonfinite"] for r in self), default=0)
        if dropped:
            lines.append(f"(examples with a non-finite score in either attack left out of that row: up to {dropped})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return "<pre>" + html.escape(str(self)) + "</pre>"


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
