"""Command line: ``mia score | attacks | split | blind | plan | cache | doctor`` (also ``python -m mia``).

Errors in user input are printed as one line (``error: ...``) with exit status 2; ``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .files import cache_limit
from . import validate as V
from .blind.cli import add_blind_parser
from .entry import USER_ERRORS, add_compile_cache_flag, run_for_user
from .data.cli import add_split_parser
from .data.sources import check_data_path, parse_column_map
from .documents import check_document_records, check_train_documents, score_documents, write_document_scores
from .files.hashing import check_cache_dir, default_cache_dir
from .metrics import metric_rows
from .report import metrics_table
from .results import no_metrics_reason


def _add_score_parser(sub) -> None:
    p = sub.add_parser("score", help="score examples with one or more attacks",
                       description="Score examples ({id?, text|tokens, label?}: a JSONL, JSON, CSV, TSV or Parquet "
                                   "file, or a datasets save_to_disk directory) with membership inference attacks. "
                                   "Every score: higher = more likely member.")
    p.add_argument("--model", required=True, help="local Hugging Face-layout model directory, or ORG/NAME[@REVISION] "
                                                  "from the Hugging Face cache (offline; docs/models.md)")
    p.add_argument("--data", required=True,
                   help="the examples: .jsonl (or a split file; also .ndjson or no suffix), .json (an array of rows), "
                        ".csv, .tsv or .parquet (any other suffix is refused), or a directory saved by datasets' "
                        "save_to_disk (a DatasetDict: DIR/SPLIT); docs/score.md#inputs")
    p.add_argument("--columns", type=_column_map, default=None, metavar="FIELD=COLUMN,...",
                   help="the data's column for each field it names differently, e.g. text=body,label=is_member "
                        "(fields: id, text, tokens, label, partition, doc_id); applies to every data flag")
    p.add_argument("--attacks", default="loss",
                   help="comma-separated, each NAME[:key=value,...]; `mia attacks` lists them")
    p.add_argument("--out", required=True, help="output JSONL, one line per evaluated example")
    p.add_argument("--max-length", type=V.arg_int(2), default=None,
                   help="truncate to this many tokens (default and maximum: the model context + 1; a text's last "
                        "token is only predicted, so C + 1 tokens make C predictions)")
    p.add_argument("--skip-invalid", action="store_true", help="record unusable lines (empty, <2 tokens) and continue")
    p.add_argument("--prefix-data", help="non-members for ReCaLL prefixes (disjoint from --data; any form of --data)")
    p.add_argument("--member-prefix-data",
                   help="known members for Con-ReCaLL's member prefix (disjoint from --data; any form of --data)")
    p.add_argument("--calib-data", help="calibration non-members for CAMIA p-values (disjoint from --data; any form "
                                        "of --data)")
    p.add_argument("--train-data", help="labelled training examples for learned combiners (disjoint from --data; "
                                        "any form of --data)")
    p.add_argument("--ref-model", help="reference model directory for the `ref` attack (with --adapter: the base)")
    p.add_argument("--adapter", help="PEFT LoRA adapter directory fine-tuned from --model, merged at load "
                                     "(docs/models.md#adapters)")
    p.add_argument("--mlm", help="masked language model directory for the `neighbor` attack")
    p.add_argument("--freq-corpus", help="local corpus (.jsonl with text|tokens, or plain text, one document a line) "
                                         "for the `dcpdd` token frequencies (default: the calib partition)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="precision (docs/models.md#precision); auto: float32 on a CPU, bfloat16 on a GPU/TPU")
    p.add_argument("--batch-tokens", type=V.arg_int(1), default=16384,
                   help="padded tokens per batch per data-parallel device (8 devices on `data`: 8x the rows)")
    p.add_argument("--pack", default="auto", choices=["auto", "on", "off"],
                   help="several texts per row in the token-stats pass (segment masks; scores unchanged): auto "
                        "(default) packs when that is estimated >= 5%% cheaper than one text per row, never on a GPU")
    p.add_argument("--bucket-step", type=V.arg_int(0), default=128,
                   help="rows longer than this are padded to multiples of it (0: powers of two); speed only")
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
    p.add_argument("--init-timeout", type=V.arg_float(0, 86400, lo_open=True), default=60.0,
                   help="seconds for all processes to reach the coordinator (default 60)")
    p.add_argument("--peer-timeout", type=V.arg_float(0, 86400, lo_open=True), default=30.0,
                   help="seconds a process may stay silent (no watchdog ping) before every process stops with one "
                        "line naming it (default 30; raise it for hosts that stall, e.g. on slow storage)")
    p.add_argument("--cache-dir", default=None, help="on-disk cache of model outputs (default: ~/.cache/mia)")
    p.add_argument("--cache-max-gb", type=V.arg_float(0, lo_open=True), default=None, metavar="GB",
                   help="size limit of the cache directory in GB (10^9 bytes; default $MIA_CACHE_MAX_GB or 5): the "
                        "least recently used entries are evicted")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the on-disk cache")
    p.add_argument("--seed", type=V.arg_int(0, V.INT32_MAX), default=0)
    p.add_argument("--delta", type=V.arg_float(0, 1, hi_open=True), default=None,
                   help="also print eps_lower: the (eps, delta)-DP epsilon each attack rules out with 95%% "
                        "confidence (docs/auditing.md)")
    p.add_argument("--bootstrap", type=V.arg_int(0), default=1000,
                   help="bootstrap resamples for the AUC standard error")
    p.add_argument("--no-progress", action="store_true")
    d = p.add_argument_group("document-level inference (docs/attacks.md#documents)")
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


def _column_map(text: str) -> dict:
    """argparse type of ``--columns``: ``mia.data.sources.parse_column_map``."""
    try:
        return parse_column_map(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_score(args) -> int:
    """``mia score``: the flags checked, then ``mia.score``; process 0 writes ``--out`` and prints the metrics."""
    # here, not at the top: the CLI's --help (and ``mia plan --topology``) start without jax and the engine
    from . import api  # here, not at the top: jax and the engine load only when a command runs (fast --help)
    from .engine import distributed  # (the same)

    if args.seq_tokens and not args.documents:
        raise ValueError("--seq-tokens cuts documents into sequences: it needs --documents")
    try:  # a bad name or parameter stops before any loading, naming the flag
        api.resolve_attacks(args.attacks)
    except ValueError as e:
        raise ValueError(f"--attacks: {str(e).splitlines()[0]}") from None
    api.check_request(args.attacks, ref_model=args.ref_model or (args.model if args.adapter else None), mlm=args.mlm)
    check_score_paths(args)  # every path before any work: a bad --out is not found after all the scoring
    group = distributed.settings_from(args.coordinator, args.num_processes, args.process_id)
    distributed.initialize(group, timeout=args.init_timeout,  # before any other jax call
                           inputs=score_inputs(args) if group is not None else None, peer_timeout=args.peer_timeout)
    # several processes: a failure on any one stops all of them, one line each
    with distributed.guard(debug=args.debug, user_errors=USER_ERRORS):
        scored = ("eval", "train") if args.documents else ("eval",)  # --documents: train documents are scored too
        examples = api.read_data(args.data, "--data", scored + api.LEARNED_PARTITIONS, column_map=args.columns)
        if args.documents:
            for e in examples if args.seq_tokens else ():
                e.doc_id = e.id if e.doc_id is None else e.doc_id  # one line = one document unless doc_id says so
            check_documents(examples, args.data)  # before the model is loaded
        api.check_data(examples, scored, args.skip_invalid)  # label conflicts too, before the model is loaded
        model = api.load(args.model, dtype=args.dtype, mesh=args.mesh,
                         fsdp=None if args.mesh is None else not args.no_fsdp, adapter=args.adapter)
        run = api.score(model, examples, args.attacks, prefix=args.prefix_data,
                        member_prefix=args.member_prefix_data, calib=args.calib_data, train=args.train_data,
                        max_length=args.max_length,
                        skip_invalid=args.skip_invalid, seq_tokens=args.seq_tokens, scored=scored, seed=args.seed,
                        batch_tokens=args.batch_tokens, cache=not args.no_cache, cache_dir=args.cache_dir,
                        progress=not args.no_progress, ref_model=args.ref_model, mlm=args.mlm,
                        freq_corpus=args.freq_corpus, cache_max_gb=args.cache_max_gb,
                        pack={"auto": None, "on": True, "off": False}[args.pack], bucket_step=args.bucket_step,
                        column_map=args.columns)
        if args.documents:
            check_documents(run.examples, args.data)  # again, without the lines --skip-invalid set aside
        if distributed.is_main():  # every process holds every score; process 0 alone writes and prints
            if args.documents:
                report_documents(args, run)
            else:
                run.write(args.out)
                for note in run.notes:
                    print(f"note: {note}", file=sys.stderr)
                if run.labelled:
                    print(run.metrics(n_resamples=args.bootstrap, seed=args.seed, delta=args.delta))
                elif run.scores:  # the scores are written; the table would be wrong, so say why there is none
                    print(f"note: no metrics table: {run.why_no_metrics()}", file=sys.stderr)
                print(f"wrote {len(run.examples)} scored example(s) to {args.out}", file=sys.stderr)
        distributed.barrier("mia score: done")
        distributed.finish()
    return 0


def score_inputs(args) -> dict:
    """{flag: digest} of everything every process of a multi-process ``mia score`` must agree on before any work:
    the content of the model(s) (``mia.models.hub.fingerprint``) and of every input file (``mia.files.hashing``,
    memoised), and the settings that shape the batch plan. Paths, --out and the cache flags may differ."""
    from .files import hashing  # here, not at the top: the CLI's fast start (only multi-process runs hash inputs)
    from .models.hf_cache import model_dir  # (the same)
    from .models.hub import fingerprint  # (the same)

    out = {"--model": fingerprint(model_dir(args.model))}
    if args.adapter:
        from pathlib import Path  # (the same)

        from .models.hub import adapted_fingerprint  # (the same)
        out["--adapter"] = adapted_fingerprint(model_dir(args.model), Path(args.adapter))
    for flag in ("ref_model", "mlm"):
        if getattr(args, flag):
            out["--" + flag.replace("_", "-")] = fingerprint(model_dir(getattr(args, flag)))
    for flag in ("data", "prefix_data", "member_prefix_data", "calib_data", "train_data", "freq_corpus"):
        if getattr(args, flag):
            out["--" + flag.replace("_", "-")] = hashing.path_sha256(getattr(args, flag))
    for flag in ("columns", "attacks", "max_length", "skip_invalid", "dtype", "batch_tokens", "pack", "bucket_step",
                 "mesh", "no_fsdp", "seed",
                 "documents", "doc_features", "doc_bins", "doc_classifier", "seq_tokens"):
        out["--" + flag.replace("_", "-")] = json.dumps(getattr(args, flag))
    return out


def check_documents(examples, data_path) -> None:
    """--documents: every scored line has a doc_id, a document's lines agree on label and partition, and the train
    documents are labelled with both classes (``mia.documents``), before anything is loaded or scored."""
    check_document_records(examples)
    if not any(e.partition == "eval" for e in examples):
        raise ValueError(f"{data_path}: --documents found no document in the 'eval' partition to score")
    check_train_documents({e.doc_id: e.label for e in examples if e.partition == "train"}, str(data_path))


def report_documents(args, run) -> None:
    """Document scores per attack (``mia.documents.score_documents``): the metrics table over the evaluation
    documents on stdout, one JSONL line per evaluation document in ``args.out``."""
    docs = score_documents(run.examples, run.scores, features=args.doc_features, n_bins=args.doc_bins,
                           classifier=args.doc_classifier, seed=args.seed)
    write_document_scores(args.out, docs)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"document level: {docs.n_train} train document(s), {len(docs.ids)} evaluation document(s); "
          f"features {args.doc_features}" + (f" ({args.doc_bins} bins)" if args.doc_features != "agg" else "")
          + f", classifier {args.doc_classifier}")
    why = no_metrics_reason(docs.labels)
    if why is None:
        print(metrics_table(metric_rows(docs.scores, docs.labels, docs.ids, args.bootstrap, args.seed)))
    else:
        print(f"note: no metrics table: {why.replace('example', 'document')}", file=sys.stderr)
    print(f"wrote {len(docs.ids)} scored document(s) to {args.out}", file=sys.stderr)


def check_score_paths(args) -> None:
    """Every path option of ``mia score`` checked before anything is loaded or scored (``mia.validate``)."""
    from .models.hf_cache import model_dir  # not at the top: mia.models imports jax and flax (fast --help)

    V.input_dir(model_dir(args.model, error=lambda m: V.InputError(f"--model {m}")), "--model", noun="model directory")
    for flag in ("data", "prefix_data", "member_prefix_data", "calib_data", "train_data"):
        if getattr(args, flag):
            check_data_path(getattr(args, flag), "--" + flag.replace("_", "-"))  # a file or a saved dataset
    if args.freq_corpus:
        V.input_file(args.freq_corpus, "--freq-corpus")
    if args.ref_model:
        V.input_dir(model_dir(args.ref_model, error=lambda m: V.InputError(f"--ref-model {m}")), "--ref-model",
                    noun="model directory")
    if getattr(args, "adapter", None):
        V.input_dir(args.adapter, "--adapter", noun="adapter directory")
    if args.mlm:
        V.input_dir(args.mlm, "--mlm", noun="model directory")
    V.output_file(args.out, "--out", inputs=(args.data, args.prefix_data, args.member_prefix_data, args.calib_data,
                                             args.train_data, args.freq_corpus))
    check_score_cache(args)


def check_score_cache(args) -> None:
    """The score cache's directory (``--cache-dir``, else ``$MIA_CACHE_DIR`` or ~/.cache/mia) exists and is
    writable or can be created, unless ``--no-cache``. ``main`` runs it before anything else (before the
    compilation cache, which shares the directory, is set up)."""
    cache_limit.check_env()  # a bad MIA_CACHE_MAX_GB is one error line, before any work
    if not args.no_cache and args.cache_dir:
        check_cache_dir(args.cache_dir, "--cache-dir", error=V.InputError)
    elif not args.no_cache:
        check_cache_dir(error=V.InputError)


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="compile the scoring step ahead of time and say whether it fits in memory",
                       description="Compile the scoring step on abstract parameters (nothing allocated) for the local "
                                   "devices or a TPU topology and print per-device memory. The last line is JSON.")
    p.add_argument("--model", required=True,
                   help="model directory, config.json, or a named shape such as pythia-12b (the list: an unknown name "
                        "prints it)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): what `mia score` runs there, bfloat16 for a TPU topology or a GPU, float32 "
                        "on a CPU")
    p.add_argument("--batch", type=int, default=8, help="rows per step (global, over the mesh's data axis)")
    p.add_argument("--length", type=int, default=2048, help="tokens per row")
    p.add_argument("--mesh", default=None,
                   help="e.g. data=1,model=8 (default: every device on data, params replicated)")
    p.add_argument("--topology", default=None, help="TPU topology to compile for without a TPU, e.g. v5e:2x4 "
                                                    "(needs the libtpu wheel)")
    p.add_argument("--attack", default="stats",
                   help="the step(s) to plan: stats (the pass every attack shares), camia (that pass over the 6x "
                        "repeated text), mope[:n=10,chunk=2], recall[:prefix_len=INT] or em_mia[:group=INT] (the "
                        "prefix pass and the conditional-LL call; --batch target rows, --length tokens per target), or "
                        "samia[:n=10,top_k=50] (generation: --batch prompts of the first half of --length tokens, "
                        "n samples each continuing to --length)")
    p.add_argument("--platform", default=None, choices=["cpu", "gpu", "tpu"],
                   help="the backend whose attention kernels and auto dtype to plan for (default: tpu with --topology, "
                        "else the local devices'). gpu on a host without one: cuDNN's flash attention cannot be "
                        "compiled there, the blocked kernel (linear memory as well) stands in and the plan says so")
    p.add_argument("--device-memory", default=None, help="memory of one device, e.g. 80GiB (default: the TPU "
                                                         "chip's HBM, or what the local device reports)")
    p.set_defaults(func=cmd_plan)


def _fmt(n) -> str:
    return "unknown" if n is None else f"{n / 2 ** 30:8.2f} GiB"


def cmd_plan(args) -> int:
    """``mia plan``: ``mia.engine.plan.plan_scoring`` and its figures, one per line, then one JSON line."""
    from . import sharding  # not at the top: --topology sets JAX_PLATFORMS before jax is imported (main)
    from .engine import plan  # (the same)
    from . import attacks  # noqa: F401 (the same; importing the attacks registers their planned steps)
    from .models.hub import resolve_dtype  # (the same)

    if args.batch < 1 or args.length < 2:
        raise plan.PlanError(f"--batch must be >= 1 and --length >= 2, got {args.batch} and {args.length}")
    if args.topology and args.platform not in (None, "tpu"):
        raise plan.PlanError(f"--platform {args.platform} with --topology {args.topology}: a topology is a TPU slice")
    hf = plan.read_hf_config(args.model)
    device_bytes = plan.parse_bytes(args.device_memory) if args.device_memory else None
    devices = plan.topology_devices(args.topology) if args.topology else None
    n_devices = len(devices) if devices is not None else plan.local_device_count()
    axes = sharding.parse_mesh(args.mesh, n_devices) if args.mesh else None
    attack, opts = plan.parse_plan_attack(args.attack)
    platform = "tpu" if args.topology else args.platform
    args.dtype = resolve_dtype(args.dtype, platform)
    r = plan.plan_scoring(hf, dtype=args.dtype, batch=args.batch, length=args.length, mesh_axes=axes, devices=devices,
                          device_bytes=device_bytes, attack=attack, source=plan.config_source(args.model),
                          platform=platform, **opts)
    where = f"TPU topology {args.topology}" if args.topology else "local devices"
    step = plan.planned_attack(attack).describe(opts)
    print(f"mia plan: {args.model} {args.dtype}, {step} of {args.batch} x {args.length}, {r.devices} x "
          f"{r.device_kind} ({where}), mesh {','.join(f'{k}={v}' for k, v in r.mesh.items())}")
    for name, f in (r.steps or {}).items():
        print(f"  step {name:<21}{' x '.join(map(str, f['shape'])):>12}   peak {_fmt(f['peak_bytes']).strip()}")
    names = {"xla": "xla (cuDNN flash)"} if r.platform == "gpu" else {}
    kernels = ", ".join(names.get(c, c) + ("" if c == k else f"; compiled here: {k}") for c, k in r.attention)
    print(f"  {'attention (' + r.platform + ')':<26}{kernels}")
    print(f"  parameters per device     {_fmt(r.params_bytes)}")
    print(f"  XLA arguments / temps     {_fmt(r.argument_bytes)} / {_fmt(r.temp_bytes).strip()}")
    print(f"  peak per device           {_fmt(r.peak_bytes)}   ({r.peak_source})")
    if r.group_bytes is not None:
        print(f"  largest perturbed group   {_fmt(r.group_bytes)}   (MoPe holds at most chunk copies at once)")
    print(f"  device memory             {_fmt(r.device_bytes)}")
    verdict = {True: "fits", False: "does NOT fit", None: "unknown (give --device-memory)"}[r.fits]
    print(f"  verdict                   {verdict}")
    if not args.topology and r.device_kind.lower() == "cpu" and args.dtype != "float32":
        print("  note: XLA:CPU's memory analysis is not representative of bf16/fp16 on accelerators; "
              "use --topology for TPUs, or read this as an estimate")
    if r.stand_in and r.platform == "tpu":
        print("  note: a TPU runs Pallas splash attention, which compiles only for TPU devices (give --topology); the "
              "blocked kernel stood in for it here (memory linear in the length as well; its temporaries are not "
              "splash's)")
    elif r.stand_in:
        print("  note: a GPU runs cuDNN's flash attention, which compiles only with a GPU present; the blocked kernel "
              "stood in for it here (memory linear in the length as well; its temporaries are not cuDNN's)")
    print(json.dumps(r.to_json(), sort_keys=True))
    return 0 if r.fits is not False else 1


def cmd_attacks(args) -> int:
    from .attacks.registry import available, get  # the registry imports every attack, and with them jax

    for name in available():
        spec = get(name)
        print(f"{spec.describe()}\n    {spec.doc.splitlines()[0] if spec.doc else ''}")
    return 0


def _add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="show or prune the on-disk cache (scores, file hashes, compiled programs)",
                       description="The mia cache directory ($MIA_CACHE_DIR or ~/.cache/mia) is kept under a size "
                                   "limit ($MIA_CACHE_MAX_GB, default 5 GB) by evicting the least recently used "
                                   "entries; `info` shows what it holds, `prune` deletes entries now.")
    csub = c.add_subparsers(dest="cache_command", required=True)
    i = csub.add_parser("info", help="total size, size by kind and by namespace")
    i.add_argument("--cache-dir", default=None, help="the cache directory (default: $MIA_CACHE_DIR or ~/.cache/mia)")
    i.set_defaults(func=cmd_cache_info)
    p = csub.add_parser("prune", help="delete matching entries and print what was freed")
    p.add_argument("--cache-dir", default=None, help="the cache directory (default: $MIA_CACHE_DIR or ~/.cache/mia)")
    p.add_argument("--older-than", type=V.arg_float(0), default=None, metavar="DAYS",
                   help="only entries last used more than DAYS days ago")
    p.add_argument("--model", default=None, metavar="SUBSTRING",
                   help="only namespaces whose name or model (path, fingerprint, dtype, ...) contains SUBSTRING")
    p.add_argument("--max-gb", type=V.arg_float(0), default=None, metavar="GB",
                   help="only the least recently used of those, until the cache is under GB (10^9 bytes)")
    p.add_argument("--all", action="store_true", help="every entry (when no other option is given)")
    p.set_defaults(func=cmd_cache_prune)


def _cache_root(args) -> str:
    root = args.cache_dir or default_cache_dir()
    V.input_dir(root, "--cache-dir" if args.cache_dir else "the cache directory (MIA_CACHE_DIR or ~/.cache/mia)")
    return root


def cmd_cache_info(args) -> int:
    """``mia cache info``: ``mia.files.cache_limit.info_table``."""
    print(cache_limit.info_table(_cache_root(args)))
    return 0


def cmd_cache_prune(args) -> int:
    """``mia cache prune``: ``mia.files.cache_limit.prune``, then what it freed."""
    if args.older_than is None and args.model is None and args.max_gb is None and not args.all:
        raise V.InputError("mia cache prune: give --older-than, --model, --max-gb or --all")
    root = _cache_root(args)
    gone = cache_limit.prune(root, older_than_days=args.older_than, model=args.model, max_gb=args.max_gb)
    print(cache_limit.prune_report(gone, root))
    return 0


def _add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check that mia works on this machine, and how fast: run it first",
                       description="Score a few rows with every model family's tiny model and every attention kernel "
                                   "that can run here against float32 with jax's own attention, compare a mesh of "
                                   "all local devices with one device, check the cache directories, time a "
                                   "Pythia-160m-shaped model and measure what bfloat16 costs in each attack's score. "
                                   "Prints one table; exits 1 naming the first failing check (docs/doctor.md).")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report to FILE as JSON (its directory is created; checked writable before "
                        "any check runs)")
    p.add_argument("--checks", default=None, metavar="LIST",
                   help="only these checks, comma-separated (default: platform,attention,mesh,cache,speed,precision)")
    p.add_argument("--families", default=None, metavar="LIST",
                   help="only these model families, comma-separated (default: every registered family)")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    """``mia doctor``: ``mia.doctor.doctor``'s table on stdout (progress on stderr), 1 when a check failed."""
    from .doctor import CHECKS, check_report_path, doctor, name_list, print_progress, write_report  # (jax)
    from .models.family import FAMILIES  # (the same)

    if args.json:
        check_report_path(args.json, "--json")  # before a minute of checks
    # an empty list, or a name that is not one: one error line naming the flag (an empty one ran nothing and said
    # "all checks passed")
    checks = CHECKS if args.checks is None else name_list(args.checks, "--checks", CHECKS, "doctor check(s)")
    families = (None if args.families is None
                else name_list(args.families, "--families", sorted(FAMILIES), "model family(-ies)"))
    report = doctor(checks=checks, families=families, progress=print_progress)
    print(report.table())
    if args.json:
        write_report(report, args.json)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = V.OneLineParser(prog="mia", description="Membership inference attacks on language models.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    add_compile_cache_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_score_parser(sub)
    a = sub.add_parser("attacks", help="list registered attacks and their parameters")
    a.set_defaults(func=cmd_attacks)
    add_split_parser(sub)
    add_blind_parser(sub)
    _add_plan_parser(sub)
    _add_cache_parser(sub)
    _add_doctor_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "cache_max_gb", None) is not None:
        cache_limit.set_max_gb(args.cache_max_gb)  # before the compilation cache is set up (it gets the limit too)
    if getattr(args, "topology", None) and "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the topology; do not look for a local TPU
    # `mia cache` compiles nothing; `mia doctor` compiles every program itself (a cached one would not show that
    # this machine compiles it) and leaves no programs of its own in the cache
    status, result = run_for_user(lambda: args.func(args), debug=args.debug,
                                  compile_cache=not args.no_compile_cache and args.command not in ("cache", "doctor"),
                                  on_interrupt="interrupted; finished batches are cached and will be reused",
                                  check_first=(lambda: check_score_cache(args)) if args.command == "score" else None)
    return status or int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
