#!/usr/bin/env bash
# The accelerator checks in one command, most important first; each step's output goes to $OUT (default ./results/
# device-check) as it finishes, so a run cut short still leaves the steps it completed.
#
#   bash experiments/device_check.sh [DIR]   # DIR: a built testbed suite (default testbeds/suite-default; its largest
#                                            # member is used) or one built testbed directory
#
# 0. mia doctor: every family and kernel against float32, the mesh, the caches, a speed line, what bf16 costs
#    ($OUT/doctor.json; a failing check is reported and the script goes on: the later steps show how it fails)
# 1. speed: Pythia-1B-shaped token stats in bf16, mia vs transformers on the same device (tokens/s, MFU, ratio)
# 2. attention kernels in bf16 (exact, blocked, xla = cuDNN on a GPU) against float32, per-token log-probs
# 3. what bf16 costs in scores: every attack in float32 and bf16 on the suite's largest member
# 4. speed in float32 (what --dtype float32 costs there)
# 5. step 3 on the memorization dial's checkpoint
# 6. packed rows vs length buckets at a real model's width in bf16 (auto never packs on a GPU until this is read;
#    the row-length table fits the per-score attention cost for mia.engine.batching.SCORE_OVERHEAD_FLOPS)
set -u
SUITE=${1:-testbeds/suite-default}
OUT=${OUT:-results/device-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
py=${PYTHON:-python3}
if [ -f "$SUITE/testbed.json" ]; then
  largest=$SUITE
else
  largest=$($py -c "from mia.testbed import open_suite; print(open_suite('$SUITE').members[-1].root)" 2>/dev/null)
fi
step() {
  local t=$SECONDS
  echo "== $1" | tee -a "$OUT/log.txt"; shift
  "$@" 2>&1 | tee -a "$OUT/log.txt"
  echo "   ($((SECONDS - t)) s)" | tee -a "$OUT/log.txt"
}
$py -c "import jax, torch; print(jax.devices(), torch.__version__, torch.cuda.is_available())" 2>&1 | tee "$OUT/log.txt"
step "0 mia doctor" $py -m mia doctor --json "$OUT/doctor.json"
step "1 bench_device bf16" $py -m experiments.bench_device --dtype bfloat16
[ -n "$largest" ] && step "2 bench_kernels bf16" $py -m experiments.bench_kernels --testbed "$largest" --rows 256 --length 129 --block 32
[ -n "$largest" ] && step "3 bench_precision" $py -m experiments.bench_precision --testbed "$largest" --no-progress \
  --out "$OUT/precision"
step "4 bench_device float32" $py -m experiments.bench_device --dtype float32
[ -n "$largest" ] && step "5 bench_precision dial" $py -m experiments.bench_precision --testbed "$largest" \
  --memorize-epochs 4 --no-progress --out "$OUT/precision-dial"
step "6 bench_padding (auto dtype: bf16)" $py -m experiments.bench_padding --corpora wikimia+mimir log-uniform \
  --hidden 2048 --layers 4 --vocab 50304 --rows 512 --budget 16384 --plan-rows 1000
exit 0
