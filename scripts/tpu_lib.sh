# shellcheck shell=bash
# Shared by scripts/tpu_*.sh (sourced, not run): settings from the environment or --flags, --dry-run,
# and the gcloud calls they all make. Settings: TPU_NAME ZONE PROJECT TPU_TYPE RUNTIME_VERSION, optional
# DISK_NAME; the queued resource is named QR_NAME (default: TPU_NAME). The checkout lives in ~/llavax on
# every worker and each worker logs to ~/llavax/logs/run.log.

DRY_RUN=${DRY_RUN:-0}
QR_NAME=${QR_NAME:-}
export REMOTE_DIR=llavax  # the checkout on every worker, under $HOME
ARGS=()

parse_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) echo "$USAGE"; exit 0 ;;
      --tpu-name=*) TPU_NAME=${1#*=} ;;
      --zone=*) ZONE=${1#*=} ;;
      --project=*) PROJECT=${1#*=} ;;
      --tpu-type=*) TPU_TYPE=${1#*=} ;;
      --runtime-version=*) RUNTIME_VERSION=${1#*=} ;;
      --disk-name=*) DISK_NAME=${1#*=} ;;
      --out-dir=*) OUT_DIR=${1#*=} ;;
      --) shift; ARGS+=("$@"); break ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
  QR_NAME=${QR_NAME:-${TPU_NAME:-}}
  export DRY_RUN TPU_NAME ZONE PROJECT TPU_TYPE RUNTIME_VERSION DISK_NAME OUT_DIR QR_NAME
}

# fail fast, naming every missing setting at once
require() {
  local missing=() name
  for name in "$@"; do
    [ -n "${!name:-}" ] || missing+=("$name")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "$(basename "$0"): missing setting(s): ${missing[*]}. Set them in the environment or as flags (--help)." >&2
    exit 2
  fi
}

# run a command, or print it (shell-quoted) under --dry-run
run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

log() {
  echo "[$(date +%H:%M:%S)] $(basename "$0"): $*" >&2
}

# run a command until it succeeds, at most RETRIES (5) times, waiting RETRY_SECONDS (5), then twice that, ...:
# gcloud calls fail for a moment (network, API quotas, an ssh key still propagating)
retry() {
  local try=1 wait=${RETRY_SECONDS:-5}
  until "$@"; do
    if [ "$try" -ge "${RETRIES:-5}" ]; then
      log "failed ${RETRIES:-5} times: $*"
      return 1
    fi
    log "failed (try $try of ${RETRIES:-5}); again in ${wait}s: $*"
    sleep "$wait"
    try=$((try + 1)) wait=$((wait * 2))
  done
}

# queued-resource state (ACTIVE, PROVISIONING, SUSPENDED, FAILED, ...), MISSING when gcloud says it does not exist,
# UNKNOWN when describe keeps failing otherwise: a failed call is no evidence that a healthy pod is gone
qr_state() {
  local err try=1 wait=${RETRY_SECONDS:-5}
  err=$(mktemp)
  while true; do
    if gcloud compute tpus queued-resources describe "$QR_NAME" --zone="$ZONE" --project="$PROJECT" \
      --format='value(state.state)' 2>"$err"; then
      break
    elif grep -q NOT_FOUND "$err"; then
      echo MISSING
      break
    elif [ "$try" -ge "${RETRIES:-5}" ]; then
      log "describe failed ${RETRIES:-5} times: $(tail -n 1 "$err")"
      echo UNKNOWN
      break
    fi
    log "describe failed (try $try of ${RETRIES:-5}); again in ${wait}s: $(tail -n 1 "$err")"
    sleep "$wait"
    try=$((try + 1)) wait=$((wait * 2))
  done
  rm -f "$err"
}

# a command on every worker of the pod (or one: WORKER=0)
on_workers() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker="${WORKER:-all}" \
    --command="$1"
}

copy_to_workers() {
  run gcloud compute tpus tpu-vm scp "$1" "$TPU_NAME:$2" --zone="$ZONE" --project="$PROJECT" --worker=all
}
