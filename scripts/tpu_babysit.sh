#!/usr/bin/env bash
# Keep a preemptible pod training until the run is done. Each round: describe the queued resource; if it is
# preempted (SUSPENDED), FAILED or missing, delete it, create it again (scripts/tpu_up.sh: setup included)
# and relaunch CMD, which must resume (train.py --resume=True); stop once train.py has written
# OUT_DIR/DONE. Needs OUT_DIR (train.py's out_dir: a bucket, gs://..., or a path the workers share) to see that marker.
# A gcloud call that fails is retried with backoff (RETRIES, RETRY_SECONDS) and never taken for a lost pod; CMD is
# launched only while no worker runs train.py, so a babysitter started again never starts a second copy.
set -euo pipefail
USAGE="usage: scripts/tpu_babysit.sh [--spot | --best-effort | --reserved] [--out-dir=gs://BUCKET/RUN | DIR] [--dry-run] [settings as tpu_up.sh] -- CMD...
  e.g. scripts/tpu_babysit.sh --spot --out-dir=gs://my-bucket/llava15-7b-pretrain -- python train.py configs/tpu_pretrain.py --resume=True
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
# every launch of this pod's run is one run to train.py: each restart takes over out_dir's lease from the last
export LLAVAX_RUN_ID=${LLAVAX_RUN_ID:-babysit-$PROJECT-$ZONE-$TPU_NAME}
done_marker=$(printf '%q' "${OUT_DIR%/}/DONE")  # run by worker 0's shell: quoted for it
case "$OUT_DIR" in
  *://*) done_test="cd \$HOME/$REMOTE_DIR && .venv/bin/python -c 'import sys, storage; sys.exit(not storage.exists(sys.argv[1]))' $done_marker" ;;
  *) done_test="test -f $done_marker" ;;
esac
if [ "$DRY_RUN" = 1 ]; then  # one round of each kind of action, printed
  run bash "$here/tpu_up.sh" "${up_flags[@]+"${up_flags[@]}"}"
  run bash "$here/tpu_run.sh" -- "${cmd[@]}"
  WORKER=0 on_workers "$done_test"
  exit 0
fi

poll=${POLL_SECONDS:-60} recreates=0 launched=0
while true; do
  state=$(qr_state)
  case "$state" in
    ACTIVE)
      if WORKER=0 on_workers "$done_test" > /dev/null 2>&1; then
        log "${OUT_DIR%/}/DONE exists: the run is complete"
        exit 0
      fi
      if [ "$launched" = 0 ]; then
        if ! running=$(retry on_workers "pgrep -f '[t]rain.py' > /dev/null && echo RUNNING || true"); then
          log "cannot reach the workers to see whether train.py runs; trying again next round"
        elif [[ "$running" == *RUNNING* ]]; then
          log "train.py already runs on $TPU_NAME: not launching a second copy"
          launched=1
        elif bash "$here/tpu_run.sh" -- "${cmd[@]}"; then
          log "launched: ${cmd[*]}"
          launched=1
        else
          log "launching failed; trying again next round"
        fi
      fi ;;
    SUSPENDED | SUSPENDING | FAILED | PREEMPTED | MISSING)
      if [ "$recreates" -ge "${MAX_RECREATES:-20}" ]; then
        log "$QR_NAME is $state and MAX_RECREATES=${MAX_RECREATES:-20} is used up; stopping"
        exit 1
      fi
      recreates=$((recreates + 1))
      log "$QR_NAME is $state: recreating it (recreation $recreates)"
      if [ "$state" != MISSING ] && ! retry bash "$here/tpu_down.sh"; then
        log "deleting $QR_NAME failed; trying again next round"
      else
        bash "$here/tpu_up.sh" "${up_flags[@]+"${up_flags[@]}"}" || log "tpu_up failed; trying again next round"
      fi
      launched=0 ;;
    *) log "$QR_NAME is $state; waiting" ;;
  esac
  sleep "$poll"
done
