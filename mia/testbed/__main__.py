"""``python -m mia.testbed --preset smoke --out DIR``: build (or resume, or reuse) a testbed;
``python -m mia.testbed --suite smoke [--out DIR]``: a suite of sizes on one data order (``mia.testbed.suite``)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from ..entry import add_compile_cache_flag, run_for_user
from ..validate import OneLineParser, arg_float, arg_int, arg_int_list, input_file, output_dir
from . import build_testbed
from .config import CANARY_KINDS, DP_SAMPLINGS, FIELD_LIMITS, MEMORIZE_EPOCHS_MAX, PRESETS, TestbedConfig, TestbedError
from .suite import SUITES, build_suite


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m mia.testbed",
                                description="Train a small Pythia-architecture model with a recorded data order and "
                                            "checkpoints. Rerunning resumes an interrupted build or reuses a finished "
                                            "one.")
    p.add_argument("--preset", default="smoke", choices=sorted(PRESETS), help="size preset (default: smoke)")
    p.add_argument("--suite", default=None, choices=sorted(SUITES),
                   help="build a suite instead: every size of SUITES[NAME] on one data order (only --out, "
                        "--save-every, --no-progress, --debug apply)")
    p.add_argument("--out", default=None,
                   help="testbed directory (default: testbeds/<preset>, or testbeds/<preset>-<hash> with overrides; "
                        "for --suite: testbeds/suite-<name>)")
    p.add_argument("--corpus", default=None, help="directory of .txt/.md/.py files, or a .jsonl/.parquet file "
                                                  "(default: this Python's standard library)")
    p.add_argument("--text-column", default=None, help="text field of a .jsonl/.parquet corpus (default: text)")
    for f in dataclasses.fields(TestbedConfig):
        if f.name not in FIELD_LIMITS:  # preset, corpus, text_column and the list / choice options below
            continue
        typ, limit = FIELD_LIMITS[f.name]
        parse = (arg_int(limit.lo, limit.hi) if typ is int
                 else arg_float(limit.lo, limit.hi, lo_open=limit.lo_open, hi_open=limit.hi_open))
        bound = f"; at most {limit.hi:,}" if typ is int and limit.hi is not None else ""
        p.add_argument("--" + f.name.replace("_", "-"), type=parse, default=None,
                       help=f"override the preset's {f.name} (mia.testbed.TestbedConfig{bound})")
    p.add_argument("--checkpoints", type=arg_int_list(0), default=None,
                   help="extra checkpoint steps, comma-separated (0 and the last are always saved)")
    p.add_argument("--canary-reps", type=arg_int_list(1), default=None,
                   help="insertions of each included canary, cycled over the canaries, comma-separated "
                        "(default 1,4,16,64; with --canaries N)")
    p.add_argument("--canary-kind", default=None,
                   help="canary kind, or several comma-separated: " + ", ".join(CANARY_KINDS) + " (default tokens; "
                        "new needs --reserved-tokens; see mia.testbed.canaries)")
    p.add_argument("--dp-sampling", choices=DP_SAMPLINGS, default=None,
                   help="DP-SGD batches (with --dp-noise): poisson (default; each record joins each step with "
                        "probability 1/train_steps) or fixed (the recorded batches, no amplification)")
    p.add_argument("--memorize-epochs", type=arg_int(0, MEMORIZE_EPOCHS_MAX), default=0,
                   help="memorization dial: after the last checkpoint, train E more epochs on a fixed member subset "
                        "only, saved as checkpoints/step{N}-mem{E}-{hash}/ (non-members stay unseen; E at most "
                        f"{MEMORIZE_EPOCHS_MAX:,})")
    p.add_argument("--memorize-rows", type=arg_int(1), default=256, help="size of that member subset (default 256)")
    p.add_argument("--save-every", type=arg_int(1), default=50, help="steps between resume states (default 50)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")

    add_compile_cache_flag(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    if args.suite:
        return _main_suite(args)

    overrides = {}
    for f in dataclasses.fields(TestbedConfig):
        v = getattr(args, f.name, None)
        if f.name in FIELD_LIMITS and v is not None:
            overrides[f.name] = v
    t0 = time.perf_counter()
    status, tb = run_for_user(
        lambda: (
            check_args(args, overrides)
            and build_testbed(
                args.preset,
                args.out,
                progress=not args.no_progress,
                save_every=args.save_every,
                memorize_epochs=args.memorize_epochs,
                memorize_rows=args.memorize_rows,
                **overrides,
            )
        ),
        debug=args.debug,
        compile_cache=not args.no_compile_cache,
        on_interrupt="interrupted; rerun the same command to resume from the last saved state",
    )
    if status:
        return status
    print(tb.summary())
    if tb.memorized is not None:
        print(f"memorized checkpoint: {tb.memorized}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def check_args(args, overrides: dict) -> bool:
    """The path and list options, checked before anything is built (fills ``overrides["checkpoints"]``)."""
    if args.out is not None:
        output_dir(args.out, "--out", error=TestbedError)
    if args.corpus is not None:
        from pathlib import Path

        if not Path(args.corpus).is_dir():
            input_file(args.corpus, "--corpus", error=TestbedError)
        overrides["corpus"] = args.corpus
    if args.text_column is not None and not args.text_column.strip():
        raise TestbedError("--text-column: empty")
    if args.checkpoints:
        overrides["checkpoints"] = tuple(args.checkpoints)
    if args.canary_reps:
        overrides["canary_reps"] = tuple(args.canary_reps)
    for name in ("canary_kind", "dp_sampling"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return True


def _main_suite(args) -> int:

    extra = [f.name for f in dataclasses.fields(TestbedConfig)
             if f.name != "preset" and getattr(args, f.name, None) is not None]
    extra += ["memorize-epochs"] * bool(args.memorize_epochs)
    if extra:
        print(f"error: --suite takes no testbed options (got {', '.join(extra)}); a suite's configs are "
              f"mia.testbed.suite.SUITES[{args.suite!r}]", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    status, suite = run_for_user(
        lambda: (
            (args.out is None or output_dir(args.out, "--out", error=TestbedError))
            and build_suite(args.suite, args.out, progress=not args.no_progress, save_every=args.save_every)
        ),
        debug=args.debug,
        on_interrupt="interrupted; rerun the same command to resume from the last saved state",
    )
    if status:
        return status
    print(suite.summary())
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
