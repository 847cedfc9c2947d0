"""EM-MIA's OLMoMIA table as one command: EM-MIA against Loss, Ref, Zlib, Min-K%, Min-K%++, ReCaLL and ReCaLL-Avg on
the random / easy / medium / hard / mix-1 / mix-2 graded-difficulty splits (AUC and TPR@1%FPR), beside the blind
AUC of each split.

    python -m experiments.em_mia [--preset default|smoke] [--out DIR]                  # the testbed suite
    python -m experiments.em_mia --olmo DIR --global-indices FILE --data-paths FILE [--ref-model DIR]   # OLMo-7B
        (no --preset with --olmo: the paper preset, said in one line)

1. A pool of members and non-members. Testbed: a checkpoint split of the suite's shared order at checkpoint c
   (members: rows [0, c*B); non-members: rows [c*B, E*B) of the first epoch), each row cut to its first L tokens
   with L = half the trained context, so that every text fits beside another text as EM-MIA's 1-shot prefix (the
   model never sees a position it was not trained at). OLMo (``--olmo``): the OLMoMIA recipe
   (docs/algorithms.md#difficulty): instances from steps [0, 100k) (members) and [400k, 450k) (non-members) of
   ``global_indices``, each reduced to its first document strictly between two EOS with L/2 < length <= L
   (L = 128), ``mia.data.olmo_order``; the model is the checkpoint at ``--steps`` (400k), which has seen the members and
   not the non-members. Texts that occur twice in the pool are dropped (a text both trained on and held out has no
   label).
2. The six splits: ``mia.data.difficulty`` (MiniLM embeddings, spherical k-means per class, the distance filter,
   cluster pairs by mean cross distance; docs/algorithms.md#difficulty).
3. Every attack on every split for the evaluated model(s): the suite's middle member by default (``--member``:
   largest, smallest, all, size names). ``ref`` on the testbed is the suite's smallest member (the paper uses
   StableLM-3B for OLMo-7B). ReCaLL's prefix: the largest n <= 12 shots of held-out
   non-members (not in any split) that fit the trained context beside a text; EM-MIA from every initial score
   (``em_mia:init=...``; the paper's headline init is unconfirmed); ReCaLL-Avg from the same pairwise matrix.
4. The blind AUC of each split: bag of words and MiniLM embeddings, each with logistic regression trained on a
   seeded half of the split and evaluated on the other half (no classifier is chosen on evaluation data).

Preset parameters. The paper's K = 50 and 0.6 filter leave no cluster of size/2 points on testbed pools (a few
thousand 64-token code texts; measured in docs/splits.md), so the testbed presets use a smaller K, filter and split
size, chosen so that all six splits exist and the blind AUC falls from easy to hard (see ``PRESETS``).

Outputs (``--out``, default ``results/em_mia-<preset>``): ``report.md``; ``table_auc.{md,csv,tex,json}`` and
``table_tpr.*`` (rows: model x method, plus the blind rows; columns: the six splits); ``values.{csv,json}`` (every
number with its bootstrap SE); ``summary.json``; ``splits/`` (the six split files, ``embeddings.npz``,
``difficulty.json``, the pool and the ReCaLL prefix); ``scores/<model>/<split>.jsonl``; ``manifest.json``;
``timings.json``. Same inputs and seed: the same tables and summary, byte for byte.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

import mia
from mia.files.atomic import write_text
from mia.data.splits import DROPPED_ROWS, partition_counts, read_split
from mia.metrics import metric_rows

from mia.checkpoints import (check_checkpoints, check_testbed_checkpoints, memorized_checkpoint, olmo_checkpoint,
                             olmo_order_settings, open_members, pick_members)
from mia.data.draw import check_token_ids, draw_testbed_split, SplitSizes
from mia.attacks.catalog import select_attacks
from experiments.harness import (DEFAULT_BOOTSTRAP, add_identical_flag, add_model_flags, add_olmo_flags, check_paths,
                                 flags_named, check_suite_steps, experiment_parser, ExperimentError, identical_note,
                                 one_step, run_blind_baselines, run_and_report, say_fn, score_split, sha_file, Timings,
                                 write_json, write_manifest, write_tables)
from experiments.em_mia_report import SPLITS, report_markdown, table_rows, value_rows

INITS = ("loss", "ref", "zlib", "mink", "minkpp")
MAX_SHOTS = 12  # ReCaLL's default n


@dataclasses.dataclass(frozen=True)
class Preset:
    """Settings of one preset. ``pool``: pool texts per class; ``size``: texts per split (half members)."""

    suite: str
    pool: int
    size: int
    k: int
    threshold: float
    blind: tuple = ("bow", "bert")
    doc_len: Optional[int] = None  # None: half the trained context (testbed); OLMoMIA's 128 for --olmo
    niter: int = 50
    member: str = "middle"  # suite members evaluated (mia.checkpoints.pick_members); the smallest is their Ref


PRESETS = {
    # the tests: 120 + 120 texts of 32 tokens from the smoke suite; splits of 24
    "smoke": Preset("smoke", pool=120, size=24, k=3, threshold=0.3, blind=("bow",)),
    # 1000 + 1000 texts of 64 tokens from the default suite; splits of 100 (50 + 50)
    "default": Preset("default", pool=1000, size=100, k=10, threshold=0.3),
    # OLMoMIA's clustering.py defaults: a 100,000-document pool, K = 50, the 0.6 filter, splits of 1000, L = 128
    "paper": Preset("paper", pool=50_000, size=1000, k=50, threshold=0.6, doc_len=128),
}


# ============================================================================================ the pool
def dedup_texts(examples: list) -> tuple:
    """(examples whose token ids occur exactly once, number dropped): a text that is both a member and a non-member
    (or a member twice) is ambiguous, so every copy goes. Unlike checkmiabench (``mia.data.draw.drop_label_conflicts``,
    which keeps the member of a member/non-member pair) the member copies go too: the difficulty splits cluster
    the pool's texts, and a text twice in a class would be a cluster of its own copies."""
    seen: dict = {}
    for e in examples:
        k = tuple(e["tokens"])
        seen[k] = seen.get(k, 0) + 1
    kept = [e for e in examples if seen[tuple(e["tokens"])] == 1]
    return kept, len(examples) - len(kept)


def position(e: dict) -> dict:
    """A drawn row's position as ``params.dropped_rows`` records it: label, index and (OLMo documents) segment."""
    return {"label": e["label"], "index": e["index"], **({"segment": e["segment"]} if e.get("segment") is not None
                                                         else {})}


def file_header(header: dict, rows: list, drawn: list, **params) -> dict:
    """The header of a split file that holds ``rows``, a part of the draw ``drawn`` (``position`` dicts) that
    ``header`` describes: counts and partitions are the rows', the drawn positions not in the file are its
    ``params.dropped_rows`` (``mia split check`` counts them as drawn when it re-draws the file from the seed), and
    ``params`` are added."""
    key = lambda d: (d["label"], d["index"], d.get("segment"))  # noqa: E731
    here = {key(position(e)) for e in rows}
    out = {**header, **partition_counts(rows), "params": {**header["params"], **params}}
    out["params"].pop(DROPPED_ROWS, None)
    dropped = [d for d in drawn if key(d) not in here]
    if dropped:
        out["params"][DROPPED_ROWS] = dropped
    return out


def testbed_pool(tb, step: int, pool: int, n_prefix: int, doc_len: int, seed: int) -> tuple:
    """(header, pool examples (partition eval), prefix examples (non-members), notes, drawn positions): a
    checkpoint split of ``tb`` at ``step`` with ``pool`` texts per class and ``n_prefix`` held-out non-members, each
    row cut to its first ``doc_len`` tokens (``params.cut_len``), texts that occur twice dropped. ``header``
    describes the whole draw; ``file_header`` makes each file's."""
    extra = pool // 10 + 8  # room for the duplicates dropped below
    header, examples, _ = draw_testbed_split(tb, step, SplitSizes(eval=pool + extra, prefix=n_prefix), seed)
    drawn = [position(e) for e in examples]
    for e in examples:
        e["tokens"] = e["tokens"][:doc_len]
    examples, dropped = dedup_texts(examples)
    prefix = [e for e in examples if e["partition"] == "prefix"]
    pool_ex = []
    for label in (1, 0):
        cls = [e for e in examples if e["partition"] == "eval" and e["label"] == label]
        if len(cls) < pool:
            raise ExperimentError(f"only {len(cls)} distinct {'member' if label else 'non-member'} texts of "
                                  f"{doc_len} tokens; lower --pool")
        pool_ex += cls[:pool]
    header["params"].update(doc_len=doc_len, cut_len=doc_len, cut="first doc_len tokens of each row",
                            duplicates_dropped=dropped)
    notes = [f"pool: rows cut to their first {doc_len} tokens; {dropped} text(s) occurring twice dropped"] if dropped \
        else [f"pool: rows cut to their first {doc_len} tokens"]
    return header, pool_ex, prefix, notes, drawn


def parse_steps(spec: str, flag: str) -> tuple:
    """'A:B' -> (A, B) with 0 <= A < B."""
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ExperimentError(f"{flag} {spec!r}: expected START:END steps, e.g. 400000:450000") from None
    if not 0 <= a < b:
        raise ExperimentError(f"{flag} {spec!r}: need 0 <= START < END")
    return a, b


def check_olmo_request(model_step: int, member_steps: tuple, nonmember_steps: tuple, global_indices,
                       data_paths) -> None:
    """The OLMo options that need no file read: members from step 0, a checkpoint between the member and the
    non-member ranges, both order files given and present."""
    if member_steps[0] != 0:
        raise ExperimentError(f"--member-steps {member_steps[0]}:{member_steps[1]}: members start at step 0 "
                              "(every instance before the end step was trained on)")
    if not member_steps[1] <= model_step <= nonmember_steps[0]:
        raise ExperimentError(f"--steps {model_step}: the checkpoint must have seen the members (steps < "
                              f"{member_steps[1]}) and not the non-members (steps >= {nonmember_steps[0]})")
    for flag, f in (("--global-indices", global_indices), ("--data-paths", data_paths)):
        if not f:
            raise ExperimentError(f"--olmo needs the training order: {flag} FILE")
    check_paths(files=[("--global-indices", global_indices), ("--data-paths", data_paths)])


def olmo_steps(member_steps: str, nonmember_steps: str, step: Optional[int]) -> tuple:
    """(member steps, non-member steps, checkpoint step) of the OLMo options (the checkpoint defaults to the
    non-member start)."""
    ms, ns = parse_steps(member_steps, "--member-steps"), parse_steps(nonmember_steps, "--nonmember-steps")
    return ms, ns, ns[0] if step is None else int(step)


def olmo_pool(global_indices, data_paths, *, model_step: int, member_steps: tuple, nonmember_steps: tuple,
              pool: int, n_prefix: int, doc_len: int, eos: int, batch_size: int, seq_len: int, seed: int,
              candidates: Optional[int] = None) -> tuple:
    """(header, pool examples, prefix examples, notes, drawn positions) by the OLMoMIA recipe (``mia.data.olmo_order``
    documents); ``header`` describes the whole draw, ``file_header`` makes each file's."""
    from mia.data.olmo_order import OlmoOrder, draw_checkpoint_split

    check_olmo_request(model_step, member_steps, nonmember_steps, global_indices, data_paths)
    order = OlmoOrder(global_indices, data_paths, seq_len=seq_len, batch_size=batch_size)
    header, examples = draw_checkpoint_split(
        order, member_steps[1], pool, pool + n_prefix, seed, nonmember_start=nonmember_steps[0],
        end_step=nonmember_steps[1], batch_size=batch_size, documents=True, eos=eos, doc_len=doc_len,
        pool=candidates)
    drawn = [position(e) for e in examples]
    examples, dropped = dedup_texts(examples)
    non = [e for e in examples if e["label"] == 0]
    prefix = non[:n_prefix]
    for e in prefix:
        e["partition"] = "prefix"
    pool_ex = [e for e in examples if e["label"] == 1] + non[n_prefix:]
    header["params"].update(model_step=model_step, duplicates_dropped=dropped)
    return header, pool_ex, prefix, ([f"pool: {dropped} document(s) occurring twice dropped"] if dropped else []), drawn


def n_shots(context: int, doc_len: int) -> int:
    """ReCaLL shots of ``doc_len`` tokens that fit the trained context beside one text (at most 12), at least 1."""
    return max(1, min(MAX_SHOTS, context // doc_len - 1))


# ============================================================================================ attacks and metrics
def attack_list(have_ref: bool, shots: int) -> tuple:
    """([(label, name, params)], {label: reason skipped}) in the paper's row order."""
    specs = ["loss", "ref", "zlib", "mink:k=0.2", "minkpp:k=0.2", f"recall:n={shots}", "recall_avg"] + \
        [f"em_mia:init={i}" for i in INITS]
    reasons = {"mlm": "not used",
               "ref": "needs a reference model (--ref-model, or a smaller member of the testbed suite)"}
    return select_attacks(",".join(specs), unavailable=["mlm"] + ([] if have_ref else ["ref"]), reasons=reasons)


def blind_split(split_path: Path, out_path: Path, seed: int) -> Path:
    """A copy of a split file with seeded, stratified train / eval halves (for the blind classifiers only)."""
    from mia.data.splits import partition_counts, read_split, write_split

    sp = read_split(split_path)
    rng = np.random.default_rng([int(seed), 0xB1D])
    ex = [dict(e) for e in sp.examples]
    for label in (0, 1):
        idx = [i for i, e in enumerate(ex) if e["label"] == label]
        order = rng.permutation(len(idx))
        for j, o in enumerate(order):
            ex[idx[o]]["partition"] = "train" if j < len(idx) // 2 else "eval"
    header = {k: v for k, v in sp.header.items() if k not in ("counts", "partitions", "type", "format")}
    header.update(partition_counts(ex))
    return write_split(out_path, header, ex)


def blind_rows(split_path: Path, features: Sequence[str], seed: int, bootstrap: int) -> tuple:
    """({feature: AUC, TPR, SE on the eval half}, {feature: reason}) of ``mia.blind`` with logistic regression."""
    rows, _, skipped = run_blind_baselines(split_path, seed, bootstrap, features=tuple(features), classifiers=("lr",))
    out = {}
    for f in features:
        r = next((r for r in rows or [] if r.get("kind") == "run" and r.get("method", "").lower().startswith(
            {"bow": "bow", "bert": "bert"}[f])), None)
        if r is not None:
            out[f] = {"auc": r["auc"], "auc_se": r["auc_se"], "tpr_at_1pct_fpr": r["tpr_at_1pct_fpr"],
                      "n": r.get("n_eval")}
    return out, skipped


# ============================================================================================ the run
@dataclasses.dataclass
class Target:
    """A model to evaluate: its name, checkpoint directory, reference model directory (or None), trained context."""

    name: str
    model_dir: Path
    ref_dir: Optional[Path]
    context: int
    ref_name: Optional[str] = None
    cache_dir: Optional[str] = None


def evaluate(targets: Sequence[Target], split_paths: dict, prefix: list, shots: int, *, seed: int, bootstrap: int,
             out: Path, progress: bool, timings: Timings) -> tuple:
    """({model: {split: {label: metric row}}}, skipped, notes): every attack on every split for every model."""
    results, skipped, notes, refs = {}, {}, [], {}
    for t in targets:
        model = mia.load(t.model_dir)
        attacks, sk = attack_list(t.ref_dir is not None, shots)
        skipped.update({f"{t.name}: {k}": v for k, v in sk.items()})
        options = {}
        if t.ref_dir is not None:  # loaded once: every split shares the model and its compiled code
            if str(t.ref_dir) not in refs:
                refs[str(t.ref_dir)] = mia.load(t.ref_dir)
            options["ref_model"] = refs[str(t.ref_dir)]
        results[t.name] = {}
        for s in SPLITS:
            examples = [dict(e) for e in read_split(split_paths[s]).examples] + [dict(e) for e in prefix]
            with timings(f"{t.name}:{s}"):
                run = score_split(model, examples, attacks, seed=seed, progress=progress, cache_dir=t.cache_dir,
                                  max_length=t.context, ref_model=options.get("ref_model"))
            skipped.update({f"{t.name} {s}: {k}": v for k, v in run.skipped.items()})
            for n in run.notes:
                if n not in notes:
                    notes.append(n)
            rows = metric_rows(run.scores, run.labels, run.ids, bootstrap, seed)
            results[t.name][s] = {r["method"]: {k: r.get(k) for k in ("auc", "auc_se", "tpr_at_1pct_fpr", "n",
                                                                      "n_nonfinite") if k in r} for r in rows}
            meta = {e["id"]: {k: e[k] for k in ("index", "step", "segment") if k in e} for e in examples}
            run.write(out / "scores" / t.name / f"{s}.jsonl", meta)
    return results, skipped, notes


def preset_for(preset: Optional[str], olmo) -> tuple:
    """(preset name, the line that says why, or None): an explicit ``preset`` as given; none given: ``paper``
    (OLMoMIA's recipe) with ``--olmo``, else ``default``. The choice for ``--olmo`` is announced, never silent."""
    if preset is not None:
        return preset, None
    if olmo is None:
        return "default", None
    q = PRESETS["paper"]
    return "paper", (f"preset paper: --olmo without --preset runs OLMoMIA's recipe (pool {q.pool:,} per class, "
                     f"K {q.k}, filter {q.threshold}, splits of {q.size:,}, L {q.doc_len}); give --preset to choose "
                     "another")


def run(preset: Optional[str] = None, out=None, *, testbeds: Sequence = (), suite_dir=None,
        member: Optional[str] = None, step: Optional[int] = None,
        memorize_epochs: int = 0, olmo=None, global_indices=None, data_paths=None, member_steps: str = "0:100000",
        nonmember_steps: str = "400000:450000", ref_model=None, eos: int = 50279,
        batch_size: Optional[int] = None, seq_len: Optional[int] = None, pool: Optional[int] = None,
        size: Optional[int] = None, k: Optional[int] = None, threshold: Optional[float] = None,
        doc_len: Optional[int] = None, encoder=None, embeddings=None,
        blind: bool = True, seed: int = 0, bootstrap: int = DEFAULT_BOOTSTRAP, progress: bool = True,
        allow_identical_checkpoints: bool = False, argv=None) -> dict:
    """Run the experiment; returns the summary (also written to ``out/summary.json``). With ``--olmo``, the
    checkpoint and ``--ref-model`` are opened and checked (``check_checkpoints``) before the pool is drawn;
    ``allow_identical_checkpoints``: run even when the two hold identical weights (recorded)."""
    from mia.data.difficulty import build_difficulty_splits
    from mia.data.splits import Split, write_split

    preset, why_preset = preset_for(preset, olmo)
    if preset not in PRESETS:
        raise ExperimentError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    p = dataclasses.replace(PRESETS[preset], **{a: v for a, v in (("pool", pool), ("size", size), ("k", k),
                                                                 ("threshold", threshold), ("doc_len", doc_len),
                                                                 ("member", member)) if v is not None})
    if p.size < 2 or p.pool < p.size // 2 or p.k < 1 or (p.doc_len is not None and p.doc_len < 2):
        raise ExperimentError(f"need --size >= 2, --pool >= size/2, --k >= 1, --doc-len >= 2 (got size {p.size}, "
                              f"pool {p.pool}, k {p.k}, doc_len {p.doc_len})")
    if not 0 <= p.threshold <= 2:  # 0: no filter
        raise ExperimentError(f"--threshold must be a cosine distance in [0, 2], got {p.threshold}")
    out = Path(out) if out is not None else Path("results") / f"em_mia-{'olmo' if olmo else preset}"
    # every check that needs no model, suite or data file read, before any of them
    check_paths(out=out, files=[("--embeddings", embeddings)], dirs=[("--testbed", list(testbeds)),
                                                                    ("--olmo", olmo), ("--encoder", encoder)],
                model_dirs=[("--ref-model", ref_model)], output_dirs=[("--suite-dir", suite_dir)])
    ckpt_records, identical, order_record, order_note = {}, [], None, None
    if olmo is not None:
        ms, ns, model_step = olmo_steps(member_steps, nonmember_steps, step)
        check_olmo_request(model_step, ms, ns, global_indices, data_paths)
        with flags_named(root="--olmo"):
            ckpts = {"model": olmo_checkpoint(olmo, model_step)}
        ckpts.update({"ref_model": Path(ref_model)} if ref_model else {})
        ckpt_records, identical = check_checkpoints(ckpts, allow_identical=allow_identical_checkpoints)
        batch_size, seq_len, order_record, order_note = olmo_order_settings({model_step: ckpts["model"]},
                                                                            batch_size, seq_len)
    elif ref_model is not None:
        raise ExperimentError("--ref-model goes with --olmo; on the testbed the suite's smallest member is the "
                              "reference model")
    elif not testbeds:
        check_suite_steps(p.suite, step)
    say = say_fn(progress)
    timings = Timings()
    t0 = time.perf_counter()
    (out / "splits").mkdir(parents=True, exist_ok=True)
    notes: list = ([why_preset] if why_preset else []) + ([identical_note(identical)] if identical else [])
    if order_note:
        notes.append(order_note)
    with timings("pool"):
        if olmo is not None:
            targets, header, drawn, pool_ex, prefix, shots, info = _olmo_setup(
                p, olmo, global_indices, data_paths, member_steps, nonmember_steps, ref_model, step, eos,
                batch_size, seq_len, seed, notes)
        else:
            targets, header, drawn, pool_ex, prefix, shots, info = _testbed_setup(
                p, testbeds, suite_dir, step, memorize_epochs, seed, progress, notes, timings,
                allow_identical_checkpoints)
    if why_preset:  # once the request and the order files have passed their checks (a bad input is one line)
        print(why_preset, file=sys.stderr)
    doc_len = header["params"]["doc_len"]
    header = file_header(header, pool_ex, drawn)  # each file's counts are its rows'; the rest of the draw dropped
    pool_path = write_split(out / "splits" / "pool.jsonl", header, pool_ex)
    write_split(out / "splits" / "prefix.jsonl", file_header(header, prefix, drawn, role="ReCaLL prefix"), prefix)
    say(f"pool: {len(pool_ex)} texts of <= {doc_len} tokens; building the six splits ...")
    with timings("difficulty"):
        paths = build_difficulty_splits(Split(header, pool_ex), out / "splits", encoder_dir=encoder,
                                        embeddings=embeddings, size=p.size, k=p.k, niter=p.niter, seed=42,
                                        threshold=p.threshold)
    dinfo = paths.pop("_info")
    blind_res, skipped = {}, {}
    if blind:
        with timings("blind"):
            for s in SPLITS:
                bpath = blind_split(paths[s], out / "splits" / "blind" / f"{s}.jsonl", seed)
                blind_res[s], bsk = blind_rows(bpath, p.blind, seed, bootstrap)
                skipped.update({f"blind {k}": v for k, v in bsk.items()})
    results, sk, run_notes = evaluate(targets, paths, prefix, shots, seed=seed, bootstrap=bootstrap, out=out,
                                      progress=progress, timings=timings)
    skipped.update(sk)
    notes += run_notes
    models = [t.name for t in targets]
    t_auc = table_rows(results, models, blind_res, "auc")
    t_tpr = table_rows(results, models, blind_res, "tpr_at_1pct_fpr")
    title = f"EM-MIA, graded-difficulty splits ({info['setting']})"
    write_tables(t_auc, out, "table_auc", ["model", "method", *SPLITS], title=f"{title}: AUC")
    write_tables(t_tpr, out, "table_tpr", ["model", "method", *SPLITS], title=f"{title}: TPR@1%FPR")
    values = value_rows(results, blind_res)
    from mia.report import csv_text

    write_text(out / "values.csv", csv_text(values))
    write_json(out / "values.json", {"rows": values})
    difficulty = {"params": {"size": p.size, "k": p.k, "threshold": p.threshold, "niter": p.niter, "seed": 42},
                  "info": dinfo}
    summary = {"setting": info["setting"], "description": info["description"],
               "models": [{"name": t.name, "ref": t.ref_name, "context": t.context} for t in targets],
               "pool": {"members": sum(e["label"] == 1 for e in pool_ex),
                        "nonmembers": sum(e["label"] == 0 for e in pool_ex), "doc_len": doc_len,
                        "prefix_shots": shots, "prefix_pool": len(prefix)},
               "difficulty": difficulty, "table_auc": t_auc, "table_tpr": t_tpr, "blind": blind_res,
               "results": results, "allow_identical_checkpoints": bool(allow_identical_checkpoints),
               "identical_checkpoints": identical, "skipped": skipped, "notes": notes}
    write_json(out / "summary.json", summary)
    write_text(out / "report.md", report_markdown(summary))
    write_manifest(out, module="experiments.em_mia", argv=argv, config={
        "preset": preset, "settings": dataclasses.asdict(p), "bootstrap": bootstrap, **info["config"],
        "allow_identical_checkpoints": bool(allow_identical_checkpoints)},
        seeds={"pool": seed, "kmeans": 42, "medium": [43, 44], "random": [42, 43], "blind_halves": [seed, 0xB1D],
               "bootstrap": seed},
        hashes={**info["hashes"], **({"checkpoints": ckpt_records} if ckpt_records else {}),
                **({"olmo_order": order_record} if order_record else {}),
                "pool_sha256": sha_file(pool_path),
                **{f"split_{s}_sha256": sha_file(paths[s]) for s in SPLITS}},
        paths={**info["paths"], "splits": str((out / "splits").resolve())},
        outputs=["report.md", "table_auc.*", "table_tpr.*", "values.*", "summary.json", "splits/", "scores/"])
    timings["total"] = round(time.perf_counter() - t0, 1)
    timings.write(out)
    say(f"wrote {out}/ in {timings['total']:.0f} s")
    return summary


def _testbed_setup(p: Preset, testbeds, suite_dir, step, memorize_epochs, seed, progress, notes, timings,
                   allow_identical: bool = False) -> tuple:
    with flags_named(testbeds="--testbed", member="--member"):
        members, desc, n = open_members(p.suite, testbeds=testbeds, suite_dir=suite_dir, progress=progress)
        used = {m.name: m for m in [members[0], *pick_members(members, p.member)]}  # the Ref (smallest), the targets
    notes += n
    tb0 = members[0].testbed
    c = tb0.train_steps if step is None else int(step)
    ckpt_records, identical = check_testbed_checkpoints([(f"{m.name}-step{c}", m.testbed, c) for m in used.values()],
                                                        allow_identical=allow_identical)
    if identical:
        notes.append(identical_note(identical))
    model0 = tb0.load_model(c)
    context = min(int(model0.max_length), tb0.row_len)
    doc_len = p.doc_len or context // 2
    if 2 * doc_len > context:
        raise ExperimentError(f"--doc-len {doc_len}: two texts (EM-MIA's prefix + target) must fit the trained "
                              f"context of {context} tokens")
    shots = n_shots(context, doc_len)
    header, pool_ex, prefix, pn, drawn = testbed_pool(tb0, c, p.pool, shots, doc_len, seed)
    notes += pn
    notes.append(f"ReCaLL: {shots} shot(s) of held-out non-members ({shots} x {doc_len} + {doc_len} <= {context} "
                 "trained positions)")
    header["source"]["tokenizer"] = str(tb0.root.resolve())
    ref = members[0] if len(members) > 1 else None
    dial = None
    targets = []
    for m in pick_members(members, p.member):
        model_dir = m.testbed.checkpoint_dir(c)
        if memorize_epochs and memorize_epochs > 0:
            rows = sorted({e["index"] for e in pool_ex if e["label"] == 1})
            with timings(f"memorize:{m.name}"):
                model_dir = memorized_checkpoint(m.testbed, rows, memorize_epochs, step=c, seed=seed, progress=progress)
            dial = {"epochs": int(memorize_epochs), "n_rows": len(rows)}
        r = ref if (ref is not None and m is not ref) else None
        targets.append(Target(m.name, Path(model_dir), r.testbed.checkpoint_dir(c) if r else None, context,
                              r.name if r else None, str(m.testbed.root / "cache")))
    if ref is not None:
        notes.append(f"Ref: the smallest suite member ({ref.name}, step{c}, clean) is the reference model of every "
                     "larger member")
    if dial:
        notes.append(f"memorization dial: every member trained {dial['epochs']} more epochs on the pool's "
                     f"{dial['n_rows']} member rows (whole rows; the texts are their first {doc_len} tokens)")
    evaluated = ", ".join(f"{m.name} ({m.n_params:,} parameters)" for m in pick_members(members, p.member))
    description = (f"Models: {evaluated} at checkpoint step{c} of {desc} (members "
                   f"{', '.join(m.name for m in members)}); members from rows [0, {c * tb0.batch_size}), "
                   f"non-members from rows [{c * tb0.batch_size}, {tb0.epoch_steps * tb0.batch_size}) of the shared "
                   f"order; trained context {context} tokens.")
    info = {"setting": f"testbed {p.suite}", "description": description,
            "config": {"step": c, "memorize": dial, "members": [m.name for m in members],
                       "testbed": tb0.config.to_dict()},
            "hashes": {"order_bin_sha256": tb0.manifest["data"]["bin"]["sha256"], "checkpoints": ckpt_records,
                       **{f"model_{t.name}_sha256": sha_file(t.model_dir / "model.safetensors") for t in targets}},
            "paths": {"testbeds": [str(m.testbed.root.resolve()) for m in members]}}
    return targets, header, drawn, pool_ex, prefix, shots, info


def _olmo_setup(p: Preset, olmo, global_indices, data_paths, member_steps, nonmember_steps, ref_model, step, eos,
                batch_size, seq_len, seed, notes) -> tuple:
    from mia.files.hashing import default_cache_dir
    from mia.models.hub import load_config

    ms, ns, model_step = olmo_steps(member_steps, nonmember_steps, step)
    with flags_named(root="--olmo"):
        model_dir = olmo_checkpoint(olmo, model_step)
    doc_len = p.doc_len or 128
    _, cfg, _ = load_config(model_dir)  # context and vocabulary from config.json; the weights load in evaluate()
    context, vocab_size = int(getattr(cfg, "max_position_embeddings", 2048) or 2048), int(cfg.vocab_size)
    shots = n_shots(context, doc_len)
    header, pool_ex, prefix, pn, drawn = olmo_pool(global_indices, data_paths, model_step=model_step, member_steps=ms,
                                            nonmember_steps=ns, pool=p.pool, n_prefix=shots, doc_len=doc_len,
                                            eos=eos, batch_size=batch_size, seq_len=seq_len, seed=seed)
    notes += pn
    check_token_ids(pool_ex + prefix, vocab_size, "--data-paths", f"--olmo {model_dir}")
    header["source"]["tokenizer"] = str(Path(model_dir).resolve())
    header["params"]["doc_len"] = doc_len
    notes.append(f"ReCaLL: {shots} shot(s) of held-out non-member documents")
    target = Target(Path(model_dir).name, Path(model_dir), Path(ref_model) if ref_model else None, context,
                    Path(ref_model).name if ref_model else None, default_cache_dir())
    info = {"setting": f"OLMo {Path(model_dir).name}",
            "description": (f"Model: {model_dir}; members: documents of instances from steps [{ms[0]}, {ms[1]}), "
                            f"non-members: from steps [{ns[0]}, {ns[1]}) of {global_indices} (batch {batch_size}, "
                            f"{seq_len}-token instances, EOS {eos}, {doc_len // 2} < length <= {doc_len})."),
            "config": {"model_step": model_step, "member_steps": list(ms), "nonmember_steps": list(ns), "eos": eos,
                       "batch_size": batch_size, "seq_len": seq_len, "ref_model": str(ref_model) if ref_model
                       else None},
            "hashes": {"model_sha256": {f.name: sha_file(f) for f in sorted(Path(model_dir).glob("*.safetensors"))}},
            "paths": {"model": str(Path(model_dir).resolve()), "global_indices": str(Path(global_indices).resolve()),
                      "data_paths": str(Path(data_paths).resolve())}}
    return [target], header, drawn, pool_ex, prefix, shots, info


# ============================================================================================ CLI
def build_parser():
    from mia import validate as V

    ap = experiment_parser("python -m experiments.em_mia", __doc__, PRESETS, preset_help=(
        f"settings preset: {', '.join(PRESETS)} (default: default; with --olmo: paper, said in one line)"))
    ap.set_defaults(preset=None)  # none given: default, or paper with --olmo (announced: preset_for)
    g = ap.add_argument_group("testbed suite (default)")
    g.add_argument("--suite-dir", default=None, help="the suite's directory (default: testbeds/suite-<preset>)")
    add_model_flags(g, member="suite members to evaluate: middle (default), largest, smallest, all or size names; "
                              "the smallest member is the others' Ref",
                    steps="the checkpoint, one step (testbed: default the last; OLMo: default the non-member start, "
                          "400000)")
    o = ap.add_argument_group("OLMo-7B (the OLMoMIA recipe)")
    add_olmo_flags(o)
    o.add_argument("--member-steps", default="0:100000", help="member instances' steps (default 0:100000)")
    o.add_argument("--nonmember-steps", default="400000:450000", help="non-member steps (default 400000:450000)")
    o.add_argument("--ref-model", default=None, help="reference model directory (the paper: stablelm-base-alpha-3b-v2)")
    o.add_argument("--eos", type=V.arg_int(0, V.INT32_MAX), default=50279, help="end-of-text token id (50279)")
    add_identical_flag(o)
    d = ap.add_argument_group("difficulty splits (default per preset)")
    d.add_argument("--pool", type=V.arg_int(1), default=None, help="pool texts per class")
    d.add_argument("--size", type=V.arg_int(2), default=None, help="texts per split (half members)")
    d.add_argument("--k", type=V.arg_int(1), default=None, help="k-means clusters per class")
    d.add_argument("--threshold", type=V.arg_float(0, 2), default=None, help="cosine-distance filter inside clusters")
    d.add_argument("--doc-len", type=V.arg_int(2), default=None, help="text length L in tokens")
    d.add_argument("--encoder", default=None, help="local sentence encoder directory (default: MiniLM-L6)")
    d.add_argument("--embeddings", default=None, help="reuse an embeddings.npz of the same pool")
    ap.add_argument("--no-blind", action="store_true", help="skip the blind rows")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    step = one_step(ap, a.steps, "em_mia")
    return run_and_report(lambda: run(
        a.preset, a.out, testbeds=a.testbed or [], suite_dir=a.suite_dir, member=a.member, step=step,
        memorize_epochs=a.memorize_epochs,
        olmo=a.olmo, global_indices=a.global_indices, data_paths=a.data_paths, member_steps=a.member_steps,
        nonmember_steps=a.nonmember_steps, ref_model=a.ref_model, eos=a.eos, batch_size=a.batch_size,
        seq_len=a.seq_len, pool=a.pool, size=a.size, k=a.k, threshold=a.threshold, doc_len=a.doc_len,
        encoder=a.encoder, embeddings=a.embeddings, blind=not a.no_blind, seed=a.seed, bootstrap=a.bootstrap,
        progress=not a.no_progress, allow_identical_checkpoints=a.allow_identical_checkpoints, argv=argv),
        a, report_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
