#!/usr/bin/env bash
# Run a command on every worker in the background: it survives ssh disconnects (nohup, setsid) and each
# worker writes its own ~/llavax/logs/run.log. The command runs in ~/llavax with .venv on PATH and
# scripts/tpu_env.sh sourced. Secrets (SECRET_VARS, default "WANDB_API_KEY HF_TOKEN") that are set here are
# copied in a private file, never on a command line, in a log or in --dry-run output.
set -euo pipefail
USAGE="usage: scripts/tpu_run.sh [--dry-run] [--tpu-name=N --zone=Z --project=P] -- CMD [ARG...]
  e.g. scripts/tpu_run.sh -- python train.py configs/tpu_pretrain.py --resume=True"
# shellcheck source=scripts/tpu_lib.sh
source "$(dirname "$0")/tpu_lib.sh"
parse_args "$@"
require TPU_NAME ZONE PROJECT
if [ ${#ARGS[@]} -eq 0 ]; then
  echo "$USAGE" >&2
  exit 2
fi
cmd=$(printf '%q ' "${ARGS[@]}")

secrets=$(mktemp -t llavax-secrets-XXXXXX)
trap 'rm -f "$secrets"' EXIT
chmod 600 "$secrets"
for name in ${SECRET_VARS:-WANDB_API_KEY HF_TOKEN} LLAVAX_RUN_ID; do  # and the babysitter's run id (train.py's lease)
  if [ -n "${!name:-}" ]; then
    printf 'export %s=%q\n' "$name" "${!name}" >>"$secrets"
  fi
done
copy_to_workers "$secrets" "$REMOTE_DIR/.secrets.env"

# the job: secrets read from the file and the file removed; stdin closed so ssh can leave
job="cd \$HOME/$REMOTE_DIR && chmod 600 .secrets.env && . ./.secrets.env && rm -f .secrets.env && source scripts/tpu_env.sh"
job="$job && PATH=\$HOME/$REMOTE_DIR/.venv/bin:\$PATH exec $cmd"
on_workers "mkdir -p \$HOME/$REMOTE_DIR/logs && nohup setsid bash -c $(printf '%q' "$job") \
> \$HOME/$REMOTE_DIR/logs/run.log 2>&1 < /dev/null &"
log "started on every worker of $TPU_NAME: $cmd (logs: scripts/tpu_logs.sh)"
