#!/usr/bin/env bash
# The TPU verdict in one command, on a TPU VM (v4-8, v5e-8; after scripts/tpu_setup.sh): dense vs blockwise vs
# Pallas attention at 2k, 8k and 32k tokens (loss and gradient agreement, peak HBM, step time), one training step of
# each TPU recipe at reduced depth, the compile count after warm-up, a checkpoint save and load
# (scripts/tpu_check.py). On a pod: scripts/tpu_run.sh -- bash scripts/tpu_check.sh (each worker prints its own).
# --cpu runs a tiny dry version on 4 CPU XLA devices (what the tests run).
set -euo pipefail
usage="usage: scripts/tpu_check.sh [--dry-run] [--cpu] [--out=DIR]   (the verdict table; DIR default: a new temp folder)"
dry_run=0
cpu=0
out=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --cpu) cpu=1 ;;
    --out=*) out="${arg#--out=}" ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
run() {
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
if [ -z "$out" ]; then
  if [ "$dry_run" = 1 ]; then out=/tmp/llavax-tpu-check; else out=$(mktemp -d -t llavax-tpu-check-XXXXXX); fi
fi
dump="$out/xla-dump"  # the compiled programs' buffer assignments: their peak memory
dump_flags="--xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph.*"
if [ "$cpu" = 1 ]; then
  # level 0: faster CPU codegen, the same buffer assignment
  run env PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 OMP_NUM_THREADS=1 \
    XLA_FLAGS="$dump_flags --xla_backend_optimization_level=0" \
    "$python" scripts/tpu_check.py --cpu --out "$out" --dump "$dump"
else
  # shellcheck source=scripts/tpu_env.sh
  source scripts/tpu_env.sh
  # where the TPU compiler writes no buffer assignment there, the verdict gives the device's peak so far instead
  run env XLA_FLAGS="$dump_flags" "$python" scripts/tpu_check.py --out "$out" --dump "$dump"
fi
