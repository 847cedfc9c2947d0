"""What every ``python -m experiments.NAME`` module shares: one small set of helpers, not copies of each other.

CLI conventions  ``experiment_parser`` (``--preset``, ``--out``, ``--seed``, ``--bootstrap``, ``--no-progress``,
                 ``--debug``; usage errors are one line), ``add_model_flags`` / ``add_olmo_flags`` / ``one_step`` (the
                 one flag vocabulary: ``--testbed``, ``--member``, ``--steps``, the OLMo order flags; old spellings
                 refused, ``RENAMED_FLAGS``), ``run_main`` (a user error is one ``error: ...`` line and
                 exit 2; Ctrl-C 130) and ``run_and_report`` (the end of every ``main``), ``ExperimentError`` (bad
                 input, one line), ``default_out``,
                 ``check_paths`` / ``check_model_dir`` (every path option before any work), ``check_suite_steps``.
Models           ``open_testbed``; ``add_identical_flag`` / ``identical_note`` (``--allow-identical-checkpoints``).
                 Finding, picking and checking checkpoints (testbed suites, Pythia, OLMo) is library work:
                 ``mia.checkpoints``; drawing splits from the testbed's, Pythia's and OLMo's orders:
                 ``mia.data.draw`` (a notebook calls the same functions). ``require_order`` names the missing order
                 flags.
Attacks          ``score_split`` (``mia.score`` of a split's eval partition; metrics, scores files and
                 JSON come from ``ScoreRun``, ``mia.metrics`` and ``mia.report``). Choosing the attacks is library
                 work: ``mia.attacks.catalog.select_attacks``.
Blind baselines  ``run_blind_baselines`` (``mia.blind`` per feature, and the shift verdict).
Outputs          ``write_tables`` (md / CSV / LaTeX / JSON via ``mia.report``), ``plot_roc``, ``plot_lines`` (curves
with bands), ``write_manifest`` (config, seeds, hashes,
                 versions), ``Timings`` (written to ``timings.json``).

Determinism: with the same inputs and seed, every table (md, csv, tex, json) and report an experiment writes is the
same byte for byte. Tables hold no timings, dates or output paths; those go to ``timings.json`` and
``manifest.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import warnings
import math
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

import flax
import jax
import optax
from matplotlib.ticker import NullFormatter
from tqdm.auto import tqdm

import mia
from mia import report
from mia import validate as V
from mia.files.atomic import save_figure
from mia.blind import run_blind, shift_verdict
from mia.checkpoints import IDENTICAL_FLAG, ArgumentError
from mia.entry import add_compile_cache_flag, run_for_user
from mia.data.splits import read_split
from mia.files.hashing import check_cache_dir, sha256_of_file
from mia.metrics import N_RESAMPLES
from mia.report import json_safe, write_json
from mia.testbed import build_testbed
from mia.testbed.config import MEMORIZE_EPOCHS_MAX, TRAIN_STEPS_MAX
from mia.testbed.suite import SUITES


class ExperimentError(ValueError):
    """A bad request or input for an experiment; the message is one line meant for the user."""


# ============================================================================================ CLI conventions
# The one flag vocabulary of the experiments: every flag two experiments share is defined here, once (its name,
# type, default and meaning), and an old spelling is refused naming the new one. tests/test_flags.py parses every
# experiment's parser and checks that the shared flags agree.
DEFAULT_BOOTSTRAP = N_RESAMPLES  # mia.metrics' documented default: 1,000 resamples
SEED_TYPE = V.arg_int(0, V.INT32_MAX)
BOOTSTRAP_TYPE = V.arg_int(0)
STEPS_TYPE = V.arg_int_list(1)
MEMORIZE_TYPE = V.arg_int(0, MEMORIZE_EPOCHS_MAX)  # docs/testbed.md#bounds
TRAIN_STEPS_TYPE = V.arg_int(1, TRAIN_STEPS_MAX)
ROWS_TYPE = V.arg_int(1)
SEQ_LEN_TYPE = V.arg_int(2)
RENAMED_FLAGS = {"--sizes": "--member", "--step": "--steps"}  # old spelling -> the flag it became


def testbed_dir(value: str) -> str:
    """argparse ``type=`` of ``--testbed``: one directory per flag (repeat the flag for several). A comma in a path
    that does not exist is the old comma-list spelling, refused with the new one."""
    if "," in value and not Path(value).exists():
        raise argparse.ArgumentTypeError(f"{value!r}: one directory per --testbed; repeat the flag for several "
                                         f"(--testbed {' --testbed '.join(v.strip() for v in value.split(','))})")
    return value


testbed_dir.__name__ = "testbed directory"


def _add_renamed(parser, new: str) -> None:
    for old, to in RENAMED_FLAGS.items():
        if to == new:
            V.add_renamed_flag(parser, old, new)


def experiment_parser(prog: str, doc: str, presets: Iterable[str], default_preset: str = "default",
                      preset_help: Optional[str] = None) -> argparse.ArgumentParser:
    """An ``argparse`` parser with the flags every experiment has.

    ``--preset`` (one of ``presets``), ``--out DIR``, ``--seed`` (splits, partitions, bootstrap, classifiers),
    ``--bootstrap`` (resamples for AUC SEs, ``DEFAULT_BOOTSTRAP`` in every experiment), ``--no-progress``,
    ``--debug`` (tracebacks instead of one line), ``--no-compile-cache``.
    """
    p = V.OneLineParser(prog=prog, description=doc.strip().split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    presets = list(presets)
    p.add_argument("--preset", default=default_preset, choices=presets,
                   help=preset_help or f"settings preset: {', '.join(presets)} (default: {default_preset})")
    p.add_argument("--out", default=None, help="results directory (default: results/<module>-<preset>)")
    p.add_argument("--seed", type=SEED_TYPE, default=0,
                   help="split, partition, classifier and bootstrap seed (default 0)")
    p.add_argument("--bootstrap", type=BOOTSTRAP_TYPE, default=DEFAULT_BOOTSTRAP,
                   help=f"bootstrap resamples for standard errors and intervals (default {DEFAULT_BOOTSTRAP}; 0: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    add_compile_cache_flag(p)
    return p


MODEL_FLAGS = ("testbed", "member", "steps", "memorize")


def add_model_flags(parser, *, testbed: str = "testbed directories sharing one data order, instead of the suite",
                    member: str = "suite member(s): largest, middle, smallest, all or size names (comma list)",
                    steps: str = "checkpoint step(s), comma list (default: the experiment's)",
                    which: Sequence[str] = MODEL_FLAGS) -> None:
    """The flags that pick the models of an experiment, the same in every one (``which`` of them): ``--testbed DIR``
    (repeatable, one directory each; default None: the suite), ``--member`` (which suite member(s); default None:
    the experiment's own choice), ``--steps`` (comma list of checkpoint steps; default None: the experiment's),
    ``--memorize-epochs`` (0). Only the help text may differ per experiment; the old spellings ``--sizes`` and
    ``--step`` are refused naming the new ones."""
    if "testbed" in which:
        parser.add_argument("--testbed", action="append", type=testbed_dir, default=None, metavar="DIR",
                            help=testbed)
    if "member" in which:
        parser.add_argument("--member", default=None, help=member)
        _add_renamed(parser, "--member")
    if "steps" in which:
        parser.add_argument("--steps", type=STEPS_TYPE, default=None, help=steps)
        _add_renamed(parser, "--steps")
    if "memorize" in which:
        parser.add_argument("--memorize-epochs", type=MEMORIZE_TYPE, default=0,
                            help="memorization dial: train each evaluated checkpoint E more epochs on its members only "
                                 f"(at most {MEMORIZE_EPOCHS_MAX:,})")


def add_olmo_flags(parser, *, olmo: str = "OLMo checkpoint directory (or a directory of stepN[-tokens...]/ ones)"
                   ) -> None:
    """The OLMo data-order flags, the same wherever an experiment reads OLMo's order: ``--olmo DIR``,
    ``--global-indices F`` (raw uint32), ``--data-paths F`` (the ordered token files), ``--batch-size`` (instances
    per step; default None: the checkpoint's ``config.yaml`` when it has one, else 2160, said in a note:
    ``olmo_order_settings``), ``--seq-len`` (tokens per instance; default None: likewise, else 2048)."""
    parser.add_argument("--olmo", default=None, help=olmo)
    parser.add_argument("--global-indices", default=None, help="OLMo: epoch-1 global_indices.npy (raw uint32)")
    parser.add_argument("--data-paths", default=None, help="OLMo: text file listing the token files in order")
    parser.add_argument("--batch-size", type=ROWS_TYPE, default=None,
                        help="rows (instances) per step (default: the checkpoint's config.yaml, else Pythia 1024, "
                             "OLMo 2160)")
    parser.add_argument("--seq-len", type=SEQ_LEN_TYPE, default=None,
                        help="OLMo instance length (default: the checkpoint's config.yaml, else 2048)")


def one_step(parser, steps, what: str) -> Optional[int]:
    """The single checkpoint of an experiment that evaluates one (``--steps`` with one value), or None; more than
    one is a one-line usage error."""
    if steps is None:
        return None
    if len(steps) != 1:
        parser.error(f"--steps {','.join(map(str, steps))}: {what} evaluates one checkpoint; give one step")
    return int(steps[0])


def check_paths(*, out=None, files: Sequence = (), dirs: Sequence = (), model_dirs: Sequence = (),
                output_dirs: Sequence = ()) -> None:
    """Every path an experiment was given, checked before any work (a suite built, a model loaded, a split drawn),
    each with one line naming its option (``mia.validate``, as ``mia score`` does):

    ``out``          the results directory: not an existing file, nothing but directories above it;
    ``files``        ``(flag, path or paths)`` that must be existing regular files;
    ``dirs``         ``(flag, path or paths)`` that must be existing directories;
    ``model_dirs``   ``(flag, path)`` that must be model directories (a ``config.json`` in them);
    ``output_dirs``  ``(flag, path)`` directories that exist or can be created (``--suite-dir``).
    A path of ``None`` (an option not given) is skipped."""
    def each(pairs):
        for flag, value in pairs:
            for v in ([] if value is None else value if isinstance(value, (list, tuple)) else [value]):
                yield flag, v

    for flag, path in each(files):
        V.input_file(path, flag, error=ExperimentError)
    for flag, path in each(dirs):
        V.input_dir(path, flag, error=ExperimentError)
    for flag, path in each(model_dirs):
        check_model_dir(path, flag)
    for flag, path in each(output_dirs):
        V.output_dir(path, flag, error=ExperimentError)
    if out is not None:
        V.output_dir(out, "--out", error=ExperimentError)


def check_suite_steps(suite: str, steps, flag: str = "--steps") -> None:
    """Checkpoint steps the testbed suite ``suite`` cannot have, refused from its configs before it is built or
    opened: every step must be in (0, train_steps] (a step between saved checkpoints is trained to on demand)."""
    if suite not in SUITES or steps is None:
        return
    cfg = SUITES[suite][0]  # every member trains the same steps on the same order
    for step in steps if isinstance(steps, (list, tuple)) else [steps]:
        if not 0 < int(step) <= cfg.train_steps:
            raise ExperimentError(f"{flag} {step}: the {suite} suite trains steps (0, {cfg.train_steps}] "
                                  f"(checkpoints: {', '.join(map(str, cfg.checkpoint_steps))})")


def check_model_dir(path, flag: str) -> Path:
    """An existing model directory (HF layout: ``config.json`` in it), or one line naming ``flag``."""
    p = V.input_dir(path, flag, noun="model directory", error=ExperimentError)
    if not (p / "config.json").is_file():
        raise ExperimentError(f"{flag} {p}: not a model directory (no config.json)")
    return p


def run_main(fn: Callable[[], object], *, debug: bool = False, compile_cache: bool = True,
             on_interrupt: str = "interrupted; rerun the same command: finished work is cached and reused"):
    """``(status, result)`` of ``fn()`` through ``mia.entry.run_for_user``: one ``error: ...`` line and status 2 for
    bad input, 130 on Ctrl-C. It also turns on JAX's persistent compilation cache (``mia.engine.compile_cache``: every
    checkpoint of one model size and every rerun reuse compiled code; ``--no-compile-cache`` or
    ``MIA_COMPILE_CACHE=0`` turn it off). The cache directory (``$MIA_CACHE_DIR`` or ~/.cache/mia) is made and
    proved writable first (``mia.files.hashing.check_cache_dir``): an unusable one is the run's one error line."""
    return run_for_user(fn, debug=debug, on_interrupt=on_interrupt, compile_cache=compile_cache,
                        check_first=lambda: check_cache_dir(error=ExperimentError))


def run_and_report(fn: Callable[[], object], args: argparse.Namespace, report: Callable[[object], str], *,
                   compile_cache: Optional[bool] = None, on_interrupt: Optional[str] = None,
                   exit_status: Optional[Callable[[object], int]] = None) -> int:
    """The end of every experiment's ``main``: ``fn()`` through ``run_main`` with the parsed ``--debug`` and
    ``--no-compile-cache`` (``compile_cache`` overrides the flag); a failure returns its status (2: bad input, 130:
    Ctrl-C), else ``report(result)`` is printed and the status is 0, or ``exit_status(result)`` (the audit's 3 on a
    violation)."""
    kw = {} if on_interrupt is None else {"on_interrupt": on_interrupt}
    cache = not getattr(args, "no_compile_cache", False) if compile_cache is None else compile_cache
    status, result = run_main(fn, debug=args.debug, compile_cache=cache, **kw)
    if status:
        return status
    print(report(result))
    return 0 if exit_status is None else exit_status(result)


def default_out(module: str, preset: str, tag: str = "") -> Path:
    """``results/<module>-<preset>[-<tag>]``."""
    return Path("results") / "-".join(x for x in (module, preset, tag) if x)


def say_fn(progress: bool) -> Callable[[str], None]:
    """A print that keeps progress bars intact (``tqdm.write``), or nothing."""
    if not progress:
        return lambda msg: None
    return lambda msg: tqdm.write(msg)


# ============================================================================================ models
def open_testbed(preset: str, path=None, *, progress: bool = True, overrides: Optional[dict] = None):
    """Build (or reuse, or resume) the testbed of ``preset`` in ``path`` (``mia.testbed.build_testbed``)."""
    return build_testbed(preset, path, progress=progress, **(overrides or {}))


@contextlib.contextmanager
def flags_named(**flags: str):
    """Inside: a ``mia.checkpoints.ArgumentError`` about an argument in ``flags`` (``root="--pythia"``) becomes an
    ``ExperimentError`` naming the flag (``--pythia DIR: no checkpoint ...``), as every experiment error does."""
    try:
        yield
    except ArgumentError as e:
        if e.argument not in flags:
            raise
        raise ExperimentError(e.renamed(flags[e.argument])) from None


def add_identical_flag(parser) -> None:
    """``--allow-identical-checkpoints`` (``mia.checkpoints.check_checkpoints``' ``allow_identical``)."""
    parser.add_argument(IDENTICAL_FLAG, action="store_true",
                        help="run even when two checkpoints hold identical weights (recorded in the report)")


def identical_note(pairs: Sequence) -> str:
    """The report's line for checkpoints allowed with identical weights (``IDENTICAL_FLAG``)."""
    return (f"{IDENTICAL_FLAG}: identical weights allowed under different checkpoints: "
            + "; ".join(f"{a} = {b}" for a, b in pairs))


PYTHIA_ORDER_HINT = "--data the .bin shard(s) of the deduplicated Pile in order, --idx its document.idx"


def require_order(source_flag: str, flags: Mapping[str, object], hint: str = "") -> None:
    """One error naming the order flags missing for ``source_flag`` (``--pythia`` needs ``--data`` and ``--idx``)."""
    missing = [k for k, v in flags.items() if not v]
    if missing:
        raise ExperimentError(f"{source_flag} needs the training order: {' and '.join(missing)} missing"
                              + (f" ({hint})" if hint else ""))


# ============================================================================================ attacks
def score_split(model, examples: Sequence[dict], attacks, *, seed: int, progress: bool, cache_dir=None,
                max_length: Optional[int] = None, ref_model=None, mlm=None):
    """``mia.score`` of a split's examples as the experiments run it: the ``eval`` partition scored, the others
    learned from; an attack that cannot run is recorded in ``skipped`` with its reason, not fatal."""
    return mia.score(model, examples, attacks, seed=seed, progress=progress, cache=cache_dir is not None,
                     cache_dir=cache_dir, max_length=max_length, ref_model=ref_model, mlm=mlm, on_error="skip")


# ============================================================================================ blind baselines
BLIND_FEATURES = ("bow", "tfidf", "w2v", "bert")


def run_blind_baselines(split_path, seed: int, n_resamples: int, features: Sequence[str] = BLIND_FEATURES,
                        classifiers: Optional[Sequence[str]] = None, progress: bool = False):
    """(rows, verdict, {feature: reason skipped}) of ``mia.blind`` on a split file, one feature at a time so a
    missing optional dependency (an encoder) skips that feature only. Rows: every feature x classifier run
    (``kind`` "run"), the classifier chosen per feature by cross-validation on the training partition (``kind``
    "chosen") and, for comparison with the paper's Table 1 rule, the best on evaluation data (``kind`` "best_eval").
    ``progress``: a bar per feature (fit, features, each classifier, the cross-validated choice)."""
    split = read_split(split_path)
    rows, skipped = [], {}
    kw = {} if classifiers is None else {"classifiers": tuple(classifiers)}
    for f in features:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows += run_blind(split, features=(f,), seed=seed, n_resamples=n_resamples, progress=progress, **kw)
        except Exception as e:  # a missing optional dependency / encoder must not stop the experiment
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            skipped[f] = f"{type(e).__name__}: {msg}"
    verdict = shift_verdict(rows) if rows else None
    return rows, verdict, skipped


# ============================================================================================ outputs
def sha_file(path) -> str:
    """Hex SHA-256 of the whole file (``mia.files.hashing``)."""
    return sha256_of_file(path)


def write_tables(rows: Sequence[Mapping], out_dir, stem: str, columns: Sequence[str], title: str,
                 extra_markdown: str = "") -> dict:
    """``stem``.md / .csv / .tex / .json in ``out_dir`` (``mia.report.write_tables``); rows only hold the
    ``columns`` plus what the CSV/JSON should keep (no timings, no paths)."""
    rows = [json_safe(dict(r)) for r in rows]
    return report.write_tables(rows, out_dir, stem=stem, columns=list(columns), title=title,
                               extra_markdown=extra_markdown)


def plot_roc(scores: Mapping[str, np.ndarray], labels: np.ndarray, path, title: str) -> None:
    """Log-log ROC of every method with both classes among its finite scores (``mia.report.plot_roc``)."""
    curves = {}
    for k, s in scores.items():
        ok = np.isfinite(s)
        if len(set(labels[ok].tolist())) == 2:
            curves[k] = (s[ok], labels[ok])
    report.plot_roc(curves, path=path, title=title)


def plot_lines(series: Mapping[str, tuple], path, *, xlabel: str, ylabel: str, title: str, xscale: str = "linear",
               hline: Optional[float] = 0.5, ncols: int = 1, panels: Optional[Mapping[str, Mapping]] = None):
    """Line plot with shaded bands. ``series``: {label: (x, y, lo, hi)} (lo/hi may be None); or ``panels``:
    {panel title: series} for one subplot per panel. Saved as PNG (Agg backend)."""
    plt = report.pyplot()
    panels = dict(panels) if panels is not None else {title: series}
    n = len(panels)
    cols = min(ncols, n) if n > 1 else 1
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.6 * rows_), squeeze=False)
    for ax, (ptitle, ser) in zip(axes.ravel(), panels.items()):
        for label, (x, y, lo, hi) in ser.items():
            x, y = np.asarray(x, float), np.asarray(y, float)
            line, = ax.plot(x, y, marker="o", ms=3, lw=1.2, label=label)
            if lo is not None and hi is not None:
                ax.fill_between(x, np.asarray(lo, float), np.asarray(hi, float), color=line.get_color(), alpha=0.15,
                                lw=0)
        if hline is not None:
            ax.axhline(hline, color="k", ls="--", lw=0.8)
        ax.set_xscale(xscale)
        if xscale == "log":  # decade labels only (minor labels overlap)
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(ptitle if n > 1 else title, fontsize=9)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    if n > 1:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


def versions() -> dict:
    return {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "numpy": np.__version__, "platform": platform.platform(),
            "devices": [str(d) for d in jax.devices()]}


def write_manifest(out_dir, *, module: str, argv: Optional[Sequence[str]], config: dict, seeds: dict, hashes: dict,
                   paths: dict, outputs: Sequence[str]) -> Path:
    """``manifest.json``: the command, config, seeds, sha256 of the inputs, paths and library versions."""
    return write_json(Path(out_dir) / "manifest.json", {
        "command": ["python", "-m", module, *(argv or [])], "config": config, "seeds": seeds, "hashes": hashes,
        "paths": paths, "versions": versions(), "outputs": list(outputs)})


class Timings(dict):
    """{stage: seconds}; ``with t("stage"):`` adds the stage's wall time. Written to ``timings.json`` only."""

    def __call__(self, stage: str):
        timings = self

        class _T:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timings[stage] = round(timings.get(stage, 0.0) + time.perf_counter() - self.t0, 2)

        return _T()

    def write(self, out_dir) -> Path:
        return write_json(Path(out_dir) / "timings.json", dict(self))


def fmt(v, digits: int = 3) -> str:
    """A number for a markdown table ('' for None/NaN)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return f"{v:.{digits}f}"


def argv_or_sys(argv) -> list:
    return list(sys.argv[1:] if argv is None else argv)
