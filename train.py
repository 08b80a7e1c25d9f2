"""
Train a LLaVA-style VLM. Configured nanoGPT-style: the defaults below, then a config file, then
--key=value overrides (parsed with ast.literal_eval).

    python train.py                                        # the shapes demo from scratch
    python train.py configs/debug.py --max_iters=20
    torchrun --nproc_per_node=8 train.py configs/finetune.py --parallel=fsdp

stage 0 trains everything, stage 1 the projector only, stage 2 the projector and the LLM.
"""

import ast
import json
import math
import re
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import convert
import data
from model import build_model, vlm_preset
from parallel import Env, autocast, checkpoint_fn, grad_sync, init_optimizer_state, place_like, print0, shard

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
seq_len = 40
pack = 0  # > 0: each micro-batch reads pack x rows samples and packs them into its rows (no padding waste)
image_mode = "pad"
num_workers = 1
shuffle_block = 1000
# what to train, and how
stage = 0  # 0 everything, 1 the projector, 2 the projector and the LLM
batch_size = 64  # global: across ranks and accumulation micro-steps
micro_batch_size = 64  # per rank per micro-step
max_iters = 2000
lr = 3e-4
min_lr = 5e-5
warmup_iters = 100
lr_decay_iters = 0  # 0: max_iters
lr_scale = {"vision": 1.0, "projector": 1.0, "llm": 1.0}  # per-module multipliers
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
skip_steps = []  # [(first, end), ...]: iterations whose batches are consumed but not trained on
# evaluation, logging, checkpoints
eval_interval = 500
eval_iters = 4
log_interval = 50
ckpt_interval = 500
keep_last = 2
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
loss_chunk = 0  # > 0: cross-entropy over this many positions at a time, never the full fp32 logits
peak_flops = 0.0  # per device, for MFU; 0 uses the bf16 dense peak of a known GPU
seed = 0
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, list, dict))}

# -----------------------------------------------------------------------------
# configuration


def _typed(key, value, default):
    ok = isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int)) or \
        (isinstance(default, list) and isinstance(value, (list, tuple)))
    if not ok or (isinstance(default, int) and isinstance(value, bool) != isinstance(default, bool)):
        raise SystemExit(f"config: {key} must be {type(default).__name__}, got {value!r} ({type(value).__name__})")
    return float(value) if isinstance(default, float) else (list(value) if isinstance(default, list) else value)


def load_config(argv):
    cfg = dict(DEFAULTS)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise SystemExit(f"config: expected --key=value, got {arg!r}")
            if key not in cfg:
                raise SystemExit(f"config: unknown key {key!r} (from {arg!r})")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string
            cfg[key] = _typed(key, value, DEFAULTS[key])
        else:
            ns = {}
            exec(Path(arg).read_text(), ns)  # noqa: S102  a config file is trusted Python, as in nanoGPT
            for key, value in ns.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                if key not in cfg:
                    raise SystemExit(f"config: unknown key {key!r} in {arg}")
                cfg[key] = _typed(key, value, DEFAULTS[key])
    if cfg["stage"] not in (0, 1, 2):
        raise SystemExit(f"config: stage must be 0, 1 or 2, got {cfg['stage']}")
    if cfg["parallel"] not in ("ddp", "fsdp"):
        raise SystemExit(f"config: parallel must be 'ddp' or 'fsdp', got {cfg['parallel']!r}")
    if cfg["dtype"] not in ("float32", "bfloat16"):
        raise SystemExit(f"config: dtype must be 'float32' or 'bfloat16', got {cfg['dtype']!r}")
    unknown = set(cfg["lr_scale"]) - {"vision", "projector", "llm"}
    if unknown:
        raise SystemExit(f"config: lr_scale has unknown modules {sorted(unknown)}")
    return cfg


def model_config(cfg):
    """The VLMConfig that init_from='scratch' builds: the preset `model` with `model_overrides` merged in."""
    try:
        return vlm_preset(cfg["model"]).with_overrides(cfg["model_overrides"])
    except (ValueError, TypeError) as e:
        raise SystemExit(f"config: model_overrides {cfg['model_overrides']!r} do not make a model: {e}") from None


# -----------------------------------------------------------------------------
# backends: small functions applied in a fixed order: freeze -> checkpointing -> compile -> shard


def freeze(model, stage):
    """requires_grad by stage. ViT blocks above the selected layer and ln_post never reach the loss: frozen too."""
    trained = {0: ("vision", "projector", "llm"), 1: ("projector",), 2: ("projector", "llm")}[stage]
    n = model.cfg.vision.n_layers
    top = max(i if i >= 0 else n + 1 + i for i in model.cfg.vision_layers)
    for name, p in model.named_parameters():
        unused = name.startswith("vision.ln_post") or (name.startswith("vision.blocks.") and int(name.split(".")[2]) >= top)
        p.requires_grad_(name.split(".")[0] in trained and not unused)


def set_checkpointing(model, fn):
    model.vision.checkpoint = model.llm.checkpoint = fn


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
            module, decay = name.split(".")[0], p.dim() >= 2  # no weight decay on norms and biases
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


def flops_per_sample(raw, stage, seq_tokens):
    """Model FLOPs of one sample (fwd + bwd), README's formula: 6N trained, 4N frozen with gradients flowing
    through, 2N frozen with nothing upstream to train; attention 12*L*d*T (fwd+bwd), halved when causal."""
    cfg = raw.cfg
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    vit_tokens = cfg.vision.n_patches + 1
    vit_mult = 6 if stage == 0 else 2
    vit_attention = (vit_mult * 2) * cfg.vision.n_layers * cfg.vision.dim * vit_tokens**2
    vit = vit_mult * count(raw.vision.blocks) * vit_tokens + vit_attention
    proj = 6 * count(raw.projector) * cfg.n_image_tokens
    llm_params = count(raw.llm) - raw.llm.tok_embeddings.weight.numel() * (not cfg.llm.tie_embeddings)
    llm_mult = 6 if stage in (0, 2) else 4
    llm = llm_mult * llm_params * seq_tokens + 6 * cfg.llm.n_layers * cfg.llm.n_heads * cfg.llm.head_dim * seq_tokens**2
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
# checkpoints: out_dir/step-XXXXXX/ holds model.safetensors + config.json (convert.py reads it),
# optimizer.safetensors + optimizer.json, rng.safetensors and state.json; written to a temporary
# directory and renamed, so a crash mid-write leaves the previous checkpoint as the newest.


def full_state(model, raw, optimizer, env):
    """Model and optimizer state by parameter name. Under SPMD the tensors stay sharded on the device: the
    writer gathers one at a time, so a host never holds more than one full tensor (a 7B-13B model saves on a pod)."""
    if env.kind == "xla":
        names = {p: n for n, p in raw.named_parameters()}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[p] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return raw.state_dict(), {"state": {names[p]: s for p, s in optimizer.state.items()}, "param_groups": groups}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if env.distributed else StateDictOptions()
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def checkpoints(out):
    return sorted(p for p in Path(out).glob("step-*") if re.fullmatch(r"step-\d{6}", p.name) and (p / "state.json").exists())


def save_checkpoint(path, model, raw, optimizer, loader, it, cfg, env):
    msd, osd = full_state(model, raw, optimizer, env)
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state(env.device)} if env.kind == "cuda" else {})
    ranks = [None] * env.world
    if env.distributed:
        dist.all_gather_object(ranks, rng)
    else:
        ranks = [rng]
    if env.master or env.kind == "xla":  # torchrun gathers to rank 0 only; SPMD tensors are global on every host
        tied = raw.cfg.llm.tie_embeddings
        weights = {k: v.detach() for k, v in msd.items() if not (tied and k == "llm.output.weight")}
        moments = {f"{name}/{k}": v.detach().reshape(-1) if k == "step" else v.detach()
                   for name, s in osd["state"].items() for k, v in s.items()}
    if env.master:
        def fill(tmp):
            convert.write_weights(weights, tmp)
            (tmp / "config.json").write_text(json.dumps(raw.cfg.to_dict(), indent=2))
            convert.write_safetensors(moments, tmp / "optimizer.safetensors")
            (tmp / "optimizer.json").write_text(json.dumps({"param_groups": osd["param_groups"]}, indent=2))
            convert.write_safetensors({f"rank{r}.{k}": v for r, s in enumerate(ranks) for k, v in s.items()},
                                      tmp / "rng.safetensors")
            for name in ("tokenizer.model", "tokenizer.json"):
                if Path(cfg["tokenizer"]).name == name and Path(cfg["tokenizer"]).exists():
                    shutil.copy(cfg["tokenizer"], tmp / name)
            (tmp / "state.json").write_text(json.dumps({"iter": it, "loader": loader.state_dict(), "config": cfg}, indent=2))

        convert.write_dir(path, fill)
        for old in checkpoints(path.parent)[: -cfg["keep_last"]] if cfg["keep_last"] > 0 else []:
            shutil.rmtree(old)
    elif env.kind == "xla":  # every host takes part in gathering each tensor, in the same order; host 0 writes
        for t in [*weights.values(), *moments.values()]:
            t.cpu()
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path, model, raw, optimizer, loader, env):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = json.loads((path / "state.json").read_text())
    moments = load_file(path / "optimizer.safetensors")
    groups = json.loads((path / "optimizer.json").read_text())["param_groups"]
    osd = {"state": {}, "param_groups": groups}
    for key, v in moments.items():
        name, k = key.rsplit("/", 1)
        osd["state"].setdefault(name, {})[k] = v.reshape(()) if k == "step" else v
    if env.kind == "xla":  # each moment goes to the device sharded like its parameter
        params = dict(raw.named_parameters())
        unknown = sorted(set(osd["state"]) - {n for n, p in params.items() if p.requires_grad})
        if unknown or len(groups) != len(optimizer.param_groups):
            raise SystemExit(f"{path}: optimizer state does not fit this run (stage or model differ): "
                             f"{len(groups)} vs {len(optimizer.param_groups)} groups, unknown {unknown[:5]}")
        for name, s in osd["state"].items():
            optimizer.state[params[name]] = {k: v if k == "step" else place_like(v, name, env)
                                             for k, v in s.items()}
        for g, saved in zip(optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k not in ("params", "lr")})
    else:
        opts = StateDictOptions(full_state_dict=True) if env.distributed else StateDictOptions()
        set_optimizer_state_dict(model, optimizer, osd, options=opts)
    rng = load_file(path / "rng.safetensors")
    if f"rank{env.rank}.cpu" in rng:
        torch.set_rng_state(rng[f"rank{env.rank}.cpu"])
        if env.kind == "cuda" and f"rank{env.rank}.cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{env.rank}.cuda"], env.device)
    loader.load_state_dict(state["loader"])
    return state["iter"]


# -----------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(model, val_loader, env, cfg, n_batches):
    model.eval()
    total, count = torch.zeros((), device=env.device), torch.zeros((), device=env.device)
    val_loader.position = 0  # the same held-out batches every time
    for i, batch in enumerate(val_loader):
        if i == n_batches:
            break
        b = env.to_device(batch)
        with autocast(env, cfg):
            _, loss = model(b["input_ids"], b["pixel_values"], b["labels"], "sum", b.get("position_ids"))
        total += loss
        count += (b["labels"][:, 1:] != -100).sum()
        env.step_end()
    model.train()
    return (env.all_sum(total) / env.all_sum(count).clamp(min=1)).item()


@torch.no_grad()
def answer_accuracy(raw, stream, env, cfg, n, show=5):
    """Exact-match accuracy of greedy answers to the first n val samples, and a few of them to show."""
    raw.eval()
    tok, stop = stream.tok, data.stop_token_id(cfg["template"], stream.tok)
    right, shown, total = 0, [], 0
    for sample in range(min(n, len(stream))):
        _, members = stream.read(sample)
        conv, image = data.sample_conversation(members)
        prompt, answer = data.prompt_and_answer(conv, image is not None, cfg["template"], tok, stream.image_token_id,
                                                stream.n_image_tokens)
        pixels = data.normalize_images(data.load_image(image, stream.image_size, stream.image_mode)[None]) \
            if image is not None else None
        ids = torch.tensor([prompt], device=env.device)
        with autocast(env, cfg):
            out = raw.generate(ids, pixels.to(env.device) if pixels is not None else None, max_new_tokens=8, eos_id=stop)
        tokens = out[0].tolist()
        said = tok.decode(tokens[: tokens.index(stop)] if stop in tokens else tokens).strip()
        right += said.lower() == answer.strip().lower()
        total += 1
        if len(shown) < show:
            question = next(t["value"] for t in conv if t["from"] in ("human", "user")).replace(data.IMAGE_TAG, "").strip()
            shown.append((question, said, answer))
    raw.train()
    return right / max(1, total), shown


# -----------------------------------------------------------------------------
# the loop


def forward_backward(model, b, env, cfg, scale):
    """One micro-step's summed loss; backward runs outside autocast. Inside it, autocast's weight-cast cache
    (global, cleared when a thread leaves its outermost autocast) handed torch_xla's checkpoint recompute, on the
    autograd thread, the casts its no-grad forward had cached: the first block recomputed (the last) lost its grads."""
    with autocast(env, cfg):
        _, loss = model(b["input_ids"], b["pixel_values"], b["labels"], "sum", b.get("position_ids"))
    (loss * scale).backward()
    return loss


def main(argv=None):
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    env = Env(cfg)
    out = Path(cfg["out_dir"])
    if env.master:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(".step-*.tmp-*"):  # a checkpoint write that was killed
            shutil.rmtree(stale, ignore_errors=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        print0(env, "config:", json.dumps(cfg))
    if not Path(cfg["data_dir"]).exists():
        raise SystemExit(f"data_dir {cfg['data_dir']!r} does not exist. For the shapes demo run "
                         "`python data.py shapes --out data/shapes` first (make demo does it).")
    # batch_size is global. Under torchrun micro_batch_size is per rank; under SPMD it is global (one program),
    # split over the hosts for reading and over the (dp, fsdp) devices for computing
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
    torch.manual_seed(cfg["seed"])

    # model: from scratch, from a converted checkpoint, or the newest checkpoint of this run
    resume_from = None
    if cfg["init_from"] == "resume":
        found = checkpoints(out)
        resume_from = found[-1] if found else None
        print0(env, f"resuming from {resume_from}" if resume_from else f"no checkpoint in {out}: starting from scratch")
    source = resume_from or (cfg["init_from"] if cfg["init_from"] not in ("scratch", "resume") else None)
    build_on = "cpu" if env.kind == "xla" else env.device  # XLA: built and initialised on the host, then sharded
    if source:
        raw = convert.load_model(source, device=build_on)
    else:
        raw = build_model(model_config(cfg), device=build_on, seed=cfg["seed"])
    freeze(raw, cfg["stage"])
    raw.loss_chunk, raw.recompute = cfg["loss_chunk"], checkpoint_fn(env.kind)
    raw.llm.flex_attention = use_flex_attention(cfg["pack"] > 0, env.kind, cfg["compile"], cfg["seq_len"])
    set_checkpointing(raw, checkpoint_fn(env.kind) if cfg["activation_checkpointing"] else None)
    if cfg["compile"]:
        compile_blocks(raw)
    model = shard(raw, env, cfg)
    optimizer = make_optimizer(raw, cfg, env)
    init_optimizer_state(raw, optimizer, env)
    n_trained = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    print0(env, f"model: {sum(p.numel() for p in raw.parameters()) / 1e6:.2f}M parameters, {n_trained / 1e6:.2f}M "
           f"trained (stage {cfg['stage']}); {env.world} x {env.kind}, {cfg['parallel'] if env.distributed else 'single'}")

    # data
    stream_args = {"tokenizer": cfg["tokenizer"], "batch_size": rows_per_host, "seq_len": cfg["seq_len"],
                   "image_size": raw.cfg.vision.image_size, "image_token_id": raw.cfg.image_token_id,
                   "n_image_tokens": raw.cfg.n_image_tokens, "template": cfg["template"], "image_mode": cfg["image_mode"],
                   "seed": cfg["seed"], "rank": env.rank, "world_size": env.world, "shuffle_block": cfg["shuffle_block"],
                   "pack": cfg["pack"]}
    loader = data.Loader(data.ShardStream(cfg["data_dir"], split="train", **stream_args), cfg["num_workers"])
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
    start = load_checkpoint(resume_from, model, raw, optimizer, loader, env) if resume_from else 0

    # preemption: finish the step, checkpoint, exit 0
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True
        print(f"rank {env.rank}: got signal {signum}; stopping after this step", flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    log_file = open(out / "log.jsonl", "a") if env.master else None  # noqa: SIM115
    if cfg["wandb_log"] and env.master:
        import wandb

        wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or None, config=cfg)

    def log(event):
        if env.master:
            log_file.write(json.dumps(event) + "\n")
            log_file.flush()
            if cfg["wandb_log"]:
                wandb.log(event, step=event["step"])

    peak = cfg["peak_flops"] or known_peak_flops(env)
    trainable = [p for p in raw.parameters() if p.requires_grad]
    batches = iter(loader)
    loss_sum, tokens_sum = torch.zeros((), device=env.device), torch.zeros((), device=env.device)
    t_last, data_wait, it = time.perf_counter(), 0.0, start
    rows_done, dropped = 0, 0
    per_row = max(1, cfg["pack"])  # samples read per row
    # FLOPs of a row: one sample of seq_len tokens, or `pack` samples of seq_len / pack (attention within each)
    row_flops = per_row * flops_per_sample(raw, cfg["stage"], cfg["seq_len"] // per_row)
    while it < cfg["max_iters"]:
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(grad_accum)]
        data_wait += time.perf_counter() - t0
        dropped += sum(int(b["dropped"].sum()) for b in micro)  # CPU tensors: no device sync
        if any(a <= it < b for a, b in cfg["skip_steps"]):
            print0(env, f"step {it}: skipped (skip_steps); its {cfg['batch_size']} samples are consumed")
            log({"step": it, "skipped": True})
            it += 1
            continue
        lr_now = lr_at(it, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr_now * g["lr_scale"]
        # the loss is a sum over supervised tokens divided by their count over all micro-steps and ranks;
        # DDP and FSDP average gradients over ranks, hence the factor world
        micro = [env.to_device(b) for b in micro]
        count = env.all_sum(sum((b["labels"][:, 1:] != -100).sum() for b in micro).float())
        for i, b in enumerate(micro):
            with grad_sync(model, env, cfg, i == grad_accum - 1):
                loss = forward_backward(model, b, env, cfg, env.replicas / count.clamp(min=1))
            loss_sum += loss.detach()
        tokens_sum += count / env.replicas
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        env.step_end()
        it += 1
        rows_done += cfg["batch_size"]

        if it % cfg["log_interval"] == 0 or it == cfg["max_iters"]:
            env.sync()
            dt = time.perf_counter() - t_last
            loss_val = (env.all_sum(loss_sum) / env.all_sum(tokens_sum).clamp(min=1)).item()
            gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            steps = rows_done / cfg["batch_size"]
            tok_s = rows_done * cfg["seq_len"] / dt
            flops = row_flops * rows_done / dt
            mem = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.kind == "cuda" else \
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            event = {"step": it, "loss": loss_val, "lr": lr_now, "grad_norm": gn.item(), "tokens_per_s": tok_s,
                     "samples_per_s": rows_done * per_row / dt, "mfu": flops / (peak * env.n_devices) if peak else None,
                     "data_wait": data_wait / dt, "peak_mem_gib": mem, "dropped_samples": dropped}
            if env.kind == "xla":  # a count that grows after warm-up means the step recompiles: see README
                import torch_xla.debug.metrics as met

                event["xla_compiles"] = (met.metric_data("CompileTime") or [0])[0]
            mfu = f"{100 * event['mfu']:.1f}%" if peak else "n/a"
            print0(env, f"step {it}: loss {loss_val:.4f}, lr {lr_now:.2e}, grad norm {event['grad_norm']:.3f}, "
                   f"{tok_s:,.0f} tok/s, {event['samples_per_s']:.1f} samples/s, MFU {mfu}, data wait "
                   f"{100 * event['data_wait']:.1f}%, peak mem {mem:.2f} GiB ({steps:.0f} steps in {dt:.1f}s)"
                   + (f", {dropped} samples dropped (see data: lines)" if dropped else "")
                   + (f", {event['xla_compiles']} XLA compiles so far" if env.kind == "xla" else ""))
            log(event)
            loss_sum.zero_()
            tokens_sum.zero_()
            t_last, data_wait, rows_done, dropped = time.perf_counter(), 0.0, 0, 0
        if val_loader and cfg["eval_interval"] and (it % cfg["eval_interval"] == 0 or it == cfg["max_iters"]):
            val = evaluate(model, val_loader, env, cfg, cfg["eval_iters"])
            print0(env, f"step {it}: val loss {val:.4f}")
            log({"step": it, "val_loss": val})
            t_last = time.perf_counter()
        stopping = env.agree(stop["requested"])
        if stopping or (cfg["ckpt_interval"] and it % cfg["ckpt_interval"] == 0) or it == cfg["max_iters"]:
            save_checkpoint(out / f"step-{it:06d}", model, raw, optimizer, loader, it, cfg, env)
            print0(env, f"step {it}: checkpoint {out / f'step-{it:06d}'}")
            t_last = time.perf_counter()
        if stopping:
            print0(env, f"stopped at step {it} by a signal; resume with --init_from=resume")
            break

    if it >= cfg["max_iters"]:
        if cfg["final_accuracy_samples"] and val_stream is not None:
            if env.kind == "xla":  # token-by-token generation would recompile at every length: answer on the host
                host = build_model(raw.cfg, device="cpu", init=False)
                host.load_state_dict({k: v.cpu() for k, v in raw.state_dict().items()})
                acc, shown = answer_accuracy(host, val_stream, SimpleNamespace(kind="cpu", device=torch.device("cpu"),
                                                                               distributed=False), cfg,
                                             cfg["final_accuracy_samples"])
            else:
                acc, shown = answer_accuracy(raw, val_stream, env, cfg, cfg["final_accuracy_samples"])
            n_asked = min(cfg["final_accuracy_samples"], len(val_stream))
            print0(env, f"held-out exact-match accuracy: {100 * acc:.1f}% on {n_asked} questions")
            for q, said, answer in shown:
                print0(env, f"  Q: {q:<36} model: {said:<8} truth: {answer}")
            log({"step": it, "accuracy": acc})
        if env.master:
            (out / "DONE").write_text(json.dumps({"step": it}))  # the babysitter's completion marker
    if log_file:
        log_file.close()
    if env.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
