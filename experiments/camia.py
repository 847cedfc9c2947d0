"""CAMIA's Table 1 (with Table 13's AUC) and Table 2 as one command: per domain, AUC and TPR@1%FPR of every baseline
and of CAMIA with each combiner, calibrated on non-members only, averaged over 10 seeded calibration draws.

    python -m experiments.camia [--preset default|smoke] [--out DIR]             # a member of the testbed suite
    python -m experiments.camia --mimir DIR --model DIR [--ref-model DIR] [--mlm DIR] [--domains arxiv,github]

Protocol (docs/algorithms.md#camia; the official ``run_ours_*.py``). For each domain the 75 CAMIA signals and
every baseline score are computed ONCE for all of the domain's members and non-members; then for draw
i = 0..draws-1 (seeded ``numpy.random.default_rng([seed, i])``; the official code seeds ``np.random.seed(i)``):

    calib  = alpha = 30% of the non-members: CAMIA's empirical p-values (the only data CAMIA learns from);
    remove = 30% of the members: only ``camia_lr`` trains on calib + remove (with their labels);
    target = the other 70% of each class: every method is evaluated here.

A cell is the mean over the draws, with the standard deviation (ddof = 1) as its spread. Baselines are thresholded
on their raw scores over the same target set (the paper's "p-values from the same calibration set" are a monotone
map of the raw score, equal up to ties on the calibration grid). The blind baseline is ``mia.blind``'s bag of words +
logistic regression on one seeded stratified 80/20 split of the domain (the paper: BoW + naive Bayes, 80/20).

Domains on the testbed: the corpus grouped by top-level name (``asyncio/base_events.py`` -> ``asyncio``,
``argparse.py`` -> ``argparse``). The testbed does not record which document each row of its order comes from, so
``row_documents`` re-derives it (the corpus re-tokenized, re-packed and matched row by row against ``order.bin``;
any mismatch stops the run) and caches it in the testbed's ``cache/``. A row belongs to the document holding most of
its tokens; rows whose majority document holds less than ``min_share`` of them are left out. Members: rows the
checkpoint trained on ([0, c*B)); non-members: rows of the same first epoch after it ([c*B, E*B)); per domain the first
``n`` of each class in one seeded permutation. Rows are scored at the model's trained context (CAMIA's 6x repeated
text runs in sliding windows of that context, with a note).

Table 2 (n-gram overlap): MIMIR's ``ngram_<n>_<t>`` files where ``--mimir`` provides them; on the testbed, the
domain's non-members filtered the same way (token n-grams found in the rows the checkpoint trained on, at most a
fraction t), the members unchanged.

Outputs (``--out``, default ``results/camia-<preset>``): ``report.md``; ``table1.{md,csv,tex,json}`` (methods x
domains, "mean ± sd" of AUC and TPR@1%FPR in %); ``table1_values.{csv,json}`` (the same, numeric, long format);
``table2.*`` (domain x n-gram split, TPR and AUC of LOSS, Zlib, Min-K%, Min-K%++ and CAMIA); ``summary.json``;
``scores/<dataset>.jsonl`` (baseline scores per example); ``signals/<dataset>.npz`` (the 75 raw signals, ids,
labels); ``splits/<dataset>.jsonl``; ``manifest.json``; ``timings.json``. Same inputs and seed: the same tables and
summary, byte for byte.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

import mia
from mia.files.atomic import save_npz, write_text
from mia.attacks import camia
from mia.report import csv_text

from mia.checkpoints import (check_checkpoints, check_testbed_checkpoints, memorized_checkpoint, open_members,
                             pick_members)
from mia.attacks.camia_protocol import aggregate, draw_results
from mia.data.draw import check_token_ids, without_label_conflicts
from mia.data.mimir import mimir_examples, mimir_index, mimir_listing, mimir_pick
from mia.testbed.row_documents import domain_of, row_documents
from experiments.camia_report import (BASELINES, DISPLAY, TABLE2_METHODS, cell, method_order, report_markdown,
                                      table1_rows, table2_rows, value_rows)
from mia.attacks.catalog import select_attacks
from experiments.harness import (DEFAULT_BOOTSTRAP, add_identical_flag, add_model_flags, check_model_dir, check_paths,
                                 flags_named, check_suite_steps, experiment_parser, ExperimentError, identical_note,
                                 one_step, run_blind_baselines, run_and_report, say_fn, score_split, sha_file, Timings,
                                 write_json, write_manifest, write_tables)

MIN_TABLE2_NONMEMBERS = 20  # fewer non-members after an n-gram filter leave no meaningful TPR@1%FPR
NGRAM_SPLITS = (("ngram_7_0.2", 7, 0.2), ("ngram_13_0.2", 13, 0.2), ("ngram_13_0.8", 13, 0.8))


@dataclasses.dataclass(frozen=True)
class Preset:
    """Settings of one preset. Counts are per domain and class."""

    suite: str  # testbed suite (or testbed) preset
    n_domains: int
    n_members: int
    n_nonmembers: int
    member: str = "middle"  # the target suite member (mia.checkpoints.pick_members): middle, largest, smallest, a name
    draws: int = 10
    alpha: float = 0.3
    min_share: float = 0.5
    blind: bool = True
    components: int = 2


PRESETS = {
    # the tests: two domains of the smoke suite, 40 + 40 rows each (12 calibration non-members per draw)
    "smoke": Preset("smoke", n_domains=2, n_members=40, n_nonmembers=40),
    # seven domains (as the paper's seven MIMIR domains) of the default suite, 100 + 100 rows each (30 calibration
    # non-members per draw)
    "default": Preset("default", n_domains=7, n_members=100, n_nonmembers=100),
}


# ============================================================================================ the testbed's domains
def choose_domains(row_domain: np.ndarray, member_rows: np.ndarray, nonmember_rows: np.ndarray, n_members: int,
                   n_nonmembers: int, want) -> list:
    """Domain names to evaluate: ``want`` names them (each must have enough rows of both classes), or is a count
    (the largest domains that do, by rows, ties by name)."""
    names = sorted(set(row_domain[member_rows].tolist()) | set(row_domain[nonmember_rows].tolist()))
    n_m = {d: 0 for d in names}
    n_n = dict(n_m)
    for d in row_domain[member_rows].tolist():
        n_m[d] += 1
    for d in row_domain[nonmember_rows].tolist():
        n_n[d] += 1
    ok = [d for d in names if n_m[d] >= n_members and n_n[d] >= n_nonmembers]
    if isinstance(want, int):
        chosen = sorted(ok, key=lambda d: (-(n_m[d] + n_n[d]), d))[:want]
        if not chosen:
            raise ExperimentError(f"no domain has {n_members} member and {n_nonmembers} non-member rows; lower "
                                  "--n-members/--n-nonmembers")
        return chosen
    bad = [d for d in want if d not in ok]
    if bad:
        listing = ", ".join(f"{d} ({n_m[d]}+{n_n[d]})" for d in sorted(ok, key=lambda d: -(n_m[d] + n_n[d]))[:15])
        raise ExperimentError(f"--domains: {', '.join(bad)} not found or without {n_members} member and "
                              f"{n_nonmembers} non-member rows; domains that have them (members+non-members): "
                              f"{listing or 'none'}")
    return list(want)


def testbed_datasets(tb, step: int, preset: Preset, seed: int, domains=None, progress: bool = False) -> tuple:
    """([(domain, examples)], info, member rows [c*B] read): per chosen domain the first ``n_members`` member and
    ``n_nonmembers`` non-member rows of one seeded permutation, with ``share`` >= ``min_share``. A non-member row
    with the same tokens as a member row (the corpus holds the text twice) is dropped, the member kept, and counted
    in ``info["domains"][d]["label_conflicts_dropped"]`` (``mia.score`` refuses one input labelled both)."""
    B, E = tb.batch_size, tb.epoch_steps
    if not 0 < step <= tb.train_steps:
        raise ExperimentError(f"--steps {step}: the testbed trained steps (0, {tb.train_steps}]")
    rd = row_documents(tb, progress)
    dom_of_doc = np.array([domain_of(p) for p in rd.paths])
    row_domain = dom_of_doc[rd.doc]
    rng = np.random.default_rng([int(seed), 0xCA01])
    members = rng.permutation(step * B)
    nonmembers = step * B + rng.permutation((E - step) * B)
    members = members[rd.share[members] >= preset.min_share]
    nonmembers = nonmembers[rd.share[nonmembers] >= preset.min_share]
    want = preset.n_domains if not domains else list(domains)
    chosen = choose_domains(row_domain, members, nonmembers, preset.n_members, preset.n_nonmembers, want)
    ds = tb.dataset()
    out, info = [], {}
    for d in chosen:
        rows_m = members[row_domain[members] == d][: preset.n_members]
        rows_n = nonmembers[row_domain[nonmembers] == d][: preset.n_nonmembers]
        rows = np.concatenate([rows_m, rows_n])
        toks = ds.get_rows(rows)
        examples = [{"id": f"row{int(r)}", "label": int(k < len(rows_m)), "tokens": t.tolist(), "index": int(r),
                     "step": int(r) // B, "batch_pos": int(r) % B, "document": rd.paths[int(rd.doc[r])],
                     "share": round(float(rd.share[r]), 4)} for k, (r, t) in enumerate(zip(rows, toks))]
        examples, conflicts = without_label_conflicts(examples)  # a corpus duplicate on both sides of the step
        out.append((d, examples))
        info[d] = {"n_members": int(len(rows_m)), "n_nonmembers": int(len(rows_n)) - conflicts,
                   "documents": len({e["document"] for e in examples}),
                   "mean_share": round(float(rd.share[rows].mean()), 4), "label_conflicts_dropped": conflicts}
    pool = {"member_rows": [0, step * B], "nonmember_rows": [step * B, E * B], "min_share": preset.min_share,
            "n_member_rows_eligible": int(len(members)), "n_nonmember_rows_eligible": int(len(nonmembers)),
            "sampler": "numpy.random.default_rng([seed, 0xCA01]).permutation per class; first n per domain",
            "domains": info}
    return out, pool


def ngram_masks(train_rows: np.ndarray, nonmember_tokens: Sequence, splits=NGRAM_SPLITS) -> dict:
    """{split name: [N] bool, True = the non-member is kept}: MIMIR's ``ngram_<n>_<t>`` rule on token ids: the
    fraction of a non-member's token n-grams found among the training rows is at most t."""
    from mia.data.text import ngram_overlap, ngram_set

    ref_lists = np.asarray(train_rows).tolist()
    sets = {n: ngram_set(ref_lists, n) for n in sorted({n for _, n, _ in splits})}
    lists = [list(map(int, t)) for t in nonmember_tokens]
    return {name: np.array([ngram_overlap(t, sets[n], n) <= thr for t in lists], bool) for name, n, thr in splits}


# ============================================================================================ MIMIR files
def mimir_request(root, domains: Optional[Sequence[str]], split: str, table2_domains) -> tuple:
    """(index, Table 1 keys, Table 2 domains) of a ``--mimir`` run, from the directory listing alone: every requested
    domain has the split, every Table 2 domain has files; one line naming what is missing and what is there."""
    index = mimir_index(root)
    keys = mimir_pick(index, domains, split)
    t2_domains = [d for d, _ in keys] if table2_domains in (None, "all") else list(table2_domains)
    unknown = [d for d in t2_domains if not any(k[0] == d for k in index)]
    if unknown:
        raise ExperimentError(f"--table2-domains: no MIMIR files for {', '.join(unknown)}; domains there: "
                              f"{mimir_listing(index)}")
    return index, keys, t2_domains


# ============================================================================================ the protocol
def blind_result(examples: list, path: Path, header_source: dict, seed: int, n_resamples: int) -> tuple:
    """(row, None) of BoW + logistic regression on one seeded stratified 80/20 split of the dataset (``mia.blind``),
    or (None, why it did not run): the caller records the reason in ``skipped`` so the blind row never vanishes
    silently."""
    from mia.data.splits import partition_counts, write_split

    header = {"source": header_source, "params": {"seed": seed}, **partition_counts(examples)}
    write_split(path, header, [{**e, "partition": "eval"} for e in examples])
    rows, _, skipped = run_blind_baselines(path, seed, n_resamples, features=("bow",), classifiers=("lr",))
    run = [r for r in (rows or []) if r.get("kind") == "run"]
    if not run:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "mia.blind gave no result"
        return None, f"BoW + LR did not run ({why})"
    return {"auc": run[0]["auc"], "auc_sd": None, "tpr": run[0]["tpr_at_1pct_fpr"], "tpr_sd": None, "n_draws": 1,
            "n_eval": run[0].get("n_eval"), "n_train": run[0].get("n_train")}, None


# ============================================================================================ the run
def _baseline_attacks(have_ref: bool, have_mlm: bool):
    reasons = {"ref": "needs a reference model (--ref-model, or a smaller member of the testbed suite)",
               "mlm": "needs a masked language model (--mlm DIR); the paper drops it after Table 1"}
    unavailable = [need for need, have in (("ref", have_ref), ("mlm", have_mlm)) if not have]
    return select_attacks(",".join(BASELINES), unavailable=unavailable, reasons=reasons)


def evaluate_dataset(name: str, model, examples: list, attacks, cache_dir, *, preset: Preset, seed: int,
                     bootstrap: int, options: dict, max_length: int, out: Path, source: dict, blind: bool,
                     progress: bool, timings: Timings) -> dict:
    """Score one dataset (baselines + 75 signals once), run the draws, the blind baseline; write its files."""
    with timings(f"score:{name}"):
        run = score_split(model, examples, attacks, seed=seed, progress=progress, cache_dir=cache_dir,
                          max_length=max_length, ref_model=options.get("ref_model"), mlm=options.get("mlm"))
        signals = camia.features(run.context, run.examples, run.context.stats(), "evaluated")
    labels = run.labels
    with timings(f"draws:{name}"):
        res, skipped = draw_results(run.scores, signals, labels, draws=preset.draws, alpha=preset.alpha, seed=seed,
                                    components=preset.components)
    results = {m: aggregate(v) for m, v in res.items()}
    if blind:
        with timings(f"blind:{name}"):
            b, why = blind_result(examples, out / "splits" / f"{_file(name)}.jsonl", source, seed, bootstrap)
        if b is not None:
            results = {"blind": b, **results}
        else:
            skipped["blind"] = why
    meta = {e["id"]: {k: e[k] for k in ("index", "step", "document", "share") if k in e} for e in examples}
    run.write(out / "scores" / f"{_file(name)}.jsonl", meta)
    save_npz(out / "signals" / f"{_file(name)}.npz", signals=signals.astype(np.float64), labels=labels,
             ids=np.array(run.ids), names=np.array(camia.FEATURE_NAMES))
    return {"results": results, "per_draw": res, "skipped": {**run.skipped, **skipped}, "notes": run.context.notes,
            "run": run, "signals": signals}


def _file(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.()-]+", "_", name)


def run(preset: str = "default", out=None, *, testbeds: Sequence = (), suite_dir=None, member: Optional[str] = None,
        step: Optional[int] = None, domains=None, n_domains: Optional[int] = None, n_members: Optional[int] = None,
        n_nonmembers: Optional[int] = None, draws: Optional[int] = None, memorize_epochs: int = 0,
        mimir=None, model_dir=None, ref_model=None, mlm=None, split: str = "ngram_7_0.2",
        table2_domains=None, max_per_class: Optional[int] = None, blind: bool = True, seed: int = 0,
        bootstrap: int = DEFAULT_BOOTSTRAP, progress: bool = True, allow_identical_checkpoints: bool = False,
        argv=None) -> dict:
    """Run the experiment; returns the summary (also written to ``out/summary.json``). With ``--mimir``, ``--model``
    and ``--ref-model`` are opened and checked (``check_checkpoints``) before any file is read or hashed;
    ``allow_identical_checkpoints``: run even when the two hold identical weights (recorded)."""
    if preset not in PRESETS:
        raise ExperimentError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    p = dataclasses.replace(PRESETS[preset], **{k: v for k, v in (
        ("n_domains", n_domains), ("n_members", n_members), ("n_nonmembers", n_nonmembers), ("draws", draws),
        ("member", member)) if v is not None})
    for k in ("n_domains", "n_members", "n_nonmembers", "draws"):
        if getattr(p, k) < 1:
            raise ExperimentError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(p, k)}")
    if max_per_class is not None and max_per_class < 1:
        raise ExperimentError(f"--max-per-class must be >= 1, got {max_per_class}")
    out = Path(out) if out is not None else Path("results") / f"camia-{'mimir' if mimir else preset}"
    # every check that needs no model, suite or data file read, before any of them
    check_paths(out=out, dirs=[("--testbed", list(testbeds)), ("--mimir", mimir)],
                model_dirs=[("--model", model_dir), ("--ref-model", ref_model), ("--mlm", mlm)],
                output_dirs=[("--suite-dir", suite_dir)])
    if mimir is not None and model_dir is None:
        raise ExperimentError("--mimir needs --model DIR (a local model directory)")
    if mimir is not None:
        mimir_request(mimir, domains, split, table2_domains)  # domains and splits: a directory listing
    elif not testbeds:
        check_suite_steps(p.suite, step)
    if mimir is None and (model_dir is not None or ref_model is not None):
        raise ExperimentError("--model/--ref-model go with --mimir; on the testbed the model is a suite member")
    ckpt_records, identical = {}, []
    if mimir is not None:
        ckpts = {"model": Path(model_dir), **({"ref_model": Path(ref_model)} if ref_model is not None else {})}
        ckpt_records, identical = check_checkpoints(ckpts, allow_identical=allow_identical_checkpoints)
    say = say_fn(progress)
    timings = Timings()
    t0 = time.perf_counter()
    for sub in ("scores", "signals", "splits"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    notes: list = [identical_note(identical)] if identical else []
    if mimir is not None:
        s = _run_mimir(p, out, mimir=mimir, model_dir=model_dir, ref_model=ref_model, mlm=mlm, split=split,
                       domains=domains, table2_domains=table2_domains, max_per_class=max_per_class, blind=blind,
                       seed=seed, bootstrap=bootstrap, progress=progress, timings=timings)
    else:
        s = _run_testbed(p, preset, out, testbeds=testbeds, suite_dir=suite_dir, step=step, domains=domains,
                         memorize_epochs=memorize_epochs, mlm=mlm, blind=blind, seed=seed, bootstrap=bootstrap,
                         progress=progress, timings=timings, allow_identical=allow_identical_checkpoints)
    s["notes"] = notes + s["notes"]
    if mimir is not None:
        s.update(allow_identical_checkpoints=bool(allow_identical_checkpoints), identical_checkpoints=identical)
        s["_config"]["allow_identical_checkpoints"] = bool(allow_identical_checkpoints)
        s["_hashes"]["checkpoints"] = ckpt_records
    write_json(out / "summary.json", {k: v for k, v in s.items() if not k.startswith("_")})
    write_text(out / "report.md", report_markdown(s))
    write_manifest(out, module="experiments.camia", argv=argv, config=s["_config"], seeds={
        "draws": f"numpy.random.default_rng([{seed}, i]) for i < {p.draws}", "domains": [seed, 0xCA01],
        "blind": seed, "mimir_subsample": [seed, 0x313]}, hashes=s["_hashes"], paths=s["_paths"],
        outputs=["report.md", "table1.*", "table1_values.*", "table2.*", "summary.json", "scores/", "signals/",
                 "splits/"])
    timings["total"] = round(time.perf_counter() - t0, 1)
    timings.write(out)
    say(f"wrote {out}/ in {timings['total']:.0f} s")
    return s


def _finish(p: Preset, out: Path, results: dict, counts: dict, t2: dict, *, setting: str, model_desc: str,
            info: dict, info_keys: list, skipped: dict, notes: list, config: dict, hashes: dict, paths: dict) -> dict:
    names = list(results)
    wide = table1_rows(results, names)
    write_tables(wide, out, "table1", list(wide[0]) if wide else ["method"],
                 title=f"CAMIA Table 1 / 13 ({setting}): AUC and TPR@1%FPR (%), mean ± sd over {p.draws} draws")
    values = value_rows(results, counts)
    write_text(out / "table1_values.csv", csv_text(values))
    write_json(out / "table1_values.json", {"rows": values})
    t2_rows = table2_rows(t2) if t2 else []
    if t2_rows:
        write_tables(t2_rows, out, "table2", list(t2_rows[0]), title=f"CAMIA Table 2 ({setting}): n-gram splits")
    per_method = []
    for m in method_order(results):
        per_method.append({"method": DISPLAY.get(m, m),
                           "tpr": {d: cell(results[d][m]["tpr"], results[d][m]["tpr_sd"], 100.0, 2)
                                   for d in names if m in results[d]},
                           "auc": {d: cell(results[d][m]["auc"], results[d][m]["auc_sd"])
                                   for d in names if m in results[d]}})
    protocol = (f"{p.draws} calibration draws (numpy default_rng([seed, i])): calib = {p.alpha:.0%} of the "
                f"non-members (CAMIA p-values), remove = {p.alpha:.0%} of the members (camia_lr training only, with "
                f"calib), target = the rest; baselines thresholded on raw scores over the same target set; blind = "
                "BoW + LR on one stratified 80/20 split")
    return {"setting": setting, "model": {"description": model_desc}, "protocol": protocol, "datasets": names,
            "counts": counts, "dataset_info": info, "dataset_info_keys": info_keys, "results": results,
            "table1_values_wide": per_method, "table2": t2_rows, "skipped": skipped, "notes": notes,
            "_config": config, "_hashes": hashes, "_paths": paths}


def _run_testbed(p: Preset, preset: str, out: Path, *, testbeds, suite_dir, step, domains, memorize_epochs, mlm,
                 blind, seed, bootstrap, progress, timings, allow_identical: bool = False) -> dict:
    say = say_fn(progress)
    with timings("testbed"):
        with flags_named(testbeds="--testbed", member="--member"):
            members, desc, notes = open_members(p.suite, testbeds=testbeds, suite_dir=suite_dir, progress=progress)
            targets = pick_members(members, p.member)
    if len(targets) != 1:
        raise ExperimentError("--member all is not offered here: Table 1 is one model; run once per --member NAME")
    target = targets[0]
    tb = target.testbed
    c = tb.train_steps if step is None else int(step)
    ref = next((m for m in members if m.n_params < target.n_params), None)
    with timings("check"):  # every checkpoint used, opened and checked before any row is drawn
        ckpt_records, identical = check_testbed_checkpoints(
            [(f"{m.name}-step{c}", m.testbed, c) for m in [target] + ([ref] if ref is not None else [])],
            allow_identical=allow_identical)
    with timings("rows"):
        datasets, pool = testbed_datasets(tb, c, p, seed, domains, progress)
    model_dir = tb.checkpoint_dir(c)
    dial = None
    if memorize_epochs and memorize_epochs > 0:
        rows = sorted(e["index"] for _, ex in datasets for e in ex if e["label"] == 1)
        with timings("memorize"):
            model_dir = memorized_checkpoint(tb, rows, memorize_epochs, step=c, seed=seed, progress=progress)
        dial = {"epochs": int(memorize_epochs), "n_rows": len(rows), "path": str(model_dir)}
    model = mia.load(model_dir)
    context = min(model.max_tokens, tb.row_len)  # whole rows: seq_len + 1 tokens make seq_len predictions
    options = {"ref_model": mia.load(ref.testbed.checkpoint_dir(c))} if ref is not None else {}  # loaded once
    if mlm:
        options["mlm"] = str(mlm)
    attacks, skipped = _baseline_attacks(ref is not None, bool(mlm))
    cache_dir = str(tb.root / "cache")
    notes = list(notes) + [f"rows of {context} tokens are scored whole: {context - 1} predictions within the model's "
                           f"trained context of {model.max_length} positions"]
    conflicts = {d: v["label_conflicts_dropped"] for d, v in pool["domains"].items() if v["label_conflicts_dropped"]}
    if conflicts:
        notes.append(f"{sum(conflicts.values())} non-member row(s) with the same tokens as a member row dropped (the "
                     "member kept): " + ", ".join(f"{d} {n}" for d, n in conflicts.items()))
    if ref is not None:
        notes.append(f"Reference = LL(target) - LL(suite member {ref.name} at step {c}), the smallest member as the "
                     "reference model (the paper uses StableLM-3B for Pythia)")
    source = {"kind": "testbed-domain", "testbed": str(tb.root.resolve()), "tokenizer": str(tb.root.resolve()),
              "config_hash": tb.config.config_hash}
    results, counts, t2 = {}, {}, {}
    train_rows = None
    for d, examples in datasets:
        say(f"domain {d}: {len(examples)} rows")
        ev = evaluate_dataset(d, model, examples, attacks, cache_dir, preset=p, seed=seed, bootstrap=bootstrap,
                              options=options, max_length=context, out=out, source=source, blind=blind,
                              progress=progress, timings=timings)
        results[d] = ev["results"]
        counts[d] = {"n_members": pool["domains"][d]["n_members"], "n_nonmembers": pool["domains"][d]["n_nonmembers"]}
        skipped.update({f"{d}: {k}": v for k, v in ev["skipped"].items()})
        for n in ev["notes"]:
            if n not in notes:
                notes.append(n)
        with timings(f"table2:{d}"):
            if train_rows is None:
                train_rows = tb.dataset().get_rows(np.arange(c * tb.batch_size))
            y = ev["run"].labels
            non = np.flatnonzero(y == 0)
            masks = ngram_masks(train_rows, [ev["run"].examples[i].tokens for i in non])
            scores = {m: v for m, v in ev["run"].scores.items() if m in TABLE2_METHODS}
            t2[(d, "all (Table 1)")] = ({m: v for m, v in ev["results"].items() if m in TABLE2_METHODS}, len(non))
            for name, keep in masks.items():
                if keep.sum() < MIN_TABLE2_NONMEMBERS:
                    t2[(d, name)] = ({}, int(keep.sum()))
                    skipped[f"{d} {name}"] = (f"only {int(keep.sum())} non-members pass the filter; a row needs at "
                                              f"least {MIN_TABLE2_NONMEMBERS}")
                    continue
                subset = np.concatenate([np.flatnonzero(y == 1), non[keep]])
                res, why = draw_results(scores, ev["signals"], y, draws=p.draws, alpha=p.alpha, seed=seed,
                                        subset=subset, lr=False)
                t2[(d, name)] = ({m: aggregate(v) for m, v in res.items() if m in TABLE2_METHODS}, int(keep.sum()))
                skipped.update({f"{d} {name}: {k}": v for k, v in why.items()})
    mdesc = (f"Model: testbed suite member {target.name} ({target.n_params:,} parameters), checkpoint step{c}"
             + (f" + memorization dial ({dial['epochs']} epochs over the {dial['n_rows']} member rows)" if dial else "")
             + f" of {desc}. Domains: top-level names of the corpus (package or module); members from rows "
             f"[0, {c * tb.batch_size}), non-members from rows [{c * tb.batch_size}, {tb.epoch_steps * tb.batch_size}) "
             f"of the first epoch; rows of {tb.row_len} tokens whose majority document holds >= {p.min_share:.0%} of "
             "them.")
    info = {d: {k: v for k, v in pool["domains"][d].items() if k in ("documents", "mean_share")} for d in results}
    config = {"preset": preset, "settings": dataclasses.asdict(p), "step": c, "member": target.name,
              "domains": list(results), "memorize": dial, "mlm": mlm, "bootstrap": bootstrap,
              "testbed": tb.config.to_dict(), "pool": pool}
    hashes = {
        "order_bin_sha256": tb.manifest["data"]["bin"]["sha256"],
        "corpus_sha256": tb.manifest["corpus"]["sha256"],
        "model_sha256": sha_file(Path(model_dir) / "model.safetensors"),
        "checkpoints": ckpt_records,
    }
    if identical:
        notes.append(identical_note(identical))
    paths = {"testbed": str(tb.root.resolve()), "model": str(Path(model_dir).resolve())}
    return _finish(p, out, results, counts, t2, setting=f"testbed {preset}, member {target.name}", model_desc=mdesc,
                   info=info, info_keys=["documents", "mean_share"], skipped=skipped, notes=notes, config=config,
                   hashes=hashes, paths=paths)


def _run_mimir(p: Preset, out: Path, *, mimir, model_dir, ref_model, mlm, split, domains, table2_domains,
               max_per_class, blind, seed, bootstrap, progress, timings) -> dict:
    if model_dir is None:
        raise ExperimentError("--mimir needs --model DIR (a local model directory)")
    index, keys, t2_domains = mimir_request(mimir, domains, split, table2_domains)
    model_dir = check_model_dir(model_dir, "--model")
    if ref_model is not None:
        check_model_dir(ref_model, "--ref-model")
    model = mia.load(model_dir)
    if model.tokenizer is None:
        raise ExperimentError(f"--model {model_dir}: no tokenizer files; MIMIR texts must be tokenized")
    options = {"mlm": str(mlm)} if mlm else {}
    if ref_model is not None:
        options["ref_model"] = mia.load(ref_model)  # loaded once, shared by every domain
    attacks, skipped = _baseline_attacks(ref_model is not None, bool(mlm))
    cache_dir = None  # MIMIR texts: no on-disk cache
    source = {"kind": "text", "format": "mimir", "root": str(Path(mimir).resolve())}
    results, counts, t2, notes, files = {}, {}, {}, [], {}
    extra = sorted(k for k in index if k[0] in t2_domains and k[1] != split and k[1] != "none")
    for key in keys + extra:
        d, sp = key
        name = f"{d}/{sp}"
        mem_f, non_f = index[key]
        files[name] = {"member": str(mem_f), "nonmember": str(non_f), "member_sha256": sha_file(mem_f),
                       "nonmember_sha256": sha_file(non_f)}
        examples, n = mimir_examples(mem_f, non_f, model.tokenizer, max_per_class, seed)
        check_token_ids(examples, model.vocab_size, f"--mimir {name} (tokenized by --model's tokenizer)",
                        f"--model {model_dir}")
        notes += n
        say_fn(progress)(f"{name}: {len(examples)} texts")
        ev = evaluate_dataset(name, model, examples, attacks, cache_dir, preset=p, seed=seed, bootstrap=bootstrap,
                              options=options, max_length=int(model.max_length), out=out, source=source, blind=blind,
                              progress=progress, timings=timings)
        y = ev["run"].labels
        c = {"n_members": int((y == 1).sum()), "n_nonmembers": int((y == 0).sum())}
        skipped.update({f"{name}: {k}": v for k, v in ev["skipped"].items()})
        for note in ev["notes"]:
            if note not in notes:
                notes.append(note)
        if key in keys:
            results[d] = ev["results"]
            counts[d] = c
        if d in t2_domains:
            t2[(d, sp)] = ({m: v for m, v in ev["results"].items() if m in TABLE2_METHODS}, c["n_nonmembers"])
    n_splits = {d: sum(k[0] == d for k in t2) for d, _ in t2}
    t2 = {k: v for k, v in sorted(t2.items()) if n_splits[k[0]] > 1}  # Table 2 compares a domain's splits
    mdesc = (f"Model: {model_dir} ({type(model.config).__name__}, context {model.max_length}); MIMIR files under "
             f"{mimir}, split {split!r} for Table 1.")
    config = {"preset": "mimir", "settings": dataclasses.asdict(p), "split": split, "domains": [d for d, _ in keys],
              "table2_domains": t2_domains, "max_per_class": max_per_class, "ref_model": str(ref_model) if ref_model
              else None, "mlm": str(mlm) if mlm else None, "bootstrap": bootstrap}
    hashes = {"model_sha256": {f.name: sha_file(f) for f in sorted(Path(model_dir).glob("*.safetensors"))},
              "mimir_files": files}
    paths = {"model": str(Path(model_dir).resolve()), "mimir": str(Path(mimir).resolve())}
    return _finish(p, out, results, counts, t2, setting=f"MIMIR {split}", model_desc=mdesc, info={}, info_keys=[],
                   skipped=skipped, notes=notes, config=config, hashes=hashes, paths=paths)


# ============================================================================================ CLI
def build_parser():
    from mia import validate as V

    ap = experiment_parser("python -m experiments.camia", __doc__, PRESETS)
    g = ap.add_argument_group("testbed (default)")
    g.add_argument("--suite-dir", default=None, help="the suite's directory (default: testbeds/suite-<preset>)")
    add_model_flags(g, testbed="a testbed directory instead of the suite (repeat for several sharing one order)",
                    member="target suite member: middle (default), largest, smallest or a size name; the smallest "
                           "is the Reference baseline's model",
                    steps="the checkpoint to evaluate, one step (default: the last)")
    g.add_argument("--n-domains", type=V.arg_int(1), default=None, help="the largest N domains (default per preset)")
    g.add_argument("--n-members", type=V.arg_int(1), default=None, help="members per domain (default per preset)")
    g.add_argument("--n-nonmembers", type=V.arg_int(1), default=None,
                   help="non-members per domain (default per preset)")
    r = ap.add_argument_group("MIMIR files and a real model")
    r.add_argument("--mimir", default=None, help="MIMIR directory (cache_100_200_1000_512/{train,test}/*.jsonl)")
    r.add_argument("--model", default=None, help="local model directory (HF layout, safetensors)")
    r.add_argument("--ref-model", default=None, help="reference model directory (the paper: stablelm-base-alpha-3b-v2)")
    r.add_argument("--split", default="ngram_7_0.2", help="MIMIR split of Table 1 (default ngram_7_0.2)")
    r.add_argument("--table2-domains", default=None, help="domains whose other n-gram splits make Table 2 "
                                                          "(default: every Table 1 domain; comma list)")
    add_identical_flag(r)
    r.add_argument("--max-per-class", type=V.arg_int(1), default=None, help="subsample each MIMIR file to N texts")
    ap.add_argument("--domains", default=None,
                    help="comma list of domains (testbed: top-level names; MIMIR: arxiv, ...)")
    ap.add_argument("--draws", type=V.arg_int(1), default=None, help="calibration draws (default 10)")
    ap.add_argument("--mlm", default=None, help="local BERT MLM directory for the Neighborhood baseline")
    ap.add_argument("--no-blind", action="store_true", help="skip the blind baseline")
    return ap


def _csv(v):
    return [x.strip() for x in v.split(",") if x.strip()] if v else None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    step = one_step(ap, a.steps, "camia")
    return run_and_report(lambda: run(
        a.preset, a.out, testbeds=a.testbed or [], suite_dir=a.suite_dir, member=a.member, step=step,
        domains=_csv(a.domains), n_domains=a.n_domains, n_members=a.n_members, n_nonmembers=a.n_nonmembers,
        draws=a.draws, memorize_epochs=a.memorize_epochs, mimir=a.mimir, model_dir=a.model, ref_model=a.ref_model,
        mlm=a.mlm, split=a.split, table2_domains=_csv(a.table2_domains), max_per_class=a.max_per_class,
        blind=not a.no_blind, seed=a.seed, bootstrap=a.bootstrap, progress=not a.no_progress,
        allow_identical_checkpoints=a.allow_identical_checkpoints, argv=argv), a, report_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
