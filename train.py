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
import signal
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

import chat
import checkpoint
import config
import mixture
import model_files
import rl
import storage
import weight_files
from benchmarks import Asker, answers_beside, open_benchmarks, run_benchmarks, summary
from checkpoint import (check_resume_config, checkpoints, load_checkpoint, newest_good_checkpoint, remove_step,
                        unfinished_steps)
from checkpoint_writer import Checkpointer, wait_for_stop_writer
from config import check_tiles, load_config
from dpo import reference_model
from evaluation import final_accuracy
from lease import Lease
from loader import Loader, ShardStream, untrainable_sentence
from lora import apply_lora, is_lora_parameter, merge_lora
from model import build_model
from model_config import VLMConfig
from objectives import OBJECTIVES
from parallel import (Env, attention_kernel, autocast, checkpoint_fn, compile_blocks, compile_cache_mirror,
                      flops_per_sample, freeze, frozen_matmul_weights, grad_sync, init_optimizer_state, make_optimizer,
                      param_groups, print0, pull_compile_cache, push_compile_cache, set_checkpointing, shard,
                      store_frozen, use_flex_attention)
from progress import RunClock, TensorBoard, clock_text
from shards import VanishedShard

# -----------------------------------------------------------------------------
# configuration


# -----------------------------------------------------------------------------
# backends: small functions applied in a fixed order: freeze -> checkpointing -> compile -> shard


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


# -----------------------------------------------------------------------------
# optimizer, schedule, FLOPs


def lr_at(it, cfg):
    decay_iters = cfg["lr_decay_iters"] or cfg["max_iters"]
    if it < cfg["warmup_iters"]:
        return cfg["lr"] * (it + 1) / cfg["warmup_iters"]
    if it >= decay_iters:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, decay_iters - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg["lr"] - cfg["min_lr"])


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


def last_checkpoint(out):
    try:
        found = checkpoints(out)
    except storage.StorageError:  # an out_dir in a bucket that stopped answering too
        return "unknown (out_dir cannot be listed now)"
    return found[-1] if found else "none"


def stop_nonfinite(out, it, n, cfg, loader):
    raise SystemExit(f"stopping at step {it}: {n} steps in a row had a non-finite loss or gradient, or nothing to learn "
                     f"(max_nonfinite_steps={cfg['max_nonfinite_steps']}); no update was applied. The last checkpoint "
                     f"is {last_checkpoint(out)}. Lower lr, check the data near loader position "
                     f"{loader.position}, or jump past it with --skip_steps=[({it}, {it + n})] and --resume=True")


# -----------------------------------------------------------------------------
# set-up: each piece checks its own configuration and says what is wrong with it


def checkpoint_folders(out, cfg, env):
    """Where this run's checkpoints go and resume looks: [out_dir], or [out_dir, local_ckpt_dir] (the frequent tier,
    on one host only: on several, each host's disk would hold only its own ranks' shards of a step)."""
    if not cfg["local_ckpt_dir"]:
        return [out]
    ranks_here = 1 if env.kind == "xla" else int(os.environ.get("LOCAL_WORLD_SIZE", env.world))
    if ranks_here != env.world:
        raise SystemExit(f"config: local_ckpt_dir holds a step only if every rank runs on this host; this run has "
                         f"{env.world} {'hosts' if env.kind == 'xla' else 'ranks'}, {ranks_here} here. Leave it out")
    mine = checkpoint.local_tier(cfg["local_ckpt_dir"], out)  # this run's own folder: another run's steps never taken
    for folder, theirs in checkpoint.other_runs_steps(cfg["local_ckpt_dir"], mine).items():
        print0(env, f"local_ckpt_dir: ignoring the steps in {folder}: another run's (out_dir {theirs})")
    return [out, mine]


def prepare_out_dir(folders, cfg, env, lease):
    """out_dir (and the local checkpoint tier) made, its lease taken (lease.py), a killed checkpoint write cleaned,
    the config stored and logged; refused if one holds another run's checkpoints and this one is not resuming it, or
    another live run holds the lease."""
    out = folders[0]
    if storage.is_url(out):
        try:
            storage.check_key(out)
            storage.check_bucket(out)
            storage.refuse_object(out, "out_dir")
        except storage.StorageError as e:
            raise SystemExit(str(e) if str(e).startswith("out_dir") else f"out_dir {e}") from None
    for folder in folders:
        found = checkpoints(folder)
        if found and not resuming(cfg):  # its pruning would delete them, or they would collide with ours
            names = ", ".join(map(storage.name, found[-3:])) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
            raise SystemExit(f"{'out_dir' if folder == out else 'local_ckpt_dir'} {folder} already holds checkpoints "
                             f"({names}): continue that run with --resume=True, or give this one a new out_dir")
    refused = None
    if env.master:
        try:
            for folder in folders:
                storage.makedirs(folder)
                if not storage.is_url(folder) and storage.check_renames(folder):
                    print0(env, f"{folder}: refuses renames and overwrites (a Mountpoint for S3 mount?): every file "
                                "there is written once, in place, as in a bucket")
            wait_for_stop_writer(out)  # a stopped run's writer reads its lease until it commits: not taken from it
            lease.acquire(cfg["take_over"])  # before anything in out_dir is touched
            if len(folders) > 1:  # the local tier says whose it is
                storage.write_text(Path(folders[1], "OUT_DIR"), checkpoint.run_key(out) + "\n")
        except SystemExit as e:
            refused = str(e)
        except OSError as e:
            raise SystemExit(f"out_dir {str(out)!r}: cannot write there ({e.strerror or e})") from None
    if env.agree(refused is not None):
        raise SystemExit(refused or "out_dir is in use by another run (rank 0 says which)")
    if env.master:
        try:
            for stale in [p for folder in folders for p in unfinished_steps(folder)]:  # a write that was killed
                print0(env, f"removing {stale}: its write did not finish (no manifest)")
                remove_step(stale)
            storage.write_text(storage.join(out, "config.json"), json.dumps(cfg, indent=2))
        except OSError as e:
            raise SystemExit(f"out_dir {str(out)!r}: cannot write there ({e.strerror or e})") from None
        changed = {k: v for k, v in cfg.items() if v != config.DEFAULTS.get(k)}  # the whole is in out_dir/config.json
        print0(env, "config (what differs from config.py's defaults):", json.dumps(changed))
    if dist.is_initialized():  # every rank looks for checkpoints after a previous stop's writer is done
        dist.barrier()


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
        print0(env, f"xla: compile cache {env.compile_cache} (on each host; a restart loads what was compiled before)"
               if env.compile_cache else f"xla: no compile cache ({env.compile_cache_off}): a restart compiles again")
    return grad_accum, rows_per_host


def resuming(cfg):
    return cfg["resume"] or cfg["init_from"] == "resume"


def resume_point(folders, cfg, env):
    """The checkpoint to resume from (resume=True or init_from='resume'), its config checked against this one, or
    None: the first start of a run launched with --resume=True starts from init_from."""
    resume_from = None
    if resuming(cfg):
        resume_from = newest_good_checkpoint(folders, env)
        start = "scratch" if cfg["init_from"] == "resume" else cfg["init_from"]
        print0(env, f"resuming from {resume_from}" if resume_from
               else f"no checkpoint in {' or '.join(map(str, folders))}: starting from {start}")
        if resume_from:
            check_resume_config(resume_from, cfg, env)
    return resume_from


def init_model(cfg, env, resume_from):
    """The unsharded model: from scratch, from a converted checkpoint, or the newest checkpoint of this run."""
    source = cfg["init_from"] if cfg["init_from"] not in ("scratch", "resume") and not resume_from else None
    build_on = "cpu" if env.kind == "xla" else env.device  # XLA: built and initialised on the host, then sharded
    if resume_from:  # built empty: each rank loads its own shards of the weights once the model is sharded
        return build_model(VLMConfig.from_dict(json.loads(storage.read_text(storage.join(resume_from, "config.json")))),
                           device=build_on, init=False)
    if source:
        try:
            return model_files.load_model(source, device=build_on)
        except (weight_files.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{'resume' if resume_from else 'init_from'} {str(source)!r}: cannot load the model "
                             f"({e})") from None
    check_tiles(config.model_config(cfg), cfg["max_tiles"])  # before building: a 7B preset takes minutes to refuse
    return build_model(config.model_config(cfg), device=build_on, seed=cfg["seed"])


def apply_backends(raw, cfg, env, objective, value_raw=None):
    """(the model the step runs, its optimizer, PPO's value model as the step runs it or None), each model through
    freeze -> activation checkpointing -> compile -> shard; the value model's parameters in the one AdamW, their own
    groups at ppo_value_lr."""
    model = backends(raw, cfg, env, objective.reward_head)
    value_model = backends(value_raw, cfg, env, reward_head=True) if value_raw is not None else None
    optimizer = make_optimizer(raw, env, cfg["lr"], (cfg["beta1"], cfg["beta2"]), cfg["weight_decay"], cfg["lr_scale"])
    init_optimizer_state(raw, optimizer, env)
    n_trained = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    print0(env, f"model: {sum(p.numel() for p in raw.parameters()) / 1e6:.2f}M parameters, {n_trained / 1e6:.2f}M "
           f"trained (stage {cfg['stage']}); {env.world} x {env.kind}, {cfg['parallel'] if env.distributed else 'single'}")
    if value_model is not None:
        value_scale = cfg["ppo_value_lr"] / cfg["lr"] if cfg["ppo_value_lr"] and cfg["lr"] else 1.0
        scales = {k: value_scale * v for k, v in cfg["lr_scale"].items()}  # the schedule's lr x these
        for group in param_groups(value_raw, cfg["weight_decay"], scales):
            optimizer.add_param_group(group)
        init_optimizer_state(value_raw, optimizer, env)
        n_value = sum(p.numel() for p in value_raw.parameters() if p.requires_grad)
        print0(env, f"ppo: value model {n_value / 1e6:.2f}M trained parameters, lr {value_scale * cfg['lr']:.2e}")
    return model, optimizer, value_model


def backends(raw, cfg, env, reward_head):
    """One model (the policy, or PPO's value model) frozen by stage, its activation checkpointing, compiled, sharded."""
    freeze(raw, cfg["stage"])
    if reward_head:
        add_reward_head(raw, cfg["seed"])
    raw.loss_chunk, raw.recompute = cfg["loss_chunk"], checkpoint_fn(env.kind)
    raw.llm.flex_attention = cfg["attention"] == "dense" and use_flex_attention(cfg["pack"] > 0, env.kind, cfg["compile"],
                                                                                cfg["seq_len"])
    window = raw.cfg.llm.sliding_window
    raw.llm.attention_kernel = attention_kernel(cfg["attention"], cfg["attention_block"], env,
                                                window if window and window < cfg["seq_len"] else None,
                                                raw.cfg.llm.attn_softcap, raw.cfg.attention_blocks)
    if cfg["frozen_dtype"] == "bfloat16":
        n = sum(p.numel() for p in frozen_matmul_weights(raw))
        store_frozen(raw, torch.bfloat16)
        print0(env, f"frozen_dtype: {n / 1e6:.2f}M frozen matmul weights stored in bf16 ({2 * n / 2**30:.2f} GiB less)")
    block_fn = checkpoint_fn(env.kind, cfg["checkpoint_policy"], "inductor" if cfg["compile"] else None)
    set_checkpointing(raw, block_fn if cfg["activation_checkpointing"] else None, cfg["checkpoint_every"])
    if cfg["compile"]:
        compile_blocks(raw)
    return shard(raw, env)


def make_loaders(vlm, cfg, env, rows_per_host, pairs):
    """(train loader, {source: val loader}, the streams' arguments), the sequence length and the image token checked
    against the model's config and the tokenizer, and a source none of whose samples can train refused."""
    check_tiles(vlm, cfg["max_tiles"])
    stream_args = {"tokenizer": cfg["tokenizer"], "batch_size": rows_per_host, "seq_len": cfg["seq_len"],
                   "image_size": vlm.vision.image_size, "image_token_id": vlm.image_token_id,
                   "n_image_tokens": vlm.n_image_tokens, "template": cfg["template"], "image_mode": cfg["image_mode"],
                   "seed": cfg["seed"], "rank": env.rank, "world_size": env.world, "shuffle_block": cfg["shuffle_block"],
                   "pack": cfg["pack"], "fast_images": cfg["fast_images"],
                   "image_mean": vlm.vision.image_stats[0], "resample": vlm.vision.resample}
    if cfg["max_tiles"]:  # tiles and placement by the model's config (anyres, grid_pinpoints, image_layout)
        stream_args |= {"vlm": vlm, "max_tiles": cfg["max_tiles"]}
    stream_args["preference"] = pairs  # rows [chosen..., rejected...], an image a pair
    try:
        group = cfg["batch_size"] * max(cfg["pack"], 1) if cfg["group_by_modality_length"] else 0  # a step's samples
        loader = Loader(ShardStream(cfg["data_dir"], split="train", group=group, **stream_args), cfg["num_workers"],
                        mixture_change=cfg["mixture_change"])
    except (OSError, ValueError) as e:
        raise SystemExit(f"data_dir {cfg['data_dir']!r}: {e}") from None
    if cfg["seq_len"] <= vlm.n_image_tokens:  # every sample with an image would drop: a loss of 0.0
        raise SystemExit(f"config: seq_len={cfg['seq_len']} leaves no room for text after the model's "
                         f"{vlm.n_image_tokens} image tokens")
    if loader.stream.mixture.take_summary():  # what take rules select but this run cannot train on, said once
        print0(env, loader.stream.mixture.take_summary())
    if loader.stream.mixture.left_out_line():  # the recipe's never-published sources, not there: their share
        print0(env, loader.stream.mixture.left_out_line())
    vocab, image_id, llm = loader.stream.tok.vocab_size, vlm.image_token_id, vlm.llm
    if cfg["seq_len"] > llm.max_seq_len:
        raise SystemExit(f"config: seq_len={cfg['seq_len']} exceeds the model's max_seq_len={llm.max_seq_len}")
    collides = image_id < vocab and loader.stream.tok.decode([image_id]) != chat.IMAGE_TAG  # an HF <image> is fine
    if collides or image_id >= llm.vocab_size or vocab > llm.vocab_size:
        raise SystemExit(f"config: image_token_id={image_id} must lie in [tokenizer vocab {vocab}, model vocab "
                         f"{llm.vocab_size}) so it never collides with a text token ({cfg['tokenizer']})")
    if untrainable := untrainable_sentence(loader.stream, {k: cfg[k] for k in ("seq_len", "max_tiles", "pack", "template")}):
        raise SystemExit(untrainable)  # after the settings that would make every sample drop are said
    val_loaders, without = {}, []  # each source's own val split: its held-out figures apart (one dataset: its val split)
    for source in mixture.sources(cfg["data_dir"], "val"):
        if source.path.endswith(".tar"):  # a lone tar is train samples only: its "val" would be what trains
            without.append(f"{source.name} (a lone .tar: one split, trained on)")
            continue
        try:
            val_loaders[source.name] = Loader(ShardStream(source, split="val", **stream_args), 0)
        except FileNotFoundError:
            without.append(f"{source.name} (no val split)")
    if without and (cfg["eval_interval"] or cfg["final_accuracy_samples"]):
        print0(env, f"val: no held-out figures for {', '.join(without)}: held-out loss is measured on val splits only")
    return loader, val_loaders, stream_args


def stop_on_signal(env):
    """Preemption: SIGTERM or SIGINT sets stop['requested']; the loop finishes the step, checkpoints, exits 0. The stop
    must end within storage_stall_s of the signal (stop['until']): the scheduler's SIGKILL follows. A signal that comes
    while the main thread waits on storage (a bucket that stopped answering) ends that wait at once."""
    stop, here = {"requested": False, "until": None}, os.getpid()

    def on_signal(signum, frame):  # (a loader worker forked from this process inherits it: only here is it the run's)
        first = not stop["requested"]
        stop["requested"] = True
        if first:
            stop["until"] = time.monotonic() + storage.STALL_S
            print(f"rank {env.rank}: got signal {signum}; stopping after this step", flush=True)
        if storage.waiting_now() and os.getpid() == here:
            raise storage.Interrupted(f"got signal {signum} while waiting on storage")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def open_log(out, cfg, env, lease, start=0):
    """(log(event), close()): events go to out_dir/log.jsonl, wandb and TensorBoard (out_dir/tensorboard),
    from the master only. Nothing is appended in out_dir (a bucket cannot append, nor can a Mountpoint for S3 mount):
    the log is appended to a local copy, which replaces out_dir/log.jsonl whole after each event (an upload, or a file
    written and renamed), as TensorBoard's event files do. Each event refreshes out_dir's lease first; a run that lost
    it writes nothing there (the loop then stops)."""
    log_file, shared = None, storage.join(out, "log.jsonl")
    if env.master:
        log_file = tempfile.NamedTemporaryFile("a", prefix="llavax-log-", suffix=".jsonl")  # noqa: SIM115  gone when closed
        if storage.exists(shared):
            log_file.write(storage.read_text(shared))  # a resumed run's log goes on
    if cfg["wandb_log"] and env.master:
        import wandb

        wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or None, config=cfg)
    board = TensorBoard(out, resumed=start) if cfg["tensorboard_log"] and env.master else None

    def write():  # the log (and TensorBoard's files), written under the lease
        storage.upload(log_file.name, shared)
        if board:
            board.upload()

    def log(event):
        if env.master:
            log_file.write(json.dumps(event) + "\n")
            log_file.flush()
            if board:
                board.add(event)
            try:  # a lease that cannot be refreshed in time stops the run: it can no longer show that out_dir is its
                lease.refresh(write)
            except storage.Interrupted as e:  # the loop stops at this step's end; the next upload carries this event
                print(f"step {event['step']}: {e}: the log in out_dir is behind", flush=True)
            if cfg["wandb_log"]:
                wandb.log(event, step=event["step"])

    def close():  # the local log copy removed; TensorBoard's writer thread ended (a thread left running would be
        if board:  # copied into every process a later fork makes, with whatever lock it held)
            board.writer.close()
        if log_file:
            log_file.close()

    return log, close


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
    meter.empty_run = torch.zeros((), dtype=torch.long, device=env.device)  # steps in a row with nothing to learn
    if env.kind == "xla":
        meter.nonfinite_run, meter.nonfinite_worst, meter.nonfinite_total = (
            torch.zeros((), dtype=torch.long, device=env.device) for _ in range(3))
    meter.peak = cfg["peak_flops"] or env.peak_flops()
    meter.loss_sum, meter.tokens_sum = torch.zeros((), device=env.device), torch.zeros((), device=env.device)
    meter.t_last, meter.data_wait = time.perf_counter(), 0.0
    meter.rows_done, meter.dropped, meter.not_updated = 0, 0, 0  # not_updated: XLA's (not_updated())
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


def forward_backward(model, b, env, cfg, scale, objective, poison=False, ref_model=None, metrics=None,
                     value_model=None):
    """One micro-step's summed loss; backward runs outside autocast. Inside it, autocast's weight-cast cache
    (global, cleared when a thread leaves its outermost autocast) handed torch_xla's checkpoint recompute, on the
    autograd thread, the casts its no-grad forward had cached: the first block recomputed (the last) lost its grads."""
    with autocast(env):
        loss, micro_metrics = objective.loss(model, b, cfg, ref_model, value_model)
    for k, v in micro_metrics.items():
        metrics[k] = metrics.get(k, 0.0) + v
    loss = loss * float("nan") if poison else loss  # tests only (LLAVAX_TEST_NONFINITE)
    (loss * scale).backward()
    return loss


def set_lr(optimizer, it, cfg):
    lr_now = lr_at(it, cfg)
    for g in optimizer.param_groups:
        g["lr"] = lr_now * g["lr_scale"]
    return lr_now


def train_step(model, micro, trainable, env, cfg, objective, poison=False, ref_model=None, meter=None,
               value_model=None):
    """(summed loss, loss units over all ranks, gradient norm) of one step's micro-batches, gradients accumulated
    and clipped (the policy's and PPO's value model's together, as TRL's PPO clips them). The loss is a sum over the
    objective's units (sft: supervised tokens; dpo: pair means) divided by their count over all micro-steps and ranks;
    DDP and FSDP average gradients over ranks, hence the factor world."""
    count = env.all_sum(sum(objective.units(b) for b in micro).float())
    step_loss = torch.zeros((), device=env.device)
    for i, b in enumerate(micro):
        last = i == len(micro) - 1
        with grad_sync(model, env, last), grad_sync(value_model, env, last) if value_model else nullcontext():
            loss = forward_backward(model, b, env, cfg, env.replicas / count.clamp(min=1), objective, poison=poison,
                                    ref_model=ref_model, metrics=meter.dpo if meter else {}, value_model=value_model)
        step_loss += loss.detach()
    if meter:  # grpo, ppo: a micro-batch without prompts has no metrics (zeros), it does not count
        meter.dpo_micro += sum(1 for b in micro if b.get("asked", 1))
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf"))
    return step_loss, count, grad_norm


def update_if_finite(optimizer, step_loss, count, grad_norm, meter, env, it, log):
    """optimizer.step() unless the loss or gradient is non-finite: then the update is skipped (the batch is consumed,
    as with skip_steps) and counted. Under XLA the skip happens inside the compiled step (no host sync); elsewhere one
    flag a step is agreed over the ranks. Whether it updated: a bool, or under XLA a device tensor."""
    finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm.to_local() if hasattr(grad_norm, "to_local")
                                                       else grad_norm)
    finite = finite & (count > 0)  # a batch with nothing to learn from (every sample dropped) moves no weight
    meter.empty_run = torch.where(count > 0, 0, meter.empty_run + 1)  # read at checkpoints and the end only
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
        return True
    else:
        meter.nonfinite_run, meter.nonfinite_total = meter.nonfinite_run + 1, meter.nonfinite_total + 1
        meter.nonfinite_worst = max(meter.nonfinite_worst, meter.nonfinite_run)
        why = "no supervised token in the batch (every sample dropped?)" if not count.item() else \
            f"non-finite loss or gradient (loss {step_loss.item()}, grad norm " \
            f"{grad_norm.full_tensor() if hasattr(grad_norm, 'full_tensor') else grad_norm:.4g})"
        print0(env, f"step {it}: {why}: update skipped, {meter.nonfinite_run} in a row, {meter.nonfinite_total} in "
               f"this run")
        log({"step": it, "nonfinite_skipped": True, "nonfinite_in_a_row": meter.nonfinite_run})
        return False
    return finite


def not_updated(counts, updated, meter, loader, env):
    """A step's samples and tokens by source (counts) that did not update the weights count as dropped
    (nonfinite_update), as skip_steps' do. Under XLA, summed on the device and handed over at the next fold."""
    if env.kind == "xla":
        meter.not_updated = meter.not_updated + torch.where(updated, 0, counts.to(env.device))
    elif not updated:
        loader.not_trained(counts, "nonfinite_update")


def fold_counts(loader, meter, env):
    """Every rank's per-source counts into the run's totals (loader.fold_tokens), XLA's updates not made first."""
    if torch.is_tensor(meter.not_updated):
        loader.not_trained(meter.not_updated.cpu(), "nonfinite_update")
        meter.not_updated = 0
    loader.fold_tokens(env)


def log_progress(meter, it, lr_now, grad_norm, env, cfg, log, out, loader, lease, clock):
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
    steps = rows_done / meter.rows_per_step
    tok_s = rows_done * cfg["seq_len"] / dt
    flops = meter.row_flops * rows_done / dt
    mem, eta = env.peak_memory_gib(), clock.eta(it)
    event = {"step": it, "loss": None if math.isnan(loss_val) else loss_val, "lr": lr_now, "grad_norm": gn.item(),
             "tokens_per_s": tok_s,
             "samples_per_s": rows_done * meter.per_row / dt, "mfu": flops / (peak * env.n_devices) if peak else None,
             "data_wait": meter.data_wait / dt, "peak_mem_gib": mem, "dropped_samples": dropped,
             "elapsed_s": clock.elapsed(), "eta_s": eta}
    fold_counts(loader, meter, env)
    event |= loader.figures()  # a mixture's samples and supervised tokens so far, by source
    for said in loader.quiet_sources():  # a source that drew samples but trained nothing since the last log line
        print0(env, f"step {it}: {said}")
    if env.compiles() is not None:  # a count that grows after warm-up means the step recompiles: see README
        event["xla_compiles"], event["xla_compile_s"] = env.compiles(), env.compile_seconds()
    event |= env.cache_figures()  # xla: programs loaded from a predecessor's compiles, stored, unreadable
    if meter.gen_rows:  # grpo, ppo: generation and training throughput apart
        event |= {"gen_samples_per_s": meter.gen_rows / meter.gen_seconds,
                  "train_samples_per_s": rows_done * meter.completions_per_prompt / max(dt - meter.gen_seconds, 1e-9)}
        print0(env, f"step {it}: generation {event['gen_samples_per_s']:.1f} samples/s, training "
               f"{event['train_samples_per_s']:.1f} samples/s ({100 * meter.gen_seconds / dt:.0f}% generating)")
        meter.gen_seconds, meter.gen_rows = 0.0, 0
    if meter.dpo:  # means over the interval's micro-steps and ranks, as the loss
        n_micro = env.all_sum(torch.tensor(float(meter.dpo_micro), device=env.device))
        # in one order on every rank: each all_sum must meet the same metric on the others (a resumed batch's metrics
        # come in its file's order)
        event |= {k: (env.all_sum(v) / n_micro.clamp(min=1)).item() for k, v in sorted(meter.dpo.items())}
        print0(env, f"step {it}: " + ", ".join(f"{k} {event[k]:.4f}" for k in meter.dpo))
        meter.dpo, meter.dpo_micro = {}, 0
    mfu = f"{100 * event['mfu']:.1f}%" if peak else "n/a"
    print0(env, f"step {it}: loss {loss_val:.4f}, lr {lr_now:.2e}, grad norm {event['grad_norm']:.3f}, "
           f"{tok_s:,.0f} tok/s, {event['samples_per_s']:.1f} samples/s, MFU {mfu}, data wait "
           f"{100 * event['data_wait']:.1f}%, peak mem {mem:.2f} GiB ({steps:.0f} steps in {dt:.1f}s), elapsed "
           f"{clock_text(event['elapsed_s'])}, ETA {clock_text(eta)}"
           + (f", {dropped} samples dropped (see data: lines)" if dropped else "")
           + (f", {event['xla_compiles']} XLA compiles so far" if "xla_compiles" in event else "")
           + (f" ({event['xla_cache_hit']} loaded from the compile cache)" if event.get("xla_cache_hit") else ""))
    log(event)
    if env.agree(lease is not None and lease.lost is not None):  # a run that took over out_dir: we commit nothing
        raise SystemExit(f"stopping at step {it}: out_dir was taken over by {lease.lost if lease else 'another run'}; "
                         f"this run writes nothing more there")
    meter.loss_sum.zero_()
    meter.tokens_sum.zero_()
    meter.t_last, meter.data_wait, meter.rows_done, meter.dropped = time.perf_counter(), 0.0, 0, 0


def evaluate_and_log(model, ref_model, val_loaders, env, cfg, vision, objective, it, log):
    val = objective.evaluate(model, ref_model, val_loaders, env, cfg, vision, objective.loss)
    shown = {k.partition("/")[0].replace("_", " ") + k[len(k.partition("/")[0]):]: v for k, v in val.items()
             if not k.startswith("val_tokens/")}  # val_loss/NAME: "val loss/NAME", the source's name as written
    print0(env, f"step {it}: " + ", ".join(f"{k} {v:.4f}" if v is not None else f"{k} n/a (every held-out sample "
                                           f"dropped)" for k, v in shown.items()))
    log({"step": it} | val)


def main(argv=None):
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    try:
        run(cfg)
    except storage.StorageError as e:  # a bucket unreachable through the retries (the loop names its step itself)
        raise SystemExit(str(e)) from None


def run(cfg):
    storage.STALL_S = cfg["storage_stall_s"]  # before any bucket is touched: its clients are made with it
    config.check_device(cfg["device"])  # torch's own error is a traceback from set_device
    env = Env(cfg)
    out = storage.join(cfg["out_dir"])
    lease = Lease(out, cfg["lease_stale_s"]) if env.master else None  # rank 0 holds out_dir's lease for the run
    try:
        train(cfg, env, out, lease)
    finally:  # however the run ends; a SIGKILLed one's lease goes stale
        if lease is not None:
            with storage.within(storage.STALL_S):  # a storage that stopped answering does not hold the exit
                lease.release()


def train(cfg, env, out, lease):
    launched = time.perf_counter()  # the elapsed time counts the set-up
    folders = checkpoint_folders(out, cfg, env)
    config.check_inputs(cfg)  # read-only, before out_dir is taken or touched
    if warning := config.schedule_warning(cfg):  # a smoke test's few steps of a long recipe, or a slip
        print0(env, warning)
    benchmarks = open_benchmarks(cfg["benchmarks"], cfg["benchmark_dir"], cfg["max_tiles"])  # files said now
    prepare_out_dir(folders, cfg, env, lease)
    mirror = compile_cache_mirror(env, out)  # xla, a bucket out_dir: the compile cache outlives a recreated VM
    pushed = pull_compile_cache(env, mirror)
    grad_accum, rows_per_host = batch_layout(cfg, env)
    torch.manual_seed(cfg["seed"])
    resume_from = resume_point(folders, cfg, env)
    objective = OBJECTIVES[cfg["objective"]]
    vlm = config.data_model_config(cfg, resume_from)  # the data is read, and refused, before a model is built
    loaders = make_loaders(vlm, cfg, env, rows_per_host, objective.pairs) if vlm else None
    raw = add_lora(init_model(cfg, env, resume_from), cfg, env, resuming=resume_from is not None)
    value_raw = rl.load_value_model(cfg, env, raw, chat.Tokenizer(cfg["tokenizer"]), resume_from) \
        if objective.value else None
    model, optimizer, value_model = apply_backends(raw, cfg, env, objective, value_raw)
    value = (value_model, value_raw) if value_raw is not None else None
    ref_model = reference_model(cfg, env, raw) if objective.reference(cfg) else None
    loader, val_loaders, stream_args = loaders or make_loaders(raw.cfg, cfg, env, rows_per_host, objective.pairs)
    checkpointer = Checkpointer(env, cfg, lease, committed=resume_from)
    start = load_checkpoint(resume_from, model, raw, optimizer, loader, env, "data_dir" in cfg["allow_config_change"],
                            value) if resume_from else 0
    stop = stop_on_signal(env)
    log, close_log = open_log(out, cfg, env, lease, start)
    poison, poison_weight = injected_faults(env)
    meter = start_meter(raw, cfg, env)
    steps = objective.batches(cfg, env, loader, resume_from, raw, value_raw)
    meter.rows_per_step, meter.completions_per_prompt = steps.rows_per_step, steps.completions_per_prompt
    trainable = [p for m in (raw, value_raw) if m is not None for p in m.parameters() if p.requires_grad]
    batches = iter(loader)
    clock = RunClock(start, cfg["max_iters"], since=launched, end=lambda: checkpointer.background_s,
                     skip=cfg["skip_steps"], passes={
        "eval": (cfg["eval_interval"] if val_loaders else 0, bool(cfg["eval_interval"] and val_loaders)),
        "bench": (cfg["benchmark_interval"], bool(benchmarks)),
        "ckpt": (cfg["ckpt_interval"], True), "local_ckpt": (cfg["local_ckpt_interval"], False, cfg["ckpt_interval"])})
    asker = Asker(chat.Tokenizer(cfg["tokenizer"]), cfg["template"], cfg["image_mode"], cfg["benchmark_batch_size"],
                  cfg["benchmark_limit"]) if benchmarks else None
    it, bench_scores = start, {}
    try:
        while it < cfg["max_iters"]:
            t0 = time.perf_counter()
            fresh = steps.fresh(it)  # grpo: False while the generation batch is reused
            micro = [next(batches) for _ in range(grad_accum)] if fresh else []
            meter.data_wait += time.perf_counter() - t0
            meter.dropped += sum(int(b["dropped"].sum()) for b in micro)  # CPU tensors: no device sync
            skipped = any(a <= it < b for a, b in cfg["skip_steps"])
            if skipped:  # the batch is consumed, nothing trains; a checkpoint due here is still written
                print0(env, f"step {it}: skipped (skip_steps); its {cfg['batch_size']} samples are consumed")
                log({"step": it, "skipped": True})
                steps.skipped(fresh)
                loader.skipped(micro)  # read, not trained: dropped/NAME/skip_steps
            else:
                lr_now = set_lr(optimizer, it, cfg)
                counts = loader.step_counts(micro)  # what this step trains on, if its update is made
                micro = steps.prepare(micro, raw, ref_model, meter, it)
                step_loss, count, grad_norm = train_step(model, micro, trainable, env, cfg, objective,
                                                         poison=it in poison, ref_model=ref_model, meter=meter,
                                                         value_model=value_model)
                updated = update_if_finite(optimizer, step_loss, count, grad_norm, meter, env, it, log)
                not_updated(counts, updated, meter, loader, env)
                optimizer.zero_grad(set_to_none=True)
                env.step_end()
                meter.rows_done += steps.rows_per_step
            it += 1
            if it in poison_weight:  # test-only: a weight goes non-finite, as after an overflowing update
                with torch.no_grad():
                    trainable[0].view(-1)[:1].fill_(float("inf"))
            if env.kind != "xla" and meter.nonfinite_worst >= cfg["max_nonfinite_steps"]:
                stop_nonfinite(out, it, meter.nonfinite_worst, cfg, loader)

            if not skipped and (it % cfg["log_interval"] == 0 or it == cfg["max_iters"]):
                log_progress(meter, it, lr_now, grad_norm, env, cfg, log, out, loader, lease, clock)
            evaluate_now = cfg["eval_interval"] and (it % cfg["eval_interval"] == 0 or it == cfg["max_iters"])
            if not skipped and val_loaders and evaluate_now:
                t0 = time.perf_counter()
                evaluate_and_log(model, ref_model, val_loaders, env, cfg, raw.cfg.vision, objective, it, log)
                meter.t_last += clock.spent("eval", t0)  # the interval's speed and data wait leave evaluation out
            bench_now = it == cfg["max_iters"] or (cfg["benchmark_interval"] and it % cfg["benchmark_interval"] == 0)
            if not skipped and benchmarks and bench_now:  # a benchmark that fails is a line; the run goes on
                t0 = time.perf_counter()
                answers = answers_beside(storage.join(out, f"step-{it:06d}"))
                bench_scores = run_benchmarks(raw, benchmarks, asker, env, answers, label=f"step {it}: ")
                if bench_scores:
                    log({"step": it} | bench_scores)
                meter.t_last += clock.spent("bench", t0)
            checkpointer.poll()
            stopping = env.agree(stop["requested"])
            persist = stopping or (cfg["ckpt_interval"] and it % cfg["ckpt_interval"] == 0) or it == cfg["max_iters"]
            local = not persist and cfg["local_ckpt_interval"] and it % cfg["local_ckpt_interval"] == 0  # the tier between
            if (persist or local) and int(meter.empty_run):  # its batch had nothing to learn: data lost, not kept
                print0(env, f"step {it}: no checkpoint: its batch had no supervised token (every sample dropped); the "
                       f"last checkpoint stays {last_checkpoint(out)}")
            elif persist or local:
                step_dir, t0 = storage.join(folders[0] if persist else folders[1], f"step-{it:06d}"), time.perf_counter()
                fold_counts(loader, meter, env)  # the state saved holds every rank's counts
                # grpo, ppo: own, the rollouts the next step uses. A save is the stop's also when a signal came while
                # it waited for the write in flight
                stopping = checkpointer.save(step_dir, model, raw, optimizer, loader, it, stop=stopping,
                                             until=stop["until"], own=steps.in_flight(it), value=value)
                print0(env, f"step {it}: checkpoint {step_dir}" + ("" if stopping else " (writing)"))
                if persist and not stopping:
                    push_compile_cache(env, mirror, pushed)  # what this host compiled so far, for a recreated VM
                meter.t_last += clock.spent("ckpt" if persist else "local_ckpt", t0)
            if stopping:
                print0(env, f"stopped at step {it} by a signal; resume with --resume=True")
                break
    except storage.StorageError as e:  # a bucket (the data's, out_dir) that stayed unreachable through the retries
        checkpointer.finish()
        back = "the shard is back (restored, or the dataset re-packed)" if isinstance(e, VanishedShard) else \
            "the bucket answers"
        raise SystemExit(f"stopping at step {it}: {e}; the last checkpoint is {checkpointer.last_committed()}: "
                         f"resume with --resume=True once {back}") from None
    except BaseException:  # a run stopped by an error lets the checkpoint in flight commit first
        checkpointer.finish()
        raise
    checkpointer.wait(final=True)  # the last checkpoint committed before anything reads it, or no DONE
    for line in loader.summary():  # as of the last fold: the last step's log line, or a stop's checkpoint
        print0(env, f"step {it}: {line}")

    if it >= cfg["max_iters"] and int(meter.empty_run):
        raise SystemExit(f"step {it}: the last {int(meter.empty_run)} batch(es) had no supervised token (every sample "
                         f"dropped): the run is not marked DONE; the last checkpoint is {last_checkpoint(out)}")
    if it >= cfg["max_iters"]:
        print0(env, f"step {it}: trained in {clock_text(clock.elapsed())}")
        if cfg["final_accuracy_samples"] and val_loaders and objective.answers:
            streams = {name: val_loader.stream for name, val_loader in val_loaders.items()}
            log({"step": it} | final_accuracy(raw, streams, stream_args, env, cfg))
        if bench_scores:
            print0(env, f"step {it}: benchmarks: {summary(bench_scores)}")
        done = storage.join(out, "DONE")  # the babysitter's completion marker, written only while the lease is ours
        if env.master and not lease.fenced(done, lambda: storage.write_text(done, json.dumps({"step": it}))):
            raise SystemExit(f"step {it}: out_dir was taken over by {lease.lost}; this run writes nothing more there "
                             f"(it is not marked DONE)")
    close_log()
    if env.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
