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
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench_data import (bench_images, bench_loader, bench_mixture_start, bench_pack, bench_video, make_bench_shards,
                        start_s3)
from memory import (print_attention_memory, print_bucket_reads, print_checkpoint_recipes, print_levers,
                    print_recipe_memory, print_xla_memory)
import checkpoint_writer
import config
import parallel
import storage
from hf_config import llava_hf_config
from hf_names import llava_table
from weight_files import write_weights
from loader import pack_rows, packed_batch
from model import build_model
from model_config import vlm_preset

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
# checkpoints: what a save costs the training loop, by world size


def rss_bytes():
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024


def bench_checkpoint(args):
    """A stage-0 model of about --gib GiB of weights and AdamW moments, FSDP2-sharded over the ranks (gloo, CPU),
    saved --saves times through checkpoint_writer.Checkpointer to each target (--out, and with --s3 a bucket on moto's S3
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
    ckpt = checkpoint_writer.Checkpointer(env, cfg_run)
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
