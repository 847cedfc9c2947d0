"""Checkpoints: find them (testbed suites, Pythia, OLMo), pick them, and check them before any work.

Every experiment and notebook reaches its models through these functions, so a notebook does what an experiment
does. Errors are one line naming the directory or file (``CheckpointError``, a ``ValueError``).

Finding    ``open_suite_members`` (a testbed suite's members, built or reused), ``open_members`` (given testbed
           directories, else a suite), ``pick_members`` (largest / middle / smallest / all / names), ``member_of``;
           ``pythia_checkpoints`` / ``pythia_checkpoint`` / ``select_pythia`` (``pythia-SIZE-deduped/stepN/``, or a
           Hugging Face hub cache), ``olmo_checkpoint`` (``stepN[-tokens...]/``).
Counting   ``count_params`` (parameters only, from the safetensors headers; buffers left out), ``size_name``.
Checking   ``check_checkpoints`` (every real checkpoint opened before any work: config, tensor names, shapes,
           dtypes, a sampled weights digest; identical weights refused unless allowed), ``check_testbed_checkpoints``
           (the same for testbed checkpoints, and against the testbed's own record), ``memorized_checkpoint`` (the
           memorization dial's checkpoint, built or reused, then checked the same way), ``olmo_order_settings`` (OLMo's
           batch size and instance length against what the checkpoint states).
"""
from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from .data.olmo_state import OlmoStateError, check_order, checkpoint_facts
from .files.hashing import file_sha256
from .models import ConfigError, hf_cache, load_config
from .models.family import FAMILIES
from .models.hub import CheckpointError
from .models.inspect import check_checkpoint, identical_pairs
from .testbed.build import TestbedError, model_config
from .testbed.build import open_testbed as open_built_testbed
from .testbed.config import SUITE_FIELDS, read_manifest
from .testbed.suite import build_suite, open_suite as open_built_suite, size_name as suite_size_name

IDENTICAL_FLAG = "--allow-identical-checkpoints"  # how the experiments spell ``allow_identical``


class ArgumentError(CheckpointError):
    """A bad value of one argument (``argument``: "root", "member", "testbeds") of a function here; the message is
    ``"{argument} {value}: {problem}"``, so a command can name its own flag instead (``renamed``)."""

    def __init__(self, argument: str, value, problem: str):
        super().__init__(f"{argument} {value}: {problem}")
        self.argument, self.value, self.problem = argument, value, problem

    def renamed(self, flag: str) -> str:
        """The message with ``flag`` in place of the argument's name."""
        return f"{flag} {self.value}: {self.problem}"


@dataclasses.dataclass(frozen=True)
class SuiteMember:
    """One model size of a suite: a name (``"70m"``, or the testbed's size name), its parameter count, its testbed."""

    name: str
    n_params: int
    testbed: object  # mia.testbed.Testbed


def open_suite_members(name: str, path=None, *, progress: bool = True) -> tuple[list, str]:
    """``(members ordered by parameter count, description)`` of the testbed suite ``name`` (``mia.testbed.suite``):
    opened when ``path`` holds a complete suite, else built, resumed or reused there (default
    ``testbeds/suite-<name>``)."""
    manifest = Path(path) / "suite.json" if path is not None else None
    recorded = read_manifest(manifest, SUITE_FIELDS) if manifest is not None and manifest.exists() else {}
    if recorded.get("complete"):
        if recorded.get("name") != name:
            raise ArgumentError("path", path, f"holds the testbed suite {str(recorded.get('name'))[:40]!r}, not "
                                f"{name!r}; give another directory, or ask for that suite")
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
            raise ArgumentError("testbeds", ", ".join(str(p) for p in testbeds), "the testbeds do not share one "
                                "data order (their data/order.bin differ), so one split cannot serve them all")
        return members, f"{len(members)} testbed(s) sharing one data order", []
    members, desc = open_suite_members(preset, suite_dir, progress=progress)
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
        raise ArgumentError("member", which, f"no such suite member; members: {', '.join(names)} (or largest, "
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
        raise CheckpointError(f"{root}: no *.safetensors weights")
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
        raise ArgumentError("root", root, "not a directory (Pythia checkpoints: pythia-SIZE-deduped/stepN/)")

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
    raise ArgumentError("root", root, f"no checkpoint pythia-{size}-deduped/step{step} (found: {_listing(found)})")


def select_pythia(root, member: Optional[str], steps: Sequence[int]) -> dict:
    """``{size: {step: path}}`` for ``--member``: Pythia size names (comma list), or ``all`` (the default, None),
    ``largest``, ``middle``, ``smallest`` among the sizes that have every one of ``steps``; one error line naming what
    is missing and what is there."""
    found = pythia_checkpoints(root)
    if not found:
        raise ArgumentError("root", root, "no pythia-SIZE-deduped/stepN/ checkpoints (with config.json) found")
    which = (member or "all").strip()
    if which in ("all", "largest", "middle", "smallest"):
        complete = [s for s, st in found.items() if all(int(x) in st for x in steps)]
        if not complete:
            raise ArgumentError("root", root, f"no size has a checkpoint at step {', '.join(map(str, steps))} "
                                f"(found: {_listing(found)})")
        chosen = pick_members(complete, which)
    else:
        chosen = [w.strip() for w in which.split(",") if w.strip()]
        bad = [s for s in chosen if s not in PYTHIA_SIZES]
        if bad or not chosen:
            raise ArgumentError("member", which, f"unknown Pythia size(s) {', '.join(bad)}; sizes: "
                                f"{', '.join(PYTHIA_SIZES)} (or all, largest, middle, smallest)")
    return {s: {int(x): pythia_checkpoint(root, s, x) for x in steps} for s in sorted(chosen, key=_size_key)}


def check_checkpoints(checkpoints: Mapping[str, Path], *, allow_identical: bool = False) -> tuple:
    """``(records, identical)`` for ``{label: checkpoint dir}``: every checkpoint a run will use opened before any
    work (``mia.models.inspect.check_checkpoint``: config, tensor names, shapes and dtypes, no weights read) and its
    sampled weights digest; ``records``: ``{label: record dict}`` for the manifest, ``identical``: ``[[path_a,
    path_b]]`` of checkpoints with the same digest. A bad checkpoint is one ``CheckpointError`` line naming its path;
    two with identical weights are refused naming both, unless ``allow_identical`` (then the caller records the
    pairs: published repositories serve one step's weights under other steps' names, and a member would silently
    be scored as a non-member)."""

    found = {}
    for label, path in checkpoints.items():
        try:
            found[label] = check_checkpoint(path)
        except (CheckpointError, ConfigError) as e:
            msg = str(e)
            raise CheckpointError(msg if str(Path(path)) in msg or str(Path(path).resolve()) in msg
                                  else f"{path}: {msg}") from None
    same = identical_pairs(found)
    pairs = [[str(checkpoints[a]), str(checkpoints[b])] for a, b in same]
    if pairs and not allow_identical:
        (a, b), digest = pairs[0], found[same[0][0]].digest
        raise CheckpointError(f"checkpoints {a} and {b} hold identical weights (sampled digest {digest}): one would "
                              f"be scored as the other's step; allow_identical ({IDENTICAL_FLAG}) overrides")
    return {label: r.to_json() for label, r in found.items()}, pairs


def testbed_config_problem(tb, path: Path) -> Optional[str]:
    """None when the config.json at ``path`` is the model config testbed ``tb``'s own settings give
    (``mia.testbed.build.model_config``: sizes, heads, context, vocabulary, rotary fraction; fields such as the context
    that ``check_checkpoint``'s shape check cannot see), else one line naming the file."""
    vocab = tb.manifest.get("tokenizer", {}).get("vocab_size")
    if vocab is None:
        return None
    want = model_config(tb.config, int(vocab))
    got = load_config(path)[1]
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name, None), getattr(want, f.name)
        if a != b:
            return (f"{Path(path) / 'config.json'}: {f.name} is {a!r}, but the testbed at {tb.root} was built with "
                    f"{b!r}: the checkpoint is not this testbed's")
    return None


def weights_problem(path: Path, want_sha256: Optional[str], record) -> Optional[str]:
    """None when ``path``/model.safetensors has the sha256 that ``record`` (a file, named in the message) states, or
    when nothing is recorded; else one line naming the weights file."""
    weights = Path(path) / "model.safetensors"
    if not want_sha256 or not weights.is_file():
        return None
    got = file_sha256(weights)
    if got != want_sha256:
        return (f"{weights}: damaged: sha256 {got[:12]}, {record} records {want_sha256[:12]}; delete it and build it "
                "again")
    return None


def testbed_checkpoint_problem(tb, step: int, path: Path) -> Optional[str]:
    """None when testbed ``tb``'s checkpoint ``step`` at ``path`` is what the testbed says it is, else one line naming
    the file: its config (``testbed_config_problem``) and model.safetensors against the sha256 its testbed.json
    records (checkpoints the build saved; a step trained on demand has no record). ``check_checkpoint`` (run by
    ``check_testbed_checkpoints`` first) covers the rest: a missing or truncated weight file, a wrong tensor name,
    shape or dtype."""
    rec = (tb.manifest.get("checkpoints") or {}).get(str(int(step))) or {}
    return testbed_config_problem(tb, path) or weights_problem(path, rec.get("sha256"), tb.root / "testbed.json")


def memorized_checkpoint(tb, rows, epochs: int, *, step: Optional[int] = None, seed: int = 0,
                         progress: bool = True) -> Path:
    """The memorization dial's checkpoint (``Testbed.memorize``: checkpoint ``step`` trained ``epochs`` more passes
    over ``rows``), built or reused, then checked as every checkpoint is before it is scored: opened
    (``check_checkpoint``: config, tensor names, shapes, dtypes), its config the testbed's (``testbed_config_problem``),
    its weights the ones its memorize.json records, and not identical to the checkpoint it was trained from (that
    dial did nothing: its scores would be the base's under another name). ``epochs`` <= 0: the checkpoint itself,
    checked as ``check_testbed_checkpoints`` does. A problem is one ``CheckpointError`` naming the file."""
    step = tb.train_steps if step is None else int(step)
    if epochs <= 0:
        check_testbed_checkpoints([(f"step{step}", tb, step)])
        return tb.checkpoint_dir(step)
    path = Path(tb.memorize(rows, epochs, step=step, seed=seed, progress=progress))
    check_testbed_checkpoints([(f"step{step}", tb, step)])
    check_checkpoints({f"step{step}": tb.checkpoint_dir(step), f"step{step}-dial": path})
    record = path / "memorize.json"
    sha = json.loads(record.read_text()).get("weights_sha256") if record.is_file() else None
    problem = testbed_config_problem(tb, path) or weights_problem(path, sha, record)
    if problem:
        raise CheckpointError(problem)
    return path


def check_testbed_checkpoints(models: Sequence[tuple], *, allow_identical: bool = False) -> tuple:
    """``(records, identical)`` as ``check_checkpoints`` gives them, for testbed checkpoints ``[(label, testbed,
    step)]``: every one opened before any split is drawn, through the same ``check_checkpoint`` as a real checkpoint
    (config, tensor names, shapes, dtypes, no weights read, the sampled digest; identical weights refused), and then
    against the testbed's own record (``testbed_checkpoint_problem``). A step between saved checkpoints is trained
    first (``Testbed.checkpoint_dir``; the order is fixed, so it is exact). A bad checkpoint: one ``CheckpointError``
    line naming the file."""

    paths, owners = {}, {}
    for label, tb, step in models:
        try:
            paths[label] = tb.checkpoint_dir(int(step))
        except TestbedError as e:
            raise CheckpointError(str(e)) from None
        owners[label] = (tb, int(step))
    records, identical = check_checkpoints(paths, allow_identical=allow_identical)
    for label, (tb, step) in owners.items():
        problem = testbed_checkpoint_problem(tb, step, paths[label])
        if problem:
            raise CheckpointError(problem)
    return records, identical


def olmo_checkpoint(root, step: int) -> Path:
    """The OLMo checkpoint of ``step``: ``root`` itself when it is a model directory (``config.json``), else
    ``root/stepN`` or ``root/stepN-tokens...`` (HF revision names), or, for a repository folder of the Hugging Face
    hub cache (``.../models--allenai--OLMo-7B``), the snapshot of its revision ``stepN[-tokens...]``; an error
    listing what is there."""

    root = Path(root)
    if not root.is_dir():
        raise ArgumentError("root", root, "not a directory (an OLMo model directory, or one of stepN[-tokens...]/)")
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
    raise ArgumentError("root", root, f"no checkpoint at step {step} (stepN[-tokens...]/ with config.json; "
                        f"found: {have})")


OLMO_BATCH_SIZE, OLMO_SEQ_LEN = 2160, 2048  # OLMo-7B's, as its revision names imply (docs/algorithms.md#olmo-order)


def olmo_order_settings(checkpoints: Mapping[int, Path], batch_size: Optional[int] = None,
                        seq_len: Optional[int] = None) -> tuple:
    """``(batch_size, seq_len, record, note)`` of the OLMo data order for ``{step: checkpoint dir}``, checked against
    what each checkpoint states (``mia.data.olmo_state``: config.yaml's batch size and instance length, the trainer
    state's step and examples seen, the tokens in a ``stepN-tokensX`` name) before any split is drawn.

    ``batch_size`` / ``seq_len`` None: the first config.yaml that states it, else OLMo-7B's 2160 / 2048. A
    disagreement is one ``CheckpointError`` naming both values and the file. ``record`` (for the manifest):
    the values, where they came from and what was checked per step; ``note``: one line when something was not
    checked (nothing to check against: the values are assumed), else None."""

    try:
        facts = {c: checkpoint_facts(p) for c, p in sorted(checkpoints.items())}
    except OlmoStateError as e:
        raise CheckpointError(str(e)) from None
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
            raise CheckpointError(str(e)) from None
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
