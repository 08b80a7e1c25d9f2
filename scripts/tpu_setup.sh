#!/usr/bin/env bash
# Install llavax on one Cloud TPU VM worker: the pinned requirements (torch and torch_xla of the same
# release) plus torch_xla's TPU runtime (libtpu), in .venv beside this checkout. Run it on every worker:
#   gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "cd llavax && bash scripts/tpu_setup.sh"
set -euo pipefail
usage="usage: scripts/tpu_setup.sh [--dry-run]   (from anywhere; installs into the checkout's .venv)"
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
run() {
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_xla_version=$(sed -n 's/^torch_xla==\([0-9.]*\).*/\1/p' requirements.txt)
if [ -z "$torch_xla_version" ]; then
  echo "tpu_setup: no torch_xla==VERSION pin in requirements.txt" >&2
  exit 1
fi
run "$python" -m venv .venv
run .venv/bin/python -m pip install --quiet --upgrade pip
run .venv/bin/python -m pip install --quiet -r requirements.txt
# the [tpu] extra brings libtpu for this torch_xla release; the index holds libtpu builds not on PyPI
run .venv/bin/python -m pip install --quiet "torch_xla[tpu]==${torch_xla_version}" \
  -f https://storage.googleapis.com/libtpu-releases/index.html
# gs:// paths (out_dir, data_dir, tokenizer, init_from) are read and written through gcsfs
run .venv/bin/python -m pip install --quiet gcsfs
run .venv/bin/python -c "import torch, torch_xla; print('llavax: torch', torch.__version__, 'torch_xla', torch_xla.__version__)"
