#!/usr/bin/env bash
# Delete the queued resource and its TPU VMs (--force deletes the node with it). Disks are kept.
set -euo pipefail
USAGE="usage: scripts/tpu_down.sh [--dry-run] [--tpu-name=N --zone=Z --project=P]"
# shellcheck source=scripts/tpu_lib.sh
source "$(dirname "$0")/tpu_lib.sh"
parse_args "$@"
require TPU_NAME ZONE PROJECT
run gcloud compute tpus queued-resources delete "$QR_NAME" --zone="$ZONE" --project="$PROJECT" --force --quiet
