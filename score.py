"""
Score a checkpoint on benchmarks without training: the answers and metrics train.py's `benchmarks` gives
(benchmarks.py: lmms-eval's prompts and metrics on greedy answers).

    python score.py --ckpt out/run/step-001000 --benchmarks mme pope --benchmark-dir data/benchmarks
    python score.py --ckpt gs://bucket/run/step-001000 --benchmarks mmstar=data/MMStar/mmstar.parquet --limit 100
    torchrun --nproc_per_node=8 score.py --ckpt CKPT --benchmarks mme       # each rank answers a slice

--ckpt is a training step, a convert.py output or an HF LLaVA directory, local or in a bucket. The template and image
mode default to the ones the checkpoint was trained with. Scores are printed, one benchmark a line, then as one JSON
line; the answers go to a JSONL beside the checkpoint (CKPT.score.jsonl) or to --out. Nothing already there is
overwritten (the run's own CKPT.benchmarks.jsonl, an earlier score): a name taken gets -2, -3, ... and the line that
starts scoring says where the answers go.
"""

import argparse
import json
import sys

import torch
import torch.distributed as dist

import chat
import config
import model_files
import storage
import weight_files
from benchmarks import TASKS, Asker, open_benchmarks, run_benchmarks
from parallel import Env, print0, shard


def trained_config(ckpt):
    """The training config a checkpoint carries in state.json, or {}."""
    state = storage.join(ckpt, "state.json")
    try:
        return json.loads(storage.read_text(state))["config"] if storage.exists(state) else {}
    except (ValueError, KeyError, TypeError):
        return {}


def unused(path):
    """path, or the first of path-2, path-3, ... (before its extension) that nothing has written yet."""
    base, dot, ext = path.rpartition(".") if "." in storage.name(path) else (path, "", "")
    n, found = 1, path
    while storage.exists(found):
        n += 1
        found = f"{base}-{n}{dot}{ext}"
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--benchmarks", nargs="+", required=True, help=f"names ({', '.join(TASKS)}) or NAME=PATH")
    p.add_argument("--benchmark-dir", default=config.DEFAULTS["benchmark_dir"])
    p.add_argument("--limit", type=int, default=0, help="the first this many questions of each (lmms-eval's --limit)")
    p.add_argument("--batch-size", type=int, default=config.DEFAULTS["benchmark_batch_size"])
    p.add_argument("--template", help="default: the training config's, else vicuna_v1")
    p.add_argument("--image-mode", choices=["pad", "crop", "resize"], help="default: the training config's, else pad")
    p.add_argument("--tokenizer", help="default: tokenizer.model or tokenizer.json in --ckpt")
    p.add_argument("--device", default="", help="'' picks cuda when available, else cpu; 'xla' under torch_xla SPMD")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", help="the answers' JSONL (default: CKPT.score.jsonl; a name taken gets -2, -3, ...)")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.limit < 0:
        p.error(f"--batch-size must be >= 1 (got {args.batch_size}), --limit >= 0 (got {args.limit})")
    benchmarks = open_benchmarks(args.benchmarks, args.benchmark_dir)  # a missing file: one sentence, before loading
    ckpt = args.ckpt.rstrip("/")
    if not storage.exists(ckpt):
        sys.exit(f"score: --ckpt {ckpt}: no such checkpoint")
    trained = trained_config(ckpt)
    template, image_mode = args.template or trained.get("template", "vicuna_v1"), \
        args.image_mode or trained.get("image_mode", "pad")
    if template not in chat.TEMPLATES:
        sys.exit(f"score: unknown template {template!r}; choose from {sorted(chat.TEMPLATES)}")
    env = Env(config.DEFAULTS | {"device": args.device, "dtype": args.dtype})
    try:
        tok = chat.Tokenizer(args.tokenizer or ckpt)
        model = model_files.load_model(ckpt, device="cpu" if env.kind == "xla" else env.device)
    except (OSError, ValueError, RuntimeError, weight_files.ConversionError) as e:
        sys.exit(f"score: {e}")
    if model.cfg.anyres or model.cfg.video_token_id is not None:
        sys.exit("score: benchmarks ask with one image a row (LLaVA-1.5's way); a model that tiles images is not "
                 "scored yet")
    model = shard(model, env) if env.kind == "xla" else model  # under torchrun every rank holds the whole model
    asker = Asker(tok, template, image_mode, args.batch_size, args.limit)
    wanted = str(args.out or storage.join(storage.parent(ckpt), storage.name(ckpt) + ".score.jsonl"))
    answers = unused(wanted)  # asked by every rank alike, before any writes (rank 0 writes at the end)
    print0(env, f"score: {ckpt}, template {template}, image mode {image_mode}, {env.world} x {env.kind}; answers to "
                f"{answers}" + (f" ({wanted} is there already: not overwritten)" if answers != wanted else ""))
    scores = run_benchmarks(model, benchmarks, asker, env, answers)
    print0(env, json.dumps(scores))
    if env.distributed:
        dist.destroy_process_group()
    return scores


if __name__ == "__main__":
    with torch.no_grad():
        main()
