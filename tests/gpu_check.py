"""One prepared end-to-end check for a lent GPU: python tests/gpu_check.py OUT_DIR.
Not a pytest module. Shapes data; single-GPU bf16 training with loader workers and the batched accuracy pass;
torchrun FSDP2 stopped by SIGTERM to its process group, then resumed, against a straight run; sample.py with a
batch of two images; to-hf opened by the installed transformers' AutoProcessor. Prints a table at the end."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_check")
work.mkdir(parents=True, exist_ok=True)
py = sys.executable
results = []


def run(name, cmd, **kw):
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    results.append((name, p.returncode, round(time.time() - t0, 1), (p.stdout + p.stderr).strip().splitlines()[-1:]))
    return p


shapes = work / "shapes"
run("shapes", [py, "data.py", "shapes", "--out", str(shapes), "--n", "1200", "--overwrite"])  # a scratch folder
base = ["configs/debug.py", f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}",
        "--dtype=bfloat16", "--log_interval=10", "--eval_interval=50", "--num_workers=2"]
run("single_bf16", [py, "train.py", *base, f"--out_dir={work / 'single'}", "--max_iters=100",
                    "--final_accuracy_samples=64"])

torchrun = [py, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29533", "train.py", *base,
            "--parallel=fsdp", "--max_iters=300", "--ckpt_interval=1000", "--lr_decay_iters=300", "--eval_interval=0"]
run("fsdp_straight", [*torchrun, f"--out_dir={work / 'straight'}"])
t0 = time.time()
stopped = subprocess.Popen([*torchrun, f"--out_dir={work / 'stopped'}"], cwd=ROOT, start_new_session=True,
                           stdout=open(work / "fsdp_stopped.log", "w"), stderr=subprocess.STDOUT)
log = work / "stopped" / "log.jsonl"
while time.time() < t0 + 120 and not (log.exists() and '"step": 100,' in log.read_text()):
    time.sleep(0.5)
os.killpg(stopped.pid, signal.SIGTERM)  # as SLURM / a VM shutdown deliver it
rc = stopped.wait()
ckpts = sorted(p.name for p in (work / "stopped").glob("step-*"))
results.append(("fsdp_term_group", rc, round(time.time() - t0, 1), ckpts))
run("fsdp_resume", [*torchrun, f"--out_dir={work / 'stopped'}", "--init_from=resume"])
try:
    sys.path.insert(0, str(ROOT))
    import model_files
    a, b = ({k: t.detach() for k, t in model_files.saved_weights(sorted((work / d).glob("step-*"))[-1]).items()}
            for d in ("straight", "stopped"))
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    results.append(("straight_vs_resumed_max_abs_diff", 0, 0, [diff]))
except Exception as e:  # noqa: BLE001 (a report, not a test)
    results.append(("straight_vs_resumed_max_abs_diff", 1, 0, [repr(e)]))

single = sorted((work / "single").glob("step-*"))[-1] if list((work / "single").glob("step-*")) else work / "single"
images = sorted((shapes / "images").glob("*.png"))[-2:]
run("sample_batch", [py, "sample.py", "--ckpt", str(single), *[a for f in images for a in ("--image", str(f))],
                     "--prompt", "How many circles are there?", "--prompt", "What color is the square?"])
run("to_hf", [py, "convert.py", "to-hf", "--ckpt", str(single), "--out", str(work / "hf")])
run("auto_processor", [py, "-c", "import sys, transformers; from transformers import AutoProcessor, "
                       "LlavaForConditionalGeneration as L; AutoProcessor.from_pretrained(sys.argv[1]); "
                       "L.from_pretrained(sys.argv[1]); print('loaded with transformers', transformers.__version__)",
                       str(work / "hf")])

print(f"{'check':36} {'rc':>4} {'s':>7}  last line")
for name, rc, secs, tail in results:
    print(f"{name:36} {rc:>4} {secs:>7}  {json.dumps(tail)[:160]}")
