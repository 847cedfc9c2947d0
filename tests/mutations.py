"""Mutation check: each one-line change of the code below must make the named default test fail.

    python -m tests.mutations            # every mutation (run by `make test-all`)
    python -m tests.mutations dp-noise   # only those whose name contains one of the words
    python -m tests.mutations --list     # the mutations and their tests, without running anything

A test that cannot fail proves nothing. Each entry names a file of mia, one line of it (a string that occurs exactly
once in the file), the line it becomes, and the default-run tests (``-m "not slow"``) that claim to cover it. The
script copies the working tree once into a temporary directory, runs the named tests there unchanged (they must
pass: a test that fails anyway would catch every mutation), then applies each mutation in turn, runs its tests and
puts the line back. A mutation is caught when pytest exits 1 (a test failed). It survived when the tests pass; it is
stale when its line is no longer in the file, and in error when pytest exits otherwise (no test collected, an
internal error): both are reported and counted as not caught. The last line is ``K/N mutations caught``; the exit
code is 0 only when every mutation is caught.

When the code changes so that a line moves or changes, update its entry here: the script says which one is stale.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    original: str  # occurs exactly once in the file
    mutated: str
    tests: tuple  # pytest node ids that must fail under the mutation
    what: str = ""


MUTATIONS = (
    Mutation("holm-unadjusted", "mia/metrics.py",
             "        if p[i] > alpha / (len(p) - rank):",
             "        if p[i] > alpha:",
             ("tests/test_audit.py::test_holm_is_the_step_down_procedure_and_holds_the_family",),
             "Holm's procedure uses unadjusted p-values"),
    Mutation("pyarrow-last-row", "mia/data/sources.py",
             "data.to_pylist(), what, lambda i:",
             "data.to_pylist()[:-1], what, lambda i:",
             ("tests/test_data_sources.py::test_every_form_gives_the_same_examples",),
             "a pyarrow Table loses its last row when read"),
    Mutation("fallback-scaled", "mia/engine/failsafe.py",
             "            out = jax.block_until_ready(self._fn(*args, **kwargs))",
             "            out = jax.tree_util.tree_map(lambda x: x * 1.001, jax.block_until_ready(self._fn(*args, "
             "**kwargs)))",
             ("tests/test_failsafe.py::test_token_stats_fall_back_to_blocked_scores",),
             "the kernel fallback's scores are multiplied by 1.001"),
    Mutation("nan-weights-pass", "mia/models/hub.py",
             "    if flags.all():",
             "    if True:",
             ("tests/test_streaming_load.py::test_a_nan_in_a_bfloat16_checkpoint_loaded_as_float32_is_refused",),
             "the NaN-weight check always passes"),
    Mutation("finite-by-max", "mia/models/hub.py",
             "    return jnp.stack([jnp.sum(x * 0, dtype=jnp.float32) == 0 if jnp.issubdtype(x.dtype, jnp.inexact) "
             "and x.size",
             "    return jnp.stack([jnp.max(jnp.abs(x)) < jnp.inf if jnp.issubdtype(x.dtype, jnp.inexact) and x.size",
             ("tests/test_streaming_load.py::test_finite_check_sees_nan_in_large_leaves",
              "tests/test_streaming_load.py::test_a_nan_in_a_bfloat16_checkpoint_loaded_as_float32_is_refused"),
             "the finiteness test goes back to max |x| < inf (a bfloat16 checkpoint's NaN loaded as float32 too; on "
             "XLA:CPU a bfloat16 max keeps NaN, so bfloat16 leaves are right either way)"),
    Mutation("doctor-mesh-one-device", "mia/doctor.py",
             "            mesh = make_mesh(axes, run.devices)",
             "            mesh = make_mesh(devices=run.devices[:1])",
             ("tests/test_doctor.py::test_mesh_check_passes_on_two_devices_and_fails_when_a_device_loses_a_row",),
             "the doctor's mesh row compares one device with one device"),
    Mutation("context-plus-one-feeds-last", "mia/engine/stats.py",
             "        fed = mask",
             "        fed = valid_bt[:, :-1]",
             ("tests/test_families_parity.py::test_a_text_of_context_plus_one_tokens_is_scored_inside_the_context",),
             "C + 1-token rows feed the text's last token as an input"),
    Mutation("new-token-sign", "mia/testbed/canaries.py",
             "    out[new] = (nll[1:] - nll[0]).mean(axis=0)",
             "    out[new] = (nll[0] - nll[1:]).mean(axis=0)",
             ("tests/test_testbed_audit.py::test_new_token_contrast_is_zero_without_training",),
             "the new-token contrast's sign is flipped"),
    Mutation("roc-axes-swapped", "mia/report.py",
             '        ax.plot(fpr, tpr, label=f"{name} (AUC',
             '        ax.plot(tpr, fpr, label=f"{name} (AUC',
             ("tests/test_score_run.py::test_plot_roc_draws_every_attack_on_log_axes",),
             "draw_roc plots (tpr, fpr) instead of (fpr, tpr)"),
    Mutation("dp-no-noise", "mia/testbed/dp.py",
             "    std = float(noise_multiplier) * float(clip)",
             "    std = 0.0 * float(noise_multiplier) * float(clip)",
             ("tests/test_finetune.py::test_dp_finetune_adds_the_noise_the_accountant_counts",),
             "the DP fine-tune adds no noise"),
    # ----------------------------------------------------------------------------------------------- our own
    Mutation("doctor-self-reference", "mia/doctor.py",
             "                ref = run.attention_reference(family)",
             "                ref = run.reference(family)",
             ("tests/test_doctor.py::test_healthy_attention_speed_and_precision_rows_pass_on_a_real_difference_and_fail_"
              "when_tightened",),
             "the doctor's attention rows compare the reference with itself"),
    Mutation("watchdog-off", "mia/engine/distributed.py",
             "        self.thread.start()",
             "        pass  # the watchdog thread never starts",
             ("tests/test_hosts.py::test_the_watchdog_stops_on_another_process_failing_with_that_process_reason",),
             "the multi-process watchdog never starts"),
    Mutation("bootstrap-p-no-plus-one", "mia/metrics.py",
             "    p = (1 + int(extreme.sum())) / (len(d) + 1)",
             "    p = int(extreme.sum()) / (len(d) + 1)",
             ("tests/test_score_run.py::test_compare_two_attacks_and_two_runs",),
             "the paired bootstrap's p-value loses its +1 (p = 0 becomes possible)"),
    Mutation("gdp-abs", "mia/privacy/gdp.py",
             "    return float(max(np.max(mu), 0.0))",
             "    return float(max(np.max(np.abs(mu[np.isfinite(mu)]), initial=0.0), 0.0))",
             ("tests/test_audit_jax_privacy.py::test_gdp_estimate_against_jax_privacy",),
             "the Gaussian-DP estimate takes |mu| (jax-privacy's error on reversed tests)"),
    Mutation("llama-no-prefix-cache", "mia/models/llama.py",
             "        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5, window=self.window(layer))",
             "        attn = attend(q, k, v, pos_bt, valid_bt, None, scale=e ** -0.5, window=self.window(layer))",
             ("tests/test_families_parity.py::test_prefix_cache_matches_full_sequence",),
             "Llama ignores the prefix cache"),
    Mutation("dp-clip-loose", "mia/testbed/finetune.py",
             "        summed, n_clipped = optax.transforms.per_example_global_norm_clip(leaves, cfg.dp_clip)",
             "        summed, n_clipped = optax.transforms.per_example_global_norm_clip(leaves, 2 * cfg.dp_clip)",
             ("tests/test_finetune.py::test_clipped_gradient_sum_matches_one_example_at_a_time",),
             "DP-SGD clips each example's gradient to twice the clipping norm the accountant assumes"),
    Mutation("bonferroni-unadjusted", "mia/metrics.py",
             "    return [p < alpha / m for p in p_values]",
             "    return [p < alpha for p in p_values]",
             ("tests/test_metrics.py::test_summary_row_keys",),
             "Bonferroni's correction is dropped"),
    Mutation("mink-top-k", "mia/attacks/mink.py",
             "    sorted_bl = jnp.sort(jnp.where(mask_bl, values_bl, jnp.inf), axis=1)",
             "    sorted_bl = -jnp.sort(-jnp.where(mask_bl, values_bl, jnp.inf), axis=1)",
             ("tests/test_attacks_stats.py",),
             "Min-K% averages the largest log-probs instead of the smallest"),
    Mutation("zlib-inverted", "mia/attacks/zlib.py",
             "    return loglik_b.astype(jnp.float32) / zlen_b.astype(jnp.float32)",
             "    return zlen_b.astype(jnp.float32) / loglik_b.astype(jnp.float32)",
             ("tests/test_attacks_stats.py",),
             "the zlib attack divides the other way"),
    Mutation("peft-export-scale", "mia/testbed/peft_export.py",
             '"lora_alpha": float(cfg.lora_scale * cfg.lora_rank),',
             '"lora_alpha": float(cfg.lora_rank),',
             ("tests/test_finetune_mia_experiment.py::test_peft_export_names_and_orients_the_factors_as_peft_saves_"
              "them",),
             "an exported PEFT adapter loses the LoRA scale (alpha = r)"),
)


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, nothing ignored) into ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(tree: Path, tests, log: Path) -> tuple:
    """(pytest's exit code, seconds) of the default run (``pytest.ini``'s marks) of ``tests`` in ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", *tests], cwd=tree,
                            env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - t0


def apply(tree: Path, m: Mutation) -> str | None:
    """Apply ``m`` in ``tree``; returns the original text to restore, or None when its line is not there once."""
    path = tree / m.path
    text = path.read_text()
    if text.count(m.original) != 1:
        return None
    path.write_text(text.replace(m.original, m.mutated, 1))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="run only the mutations whose name contains one of these words")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary tree and the pytest logs")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(w in m.name for w in args.only)]
    if not chosen:
        ap.error(f"no mutation matches {args.only}; names: {', '.join(m.name for m in MUTATIONS)}")
    if args.list:
        for m in chosen:
            print(f"{m.name:24s} {m.path}: {m.what}\n{'':24s} -> {' '.join(m.tests)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="mia-mutations-"))
    tree = work / "tree"
    copy_tree(tree)
    try:
        everything = sorted({t for m in chosen for t in m.tests})
        rc, secs = run_tests(tree, everything, work / "baseline.log")
        if rc != 0:
            print(f"error: the named tests do not pass on the unmutated tree (pytest exit {rc}, "
                  f"log {work / 'baseline.log'}); nothing was mutated", file=sys.stderr)
            args.keep = True
            return 2
        print(f"baseline: {len(everything)} test ids pass unmutated ({secs:.0f} s)", flush=True)
        caught = 0
        for m in chosen:
            original = apply(tree, m)
            if original is None:
                print(f"STALE     {m.name}: its line is not in {m.path} exactly once; update tests/mutations.py",
                      flush=True)
                continue
            try:
                rc, secs = run_tests(tree, m.tests, work / f"{m.name}.log")
            finally:
                (tree / m.path).write_text(original)
            verdict = {0: "SURVIVED", 1: "caught"}.get(rc, f"ERROR (pytest exit {rc})")
            caught += rc == 1
            print(f"{verdict:9s} {m.name} ({secs:.0f} s): {m.what}", flush=True)
        print(f"{caught}/{len(chosen)} mutations caught")
        return 0 if caught == len(chosen) else 1
    finally:
        if args.keep:
            print(f"kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
