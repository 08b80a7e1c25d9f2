"""
What fits where: the memory and time arithmetic the recipes rely on, computed from the presets' real shapes (built on
the meta device) and stated rates, never measured here. bench.py prints it (xla, levers, attention, checkpoint
--recipes, loader --computed); docs/recipes.md quotes it.
"""

from pathlib import Path

import numpy as np
import torch

import config
import parallel
from model_config import vlm_preset


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
    """The table, with what it assumes said in its cells: a GPU recipe's micro_batch_size of 1 would leave chips idle
    on a pod, so at least one row a chip is counted; 'bounded' attention is splash, a Pallas kernel never run here."""
    print("| recipe config as written | pod (chips, HBM) | micro_batch_size as written -> rows a chip counted | "
          "attention | GiB a chip | with attention='dense' |")
    print("|---|---|---|---|---|---|")
    for config_file, (pod, _) in TPU_RECIPES.items():
        (gib, hbm), (dense, _) = recipe_memory(config_file), recipe_memory(config_file, attention="dense")
        cfg = config.load_config([str(Path(__file__).parent / config_file)])
        chips, rows = (PODS | ATTENTION_PODS)[pod][0], cfg["micro_batch_size"]
        counted = f"{rows} -> {rows / chips:g}" if rows >= chips else f"{rows} -> 1 (assumed: --micro_batch_size={chips})"
        attention = cfg["attention"] + (" (a Pallas kernel: assumed, never run)"
                                        if cfg["attention"] in ("bounded", "splash", "flash") else "")
        print(f"| {config_file} | {pod} ({chips}, {hbm} GiB) | {counted} | {attention} | {gib:,.1f} | {dense:,.1f} |")


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




# -----------------------------------------------------------------------------
# the loader from a real bucket, computed

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

