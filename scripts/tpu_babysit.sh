#!/usr/bin/env bash
# Keep a preemptible pod training until the run is done. Each round: describe the queued resource; if it is
# preempted (SUSPENDED), FAILED or missing, delete it, create it again (scripts/tpu_up.sh: setup included)
# and relaunch CMD, which must resume (train.py --init_from=resume); stop once train.py has written
# OUT_DIR/DONE. Needs OUT_DIR (train.py's out_dir, on storage the workers share) to see that marker.
set -euo pipefail
USAGE="usage: scripts/tpu_babysit.sh [--spot | --best-effort | --reserved] [--out-dir=DIR] [--dry-run] [settings as tpu_up.sh] -- CMD...
  e.g. scripts/tpu_babysit.sh --spot --out-dir=/mnt/ckpt/run -- python train.py configs/tpu_pretrain.py --init_from=resume
  POLL_SECONDS (default 60) between rounds; MAX_RECREATES (default 20) bounds the recreations."
# shellcheck source=scripts/tpu_lib.sh
source "$(dirname "$0")/tpu_lib.sh"
parse_args "$@"
require TPU_NAME ZONE PROJECT TPU_TYPE RUNTIME_VERSION OUT_DIR
up_flags=() cmd=()
for i in "${!ARGS[@]}"; do
  case "${ARGS[$i]}" in
    --spot | --best-effort | --reserved) up_flags+=("${ARGS[$i]}") ;;
    *) cmd=("${ARGS[@]:$i}"); break ;;
  esac
done
if [ ${#cmd[@]} -eq 0 ]; then
  echo "$USAGE" >&2
  exit 2
fi
here=$(dirname "$0")
if [ "$DRY_RUN" = 1 ]; then  # one round of each kind of action, printed
  run bash "$here/tpu_up.sh" "${up_flags[@]+"${up_flags[@]}"}"
  run bash "$here/tpu_run.sh" -- "${cmd[@]}"
  WORKER=0 on_workers "test -f $OUT_DIR/DONE"
  exit 0
fi

poll=${POLL_SECONDS:-60} recreates=0 launched=0
while true; do
  state=$(qr_state)
  case "$state" in
    ACTIVE)
      if WORKER=0 on_workers "test -f $OUT_DIR/DONE" > /dev/null 2>&1; then
        log "$OUT_DIR/DONE exists: the run is complete"
        exit 0
      fi
      if [ "$launched" = 0 ]; then
        log "launching: ${cmd[*]}"
        bash "$here/tpu_run.sh" -- "${cmd[@]}"
        launched=1
      fi ;;
    SUSPENDED | SUSPENDING | FAILED | PREEMPTED | MISSING)
      if [ "$recreates" -ge "${MAX_RECREATES:-20}" ]; then
        log "$QR_NAME is $state and MAX_RECREATES=${MAX_RECREATES:-20} is used up; stopping"
        exit 1
      fi
      recreates=$((recreates + 1))
      log "$QR_NAME is $state: recreating it (recreation $recreates)"
      [ "$state" = MISSING ] || bash "$here/tpu_down.sh"
      bash "$here/tpu_up.sh" "${up_flags[@]+"${up_flags[@]}"}" || log "tpu_up failed; trying again next round"
      launched=0 ;;
    *) log "$QR_NAME is $state; waiting" ;;
  esac
  sleep "$poll"
done
