"""
Train a LLaVA-style VLM. Configured nanoGPT-style: the defaults below, then a config file, then
--key=value overrides (parsed with ast.literal_eval).

    python train.py                                        # the shapes demo from scratch
    python train.py configs/debug.py --max_iters=20
    torchrun --nproc_per_node=8 train.py configs/finetune.py --parallel=fsdp

stage 0 trains everything, stage 1 the projector only, stage 2 the projector and the LLM.
"""

import json
import math
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

import config
import convert
import data
import rl
import storage
from checkpoint import (Checkpointer, check_resume_config, checkpoints, newest_good_checkpoint, remove_step,
                        unfinished_steps, wait_for_stop_writer)
from config import check_objective, lora_config, model_config  # noqa: F401  (bench.py, data_cli.py, tests: train.*)
from dpo import (evaluate_preference, pair_objective, preference_loss, reference_model,  # noqa: F401  (tests: train.*)
                 reward_pairs, sequence_logps)
from evaluation import device_batch, evaluate, final_accuracy
from lora import apply_lora, is_lora_parameter, merge_lora
from model import VLMConfig, build_model, param_group
from parallel import Env, autocast, checkpoint_fn, grad_sync, init_optimizer_state, print0, shard

# -----------------------------------------------------------------------------
# config: typed defaults; configs/*.py and --key=value may change only these keys
# I/O
out_dir = "out/shapes"
init_from = "scratch"  # 'scratch', 'resume' (newest checkpoint in out_dir) or a convert.py checkpoint directory
model = "debug"  # the VLM preset when init_from='scratch'
model_overrides = {  # merged into the preset; these make the shapes demo's 1.8M-parameter VLM
    "vision": {"image_size": 48, "patch_size": 16, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 512},
    "llm": {"vocab_size": 576, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 384, "max_seq_len": 64},
    "vision_layer": -1,
    "image_token_id": 512,  # the shapes tokenizer holds at most 512 pieces; the vocab is padded to 576
}
# data
data_dir = "data/shapes/shards"
tokenizer = "data/shapes/tokenizer.model"
template = "llama_3"
seq_len = 36  # the demo's samples are 30-34 tokens (9 image tokens, llama_3); padding past them is compute
pack = 0  # > 0: each micro-batch reads pack x rows samples and packs them into its rows (no padding waste)
max_tiles = 0  # > 0: static ViT tile slots a row, shared by its images and their anyres tiles; 0: one image a row
image_mode = "pad"
fast_images = False  # True: JPEG draft decoding + torch's bicubic, ~2x faster, up to ~12 levels off (README)
num_workers = 1
shuffle_block = 1000
# what to train, and how
stage = 0  # 0 everything, 1 the projector, 2 the projector and the LLM
batch_size = 64  # global: across ranks and accumulation micro-steps
micro_batch_size = 64  # per rank per micro-step
max_iters = 1500  # the demo: 94.2-95.0% held-out at 1500 steps, 86.4-91.8% at 1200, 96.8-97.6% at 2000 (BENCHMARKS.md)
lr = 3e-4
min_lr = 5e-5
warmup_iters = 100
lr_decay_iters = 0  # 0: max_iters
lr_scale = {"vision": 1.0, "projector": 1.0, "llm": 1.0}  # per-module multipliers
lora = {}  # {} off; else LoRA adapters {"r", "alpha", "dropout", "targets", "rslora"} (README "LoRA")
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
max_nonfinite_steps = 5  # an update with a non-finite loss or gradient is skipped; this many in a row stop the run
skip_steps = []  # [(first, end), ...]: iterations whose batches are consumed but not trained on
# evaluation, logging, checkpoints
eval_interval = 500
eval_iters = 4
log_interval = 50
ckpt_interval = 500
keep_last = 2
allow_config_change = []  # keys that may differ from the checkpoint's config on resume (see FIXED_ON_RESUME)
final_accuracy_samples = 500  # > 0: exact-match accuracy of generated answers on that many val samples
wandb_log = False
wandb_project = "llavax"
wandb_run_name = ""
# backend
device = ""  # '' picks cuda when available, else cpu; 'xla' is torch_xla SPMD (TPU, or CPU devices in tests)
parallel = "ddp"  # under torchrun: 'ddp' or 'fsdp'
mesh = [1, -1, 1]  # xla: devices as (dp, fsdp, tp); one -1 takes what the others leave
dcn_mesh = [1, 1, 1]  # xla: slices as (dp, fsdp, tp) for multi-slice pods (dp across slices is usual)
dtype = "float32"  # 'bfloat16': bf16 compute with fp32 master weights
compile = False
activation_checkpointing = False
checkpoint_policy = "full"  # 'selective': keep the matmul and attention outputs, recompute a block's elementwise ops
checkpoint_every = 1  # k: checkpoint blocks 0, k, 2k, ... of each tower; the others keep all their activations
frozen_dtype = "float32"  # 'bfloat16' (with dtype='bfloat16'): frozen Linear/Conv weights stored in bf16, never cast
loss_chunk = 0  # > 0: cross-entropy over this many positions at a time, never the full fp32 logits
peak_flops = 0.0  # per device, for MFU; 0 uses the bf16 dense peak of a known GPU
seed = 0
# preference training (README "Preference training (DPO)"): rows of chosen and rejected answers from preference shards
objective = "sft"  # 'sft' (next-token loss) or 'dpo' (against a frozen reference: the init_from checkpoint)
dpo_beta = 0.1
dpo_loss = "sigmoid"  # 'sigmoid' (DPO), 'ipo' (length-normalised, as TRL), 'hinge'
dpo_sft_weight = 0.0  # + this x the chosen answers' token NLL (LLaVA-NeXT's gamma; TRL's "sft" loss)
dpo_end_of_turn = True  # False: an answer's log-prob leaves out its end-of-turn token (its last supervised one)
dpo_reference = ""  # the reference checkpoint; '' is init_from (name it when resuming: init_from is then 'resume')
# objective='reward' (README "Reward models and RL"): a scalar head on the same preference shards, Bradley-Terry loss
reward_margin = 0.0  # -log sigmoid(r_chosen - r_rejected - margin)
reward_center_weight = 0.0  # + this x (r_chosen + r_rejected)^2: rewards stay near 0 (TRL's center_rewards_coefficient)
# objective='grpo': prompts from SFT shards, grpo_group samples each; batch_size and micro_batch_size count prompts
grpo_group = 4  # completions a prompt (TRL's num_generations)
grpo_loss = "dapo"  # 'dapo' (token sum / the step's completion tokens: TRL's default), 'grpo', 'dr_grpo'
grpo_beta = 0.0  # k3 KL to the reference (grpo_reference, else init_from); 0: no reference (TRL's default)
grpo_epsilon = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon]
grpo_iterations = 1  # optimisation steps on each generation batch (TRL's num_iterations); > 1 uses the importance ratio
grpo_max_new_tokens = 8
grpo_temperature = 1.0
grpo_top_p = 1.0
grpo_reward = "exact_match"  # 'exact_match', 'module:function' (completions, answers) -> floats, or a reward-model dir
grpo_reference = ""
grpo_static = False  # static-shape rollouts (always under XLA): prompts left-padded to grpo_prompt_len, hashed draws
grpo_prompt_len = 0  # static rollouts' prompt bucket (0: seq_len - grpo_max_new_tokens); a longer prompt is skipped
# FSDP2: True keeps every block gathered from the first decoding step to the last (TRL's ds3_gather_for_generation, on
# by default there): fast, but the whole model on each rank. False gathers each block again at every step (less memory)
grpo_gather_for_generation = False
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, list, dict))}

# -----------------------------------------------------------------------------
# configuration


def load_config(argv):
    return config.check(config.parse(argv, DEFAULTS))


def check_tiles(vlm, max_tiles):
    """An anyres or video model needs tile slots; anyres needs room for the base view and the smallest grid."""
    tiled = vlm.anyres or vlm.video_token_id is not None
    if tiled and not max_tiles:
        raise SystemExit(f"config: max_tiles=0, but the model tiles images (anyres={vlm.anyres!r}, video_token_id="
                         f"{vlm.video_token_id}): set max_tiles to the ViT slots a row holds (e.g. 10 for a base view and "
                         f"a 3x3 grid)")
    if vlm.anyres and max_tiles and vlm.grid_pinpoints:
        size = vlm.vision.image_size
        least = 1 + min(math.ceil(h / size) * math.ceil(w / size) for h, w in vlm.grid_pinpoints)
        if max_tiles < least:
            raise SystemExit(f"config: max_tiles={max_tiles} is fewer than the {least} tiles the smallest anyres image "
                             f"needs (a base view and the smallest grid of grid_pinpoints {vlm.grid_pinpoints}): every "
                             f"image would be dropped")


# -----------------------------------------------------------------------------
# backends: small functions applied in a fixed order: freeze -> checkpointing -> compile -> shard


def freeze(model, stage):
    """requires_grad by stage. ViT blocks above the selected layer and ln_post never reach the loss: frozen too.
    A part with LoRA adapters trains them alone."""
    trained = {0: ("vision", "projector", "llm"), 1: ("projector",), 2: ("projector", "llm")}[stage]
    n = model.cfg.vision.n_layers
    top = max(i if i >= 0 else n + 1 + i for i in model.cfg.vision_layers)
    adapted = {param_group(name) for name, _ in model.named_parameters() if is_lora_parameter(name)}
    for name, p in model.named_parameters():
        unused = name.startswith("vision.ln_post") or (name.startswith("vision.blocks.") and int(name.split(".")[2]) >= top)
        in_full = param_group(name) not in adapted or is_lora_parameter(name)
        p.requires_grad_(param_group(name) in trained and not unused and in_full)


def add_lora(raw, cfg, env, resuming):
    """The config's LoRA on the loaded model: fresh adapters (B = 0: the outputs do not change), or the model's own
    when it holds the same ones (resume, or init_from a LoRA run); other adapters it holds are merged in first."""
    lora = config.lora_config(cfg)
    if raw.cfg.lora == lora:
        return raw
    if resuming:
        raise SystemExit(f"resume: the checkpoint has lora={raw.cfg.lora}, the config lora={lora}; resume with the "
                         f"same, or start a new out_dir with init_from the checkpoint")
    if raw.cfg.lora:
        print0(env, f"init_from: merging its LoRA adapters ({raw.cfg.lora}) into the weights")
        merge_lora(raw)
    if lora:
        untrained = {t.split(".")[0] for t in lora.targets} - {0: {"vision", "llm"}, 1: set(), 2: {"llm"}}[cfg["stage"]]
        if untrained:
            raise SystemExit(f"config: lora targets {lora.targets} adapt {sorted(untrained)}, which stage {cfg['stage']} "
                             f"does not train (stage 2 trains the projector and the LLM)")
        apply_lora(raw, lora, seed=cfg["seed"])
        n = sum(p.numel() for name, p in raw.named_parameters() if is_lora_parameter(name))
        print0(env, f"lora: r {lora.r}, alpha {lora.alpha:g} (scaling {lora.scaling:g}) on {', '.join(lora.sites())}: "
               f"{n / 1e6:.2f}M adapter parameters")
    return raw


def add_reward_head(model, seed):
    """objective='reward' from a checkpoint without one: a scalar head nn.Linear(dim, 1), std 1/sqrt(dim) as
    init_weights draws it, bias 0. The LM head plays no part in the reward: frozen (DDP needs every trained
    parameter to reach the loss)."""
    if model.reward_head is None:
        model.cfg.reward_head = True
        dim, weight = model.cfg.llm.dim, model.llm.output.weight
        model.reward_head = torch.nn.Linear(dim, 1, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            model.reward_head.weight.normal_(std=dim**-0.5, generator=torch.Generator(weight.device).manual_seed(seed))
            model.reward_head.bias.zero_()
    model.reward_head.requires_grad_(True)  # whatever the stage
    if not model.cfg.llm.tie_embeddings:
        model.llm.output.weight.requires_grad_(False)


def set_checkpointing(model, fn, every=1):
    """fn recomputes blocks 0, k, 2k, ... of each tower in backward (k = every); the others keep their activations."""
    for tower, blocks in ((model.vision, model.vision.blocks), (model.llm, model.llm.layers)):
        chosen = {id(b) for b in list(blocks)[::every]}
        tower.checkpoint = fn if fn is None or every == 1 else \
            (lambda block, *args, chosen=chosen: fn(block, *args) if id(block) in chosen else block(*args))


def store_frozen(model, dtype):
    """Frozen weights and biases of the Linear and Conv2d layers kept in `dtype` (bf16): the copy autocast makes of
    them at every use, made once, and their fp32 originals dropped. Embeddings, norms and the ViT's positional and
    class embeddings stay fp32: autocast does not cast them (the token embedding starts the fp32 residual stream)."""
    for p in frozen_matmul_weights(model):
        p.data = p.data.to(dtype)


def frozen_matmul_weights(model):
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}  # and a tied output
    return [p for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for p in (m.weight, m.bias)
            if p is not None and not p.requires_grad and id(p) not in embeddings]


def use_flex_attention(packed, device_kind, compiled, seq_len):
    """FlexAttention for packed rows needs CUDA and compiled blocks. Its kernels failed to compile on an H100 (torch
    2.11) for 96-token rows but ran for 128, 256 and 2048: whole 128-token blocks only, else SDPA with a dense mask."""
    return packed and device_kind == "cuda" and compiled and seq_len % 128 == 0


def compile_blocks(model):
    for block in list(model.vision.blocks) + list(model.llm.layers):
        block.compile()


# -----------------------------------------------------------------------------
# optimizer, schedule, FLOPs


def make_optimizer(raw, cfg, env):
    groups = {}
    for name, p in raw.named_parameters():
        if p.requires_grad:
            module, decay = param_group(name), p.dim() >= 2  # no weight decay on norms, biases, image_newline
            g = groups.setdefault((module, decay), {"params": [], "lr_scale": cfg["lr_scale"][module],
                                                    "weight_decay": cfg["weight_decay"] if decay else 0.0})
            g["params"].append(p)
    kw = {"fused": True} if env.kind == "cuda" else {"foreach": True} if env.kind == "cpu" else {}
    return torch.optim.AdamW(list(groups.values()), lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), **kw)


def lr_at(it, cfg):
    decay_iters = cfg["lr_decay_iters"] or cfg["max_iters"]
    if it < cfg["warmup_iters"]:
        return cfg["lr"] * (it + 1) / cfg["warmup_iters"]
    if it >= decay_iters:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, decay_iters - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg["lr"] - cfg["min_lr"])


def flops_per_sample(raw, stage, seq_tokens, n_tiles=1):
    """Model FLOPs of one sample (fwd + bwd) with n_tiles ViT views, README's formula: 6N trained, 4N frozen with
    gradients flowing through, 2N frozen with nothing upstream to train; attention 12*L*d*T (fwd+bwd), halved when
    causal."""
    cfg = raw.cfg
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    adapters = lambda m: sum(p.numel() for n, p in m.named_parameters() if is_lora_parameter(n))  # noqa: E731
    vit_lora, llm_lora = adapters(raw.vision.blocks), adapters(raw.llm)  # LoRA: 6N, its frozen base 4N
    vit_tokens = cfg.vision.n_patches + 1
    vit_mult = 4 if vit_lora else 6 if stage == 0 else 2
    vit_attention = (vit_mult * 2) * cfg.vision.n_layers * cfg.vision.dim * vit_tokens**2
    vit = ((vit_mult * (count(raw.vision.blocks) - vit_lora) + 6 * vit_lora) * vit_tokens + vit_attention) * n_tiles
    proj = 6 * count(raw.projector) * cfg.n_image_tokens * n_tiles
    llm_params = count(raw.llm) - raw.llm.tok_embeddings.weight.numel() * (not cfg.llm.tie_embeddings)
    llm_mult = 4 if llm_lora else 6 if stage in (0, 2) else 4
    llm = (llm_mult * (llm_params - llm_lora) + 6 * llm_lora) * seq_tokens + \
        6 * cfg.llm.n_layers * cfg.llm.n_heads * cfg.llm.head_dim * seq_tokens**2
    return vit + proj + llm


def known_peak_flops(env):
    if env.kind != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(env.device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12), ("A10", 125e12)):
        if key in name:
            return peak
    return 0.0


# -----------------------------------------------------------------------------
# the step


def step_if_finite(optimizer, finite):
    """optimizer.step(), undone inside the graph where `finite` is False: XLA skips an update without a host sync.
    The clones are lazy (no copy is made before the graph runs). AdamW's step count, a host tensor, still advances."""
    saved = [(p, p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items() if k != "step"})
             for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    optimizer.step()
    with torch.no_grad():
        for p, old, state in saved:
            p.copy_(torch.where(finite, p, old))
            for k, v in state.items():
                optimizer.state[p][k].copy_(torch.where(finite, optimizer.state[p][k], v))


def stop_nonfinite(out, it, n, cfg, loader):
    found = checkpoints(out)
    raise SystemExit(f"stopping at step {it}: {n} steps in a row had a non-finite loss or gradient "
                     f"(max_nonfinite_steps={cfg['max_nonfinite_steps']}); no update was applied. The last checkpoint "
                     f"is {found[-1] if found else 'none'}. Lower lr, check the data near loader position "
                     f"{loader.position}, or jump past it with --skip_steps=[({it}, {it + n})] and --init_from=resume")


# -----------------------------------------------------------------------------
# set-up: each piece checks its own configuration and says what is wrong with it


def prepare_out_dir(out, cfg, env):
    """out_dir made, a killed checkpoint write cleaned, the config stored and logged; refused if it holds another
    run's checkpoints and this one is not resuming it."""
    if storage.is_url(out):
        try:
            storage.check_bucket(out)
        except storage.StorageError as e:
            raise SystemExit(f"out_dir {e}") from None
    found = checkpoints(out)
    if found and cfg["init_from"] != "resume":  # its pruning would delete them, or they would collide with ours
        names = ", ".join(p.name for p in found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise SystemExit(f"out_dir {out} already holds checkpoints ({names}): continue that run with "
                         f"--init_from=resume, or give this one a new out_dir")
    if env.master:
        try:
            storage.makedirs(out)
            wait_for_stop_writer(out)
            for stale in unfinished_steps(out):  # a checkpoint write that was killed: never committed, never taken
                print0(env, f"removing {stale}: its write did not finish (no manifest)")
                remove_step(stale)
            storage.write_text(storage.join(out, "config.json"), json.dumps(cfg, indent=2))
        except OSError as e:
            raise SystemExit(f"out_dir {str(out)!r}: cannot write there ({e.strerror or e})") from None
        print0(env, "config:", json.dumps(cfg))
    if dist.is_initialized():  # every rank looks for checkpoints after a previous stop's writer is done
        dist.barrier()


def check_inputs(cfg):
    if not Path(cfg["data_dir"]).exists():
        raise SystemExit(f"data_dir {cfg['data_dir']!r} does not exist. For the shapes demo run "
                         "`python data.py shapes --out data/shapes` first (make demo does it).")
    try:
        data.Tokenizer(cfg["tokenizer"])
    except Exception as e:  # noqa: BLE001  sentencepiece and tokenizers raise many kinds for a bogus file
        raise SystemExit(f"tokenizer {cfg['tokenizer']!r}: cannot load ({type(e).__name__}: {e})") from None


def batch_layout(cfg, env):
    """(micro-steps a step, rows each host reads a micro-step). batch_size is global. Under torchrun
    micro_batch_size is per rank; under SPMD it is global (one program), split over the hosts for reading and over
    the (dp, fsdp) devices for computing."""
    per_step = cfg["micro_batch_size"] * env.replicas
    if cfg["batch_size"] % per_step:
        raise SystemExit(f"config: batch_size={cfg['batch_size']} is not a multiple of micro_batch_size x ranks "
                         f"= {cfg['micro_batch_size']} x {env.replicas}")
    grad_accum = cfg["batch_size"] // per_step
    rows_per_host = cfg["micro_batch_size"] // (env.world if env.kind == "xla" else 1)
    if env.kind == "xla":
        data_devices = env.mesh.shape()["dp"] * env.mesh.shape()["fsdp"]
        if cfg["micro_batch_size"] % data_devices or cfg["micro_batch_size"] % env.world:
            raise SystemExit(f"config: micro_batch_size={cfg['micro_batch_size']} must split evenly over the "
                             f"{data_devices} dp x fsdp devices and the {env.world} hosts")
        if cfg["compile"]:
            raise SystemExit("config: compile is for CUDA; under XLA the whole step is traced and compiled already")
        print0(env, f"xla: mesh {dict(env.mesh.shape())} over {env.n_devices} devices, {env.world} host(s); global batch "
               f"{cfg['batch_size']} = {grad_accum} micro-steps x {cfg['micro_batch_size']} rows "
               f"({cfg['micro_batch_size'] // data_devices} a device, {rows_per_host} read by each host)")
    return grad_accum, rows_per_host


def resume_point(out, cfg, env):
    """The checkpoint to resume from (init_from='resume'), its config checked against this one, or None."""
    resume_from = None
    if cfg["init_from"] == "resume":
        resume_from = newest_good_checkpoint(out, env)
        print0(env, f"resuming from {resume_from}" if resume_from else f"no checkpoint in {out}: starting from scratch")
        if resume_from:
            check_resume_config(resume_from, cfg, env)
    return resume_from


def init_model(cfg, env, resume_from):
    """The unsharded model: from scratch, from a converted checkpoint, or the newest checkpoint of this run."""
    source = cfg["init_from"] if cfg["init_from"] not in ("scratch", "resume") else None
    build_on = "cpu" if env.kind == "xla" else env.device  # XLA: built and initialised on the host, then sharded
    if resume_from:  # built empty: each rank loads its own shards of the weights once the model is sharded
        return build_model(VLMConfig.from_dict(json.loads(storage.read_text(storage.join(resume_from, "config.json")))),
                           device=build_on, init=False)
    if source:
        try:
            return convert.load_model(source, device=build_on)
        except (convert.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{'resume' if resume_from else 'init_from'} {str(source)!r}: cannot load the model "
                             f"({e})") from None
    check_tiles(config.model_config(cfg), cfg["max_tiles"])  # before building: a 7B preset takes minutes to refuse
    return build_model(config.model_config(cfg), device=build_on, seed=cfg["seed"])


def apply_backends(raw, cfg, env):
    """(the model the step runs, its optimizer): freeze -> activation checkpointing -> compile -> shard."""
    freeze(raw, cfg["stage"])
    if cfg["objective"] == "reward":
        add_reward_head(raw, cfg["seed"])
    raw.loss_chunk, raw.recompute = cfg["loss_chunk"], checkpoint_fn(env.kind)
    raw.llm.flex_attention = use_flex_attention(cfg["pack"] > 0, env.kind, cfg["compile"], cfg["seq_len"])
    if cfg["frozen_dtype"] == "bfloat16":
        n = sum(p.numel() for p in frozen_matmul_weights(raw))
        store_frozen(raw, torch.bfloat16)
        print0(env, f"frozen_dtype: {n / 1e6:.2f}M frozen matmul weights stored in bf16 ({2 * n / 2**30:.2f} GiB less)")
    block_fn = checkpoint_fn(env.kind, cfg["checkpoint_policy"], "inductor" if cfg["compile"] else None)
    set_checkpointing(raw, block_fn if cfg["activation_checkpointing"] else None, cfg["checkpoint_every"])
    if cfg["compile"]:
        compile_blocks(raw)
    model = shard(raw, env, cfg)
    optimizer = make_optimizer(raw, cfg, env)
    init_optimizer_state(raw, optimizer, env)
    n_trained = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    print0(env, f"model: {sum(p.numel() for p in raw.parameters()) / 1e6:.2f}M parameters, {n_trained / 1e6:.2f}M "
           f"trained (stage {cfg['stage']}); {env.world} x {env.kind}, {cfg['parallel'] if env.distributed else 'single'}")
    return model, optimizer


def make_loaders(raw, cfg, env, rows_per_host):
    """(train loader, val loader or None, val stream or None, the streams' arguments), the sequence length and the
    image token checked against the model and the tokenizer."""
    check_tiles(raw.cfg, cfg["max_tiles"])
    stream_args = {"tokenizer": cfg["tokenizer"], "batch_size": rows_per_host, "seq_len": cfg["seq_len"],
                   "image_size": raw.cfg.vision.image_size, "image_token_id": raw.cfg.image_token_id,
                   "n_image_tokens": raw.cfg.n_image_tokens, "template": cfg["template"], "image_mode": cfg["image_mode"],
                   "seed": cfg["seed"], "rank": env.rank, "world_size": env.world, "shuffle_block": cfg["shuffle_block"],
                   "pack": cfg["pack"], "fast_images": cfg["fast_images"],
                   "image_mean": raw.cfg.vision.image_stats[0]}
    if cfg["max_tiles"]:  # tiles and placement by the model's config (anyres, grid_pinpoints, image_layout)
        stream_args |= {"vlm": raw.cfg, "max_tiles": cfg["max_tiles"]}
    stream_args["preference"] = cfg["objective"] in ("dpo", "reward")  # rows [chosen..., rejected...], an image a pair
    try:
        loader = data.Loader(data.ShardStream(cfg["data_dir"], split="train", **stream_args), cfg["num_workers"])
    except (OSError, ValueError) as e:
        raise SystemExit(f"data_dir {cfg['data_dir']!r}: {e}") from None
    if cfg["seq_len"] <= raw.cfg.n_image_tokens:  # every sample with an image would drop: a loss of 0.0
        raise SystemExit(f"config: seq_len={cfg['seq_len']} leaves no room for text after the model's "
                         f"{raw.cfg.n_image_tokens} image tokens")
    vocab, image_id, llm = loader.stream.tok.vocab_size, raw.cfg.image_token_id, raw.cfg.llm
    if cfg["seq_len"] > llm.max_seq_len:
        raise SystemExit(f"config: seq_len={cfg['seq_len']} exceeds the model's max_seq_len={llm.max_seq_len}")
    collides = image_id < vocab and loader.stream.tok.decode([image_id]) != data.IMAGE_TAG  # an HF <image> is fine
    if collides or image_id >= llm.vocab_size or vocab > llm.vocab_size:
        raise SystemExit(f"config: image_token_id={image_id} must lie in [tokenizer vocab {vocab}, model vocab "
                         f"{llm.vocab_size}) so it never collides with a text token ({cfg['tokenizer']})")
    try:
        val_stream = data.ShardStream(cfg["data_dir"], split="val", **stream_args)
        val_loader = data.Loader(val_stream, 0)
    except FileNotFoundError:
        val_stream = val_loader = None
    return loader, val_loader, val_stream, stream_args


def stop_on_signal(env):
    """Preemption: SIGTERM or SIGINT sets stop['requested']; the loop finishes the step, checkpoints, exits 0."""
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True
        print(f"rank {env.rank}: got signal {signum}; stopping after this step", flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def open_log(out, cfg, env):
    """(log(event), the log file or None): events go to out_dir/log.jsonl and wandb, from the master only. A bucket
    has no appends: there the log is kept in a local copy, uploaded whole after each event."""
    remote = storage.join(out, "log.jsonl") if storage.is_url(out) else None
    local = Path(tempfile.mkdtemp(prefix="llavax-log-"), "log.jsonl") if remote else out / "log.jsonl"
    if env.master and remote and storage.exists(remote):
        local.write_bytes(storage.read_bytes(remote))  # a resumed run's log goes on
    log_file = open(local, "a") if env.master else None  # noqa: SIM115
    if cfg["wandb_log"] and env.master:
        import wandb

        wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or None, config=cfg)

    def log(event):
        if env.master:
            log_file.write(json.dumps(event) + "\n")
            log_file.flush()
            if remote:
                storage.upload(local, remote)
            if cfg["wandb_log"]:
                wandb.log(event, step=event["step"])

    return log, log_file


def injected_faults(env):
    """Test-only fault injection: LLAVAX_TEST_NONFINITE="3,4@1" makes the loss NaN at iterations 3 and 4 (on rank 1
    only; every rank without "@"), LLAVAX_TEST_INF_WEIGHT="6" sets a weight to inf after iteration 6's update."""
    steps, _, rank = os.environ.get("LLAVAX_TEST_NONFINITE", "").partition("@")
    poison = {int(x) for x in steps.split(",") if x} if rank in ("", str(env.rank)) else set()
    poison_weight = {int(x) for x in os.environ.get("LLAVAX_TEST_INF_WEIGHT", "").split(",") if x}
    return poison, poison_weight


def start_meter(raw, cfg, env):
    """What a log interval sums (loss, supervised tokens, rows, data wait, dropped samples) and the run's non-finite
    skips (device tensors under XLA, read only at log intervals), with the FLOPs of a row for MFU."""
    meter = SimpleNamespace(nonfinite_run=0, nonfinite_worst=0, nonfinite_total=0)
    if env.kind == "xla":
        meter.nonfinite_run, meter.nonfinite_worst, meter.nonfinite_total = (
            torch.zeros((), dtype=torch.long, device=env.device) for _ in range(3))
    meter.peak = cfg["peak_flops"] or known_peak_flops(env)
    meter.loss_sum, meter.tokens_sum = torch.zeros((), device=env.device), torch.zeros((), device=env.device)
    meter.t_last, meter.data_wait = time.perf_counter(), 0.0
    meter.rows_done, meter.dropped = 0, 0
    meter.dpo, meter.dpo_micro = {}, 0  # dpo, reward, grpo: their metrics summed over micro-steps, and their count
    meter.gen_seconds, meter.gen_rows = 0.0, 0  # grpo: time in rollouts, and completions sampled
    meter.per_row = max(1, cfg["pack"])  # samples read per row
    # FLOPs of a row: one sample of seq_len tokens, or `pack` samples of seq_len / pack (attention within each)
    # with max_tiles the ViT runs on every slot of a row, however many images its samples hold
    per_row = meter.per_row
    meter.row_flops = per_row * flops_per_sample(raw, cfg["stage"], cfg["seq_len"] // per_row) if not cfg["max_tiles"] \
        else per_row * flops_per_sample(raw, cfg["stage"], cfg["seq_len"] // per_row, 0) + \
        flops_per_sample(raw, cfg["stage"], 0, cfg["max_tiles"])
    return meter


# -----------------------------------------------------------------------------
# the loop


def forward_backward(model, b, env, cfg, scale, poison=False, ref_model=None, metrics=None):
    """One micro-step's summed loss; backward runs outside autocast. Inside it, autocast's weight-cast cache
    (global, cleared when a thread leaves its outermost autocast) handed torch_xla's checkpoint recompute, on the
    autograd thread, the casts its no-grad forward had cached: the first block recomputed (the last) lost its grads."""
    with autocast(env, cfg):
        if cfg["objective"] != "sft":  # dpo, reward: the mean over the micro-batch's pairs; grpo: its summed loss
            loss, pair_metrics = rl.rl_loss(model, b, cfg) if cfg["objective"] == "grpo" else \
                pair_objective(model, ref_model, b, cfg)
            for k, v in pair_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v
        else:
            _, loss = model(b["input_ids"], b["pixel_values"], b["labels"], "sum", b.get("position_ids"),
                            image_index=b.get("image_index"), image_weight=b.get("image_weight"))
    loss = loss * float("nan") if poison else loss  # tests only (LLAVAX_TEST_NONFINITE)
    (loss * scale).backward()
    return loss


def set_lr(optimizer, it, cfg):
    lr_now = lr_at(it, cfg)
    for g in optimizer.param_groups:
        g["lr"] = lr_now * g["lr_scale"]
    return lr_now


def loss_units(b, cfg):
    """What a step's loss is divided by, summed over micro-steps and ranks: supervised tokens (sft, whose loss is a
    sum over them), or micro-batches (dpo, whose loss is already a mean over the micro-batch's pairs)."""
    if cfg["objective"] == "grpo":  # completion tokens (dapo), completions (grpo) or completion slots (dr_grpo)
        return b["units"]
    return (b["labels"][:, 1:] != -100).sum() if cfg["objective"] == "sft" else torch.ones((), device=b["labels"].device)


def train_step(model, micro, trainable, env, cfg, poison=False, ref_model=None, meter=None):
    """(summed loss, loss units over all ranks, gradient norm) of one step's micro-batches, gradients accumulated
    and clipped. The loss is a sum over supervised tokens (dpo: pair means) divided by their count over all
    micro-steps and ranks; DDP and FSDP average gradients over ranks, hence the factor world."""
    count = env.all_sum(sum(loss_units(b, cfg) for b in micro).float())
    step_loss = torch.zeros((), device=env.device)
    for i, b in enumerate(micro):
        with grad_sync(model, env, cfg, i == len(micro) - 1):
            loss = forward_backward(model, b, env, cfg, env.replicas / count.clamp(min=1), poison=poison,
                                    ref_model=ref_model, metrics=meter.dpo if meter else None)
        step_loss += loss.detach()
    if cfg["objective"] != "sft":  # grpo: a micro-batch without prompts has no metrics (zeros), it does not count
        meter.dpo_micro += sum(1 for b in micro if b.get("asked", 1))
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf"))
    return step_loss, count, grad_norm


def update_if_finite(optimizer, step_loss, count, grad_norm, meter, env, it, log):
    """optimizer.step() unless the loss or gradient is non-finite: then the update is skipped (the batch is consumed,
    as with skip_steps) and counted. Under XLA the skip happens inside the compiled step (no host sync); elsewhere one
    flag a step is agreed over the ranks."""
    finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm.to_local() if hasattr(grad_norm, "to_local")
                                                       else grad_norm)
    if env.kind == "xla":
        step_if_finite(optimizer, finite)
        meter.nonfinite_run = torch.where(finite, 0, meter.nonfinite_run + 1)
        meter.nonfinite_worst, meter.nonfinite_total = (torch.maximum(meter.nonfinite_worst, meter.nonfinite_run),
                                                        meter.nonfinite_total + ~finite)
        meter.loss_sum += torch.where(finite, step_loss, 0.0)
        meter.tokens_sum += torch.where(finite, count / env.replicas, 0.0)
    elif not env.agree(not bool(finite)):
        optimizer.step()
        meter.loss_sum += step_loss
        meter.tokens_sum += count / env.replicas
        meter.nonfinite_worst = meter.nonfinite_run = 0
    else:
        meter.nonfinite_run, meter.nonfinite_total = meter.nonfinite_run + 1, meter.nonfinite_total + 1
        meter.nonfinite_worst = max(meter.nonfinite_worst, meter.nonfinite_run)
        print0(env, f"step {it}: non-finite loss or gradient (loss {step_loss.item()}, grad norm "
               f"{grad_norm.full_tensor() if hasattr(grad_norm, 'full_tensor') else grad_norm:.4g}): update "
               f"skipped, {meter.nonfinite_run} in a row, {meter.nonfinite_total} in this run")
        log({"step": it, "nonfinite_skipped": True, "nonfinite_in_a_row": meter.nonfinite_run})


def log_progress(meter, it, lr_now, grad_norm, env, cfg, log, out, loader):
    """The log interval's loss, throughput and memory, printed and logged, and the meter's interval sums reset.
    Under XLA the compiled steps' non-finite skips are read here, and too many in a row stop the run."""
    env.sync()
    if env.kind == "xla":  # the skips of the compiled steps, read at log intervals only
        worst, skipped = int(meter.nonfinite_worst.item()), int(meter.nonfinite_total.item())
        if skipped:
            print0(env, f"step {it}: {skipped} update(s) skipped so far for a non-finite loss or gradient")
        if worst >= cfg["max_nonfinite_steps"]:  # the longest run so far: never reset, we stop at once
            stop_nonfinite(out, it, worst, cfg, loader)
    rows_done, dropped, peak = meter.rows_done, meter.dropped, meter.peak
    dt = time.perf_counter() - meter.t_last
    n_tokens = env.all_sum(meter.tokens_sum)
    # no supervised token in the interval (all skipped or dropped): no loss, rather than 0.0
    loss_val = (env.all_sum(meter.loss_sum) / n_tokens).item() if n_tokens.item() else float("nan")
    gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    steps = rows_done / cfg["batch_size"]
    tok_s = rows_done * cfg["seq_len"] / dt
    flops = meter.row_flops * rows_done / dt
    mem = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.kind == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    event = {"step": it, "loss": None if math.isnan(loss_val) else loss_val, "lr": lr_now, "grad_norm": gn.item(),
             "tokens_per_s": tok_s,
             "samples_per_s": rows_done * meter.per_row / dt, "mfu": flops / (peak * env.n_devices) if peak else None,
             "data_wait": meter.data_wait / dt, "peak_mem_gib": mem, "dropped_samples": dropped}
    if env.kind == "xla":  # a count that grows after warm-up means the step recompiles: see README
        import torch_xla.debug.metrics as met

        event["xla_compiles"] = (met.metric_data("CompileTime") or [0])[0]
    if meter.gen_rows:  # grpo: generation and training throughput apart
        event |= {"gen_samples_per_s": meter.gen_rows / meter.gen_seconds,
                  "train_samples_per_s": rows_done * cfg["grpo_group"] / max(dt - meter.gen_seconds, 1e-9)}
        print0(env, f"step {it}: generation {event['gen_samples_per_s']:.1f} samples/s, training "
               f"{event['train_samples_per_s']:.1f} samples/s ({100 * meter.gen_seconds / dt:.0f}% generating)")
        meter.gen_seconds, meter.gen_rows = 0.0, 0
    if meter.dpo:  # means over the interval's micro-steps and ranks, as the loss
        n_micro = env.all_sum(torch.tensor(float(meter.dpo_micro), device=env.device))
        event |= {k: (env.all_sum(v) / n_micro.clamp(min=1)).item() for k, v in meter.dpo.items()}
        print0(env, f"step {it}: " + ", ".join(f"{k} {event[k]:.4f}" for k in meter.dpo))
        meter.dpo, meter.dpo_micro = {}, 0
    mfu = f"{100 * event['mfu']:.1f}%" if peak else "n/a"
    print0(env, f"step {it}: loss {loss_val:.4f}, lr {lr_now:.2e}, grad norm {event['grad_norm']:.3f}, "
           f"{tok_s:,.0f} tok/s, {event['samples_per_s']:.1f} samples/s, MFU {mfu}, data wait "
           f"{100 * event['data_wait']:.1f}%, peak mem {mem:.2f} GiB ({steps:.0f} steps in {dt:.1f}s)"
           + (f", {dropped} samples dropped (see data: lines)" if dropped else "")
           + (f", {event['xla_compiles']} XLA compiles so far" if env.kind == "xla" else ""))
    log(event)
    meter.loss_sum.zero_()
    meter.tokens_sum.zero_()
    meter.t_last, meter.data_wait, meter.rows_done, meter.dropped = time.perf_counter(), 0.0, 0, 0


# what a generation batch saved in a checkpoint was made with (grpo_beta: whether it holds reference log-probs);
# not grpo_reference, which a resume must name when the reference was init_from
def evaluate_and_log(model, ref_model, val_loader, env, cfg, vision, it, log):
    if cfg["objective"] in ("dpo", "reward"):
        val = evaluate_preference(model, ref_model, val_loader, env, cfg, cfg["eval_iters"], vision)
        print0(env, f"step {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
        log({"step": it} | val)
    else:
        val = evaluate(model, val_loader, env, cfg, cfg["eval_iters"], vision)
        print0(env, f"step {it}: val loss {val:.4f}")
        log({"step": it, "val_loss": val})


def main(argv=None):
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    env = Env(cfg)
    out = storage.join(cfg["out_dir"])
    prepare_out_dir(out, cfg, env)
    check_inputs(cfg)
    grad_accum, rows_per_host = batch_layout(cfg, env)
    torch.manual_seed(cfg["seed"])
    resume_from = resume_point(out, cfg, env)
    raw = add_lora(init_model(cfg, env, resume_from), cfg, env, resuming=resume_from is not None)
    model, optimizer = apply_backends(raw, cfg, env)
    needs_reference = cfg["objective"] == "dpo" or cfg["objective"] == "grpo" and cfg["grpo_beta"]
    ref_model = reference_model(cfg, env, raw) if needs_reference else None
    loader, val_loader, val_stream, stream_args = make_loaders(raw, cfg, env, rows_per_host)
    checkpointer = Checkpointer(env, cfg)
    start = checkpointer.load(resume_from, model, raw, optimizer, loader) if resume_from else 0
    stop = stop_on_signal(env)
    log, log_file = open_log(out, cfg, env)
    poison, poison_weight = injected_faults(env)
    meter = start_meter(raw, cfg, env)
    grpo = rl.setup(cfg, env, loader, resume_from, raw.cfg) if cfg["objective"] == "grpo" else None
    trainable = [p for p in raw.parameters() if p.requires_grad]
    batches = iter(loader)
    it = start
    try:
        while it < cfg["max_iters"]:
            t0 = time.perf_counter()
            fresh = grpo is None or it % cfg["grpo_iterations"] == 0 or grpo.rollouts is None  # grpo: new rollouts
            micro = [next(batches) for _ in range(grad_accum)] if fresh else []
            meter.data_wait += time.perf_counter() - t0
            meter.dropped += sum(int(b["dropped"].sum()) for b in micro)  # CPU tensors: no device sync
            skipped = any(a <= it < b for a, b in cfg["skip_steps"])
            if skipped:  # the batch is consumed, nothing trains; a checkpoint due here is still written
                print0(env, f"step {it}: skipped (skip_steps); its {cfg['batch_size']} samples are consumed")
                log({"step": it, "skipped": True})
                if grpo is not None and fresh:  # grpo: no generation batch for the steps after it, the next one samples
                    grpo.rollouts = None
            else:
                lr_now = set_lr(optimizer, it, cfg)
                micro = [device_batch(b, env, raw.cfg.vision) for b in micro] if grpo is None else micro
                if grpo is not None:  # the rollouts place what they need from the host batches
                    micro = rl.generation_batch(grpo, raw, micro, ref_model, meter, cfg, env, it) if fresh else grpo.rollouts
                step_loss, count, grad_norm = train_step(model, micro, trainable, env, cfg, poison=it in poison,
                                                         ref_model=ref_model, meter=meter)
                update_if_finite(optimizer, step_loss, count, grad_norm, meter, env, it, log)
                optimizer.zero_grad(set_to_none=True)
                env.step_end()
                meter.rows_done += cfg["batch_size"]
            it += 1
            if it in poison_weight:  # test-only: a weight goes non-finite, as after an overflowing update
                with torch.no_grad():
                    trainable[0].view(-1)[:1].fill_(float("inf"))
            if env.kind != "xla" and meter.nonfinite_worst >= cfg["max_nonfinite_steps"]:
                stop_nonfinite(out, it, meter.nonfinite_worst, cfg, loader)

            if not skipped and (it % cfg["log_interval"] == 0 or it == cfg["max_iters"]):
                log_progress(meter, it, lr_now, grad_norm, env, cfg, log, out, loader)
            evaluate_now = cfg["eval_interval"] and (it % cfg["eval_interval"] == 0 or it == cfg["max_iters"])
            if not skipped and val_loader and evaluate_now:
                evaluate_and_log(model, ref_model, val_loader, env, cfg, raw.cfg.vision, it, log)
                meter.t_last = time.perf_counter()
            checkpointer.poll()
            stopping = env.agree(stop["requested"])
            if stopping or (cfg["ckpt_interval"] and it % cfg["ckpt_interval"] == 0) or it == cfg["max_iters"]:
                in_flight = grpo is not None and it % cfg["grpo_iterations"] and grpo.rollouts  # the next step's
                step_dir = storage.join(out, f"step-{it:06d}")
                checkpointer.save(step_dir, model, raw, optimizer, loader, it, stop=stopping,
                                  own=rl.rollouts_state(grpo.rollouts) if in_flight else None)
                print0(env, f"step {it}: checkpoint {step_dir}" + ("" if stopping else " (writing)"))
                meter.t_last = time.perf_counter()
            if stopping:
                print0(env, f"stopped at step {it} by a signal; resume with --init_from=resume")
                break
    except BaseException:  # a run stopped by an error lets the checkpoint in flight commit first
        checkpointer.finish()
        raise
    checkpointer.wait()  # the last checkpoint committed before anything reads it

    if it >= cfg["max_iters"]:
        if cfg["final_accuracy_samples"] and val_stream is not None and cfg["objective"] != "reward":
            log({"step": it, "accuracy": final_accuracy(raw, val_stream, stream_args, env, cfg)})
        if env.master:
            storage.write_text(storage.join(out, "DONE"), json.dumps({"step": it}))  # the babysitter's completion marker
    if log_file:
        log_file.close()
    if env.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
