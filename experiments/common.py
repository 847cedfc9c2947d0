"""What every ``python -m experiments.NAME`` module shares: one small set of helpers, not copies of each other.

CLI conventions  ``experiment_parser`` (``--preset``, ``--out``, ``--seed``, ``--bootstrap``, ``--no-progress``,
                 ``--debug``; usage errors are one line), ``add_model_flags`` / ``add_olmo_flags`` / ``one_step`` (the
                 one flag vocabulary: ``--testbed``, ``--member``, ``--steps``, the OLMo order flags; old spellings
                 refused, ``RENAMED_FLAGS``), ``run_main`` (a user error is one ``error: ...`` line and
                 exit 2; Ctrl-C 130), ``ExperimentError`` (bad input, one line), ``default_out``,
                 ``check_paths`` / ``check_model_dir`` (every path option before any work), ``check_suite_steps``.
Models           ``open_testbed``, ``open_suite`` (the testbed suite, or one testbed as a suite of one),
                 ``open_members`` (given testbeds, else the suite), ``pick_members``,
                 ``pythia_checkpoints`` / ``pythia_checkpoint`` (``pythia-SIZE-deduped/stepN``), ``olmo_checkpoint``,
                 ``check_checkpoints`` (every real checkpoint opened before any work; digests for the manifest;
                 identical weights refused unless ``--allow-identical-checkpoints``),
                 ``check_testbed_checkpoints`` (the same for testbed checkpoints, and their own records),
                 ``olmo_order_settings`` (OLMo batch size and first step against the checkpoint's trainer record),
                 ``count_params`` (parameters only, from the safetensors headers, nothing loaded).
Splits           ``SplitSizes`` (examples per partition and class), ``draw_testbed_split``, ``draw_pythia_split``,
                 ``draw_olmo_split``: the ``mia split`` samplers (``mia.data.pythia`` / ``mia.data.olmo``) followed by
                 one seeded partition plan; ``check_token_ids`` (data vs the model's vocabulary).
Attacks          ``select_attacks`` (registry names and ``NAME:k=v`` specs, by cost, with reasons for what is
                 skipped), ``score_split`` (``mia.score`` of a split's eval partition; metrics, scores files and
                 JSON come from ``ScoreRun``, ``mia.metrics`` and ``mia.report``).
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
import warnings
import dataclasses
import json
import math
import platform
import re
import struct
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
from mia.atomic import save_figure
from mia.attacks import COSTS, AttackError, AttackInputs, available, check_attack_inputs, get, parse_attacks
from mia.attacks.registry import NEED_DESCRIPTIONS
from mia.blind import run_blind, shift_verdict
from mia.commands import add_compile_cache_flag, run_for_user
from mia.data import olmo, pythia
from mia.data.splits import assign_partitions, partition_counts, read_split
from mia.file_hash import sha256_of_file
from mia.metrics import N_RESAMPLES
from mia.report import json_safe, write_json
from mia.testbed import build_testbed
from mia.testbed.build import open_testbed as open_built_testbed
from mia.testbed.config import SUITE_FIELDS, read_manifest
from mia.testbed.suite import SUITES, build_suite, size_name as suite_size_name
from mia.testbed.suite import open_suite as open_built_suite


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
MEMORIZE_TYPE = V.arg_int(0)
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


class _Renamed(argparse.Action):
    """An old flag spelling: refused with one line naming the flag it became (never silently accepted: argparse would
    otherwise take ``--step`` as an abbreviation of ``--steps``)."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {self.new}")


def _add_renamed(parser, new: str) -> None:
    for old, to in RENAMED_FLAGS.items():
        if to == new:
            parser.add_argument(old, action=_Renamed, new=new, dest=f"_renamed_{old.strip('-')}", default=None)


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
                            help="memorization dial: train each evaluated checkpoint E more epochs on its members only")


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
    """``(status, result)`` of ``fn()`` through ``mia.commands.run_for_user``: one ``error: ...`` line and status 2 for
    bad input, 130 on Ctrl-C. It also turns on JAX's persistent compilation cache (``mia.engine.compile_cache``: every
    checkpoint of one model size and every rerun reuse compiled code; ``--no-compile-cache`` or
    ``MIA_COMPILE_CACHE=0`` turn it off)."""
    return run_for_user(fn, debug=debug, on_interrupt=on_interrupt, compile_cache=compile_cache)


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


@dataclasses.dataclass(frozen=True)
class SuiteMember:
    """One model size of a suite: a name (``"70m"``, or the testbed's size name), its parameter count, its testbed."""

    name: str
    n_params: int
    testbed: object  # mia.testbed.Testbed


def open_suite(name: str, path=None, *, progress: bool = True) -> tuple[list, str]:
    """``(members ordered by parameter count, description)`` of the testbed suite ``name`` (``mia.testbed.suite``):
    opened when ``path`` holds a complete suite, else built, resumed or reused there (default
    ``testbeds/suite-<name>``)."""
    if path is not None and (Path(path) / "suite.json").exists() and \
            read_manifest(Path(path) / "suite.json", SUITE_FIELDS).get("complete"):
        suite = open_built_suite(path)
    else:
        suite = build_suite(name, path, progress=progress)
    names = getattr(suite, "names", None) or [None] * len(suite.members)
    members = [member_of(tb, n) for tb, n in zip(suite.members, names)]
    return sorted(members, key=lambda m: m.n_params), f"testbed suite {suite.name!r}"


def open_members(preset: str, *, testbeds: Sequence = (), suite_dir=None, progress: bool = True) -> tuple:
    """``(members by size, description, notes)`` for an experiment on testbeds: the given testbed directories (each
    one member; they must share one data order, so that one split serves them all), else the testbed suite
    ``preset`` (built or reused in ``suite_dir``)."""
    if testbeds:
        members = sorted((member_of(open_built_testbed(p)) for p in testbeds), key=lambda m: m.n_params)
        if len({m.testbed.manifest["data"]["bin"]["sha256"] for m in members}) > 1:
            raise ExperimentError("--testbed: the testbeds do not share one data order (their data/order.bin "
                                  "differ), so one split cannot serve them all")
        return members, f"{len(members)} testbed(s) sharing one data order", []
    members, desc = open_suite(preset, suite_dir, progress=progress)
    return members, desc, []


def pick_members(members: Sequence, which: str) -> list:
    """The suite members (ordered by size) an experiment evaluates: ``largest``, ``smallest``, ``middle`` (the
    median size; the only one of a suite of one), ``all``, or one or more size names (comma list)."""
    if which == "largest":
        return [members[-1]]
    if which == "smallest":
        return [members[0]]
    if which == "middle":
        return [members[(len(members) - 1) // 2]]
    if which == "all":
        return list(members)
    names = [m.name for m in members]
    want = [w.strip() for w in which.split(",") if w.strip()]
    bad = [w for w in want if w not in names]
    if bad or not want:
        raise ExperimentError(f"--member {which}: no such suite member; members: {', '.join(names)} (or largest, "
                              "middle, smallest, all)")
    return [members[names.index(w)] for w in want]


def member_of(tb, name: Optional[str] = None) -> SuiteMember:
    """A testbed as a suite member: its parameter count (``Testbed.n_params``, else counted in the last checkpoint)
    and its name (given, else Pythia-style from the count: ``"164k"``)."""
    n = getattr(tb, "n_params", None) or count_params(tb.checkpoint_dir(tb.train_steps, create=False))
    return SuiteMember(name or size_name(n), int(n), tb)


def size_name(n_params: int) -> str:
    """Pythia-style size label (``mia.testbed.suite.size_name``; billions as ``"6.9b"``)."""
    return f"{n_params / 1e9:.1f}b".replace(".0b", "b") if n_params >= 1e9 else suite_size_name(int(n_params))


def buffer_patterns(model_dir) -> tuple:
    """Regexes of the tensor names that are buffers, not parameters, in the checkpoint at ``model_dir``: the
    ``ignored_keys`` of the family named by its ``config.json`` ``model_type`` (GPT-NeoX: the causal masks
    ``attention.bias`` / ``attention.masked_bias`` and ``rotary_emb.inv_freq``), or every registered family's when
    there is no config.json or its family is not registered."""
    import mia.models  # noqa: F401  (registers the families)
    from mia.models.family import FAMILIES

    cfg = Path(model_dir) / "config.json"
    model_type = None
    if cfg.is_file():
        try:
            model_type = json.loads(cfg.read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None
    if model_type in FAMILIES:
        return FAMILIES[model_type].ignored_keys
    return tuple(sorted({p for fam in FAMILIES.values() for p in fam.ignored_keys}))


def count_params(model_dir) -> int:
    """Parameters of a HF safetensors checkpoint directory (single file or sharded), read from the headers only.

    Counts parameters only: a tensor whose name matches ``buffer_patterns(model_dir)`` (what mia's loader for the
    family skips as a buffer, e.g. the causal masks and rotary ``inv_freq`` that old Pythia checkpoints carry) is not
    counted."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    files = [f for f in files if f.name != "train_state.safetensors"]
    if not files:
        raise ExperimentError(f"{root}: no *.safetensors weights")
    buffers = [re.compile(p) for p in buffer_patterns(root)]
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__" and not any(b.search(k) for b in buffers):
                total += int(np.prod(v["shape"], dtype=np.int64))
    return total


PYTHIA_SIZES = ("14m", "31m", "70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")
_PYTHIA_DIR = re.compile(r"^pythia-(\d+(?:\.\d+)?[mb])-deduped$")
_STEP_DIR = re.compile(r"^step(\d+)(?:-.*)?$")


def _size_key(size: str) -> float:
    return float(size[:-1]) * (1e9 if size.endswith("b") else 1e6)


def pythia_checkpoints(root) -> dict:
    """``{size: {step: path}}`` of the HF checkpoints under ``root/pythia-SIZE-deduped/stepN/`` (a
    ``config.json`` in each), sizes ordered by parameter count. ``root`` may also be a Hugging Face hub cache
    (``models--ORG--pythia-SIZE-deduped/``): its revisions ``stepN`` with a config.json, read offline."""
    root = Path(root)
    if not root.is_dir():
        raise ExperimentError(f"--pythia {root}: not a directory")
    from mia.models import hf_cache

    if hf_cache.cached_repos(root):
        return _by_size(pythia_in_hub_cache(root))
    found: dict = {}
    for d in root.iterdir():
        m = _PYTHIA_DIR.match(d.name)
        if not m or not d.is_dir():
            continue
        steps = {}
        for s in d.iterdir():
            ms = _STEP_DIR.match(s.name)
            if ms and (s / "config.json").exists():
                steps[int(ms.group(1))] = s
        if steps:
            found[m.group(1)] = dict(sorted(steps.items()))
    return _by_size(found)


def pythia_in_hub_cache(cache: Path) -> dict:
    """``{size: {step: snapshot}}`` of the ``stepN`` revisions (with a config.json) of the cached
    ``ORG/pythia-SIZE-deduped`` repositories."""
    from mia.models import hf_cache

    found: dict = {}
    for repo in hf_cache.cached_repos(cache):
        m = _PYTHIA_DIR.match(repo.split("/")[-1])
        revisions = hf_cache.revisions(cache / hf_cache.repo_folder(repo)) if m else {}
        steps = {int(s.group(1)): snap for name, snap in revisions.items()
                 if (s := _STEP_DIR.match(name)) and (snap / "config.json").exists()}
        if steps:
            found[m.group(1)] = dict(sorted(steps.items()))
    return found


def _by_size(found: dict) -> dict:
    return dict(sorted(found.items(), key=lambda kv: _size_key(kv[0])))


def _listing(found: dict) -> str:
    if not found:
        return "none"
    return "; ".join(f"pythia-{size}-deduped: steps {', '.join(map(str, steps))}" for size, steps in found.items())


def pythia_checkpoint(root, size: str, step: int) -> Path:
    """``root/pythia-SIZE-deduped/stepN`` or an error listing the checkpoints that are there."""
    found = pythia_checkpoints(root)
    if size in found and int(step) in found[size]:
        return found[size][int(step)]
    raise ExperimentError(f"--pythia {root}: no checkpoint pythia-{size}-deduped/step{step} (found: {_listing(found)})")


def select_pythia(root, member: Optional[str], steps: Sequence[int]) -> dict:
    """``{size: {step: path}}`` for ``--member``: Pythia size names (comma list), or ``all`` (the default, None),
    ``largest``, ``middle``, ``smallest`` among the sizes that have every one of ``steps``; one error line naming what
    is missing and what is there."""
    found = pythia_checkpoints(root)
    if not found:
        raise ExperimentError(f"--pythia {root}: no pythia-SIZE-deduped/stepN/ checkpoints (with config.json) found")
    which = (member or "all").strip()
    if which in ("all", "largest", "middle", "smallest"):
        complete = [s for s, st in found.items() if all(int(x) in st for x in steps)]
        if not complete:
            raise ExperimentError(f"--pythia {root}: no size has a checkpoint at step {', '.join(map(str, steps))} "
                                  f"(found: {_listing(found)})")
        chosen = pick_members(complete, which)
    else:
        chosen = [w.strip() for w in which.split(",") if w.strip()]
        bad = [s for s in chosen if s not in PYTHIA_SIZES]
        if bad or not chosen:
            raise ExperimentError(f"--member {which}: unknown Pythia size(s) {', '.join(bad)}; sizes: "
                                  f"{', '.join(PYTHIA_SIZES)} (or all, largest, middle, smallest)")
    return {s: {int(x): pythia_checkpoint(root, s, x) for x in steps} for s in sorted(chosen, key=_size_key)}


IDENTICAL_FLAG = "--allow-identical-checkpoints"


def check_checkpoints(checkpoints: Mapping[str, Path], *, allow_identical: bool = False) -> tuple:
    """``(records, identical)`` for ``{label: checkpoint dir}``: every checkpoint a run will use opened before any
    work (``mia.models.inspect.check_checkpoint``: config, tensor names, shapes and dtypes, no weights read) and its
    sampled weights digest; ``records``: ``{label: record dict}`` for the manifest, ``identical``: ``[[path_a,
    path_b]]`` of checkpoints with the same digest. A bad checkpoint is one ``ExperimentError`` line naming its path;
    two with identical weights are refused naming both, unless ``allow_identical`` (then the caller records the
    pairs: published repositories serve one step's weights under other steps' names, and a member would silently
    be scored as a non-member)."""
    from mia.models import ConfigError
    from mia.models.hub import CheckpointError
    from mia.models.inspect import check_checkpoint, identical_pairs

    found = {}
    for label, path in checkpoints.items():
        try:
            found[label] = check_checkpoint(path)
        except (CheckpointError, ConfigError) as e:
            msg = str(e)
            raise ExperimentError(msg if str(Path(path)) in msg or str(Path(path).resolve()) in msg
                                  else f"{path}: {msg}") from None
    same = identical_pairs(found)
    pairs = [[str(checkpoints[a]), str(checkpoints[b])] for a, b in same]
    if pairs and not allow_identical:
        (a, b), digest = pairs[0], found[same[0][0]].digest
        raise ExperimentError(f"checkpoints {a} and {b} hold identical weights (sampled digest {digest}): one would "
                              f"be scored as the other's step; {IDENTICAL_FLAG} overrides")
    return {label: r.to_json() for label, r in found.items()}, pairs


def testbed_checkpoint_problem(tb, step: int, path: Path) -> Optional[str]:
    """None when testbed ``tb``'s checkpoint ``step`` at ``path`` is what the testbed says it is, else one line naming
    the file: config.json against the model config the testbed's own settings give (``mia.testbed.build.model_config``:
    sizes, heads, context, vocabulary, rotary fraction; a field ``check_checkpoint``'s shape check cannot see, such as
    the context), and model.safetensors against the sha256 its testbed.json records (checkpoints the build saved; a
    step trained on demand has no record). ``check_checkpoint`` (run by ``check_testbed_checkpoints`` first) covers
    the rest: a missing or truncated weight file, a wrong tensor name, shape or dtype."""
    import dataclasses as dc

    from mia.file_hash import file_sha256
    from mia.models import load_config
    from mia.testbed.build import model_config

    vocab = tb.manifest.get("tokenizer", {}).get("vocab_size")
    if vocab is not None:
        want = model_config(tb.config, int(vocab))
        got = load_config(path)[1]
        for f in dc.fields(want):
            a, b = getattr(got, f.name, None), getattr(want, f.name)
            if a != b:
                return (f"{Path(path) / 'config.json'}: {f.name} is {a!r}, but the testbed at {tb.root} was built with "
                        f"{b!r}: the checkpoint is not this testbed's")
    rec = (tb.manifest.get("checkpoints") or {}).get(str(int(step)))
    weights = Path(path) / "model.safetensors"
    if rec and rec.get("sha256") and weights.is_file():
        got = file_sha256(weights)
        if got != rec["sha256"]:
            return (f"{weights}: damaged: sha256 {got[:12]}, {tb.root / 'testbed.json'} records {rec['sha256'][:12]}; "
                    "delete the testbed and build it again")
    return None


def check_testbed_checkpoints(models: Sequence[tuple], *, allow_identical: bool = False) -> tuple:
    """``(records, identical)`` as ``check_checkpoints`` gives them, for testbed checkpoints ``[(label, testbed,
    step)]``: every one opened before any split is drawn, through the same ``check_checkpoint`` as a real checkpoint
    (config, tensor names, shapes, dtypes, no weights read, the sampled digest; identical weights refused), and then
    against the testbed's own record (``testbed_checkpoint_problem``). A step between saved checkpoints is trained
    first (``Testbed.checkpoint_dir``; the order is fixed, so it is exact). A bad checkpoint: one ``ExperimentError``
    line naming the file."""
    from mia.testbed.build import TestbedError

    paths, owners = {}, {}
    for label, tb, step in models:
        try:
            paths[label] = tb.checkpoint_dir(int(step))
        except TestbedError as e:
            raise ExperimentError(str(e)) from None
        owners[label] = (tb, int(step))
    records, identical = check_checkpoints(paths, allow_identical=allow_identical)
    for label, (tb, step) in owners.items():
        problem = testbed_checkpoint_problem(tb, step, paths[label])
        if problem:
            raise ExperimentError(problem)
    return records, identical


def add_identical_flag(parser) -> None:
    """``--allow-identical-checkpoints`` (``check_checkpoints``)."""
    parser.add_argument(IDENTICAL_FLAG, action="store_true",
                        help="run even when two checkpoints hold identical weights (recorded in the report)")


def identical_note(pairs: Sequence) -> str:
    """The report's line for checkpoints allowed with identical weights (``IDENTICAL_FLAG``)."""
    return (f"{IDENTICAL_FLAG}: identical weights allowed under different checkpoints: "
            + "; ".join(f"{a} = {b}" for a, b in pairs))


def olmo_checkpoint(root, step: int) -> Path:
    """The OLMo checkpoint of ``step``: ``root`` itself when it is a model directory (``config.json``), else
    ``root/stepN`` or ``root/stepN-tokens...`` (HF revision names), or, for a repository folder of the Hugging Face
    hub cache (``.../models--allenai--OLMo-7B``), the snapshot of its revision ``stepN[-tokens...]``; an error
    listing what is there."""
    from mia.models import hf_cache

    root = Path(root)
    if not root.is_dir():
        raise ExperimentError(f"--olmo {root}: not a directory")
    if (root / "config.json").exists():
        return root
    cached = hf_cache.revisions(root) if root.name.startswith("models--") else {}
    candidates = cached.items() if cached else ((d.name, d) for d in root.iterdir())
    steps = {}
    for name, d in candidates:
        m = _STEP_DIR.match(name)
        if m and (d / "config.json").exists():
            steps.setdefault(int(m.group(1)), d)
    if int(step) in steps:
        return steps[int(step)]
    have = ", ".join(f"step{s}" for s in sorted(steps)) or "none"
    raise ExperimentError(f"--olmo {root}: no checkpoint at step {step} (stepN[-tokens...]/ with config.json; "
                          f"found: {have})")


OLMO_BATCH_SIZE, OLMO_SEQ_LEN = 2160, 2048  # OLMo-7B's, as its revision names imply (docs/algorithms.md#olmo-order)


def olmo_order_settings(checkpoints: Mapping[int, Path], batch_size: Optional[int] = None,
                        seq_len: Optional[int] = None) -> tuple:
    """``(batch_size, seq_len, record, note)`` of the OLMo data order for ``{step: checkpoint dir}``, checked against
    what each checkpoint states (``mia.data.olmo_state``: config.yaml's batch size and instance length, the trainer
    state's step and examples seen, the tokens in a ``stepN-tokensX`` name) before any split is drawn.

    ``batch_size`` / ``seq_len`` None: the first config.yaml that states it, else OLMo-7B's 2160 / 2048. A
    disagreement is one ``ExperimentError`` naming both values and the file. ``record`` (for the manifest):
    the values, where they came from and what was checked per step; ``note``: one line when something was not
    checked (nothing to check against: the values are assumed), else None."""
    from mia.data.olmo_state import OlmoStateError, check_order, checkpoint_facts

    try:
        facts = {c: checkpoint_facts(p) for c, p in sorted(checkpoints.items())}
    except OlmoStateError as e:
        raise ExperimentError(str(e)) from None
    stated = {f.field: f for c in facts for f in facts[c]}
    sources = {}
    for flag, field, given, default, key in (("--batch-size", "global_train_batch_size", batch_size,
                                              OLMO_BATCH_SIZE, "batch_size"),
                                             ("--seq-len", "max_sequence_length", seq_len, OLMO_SEQ_LEN, "seq_len")):
        if given is not None:
            sources[key] = (int(given), flag)
        elif field in stated:
            sources[key] = (stated[field].value, stated[field].source)
        else:
            sources[key] = (default, "default (OLMo-7B)")
    (b, b_from), (L, l_from) = sources["batch_size"], sources["seq_len"]
    checked = {}
    for c, fs in facts.items():
        try:
            checked[f"step{c}"] = check_order(fs, c, b, L)
        except OlmoStateError as e:
            raise ExperimentError(str(e)) from None
    record = {"batch_size": b, "batch_size_from": b_from, "seq_len": L, "seq_len_from": l_from,
              "first_step_position": 0, "checked": checked}
    batch_ok = any("batch size" in x or "tokens" in x or "position" in x for v in checked.values() for x in v)
    position_ok = all(any("position" in x for x in v) for v in checked.values())
    missing = ([] if batch_ok else [f"batch size {b}"]) + ([] if position_ok else ["the first step at position 0"])
    note = None
    if missing:
        why = ("no config.yaml, trainer state (train.pt) or stepN-tokensX name in the checkpoint directory"
               if not any(checked.values()) else "no trainer state (train.pt or train/rank0.pt) in the checkpoint "
               "directory" if batch_ok else "no config.yaml or token count in the checkpoint directory")
        note = f"OLMo order: {' and '.join(missing)} assumed, not checked ({why})"
        record["unchecked"] = note
    return b, L, record, note


# ============================================================================================ splits
@dataclasses.dataclass(frozen=True)
class SplitSizes:
    """Examples per partition: ``eval`` and ``train`` per class; ``calib`` (CAMIA) and ``prefix`` (ReCaLL)
    non-members only. ``eval_nonmembers`` defaults to ``eval``."""

    eval: int
    train: int = 0
    calib: int = 0
    prefix: int = 0
    eval_nonmembers: Optional[int] = None

    def __post_init__(self):
        for k in ("eval", "train", "calib", "prefix"):
            if getattr(self, k) < 0:
                raise ExperimentError(f"partition {k} must be >= 0, got {getattr(self, k)}")
        if self.eval < 1 or self.n_eval_nonmembers < 1:
            raise ExperimentError("the eval partition needs at least one member and one non-member")

    @property
    def n_eval_nonmembers(self) -> int:
        return self.eval if self.eval_nonmembers is None else int(self.eval_nonmembers)

    @property
    def members(self) -> int:
        return self.eval + self.train

    @property
    def nonmembers(self) -> int:
        return self.n_eval_nonmembers + self.train + self.calib + self.prefix

    def plan(self) -> dict:
        """{label: ((partition, count), ...)} in assignment order."""
        return {1: (("train", self.train), ("eval", self.eval)),
                0: (("prefix", self.prefix), ("calib", self.calib), ("train", self.train),
                    ("eval", self.n_eval_nonmembers))}

    def replace(self, **kw) -> "SplitSizes":
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


PARTITION_STREAM = 0x5B1  # the experiments' partition stream (``mia.data.splits.assign_partitions``)
PARTITION_SAMPLER = ("numpy.random.default_rng([seed, 0x5B1]) permutation per class: members -> train, eval; "
                     "non-members -> prefix, calib, train, eval")


def _finish_split(header: dict, examples: list, sizes: SplitSizes, seed: int) -> tuple:
    assign_partitions(examples, sizes.plan(), seed, stream=PARTITION_STREAM)
    header["params"]["sampler_partitions"] = PARTITION_SAMPLER
    header.update(partition_counts(examples))
    return header, examples


def drop_learned_duplicates(header: dict, examples: list, scored: Sequence[str] = ("eval",)) -> tuple:
    """(header, examples, dropped ids): every scored row (partition in ``scored``) that is the same as a learned-from
    row (``mia.api.LEARNED_PARTITIONS``) by mia's disjointness rule (``mia.attacks.context.disjointness_keys``: id,
    token ids or text; ``mia.score`` refuses such a pair) left out, the learned-from copy kept. Real orders hold exact
    duplicate rows, so a draw may pair two. The header's counts and partitions are the kept rows'; the dropped
    positions go to ``params.dropped_rows`` (``mia.data.splits.DROPPED_ROWS``), so ``mia split check`` still
    re-draws the file from its seed. Nothing dropped: the inputs unchanged."""
    from mia.api import LEARNED_PARTITIONS
    from mia.attacks.context import disjointness_keys

    learned = {k for e in examples if e.get("partition") in LEARNED_PARTITIONS for k in disjointness_keys(e)}
    gone = [e for e in examples if e.get("partition", "eval") in scored
            and any(k in learned for k in disjointness_keys(e))]
    return _drop_rows(header, examples, gone)


def _drop_rows(header: dict, examples: list, gone: list) -> tuple:
    """(header, kept examples, dropped ids): ``gone`` left out, the header's counts and partitions the kept rows',
    the dropped positions appended to ``params.dropped_rows`` (``mia.data.splits.DROPPED_ROWS``)."""
    from mia.data.splits import DROPPED_ROWS

    if not gone:
        return header, examples, []
    ids = {id(e) for e in gone}
    kept = [e for e in examples if id(e) not in ids]
    header = {**header, **partition_counts(kept), "params": dict(header.get("params") or {})}
    header["params"][DROPPED_ROWS] = list(header["params"].get(DROPPED_ROWS) or []) + [
        {"label": e["label"], "index": e["index"],
         **({"segment": e["segment"]} if e.get("segment") is not None else {})}
        for e in gone if e.get("index") is not None]
    return header, kept, [str(e["id"]) for e in gone]


def label_conflicts(examples: list, scored: Sequence[str] = ("eval",)) -> list:
    """The scored non-member rows (label 0, partition in ``scored``) with the same token ids or text as a scored
    member row (label 1): what ``mia.score`` refuses as one input labelled both. Rows are dicts; no partition is
    ``eval``."""
    from mia.attacks.context import disjointness_keys

    content = lambda e: [k for k in disjointness_keys(e) if k[0] != "id"]  # noqa: E731
    members = {k for e in examples if e.get("partition", "eval") in scored and e.get("label") == 1
               for k in content(e)}
    return [e for e in examples if e.get("partition", "eval") in scored and e.get("label") == 0
            and any(k in members for k in content(e))]


def drop_label_conflicts(header: dict, examples: list, scored: Sequence[str] = ("eval",)) -> tuple:
    """(header, examples, dropped ids): every ``label_conflicts`` row left out, the member kept (``mia.score``
    refuses one input labelled both; a real order's exact duplicate rows can put one copy before the checkpoint and
    one after, and the model has seen it). Recorded in ``params.dropped_rows`` as ``drop_learned_duplicates`` does,
    so ``mia split check`` still re-draws the file."""
    return _drop_rows(header, examples, label_conflicts(examples, scored))


def without_label_conflicts(examples: list) -> tuple:
    """(examples, number dropped): ``label_conflicts`` left out, the member kept, for data that is no split file
    (no header to record the positions in)."""
    gone = {id(e) for e in label_conflicts(examples)}
    return [e for e in examples if id(e) not in gone], len(gone)


def draw_testbed_split(tb, step: int, sizes: SplitSizes, seed: int, end_step: Optional[int] = None, *,
                       allow_fewer: bool = False):
    """(header, examples, note) of the checkpoint split of testbed ``tb`` at checkpoint ``step``.

    Members: rows [0, step*B); non-members: rows [step*B, end_step*B), end_step = the first epoch's end by default.
    Drawn without replacement by ``mia.data.pythia.draw_checkpoint_split`` with the model's vocabulary
    (``testbed_vocab_size``: an id outside it stops, naming the row); partitions by
    ``mia.data.splits.assign_partitions``.
    ``allow_fewer`` shrinks the partitions to what the ranges hold (with a note) instead of stopping.
    """
    B, epoch_end = tb.batch_size, tb.epoch_steps
    end_step = epoch_end if end_step is None else int(end_step)
    if step <= 0:
        raise ExperimentError(f"checkpoint step {step} has seen no rows, so it has no members; use a step in "
                              f"(0, {tb.train_steps}]")
    if step > tb.train_steps:
        raise ExperimentError(f"checkpoint step {step} is beyond the run: the testbed trained {tb.train_steps} steps "
                              f"(checkpoints: {', '.join(map(str, tb.steps))})")
    sizes, note = _fit(f"step{step} split", sizes, allow_fewer, step * B, max(0, (end_step - step) * B))
    if sizes.members > step * B:
        raise ExperimentError(f"the split asks for {sizes.members} members (eval {sizes.eval} + train {sizes.train}) "
                              f"but checkpoint step{step} has seen only {step * B} rows (steps [0, {step}) x batch "
                              f"{B}); lower --n-members/--n-train")
    if sizes.nonmembers > (end_step - step) * B:
        raise ExperimentError(f"the split asks for {sizes.nonmembers} non-members (eval {sizes.n_eval_nonmembers} + "
                              f"train {sizes.train} + calib {sizes.calib} + prefix {sizes.prefix}) but steps [{step}, "
                              f"{end_step}) of the first epoch hold only {max(0, (end_step - step) * B)} rows; lower "
                              "the counts or use an earlier --steps")
    header, examples = pythia.draw_checkpoint_split(tb.dataset(), step, sizes.members, sizes.nonmembers, seed, gap=0,
                                             end_step=end_step, batch_size=B, vocab_size=testbed_vocab_size(tb))
    for e in examples:  # ids of the testbed's rows; kind "testbed" in the header
        e["id"] = f"row{e['index']}"
    header["source"].update(kind="testbed", testbed=str(tb.root.resolve()), tokenizer=str(tb.root.resolve()),
                            config_hash=tb.config.config_hash, corpus_sha256=tb.manifest["corpus"]["sha256"],
                            checkpoint=str(tb.checkpoint_dir(step).resolve()))
    header["params"].update(epoch_end_step=epoch_end)
    return (*_finish_split(header, examples, sizes, seed), note)


def testbed_vocab_size(tb) -> int:
    """The vocabulary of the testbed's model (its tokenizer's size, recorded in the manifest): every drawn token id
    must lie in ``[0, vocab_size)``."""
    return int(tb.manifest["tokenizer"]["vocab_size"])


def _fit(what: str, sizes: SplitSizes, allow_fewer: bool, available_members: int, available_nonmembers: int):
    """``sizes`` shrunk to what the ranges hold when ``allow_fewer`` (the paper preset's 'where the data allow')."""
    if not allow_fewer:
        return sizes, None
    m_scale = min(1.0, available_members / max(sizes.members, 1))
    n_scale = min(1.0, available_nonmembers / max(sizes.nonmembers, 1))
    s = min(m_scale, n_scale)
    if s >= 1.0:
        return sizes, None
    fit = SplitSizes(max(1, int(sizes.eval * s)), int(sizes.train * s), int(sizes.calib * s), int(sizes.prefix * s),
                     None if sizes.eval_nonmembers is None else max(1, int(sizes.n_eval_nonmembers * s)))
    return fit, (f"{what}: the ranges hold {available_members} member and {available_nonmembers} non-member rows, "
                 f"fewer than asked; partitions scaled by {s:.3f} (eval {fit.eval}, train {fit.train}, calib "
                 f"{fit.calib}, prefix {fit.prefix})")


def require_order(source_flag: str, flags: Mapping[str, object], hint: str = "") -> None:
    """One error naming the order flags missing for ``source_flag`` (``--pythia`` needs ``--data`` and ``--idx``)."""
    missing = [k for k, v in flags.items() if not v]
    if missing:
        raise ExperimentError(f"{source_flag} needs the training order: {' and '.join(missing)} missing"
                              + (f" ({hint})" if hint else ""))


PYTHIA_ORDER_HINT = "--data the .bin shard(s) of the deduplicated Pile in order, --idx its document.idx"


def draw_pythia_split(data: Sequence, idx, step: int, sizes: SplitSizes, seed: int, *, gap: int = 0,
                      end_step: int = 98_500, batch_size: int = 1024, allow_fewer: bool = False,
                      vocab_size: Optional[int] = None):
    """(header, examples, note) of a Pythia checkpoint split: ``mia split pythia`` (members from steps
    [0, step-gap), non-members from [step+gap, end_step)) on the .bin shards ``data`` with the single ``idx``.
    ``vocab_size`` (the models' config.json): a drawn token id outside it stops, naming shard, row and token."""
    require_order("--pythia", {"--data": data, "--idx": idx}, PYTHIA_ORDER_HINT)
    for p in list(data) + [idx]:
        if not Path(p).exists():
            raise ExperimentError(f"{p}: data file not found")
    ds = pythia.open_dataset([str(p) for p in data], str(idx))
    n_mem = max(0, step - gap) * batch_size
    n_non = max(0, min(end_step, len(ds) // batch_size) - (step + gap)) * batch_size
    sizes, note = _fit("pythia split", sizes, allow_fewer, n_mem, n_non)
    header, examples = pythia.draw_checkpoint_split(ds, step, sizes.members, sizes.nonmembers, seed, gap=gap,
                                             end_step=end_step, batch_size=batch_size, vocab_size=vocab_size)
    header, examples = _finish_split(header, examples, sizes, seed)
    return header, examples, note


def draw_olmo_split(global_indices, data_paths, step: int, sizes: SplitSizes, seed: int, *,
                    nonmember_start: Optional[int] = None, end_step: Optional[int] = None, batch_size: int = 2160,
                    seq_len: int = 2048, allow_fewer: bool = False):
    """(header, examples, note) of an OLMo checkpoint split: ``mia split olmo`` (members from positions of steps
    [0, step), non-members from [nonmember_start, end_step)) on ``global_indices`` + the ``data_paths`` list."""
    require_order("--olmo", {"--global-indices": global_indices, "--data-paths": data_paths})
    order = olmo.OlmoOrder(global_indices, data_paths, seq_len=seq_len, batch_size=batch_size)
    s2 = step if nonmember_start is None else int(nonmember_start)
    e = order.steps if end_step is None else int(end_step)
    sizes, note = _fit("olmo split", sizes, allow_fewer, step * batch_size, max(0, e - s2) * batch_size)
    header, examples = olmo.draw_checkpoint_split(order, step, sizes.members, sizes.nonmembers, seed,
                                             nonmember_start=s2, end_step=e, batch_size=batch_size)
    header, examples = _finish_split(header, examples, sizes, seed)
    return header, examples, note


def check_token_ids(examples: Sequence[dict], vocab_size: int, data_desc: str, model_desc: str) -> None:
    """Refuse data whose token ids do not exist in the model's vocabulary (data made with another tokenizer)."""
    worst = None
    for e in examples:
        t = np.asarray(e["tokens"])
        if t.size and int(t.max()) >= vocab_size and (worst is None or int(t.max()) > worst[1]):
            worst = (e, int(t.max()))
    if worst is not None:
        e, tok = worst
        where = f"row {e['index']}" if e.get("index") is not None else f"example {e['id']}"
        raise ExperimentError(f"{data_desc}: {where} holds token id {tok} >= the vocabulary size {vocab_size} of "
                              f"{model_desc}: the data files do not match the model's tokenizer")


# ============================================================================================ attacks
def unavailable_reason(need: str) -> str:
    """Why an attack with ``need`` is skipped by an experiment that cannot provide it."""
    return f"needs {NEED_DESCRIPTIONS[need]}, which this experiment does not have"


def select_attacks(spec=None, *, max_cost: str = "heavy", unavailable: Sequence[str] = ("ref", "mlm"),
                   reasons: Optional[Mapping[str, str]] = None, tolerant: bool = False, preset: str = ""):
    """([(label, name, params)] to run, {label: reason} skipped).

    ``spec``: None or ``"default"`` (every registered attack whose ``cost`` is at most ``max_cost``), ``"all"``
    (every one), a comma list ``"loss,mink:k=0.1"``, or a list of such spec strings (named attacks run whatever
    their cost). Attacks needing one of ``unavailable`` are skipped with the reason (``reasons`` overrides
    ``unavailable_reason`` per need). ``tolerant``: an unknown attack or parameter is skipped with the registry's
    message instead of stopping (for preset lists that name attacks a checkout may not have yet)."""
    reasons = {need: (reasons or {}).get(need) or unavailable_reason(need) for need in unavailable}
    skipped: dict = {}
    chosen: list = []
    if spec is None or (isinstance(spec, str) and spec.strip() in ("all", "default")):
        every = isinstance(spec, str) and spec.strip() == "all"
        budget = COSTS.index(max_cost)
        for name in available():
            a = get(name)
            if any(n in reasons for n in a.needs):
                chosen.append((name, name, dict(a.defaults)))  # skipped below, with the missing input as reason
            elif not every and COSTS.index(a.cost) > budget:
                again = "; run with --attacks all or name it in --attacks"
                if a.cost == "quadratic":  # never in a default selection, whatever the budget
                    skipped[name] = f"{a.cost_note or a.cost}{again}"
                else:
                    within = f"the {preset} preset's time budget" if preset else f"the default cost ({max_cost})"
                    skipped[name] = f"not in {within}: {a.cost_note or a.cost}{again}"
            else:
                chosen.append((name, name, dict(a.defaults)))
    else:
        for item in [spec] if isinstance(spec, str) else list(spec):
            try:
                chosen += parse_attacks(item)
            except AttackError as e:
                if not tolerant:
                    raise
                skipped[item] = f"not available in this checkout: {str(e).splitlines()[0]}"
    run = []
    inputs = AttackInputs(None, ref_model="ref" not in reasons, mlm="mlm" not in reasons)
    for label, name, params in chosen:
        why = next((reasons[n] for n in get(name).needs if n in reasons), None)
        if why is None:
            try:
                check_attack_inputs(label, name, params, inputs)  # an attack's own rule, e.g. em_mia:init=ref
            except AttackError as e:
                why = str(e).splitlines()[0]
        if why:
            skipped[label] = why
        else:
            run.append((label, name, params))
    return run, skipped


def score_split(model, examples: Sequence[dict], attacks, *, seed: int, progress: bool, cache_dir=None,
                max_length: Optional[int] = None, ref_model=None, mlm=None):
    """``mia.score`` of a split's examples as the experiments run it: the ``eval`` partition scored, the others
    learned from; an attack that cannot run is recorded in ``skipped`` with its reason, not fatal."""
    return mia.score(model, examples, attacks, seed=seed, progress=progress, cache=cache_dir is not None,
                     cache_dir=cache_dir, max_length=max_length, ref_model=ref_model, mlm=mlm, on_error="skip")


# ============================================================================================ blind baselines
BLIND_FEATURES = ("bow", "tfidf", "w2v", "bert")


def run_blind_baselines(split_path, seed: int, n_resamples: int, features: Sequence[str] = BLIND_FEATURES,
                        classifiers: Optional[Sequence[str]] = None):
    """(rows, verdict, {feature: reason skipped}) of ``mia.blind`` on a split file, one feature at a time so a
    missing optional dependency (an encoder) skips that feature only. Rows: every feature x classifier run
    (``kind`` "run"), the classifier chosen per feature by cross-validation on the training partition (``kind``
    "chosen") and, for comparison with the paper's Table 1 rule, the best on evaluation data (``kind`` "best_eval")."""
    split = read_split(split_path)
    rows, skipped = [], {}
    kw = {} if classifiers is None else {"classifiers": tuple(classifiers)}
    for f in features:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows += run_blind(split, features=(f,), seed=seed, n_resamples=n_resamples, **kw)
        except Exception as e:  # a missing optional dependency / encoder must not stop the experiment
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            skipped[f] = f"{type(e).__name__}: {msg}"
    verdict = shift_verdict(rows) if rows else None
    return rows, verdict, skipped


# ============================================================================================ outputs
def sha_file(path) -> str:
    """Hex SHA-256 of the whole file (``mia.file_hash``)."""
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
    plt = report._plt()
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
