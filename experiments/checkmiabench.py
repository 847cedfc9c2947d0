"""CheckMIABench (Wang et al.): Tables 1/3 (blind baselines) and 2/4 (attacks) for every model size x checkpoint,
with the recency and scale curves; on the testbed suite by default, on real Pythia / OLMo checkpoints from local
paths.

    python -m experiments.checkmiabench [--preset smoke|default|paper] [--out DIR]
    python -m experiments.checkmiabench --paper --pythia DIR --data document-000*.bin --idx document.idx
    python -m experiments.checkmiabench --paper --olmo DIR --global-indices global_indices.npy --data-paths paths.txt

For each checkpoint c, one split is drawn with the ``mia split`` machinery (members: rows trained before c;
non-members: rows the same run trains after c within the first epoch) and shared by every model size, since the
sizes of a suite (like Pythia's) train on the identical data order. Then:

* Table 1/3 layout (``blind.*``): per feature (BoW, TF-IDF, W2V, BERT), the classifier that ``mia.blind`` chooses
  among LR / RF / MLP, trained on partition ``train`` and scored on partition ``eval``: AUC, bootstrap SE,
  TPR@1%FPR, and the shift verdict (every feature x classifier run is in ``blind_runs.*``).
* Table 2/4 layout (``attacks.*``): every attack of the preset on every model size at c: AUC, bootstrap SE,
  TPR@1%FPR, with the paper's published numbers beside ours where the setting is the same (real Pythia at step
  97,000 / OLMo-7B at step 400,000, gap 0, 1,000 + 1,000 evaluated, the paper's attack settings; else a note
  says what differs).
* Curves (``experiments.curves``): AUC by steps-since-seen (``--bins`` age bins, bootstrap bands) for every model
  and checkpoint, AUC by model size; ``recency.*``, ``scale.*``, ``recency.png``, ``scale.png``.
* ``report.md`` (tables, verdicts and trend sentences computed from the numbers), ``summary.json``,
  ``scores/<model>-step<c>.jsonl``, ``splits/step<c>.jsonl``, ``manifest.json``, ``timings.json``.

Real checkpoints are opened first (config, tensor names, shapes and dtypes; no weights read), before any split is
drawn; each one's sampled weights digest goes to ``manifest.json``, and two steps with identical weights are refused
naming both unless ``--allow-identical-checkpoints`` (recorded in the summary and report).

Same seed, same inputs: every table and the report are the same byte for byte (timings are only in timings.json).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

import mia
from mia.files.atomic import write_text
from mia.attacks.catalog import select_attacks
from mia.checkpoints import (check_checkpoints, check_testbed_checkpoints, count_params, memorized_checkpoint,
                             olmo_checkpoint, olmo_order_settings, open_members, pick_members, select_pythia, size_name)
from mia.data.draw import (check_token_ids, draw_olmo_split, draw_pythia_split, draw_testbed_split,
                           drop_label_conflicts, drop_learned_duplicates, SplitSizes)
from mia.data.splits import write_split
from mia.files.hashing import default_cache_dir
from mia.metrics import metric_rows

from experiments import curves
from experiments.harness import (flags_named, BLIND_FEATURES, DEFAULT_BOOTSTRAP, PYTHIA_ORDER_HINT, add_identical_flag,
                                 add_model_flags, add_olmo_flags, argv_or_sys, check_paths, check_suite_steps,
                                 default_out, experiment_parser, ExperimentError, identical_note, require_order,
                                 run_blind_baselines, run_and_report, say_fn, score_split, sha_file, Timings,
                                 write_json, write_manifest, write_tables)
from experiments.checkmiabench_report import ATTACK_COLUMNS, BLIND_COLUMNS, PAPER_COLUMNS, report_markdown
from experiments.checkmiabench_paper import (PAPER_ATTACKS, PAPER_BLIND_NOT_SAME, PAPER_SETTING, PAPER_SPLIT,
                                             PAPER_ZLIB, paper_attack_reference, paper_blind_reference, paper_notes,
                                             paper_setting_differences)

MODULE = "experiments.checkmiabench"

# ------------------------------------------------------------------------------------------------ presets
@dataclasses.dataclass(frozen=True)
class Preset:
    """Settings of a run. ``steps``: "all" (every saved checkpoint after step 0), "last", or explicit steps.
    Blind features: ``blind_every`` at every checkpoint, ``blind_last`` also at the last one (the paper's Tables 1/3
    are one checkpoint; BERT features cost ~150 CPU-seconds per default split on 2 cores). Attacks: ``attacks`` at
    every checkpoint, ``attacks_last`` also at the last one (for costly attacks, e.g. MoPe's 10 extra forward passes per
    model). An explicit ``--attacks`` list runs at every checkpoint."""

    suite: str
    sizes: SplitSizes
    attacks: tuple
    blind_every: tuple
    blind_last: tuple
    attacks_last: tuple = ()
    steps: object = "all"
    bins: int = 8
    allow_fewer: bool = False  # shrink the partitions to what the data hold ("where the data allow")
    gap: int = 0  # real data: members from steps [0, c - gap), non-members from [c + gap, end)
    note: str = ""


PRESETS = {
    # the tests' run: < 1 minute on 2 cores with the smoke suite built; stats-based attacks and the paper's ReCaLL
    "smoke": Preset("smoke", SplitSizes(60, 60, 0, 12), ("loss", "mink:k=0.1", "minkpp:k=0.1", PAPER_ZLIB),
                    (), ("bow",), attacks_last=("zlib", "recall:variant=checkmia"),
                    note="smoke preset, for time: no MoPe (10 extra passes per model); blind baselines (BoW), the "
                         "LL/zlib ratio and the paper's ReCaLL (a conditional pass per text) at the last checkpoint "
                         "only"),
    # 2 CPU cores: the paper's attacks (and the LL/zlib ratio) on every size x checkpoint of the default suite
    "default": Preset("default", SplitSizes(500, 500, 0, 12), (*PAPER_ATTACKS.values(), "zlib"),
                      ("bow", "tfidf", "w2v"), ("bert",),
                      note="default preset, for time on 2 CPU cores: BERT blind features at the last checkpoint only"),
    # the paper's settings: 4,000 + 4,000 blind training and 1,000 + 1,000 evaluated where the data allow
    "paper": Preset("default", SplitSizes(1000, 4000, 0, 12), tuple(PAPER_ATTACKS.values()), BLIND_FEATURES, (),
                    allow_fewer=True, gap=PAPER_SPLIT["gap"]),
}


# ------------------------------------------------------------------------------------------------ sources
@dataclasses.dataclass(frozen=True)
class Target:
    """One model to evaluate: size ``model`` at checkpoint ``step`` (a HF directory)."""

    model: str
    params: int
    step: int
    path: Path
    cache_dir: Optional[str]
    testbed: object = None  # the testbed (for the memorization dial), None for real checkpoints


@dataclasses.dataclass
class Setup:
    """What a run evaluates: targets, the checkpoints, and how to draw the split of a checkpoint."""

    kind: str  # "testbed" | "pythia" | "olmo"
    description: str
    targets: list
    steps: list
    draw: Callable  # step -> (header, examples, note or None)
    data_desc: str
    hashes: dict
    end_step: Optional[int] = None
    notes: list = dataclasses.field(default_factory=list)
    identical: list = dataclasses.field(default_factory=list)  # [[path, path]] allowed with identical weights


def _saved_steps(tb) -> list:
    return [s for s in tb.steps if s > 0]


def testbed_setup(preset: Preset, *, testbeds: Sequence = (), suite: Optional[str] = None, suite_dir=None,
                  member: Optional[str] = None, steps=None, split_sizes: SplitSizes, seed: int, progress: bool,
                  allow_fewer: bool = False, allow_identical: bool = False) -> Setup:
    """The testbed suite ``suite`` (or the testbeds given, which must share one data order) as a Setup. Every
    checkpoint is opened and checked (``check_testbed_checkpoints``) before any split is drawn."""
    with flags_named(testbeds="--testbed", member="--member"):
        members, desc, notes = open_members(suite or preset.suite, testbeds=testbeds, suite_dir=suite_dir,
                                            progress=progress)
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ExperimentError(f"two suite members have the same size name ({', '.join(names)})")
        members = pick_members(members, member or "all")
    first = members[0].testbed
    common = sorted(set.intersection(*(set(_saved_steps(m.testbed)) for m in members)))
    chosen = _pick_steps(steps if steps is not None else preset.steps, common, "the suite")
    for m in members:
        over = [c for c in chosen if c > m.testbed.train_steps]
        if over:
            raise ExperimentError(f"checkpoint step {over[0]} is beyond the run: member {m.name} trained "
                                  f"{m.testbed.train_steps} steps (checkpoints: {', '.join(map(str, common))})")
    targets = [Target(m.name, m.n_params, c, m.testbed.checkpoint_dir(c), str(m.testbed.root / "cache"), m.testbed)
               for c in chosen for m in members]
    records, identical = check_testbed_checkpoints([(f"{t.model}-step{t.step}", t.testbed, t.step) for t in targets],
                                                   allow_identical=allow_identical)
    hashes = {"checkpoints": records,"order_bin_sha256": first.manifest["data"]["bin"]["sha256"],
              "corpus_sha256": first.manifest["corpus"]["sha256"],
              "tokenizer_sha256": first.manifest["tokenizer"]["sha256"],
              "testbed_config_hashes": {m.name: m.testbed.config.config_hash for m in members}}
    sizes_txt = ", ".join(f"{m.name} ({m.n_params:,} parameters)" for m in members)
    return Setup("testbed", f"{desc}: {sizes_txt}; batch {first.batch_size} rows of {first.row_len} tokens, first "
                            f"epoch = steps [0, {first.epoch_steps})",
                 targets, chosen, lambda c: draw_testbed_split(first, c, split_sizes, seed, allow_fewer=allow_fewer),
                 "the testbed's data/order.bin", hashes, notes=notes, identical=identical)


def _pick_steps(spec, available: Sequence[int], where: str) -> list:
    if spec == "all":
        if not available:
            raise ExperimentError(f"{where} has no checkpoint after step 0")
        return list(available)
    if spec == "last":
        return [max(available)]
    chosen = sorted({int(s) for s in spec})
    missing = [s for s in chosen if s not in available]
    if missing:
        raise ExperimentError(f"no checkpoint at step {', '.join(map(str, missing))} in {where} "
                              f"(checkpoints: {', '.join(map(str, available)) or 'none'})")
    return chosen


def pythia_setup(root, data: Sequence, idx, *, member: Optional[str], steps: Sequence[int], split_sizes: SplitSizes,
                 seed: int, gap: int, end_step: int, batch_size: int, allow_fewer: bool,
                 allow_identical: bool = False) -> Setup:
    """Real Pythia: ``root/pythia-SIZE-deduped/stepN`` and the deduplicated Pile order (``--data``/``--idx``).
    Every checkpoint is opened and checked (``check_checkpoints``) before anything else is read."""
    from mia.models import load_config

    require_order("--pythia", {"--data": data, "--idx": idx}, PYTHIA_ORDER_HINT)
    with flags_named(root="--pythia", member="--member"):
        chosen = select_pythia(root, member, steps)
    records, identical = check_checkpoints({f"{size}-step{s}": path for size, by_step in chosen.items()
                                            for s, path in by_step.items()}, allow_identical=allow_identical)
    targets = [Target(size, count_params(path), c, path, None) for c in steps for size, by_step in chosen.items()
                  for s, path in by_step.items() if s == c]
    tokenizer_dir = str(targets[0].path.resolve())
    vocab_size = min(int(load_config(t.path)[1].vocab_size) for t in targets)  # ids checked as they are drawn

    def draw(c):
        header, examples, note = draw_pythia_split(data, idx, c, split_sizes, seed, gap=gap, end_step=end_step,
                                                   batch_size=batch_size, allow_fewer=allow_fewer,
                                                   vocab_size=vocab_size)
        header["source"]["tokenizer"] = tokenizer_dir  # blind W2V/BERT decode the token ids with it
        return header, examples, note

    return Setup("pythia", f"Pythia (deduped) {', '.join(chosen)} from {root}; order {len(data)} .bin shard(s) + "
                           f"{Path(idx).name}, batch {batch_size}, gap {gap}, non-members up to step {end_step}",
                 targets, sorted(steps), draw, f"--data/--idx ({Path(data[0]).name}, ...)", {"checkpoints": records},
                 end_step, identical=identical)


def olmo_setup(root, global_indices, data_paths, *, steps: Sequence[int], split_sizes: SplitSizes, seed: int,
               gap: int, end_step: Optional[int], batch_size: Optional[int], seq_len: Optional[int],
               allow_fewer: bool, allow_identical: bool = False) -> Setup:
    """Real OLMo: a checkpoint directory (or ``root/stepN[-tokens...]``) with ``global_indices`` + data paths. Every
    checkpoint is opened and checked (``check_checkpoints``) before anything else is read, and the batch size,
    instance length and first-step position against what the checkpoints state (``olmo_order_settings``)."""
    require_order("--olmo", {"--global-indices": global_indices, "--data-paths": data_paths})
    with flags_named(root="--olmo"):
        paths = {c: olmo_checkpoint(root, c) for c in sorted(steps)}
    records, identical = check_checkpoints({f"step{c}": p for c, p in paths.items()}, allow_identical=allow_identical)
    batch_size, seq_len, order_record, order_note = olmo_order_settings(paths, batch_size, seq_len)
    targets = []
    for c, path in paths.items():
        n = count_params(path)
        name = "7b" if 6e9 <= n <= 8e9 else size_name(n)
        targets.append(Target(name, n, c, path, None))
    tokenizer_dir = str(targets[0].path.resolve())

    def draw(c):
        header, examples, note = draw_olmo_split(global_indices, data_paths, c, split_sizes, seed,
                                                 nonmember_start=c + gap, end_step=end_step, batch_size=batch_size,
                                                 seq_len=seq_len, allow_fewer=allow_fewer)
        header["source"]["tokenizer"] = tokenizer_dir
        return header, examples, note

    return Setup("olmo", f"OLMo {targets[0].model} from {root}; order {Path(global_indices).name} + "
                         f"{Path(data_paths).name}, batch {batch_size}, non-members from step + {gap}",
                 targets, sorted(steps), draw, f"--global-indices/--data-paths ({Path(global_indices).name})",
                 {"checkpoints": records, "olmo_order": order_record}, end_step,
                 notes=[order_note] if order_note else [], identical=identical)


# ------------------------------------------------------------------------------------------------ the run
ROW_KEYS = ("model", "params", "step", "method", "kind", "auc", "auc_se", "tpr_at_1pct_fpr", "auc_ci_low",
            "auc_ci_high", "tpr_at_0.1pct_fpr", "p_auc_gt_half", "n", "n_nonfinite", "feature", "classifier",
            "n_train", "n_eval", "eps_lower", "delta", *PAPER_COLUMNS)


def _keep(row: dict) -> dict:
    return {k: row[k] for k in ROW_KEYS if k in row}


def _is_model_free(name: str) -> bool:
    from mia.attacks import get

    return not ({"stats", "model"} & set(get(name).needs))


def run(preset: str = "default", out=None, *, testbeds: Sequence = (), suite: Optional[str] = None, suite_dir=None,
        pythia=None, olmo=None, data: Sequence = (), idx=None, global_indices=None, data_paths=None,
        member: Optional[str] = None, steps: Optional[Sequence[int]] = None, attacks=None, blind: bool = True,
        blind_features: Optional[Sequence[str]] = None, n_members: Optional[int] = None,
        n_train: Optional[int] = None, n_prefix: Optional[int] = None, n_calib: Optional[int] = None,
        gap: Optional[int] = None, end_step: Optional[int] = None, batch_size: Optional[int] = None,
        seq_len: Optional[int] = None, bins: Optional[int] = None, memorize_epochs: int = 0, seed: int = 0,
        bootstrap: int = DEFAULT_BOOTSTRAP, delta: Optional[float] = None, progress: bool = True,
        allow_identical_checkpoints: bool = False, argv=None) -> dict:
    """Run CheckMIABench; returns the summary dict (also ``out/summary.json``). ``delta``: the attack table gets
    ``eps_lower``, the DP epsilon each attack rules out at that delta with 95% confidence (docs/auditing.md).
    ``allow_identical_checkpoints``: run even when two real checkpoints hold identical weights (recorded)."""
    if preset not in PRESETS:
        raise ExperimentError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if pythia and olmo:
        raise ExperimentError("give --pythia or --olmo, not both")
    if memorize_epochs and (pythia or olmo):
        raise ExperimentError("--memorize-epochs trains a testbed checkpoint further; it needs the testbed suite, not "
                              "--pythia/--olmo")
    say = say_fn(progress)
    timings = Timings()
    t_start = time.perf_counter()
    split_sizes = p.sizes.replace(eval=n_members, train=n_train, prefix=n_prefix, calib=n_calib)
    bootstrap = int(bootstrap)
    bins = p.bins if bins is None else int(bins)
    gap = p.gap if gap is None else int(gap)
    every, last = (tuple(blind_features), ()) if blind_features is not None else (p.blind_every, p.blind_last)
    out = Path(out) if out is not None else default_out("checkmiabench", preset,
                                                        "pythia" if pythia else "olmo" if olmo else "")
    # every check that needs no model, suite or data file read, before any of them
    check_paths(out=out, files=[("--data", list(data or ())), ("--idx", idx), ("--global-indices", global_indices),
                                ("--data-paths", data_paths)],
                dirs=[("--testbed", list(testbeds)), ("--pythia", pythia), ("--olmo", olmo)],
                output_dirs=[("--suite-dir", suite_dir)])
    if not (pythia or olmo or testbeds):
        check_suite_steps(suite or p.suite, steps, "--steps")
    to_run, skipped = select_attacks(list(p.attacks + p.attacks_last) if attacks is None else attacks,
                                     tolerant=attacks is None)
    last_only = ({label for label, _, _ in select_attacks(list(p.attacks_last), tolerant=True)[0]}
                 if attacks is None and p.attacks_last else set())
    if not to_run:
        raise ExperimentError("no attack to run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))

    with timings("setup"):
        if pythia:
            setup = pythia_setup(pythia, list(data or ()), idx, member=member, steps=list(steps or [97_000]),
                                 split_sizes=split_sizes, seed=seed, gap=gap,
                                 end_step=98_500 if end_step is None else end_step,
                                 batch_size=batch_size or 1024, allow_fewer=p.allow_fewer,
                                 allow_identical=allow_identical_checkpoints)
        elif olmo:
            setup = olmo_setup(olmo, global_indices, data_paths, steps=list(steps or [400_000]),
                               split_sizes=split_sizes, seed=seed, gap=gap, end_step=end_step,
                               batch_size=batch_size, seq_len=seq_len, allow_fewer=p.allow_fewer,
                               allow_identical=allow_identical_checkpoints)
        else:
            setup = testbed_setup(p, testbeds=testbeds, suite=suite, suite_dir=suite_dir, member=member, steps=steps,
                                  split_sizes=split_sizes, seed=seed, progress=progress, allow_fewer=p.allow_fewer,
                                  allow_identical=allow_identical_checkpoints)
    out.mkdir(parents=True, exist_ok=True)
    say(setup.description)

    blind_best, blind_runs, verdicts, attack_rows, recency, targets_out = [], [], {}, [], [], []
    notes = list(setup.notes) + ([identical_note(setup.identical)] if setup.identical else [])
    split_info = {}
    for c in setup.steps:
        with timings("splits"):
            header, examples, note = setup.draw(c)
            drawn_parts = header["partitions"]
            header, examples, dropped = drop_learned_duplicates(header, examples)
            header, examples, conflicts = drop_label_conflicts(header, examples)
            split_path = write_split(out / "splits" / f"step{c}.jsonl", header, examples)
        if note:
            notes.append(note)
        if dropped:
            shown = ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else "")
            notes.append(f"step{c} split: {len(dropped)} evaluated row(s) with the same tokens as a learned-from row "
                         f"dropped, the learned-from copy kept ({shown})")
        if conflicts:
            shown = ", ".join(conflicts[:5]) + (" ..." if len(conflicts) > 5 else "")
            notes.append(f"step{c} split: {len(conflicts)} evaluated non-member row(s) with the same tokens as an "
                         f"evaluated member dropped, the member kept ({shown})")
        prm = header["params"]
        split_info[c] = {"member_steps": prm.get("member_steps"), "nonmember_steps": prm.get("nonmember_steps"),
                         "partitions": header["partitions"], "seed": seed, "file": f"splits/step{c}.jsonl",
                         "duplicates_dropped": len(dropped), "label_conflicts_dropped": len(conflicts)}
        say(f"step{c}: split {header['counts']['members']} members, {header['counts']['nonmembers']} non-members")
        # the paper's numbers stand beside ours only where the setting is the paper's (else a note says what differs)
        parts = {k: (v["members"], v["nonmembers"]) for k, v in drawn_parts.items()}
        differs = paper_setting_differences(setup.kind, c, gap=gap, end_step=setup.end_step,
                                            eval_counts=parts.get("eval", (0, 0)))
        differs_blind = paper_setting_differences(setup.kind, c, gap=gap, end_step=setup.end_step,
                                                  eval_counts=parts.get("eval", (0, 0)),
                                                  train_counts=parts.get("train", (0, 0)))
        if memorize_epochs:
            differs = differs + [f"memorization dial E={memorize_epochs}"]
        if setup.kind in PAPER_SETTING:
            notes += paper_notes(setup.kind, c, differs, differs_blind, blind and bool(every + last),
                                 [t.model for t in setup.targets if t.step == c])
        features = every + (last if c == setup.steps[-1] else ())
        if blind and features:
            say(f"step{c}: blind baselines ({', '.join(features)}) ...")
            with timings("blind"):
                rows, verdict, bskip = run_blind_baselines(split_path, seed, bootstrap, features, progress=progress)
            skipped.update({f"blind {k}": v for k, v in bskip.items()})
            for r in rows or []:
                r = dict(r, step=c)
                if r.get("kind") == "chosen":
                    ref = None if differs_blind else paper_blind_reference(setup.kind, c, r["method"])
                    if ref:
                        r.update(zip(PAPER_COLUMNS, ref))
                    blind_best.append(r)
                else:
                    blind_runs.append(r)
            if verdict:
                verdicts[c] = verdict
        meta = {e["id"]: {"index": e["index"], "step": e["step"], "batch_pos": e["batch_pos"]} for e in examples}
        for t in [t for t in setup.targets if t.step == c]:
            model_dir, reference = t.path, None
            if memorize_epochs:
                with timings("memorize"):
                    rows_ = [e["index"] for e in examples if e["label"] == 1]
                    model_dir = memorized_checkpoint(t.testbed, rows_, memorize_epochs, step=c, seed=seed,
                                                     progress=progress)
            model = mia.load(model_dir)
            check_token_ids(examples, model.vocab_size, setup.data_desc, f"{t.model} step{c} ({t.path.name})")
            cache_dir = t.cache_dir or default_cache_dir()
            here = [a for a in to_run if c == setup.steps[-1] or a[0] not in last_only]
            say(f"{t.model} step{c}: {', '.join(label for label, _, _ in here)}")
            with timings("attacks"):
                res = score_split(model, examples, here, seed=seed, progress=progress, cache_dir=cache_dir)
            for k, v in res.skipped.items():
                skipped[f"{k} ({t.model} step{c})"] = v
            notes += [n for n in res.notes if n not in notes]
            extra = {"model": t.model, "params": t.params, "step": c}
            for r in metric_rows(res.scores, res.labels, res.ids, bootstrap, seed, delta=delta, **extra):
                ref = None if differs else paper_attack_reference(setup.kind, t.model, c, r["method"], setup.end_step)
                if ref:
                    r.update(zip(PAPER_COLUMNS, ref))
                attack_rows.append(r)
            if memorize_epochs:  # the clean checkpoint's LOSS on the same split, as a reference
                clean = score_split(mia.load(t.path), examples, "loss", seed=seed, progress=False,
                                    cache_dir=cache_dir)
                reference = clean.scores["loss"]
                attack_rows += metric_rows({f"loss (clean step{c}, no dial)": reference}, res.labels, res.ids,
                                           bootstrap, seed, kind="reference", **extra)
            with timings("curves"):
                recency += curves.recency_rows(res.scores, res.labels, np.array([meta[i]["step"] for i in res.ids]),
                                               c, bins, bootstrap, seed, model=t.model, step=c)
            rel = f"scores/{t.model}-step{c}.jsonl"
            res.write(out / rel, meta, {"loss (clean)": reference} if reference is not None else None)
            targets_out.append({"model": t.model, "params": t.params, "step": c, "scores": rel,
                                "checkpoint": t.path.name if setup.kind != "testbed" else f"step{c}",
                                "memorize_epochs": memorize_epochs})

    # ---- tables, curves, report
    with timings("outputs"):
        model_free = [label for label, name, _ in to_run if _is_model_free(name)]
        scale = curves.scale_rows([r for r in attack_rows if r.get("kind") == "attack"])
        title = f"{setup.kind}, {preset} preset" + (f", dial E={memorize_epochs}" if memorize_epochs else "")
        show_paper = any("paper_auc" in r for r in attack_rows + blind_best)
        a_cols = ATTACK_COLUMNS + (("eps_lower",) if delta is not None else ()) + (PAPER_COLUMNS if show_paper else ())
        b_cols = BLIND_COLUMNS + (PAPER_COLUMNS if show_paper else ())
        write_tables([_keep(r) for r in blind_best], out, "blind", b_cols,
                     "Blind baselines, best of LR/RF/MLP per feature (CheckMIABench Table 1/3 layout)")
        write_tables([_keep(r) for r in blind_runs], out, "blind_runs", ("step", "method", "auc", "auc_se",
                                                                         "tpr_at_1pct_fpr", "p_auc_gt_half"),
                     "Every blind feature x classifier run")
        write_tables([_keep(r) for r in attack_rows], out, "attacks", a_cols,
                     "Attacks per model size and checkpoint (CheckMIABench Table 2/4 layout)")
        curves.write_curves(out, recency, scale, title)
        rec_trends, scale_trends = curves.recency_trends(recency), curves.scale_trends(scale)
        findings = {"blind": {str(c): v["text"] for c, v in verdicts.items()},
                    "scale": curves.scale_sentence(scale_trends, model_free),
                    "recency": curves.recency_sentence(rec_trends, model_free)}
        summary = {
            "preset": preset, "kind": setup.kind, "description": setup.description, "seed": seed,
            "bootstrap": bootstrap, "bins": bins, "memorize_epochs": memorize_epochs,
            "attacks_run": [label for label, _, _ in to_run], "model_free": model_free,
            "splits": {str(c): v for c, v in split_info.items()},
            "targets": targets_out,
            "blind": [_keep(r) for r in blind_best], "blind_runs": [_keep(r) for r in blind_runs],
            "blind_verdicts": {str(c): v for c, v in verdicts.items()},
            "attacks": [_keep(r) for r in attack_rows], "recency": recency, "scale": scale,
            "recency_trends": rec_trends, "scale_trends": scale_trends, "findings": findings,
            "allow_identical_checkpoints": bool(allow_identical_checkpoints),
            "identical_checkpoints": setup.identical,
            "skipped": skipped, "notes": notes + ([p.note] if p.note else []) +
            ([PAPER_BLIND_NOT_SAME] if show_paper else []),
        }
        write_json(out / "summary.json", summary)
        write_text(out / "report.md", report_markdown(summary))
    outputs = ["report.md", "summary.json", "blind.*", "blind_runs.*", "attacks.*", "recency.*", "scale.*",
               "recency.png", "scale.png", "scores/", "splits/", "manifest.json", "timings.json"]
    models = list(dict.fromkeys(t.model for t in sorted(setup.targets, key=lambda t: t.params)))
    blind_cfg = {"every checkpoint": list(every), "last checkpoint": list(last)} if blind else {}
    write_manifest(out, module=MODULE, argv=argv, outputs=outputs,
                   config={"preset": preset, "preset_settings": _preset_dict(p), "kind": setup.kind,
                           "split_sizes": dataclasses.asdict(split_sizes), "steps": setup.steps, "models": models,
                           "attacks": [label for label, _, _ in to_run],
                           "attacks_last_checkpoint_only": sorted(last_only), "blind_features": blind_cfg, "gap": gap,
                           "bins": bins, "memorize_epochs": memorize_epochs, "bootstrap": bootstrap,
                           "allow_identical_checkpoints": bool(allow_identical_checkpoints)},
                   seeds={"split": seed, "partitions": [seed, 0x5B1], "bootstrap": seed, "blind": seed},
                   hashes={**setup.hashes, "splits_sha256": {c: sha_file(out / "splits" / f"step{c}.jsonl")
                                                             for c in setup.steps}},
                   paths={"checkpoints": {f"{t.model}-step{t.step}": str(t.path.resolve()) for t in setup.targets}})
    timings["total"] = round(time.perf_counter() - t_start, 1)
    timings.write(out)
    say(f"wrote {out}/ in {timings['total']:.0f} s")
    return summary


def _preset_dict(p: Preset) -> dict:
    """The preset as JSON: its fields, ``steps`` a list (or its spec string)."""
    return {**dataclasses.asdict(p), "steps": p.steps if isinstance(p.steps, str) else list(p.steps)}


# ------------------------------------------------------------------------------------------------ CLI
def _csv(text: Optional[str]) -> list:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def build_parser():
    from mia import validate as V

    p = experiment_parser(f"python -m {MODULE}", __doc__, PRESETS)
    p.add_argument("--paper", action="store_true", help="the paper's settings (= --preset paper)")
    p.set_defaults(preset=None)  # to tell an explicit --preset from the default (see chosen_preset)
    g = p.add_argument_group("models and checkpoints")
    g.add_argument("--suite", default=None, help="suite name (default: the preset's: smoke for smoke, else default)")
    g.add_argument("--suite-dir", default=None, help="suite directory (built there if missing)")
    add_model_flags(g, member="model sizes to evaluate: all (default), largest, middle, smallest or size names "
                              "(comma list; suite member names, or Pythia sizes 70m,160m,...)",
                    steps="checkpoints, comma list (default: every saved one for the suite; 97000 Pythia; "
                          "400000 OLMo)")
    r = p.add_argument_group("real checkpoints")
    r.add_argument("--pythia", default=None, help="directory of pythia-SIZE-deduped/stepN/ HF checkpoints")
    r.add_argument("--data", nargs="+", default=None,
                   help="Pythia: the .bin shard(s) of the deduplicated Pile, in order")
    r.add_argument("--idx", default=None, help="Pythia: the document.idx of those shards")
    add_olmo_flags(r)
    r.add_argument("--gap", type=V.arg_int(0), default=None,
                   help="steps left out on each side of the checkpoint (default 0, as in the paper; the paper's "
                        "numbers are shown beside ours only with gap 0)")
    r.add_argument("--end-step", type=V.arg_int(1), default=None, help="non-members up to this step (Pythia: 98500)")
    add_identical_flag(r)
    s = p.add_argument_group("what to run")
    s.add_argument("--attacks", default=None, help="attack list NAME[:k=v,...] (default: the preset's)")
    s.add_argument("--no-blind", action="store_true", help="skip the blind baselines")
    s.add_argument("--delta", type=V.arg_float(0, 1, hi_open=True), default=None,
                   help="add eps_lower to the attack table: the (eps, delta)-DP epsilon each attack rules out "
                        "with 95%% confidence")
    s.add_argument("--blind-features", default=None, help="comma-separated of bow,tfidf,w2v,bert (default: preset's)")
    s.add_argument("--n-members", type=V.arg_int(1), default=None,
                   help="evaluated members (= non-members) per checkpoint")
    s.add_argument("--n-train", type=V.arg_int(0), default=None, help="blind-classifier training examples per class")
    s.add_argument("--n-prefix", type=V.arg_int(0), default=None, help="non-members set aside for ReCaLL prefixes")
    s.add_argument("--n-calib", type=V.arg_int(0), default=None, help="non-members set aside for CAMIA calibration")
    s.add_argument("--bins", type=V.arg_int(1), default=None, help="age bins of the recency curves (default 8)")
    return p


def chosen_preset(parser, args) -> str:
    """The preset asked for: ``--paper`` is ``--preset paper``; with any other ``--preset`` it is a usage error naming
    both flags (a smoke run must never quietly become the paper's long one)."""
    if args.paper and args.preset not in (None, "paper"):
        parser.error(f"--paper and --preset {args.preset}: --paper means --preset paper; give one of them")
    return "paper" if args.paper else (args.preset or "default")


def main(argv=None) -> int:
    argv = argv_or_sys(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = chosen_preset(parser, args)
    return run_and_report(
        lambda: run(preset, args.out, testbeds=args.testbed or [], suite=args.suite, suite_dir=args.suite_dir,
                    pythia=args.pythia, olmo=args.olmo, data=args.data, idx=args.idx,
                    global_indices=args.global_indices, data_paths=args.data_paths, member=args.member,
                    steps=args.steps, attacks=args.attacks, blind=not args.no_blind,
                    blind_features=_csv(args.blind_features) or None, n_members=args.n_members,
                    n_train=args.n_train, n_prefix=args.n_prefix, n_calib=args.n_calib, gap=args.gap,
                    end_step=args.end_step, batch_size=args.batch_size, seq_len=args.seq_len, bins=args.bins,
                    memorize_epochs=args.memorize_epochs, seed=args.seed, bootstrap=args.bootstrap, delta=args.delta,
                    progress=not args.no_progress,
                    allow_identical_checkpoints=args.allow_identical_checkpoints, argv=argv),
        args, report_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
