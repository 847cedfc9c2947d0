"""Command line: ``mia score | split | blind ...`` (also ``python -m mia``).

Errors in user input are printed as one line (``error: ...``) with exit status 2; ``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import validate as V


def _add_score_parser(sub) -> None:
    p = sub.add_parser("score", help="score examples with one or more attacks",
                       description="Score a JSONL file ({id, text|tokens, label?}) with membership inference attacks. "
                                   "Every score: higher = more likely member.")
    p.add_argument("--model", required=True, help="local Hugging Face-layout model directory, or ORG/NAME[@REVISION] "
                                                  "from the Hugging Face cache (offline; docs/models.md)")
    p.add_argument("--data", required=True, help="JSONL examples or a split file")
    p.add_argument("--attacks", default="loss", help="comma-separated, each NAME[:key=value,...]; `mia attacks` lists them")
    p.add_argument("--out", required=True, help="output JSONL, one line per evaluated example")
    p.add_argument("--max-length", type=V.arg_int(2), default=None, help="truncate to this many tokens (default: model context)")
    p.add_argument("--skip-invalid", action="store_true", help="record unusable lines (empty, <2 tokens) and continue")
    p.add_argument("--prefix-data", help="JSONL of non-members for ReCaLL prefixes (disjoint from --data)")
    p.add_argument("--member-prefix-data", help="JSONL of known members for Con-ReCaLL's member prefix (disjoint from --data)")
    p.add_argument("--calib-data", help="JSONL of calibration non-members for CAMIA p-values (disjoint from --data)")
    p.add_argument("--train-data", help="JSONL of labelled training examples for learned combiners (disjoint from --data)")
    p.add_argument("--ref-model", help="reference model directory for the `ref` attack")
    p.add_argument("--mlm", help="masked language model directory for the `neighbor` attack")
    p.add_argument("--freq-corpus", help="local corpus (.jsonl with text|tokens, or plain text, one document a line) "
                                         "for the `dcpdd` token frequencies (default: the calib partition)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="README: Precision policy")
    p.add_argument("--batch-tokens", type=V.arg_int(1), default=16384,
                   help="padded tokens per batch per data-parallel device (8 devices on `data`: 8x the rows)")
    p.add_argument("--mesh", default=None, metavar="AXES",
                   help="device mesh, e.g. data=2,model=4 (product = the number of devices); parameters are "
                        "sharded FSDP over data and tensor-parallel over model. Default: every device on data, "
                        "parameters replicated")
    p.add_argument("--no-fsdp", action="store_true", help="with --mesh: keep parameters replicated over data")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes (hosts) under jax.distributed: process 0's address "
                        "(or JAX_COORDINATOR_ADDRESS); process 0 alone writes --out")
    p.add_argument("--num-processes", type=V.arg_int(1), default=None, help="with --coordinator (or JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=V.arg_int(0), default=None, help="with --coordinator (or JAX_PROCESS_ID)")
    p.add_argument("--init-timeout", type=V.arg_float(0, lo_open=True), default=60.0,
                   help="seconds for all processes to reach the coordinator (default 60)")
    p.add_argument("--cache-dir", default=None, help="on-disk cache of model outputs (default: ~/.cache/mia)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the on-disk cache")
    p.add_argument("--seed", type=V.arg_int(0, V.INT32_MAX), default=0)
    p.add_argument("--bootstrap", type=V.arg_int(0), default=1000, help="bootstrap resamples for the AUC standard error")
    p.add_argument("--no-progress", action="store_true")
    d = p.add_argument_group("document-level inference (README: Document-level MIA)")
    d.add_argument("--documents", action="store_true",
                   help="each line is one sequence of the document named by its 'doc_id'; sequence scores of each "
                        "attack are aggregated per document and a classifier trained on the 'train' documents scores "
                        "the 'eval' ones; --out gets one line per evaluation document")
    d.add_argument("--doc-features", default="hist", choices=("hist", "agg", "both"),
                   help="hist: fraction of a document's sequence scores per bin (the paper's HistFE); agg: mean, min, "
                        "max, std, count and percentiles (AggFE); both (default hist)")
    d.add_argument("--doc-bins", type=V.arg_int(1), default=10, help="histogram bins, fixed on the train documents")
    d.add_argument("--doc-classifier", default="rf", choices=("rf", "lr"),
                   help="rf: random forest (the paper's), lr: logistic regression (default rf)")
    d.add_argument("--seq-tokens", type=V.arg_int(2), default=None,
                   help="cut each eval/train line (a whole document, or a part of one) into sequences of this many "
                        "tokens (the last one shorter); 'doc_id' defaults to the line's id")
    p.set_defaults(func=cmd_score)


def default_cache_dir() -> str:
    from .file_hash import default_cache_dir as cache_root

    return cache_root()


def cmd_score(args) -> int:
    from . import distributed
    from .attacks import AttackContext, assert_disjoint, parse_attacks
    from .attacks.registry import get
    from .data.examples import read_examples, tokenize_examples
    from .models import load
    from .scoring import ScoringSettings

    attacks = parse_attacks(args.attacks)  # fail on a bad name before loading anything
    check_attack_inputs(attacks, args)
    check_score_paths(args)  # every path before any work: a bad --out is not found after all the scoring
    group = distributed.settings_from(args.coordinator, args.num_processes, args.process_id)
    distributed.initialize(group, timeout=args.init_timeout)  # before any other jax call
    mesh = engine_mesh(args.mesh)
    _, examples = read_examples(args.data, what="--data")
    scored = ("eval", "train") if args.documents else ("eval",)  # --documents: train documents are scored too
    if args.seq_tokens and not args.documents:
        raise ValueError("--seq-tokens cuts documents into sequences: it needs --documents")
    if args.documents:
        for e in examples if args.seq_tokens else ():
            e.doc_id = e.id if e.doc_id is None else e.doc_id  # one line = one document unless doc_id says otherwise
        check_documents(examples, args.data)  # before the model is loaded
    model = load(args.model, dtype=args.dtype, mesh=mesh, fsdp=None if mesh is None else not args.no_fsdp)
    max_length = args.max_length if args.max_length is not None else model.max_length
    if max_length > model.max_length:
        raise ValueError(f"--max-length {max_length} exceeds the model context ({model.max_length})")
    if args.seq_tokens and args.seq_tokens > model.max_length:
        raise ValueError(f"--seq-tokens {args.seq_tokens} exceeds the model context ({model.max_length})")
    data_notes: list[str] = []
    whole = [e for e in examples if e.partition in scored] if args.seq_tokens else []
    tokenize_examples(whole, model.tokenizer, None, args.skip_invalid, model.vocab_size, notes=data_notes)
    whole_ids = {id(e) for e in whole}
    tokenize_examples([e for e in examples if id(e) not in whole_ids], model.tokenizer, max_length,
                      args.skip_invalid, model.vocab_size, notes=data_notes)
    if args.seq_tokens:
        from .documents import chunk_examples

        examples = chunk_examples(examples, args.seq_tokens, scored)

    partitions: dict = {}
    for e in examples:
        if e.partition not in scored:
            partitions.setdefault(e.partition, []).append(e)
    for name, path in (("prefix", args.prefix_data), ("member_prefix", args.member_prefix_data),
                       ("calib", args.calib_data), ("train", args.train_data)):
        if path:
            _, extra = read_examples(path, what=f"--{name}-data")
            tokenize_examples(extra, model.tokenizer, max_length, True, model.vocab_size, notes=data_notes)
            partitions.setdefault(name, []).extend(e for e in extra if e.invalid is None)
    evaluated = [e for e in examples if e.partition in scored and e.invalid is None]
    if not evaluated:
        raise ValueError(f"{args.data}: no valid examples in the evaluation partition")
    if args.documents:
        check_documents(evaluated, args.data)  # again, without the lines --skip-invalid set aside
    check_attack_inputs(attacks, args, partitions)  # before the first attack runs, not after the others
    for name, part in partitions.items():
        assert_disjoint(evaluated, part, f"partition {name!r}")

    settings = ScoringSettings(token_budget=args.batch_tokens, progress=not args.no_progress,
                               cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()))
    options = {"seed": args.seed, "ref_model": args.ref_model, "mlm": args.mlm, "max_length": max_length}
    if args.freq_corpus:
        from .data.freq_corpus import read_corpus

        options["freq_corpus"] = read_corpus(args.freq_corpus, model.tokenizer, model.vocab_size)
    ctx = AttackContext(model, evaluated, settings, partitions, options)
    scores: dict[str, np.ndarray] = {}
    timings = {}
    for label, name, params in attacks:
        t0 = time.perf_counter()
        s = np.asarray(get(name).fn(ctx, **params), dtype=np.float64)
        if s.shape != (len(evaluated),):
            raise AssertionError(f"attack {name} returned shape {s.shape}, expected ({len(evaluated)},)")
        scores[label] = s
        timings[label] = time.perf_counter() - t0

    if distributed.is_main() and args.documents:
        report_documents(args, evaluated, scores, data_notes + ctx.notes)
    elif distributed.is_main():  # every process holds every score; process 0 alone writes and prints
        write_scores(args.out, examples, evaluated, scores)
        for note in data_notes + ctx.notes:
            print(f"note: {note}", file=sys.stderr)
        labels = np.array([e.label if e.label is not None else -1 for e in evaluated])
        if (labels >= 0).all() and len(set(labels.tolist())) == 2:
            print(metrics_table(scores, labels, n_resamples=args.bootstrap, seed=args.seed))
        print(f"wrote {len(evaluated)} scored example(s) to {args.out}", file=sys.stderr)
    distributed.barrier("mia score: done")
    return 0


def check_documents(examples, data_path) -> None:
    """--documents: every scored line has a doc_id, a document's lines agree on label and partition, and the train
    documents are labelled with both classes (``mia.documents``), before anything is loaded or scored."""
    from .documents import check_document_records, check_train_documents

    check_document_records(examples)
    if not any(e.partition == "eval" for e in examples):
        raise ValueError(f"{data_path}: --documents found no document in the 'eval' partition to score")
    check_train_documents({e.doc_id: e.label for e in examples if e.partition == "train"}, str(data_path))


def report_documents(args, evaluated, scores: dict, notes: list) -> None:
    """Document scores per attack (``mia.documents.fit_and_score_documents``): the metrics table over the evaluation
    documents on stdout, one JSONL line per evaluation document in ``args.out``."""
    from .atomic import atomic_write
    from .documents import fit_and_score_documents, group_by_document, values_per_document

    doc_ids, groups = group_by_document([e.doc_id for e in evaluated])
    first = [evaluated[ix[0]] for ix in groups]
    is_train = np.array([e.partition == "train" for e in first], bool)
    labels = np.array([-1 if e.label is None else e.label for e in first])
    doc_scores = {}
    for label, s in scores.items():
        values = values_per_document(s, groups)
        doc_scores[label] = fit_and_score_documents(
            [v for v, t in zip(values, is_train) if t], labels[is_train],
            [v for v, t in zip(values, is_train) if not t], features=args.doc_features, n_bins=args.doc_bins,
            classifier=args.doc_classifier, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as f:
        for r, i in enumerate(np.flatnonzero(~is_train)):
            f.write(json.dumps({"doc_id": doc_ids[i], "label": first[i].label, "n_sequences": len(groups[i]),
                                "scores": {k: _finite_or_none(v[r]) for k, v in doc_scores.items()}}) + "\n")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    eval_labels = labels[~is_train]
    print(f"document level: {int(is_train.sum())} train document(s), {int((~is_train).sum())} evaluation document(s); "
          f"features {args.doc_features}" + (f" ({args.doc_bins} bins)" if args.doc_features != "agg" else "")
          + f", classifier {args.doc_classifier}")
    if (eval_labels >= 0).all() and len(set(eval_labels.tolist())) == 2:
        print(metrics_table(doc_scores, eval_labels, n_resamples=args.bootstrap, seed=args.seed))
    print(f"wrote {int((~is_train).sum())} scored document(s) to {args.out}", file=sys.stderr)


def check_score_paths(args) -> None:
    """Every path option of ``mia score`` checked before anything is loaded or scored (``mia.validate``)."""
    from .models.hf_cache import model_dir  # ORG/NAME[@REVISION]: its snapshot in the Hugging Face cache

    V.input_dir(model_dir(args.model, error=lambda m: V.InputError(f"--model {m}")), "--model", noun="model directory")
    V.input_file(args.data, "--data")
    for flag in ("prefix_data", "member_prefix_data", "calib_data", "train_data", "freq_corpus"):
        if getattr(args, flag):
            V.input_file(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.ref_model:
        V.input_dir(model_dir(args.ref_model, error=lambda m: V.InputError(f"--ref-model {m}")), "--ref-model",
                    noun="model directory")
    if args.mlm:
        V.input_dir(args.mlm, "--mlm", noun="model directory")
    V.output_file(args.out, "--out", inputs=(args.data, args.prefix_data, args.member_prefix_data, args.calib_data,
                                             args.train_data, args.freq_corpus))
    if not args.no_cache and args.cache_dir:
        V.output_dir(args.cache_dir, "--cache-dir")
    elif not args.no_cache:
        V.output_dir(default_cache_dir(), "the cache directory (MIA_CACHE_DIR or ~/.cache/mia)")


def check_attack_inputs(attacks, args, partitions: dict | None = None) -> None:
    """What the chosen attacks need from the command line: --ref-model / --mlm (always), and, once the data are read
    (``partitions`` given), a non-empty learned-from partition for each ``prefix``/``calib``/``train`` need, member
    prefix shots for ``member_prefix`` (conrecall: the member_prefix partition, else the train partition's members)
    and a frequency corpus for ``freq`` (dcpdd: --freq-corpus, else the calib partition); the attacks check their
    own minimum sizes."""
    from .attacks.registry import AttackError, get

    flags = {"prefix": "--prefix-data", "calib": "--calib-data", "train": "--train-data"}
    for label, name, params in attacks:
        needs = set(get(name).needs) | ({"ref"} if params.get("init") == "ref" else set())
        if "ref" in needs and not args.ref_model:
            raise AttackError(f"attack {label} needs a reference model: give --ref-model DIR (a local model directory)")
        if "mlm" in needs and not args.mlm:
            raise AttackError(f"attack {label} needs a masked language model: give --mlm DIR (a local BERT MLM "
                              "directory)")
        for need in needs & set(flags) if partitions is not None else ():
            if not partitions.get(need):
                raise AttackError(f"attack {label} needs '{need}' examples, got none (give {flags[need]} FILE or a "
                                  f"split with a '{need}' partition)")
        if partitions is not None:
            check_member_prefix_and_freq(label, needs, params, args, partitions)


def check_member_prefix_and_freq(label: str, needs: set, params: dict, args, partitions: dict) -> None:
    """The ``member_prefix`` need (conrecall's own shot selection, ``select_member_shots``, for its ``n``) and the
    ``freq`` need, from the partitions read (see ``check_attack_inputs``)."""
    from .attacks.conrecall import select_member_shots
    from .attacks.registry import AttackError

    if "member_prefix" in needs:
        select_member_shots(partitions, max(1, int(params.get("n", 1))))
    if "freq" in needs and not getattr(args, "freq_corpus", None) and not partitions.get("calib"):
        raise AttackError(f"attack {label} needs a token-frequency corpus, got none (give --freq-corpus FILE, or "
                          "--calib-data / a split with a 'calib' partition)")


def engine_mesh(text):
    """The Mesh asked for by ``--mesh`` (checked against the visible devices of every process), or None."""
    if not text:
        return None
    import jax

    from .sharding import make_mesh, parse_mesh

    return make_mesh(parse_mesh(text, len(jax.devices())))


def write_scores(path, examples, evaluated, scores: dict) -> None:
    """One line per example of the evaluation partition, input order; invalid ones keep their reason."""
    row_of = {id(e): i for i, e in enumerate(evaluated)}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    from .atomic import atomic_write

    with atomic_write(out) as f:
        for e in examples:
            if e.partition != "eval":
                continue
            line = {"id": e.id, "label": e.label, "n_tokens": e.n_tokens, "truncated": e.truncated}
            if e.invalid is not None:
                line["invalid"] = e.invalid
                line["scores"] = None
            else:
                r = row_of[id(e)]
                line["scores"] = {k: _finite_or_none(v[r]) for k, v in scores.items()}
            f.write(json.dumps(line) + "\n")


def _finite_or_none(x):
    x = float(x)
    return x if np.isfinite(x) else None


def metrics_table(scores: dict, labels: np.ndarray, n_resamples: int = 1000, seed: int = 0) -> str:
    from .metrics import summary_row

    lines = [f"{'attack':<28} {'AUC':>7} {'AUC SE':>7} {'TPR@1%FPR':>10}", "-" * 55]
    for name, s in scores.items():
        ok = np.isfinite(s)
        if not ok.any():
            lines.append(f"{name:<28} no metrics: all {len(s)} scores are non-finite (NaN/inf)")
            continue
        if ok.sum() < len(s):
            lines.append(f"{name:<28} {int((~ok).sum())} non-finite score(s); metrics on the rest")
        if len(set(labels[ok].tolist())) < 2:
            lines.append(f"{name:<28} no metrics: the finite scores are all of "
                         f"{'members' if labels[ok][0] == 1 else 'non-members'}")
            continue
        r = summary_row(name, s[ok], labels[ok], n_resamples=n_resamples, seed=seed)
        lines.append(f"{name:<28} {r['auc']:7.4f} {r['auc_se']:7.4f} {r['tpr_at_1pct_fpr']:10.4f}")
    return "\n".join(lines)


def cmd_attacks(args) -> int:
    from .attacks.registry import get, available

    for name in available():
        spec = get(name)
        print(f"{spec.describe()}\n    {spec.doc.splitlines()[0] if spec.doc else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = V.OneLineParser(prog="mia", description="Membership inference attacks on language models.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    add_compile_cache_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_score_parser(sub)
    a = sub.add_parser("attacks", help="list registered attacks and their parameters")
    a.set_defaults(func=cmd_attacks)
    for module, fn in (("mia.data.cli", "add_split_parser"), ("mia.blind.cli", "add_blind_parser"),
                       ("mia.plan", "add_plan_parser")):
        try:
            mod = __import__(module, fromlist=[fn])
        except ImportError:
            continue
        getattr(mod, fn)(sub)
    return parser


USER_ERRORS = (ValueError, FileNotFoundError, KeyError)  # raised with a one-line message about the user's input


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use the persistent XLA compilation cache (<cache dir>/xla; also MIA_COMPILE_CACHE=0)")


def run_for_user(fn, *, debug: bool = False, on_interrupt: str = "interrupted", compile_cache: bool = True):
    """(exit status, result) of ``fn()``: a user-input error prints one ``error: ...`` line and gives status 2
    (``debug`` re-raises it with its traceback); Ctrl-C prints ``on_interrupt`` and gives 130.

    Every entry point runs through here, so this also turns on the persistent compilation cache
    (``mia.compile_cache``; off with ``compile_cache=False`` or ``MIA_COMPILE_CACHE=0``).
    """
    from .compile_cache import enable_compile_cache

    enable_compile_cache(enabled=compile_cache)
    try:
        return 0, fn()
    except USER_ERRORS as e:
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2, None
    except KeyboardInterrupt:
        print(on_interrupt, file=sys.stderr)
        return 130, None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    status, result = run_for_user(lambda: args.func(args), debug=args.debug, compile_cache=not args.no_compile_cache,
                                  on_interrupt="interrupted; finished batches are cached and will be reused")
    return status or int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
