"""``mia split pythia|olmo|text|check``: draw, build and check split files.

``add_split_parser(subparsers)`` registers the ``split`` command; every sub-command sets ``func(args) -> int``.
Errors are ``ValueError`` subclasses with a one-line message (the main CLI prints ``error: <message>``, exit 2).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import validate as V
from . import olmo_order, pythia, text
from .difficulty import add_difficulty_parser
from .indexed import IndexedDataset
from .splits import SplitError, parse_partitions, partition_total, write_split
from .verify import verify_split


def _counts(args, parts):
    """--n-members / --n-nonmembers, defaulting to the partitions' total when they are all counts."""
    total = partition_total(parts) if parts else None
    out = []
    for name in ("n_members", "n_nonmembers"):
        v = getattr(args, name)
        if v is None:
            if total is None:
                raise SplitError(f"give --{name.replace('_', '-')} (or --partition with counts only)")
            v = total
        if v < 0:
            raise SplitError(f"--{name.replace('_', '-')} must be non-negative")
        out.append(v)
    return out


def _summary(out, header) -> str:
    c = header["counts"]
    parts = ", ".join(f"{k}: {v['members']}+{v['nonmembers']}" for k, v in header.get("partitions", {}).items())
    return f"wrote {out}: {c['members']} members, {c['nonmembers']} non-members ({parts})"


def _vocab_bound(args):
    """The model's vocabulary size from --vocab-size, or --model DIR's config.json (``vocab_size``), or None."""
    if args.vocab_size is not None:
        if args.vocab_size <= 0:
            raise SplitError(f"--vocab-size must be positive, got {args.vocab_size}")
        return args.vocab_size
    if args.model is None:
        return None
    import json
    from pathlib import Path

    cfg = Path(args.model) / "config.json"
    if not cfg.exists():
        raise SplitError(f"--model {args.model}: no config.json")
    try:
        cfg_obj = json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise SplitError(
            f"{cfg}: not readable JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    v = cfg_obj.get("vocab_size") if isinstance(cfg_obj, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise SplitError(f"{cfg}: vocab_size {v!r} is not a positive integer")
    return v


def _print_notes(header) -> None:
    for note in header["source"].get("notes") or []:
        print(f"note: {note}", file=sys.stderr)


def checkpoint_step(parser, help: str) -> None:
    """``--steps S``: the one checkpoint a split is drawn at, spelled as the experiments spell it (``--step`` is
    refused naming ``--steps``)."""
    parser.add_argument("--steps", type=V.arg_int_list(0), required=True, metavar="S", help=help + " (one step)")
    V.add_renamed_flag(parser, "--step", "--steps")


def one_step(args) -> int:
    """The single step of ``--steps`` (a split is drawn at one checkpoint)."""
    if len(args.steps) != 1:
        raise SplitError(f"--steps {','.join(map(str, args.steps))}: a split is drawn at one checkpoint; give one step")
    return int(args.steps[0])


def _run_pythia(args) -> int:

    parts = parse_partitions(args.partition)
    n_m, n_n = _counts(args, parts)
    data = args.data if len(args.data) > 1 else args.data[0]
    wanted = {"--data": ".bin file (or the PATH prefix of PATH.bin and PATH.idx)", "--idx": ".idx file"}
    for flag, path in [("--data", d) for d in args.data] + [("--idx", args.idx)]:
        if path is not None and Path(path).is_dir():
            raise SplitError(f"{flag} {path}: is a directory, expected a {wanted[flag]}")
    ds = IndexedDataset(data, idx_path=args.idx)
    header, ex = pythia.draw_checkpoint_split(ds, one_step(args), n_m, n_n, args.seed, gap=args.gap,
                                              end_step=args.end_step, batch_size=args.batch_size,
                                              partitions=parts or None, vocab_size=_vocab_bound(args))
    write_split(args.out, header, ex)
    p = header["params"]
    print(_summary(args.out, header) + f"; member steps {p['member_steps']}, non-member steps {p['nonmember_steps']}")
    return 0


def _run_olmo(args) -> int:

    parts = parse_partitions(args.partition)
    n_m, n_n = _counts(args, parts)
    order = olmo_order.OlmoOrder(args.global_indices, args.data_paths, seq_len=args.seq_len, batch_size=args.batch_size,
                      token_dtype=args.token_dtype, indices_format=args.global_indices_format)
    header, ex = olmo_order.draw_checkpoint_split(order, one_step(args), n_m, n_n, args.seed,
                                            nonmember_start=args.nonmember_start, end_step=args.end_step,
                                            partitions=parts or None, documents=args.documents, eos=args.eos,
                                            doc_len=args.doc_len, pool=args.pool, vocab_size=_vocab_bound(args))
    _print_notes(header)
    header["source"]["global_indices_format"] = args.global_indices_format
    write_split(args.out, header, ex)
    p = header["params"]
    print(_summary(args.out, header) + f"; member steps {p['member_steps']}, non-member steps {p['nonmember_steps']}")
    return 0


def _parse_ngram(spec):
    if spec is None:
        return None
    for sep in (":", "_", ","):
        if sep in spec:
            a, b = spec.split(sep, 1)
            try:
                return int(a), float(b)
            except ValueError:
                break
    raise SplitError(f"bad --ngram-filter {spec!r}: expected N:THRESHOLD (e.g. 13:0.8 or 13_0.8)")


def _run_text(args) -> int:

    parts = parse_partitions(args.partition)
    ngram = _parse_ngram(args.ngram_filter)
    if args.format == "mimir":
        ex, files = text.load_mimir(file=args.file, member=args.member, nonmember=args.nonmember, domain=args.domain,
                                    text_column=args.text_column, member_column=args.member_column,
                                    nonmember_column=args.nonmember_column)
    else:
        if args.file is None:
            raise SplitError(f"--format {args.format} needs --file")
        if args.format == "wikimia":
            ex, files = text.load_wikimia(args.file, text_column=args.text_column or "input",
                                          label_column=args.label_column or "label")
        else:
            ex, files = text.load_generic(args.file, text_column=args.text_column or "text",
                                          label_column=args.label_column or "label", id_column=args.id_column)
    ref = None
    if args.ngram_reference:
        rows, rf = text.load_rows(args.ngram_reference)
        ref = [text._text_of(r, args.text_column if args.format != "wikimia" else None, f"{rf[0]} row {i}")
               for i, r in enumerate(rows)]
        files = list(files) + list(rf)
    n_m, n_n = args.n_members, args.n_nonmembers
    if parts and partition_total(parts) is not None:
        n_m = partition_total(parts) if n_m is None else n_m
        n_n = partition_total(parts) if n_n is None else n_n
    params = {"format": args.format, "domain": args.domain, "text_column": args.text_column,
              "label_column": args.label_column, "id_column": args.id_column}
    header, out = text.build_text_split(ex, files, params, n_members=n_m, n_nonmembers=n_n, seed=args.seed,
                                        partitions=parts or None, ngram=ngram, ngram_reference=ref)
    write_split(args.out, header, out)
    msg = _summary(args.out, header)
    if ngram:
        msg += f"; n-gram filter dropped {header['params']['ngram_filter']['dropped']} non-members"
    print(msg)
    return 0


def _run_check(args) -> int:
    if args.max_problems < 0:
        raise SplitError(f"--max-problems must be non-negative, got {args.max_problems}")
    report = verify_split(args.split, verify_hashes=not args.no_hash, vocab_size=_vocab_bound(args))
    problems = report.problems
    for p in problems[: args.max_problems]:
        print(f"{args.split}: {p}")
    if len(problems) > args.max_problems:
        print(f"{args.split}: ... {len(problems) - args.max_problems} more problems")
    for line in report.not_verified:
        print(f"{args.split}: not verified: {line}")
    if problems:
        print(f"{args.split}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    if report.not_verified:
        print(f"{args.split}: no problem found, but {len(report.not_verified)} verification(s) could not be done "
              "(listed above)")
        return 0
    print(f"{args.split}: ok")
    return 0


def add_split_parser(subparsers) -> argparse.ArgumentParser:
    sp = subparsers.add_parser("split", help="draw, build and check member/non-member split files",
                               description="Draw checkpoint splits from real training orders (Pythia, OLMo), "
                                           "build splits from local text benchmarks, and check split files.")
    sub = sp.add_subparsers(dest="split_command", metavar="{pythia,olmo,text,check,difficulty}")
    sub.required = True

    def common(p, seed=True):
        p.add_argument("--n-members", type=int, default=None, help="members to draw (default: partition total)")
        p.add_argument("--n-nonmembers", type=int, default=None, help="non-members to draw (default: partition total)")
        if seed:
            p.add_argument("--seed", type=V.arg_int(0, V.INT32_MAX), default=0, help="numpy Generator seed (default 0)")
        p.add_argument("--partition", default=None,
                       help="per-class partitions, e.g. train=4000,calib=500,eval=1000 (one may be 'rest')")
        p.add_argument("--out", required=True, help="output split file (.jsonl)")

    def vocab(p):
        g = p.add_mutually_exclusive_group()
        g.add_argument("--model", default=None, metavar="DIR",
                       help="the model the split is for: its config.json vocab_size bounds the drawn token ids "
                            "(a data file of another tokenizer stops with the file, row and token)")
        g.add_argument("--vocab-size", type=int, default=None, help="the same bound, given directly")

    p = sub.add_parser("pythia", help="checkpoint split from the Pythia order (Megatron .bin/.idx)")
    p.add_argument("--data", action="extend", nargs="+", required=True, metavar="BIN",
                   help="a .bin (or prefix); several (repeated or a shell glob, in order) are shards read as one "
                        "byte concatenation with the single --idx")
    p.add_argument("--idx", default=None, help="the .idx (default: next to a single --data)")
    checkpoint_step(p, "checkpoint revision stepS")
    p.add_argument("--end-step", type=int, default=98_500, help="epoch end: non-members come from [S+G, end) (98500)")
    p.add_argument("--gap", type=int, default=0, help="steps left out on each side of S (members [0, S-G))")
    p.add_argument("--batch-size", type=int, default=1024)
    vocab(p)
    common(p)
    p.set_defaults(func=_run_pythia)

    p = sub.add_parser("olmo", help="checkpoint split from the OLMo order (global_indices + token files)")
    p.add_argument("--global-indices", required=True, help="epoch global_indices file (raw uint32, no header)")
    p.add_argument("--global-indices-format", choices=["raw", "npy"], default="raw")
    p.add_argument("--data-paths", required=True, help="text file: the ordered token files, one per line")
    p.add_argument("--token-dtype", default="uint16")
    checkpoint_step(p, "checkpoint step S: members from steps [0, S)")
    p.add_argument("--nonmember-start", type=int, default=None, help="S2: non-members from [S2, E) (default S)")
    p.add_argument("--end-step", type=int, default=None, help="E (default: last complete batch of the order)")
    p.add_argument("--batch-size", type=int, default=2160)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--documents", action="store_true", help="OLMoMIA documents: one EOS-delimited segment per instance")
    p.add_argument("--eos", type=int, default=50279)
    p.add_argument("--doc-len", type=int, default=128, help="keep documents with L/2 < length <= L")
    p.add_argument("--pool", type=int, default=None, help="candidate instances per class (default max(20n, 1000))")
    vocab(p)
    common(p)
    p.set_defaults(func=_run_olmo)

    p = sub.add_parser("text", help="split from a local text benchmark (MIMIR, WikiMIA, generic table)")
    p.add_argument("--format", choices=["mimir", "wikimia", "generic"], required=True)
    p.add_argument("--file", default=None, help="table (jsonl/json/parquet/csv/txt) or folder of them")
    p.add_argument("--member", default=None, help="MIMIR: members file")
    p.add_argument("--nonmember", default=None, help="MIMIR: non-members file")
    p.add_argument("--domain", default=None, help="MIMIR: keep files (in a folder) / rows whose path/domain matches")
    p.add_argument("--text-column", default=None, help="text column (wikimia: input, generic: text)")
    p.add_argument("--label-column", default=None, help="label column (default label)")
    p.add_argument("--id-column", default=None, help="generic: id column (default: row number)")
    p.add_argument("--member-column", default="member")
    p.add_argument("--nonmember-column", default="nonmember")
    p.add_argument("--ngram-filter", default=None, metavar="N:T",
                   help="drop non-members with > T of their word N-grams in the members (MIMIR ngram_13_0.8: 13:0.8)")
    p.add_argument("--ngram-reference", default=None, help="n-gram reference texts instead of the members")
    common(p)
    p.set_defaults(func=_run_text)

    p = sub.add_parser("check", help="verify everything a split claims: header, rows, row hashes, sources",
                       description="Verify a split: header parameters against each other and the rows, every row "
                                   "against its row hash and (training orders) re-read from the data and re-drawn "
                                   "from the seed. Exit 1 on a problem; checks that could not be done are listed "
                                   "as 'not verified'.")
    p.add_argument("split")
    p.add_argument("--no-hash", action="store_true", help="skip the source file hashes")
    p.add_argument("--max-problems", type=int, default=50)
    vocab(p)
    p.set_defaults(func=_run_check)
    add_difficulty_parser(sub)
    return sp
