"""Benchmark: the testbed's training step under XLA compiler options, side by side (compile and step time).

    python -m experiments.bench_train_step [--suite smoke] [--steps 20]

For each member of a testbed suite (``mia.testbed.SUITES``) and each option set below, a fresh process builds the
member's model and optimizer as ``mia.testbed`` does, compiles ``mia.testbed.train.make_train_step`` with those
options (``XLA_FLAGS`` cleared, so nothing else changes the program), times the first call (compile + one step) and
the mean of ``--steps`` further steps on one fixed batch of random rows, and prints a table with the projected time
of a whole training run (first call + ``train_steps`` steps), with a last row for the level
``mia.testbed.train.compiler_options`` picks for each member, and each row's ratio against that one. Timings are
single runs: quote them only from an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# name -> XLA compiler options of the training step's jit
OPTION_SETS = {
    "level 0": {"xla_backend_optimization_level": 0},
    "level 3": {"xla_backend_optimization_level": 3},
    "level 3, legacy emitters": {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": False},
    "level 0, legacy emitters": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
}


def time_member(suite: str, member: int, options: dict, steps: int) -> dict:
    """First-call and per-step seconds of one suite member's training step (run in this process)."""
    import time

    import jax.numpy as jnp
    import numpy as np

    from mia.models import from_config
    from mia.models.hub import family
    from mia.testbed.build import model_config
    from mia.testbed.init import init_params
    from mia.testbed.suite import SUITES
    from mia.testbed.train import make_optimizer, make_train_step

    cfg = SUITES[suite][member]
    mcfg = model_config(cfg, cfg.vocab_size)
    params = init_params(family("gpt_neox").module_cls(mcfg, dtype=jnp.float32, param_dtype=jnp.float32), cfg.seed)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(params)
    step = make_train_step(from_config(mcfg, params=params), optimizer, options)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
    t0 = time.perf_counter()
    params, opt_state, m = step(params, opt_state, rows)
    float(m["loss"])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt_state, m = step(params, opt_state, rows)
        float(m["loss"])
    per_step = (time.perf_counter() - t0) / steps
    return {"hidden": cfg.hidden_size, "train_steps": cfg.train_steps, "first_s": first, "step_s": per_step}


def run_child(suite: str, member: int, name: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "experiments.bench_train_step", "--child", suite, str(member), name,
                          str(steps)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("--steps", type=int, default=20, help="timed steps after the first call (default 20)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        suite, member, name, steps = args.child
        print(json.dumps(time_member(suite, int(member), OPTION_SETS[name], int(steps))))
        return
    from mia.testbed.suite import SUITES
    from mia.testbed.train import compiler_options

    members = range(len(SUITES[args.suite]))
    results = {name: [run_child(args.suite, i, name, args.steps) for i in members] for name in OPTION_SETS}
    picks = [f"level {compiler_options(c, c.train_steps)['xla_backend_optimization_level']}"
             for c in SUITES[args.suite]]
    results["mia's pick (" + ", ".join(picks) + ")"] = [results[p][i] for i, p in enumerate(picks)]
    base = sum(r["first_s"] + r["train_steps"] * r["step_s"] for r in list(results.values())[-1])
    print(f"suite {args.suite}: first call (compile + 1 step) / mean step, per member; whole run = first call + "
          f"train_steps steps, summed over the members")
    print("| options | " + " | ".join(f"hidden {r['hidden']}" for r in results["level 3"])
          + " | whole run | ratio |")
    print("|---|" + "---|" * (len(members) + 2))
    for name, rows in results.items():
        whole = sum(r["first_s"] + r["train_steps"] * r["step_s"] for r in rows)
        cells = " | ".join(f"{r['first_s']:.2f} s / {1e3 * r['step_s']:.1f} ms" for r in rows)
        print(f"| {name} | {cells} | {whole:.1f} s | {whole / base:.2f}x |")


if __name__ == "__main__":
    main()
