"""
Benchmarks. Figures go to BENCHMARKS.md with the command, date and machine.

    python bench.py train [--size bench|debug] [--stage 1|2] [--peer hf] [--steps N] [--batch B]
    python bench.py data [--shards DIR]        # decode + preprocess images/s per core, ours vs webdataset + PIL

`train` times full training steps (forward, backward, AdamW) on random weights and synthetic
batches after warm-up, and reports tokens/s, samples/s, MFU (README's formula), peak memory and
the padding share. With --peer hf it builds transformers.LlavaForConditionalGeneration with the
same weights (through convert.py), the same batches, optimizer, precision and SDPA attention, and
prints ours/HF. The two alternate in phases (ours, HF, ours, HF), one model in memory at a time.
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import convert
from data import CLIP_MEAN, CLIP_STD, IMAGE_TAG, load_image, normalize_images, pack, read_members, \
    sample_offsets, shard_files
import train
from model import build_model, vlm_preset

SIZES = {  # (preset, seq_len, micro batch, real tokens per sample)
    "bench": ("bench", 2048, 8, 680),  # TinyLlama-1.1B-shaped LLM + CLIP ViT-L/14-336; 576 image + ~100 text tokens
    "debug": ("debug", 128, 4, 48),
}


def synthetic_batches(cfg, seq_len, batch, real_tokens, n, seed=0):
    """Image placeholders first, then random text; `real_tokens` per sample (jittered), the rest padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        labels = torch.full((batch, seq_len), -100, dtype=torch.long)
        for row in range(batch):
            jitter = int(torch.randint(-real_tokens // 8, real_tokens // 8 + 1, (), generator=g))
            length = min(seq_len, max(cfg.n_image_tokens + 16, real_tokens + jitter))
            text = torch.randint(3, min(cfg.llm.vocab_size, cfg.image_token_id), (length,), generator=g)
            text[: cfg.n_image_tokens] = cfg.image_token_id
            ids[row, :length] = text
            labels[row, cfg.n_image_tokens : length] = text[cfg.n_image_tokens :]
        pixels = torch.randn(batch, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g)
        out.append((ids, pixels, labels))
    return out


def hf_model(raw, device):
    """transformers' LLaVA with our weights, through convert.py's to-hf."""
    from transformers import LlavaForConditionalGeneration

    with tempfile.TemporaryDirectory() as d:
        convert.save_model(raw, f"{d}/ours")
        convert.llava_to_hf(f"{d}/ours", f"{d}/hf")
        return LlavaForConditionalGeneration.from_pretrained(f"{d}/hf", attn_implementation="sdpa",
                                                             dtype=torch.float32).to(device)


def hf_freeze(model, stage):
    for name, p in model.named_parameters():
        trained = "multi_modal_projector" in name or (stage in (0, 2) and ("language_model" in name or "lm_head" in name))
        p.requires_grad_(trained or (stage == 0 and "vision_tower" in name))


def run_phase(kind, raw_cpu, batches, args, device, steps, warmup):
    if kind == "ours":
        model = build_model(raw_cpu.cfg, device=device, init=False)
        model.load_state_dict(raw_cpu.state_dict())
        train.freeze(model, args.stage)
        if args.compile:
            train.compile_blocks(model)
        step_fn = lambda ids, px, lab: model(ids, px, lab)[1]  # noqa: E731
    else:
        model = hf_model(raw_cpu, device)
        hf_freeze(model, args.stage)
        step_fn = lambda ids, px, lab: model(input_ids=ids, pixel_values=px, labels=lab).loss  # noqa: E731
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else torch.autocast(
        device.type, enabled=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, t0 = [], None
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        ids, px, lab = (t.to(device, non_blocking=True) for t in batches[i % len(batches)])
        with amp:
            loss = step_fn(ids, px, lab)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    first_loss = losses[0].item()
    model = opt = step_fn = None  # free before the next phase builds its model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds_per_step": dt / steps, "peak_mem_gib": peak, "first_loss": first_loss}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_train(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset, seq_len, batch, real = SIZES[args.size]
    batch = args.batch or batch
    torch.manual_seed(0)
    raw = build_model(vlm_preset(preset), device="cpu", seed=0)
    batches = synthetic_batches(raw.cfg, seq_len, batch, real, n=4)
    padding = 1 - sum(int((ids != 0).sum()) for ids, _, _ in batches) / sum(ids.numel() for ids, _, _ in batches)
    flops = train.flops_per_sample(raw, args.stage, seq_len) * batch
    env = type("E", (), {"kind": device.type, "device": device})()
    peak = args.peak_flops or train.known_peak_flops(env)
    kinds = ["ours", "hf"] * args.rounds if args.peer == "hf" else ["ours"] * args.rounds
    results = {}
    for kind in kinds:
        r = run_phase(kind, raw, batches, args, device, args.steps, args.warmup)
        best = results.get(kind)
        if best is None or r["seconds_per_step"] < best["seconds_per_step"]:
            results[kind] = r
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "size": args.size,
              "stage": args.stage, "batch": batch, "seq_len": seq_len, "dtype": args.dtype, "padding_share": padding}
    for kind, r in results.items():
        s = r["seconds_per_step"]
        report[kind] = {"tokens_per_s": batch * seq_len / s, "samples_per_s": batch / s,
                        "mfu": flops / s / peak if peak else None, "peak_mem_gib": r["peak_mem_gib"],
                        "step_ms": 1000 * s, "first_loss": r["first_loss"]}
    if "hf" in results:
        report["ratio"] = {"tokens_per_s": report["ours"]["tokens_per_s"] / report["hf"]["tokens_per_s"],
                           "peak_mem": report["ours"]["peak_mem_gib"] / report["hf"]["peak_mem_gib"]}
    for kind in results:
        r = report[kind]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        print(f"{kind:>4}: {r['tokens_per_s']:,.0f} tok/s, {r['samples_per_s']:.2f} samples/s, MFU {mfu}, "
              f"peak mem {r['peak_mem_gib']:.2f} GiB, {r['step_ms']:.1f} ms/step, first loss {r['first_loss']:.4f}")
    if "ratio" in report:
        print(f"ours/HF: tokens/s x{report['ratio']['tokens_per_s']:.2f}, peak memory x{report['ratio']['peak_mem']:.2f}")
    print(f"padding share {100 * padding:.1f}% ({report['batch']} x {seq_len}, stage {args.stage}, {args.dtype})")
    print(json.dumps(report))
    return report


# -----------------------------------------------------------------------------
# benchmark: decode + preprocess to `size` px, ours against webdataset + PIL


def make_bench_shards(out, n=400, width=640, height=480, seed=0):
    """Photo-like 640x480 JPEGs (smooth gradients plus noise), packed."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    records = []
    for i in range(n):
        base = np.stack([np.sin(xx / rng.uniform(20, 90) + c) * np.cos(yy / rng.uniform(20, 90)) for c in range(3)], -1)
        pixels = np.clip(127 + 100 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(out / "images" / f"{i}.jpg", quality=90)
        records.append({"id": i, "image": f"{i}.jpg", "conversations": [
            {"from": "human", "value": f"{IMAGE_TAG}\nDescribe the image."}, {"from": "gpt", "value": "Waves."}]})
    (out / "bench.json").write_text(json.dumps(records))
    pack(out / "bench.json", out / "images", out / "shards", shard_size=100)
    return out / "shards"


def bench_images(shards, size=336, repeats=2):
    """images/s on one core for our reader (draft decode, resize, pad, batched normalize) and webdataset + PIL."""
    import time

    torch.set_num_threads(1)
    files = shard_files(shards)

    def ours():
        n = 0
        for path in files:
            with open(path, "rb") as f:
                for start, end in sample_offsets(path):
                    _, members = read_members(f, start, end)
                    normalize_images(load_image(members["jpg"], size, "pad")[None])
                    n += 1
        return n

    def webdataset_pil():
        import webdataset as wds

        mean = np.array(CLIP_MEAN, dtype=np.float32)
        std = np.array(CLIP_STD, dtype=np.float32)
        n = 0
        for sample in wds.WebDataset([str(f) for f in files], shardshuffle=False).decode("pil"):
            img = sample["jpg"].convert("RGB")
            w, h = img.size  # LLaVA's expand2square, then the processor's resize and normalize
            square = Image.new("RGB", (max(w, h),) * 2, tuple(int(m * 255) for m in CLIP_MEAN))
            square.paste(img, ((max(w, h) - w) // 2, (max(w, h) - h) // 2))
            x = np.asarray(square.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
            ((x - mean) / std).transpose(2, 0, 1)
            n += 1
        return n

    results = {}
    for name, fn in (("llavax", ours), ("webdataset+PIL", webdataset_pil)):
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = fn()
            best = max(best, n / (time.perf_counter() - t0))
        results[name] = best
    return results



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--size", default="bench", choices=sorted(SIZES))
    t.add_argument("--stage", type=int, default=2, choices=[1, 2])
    t.add_argument("--peer", choices=["hf"])
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--rounds", type=int, default=2, help="phases per model; the fastest is reported")
    t.add_argument("--batch", type=int, default=0, help="micro batch (default: the size's)")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    t.add_argument("--compile", action="store_true", help="torch.compile our blocks")
    t.add_argument("--device", default="")
    t.add_argument("--peak-flops", type=float, default=0.0)
    d = sub.add_parser("data")
    d.add_argument("--shards", help="shards to read (default: generate 640x480 JPEGs in --workdir)")
    d.add_argument("--workdir", default="out/bench-data")
    d.add_argument("--size", type=int, default=336)
    d.add_argument("--n", type=int, default=400)
    args = p.parse_args(argv)
    if args.cmd == "data":
        shards = args.shards or make_bench_shards(args.workdir, args.n)
        r = bench_images(shards, args.size)
        print(f"decode+preprocess to {args.size}px, 1 core: llavax {r['llavax']:.0f} img/s, "
              f"webdataset+PIL {r['webdataset+PIL']:.0f} img/s, ratio {r['llavax'] / r['webdataset+PIL']:.2f}x")
    else:
        bench_train(args)


if __name__ == "__main__":
    sys.exit(main())
