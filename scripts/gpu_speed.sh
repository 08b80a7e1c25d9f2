#!/usr/bin/env bash
# Issue 24's GPU speed matrix on one H100 (predicted 8-10 minutes; --only splits it in two calls of about 5):
# stage 2 on configs/bench.py (ours, transformers, transformers + Liger) and LLaVA-1.5-7B stage 1
# (configs/bench_7b_stage1.py) without and with each lever (frozen weights in bf16, selective or every-other-block
# checkpointing, no checkpointing, other micro-batches), each a bench.py phase, the likeliest winners first (a row
# stopped at its time limit keeps the phases it finished). Writes OUT/speed.json (a row per phase: its command,
# settings and bench.py's figures) and OUT/speed.md.
#
# usage: scripts/gpu_speed.sh [--out DIR] [--only stage2|stage1] [--debug] [--dry-run]
#   --out DIR   where the table and the logs go (default: $OUT, else out/gpu-speed)
#   --only X    one half of the matrix (two calls, where one would not fit a call's time)
#   --debug     the debug-size model on the CPU, one step a phase: checks the script, measures nothing
#   --dry-run   print the commands instead of running them
#
# Liger may not be installed on the GPU machine (no package index there): bring its wheel, e.g. here
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5
# into the checkout's .whl/; the script installs .whl/liger_kernel-*.whl into /tmp/site. Without it (or without
# CUDA) the Liger row is reported as skipped, with the reason.
set -euo pipefail

usage() { echo "usage: $0 [--out DIR] [--only stage2|stage1] [--debug] [--dry-run]" >&2; exit 2; }
out="${OUT:-out/gpu-speed}"
debug=0
dry_run=0
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || usage; out="$2"; shift 2 ;;
        --only) [ $# -ge 2 ] && [[ "$2" =~ ^stage[12]$ ]] || usage; only="$2"; shift 2 ;;
        --debug) debug=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        *) usage ;;
    esac
done
python="${PYTHON:-python3}"
cd "$(dirname "$0")/.."
mkdir -p "$out/rows"

# ---- the two models and their settings: the GPU targets, or the debug model on the CPU
if [ "$debug" = 1 ]; then
    stage2=(--size debug --stage 2 --pack --loss-chunk 64 --dtype bfloat16 --device cpu)
    stage1=(--size debug --stage 1 --pack --loss-chunk 64 --checkpointing --dtype bfloat16 --device cpu)
    timing=(--steps 1 --warmup 1 --rounds 1)
    bigger=6
    smaller=2
    stage2_rows=8
    big="debug"
else
    stage2=(--config configs/bench.py)
    stage1=(--config configs/bench_7b_stage1.py)
    timing=(--steps 4 --warmup 2 --rounds 1)
    bigger=12
    smaller=4
    stage2_rows=16
    big="7B"
fi

if [ -d .whl ] && compgen -G ".whl/liger_kernel-*.whl" >/dev/null && [ "$dry_run" = 0 ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/liger_kernel-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# ---- one bench.py run: its log, its report (the last stdout line), or why it did not run
n=0
bench() {  # bench NAME SECONDS PHASE=ROW_NAME... -- BENCH_ARGS...
    local name="$1" limit="$2"; shift 2
    local phases=()
    while [ "$1" != "--" ]; do phases+=("$1"); shift; done
    shift
    n=$((n + 1))
    local cmd=("$python" bench.py train "$@" "${timing[@]}")
    if [ "$dry_run" = 1 ]; then
        printf '%q ' "${cmd[@]}"; echo
        return 0
    fi
    echo "== $name: ${cmd[*]}" >&2
    local log="$out/rows/$n.log" status=0
    timeout "$limit" "${cmd[@]}" >"$log" 2>"$log.err" || status=$?
    "$python" - "$out/rows/$n.json" "$status" "${cmd[*]}" "$log" "${phases[@]}" <<'EOF'
import json, sys
path, status, command, log, *phases = sys.argv[1:]
lines = open(log).read().strip().splitlines()
err = open(log + ".err").read().strip().splitlines()
report = json.loads(lines[-1]) if status == "0" else {}
done = {}  # "phase KIND: {...}" lines, printed as each phase ends: what a stopped run had finished
for line in lines:
    if line.startswith("phase ") and ": {" in line:
        kind, _, figures = line[len("phase "):].partition(": ")
        done[kind] = json.loads(figures)
rows = []
for phase in phases:
    kind, _, name = phase.partition("=")
    row = {"name": name, "phase": kind, "command": command}
    if report.get(kind) or done.get(kind):
        row["result"] = report.get(kind) or done[kind]
        row["settings"] = report["variants"].get(kind, {"peer": report["peer"]}) if report else "see the command"
    else:
        row["error"] = (err or lines or [f"exit status {status}"])[-1] if status != "0" else f"no phase {kind!r}"
        if status == "124":
            row["error"] = "stopped at the row's time limit before this phase ended"
    rows.append(row)
json.dump(rows, open(path, "w"), indent=1)
EOF
}

skip() {  # skip NAME REASON
    n=$((n + 1))
    [ "$dry_run" = 1 ] && { echo "# skipped: $1 ($2)"; return 0; }
    "$python" -c 'import json, sys; json.dump([{"name": sys.argv[2], "skipped": sys.argv[3]}], open(sys.argv[1], "w"))' \
        "$out/rows/$n.json" "$1" "$2"
}

# ---- stage 2 on configs/bench.py: ours (and two levers), transformers, transformers + Liger (ours again beside it:
# the spread of one setting timed twice)
if [ "$only" != stage1 ]; then
bench "stage 2" 360 "ours=stage 2: ours" "bf16=stage 2: ours, bf16 frozen ViT" \
    "bigger=stage 2: ours, bf16 frozen ViT, $stage2_rows rows" "hf=stage 2: transformers" -- "${stage2[@]}" --peer hf \
    --variant bf16:frozen_dtype=bfloat16 --variant "bigger:frozen_dtype=bfloat16,batch=$stage2_rows"
liger_reason=$("$python" -c '
import torch
try:
    import liger_kernel  # noqa: F401
except ImportError as e:
    print(f"liger-kernel does not import ({e}): put its wheel in .whl/")
else:
    print("" if torch.cuda.is_available() else "no CUDA: Liger kernels are Triton GPU kernels")' 2>&1 | tail -n 1) || true
if [ -z "$liger_reason" ]; then
    bench "stage 2 + Liger" 240 "ours=stage 2: ours (again)" "hf-liger=stage 2: transformers + Liger" -- \
        "${stage2[@]}" --peer hf-liger
else
    skip "stage 2: transformers + Liger" "$liger_reason"
fi
fi

# ---- LLaVA-1.5-7B stage 1: today's settings, then each lever, in one process (one model shape, one data set)
if [ "$only" != stage2 ]; then
bench "$big stage 1" 540 \
    "ours=$big stage 1: fp32 frozen, full checkpointing (today)" \
    "bf16=$big stage 1: bf16 frozen, full checkpointing" \
    "bf16-none=$big stage 1: bf16 frozen, no checkpointing" \
    "bf16-selective=$big stage 1: bf16 frozen, selective checkpointing" \
    "bf16-none-smaller=$big stage 1: bf16 frozen, no checkpointing, $smaller rows" \
    "bf16-every2=$big stage 1: bf16 frozen, every other block checkpointed" \
    "bf16-bigger=$big stage 1: bf16 frozen, full checkpointing, $bigger rows" \
    -- "${stage1[@]}" \
    --variant bf16:frozen_dtype=bfloat16 \
    --variant bf16-none:frozen_dtype=bfloat16,checkpointing=false \
    --variant bf16-selective:frozen_dtype=bfloat16,checkpoint_policy=selective \
    --variant "bf16-none-smaller:frozen_dtype=bfloat16,checkpointing=false,batch=$smaller" \
    --variant bf16-every2:frozen_dtype=bfloat16,checkpoint_every=2 \
    --variant "bf16-bigger:frozen_dtype=bfloat16,batch=$bigger"
fi

[ "$dry_run" = 1 ] && exit 0

# ---- one JSON, one markdown table
"$python" - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = [r for p in sorted((out / "rows").glob("*.json"), key=lambda p: int(p.stem)) for r in json.loads(p.read_text())]
(out / "speed.json").write_text(json.dumps(rows, indent=1))
lines = ["| row | samples/s | real tok/s | useful MFU | peak GiB | ms/step |", "|---|---|---|---|---|---|"]
for r in rows:
    res = r.get("result", {})
    if res.get("out_of_memory"):
        lines.append(f"| {r['name']} | out of memory | | | | |")
    elif "samples_per_s" in res:
        mfu = f"{100 * res['mfu']:.1f}%" if res["mfu"] else "n/a"
        lines.append(f"| {r['name']} | {res['samples_per_s']:.2f} | {res['real_tokens_per_s']:,.0f} | {mfu} | "
                     f"{res['peak_mem_gib']:.1f} | {res['step_ms']:.0f} |")
    else:
        why = r.get("skipped") or r.get("error") or res.get("error") or res
        lines.append(f"| {r['name']} | {'skipped' if 'skipped' in r else 'failed'}: {why} | | | | |")
(out / "speed.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
failed = [r["name"] for r in rows if "error" in r]
sys.exit(f"failed: {failed}" if failed else 0)
EOF
