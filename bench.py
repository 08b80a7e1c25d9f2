"""
Benchmarks. Figures go to BENCHMARKS.md with the command, date and machine.

    python bench.py train --config configs/bench.py [--peer hf|hf-liger] [--steps N] [--stage 1|2]
    python bench.py train --config configs/bench_7b_stage1.py --variant bf16:frozen_dtype=bfloat16 ...
    python bench.py train [--size bench|debug] [--stage 1|2] [--peer hf] [--pack] [--compile] [--loss-chunk N]
    python bench.py data [--shards DIR]        # decode + preprocess images/s per core, ours vs webdataset + PIL
    python bench.py pack [--n 2000] [--workers 1 2]   # pack throughput: JPEG records from JSON, and as parquet rows
    python bench.py video [--seconds 20]       # pack on MP4 files; the loader on video shards against image shards
    python bench.py loader [--latency_ms 50]   # the loader from local files and from S3 (moto) behind latency
    python bench.py loader --computed          # computed: ranged reads from a real bucket, by streams and request size
    python bench.py xla                        # computed per-device memory of the 7B recipes on TPU pods
    python bench.py levers                     # computed memory, predicted speed of the speed levers (7B, H100)
    python bench.py attention                  # computed activation memory a chip, dense vs bounded attention (TPU)
    python bench.py checkpoint --ranks 4 [--gib 1.2] [--out DIR]   # sharded checkpoint: time blocked, rank 0's memory
    python bench.py checkpoint --ranks 2 --s3 [--latency-ms 50]    # the same to moto's S3 server, beside a local dir

`train` times full training steps (forward, backward, AdamW) on random weights and synthetic
batches after warm-up, and reports tokens/s, samples/s, MFU (docs/training.md "MFU"), peak memory and
the padding share. With --peer hf it builds transformers.LlavaForConditionalGeneration with the
same weights (through convert.py), the same batches, optimizer, precision and SDPA attention, and
prints ours/HF. The two alternate in phases (ours, HF, ours, HF), one model in memory at a time. --peer hf-liger
is the same model with Liger's kernels (apply_liger_kernel_to_llava: CUDA and the liger-kernel package, which
llavax does not require). Each --variant NAME:key=value,... adds a phase of ours with other settings (frozen_dtype,
checkpointing, checkpoint_policy, checkpoint_every, batch), reported under its name: one process, one model build,
for a matrix of speed levers. Without a peer the model is built and initialised on the device (a 7B in seconds).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

import checkpoint
import config
import parallel
import storage
from chat import IMAGE_TAG
from hf_config import llava_hf_config
from hf_names import llava_table
from weight_files import write_weights
from images import CLIP_MEAN, CLIP_STD, load_image, normalize_images
from loader import pack_rows, packed_batch
from model import build_model
from model_config import vlm_preset
from pack import pack, pack_source
from shards import read_members, sample_offsets, shard_files
from sources import JsonRecords, ParquetRows

SIZES = {  # (preset, seq_len, micro batch, real tokens per sample)
    "bench": ("bench", 2048, 8, 680),  # TinyLlama-1.1B-shaped LLM + CLIP ViT-L/14-336; 576 image + ~100 text tokens
    "debug": ("debug", 128, 4, 48),
}


def synthetic_samples(cfg, real_tokens, n, seed=0):
    """(ids, labels) of n samples: image placeholders first, then random text, `real_tokens` long (jittered)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        jitter = int(torch.randint(-real_tokens // 8, real_tokens // 8 + 1, (), generator=g))
        length = max(cfg.n_image_tokens + 16, real_tokens + jitter)
        ids = torch.randint(3, min(cfg.llm.vocab_size, cfg.image_token_id), (length,), generator=g)
        ids[: cfg.n_image_tokens] = cfg.image_token_id
        labels = ids.clone()
        labels[: cfg.n_image_tokens] = -100
        out.append((ids, labels))
    return out


def synthetic_batches(cfg, seq_len, rows, real_tokens, n, pack=False, seed=0):
    """n batches of `rows` x seq_len and the samples in each. Unpacked: a sample a row, right-padded. Packed: as
    many samples a row as fit (data.packed_batch), images in placeholder order, their count padded to a fixed
    number so shapes stay static."""
    samples = synthetic_samples(cfg, real_tokens, n * rows * (seq_len // real_tokens + 2), seed)
    g = torch.Generator().manual_seed(seed + 1)
    out, next_sample = [], 0
    for _ in range(n):
        if not pack:
            chosen = samples[next_sample : next_sample + rows]
            ids = torch.zeros(rows, seq_len, dtype=torch.long)
            labels = torch.full((rows, seq_len), -100, dtype=torch.long)
            for r, (i, lab) in enumerate(chosen):
                ids[r, : len(i)], labels[r, : len(lab)] = i, lab
            positions = None
        else:
            # the longest run of the next samples that fits the rows (first-fit decreasing)
            take = 1
            while all(w is not None for w in pack_rows([len(i) for i, _ in samples[next_sample : next_sample + take + 1]],
                                                       rows, seq_len)[0]):
                take += 1
            chosen = samples[next_sample : next_sample + take]
            b = packed_batch(chosen, rows, seq_len, pad_id=0)
            ids, labels, positions = b["input_ids"], b["labels"], b["position_ids"]
        next_sample += len(chosen)
        out.append({"ids": ids, "labels": labels, "positions": positions, "lengths": [len(i) for i, _ in chosen]})
    n_images = max(len(b["lengths"]) for b in out)
    for b in out:
        b["pixels"] = torch.randn(n_images if pack else rows, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g)
    return out


def hf_model(raw, device):
    """transformers' LLaVA with our weights, by convert.py's name table."""
    from transformers import LlavaForConditionalGeneration

    table, tied = llava_table(raw.cfg), raw.cfg.llm.tie_embeddings
    with tempfile.TemporaryDirectory() as d:  # the hub layout, as convert.py's to-hf writes it
        write_weights({table[k]: v.detach().cpu() for k, v in raw.state_dict().items()
                       if not (tied and k == "llm.output.weight")}, d)
        Path(d, "config.json").write_text(json.dumps(llava_hf_config(raw.cfg)))
        return LlavaForConditionalGeneration.from_pretrained(d, attn_implementation="sdpa",
                                                             dtype=torch.float32).to(device)


def hf_freeze(model, stage):
    for name, p in model.named_parameters():
        trained = "multi_modal_projector" in name or (stage in (0, 2) and ("language_model" in name or "lm_head" in name))
        p.requires_grad_(trained or (stage == 0 and "vision_tower" in name))


def run_phase(kind, raw_cpu, batches, args, device, steps, warmup):
    if kind not in ("hf", "hf-liger"):  # ours, or a --variant of it
        if raw_cpu.llm.rope_cos.is_meta:  # no peer to share weights with: random ones, made on the device
            model = build_model(raw_cpu.cfg, device=device, seed=0)
        else:
            model = build_model(raw_cpu.cfg, device=device, init=False)
            model.load_state_dict(raw_cpu.state_dict())
        parallel.freeze(model, args.stage)
        if args.frozen_dtype == "bfloat16":
            parallel.store_frozen(model, torch.bfloat16)
        model.loss_chunk = args.loss_chunk
        seq = batches[0]["ids"].shape[1]
        model.llm.flex_attention = parallel.use_flex_attention(args.pack, device.type, args.compile, seq)
        block_fn = parallel.checkpoint_fn(device.type, args.checkpoint_policy, "inductor" if args.compile else None)
        parallel.set_checkpointing(model, block_fn if args.checkpointing else None, args.checkpoint_every)
        if args.compile:
            parallel.compile_blocks(model)
        step_fn = lambda b: model(b["ids"], b["pixels"], b["labels"], "sum", b["positions"])[1] / b["n_targets"]  # noqa: E731
    else:
        model = hf_model(raw_cpu, device)
        if kind == "hf-liger":  # also patches LlavaForConditionalGeneration.forward (its fused loss): one peer a run
            liger_llava()(model=model)
        hf_freeze(model, args.stage)
        step_fn = lambda b: model(input_ids=b["ids"], pixel_values=b["pixels"], labels=b["labels"]).loss  # noqa: E731
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
        b = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batches[i % len(batches)].items()}
        with amp:
            loss = step_fn(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    dt = time.perf_counter() - t0
    if args.profile and kind == "ours":
        profile_steps(step_fn, opt, batches, device, amp, args.profile)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    first_loss = losses[0].item()
    model = opt = step_fn = None  # free before the next phase builds its model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds_per_step": dt / steps, "peak_mem_gib": peak, "first_loss": first_loss}


def phase_figures(raw, stage, r, bs, n_rows, seq_len, peak):
    """A phase's throughput, useful MFU and memory from its step time and its batches."""
    s = r["seconds_per_step"]
    samples = sum(len(b["lengths"]) for b in bs) / len(bs)  # per step
    real_tokens = sum(sum(b["lengths"]) for b in bs) / len(bs)
    # useful FLOPs: each sample at its own length (docs/training.md "MFU"); padding does no useful work
    flops = sum(parallel.flops_per_sample(raw, stage, n) for b in bs for n in b["lengths"]) / len(bs)
    return {"tokens_per_s": n_rows * seq_len / s, "real_tokens_per_s": real_tokens / s, "samples_per_s": samples / s,
            "samples_per_step": samples, "padding_share": 1 - real_tokens / (n_rows * seq_len),
            "mfu": flops / s / peak if peak else None, "peak_mem_gib": r["peak_mem_gib"], "step_ms": 1000 * s,
            "first_loss": r["first_loss"]}


def liger_llava():
    """liger_kernel's apply_liger_kernel_to_llava, or one sentence on why --peer hf-liger cannot run here."""
    if not torch.cuda.is_available():
        raise SystemExit("bench: --peer hf-liger needs CUDA (Liger's kernels are Triton GPU kernels); no GPU here")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llava
    except ImportError as e:
        raise SystemExit(f"bench: --peer hf-liger needs the liger-kernel package (pip install liger-kernel; llavax does "
                         f"not require it), which does not import here: {e}") from None
    return apply_liger_kernel_to_llava


VARIANT_KEYS = {"frozen_dtype": str, "checkpointing": lambda v: v.lower() in ("1", "true"), "checkpoint_policy": str,
                "checkpoint_every": int, "batch": int}


def parse_variant(text):
    """"NAME:key=value,key=value" -> (NAME, {key: value}) over VARIANT_KEYS, or one sentence on what is wrong."""
    name, _, settings = text.partition(":")
    out = {}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in VARIANT_KEYS:
            raise SystemExit(f"bench: --variant {text!r}: {item!r} is not key=value with a key of {sorted(VARIANT_KEYS)}")
        out[key] = VARIANT_KEYS[key](value)
    if not name or name in ("ours", "hf", "hf-liger"):
        raise SystemExit(f"bench: --variant {text!r} needs a name of its own before the colon")
    return name, out


def check_levers(args):
    if args.frozen_dtype == "bfloat16" and args.dtype != "bfloat16":
        raise SystemExit("bench: frozen_dtype bfloat16 needs --dtype bfloat16 (fp32 compute would meet bf16 weights)")
    if args.checkpoint_policy not in ("full", "selective") or args.checkpoint_every < 1:
        raise SystemExit(f"bench: checkpoint_policy must be full or selective and checkpoint_every >= 1, got "
                         f"{args.checkpoint_policy!r}, {args.checkpoint_every}")


def profile_steps(step_fn, opt, batches, device, amp, path, n=3):
    """The torch profiler's top kernels over n more steps, as a table in `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(n):
            b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batches[i % len(batches)].items()}
            with amp:
                step_fn(b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_phases(kinds, variants, raw, batches, args, device, rows, seq_len, peak):
    """{kind: the fastest of its phases, or out_of_memory}; each phase's figures are printed as it ends, so a run
    stopped later (a time limit) keeps them."""
    results = {}
    for kind in kinds:
        settings = SimpleNamespace(**variants[kind]) if kind in variants else args
        if len(variants) > 1:  # each phase compiles as its own run would: static shapes, no shared cache limit
            torch._dynamo.reset()
        try:
            r = run_phase(kind, raw, batches[kind], settings, device, args.steps, args.warmup)
        except torch.OutOfMemoryError:  # a lever's setting that does not fit is a result; the others still run
            r = None
        if r is None:
            gc.collect()
            torch.cuda.empty_cache()
            results.setdefault(kind, {"out_of_memory": True})
            print(f"phase {kind}: " + json.dumps({"out_of_memory": True}), flush=True)
            continue
        n_rows = variants.get(kind, {"batch": rows})["batch"]
        print(f"phase {kind}: {json.dumps(phase_figures(raw, args.stage, r, batches[kind], n_rows, seq_len, peak))}",
              flush=True)
        best = results.get(kind)
        if best is None or best.get("out_of_memory") or r["seconds_per_step"] < best["seconds_per_step"]:
            results[kind] = r
    return results


def bench_train(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset, seq_len, rows, real = SIZES[args.size or "bench"]
    model_cfg = vlm_preset(preset)
    if args.config:  # the model, row shape and our optimisations from a train.py config; flags given win
        cfg = config.load_config([args.config])
        model_cfg, seq_len, rows = config.model_config(cfg), cfg["seq_len"], cfg["micro_batch_size"]
        real = min(real, seq_len * 3 // 4)  # LLaVA-like ~680-token samples, shorter when the rows are
        args.stage = args.stage or (cfg["stage"] if cfg["stage"] in (1, 2) else 2)
        args.dtype = args.dtype or cfg["dtype"]
        args.pack, args.compile = args.pack or cfg["pack"] > 0, args.compile or cfg["compile"]
        args.checkpointing = args.checkpointing or cfg["activation_checkpointing"]
        args.loss_chunk = cfg["loss_chunk"] if args.loss_chunk is None else args.loss_chunk
        args.frozen_dtype = args.frozen_dtype or cfg["frozen_dtype"]
        args.checkpoint_policy = args.checkpoint_policy or cfg["checkpoint_policy"]
        args.checkpoint_every = args.checkpoint_every or cfg["checkpoint_every"]
    args.stage, args.dtype, args.loss_chunk = args.stage or 2, args.dtype or "bfloat16", args.loss_chunk or 0
    args.frozen_dtype, args.checkpoint_policy = args.frozen_dtype or "float32", args.checkpoint_policy or "full"
    args.checkpoint_every = args.checkpoint_every or 1
    rows = args.batch or rows
    variants = {"ours": vars(args) | {"batch": rows}}
    for text in args.variant:
        name, settings = parse_variant(text)
        variants[name] = variants["ours"] | settings
    for settings in variants.values():
        check_levers(SimpleNamespace(**settings))
    if args.peer == "hf-liger":
        liger_llava()  # its sentence before minutes of building
    torch.manual_seed(0)
    if args.peer:
        raw = build_model(model_cfg, device="cpu", seed=0)
    else:  # ours alone: each phase makes its weights on the device; this one only counts parameters (FLOPs)
        with torch.device("meta"):
            raw = build_model(model_cfg, device="meta", init=False)
    peak = args.peak_flops or parallel.Env({"device": device.type}).peak_flops()
    # HF always takes a sample a row; ours the same, or packed rows with --pack; a variant may take other rows
    batches = {kind: synthetic_batches(raw.cfg, seq_len, v["batch"], real, n=4, pack=args.pack)
               for kind, v in variants.items()}
    if args.peer:
        batches[args.peer] = synthetic_batches(raw.cfg, seq_len, rows, real, n=4, pack=False)
    for b in sum(batches.values(), []):
        b["n_targets"] = (b["labels"][:, 1:] != -100).sum()
    kinds = (["ours"] + ([args.peer] if args.peer else []) + list(variants)[1:]) * args.rounds  # the pair first
    results = run_phases(kinds, variants, raw, batches, args, device, rows, seq_len, peak)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "size": args.config or args.size or "bench",
              "stage": args.stage, "rows": rows, "seq_len": seq_len, "dtype": args.dtype, "pack": args.pack,
              "loss_chunk": args.loss_chunk, "compile": args.compile, "checkpointing": args.checkpointing,
              "frozen_dtype": args.frozen_dtype, "checkpoint_policy": args.checkpoint_policy,
              "checkpoint_every": args.checkpoint_every, "peer": args.peer,
              "variants": {k: {key: v[key] for key in VARIANT_KEYS} for k, v in variants.items()}}
    for kind, r in results.items():
        report[kind] = {"out_of_memory": True} if r.get("out_of_memory") else phase_figures(
            raw, args.stage, r, batches[kind], variants.get(kind, {"batch": rows})["batch"], seq_len, peak)
    if args.peer and not any(report[k].get("out_of_memory") for k in ("ours", args.peer)):  # ours / hf or hf-liger
        report["ratio"] = {k: report["ours"][k] / report[args.peer][k] for k in ("tokens_per_s", "real_tokens_per_s",
                                                                                "samples_per_s", "peak_mem_gib")}
    for kind in results:
        r = report[kind]
        if r.get("out_of_memory"):
            print(f"{kind:>4}: out of memory")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        print(f"{kind:>4}: {r['real_tokens_per_s']:,.0f} real tok/s ({r['tokens_per_s']:,.0f} with padding, "
              f"{100 * r['padding_share']:.1f}% padding), {r['samples_per_s']:.2f} samples/s "
              f"({r['samples_per_step']:.1f} a step), MFU {mfu}, peak mem {r['peak_mem_gib']:.2f} GiB, "
              f"{r['step_ms']:.1f} ms/step, first loss {r['first_loss']:.4f}")
    if "ratio" in report:
        q = report["ratio"]
        print(f"ours/{args.peer}: real tokens/s x{q['real_tokens_per_s']:.2f}, samples/s x{q['samples_per_s']:.2f}, "
              f"tokens/s with padding x{q['tokens_per_s']:.2f}, peak memory x{q['peak_mem_gib']:.2f}")
    print(f"{variants['ours']['batch']} x {seq_len}, stage {args.stage}, {args.dtype}; ours: pack {args.pack}, loss_chunk "
          f"{args.loss_chunk}, compile {args.compile}, checkpointing {args.checkpointing} ({args.checkpoint_policy}, "
          f"every {args.checkpoint_every}), frozen {args.frozen_dtype}")
    print(json.dumps(report))
    return report


# -----------------------------------------------------------------------------
# benchmark: decode + preprocess to `size` px, ours against webdataset + PIL


def make_bench_shards(out, n=400, width=640, height=480, seed=0, shard_size=100):
    """Photo-like 640x480 JPEGs (smooth gradients plus noise), packed."""
    bench_records(out, n, width, height, seed)
    pack(Path(out) / "bench.json", Path(out) / "images", Path(out) / "shards", shard_size=shard_size, overwrite=True)
    return Path(out) / "shards"


def bench_records(out, n=400, width=640, height=480, seed=0):
    """n records of photo-like JPEGs (smooth gradients plus noise): OUT/images/I.jpg and OUT/bench.json."""
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
    return records


def bench_pack(args):
    """Pack the same JPEG records from a JSON file and its image folder, and from parquet rows (row groups of 100,
    the images inside), alternating, --rounds times each; the fastest of each is reported."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    work = Path(args.workdir)
    if not (work / "bench.json").exists() or len(json.loads((work / "bench.json").read_text())) != args.n:
        bench_records(work, args.n, args.width, args.height)
    records = json.loads((work / "bench.json").read_text())
    image_bytes = sum((work / "images" / r["image"]).stat().st_size for r in records)
    rows = [{"id": r["id"], "image": {"bytes": (work / "images" / r["image"]).read_bytes(), "path": r["image"]},
             "conversations": r["conversations"]} for r in records]
    (work / "parquet").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), work / "parquet/bench.parquet", row_group_size=100)
    del rows
    print(f"{args.n} records, {image_bytes / args.n / 1e3:.0f} KB JPEGs ({args.width}x{args.height}), "
          f"{image_bytes / 1e6:.0f} MB of images; parquet file {(work / 'parquet/bench.parquet').stat().st_size / 1e6:.0f} "
          "MB\n| source | workers | seconds | samples/s | MB/s of images |\n|---|---|---|---|---|")
    for workers in args.workers:
        best = {}
        for _ in range(args.rounds):
            for kind in ("JSON + image folder", "parquet rows"):
                source = JsonRecords(work / "bench.json", work / "images") if kind.startswith("JSON") else \
                    ParquetRows(work / "parquet/bench.parquet")
                t0 = time.perf_counter()
                pack_source(source, work / "out", shard_size=1000, workers=workers, overwrite=True)
                best[kind] = min(best.get(kind, float("inf")), time.perf_counter() - t0)
        for kind, seconds in best.items():
            print(f"| {kind} | {workers} | {seconds:.2f} | {args.n / seconds:.0f} | {image_bytes / 1e6 / seconds:.1f} |")


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


# -----------------------------------------------------------------------------
# loader: the same shards from local files and from an S3 server behind injected latency


class LatencyProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that holds every request `latency` seconds before forwarding it to
    127.0.0.1:upstream: a bucket's time to first byte (50-100 ms on S3 and GCS) in front of a local S3 server."""

    def __init__(self, upstream, latency):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hop_by_hop = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
                      "expect", "content-length"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except ConnectionError:  # a client that went away (a loader worker at its end)
                    self.close_connection = True

            def forward(self):
                time.sleep(latency)
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop_by_hop}
                if not hasattr(self, "upstream"):  # one connection upstream for each client connection
                    self.upstream = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
                self.upstream.request(self.command, self.path, body=body, headers=headers)
                r = self.upstream.getresponse()
                data = r.read()
                self.send_response_only(r.status)
                for k, v in dict(r.getheaders()).items():  # once each: the S3 server sends two "Server" headers
                    if k.lower() not in hop_by_hop:
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def time_loader(loader, n_batches, step_s, warmup=2):
    """(samples/s, share of the time spent waiting for batches) over n_batches after `warmup`, each batch followed
    by step_s seconds of simulated training (the loader's workers go on meanwhile)."""
    batches, waited, n = iter(loader), 0.0, 0
    for _ in range(warmup):
        next(batches)
        time.sleep(step_s)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        t = time.perf_counter()
        n += len(next(batches)["sample_id"])
        waited += time.perf_counter() - t
        time.sleep(step_s)
    total = time.perf_counter() - t0
    return n / total, waited / total


# a real bucket, assumed (not measured here): time to first byte and one stream's rate once data flows
BUCKET_LATENCY = (0.05, 0.1)  # s a request, S3 and GCS
STREAM_RATE = 80e6  # B/s a stream
SAMPLE_BYTES = 150e3  # a LLaVA-665k sample: a JPEG of ~150 KB and its text


def print_bucket_reads():
    """Computed: the rate `streams` concurrent ranged requests of `size` bytes reach, each taking latency +
    size / STREAM_RATE, and the samples/s of SAMPLE_BYTES that makes."""
    print(f"| request | streams | {' | '.join(f'MB/s at {1e3 * lat:.0f} ms (samples/s)' for lat in BUCKET_LATENCY)} |")
    print("|---|---|" + "---|" * len(BUCKET_LATENCY))
    for size, what in ((SAMPLE_BYTES, "one sample (150 KB)"), (2**20, "1 MiB (merged)"), (4 * 2**20, "4 MiB (merged)")):
        for streams in (1, 16, 64):
            rates = [streams * size / (lat + size / STREAM_RATE) for lat in BUCKET_LATENCY]
            print(f"| {what} | {streams} | " + " | ".join(f"{r / 1e6:.0f} ({r / SAMPLE_BYTES:,.0f})" for r in rates) + " |")


def split_bench_shards(work, n_sources):
    """The bench samples (work/bench.json) as n_sources datasets of equal size, in work/sources/NNN."""
    records = json.loads((work / "bench.json").read_text())
    folders = [work / "sources" / f"{k:04d}" for k in range(n_sources)]
    for k, folder in enumerate(folders):
        if not (folder / ".nv-meta" / ".info.json").exists():
            part = work / "sources" / f"{k:04d}.json"
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps(records[k::n_sources]))
            pack(part, work / "images", folder, shard_size=10, overwrite=True)
    return folders


def bench_mixture_start(n_sources, work):
    """A mixture of n_sources small datasets (copies of one): seconds to open it, files held open and the resident
    memory after reading 50 batches of 8 from a loader with two workers."""
    import resource
    import shutil

    from loader import Loader, ShardStream
    from shapes import train_tokenizer

    one = work / "one"
    if not (one / ".nv-meta" / ".info.json").exists():
        make_bench_shards(work / "one-src", 40, width=64, height=48, shard_size=10)
        shutil.copytree(work / "one-src" / "shards", one, dirs_exist_ok=True)
    copies = [work / "copies" / f"{k:04d}" for k in range(n_sources)]
    for c in copies:
        if not c.exists():
            shutil.copytree(one, c)
    if not (work / "tokenizer.model").exists():
        train_tokenizer(["Describe the image.", "Waves."] * 50, work / "tokenizer", 320)
    t0 = time.perf_counter()
    stream = ShardStream([{"path": str(c), "weight": 1} for c in copies], work / "tokenizer.model", batch_size=8,
                         seq_len=64, image_size=28, image_token_id=320, n_image_tokens=4)
    opened = time.perf_counter() - t0
    batches = iter(Loader(stream, num_workers=2))
    for _ in range(50):
        next(batches)
    fds = len(os.listdir("/proc/self/fd"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {n_sources} | {len(stream)} | {opened:.2f} | {fds} | {rss:.0f} |")


def bench_loader(args):
    """The bench JPEGs (make_bench_shards) read by the loader, decoded to 336 px, from local files and from moto's S3
    server behind --latency_ms a request: with the ranged reads fetched ahead (shards.ShardReader), and one request
    a sample, as reading without prefetch would."""
    import shards
    from loader import Loader, ShardStream
    from shapes import train_tokenizer

    work = Path(args.workdir)
    local = work / "shards"
    if not (local / ".nv-meta" / ".info.json").exists():
        # small shards: moto reads a whole object to answer a ranged GET (a real bucket does not)
        make_bench_shards(work, args.n, shard_size=10)
    if not (work / "tokenizer.model").exists():
        train_tokenizer(["Describe the image.", "Waves."] * 50, work / "tokenizer", 320)
    url = start_s3(args.latency_ms) + "/shards"
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        storage.upload(f, f"{url}/{f.relative_to(local)}")
    n = sum(json.loads((local / ".nv-meta" / ".info.json").read_text())["shard_counts"].values())
    kib = sum(f.stat().st_size for f in local.glob("*.tar")) / 1024 / n
    print(f"loader: {n} samples ({kib:.0f} KiB a sample), batch {args.batch}, {args.workers} workers, {args.step_ms} ms "
          f"a simulated step, S3 (moto) behind {args.latency_ms:g} ms a request")
    ahead, best = shards.AHEAD, {}
    sources = {"local files": (local, ahead), f"S3 +{args.latency_ms:g} ms, read ahead": (url, ahead),
               f"S3 +{args.latency_ms:g} ms, one request a sample": (url, 1)}
    if args.sources > 1:  # the same samples as a mixture of equal sources, equal weights (mixture.py)
        folders = split_bench_shards(work, args.sources)
        for f in sorted(p for d in folders for p in d.rglob("*") if p.is_file()):
            storage.upload(f, f"{url}-mix/{f.relative_to(work / 'sources')}")
        sources |= {f"local files, {args.sources} sources": ([{"path": str(d), "weight": 1} for d in folders], ahead),
                    f"S3 +{args.latency_ms:g} ms, read ahead, {args.sources} sources":
                        ([{"path": f"{url}-mix/{d.name}", "weight": 1} for d in folders], ahead)}
    for _ in range(args.rounds):  # the sources alternate, so a busy moment of the machine hits them alike
        for name, (where, n_ahead) in sources.items():
            shards.AHEAD = n_ahead  # read at fork time by the workers too
            stream = ShardStream(where, work / "tokenizer.model", batch_size=args.batch, seq_len=640, image_size=336,
                                 image_token_id=320, n_image_tokens=576)
            rate, waiting = time_loader(Loader(stream, args.workers), args.batches, args.step_ms / 1000)
            best[name] = max(best.get(name, (0, 0)), (rate, waiting))
    shards.AHEAD = ahead
    print("| source | samples/s | waiting on data |\n|---|---|---|\n" + "\n".join(
        f"| {name} | {rate:.1f} | {waiting:.0%} |" for name, (rate, waiting) in best.items()))


# -----------------------------------------------------------------------------
# video: pack throughput on MP4 files; the loader on video shards against image shards, and against decoding the
# video bytes at load time (the storage pack does not choose)


def scene(width, height, n_frames, seed):
    """n_frames RGB frames of a camera panning over a photo-like scene (smooth colour fields, fine texture, discs)
    while a red block crosses it."""
    rng = np.random.default_rng(seed)
    big_h, big_w = height + 200, width + 400
    world = np.full((big_h, big_w, 3), 128.0, np.float32)
    for scale, amp in ((64, 90), (16, 40), (4, 6)):
        field = rng.normal(0, 1, (big_h // scale + 2, big_w // scale + 2, 3)).astype(np.float32)
        field = np.kron(field, np.ones((scale, scale, 1), np.float32))[:big_h, :big_w]
        k = max(1, scale // 2)  # a box blur of the blocks
        world += amp * (field + np.roll(field, k, 0) + np.roll(field, k, 1) + np.roll(field, (k, k), (0, 1))) / 4
    yy, xx = np.mgrid[0:big_h, 0:big_w]
    for _ in range(25):
        cx, cy, r = rng.integers(0, big_w), rng.integers(0, big_h), rng.integers(10, 80)
        world[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    world = np.clip(world, 0, 255).astype(np.uint8)
    for t in range(n_frames):
        x, y = int(200 + 180 * np.sin(t / 90)), int(100 + 90 * np.cos(t / 70))
        frame = world[y : y + height, x : x + width].copy()
        left = (t * 6) % width
        frame[height // 3 : height // 3 + 60, max(0, left - 30) : left + 30] = (240, 30, 30)
        yield frame


def bench_video_files(work, sizes, seconds, fps=30):
    """H.264 MP4s (x264's defaults: CRF 23, preset medium) of `scene`, one a size, kept in work/videos; the JSON of
    their records, and of image records (one JPEG a sample, a frame of the same size, quality 95) beside it."""
    import av

    folder = work / "videos"
    folder.mkdir(parents=True, exist_ok=True)
    videos, pictures = [], []
    for i, (w, h) in enumerate(sizes):
        name = f"{i}_{w}x{h}_{seconds}s.mp4"
        if not (folder / name).exists():
            with av.open(str(folder / f"tmp-{name}"), "w") as c:
                s = c.add_stream("libx264", rate=fps)
                s.width, s.height, s.pix_fmt = w, h, "yuv420p"
                for frame in scene(w, h, int(seconds * fps), seed=i):
                    for packet in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                        c.mux(packet)
                for packet in s.encode():
                    c.mux(packet)
            os.replace(folder / f"tmp-{name}", folder / name)
            Image.fromarray(next(scene(w, h, 1, seed=i))).save(folder / f"{i}.jpg", quality=95)
        turns = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A red block."}]
        videos.append({"id": i, "video": name, "conversations": turns})
        pictures.append({"id": i, "image": f"{i}.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                                          turns[1]]})
    (work / "videos.json").write_text(json.dumps(videos))
    (work / "images.json").write_text(json.dumps(pictures))
    return folder, videos


def tiles_from_video_bytes(data, settings, size):
    """What a loader would do with the video bytes in the shard: LLaVA-NeXT's frames decoded and squashed to
    size x size (the storage pack does not choose; timed here only)."""
    from video import count_packets, frame_indices, open_container, video_stream

    total, fps, _ = count_packets(data, settings)
    indices, _ = frame_indices(total, float(fps), settings)
    wanted, found = set(indices), {}
    with open_container(data) as container:
        for i, frame in enumerate(container.decode(video_stream(container, settings))):
            if i in wanted:
                found[i] = torch.from_numpy(np.array(frame.to_image().resize((size, size), Image.BICUBIC)))
            if i >= max(indices):
                break
    return torch.stack([found[i] for i in indices]).permute(0, 3, 1, 2)  # (n, 3, size, size)


def samples_per_second(work_fn, n, rounds):
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            work_fn(i)
        best = min(best, time.perf_counter() - t0)
    return n / best


def bench_video(args):
    """pack on MP4 records (samples/s, MB/s of video), then one process's loader samples/s (a DataLoader worker's
    rate, tiles squashed to 384 px as for LLaVA-OneVision) on the video shards, on the same shards with PNG frames,
    on image shards (one JPEG a sample, anyres tiles), and decoding the MP4 bytes at load time instead."""
    from loader import ShardStream
    from shapes import train_tokenizer
    from sources import JsonRecords
    from video import VideoSettings

    work = Path(args.workdir)
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes]
    folder, videos = bench_video_files(work, sizes, args.seconds)
    video_mb = sum((folder / r["video"]).stat().st_size for r in videos) / 1e6
    n = len(videos)
    print(f"{n} H.264 MP4s of {args.seconds} s at 30 fps ({', '.join(args.sizes)}), {video_mb:.1f} MB in all; "
          f"LLaVA-OneVision's frame choice (--frames-upbound 32 --video-fps 1)\n"
          "| pack | workers | seconds | samples/s | MB/s of video | bytes a sample in the shard |\n"
          "|---|---|---|---|---|---|")
    shards = {}
    for frames in ("jpg", "png"):
        for workers in args.workers:
            out = work / f"shards-{frames}"
            t0 = time.perf_counter()
            pack_source(JsonRecords(work / "videos.json", folder), out, workers=workers, overwrite=True,
                        video=VideoSettings(frame_format=frames))
            seconds = time.perf_counter() - t0
            per_sample = sum(f.stat().st_size for f in out.glob("*.tar")) / n
            print(f"| {frames.upper()} frames | {workers} | {seconds:.2f} | {n / seconds:.2f} | {video_mb / seconds:.1f} | "
                  f"{per_sample / 1e6:.2f} MB |")
            shards[f"video shards, {frames.upper()} frames"] = out
    pack_source(JsonRecords(work / "images.json", folder), work / "shards-images", overwrite=True)
    shards["image shards, one JPEG a sample"] = work / "shards-images"
    if not (work / "tokenizer.model").exists():
        train_tokenizer(["What moves?", "A red block.", "What?"] * 50, work / "tokenizer", 320)
    cfg = vlm_preset("llava-onevision-qwen2-0.5b")
    size = cfg.vision.image_size
    print(f"\n| loader, one process ({size} px tiles) | samples/s | tiles a sample | bytes a sample |\n|---|---|---|---|")
    for name, where in shards.items():
        stream = ShardStream(where, work / "tokenizer.model", batch_size=1, seq_len=16384, image_size=size,
                             image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template="chatml",
                             vlm=cfg, max_tiles=40, image_mean=cfg.vision.image_stats[0])
        tiles = sum(len(stream.encode(i)[2]) for i in range(n)) / n
        rate = samples_per_second(stream.encode, n, args.rounds)
        per_sample = sum(f.stat().st_size for f in where.glob("*.tar")) / n
        print(f"| {name} | {rate:.2f} | {tiles:.1f} | {per_sample / 1e6:.2f} MB |")
    blobs = [(folder / r["video"]).read_bytes() for r in videos]
    settings = VideoSettings()
    rate = samples_per_second(lambda i: tiles_from_video_bytes(blobs[i], settings, size), n, args.rounds)
    print(f"| the MP4 bytes decoded at load time (not stored so) | {rate:.2f} | "
          f"{len(tiles_from_video_bytes(blobs[0], settings, size))} (first) | {video_mb / n:.2f} MB |")


# -----------------------------------------------------------------------------
# xla: computed per-device memory of the TPU recipes (not measured on a TPU)

PODS = {"v4-64": (32, 32), "v5p-128": (64, 95), "v6e-64": (64, 32)}  # chips, HBM GiB a chip
RECIPES = {1: 256, 2: 128}  # global rows of a step: configs/tpu_pretrain.py (stage 1), LLaVA-1.5 stage 2


def xla_memory(preset="llava-1.5-7b", seq_len=2048):
    """Per-device GiB of weights, gradients, AdamW state and activations on mesh (1, chips, 1), from parallel.py's
    sharding rules applied to the real model's shapes (built on the meta device) and the formulas printed below."""
    from model import VLM

    with torch.device("meta"):
        model = VLM(vlm_preset(preset))
    c, rows = model.cfg, {}
    vit_used = max(i if i >= 0 else c.vision.n_layers + 1 + i for i in c.vision_layers)
    for stage, batch in RECIPES.items():
        parallel.freeze(model, stage)
        for pod, (chips, hbm) in PODS.items():
            mesh = {"dp": 1, "fsdp": chips, "tp": 1}
            axes = {n: [a for d in parallel.param_spec(n, p.dim()) if d for a in ((d,) if isinstance(d, str) else d)]
                    for n, p in model.named_parameters()}
            shards = {n: int(np.prod([mesh[a] for a in axes[n]])) for n in axes}
            weights = sum(4 * p.numel() / shards[n] for n, p in model.named_parameters())
            grads = sum(4 * p.numel() / shards[n] for n, p in model.named_parameters() if p.requires_grad)
            r, L, D, T, H = batch / chips, c.llm.n_layers, c.llm.dim, seq_len, c.llm.n_heads
            # checkpointing: each block's fp32 input is kept; one block at a time is recomputed, its bf16
            # projections and MLP (10 D + 6 F a token), its fp32 attention scores and their gradient (8 H T a token)
            saved = r * 4 * (L * T * D + vit_used * c.n_image_tokens * c.vision.dim)
            block = r * T * (2 * (10 * D + 6 * c.llm.ffn_dim) + 8 * H * T)
            # FSDP all-gathers one block's weights at a time (fp32, and their bf16 cast) for its forward or backward
            gathered = 6 * sum(p.numel() for p in model.llm.layers[0].parameters())
            rows[(stage, pod)] = (chips, hbm, r, weights, grads, 2 * grads, saved + block, gathered)
    return rows


def print_xla_memory():
    print("| stage | pod (chips, HBM) | rows a chip | weights | grads | AdamW | activations | gathered block | total GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (stage, pod), (chips, hbm, r, *sizes) in xla_memory().items():
        print(f"| {stage} | {pod} ({chips}, {hbm} GiB) | {r:g} | " + " | ".join(f"{x / 2**30:.2f}" for x in sizes)
              + f" | {sum(sizes) / 2**30:.1f} |")


# attention at the OneVision and NeXT recipes' lengths on TPU pods: activation memory a chip, computed

# (recipe, preset, tokens a row, rows a step): configs/onevision_qwen2_7b.py and configs/llava_next_7b.py
LONG_RECIPES = [("OneVision-7B", "llava-onevision-qwen2-7b", 16384, 64), ("NeXT-7B", "llava-next-vicuna-7b", 4096, 64)]
ATTENTION_PODS = {"v4-64": (32, 32), "v5p-128": (64, 95)}  # chips, HBM GiB a chip


def attention_bytes(c, T, attention, checkpointing, block=512):
    """Activation bytes of one row of T tokens through the LLM in a bf16 step. Each layer keeps what a fused attention
    keeps (kept_bytes 'none'), plus: 'dense' (SDPA on XLA) its fp32 probabilities, T a head a token, and while a layer
    runs backward the scores' and probabilities' gradients and the row's (T, T) mask; 'blockwise' its operand copies
    and, one layer at a time, six fp32 (heads, T, block) tiles; 'pallas' (flash, splash) nothing beyond (its tiles
    live in the chip's VMEM). Full checkpointing keeps each layer's fp32 input and one layer's tensors at a time. The
    attention terms match the compiled CPU programs of tests/xla_attention.py: 12.5 bytes a score (dense, 2 heads,
    4096 tokens) and 5.6 tiles (blockwise, 16384 tokens)."""
    H, hd = c.n_heads, c.head_dim
    kept = {"dense": 4 * H * T, "blockwise": 2 * (2 * H + 2 * c.n_kv_heads) * hd + 4 * H, "pallas": 0}[attention]
    working = {"dense": 8 * H * T + T, "blockwise": 6 * 4 * H * min(block, T), "pallas": 0}[attention]
    layer = kept_bytes(c, "none", True) + kept
    per_token = (c.n_layers * 4 * c.dim + layer if checkpointing else c.n_layers * layer) + working
    return T * per_token


def print_attention_memory():
    """Computed, not measured: activation GiB a chip for the long recipes (rows of the step split over the chips, the
    LLM's activations; weights, gradients and AdamW moments fp32 and sharded over every chip, stage 0)."""
    from model import VLM

    kinds = [(a, ckpt) for a in ("dense", "blockwise", "pallas") for ckpt in (False, True)]
    print("| recipe (tokens a row) | pod (chips, HBM) | rows a chip | weights + grads + AdamW | " +
          " | ".join(f"{a}{', checkpointed' if ckpt else ''}" for a, ckpt in kinds) + " |")
    print("|---|---|---|---|" + "---|" * len(kinds))
    for name, preset, T, rows in LONG_RECIPES:
        with torch.device("meta"):
            model = VLM(vlm_preset(preset))
        state = 16 * sum(p.numel() for p in model.parameters())
        for pod, (chips, hbm) in ATTENTION_PODS.items():
            r = rows / chips
            cells = [r * attention_bytes(model.cfg.llm, T, a, ckpt) / 2**30 for a, ckpt in kinds]
            print(f"| {name} ({T}) | {pod} ({chips}, {hbm} GiB) | {r:g} | {state / chips / 2**30:.1f} | " +
                  " | ".join(f"{x:,.1f}" for x in cells) + " |")


# the TPU recipe configs as written, each on the pod docs/recipes.md runs it on, and the model its init_from holds
TPU_RECIPES = {"configs/tpu_pretrain.py": ("v4-64", "llava-1.5-7b"),
               "configs/llava_next_7b.py": ("v4-64", "llava-next-vicuna-7b"),
               "configs/onevision_qwen2_7b.py": ("v5p-128", "llava-onevision-qwen2-7b"),
               "configs/onevision_qwen3_8b.py": ("v5p-128", "onevision-qwen3-8b")}


def recipe_memory(config_file, attention=None):
    """Computed, not measured: GiB a chip of a recipe config as written (attention: another, to compare) on its pod,
    and the pod's HBM a chip. fp32 weights sharded over every chip, fp32 gradients and AdamW's two moments of what its
    stage trains, and the LLM's activations (attention_bytes) of micro_batch_size rows (global under SPMD, at least
    one a chip: a GPU recipe's micro_batch_size=1 is --micro_batch_size=CHIPS on a pod) of seq_len tokens, with its
    attention ('bounded' is splash, a Pallas kernel, on a TPU) and its activation checkpointing."""
    from model import VLM

    cfg = config.load_config([str(Path(__file__).parent / config_file)])
    pod, preset = TPU_RECIPES[config_file]
    chips, hbm = (PODS | ATTENTION_PODS)[pod]
    with torch.device("meta"):
        model = VLM(vlm_preset(preset))  # what init_from holds (model_overrides apply only from scratch)
    parallel.freeze(model, cfg["stage"])
    state = sum((4 + 12 * p.requires_grad) * p.numel() for p in model.parameters())
    kind = attention or cfg["attention"]
    kind = "pallas" if kind in ("bounded", "splash", "flash") else kind
    rows = max(1.0, cfg["micro_batch_size"] / chips)
    activations = rows * attention_bytes(model.cfg.llm, cfg["seq_len"], kind, cfg["activation_checkpointing"])
    return (state / chips + activations) / 2**30, hbm


def print_recipe_memory():
    print("| recipe config as written | pod (chips, HBM) | attention | GiB a chip | with attention='dense' |")
    print("|---|---|---|---|---|")
    for config_file, (pod, _) in TPU_RECIPES.items():
        (gib, hbm), (dense, _) = recipe_memory(config_file), recipe_memory(config_file, attention="dense")
        attention = config.load_config([str(Path(__file__).parent / config_file)])["attention"]
        print(f"| {config_file} | {pod} ({(PODS | ATTENTION_PODS)[pod][0]}, {hbm} GiB) | {attention} | {gib:,.1f} | "
              f"{dense:,.1f} |")


# -----------------------------------------------------------------------------
# levers: computed memory of frozen_dtype and of the checkpointing settings, and predicted speed

H100_GIB = 79.6  # 81,559 MiB as nvidia-smi shows an H100 80GB HBM3
BASELINE_7B_STAGE1 = 18.0  # samples/s, LLaVA-1.5-7B stage 1, 8 x 2048, full checkpointing, H100 (measured)
CAST_SHARE = 0.014  # of its GPU time in the bf16 casts of frozen weights (measured profile)


def kept_bytes(c, policy, trained):
    """Activation bytes one LLM layer keeps for backward, a token, under bf16 autocast with compiled blocks: the
    tensors inductor's partitioner keeps (tests/test_speed_levers.py checks the three against it). Every policy
    keeps the fp32 block input (4 D). 'none' adds q, k and v as SDPA reads them (k and v repeated to every head),
    the attention output and its logsumexp, wo's, w1's and w3's outputs (bf16: 10 D + 4 F) and the norms' rsqrt;
    with trained weights also the inputs of wq, wo, w1 and w2 for their gradients (6 D + 2 F). 'selective' keeps
    the matmul outputs (k and v unrepeated) and the attention's; 'full' keeps the input alone."""
    D, kv, F, H = c.dim, c.n_kv_heads * c.head_dim, c.ffn_dim, c.n_heads
    kept = {"none": 14 * D + 4 * F + 8 + 4 * H + (6 * D + 2 * F) * trained,
            "selective": 10 * D + 4 * kv + 4 * F + 4 * H, "full": 4 * D}
    return kept[policy]


def lever_memory(model, stage, frozen_dtype, policy, every, rows, seq_len, loss_chunk=4096):
    """(weights, trained state, activations, loss chunk) bytes of one GPU's stage-`stage` step, not sharded."""
    parallel.freeze(model, stage)
    c, tokens = model.cfg.llm, rows * seq_len
    weights = 4 * sum(p.numel() for p in model.parameters())
    if frozen_dtype == "bfloat16":
        weights -= 2 * sum(p.numel() for p in parallel.frozen_matmul_weights(model))
    trained = 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # grad + 2 AdamW moments
    checkpointed, trained_llm = 0 if policy == "none" else len(range(0, c.n_layers, every)), stage != 1
    layers = checkpointed * kept_bytes(c, policy, trained_llm) + \
        (c.n_layers - checkpointed) * kept_bytes(c, "none", trained_llm)
    recompute = kept_bytes(c, "none", trained_llm) if policy == "full" else 0  # one block's, during its backward
    # a block that is not checkpointed also keeps autocast's bf16 copy of each fp32 matmul weight for its backward
    # (a bf16-stored weight is kept as itself); selective recomputes the casts
    fp32_matmuls = sum(m.weight.numel() for m in model.llm.layers[0].modules() if isinstance(m, torch.nn.Linear)
                       and (m.weight.requires_grad or frozen_dtype == "float32"))
    casts = 2 * fp32_matmuls * ((c.n_layers - checkpointed) + (policy == "full"))
    return weights, trained, tokens * (layers + recompute) + casts, loss_chunk * c.vocab_size * 8  # logits + grad


def print_levers():
    """Computed, not measured: bytes of each lever setting for LLaVA-1.5-7B on one H100, and the speed predicted from
    the measured 7B stage-1 baseline by the FLOPs recomputation adds and the casts' share (same hardware MFU assumed;
    selective's recomputed elementwise ops not counted)."""
    from model import VLM

    with torch.device("meta"):
        model = VLM(vlm_preset("llava-1.5-7b"))
    for stage in (1, 2):
        parallel.freeze(model, stage)
        n = sum(p.numel() for p in parallel.frozen_matmul_weights(model))
        print(f"stage {stage}: frozen_dtype='bfloat16' stores {n:,} frozen matmul weights in bf16: {2 * n / 1e9:.2f} GB "
              f"({2 * n / 2**30:.2f} GiB) less (x 1/ranks under FSDP)")
    c = model.cfg.llm
    T = 680  # a LLaVA stage-1 sample's tokens, as bench.py's synthetic ones
    useful = parallel.flops_per_sample(model, 1, T)
    llm_forward = 2 * (sum(p.numel() for p in model.llm.parameters()) - model.llm.tok_embeddings.weight.numel()) * T \
        + 2 * c.n_layers * c.dim * T**2
    print(f"\n7B stage 1, 8 x 2048 unless said; recomputing every LLM block adds {100 * llm_forward / useful:.0f}% to "
          f"the useful FLOPs (its forward again)")
    print("| setting | weights | activations | total (+ trained state, loss chunk) | fits 79.6 GiB? | predicted "
          "samples/s |")
    print("|---|---|---|---|---|---|")
    for label, frozen, policy, every, rows in [
            ("today: fp32 frozen, full checkpointing", "float32", "full", 1, 8),
            ("today without checkpointing (out of memory)", "float32", "none", 1, 8),
            ("bf16 frozen, full checkpointing", "bfloat16", "full", 1, 8),
            ("bf16 frozen, every other block checkpointed", "bfloat16", "full", 2, 8),
            ("bf16 frozen, selective checkpointing", "bfloat16", "selective", 1, 8),
            ("bf16 frozen, no checkpointing", "bfloat16", "none", 1, 8),
            ("bf16 frozen, no checkpointing, 4 rows", "bfloat16", "none", 1, 4),
            ("bf16 frozen, full checkpointing, 12 rows", "bfloat16", "full", 1, 12)]:
        weights, trained, acts, loss = lever_memory(model, 1, frozen, policy, every, rows, 2048)
        total = (weights + trained + acts + loss) / 2**30
        recomputed = 0 if policy in ("none", "selective") else len(range(0, c.n_layers, every)) / c.n_layers
        speed = BASELINE_7B_STAGE1 * (useful + llm_forward) / (useful + recomputed * llm_forward) \
            / (1 - CAST_SHARE * (frozen == "bfloat16"))
        print(f"| {label} | {weights / 2**30:.1f} GiB | {acts / 2**30:.1f} GiB | {total:.1f} GiB | "
              f"{'yes' if total < H100_GIB - 2 else 'no' if total > H100_GIB else 'at the edge'} | {speed:.1f} |")


# -----------------------------------------------------------------------------
# checkpoints: what a save costs the training loop, by world size


def rss_bytes():
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024


# (recipe, preset, stage, ranks or hosts, GPU node or TPU host)
CHECKPOINT_RECIPES = [("7B stage 1, 8 GPUs", "llava-1.5-7b", 1, 8, "gpu"),
                      ("7B stage 2, 8 GPUs", "llava-1.5-7b", 2, 8, "gpu"),
                      ("13B stage 2, 8 GPUs", "llava-1.5-13b", 2, 8, "gpu"),
                      ("7B stage 1, v4-64 (8 hosts)", "llava-1.5-7b", 1, 8, "tpu"),
                      ("7B stage 2, v4-64 (8 hosts)", "llava-1.5-7b", 2, 8, "tpu"),
                      ("7B stage 2, v5p-128 (16 hosts)", "llava-1.5-7b", 2, 16, "tpu")]
HOST_COPY = {"first": 1.5e9, "again": 16e9}  # B/s a GPU into fresh pageable pages / into the kept buffers (H100 host)
WRITE = {"gpu": 2e9, "tpu": 0.15e9}  # B/s a node (local NVMe) / a TPU host (to a bucket, one stream): assumed


def print_checkpoint_recipes():
    """Computed from the presets' real shapes (meta device) and the stated rates: what each rank (host) holds of a
    stage's checkpoint, the time the loop is blocked copying it to host memory, and the background write."""
    from model import VLM

    print("| recipe | state | per rank / host | blocked: first save, later saves | background write | "
          "stop checkpoint within 30 s? |")
    print("|---|---|---|---|---|---|")
    for name, preset, stage, ranks, kind in CHECKPOINT_RECIPES:
        with torch.device("meta"):
            model = VLM(vlm_preset(preset))
        parallel.freeze(model, stage)
        state = sum(p.numel() * (4 + 8 * p.requires_grad) for p in model.parameters())  # fp32 weights, AdamW moments
        mine = state / ranks
        first, again = mine / HOST_COPY["first"], mine / HOST_COPY["again"]
        write = (state / (ranks // 8 if kind == "gpu" else ranks)) / WRITE[kind]  # a GPU node's 8 ranks share its disk
        if kind == "gpu":  # torchrun SIGKILLs after 30 s; the detached writers then finish
            fits = f"yes: the copy ({first:.1f} s) fits; the writers outlive the kill" if first < 30 else "no"
        else:  # a spot TPU VM stops 30 s after the notice: copy and write must both fit
            fits = "yes" if again + write < 30 else f"no: {again + write:.0f} s (keep ckpt_interval short)"
        print(f"| {name} | {state / 1e9:.1f} GB | {mine / 1e9:.2f} GB | {first:.1f} s, {again:.2f} s | {write:.0f} s | "
              f"{fits} |")


def start_s3(latency_ms):
    """moto's S3 server in this process (the tests' emulator: pip install 'moto[server]'), behind a LatencyProxy when
    latency_ms, with a new bucket; its s3:// URL. The endpoint and test credentials go to os.environ, for the ranks
    and the loader's workers."""
    import logging
    import os
    import uuid

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line a request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    endpoint = LatencyProxy(port, latency_ms / 1000).url if latency_ms else f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    url = f"s3://llavax-bench-{uuid.uuid4().hex[:8]}"
    storage.filesystem(url).mkdir(storage.bucket(url))
    return url


def bench_checkpoint(args):
    """A stage-0 model of about --gib GiB of weights and AdamW moments, FSDP2-sharded over the ranks (gloo, CPU),
    saved --saves times through checkpoint.Checkpointer to each target (--out, and with --s3 a bucket on moto's S3
    server, side by side): the time the loop is blocked (host copy of this rank's shards), the time until the step is
    committed (every rank written and hashed, the manifest written), and rank 0's resident memory above what it held
    before the save (sampled every 10 ms)."""
    import os
    import threading

    import torch.distributed as dist

    from model import VLM

    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.s3 and not args.s3_url:  # one server and bucket for every rank, in this (the launching) process
        args.s3_url = start_s3(args.latency_ms)
        print(f"S3: moto at {os.environ['AWS_ENDPOINT_URL']}"
              + (f" behind {args.latency_ms:g} ms a request" if args.latency_ms else "") + f", bucket {args.s3_url}")
    if world == 1 and args.ranks > 1:  # start the ranks: this same command under torchrun
        import subprocess

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}", "--master_addr=127.0.0.1",
               "--master_port=29533", __file__, *sys.argv[1:]] + (["--s3-url", args.s3_url] if args.s3_url else [])
        return subprocess.call(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"})
    cfg_run = dict(config.DEFAULTS) | {"parallel": "fsdp", "device": "cpu", "keep_last": 1, "tokenizer": ""}
    env = parallel.Env(cfg_run)
    n_layers = max(1, round(args.gib * 2**30 / 12 / 16.8e6))  # 12 bytes a parameter, ~16.8M a 1024-wide layer
    cfg = vlm_preset("debug").with_overrides({"llm": {"dim": 1024, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 4096,
                                                      "n_layers": n_layers}})
    with torch.device("meta"):
        raw = VLM(cfg)
    model = parallel.shard(raw, env) if env.distributed else raw
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    optimizer = parallel.make_optimizer(raw, env, 1e-4, (0.9, 0.95), 0.0, {"vision": 1, "projector": 1, "llm": 1})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist
    loader = SimpleNamespace(state_dict=lambda: {"position": 0})
    targets = [("local", Path(args.out) / f"ranks-{world}")] + ([("s3", f"{args.s3_url}/ranks-{world}")] if args.s3_url
                                                                else [])
    ckpt = checkpoint.Checkpointer(env, cfg_run)
    state_bytes = sum(p.numel() * 12 for p in raw.parameters()) / 2**30
    rows = []
    for i in range(args.saves):
        for kind, out in targets:  # alternating, so that both see the same load on the machine
            base, peak, done = rss_bytes(), [0], threading.Event()

            def sample(peak=peak, done=done):
                while not done.is_set():
                    peak[0] = max(peak[0], rss_bytes())
                    time.sleep(0.01)

            sampler = threading.Thread(target=sample)
            sampler.start()
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            ckpt.save(storage.join(out, f"step-{i + 1:06d}"), model, raw, optimizer, loader, i + 1)
            blocked = time.perf_counter() - t0
            ckpt.wait()
            total = time.perf_counter() - t0
            done.set()
            sampler.join()
            rows.append((kind, i + 1, blocked, total))
            if env.master:
                print(f"ranks {world}, {kind}: state {state_bytes:.2f} GiB; save {i + 1}: blocked {blocked:.2f} s, "
                      f"committed {total:.2f} s, rank 0 extra memory {(peak[0] - base) / 2**30:.2f} GiB", flush=True)
    if env.master and len(targets) > 1:
        print("| target | blocked (s), each save | committed (s), each save |\n|---|---|---|")
        for kind, _ in targets:
            mine = [r for r in rows if r[0] == kind]
            print(f"| {kind} | {', '.join(f'{r[2]:.2f}' for r in mine)} | {', '.join(f'{r[3]:.2f}' for r in mine)} |")
    if env.distributed:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--config", help="a train.py config to take the model, shapes and settings from (configs/bench.py)")
    t.add_argument("--size", choices=sorted(SIZES), help="a built-in size instead of --config (default bench)")
    t.add_argument("--stage", type=int, choices=[1, 2], help="default 2, or the config's")
    t.add_argument("--peer", choices=["hf", "hf-liger"], help="hf-liger: transformers with Liger's kernels (CUDA)")
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--rounds", type=int, default=2, help="phases per model; the fastest is reported")
    t.add_argument("--batch", type=int, default=0, help="micro batch (default: the size's)")
    t.add_argument("--dtype", choices=["bfloat16", "float32"], help="default bfloat16, or the config's")
    t.add_argument("--compile", action="store_true", help="torch.compile our blocks")
    t.add_argument("--pack", action="store_true", help="ours: several samples a row (FlexAttention on CUDA)")
    t.add_argument("--loss-chunk", type=int, help="ours: cross-entropy this many positions at a time (0: off)")
    t.add_argument("--checkpointing", action="store_true", help="ours: recompute every block in backward")
    t.add_argument("--checkpoint-policy", choices=["full", "selective"], help="ours: default full, or the config's")
    t.add_argument("--checkpoint-every", type=int, help="ours: checkpoint every k-th block (default 1)")
    t.add_argument("--frozen-dtype", choices=["float32", "bfloat16"], help="ours: frozen matmul weights' storage")
    t.add_argument("--variant", action="append", default=[], help="NAME:key=value,...: one more phase of ours")
    t.add_argument("--profile", default="", help="write the torch profiler's top kernels of ours to this file")
    t.add_argument("--device", default="")
    t.add_argument("--peak-flops", type=float, default=0.0)
    d = sub.add_parser("data")
    d.add_argument("--shards", help="shards to read (default: generate 640x480 JPEGs in --workdir)")
    d.add_argument("--workdir", default="out/bench-data")
    d.add_argument("--size", type=int, default=336)
    d.add_argument("--n", type=int, default=400)
    pk = sub.add_parser("pack", help="pack throughput: JPEG records from a JSON file, and the same as parquet rows")
    pk.add_argument("--n", type=int, default=2000)
    pk.add_argument("--width", type=int, default=640)
    pk.add_argument("--height", type=int, default=480)
    pk.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    pk.add_argument("--rounds", type=int, default=2, help="packs of each source, alternating; the fastest is reported")
    pk.add_argument("--workdir", default="out/bench-pack")
    ld = sub.add_parser("loader", help="the loader from local files and from an S3 server behind injected latency")
    ld.add_argument("--latency_ms", type=float, default=50, help="added to every request to the S3 server")
    ld.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (train.py's num_workers)")
    ld.add_argument("--step_ms", type=float, default=100, help="simulated training time a batch")
    ld.add_argument("--batch", type=int, default=8)
    ld.add_argument("--batches", type=int, default=20, help="batches timed a source, after 2 of warm-up")
    ld.add_argument("--rounds", type=int, default=2, help="phases a source, alternating; the fastest is reported")
    ld.add_argument("--n", type=int, default=400, help="samples of the dataset generated in --workdir")
    ld.add_argument("--workdir", default="out/bench-loader")
    ld.add_argument("--computed", action="store_true", help="print the computed table for real buckets instead")
    ld.add_argument("--sources", type=int, default=1, help="also read the same samples as a mixture of this many "
                                                           "equal datasets, equal weights")
    ld.add_argument("--start-sources", type=int, nargs="*", default=[],
                    help="instead: open mixtures of this many small datasets, and read 50 batches")
    v = sub.add_parser("video", help="pack throughput on MP4 files; the loader on video shards against image shards")
    v.add_argument("--sizes", nargs="+", default=["640x360", "1280x720", "640x360", "1280x720"], help="WxH a video")
    v.add_argument("--seconds", type=float, default=20)
    v.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    v.add_argument("--rounds", type=int, default=2, help="loader passes over the samples; the fastest is reported")
    v.add_argument("--workdir", default="out/bench-video")
    sub.add_parser("xla", help="computed per-device memory of the LLaVA-1.5-7B TPU recipes (docs/recipes.md)")
    sub.add_parser("levers", help="computed memory and predicted speed of the speed levers for LLaVA-1.5-7B")
    sub.add_parser("attention", help="computed activation memory a chip of the long recipes: dense vs bounded attention")
    c = sub.add_parser("checkpoint", help="a sharded checkpoint's blocked time, commit time and rank 0's extra memory")
    c.add_argument("--ranks", type=int, default=1)
    c.add_argument("--gib", type=float, default=1.2, help="weights + AdamW moments, GiB")
    c.add_argument("--saves", type=int, default=3)
    c.add_argument("--out", default="out/bench-checkpoint")
    c.add_argument("--recipes", action="store_true", help="print the computed table of docs/recipes.md instead")
    c.add_argument("--s3", action="store_true", help="also save to a bucket on moto's S3 server, alternating with --out")
    c.add_argument("--latency-ms", type=float, default=0.0, help="--s3: hold every request this long (a real store)")
    c.add_argument("--s3-url", default="", help=argparse.SUPPRESS)  # the bucket the launching process made
    args = p.parse_args(argv)
    if args.cmd == "checkpoint":
        return print_checkpoint_recipes() if args.recipes else bench_checkpoint(args)
    if args.cmd == "xla":
        print_xla_memory()
        print()
        print_recipe_memory()
    elif args.cmd == "levers":
        print_levers()
    elif args.cmd == "attention":
        print_attention_memory()
    elif args.cmd == "loader" and args.start_sources:
        print("| sources | samples | seconds to open | files open (main process) | max RSS MiB (main process) |\n"
              "|---|---|---|---|---|")
        for n in args.start_sources:
            bench_mixture_start(n, Path(args.workdir) / "start")
    elif args.cmd == "loader":
        print_bucket_reads() if args.computed else bench_loader(args)
    elif args.cmd == "pack":
        bench_pack(args)
    elif args.cmd == "video":
        bench_video(args)
    elif args.cmd == "data":
        shards = args.shards or make_bench_shards(args.workdir, args.n)
        r = bench_images(shards, args.size)
        print(f"decode+preprocess to {args.size}px, 1 core: llavax {r['llavax']:.0f} img/s, "
              f"webdataset+PIL {r['webdataset+PIL']:.0f} img/s, ratio {r['llavax'] / r['webdataset+PIL']:.2f}x")
    else:
        bench_train(args)


if __name__ == "__main__":
    sys.exit(main())
