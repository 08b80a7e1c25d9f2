#!/usr/bin/env bash
# Train with torchrun on one node or many: every node runs this with the same CONFIG and settings and its own
# NODE_RANK. Settings (environment): NNODES (1), NODE_RANK (0), NPROC_PER_NODE (the GPUs here, else 1),
# MASTER_ADDR (127.0.0.1; node 0's address), PYTHON (python), MASTER_PORT (29500), MAX_RESTARTS (0; torchrun restarts every
# worker of a failed group this many times, and train.py continues from its newest checkpoint when given
# --resume=True), RDZV_ID (llavax). The c10d rendezvous (hosted on MASTER_ADDR:MASTER_PORT) assigns ranks.
set -euo pipefail
USAGE="usage: scripts/launch.sh [--dry-run] CONFIG [--key=value ...]
  e.g. NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MAX_RESTARTS=3 scripts/launch.sh configs/finetune.py --resume=True"
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  echo "$USAGE"
  [ $# -ge 1 ] && exit 0
  exit 2
fi
config=$1
shift
if [ ! -f "$config" ]; then
  echo "launch.sh: config $config does not exist" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")/.." && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
nnodes=${NNODES:-1} node_rank=${NODE_RANK:-0} nproc=${NPROC_PER_NODE:-${gpus:-1}}
[ "$nproc" != 0 ] || [ -n "${NPROC_PER_NODE:-}" ] || nproc=1  # no GPU here: one process
master_addr=${MASTER_ADDR:-127.0.0.1} master_port=${MASTER_PORT:-29500}
# every number a user can set, checked before torchrun sees it: NAME=value minimum
for setting in "NNODES=$nnodes 1" "NODE_RANK=$node_rank 0" "NPROC_PER_NODE=$nproc 1" "MASTER_PORT=$master_port 1" \
  "MAX_RESTARTS=${MAX_RESTARTS:-0} 0"; do
  value=${setting% *} min=${setting##* }
  if ! [[ ${value#*=} =~ ^[0-9]+$ ]] || [ "${value#*=}" -lt "$min" ]; then
    echo "launch.sh: ${value%%=*} must be a whole number >= $min, got '${value#*=}'" >&2
    exit 2
  fi
done

# NCCL defaults (a value already in the environment wins)
# a failed or timed-out collective aborts the process, so torchrun can restart the group instead of it hanging
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# a watchdog that dumps and kills a rank whose collectives stop making progress for this long
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1800}
# NCCL says why it failed, without flooding the log
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# one math thread a rank: the loader's workers do the CPU work
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

cmd=("${PYTHON:-python}" -m torch.distributed.run --nnodes="$nnodes" --nproc-per-node="$nproc" --node-rank="$node_rank"
  --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id="${RDZV_ID:-llavax}"
  --max-restarts="${MAX_RESTARTS:-0}" "$here/train.py" "$config" "$@")
if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
else
  exec "${cmd[@]}"
fi
