#!/usr/bin/env bash
# Stop training on every worker: SIGTERM first, so train.py checkpoints and exits, SIGKILL after GRACE seconds;
# then remove a stale /tmp/libtpu_lockfile, which would keep the next job off the TPU. The pattern is
# '[t]rain.py' so that pkill never matches the remote shell whose command line holds it.
set -euo pipefail
USAGE="usage: scripts/tpu_stop.sh [--dry-run] [--tpu-name=N --zone=Z --project=P]   (GRACE seconds, default 120)"
# shellcheck source=scripts/tpu_lib.sh
source "$(dirname "$0")/tpu_lib.sh"
parse_args "$@"
require TPU_NAME ZONE PROJECT
grace=${GRACE:-120}
on_workers "pkill -TERM -f '[t]rain.py' || true; for _ in \$(seq $grace); do pgrep -f '[t]rain.py' > /dev/null || break; \
sleep 1; done; pkill -KILL -f '[t]rain.py' || true; sudo rm -f /tmp/libtpu_lockfile"
