#!/usr/bin/env bash
# Show the last lines of every worker's log (~/llavax/logs/run.log); --follow keeps tailing.
set -euo pipefail
USAGE="usage: scripts/tpu_logs.sh [--follow] [--lines=N] [--dry-run] [--tpu-name=N --zone=Z --project=P]
  WORKER=0 shows one worker only."
# shellcheck source=scripts/tpu_lib.sh
source "$(dirname "$0")/tpu_lib.sh"
parse_args "$@"
require TPU_NAME ZONE PROJECT
lines=50 follow=""
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$arg" in
    --follow) follow="-F" ;;
    --lines=*) lines=${arg#*=} ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
done
on_workers "tail -n $lines $follow \$HOME/$REMOTE_DIR/logs/run.log"
