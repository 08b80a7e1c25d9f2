#!/usr/bin/env bash
# Create a TPU pod as a queued resource, wait until it is ACTIVE, optionally attach and mount a persistent
# disk read-only (DISK_NAME), then copy this checkout to every worker and run scripts/tpu_setup.sh there.
set -euo pipefail
USAGE="usage: scripts/tpu_up.sh [--spot | --best-effort | --reserved] [--dry-run] [--tpu-name=N --zone=Z --project=P
       --tpu-type=T --runtime-version=V --disk-name=D]   (or TPU_NAME ZONE PROJECT TPU_TYPE RUNTIME_VERSION DISK_NAME)
  UP_TIMEOUT (seconds, default 3600) bounds the wait for ACTIVE; POLL_SECONDS (default 30) its polling."
# shellcheck source=scripts/tpu_lib.sh
source "$(dirname "$0")/tpu_lib.sh"
parse_args "$@"
require TPU_NAME ZONE PROJECT TPU_TYPE RUNTIME_VERSION
capacity=()
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$arg" in
    --spot | --best-effort | --reserved) capacity=("$arg") ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
done

# 1. the queued resource
log "creating queued resource $QR_NAME ($TPU_TYPE, ${capacity[*]:-on-demand}) in $ZONE"
run gcloud compute tpus queued-resources create "$QR_NAME" --node-id="$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
  --accelerator-type="$TPU_TYPE" --runtime-version="$RUNTIME_VERSION" "${capacity[@]+"${capacity[@]}"}"

# 2. wait for ACTIVE, showing progress; a FAILED or SUSPENDED resource will not become ACTIVE
if [ "$DRY_RUN" = 1 ]; then
  run gcloud compute tpus queued-resources describe "$QR_NAME" --zone="$ZONE" --project="$PROJECT" \
    --format='value(state.state)'
else
  timeout=${UP_TIMEOUT:-3600} poll=${POLL_SECONDS:-30} waited=0
  while true; do
    state=$(qr_state)
    [ "$state" = ACTIVE ] && break
    case "$state" in
      FAILED | SUSPENDED | SUSPENDING | MISSING)
        log "queued resource $QR_NAME is $state; giving up (scripts/tpu_down.sh cleans up)"
        exit 1 ;;
    esac
    if [ "$waited" -ge "$timeout" ]; then
      log "queued resource $QR_NAME still $state after ${waited}s (UP_TIMEOUT=$timeout)"
      exit 1
    fi
    log "waiting for $QR_NAME: $state, ${waited}s of ${timeout}s"
    sleep "$poll"
    waited=$((waited + poll))
  done
  log "$QR_NAME is ACTIVE"
fi

# 3. a persistent disk, read-only on every worker (several VMs may share it only read-only)
if [ -n "${DISK_NAME:-}" ]; then
  mount_point=${MOUNT_POINT:-/mnt/disks/data}
  run gcloud alpha compute tpus tpu-vm attach-disk "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
    --disk="$DISK_NAME" --mode=read-only
  on_workers "sudo mkdir -p $mount_point && sudo mount -o ro,noload /dev/sdb $mount_point"
fi

# 4. the code (what git tracks, as committed) and its environment on every worker
archive=$(mktemp -t llavax-XXXXXX.tar.gz)
trap 'rm -f "$archive"' EXIT
run git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
copy_to_workers "$archive" "llavax.tar.gz"
on_workers "mkdir -p $REMOTE_DIR && tar -xzf llavax.tar.gz -C $REMOTE_DIR && bash $REMOTE_DIR/scripts/tpu_setup.sh"
log "ready: scripts/tpu_run.sh -- python train.py CONFIG"
