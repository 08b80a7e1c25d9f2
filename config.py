"""
train.py's configuration, nanoGPT-style (its configurator.py): the defaults at the top of train.py, then each config
file (a Python file of `key = value` lines) and --key=value argument in order (parse). Each value keeps its default's
type; an unknown key, a wrong type or a file that is not such a Python file is one sentence; then every value is
checked (check), each objective's keys by its module (rl.check_config for GRPO).
"""

import ast
import builtins
import contextlib
import difflib
import json
import math
import re
import traceback
from dataclasses import fields
from hashlib import sha256
from pathlib import Path

import torch

import chat
import checkpoint
import mixture
import model_files
import rl
import storage
from loader import sample_conversation
from lora import LoRAConfig
from hf_config import HF_ARCHITECTURES, llava_config
from losses import DPO_LOSSES
from model_config import VLM_PRESETS, VLMConfig, vlm_preset
from parallel import ATTENTION, PALLAS, pallas_refusal
from mixture import MixtureError
from shards import DatasetError, parse_members, sample_offsets, shard_files

_IMPORTED = set(globals())  # the names above are no keys (a dict imported here would otherwise become one)

# -----------------------------------------------------------------------------
# a run's typed defaults; configs/*.py and --key=value may change only these keys
# I/O
out_dir = "out/shapes"  # where checkpoints, config.json, log.jsonl and DONE go: a folder, or gs://... / s3://...
init_from = "scratch"  # 'scratch', 'resume' (newest checkpoint in out_dir) or a convert.py checkpoint directory
resume = False  # True: the newest good checkpoint in out_dir when there is one, else init_from (the launch scripts pass it)
model = "debug"  # the VLM preset when init_from='scratch'
model_overrides = {  # merged into the preset; these make the shapes demo's 1.93M-parameter VLM
    "vision": {"image_size": 48, "patch_size": 16, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 512},
    "llm": {"vocab_size": 576, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 384, "max_seq_len": 64},
    "vision_layer": -1,
    "image_token_id": 512,  # the shapes tokenizer holds at most 512 pieces; the vocab is padded to 576
}
# the commands that make this config's inputs (data_dir, init_from) from other runs: listed when one is missing
prepare = []  # shell commands printed when an input is missing (the demos' earlier steps)
# data
data_dir = "data/shapes/shards"  # one packed dataset, or a mixture: a list of sources or a YAML file (mixture.py)
tokenizer = "data/shapes/tokenizer.model"  # a sentencepiece tokenizer.model or an HF tokenizer.json (or their folder)
template = "llama_3"  # the chat template (chat.TEMPLATES; each model's: chat.PRESET_TEMPLATES, docs/model.md)
seq_len = 36  # the demo's samples are 30-34 tokens (9 image tokens, llama_3); padding past them is compute
pack = 0  # > 0: each micro-batch reads pack x rows samples and packs them into its rows (no padding waste)
max_tiles = 0  # > 0: static ViT tile slots a row, shared by its images and their anyres tiles; 0: one image a row
image_mode = "pad"  # 'pad' to square in the tower's mean colour (LLaVA-1.5), or 'resize' (squash)
fast_images = False  # True: JPEG draft decoding + torch's bicubic, ~2x faster, up to ~12 levels off (README)
num_workers = 1  # DataLoader worker processes a rank
shuffle_block = 1000  # samples shuffled together, a block at a time (the exact-resume order)
group_by_modality_length = False  # True: each step's samples all with an image/video or all text (LLaVA-NeXT's)
# what to train, and how
stage = 0  # 0 everything, 1 the projector, 2 the projector and the LLM
batch_size = 64  # global: across ranks and accumulation micro-steps
micro_batch_size = 64  # per rank per micro-step
max_iters = 1500  # the demo: 94.2-95.0% held-out at 1500 steps, 86.4-91.8% at 1200, 96.8-97.6% at 2000 (BENCHMARKS.md)
lr = 3e-4  # peak learning rate (lr_scale multiplies it per module)
min_lr = 5e-5  # the cosine schedule's floor
warmup_iters = 100  # linear warmup steps
lr_decay_iters = 0  # 0: max_iters
lr_scale = {"vision": 1.0, "projector": 1.0, "llm": 1.0}  # per-module multipliers
lora = {}  # {} off; else LoRA adapters {"r", "alpha", "dropout", "targets", "rslora"} (docs/training.md "LoRA")
weight_decay = 0.01  # AdamW's, on weights of two or more dimensions (never norms or biases)
beta1 = 0.9  # AdamW
beta2 = 0.95  # AdamW
grad_clip = 1.0  # global gradient norm clip; 0 turns it off
max_nonfinite_steps = 5  # an update with a non-finite loss or gradient is skipped; this many in a row stop the run
skip_steps = []  # [(first, end), ...]: iterations whose batches are consumed but not trained on
# evaluation, logging, checkpoints
eval_interval = 500  # steps between held-out evaluations; 0 turns them off
eval_iters = 4  # held-out batches an evaluation reads
log_interval = 50  # steps between log lines (and lease refreshes)
ckpt_interval = 500  # steps between checkpoints in out_dir; 0: only the last (and a stop's)
keep_last = 2  # in out_dir, and in local_ckpt_dir
# multi-tier (Orbax's): also checkpoint every local_ckpt_interval steps to a folder on this host's disk, which is fast;
# resume takes the newest step that verifies in either. One host only (another host's disk holds its ranks' shards)
local_ckpt_dir = ""  # a folder on this host's disk for the frequent tier; '' turns it off
local_ckpt_interval = 0  # steps between checkpoints in local_ckpt_dir
storage_stall_s = 60.0  # a bucket request (an upload's included) that makes no progress this long is abandoned
max_failed_checkpoints = 3  # checkpoints in a row whose write failed (an outage) before the run stops
take_over = False  # True: take out_dir's lease from the run that holds it (one that is dead: lease.py)
lease_stale_s = 300.0  # a lease not refreshed for this long (and 10 log intervals) is a dead run's, taken over
allow_config_change = []  # keys that may differ from the checkpoint's config on resume (see FIXED_ON_RESUME)
# a resume on another mixture (allow_config_change=['data_dir']): 'continue' reads it from the saved position (the
# log says per source how many samples of the epoch under way repeat or are skipped); 'restart_epoch' starts its epoch
mixture_change = "continue"  # 'continue' or 'restart_epoch' (above)
final_accuracy_samples = 500  # > 0: exact-match accuracy of generated answers on that many val samples
wandb_log = False  # log to Weights & Biases too
wandb_project = "llavax"  # its project
wandb_run_name = ""  # its run name ('' lets wandb choose)
tensorboard_log = False  # True: TensorBoard event files in out_dir/tensorboard too (pip install tensorboard)
# benchmarks (docs/training.md "Benchmarks"): lmms-eval's tasks on greedy answers, at benchmark_interval and the end
benchmarks = []  # task names (benchmarks.TASKS: mme, pope, scienceqa_img, mmbench_en_dev, mmstar, chartqa), or NAME=PATH
benchmark_dir = "data/benchmarks"  # where each benchmark lies as the Hub download puts it (benchmark_dir/MME/data/...)
benchmark_interval = 0  # steps between benchmark runs; 0: only at the end of the run
benchmark_limit = 0  # > 0: the first this many questions of each benchmark (lmms-eval's --limit)
benchmark_batch_size = 8  # questions answered together (a rank's; under XLA the global batch)
# backend
device = ""  # '' picks cuda when available, else cpu; 'xla' is torch_xla SPMD (TPU, or CPU devices in tests)
parallel = "ddp"  # under torchrun: 'ddp' or 'fsdp'
compile_cache_dir = ""  # xla: programs kept for restarts; '' = ~/.cache/llavax/xla-VERSION on a TPU host, 'none' = off
mesh = [1, -1, 1]  # xla: devices as (dp, fsdp, tp); one -1 takes what the others leave
dcn_mesh = [1, 1, 1]  # xla: slices as (dp, fsdp, tp) for multi-slice pods (dp across slices is usual)
dtype = "float32"  # 'bfloat16': bf16 compute with fp32 master weights
compile = False  # torch.compile each block (CUDA)
activation_checkpointing = False  # recompute each block in backward
checkpoint_policy = "full"  # 'selective': keep the matmul and attention outputs, recompute a block's elementwise ops
checkpoint_every = 1  # k: checkpoint blocks 0, k, 2k, ... of each tower; the others keep all their activations
frozen_dtype = "float32"  # 'bfloat16' (with dtype='bfloat16'): frozen Linear/Conv weights stored in bf16, never cast
loss_chunk = 0  # > 0: cross-entropy over this many positions at a time, never the full fp32 logits
# 'dense': SDPA (packed rows: a (B, 1, T, T) mask, or FlexAttention on CUDA with compile); 'blockwise': an online
# softmax over key blocks, memory linear in seq_len on every device (XLA: one compiled loop); 'flash', 'splash':
# torch_xla's Pallas kernels (TPU only, not verified in llavax's tests); 'bounded' (the long recipes'): 'splash' on a
# TPU, 'blockwise' elsewhere, resolved once at set-up and printed
attention = "dense"  # 'dense', 'blockwise', 'flash', 'splash' or 'bounded' (above)
attention_block = 512  # keys a step of attention='blockwise'
peak_flops = 0.0  # per device, for MFU; 0 uses the bf16 dense peak of a known GPU
seed = 0  # model init, data order and sampling
# preference training (docs/post-training.md "DPO"): rows of chosen and rejected answers from preference shards
objective = "sft"  # 'sft' (next-token loss), 'dpo' (against a frozen reference), 'reward', 'grpo' or 'ppo' (below)
dpo_beta = 0.1  # DPO's beta (the implicit reward's scale)
dpo_loss = "sigmoid"  # 'sigmoid' (DPO), 'ipo' (length-normalised, as TRL), 'hinge'
dpo_sft_weight = 0.0  # + this x the chosen answers' token NLL (LLaVA-NeXT's gamma; TRL's "sft" loss)
dpo_end_of_turn = True  # False: an answer's log-prob leaves out its end-of-turn token (its last supervised one)
dpo_reference = ""  # the reference checkpoint; '' is init_from (with --resume=True too; name it under init_from='resume')
# objective='reward' (docs/post-training.md): a scalar head on the same preference shards, Bradley-Terry loss
reward_margin = 0.0  # -log sigmoid(r_chosen - r_rejected - margin)
reward_center_weight = 0.0  # + this x (r_chosen + r_rejected)^2: rewards stay near 0 (TRL's center_rewards_coefficient)
# objective='grpo': prompts from SFT shards, grpo_group samples each; batch_size and micro_batch_size count prompts
grpo_group = 4  # completions a prompt (TRL's num_generations)
grpo_loss = "dapo"  # 'dapo' (token sum / the step's completion tokens: TRL's default), 'grpo', 'dr_grpo'
grpo_beta = 0.0  # k3 KL to the reference (grpo_reference, else init_from); 0: no reference (TRL's default)
grpo_epsilon = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
grpo_epsilon_high = 0.0  # DAPO's clip-higher (0.28 in its paper); 0: grpo_epsilon
grpo_scale_rewards = "group"  # r - group mean divided by the group's std, the generation batch's ('batch') or 1 ('none')
grpo_iterations = 1  # optimisation steps on each generation batch (TRL's num_iterations); > 1 uses the importance ratio
grpo_max_new_tokens = 8  # tokens a completion may have
grpo_temperature = 1.0  # sampling temperature of the rollouts
grpo_top_p = 1.0  # nucleus sampling of the rollouts
grpo_reward = "exact_match"  # 'exact_match', 'module:function' (completions, answers) -> floats, or a reward-model dir
grpo_reference = ""  # the KL reference: a checkpoint; '' = init_from
grpo_static = False  # static-shape rollouts (always under XLA): prompts left-padded to grpo_prompt_len, hashed draws
grpo_prompt_len = 0  # static rollouts' prompt bucket (0: seq_len - grpo_max_new_tokens); a longer prompt is skipped
# FSDP2: True keeps every block gathered from the first decoding step to the last (TRL's ds3_gather_for_generation, on
# by default there): fast, but the whole model on each rank. False gathers each block again at every step (less memory)
grpo_gather_for_generation = False  # (above)
# objective='ppo' (EasyLM's llama_train_ppo; TRL <= 1.12's defaults): rollouts as GRPO's grpo_* keys make them
ppo_value_init = ""  # the value model: a reward-model checkpoint, its head read at every token; '' = grpo_reward's
ppo_kl_coef = 0.05  # per-token reward -kl_coef x KL(policy || reference), the score added at the last token
ppo_kl_estimator = "k1"  # 'k1' logp - ref_logp, 'k3' (rho - 1) - log rho
ppo_reward_gain = 1.0  # score = gain x reward + bias - ppo_missing_end_penalty when a completion has no end of turn
ppo_reward_bias = 0.0  # (see ppo_reward_gain)
ppo_missing_end_penalty = 0.0  # (see ppo_reward_gain)
ppo_gamma = 1.0  # GAE
ppo_lam = 0.95  # GAE's lambda
ppo_whiten_rewards = False  # whiten the per-token rewards of a batch
ppo_epochs = 4  # passes over each rollout batch (batch_size prompts)
ppo_mini_batch_size = 0  # prompts an optimizer step; 0: the whole rollout batch
ppo_clip = 0.2  # the policy ratio's clip
ppo_clip_value = 0.2  # the value's clip around its old estimate
ppo_vf_coef = 0.1  # the value loss's weight
ppo_value_lr = 0.0  # the value model's peak learning rate (on the same schedule); 0: lr, as TRL's one optimizer
DEFAULTS = {k: v for k, v in globals().items()
            if k not in _IMPORTED and not k.startswith("_") and isinstance(v, (int, float, str, list, dict))}


def parse(argv, defaults):
    """defaults updated by argv (config files and --key=value or --key value, in order), each value of its default's
    type."""
    cfg, args = dict(defaults), list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq and isinstance(defaults.get(key), bool) and args and not args[0].startswith("--") and \
                    args[0].lower() not in BOOLEANS and not args[0].endswith(".py") and not Path(args[0]).is_file():
                raise SystemExit(f"config: --{key} {args[0]}: {key} is a bool, {BOOL_WORDS}; --{key} alone is True")
            if not eq and isinstance(defaults.get(key), bool) and not (args and args[0].lower() in BOOLEANS):
                raw = "True"  # a boolean flag alone (--compile), as argparse's store_true
            elif not eq and args and not args[0].startswith("--"):  # --key value, as argparse users type it
                raw = args.pop(0)
                arg = f"--{key}={raw}"
            elif not eq:
                raise SystemExit(f"config: expected --key=value (or --key value), got {arg!r} with no value")
            if key not in cfg:
                raise SystemExit(f"config: unknown key {key!r} (from {arg!r}){nearest(key, cfg)}")
            cfg[key] = _typed(key, literal(raw, defaults[key], key), defaults[key])
        else:
            ns = run_config_file(arg)
            for key, value in ns.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                if key not in cfg:
                    raise SystemExit(f"config: unknown key {key!r} in {arg}:{line_of(arg, key)}{nearest(key, cfg)}")
                try:
                    cfg[key] = _typed(key, value, defaults[key])
                except SystemExit as e:
                    raise SystemExit(f"{e} in {arg}:{line_of(arg, key)}") from None
    return cfg


def line_of(path, name):
    """The line of config file `path` that last assigns or imports `name` ('?' if none can be found)."""
    lines = [node.lineno for node in ast.walk(ast.parse(Path(path).read_text()))
             if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store) or
             isinstance(node, ast.alias) and (node.asname or node.name) == name]
    return max(lines, default="?")


BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
BOOL_WORDS = "True or False (also true/false, yes/no, on/off, 1/0)"


def literal(raw, default, key="value"):
    """A command-line value as Python reads it; a bare word is a string; a boolean key also takes true/false,
    yes/no, on/off and 1/0 in any case. A list, dict or tuple that is not a literal is refused: read as a string it
    would become one path."""
    if isinstance(default, bool) and raw.strip().lower() in BOOLEANS:
        return BOOLEANS[raw.strip().lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        if raw.lstrip()[:1] in ("[", "{", "("):
            raise SystemExit(f"config: --{key}={raw} is a list or dict that Python's literal_eval cannot read: only "
                             "numbers, strings, lists, dicts, True, False and None, no calls such as float('inf') "
                             "(write 1e999 for infinity)") from None
        return raw  # a bare string


def nearest(name, known):
    """': did you mean a or b?' naming the known names closest to a mistyped one, or ''."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f": did you mean {' or '.join(close)}?" if close else ""


def _typed(key, value, default):
    if key == "data_dir" and isinstance(value, (list, tuple)):  # a mixture, a dict a source (mixture.py)
        return list(value)
    ok = isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int)) or \
        (isinstance(default, list) and isinstance(value, (list, tuple)))
    if not ok or (isinstance(default, int) and isinstance(value, bool) != isinstance(default, bool)):
        said = f"a bool, {BOOL_WORDS}" if isinstance(default, bool) else type(default).__name__
        raise SystemExit(f"config: {key} must be {said}, got {value!r} ({type(value).__name__})")
    return float(value) if isinstance(default, float) else (list(value) if isinstance(default, list) else value)


def run_config_file(arg):
    """The names config file `arg` assigns. It must be an existing .py file of assignments: YAML's `key: value`
    parses as a Python annotation and would be silently ignored. Whatever it raises is named with its line."""
    path = Path(arg)
    if not path.is_file():
        raise SystemExit(f"config: {arg}: no such file (arguments are a config file or --key=value)")
    if path.suffix != ".py":
        raise SystemExit(f"config: {arg}: a config is a Python file of `key = value` lines (configs/*.py), "
                         f"not {path.suffix or 'a file without a suffix'}")
    try:
        tree = ast.parse(path.read_text(), filename=arg)
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"config: {arg}: not valid Python ({e})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is None:
            raise SystemExit(f"config: {arg}:{node.lineno}: `{ast.unparse(node)}` assigns nothing (YAML? write "
                             f"key = value)")
    ns = {}
    try:
        exec(builtins.compile(tree, arg, "exec"), ns)  # noqa: S102  trusted Python, as in nanoGPT (`compile` is a key)
    except Exception as e:  # noqa: BLE001  whatever the file raises: name the file and its line
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
        raise SystemExit(f"config: {arg}:{lines[-1] if lines else '?'}: raised {type(e).__name__}: {e}") from None
    return ns


# -----------------------------------------------------------------------------
# the values checked

POSITIVE = ("batch_size", "micro_batch_size", "max_iters", "seq_len", "log_interval", "shuffle_block",
            "max_nonfinite_steps", "checkpoint_every", "attention_block", "storage_stall_s", "max_failed_checkpoints",
            "benchmark_batch_size")
NON_NEGATIVE = ("eval_interval", "eval_iters", "ckpt_interval", "local_ckpt_interval", "keep_last", "num_workers", "pack",
                "warmup_iters", "lr_decay_iters", "max_tiles", "final_accuracy_samples", "lr", "min_lr", "weight_decay",
                "grad_clip", "loss_chunk", "peak_flops", "lease_stale_s", "benchmark_interval", "benchmark_limit")


def check(cfg):
    """cfg (what parse read) with every value checked: one sentence for the first that is wrong."""
    if cfg["init_from"] == "scratch":  # a model_overrides field that is no model's: said now, not after the data
        model_config(cfg)
    for key in POSITIVE + NON_NEGATIVE:
        if cfg[key] < 0 or (cfg[key] == 0 and key in POSITIVE):
            raise SystemExit(f"config: {key} must be {'> 0' if key in POSITIVE else '>= 0'}, got {cfg[key]}")
    if cfg["min_lr"] > cfg["lr"]:
        raise SystemExit(f"config: min_lr={cfg['min_lr']:g} is above lr={cfg['lr']:g}: after the warmup the cosine "
                         f"schedule would climb from lr to min_lr; set min_lr <= lr")
    if bool(cfg["local_ckpt_interval"]) != bool(cfg["local_ckpt_dir"]):
        raise SystemExit("config: local_ckpt_dir and local_ckpt_interval go together (a folder on this host's disk, "
                         "and the steps between its checkpoints)")
    if storage.is_url(cfg["compile_cache_dir"]):
        raise SystemExit(f"config: compile_cache_dir {cfg['compile_cache_dir']!r} must be a folder on this host's disk "
                         f"(torch_xla reads its cache locally): leave it '' for ~/.cache/llavax, or 'none'")
    if storage.is_url(cfg["local_ckpt_dir"]):
        raise SystemExit(f"config: local_ckpt_dir {cfg['local_ckpt_dir']!r} must be a folder on this host's disk; "
                         f"out_dir is the bucket")
    if cfg["eval_interval"] and not cfg["eval_iters"]:
        raise SystemExit("config: eval_iters must be > 0 when eval_interval is (eval_interval=0 turns evaluation off)")
    if cfg["template"] not in chat.TEMPLATES:
        raise SystemExit(f"config: unknown template {cfg['template']!r}; choose from {sorted(chat.TEMPLATES)}")
    if cfg["image_mode"] not in ("pad", "crop", "resize"):
        raise SystemExit(f"config: unknown image_mode {cfg['image_mode']!r}; choose 'pad', 'crop' or 'resize'")
    if cfg["stage"] not in (0, 1, 2):
        raise SystemExit(f"config: stage must be 0, 1 or 2, got {cfg['stage']}")
    if cfg["parallel"] not in ("ddp", "fsdp"):
        raise SystemExit(f"config: parallel must be 'ddp' or 'fsdp', got {cfg['parallel']!r}")
    if cfg["mixture_change"] not in ("continue", "restart_epoch"):
        raise SystemExit(f"config: mixture_change must be 'continue' or 'restart_epoch', got {cfg['mixture_change']!r}")
    if cfg["dtype"] not in ("float32", "bfloat16"):
        raise SystemExit(f"config: dtype must be 'float32' or 'bfloat16', got {cfg['dtype']!r}")
    check_objective(cfg)
    check_speed_levers(cfg)
    unknown = set(cfg["lr_scale"]) - {"vision", "projector", "llm"}
    if unknown:
        raise SystemExit(f"config: lr_scale has unknown modules {sorted(unknown)}")
    lora_config(cfg)
    return cfg


def check_device(device, said="config: device"):
    """Before the backend starts (torch's own error is a traceback from deep in set_device): a CUDA device where torch
    finds none is one sentence. Checked by the programs that run, not by check (an audit of a GPU config runs anywhere)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{said}={device!r}, but torch finds no CUDA GPU here (torch {torch.__version__}, built with "
                         f"CUDA {torch.version.cuda or 'none'}): run on the CPU (device 'cpu')")


def schedule_warning(cfg):
    """A sentence when the warmup outlasts the schedule (lr_decay_iters, else max_iters): the peak lr is never reached.
    A warning, not an error: a few steps of a long recipe (a smoke test) are that, on purpose; so is the first part of
    a longer schedule (lr_decay_iters past max_iters), which says nothing."""
    schedule = cfg["lr_decay_iters"] or cfg["max_iters"]
    if cfg["warmup_iters"] > schedule and schedule <= cfg["max_iters"]:
        where = f"lr_decay_iters={schedule}" if cfg["lr_decay_iters"] else f"max_iters={schedule}"
        return (f"config: warning: warmup_iters={cfg['warmup_iters']} is longer than {where}: the learning rate never "
                f"reaches lr={cfg['lr']:g} (at most {cfg['lr'] * schedule / cfg['warmup_iters']:.3g})")
    return None


def check_speed_levers(cfg):
    if cfg["attention"] not in ATTENTION:
        raise SystemExit(f"config: attention must be one of {ATTENTION}, got {cfg['attention']!r}")
    if cfg["attention"] in PALLAS and cfg["device"] != "xla":
        raise SystemExit(pallas_refusal(cfg["attention"], f"device={cfg['device']!r}"))
    if cfg["checkpoint_policy"] not in ("full", "selective"):
        raise SystemExit(f"config: checkpoint_policy must be 'full' or 'selective', got {cfg['checkpoint_policy']!r}")
    if cfg["checkpoint_policy"] == "selective" and cfg["device"] == "xla":
        raise SystemExit("config: checkpoint_policy='selective' is torch's (CUDA, CPU); torch_xla's checkpoint "
                         "recomputes whole blocks: use checkpoint_policy='full' under XLA")
    if cfg["frozen_dtype"] not in ("float32", "bfloat16"):
        raise SystemExit(f"config: frozen_dtype must be 'float32' or 'bfloat16', got {cfg['frozen_dtype']!r}")
    if cfg["frozen_dtype"] == "bfloat16" and cfg["dtype"] != "bfloat16":
        raise SystemExit("config: frozen_dtype='bfloat16' needs dtype='bfloat16' (fp32 compute would meet bf16 weights)")
    if cfg["frozen_dtype"] == "bfloat16" and cfg["device"] == "xla":
        raise SystemExit("config: frozen_dtype='bfloat16' is built and tested for torchrun and single-process runs (CUDA, "
                         "CPU), not under XLA: use frozen_dtype='float32' there")
    if (cfg["checkpoint_policy"] != "full" or cfg["checkpoint_every"] != 1) and not cfg["activation_checkpointing"]:
        raise SystemExit(f"config: checkpoint_policy={cfg['checkpoint_policy']!r}, checkpoint_every="
                         f"{cfg['checkpoint_every']} say how activation_checkpointing recomputes, and it is off: set "
                         "activation_checkpointing=True")


OBJECTIVES = ("sft", "dpo", "reward", "grpo", "ppo")


def check_objective(cfg):
    if cfg["objective"] not in OBJECTIVES:
        raise SystemExit(f"config: objective must be one of {OBJECTIVES}, got {cfg['objective']!r}")
    if cfg["dpo_loss"] not in DPO_LOSSES:
        raise SystemExit(f"config: dpo_loss must be one of {DPO_LOSSES}, got {cfg['dpo_loss']!r}")
    if cfg["dpo_beta"] <= 0 or cfg["dpo_sft_weight"] < 0:
        raise SystemExit(f"config: dpo_beta must be > 0 and dpo_sft_weight >= 0, got {cfg['dpo_beta']}, "
                         f"{cfg['dpo_sft_weight']}")
    if cfg["objective"] in ("dpo", "reward") and cfg["pack"]:
        raise SystemExit(f"config: objective={cfg['objective']!r} reads a pair into two fixed rows: pack must be 0")
    if cfg["objective"] == "grpo":
        rl.check_config(cfg)
    if cfg["objective"] == "ppo":
        rl.check_ppo_config(cfg)
    if cfg["reward_center_weight"] < 0:
        raise SystemExit(f"config: reward_center_weight must be >= 0, got {cfg['reward_center_weight']}")
    if cfg["objective"] == "dpo" and (cfg["dpo_reference"] or cfg["init_from"]) in ("scratch", "resume"):
        raise SystemExit("config: objective='dpo' needs a reference checkpoint: init_from (the SFT checkpoint the run "
                         "starts from), or dpo_reference=DIR when init_from is 'resume' or 'scratch'")


def model_config(cfg):
    """The VLMConfig that init_from='scratch' builds: the preset `model` with `model_overrides` merged in."""
    if cfg["model"] not in VLM_PRESETS:
        raise SystemExit(f"config: model {cfg['model']!r} is no preset{nearest(cfg['model'], VLM_PRESETS)} (the "
                         f"presets: {', '.join(VLM_PRESETS)})")
    try:
        return vlm_preset(cfg["model"]).with_overrides(cfg["model_overrides"])
    except (ValueError, TypeError) as e:
        raise SystemExit(f"config: model_overrides {cfg['model_overrides']!r} do not make a model: {e}") from None


def lora_config(cfg):
    known = [f.name for f in fields(LoRAConfig)]
    if isinstance(cfg["lora"], dict) and (unknown := [k for k in cfg["lora"] if k not in known]):
        raise SystemExit(f"config: lora={cfg['lora']!r}: no field {unknown[0]!r}{nearest(unknown[0], known)} (its "
                         f"fields: {', '.join(known)})")
    try:
        return LoRAConfig(**cfg["lora"]) if cfg["lora"] else None
    except (TypeError, ValueError) as e:
        raise SystemExit(f"config: lora={cfg['lora']!r}: {str(e).replace('__init__() got an ', '')}") from None


def load_config(argv):
    if "--help" in argv or "-h" in argv:
        with contextlib.suppress(BrokenPipeError):  # `train.py --help | head`
            print(help_text([a for a in argv if a not in ("--help", "-h")]))
        raise SystemExit(0)
    return check(parse(argv, DEFAULTS))


def described_keys():
    """[(group, key, its comment's first line)] in this file's order (described_notes has the longer comments)."""
    return [(group, key, comment) for group, key, comment, _ in described_notes()]


def described_notes():
    """[(group, key, its comment, note)] in this file's order. A one-line comment between keys opens a group (its
    name: up to its colon or parenthesis); a longer one is a note on the key below it (its lines, for help)."""
    source = Path(__file__).read_text()
    block = source[source.index("# a run's typed defaults"):source.index("\nDEFAULTS = ")].splitlines()[1:]
    group, comments, found = "", [], []
    for line in block:
        if line.startswith("# "):
            comments.append(line)
            continue
        if len(comments) == 1 or not found and comments:
            group = re.split(r"[:(]", comments[0][2:])[0].strip()
        if m := re.match(r"(\w+) = .*?(?:  # (.*))?$", line):
            found.append((group, m.group(1), m.group(2) or "", comments if len(comments) > 1 and found else []))
        comments = [] if line else comments
    return found


def help_text(argv):
    """Every key, grouped as this file groups them, with its default (or the value argv's config files and flags
    give it, marked * where they change it), its type and what it is."""
    cfg = parse(argv, DEFAULTS)
    lines = ["usage: python train.py [CONFIG.py ...] [--key=value | --key value ...]",
             "Config files (Python files of `key = value` lines, configs/*.py) and flags apply in order; each value keeps "
             "its default's type (booleans also take true/false/yes/no/1/0, or --flag alone for True). The keys, from "
             "config.py"
             + (f", as {' '.join(argv)} sets them (* changed):" if argv else ":")]
    group = None
    for where, key, comment, note in described_notes():
        if where != group:
            group = where
            lines.append(f"\n{where}")
        lines += [f"   {line}" for line in note]
        shown = repr(cfg[key])
        shown = shown if len(shown) <= 48 else shown[:45] + "..."
        mark = "*" if argv and cfg[key] != DEFAULTS[key] else " "
        lines.append(f" {mark}{key} = {shown}  ({type(DEFAULTS[key]).__name__})" + (f"  {comment}" if comment else ""))
    return "\n".join(lines)


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


MODEL_INPUTS = ("tokenizer", "init_from", "dpo_reference", "grpo_reference", "grpo_reward", "ppo_value_init")


def check_inputs(cfg):
    """Each input's bucket, the dataset's metadata and the tokenizer, before anything is built (a 7B model takes
    minutes): a missing one is one sentence now, not after the model."""
    for key in MODEL_INPUTS:  # read where they load; a bucket that is not there is named now
        if storage.is_url(cfg.get(key) or ""):
            try:
                storage.check_bucket(cfg[key])
            except storage.StorageError as e:
                raise SystemExit(f"{key} {e}") from None
    steps = "; ".join(f"({i}) {c}" for i, c in enumerate(cfg["prepare"], 1))
    init = cfg["init_from"]
    if steps and init not in ("scratch", "resume") and not cfg["resume"] and not storage.is_url(init) and \
            not Path(init).exists():
        raise SystemExit(f"init_from {init!r} does not exist; this config's inputs are made by: {steps}")
    check_data(cfg["data_dir"], cfg["objective"], cfg["seed"], cfg["tokenizer"], steps)
    try:
        chat.Tokenizer(cfg["tokenizer"])
    except Exception as e:  # noqa: BLE001  sentencepiece and tokenizers raise many kinds for a bogus file
        raise SystemExit(f"tokenizer {cfg['tokenizer']!r}: cannot load ({type(e).__name__}: {e})") from None


def check_data(data_dir, objective, seed, tokenizer, steps=""):
    """data_dir's sources (one dataset, or a mixture: mixture.py) each there, with a train split, something left by
    its take rule, made for this run's tokenizer if a mixture's source records one, and of one kind (preference pairs
    or single answers): one sentence naming the source."""
    try:
        found = mixture.sources(data_dir, "train")
    except MixtureError as e:
        raise SystemExit(f"data_dir: {e}") from None
    kinds = {}
    for source in found:
        where = f"data_dir {source.path!r}" if len(found) == 1 else f"data_dir source {source.name} ({source.path})"
        if not storage.is_url(source.path) and not Path(source.path).exists():
            hint = f" This config's inputs are made by: {steps}" if steps else \
                " For the shapes demo run `python data.py shapes --out data/shapes` first (make demo does it)." \
                if len(found) == 1 else ""
            raise SystemExit(f"{where} does not exist.{hint}")
        if not storage.is_url(source.path) and Path(source.path).is_file() and not source.path.endswith(".tar"):
            raise SystemExit(f"{where} is a file but not a .tar of shards: pack a LLaVA JSON first (`python data.py "
                             f"pack --json FILE --images DIR --out DATASET`), and give a mixture file as data_dir itself")
        try:  # its bucket, .nv-meta and shard listing (two listings and three small reads), or a lone tar's index
            counts = shard_files(source.path, source.part)
            for tar, count in counts.items():
                if count is None:  # a lone tar: there, its samples counted when the loader reads its index
                    storage.size(tar)
        except (DatasetError, OSError) as e:
            said = str(e).replace("no train shards found", "no train split (no train shards)")
            raise SystemExit(f"data_dir {said}" if said.startswith(str(source.path)) and len(found) == 1 else
                             f"{where}: {said}") from None
        if None in counts.values():
            kinds[source.name] = first_sample_kind(counts)
            continue
        try:  # a LLaVA-NeXT rule counts the records of the file packed, where pack recorded them
            records = mixture.packed_records(source.path, list(counts)) if source.take != "all" else None
            kept = len(mixture.take_indices(source.take, sum(counts.values()), source.name, seed, records))
        except MixtureError as e:
            raise SystemExit(f"{where}: {e}") from None
        if not kept:
            raise SystemExit(f"{where}: take {source.take!r} keeps none of its {sum(counts.values())} samples")
        if source.repeat is not None and int(kept * source.repeat) == 0:
            raise SystemExit(f"{where}: repeat {source.repeat:g} draws none of its {kept} samples an epoch (int(n x "
                             f"repeat), as Energon counts): raise it, or leave the source out")
        made_for = made_for_tokenizer(source.path) if len(found) > 1 else None
        if made_for and made_for["sha256"] != file_sha256(tokenizer):
            raise SystemExit(f"{where} was made for another tokenizer ({made_for['file']}, sha256 "
                             f"{made_for['sha256'][:12]}...) than this run's {tokenizer}: its text is tokenized for "
                             f"that one (shapes: draw it with --tokenizer {tokenizer})")
        kinds[source.name] = first_sample_kind(counts)
    pairs = sorted(name for name, kind in kinds.items() if kind == "pair")
    single = sorted(name for name, kind in kinds.items() if kind == "single")
    if pairs and single:
        raise SystemExit(f"data_dir: a mixture of preference pairs ({', '.join(pairs[:3])}) and single answers "
                         f"({', '.join(single[:3])}) under objective={objective!r}: every source of a run must hold "
                         f"the same kind of sample")


def file_sha256(tokenizer):
    """The sha256 of the tokenizer file a run reads, or None when it cannot be read (check_inputs says why)."""
    try:
        return sha256(storage.read_bytes(chat.tokenizer_file(tokenizer))).hexdigest()
    except (OSError, ValueError):
        return None


def made_for_tokenizer(path):
    """The tokenizer a dataset folder records it was made for (.nv-meta/llavax.json), or None."""
    meta = storage.join(path, ".nv-meta", "llavax.json")
    try:
        return json.loads(storage.read_text(meta)).get("tokenizer") if not str(path).endswith(".tar") else None
    except (OSError, ValueError, AttributeError):
        return None


def first_sample_kind(counts):
    """'pair' (a rejected answer in its last turn), 'single', or None (unreadable: the loader counts it) of the
    first sample of a dataset's shards."""
    try:
        tar = next(iter(counts))
        start, end = sample_offsets(tar, counts[tar])[0]
        conv, _ = sample_conversation(parse_members(storage.read_bytes(tar, start, end))[1])
        return "pair" if isinstance(conv[-1], dict) and "rejected" in conv[-1] else "single"
    except (DatasetError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def check_carried_tokenizer(step, cfg):
    """A training step carries its run's tokenizer (checkpoint.tokenizer_files): this run's must encode text as that
    one does. Another tokenizer named, or its file replaced in the bucket since, would shift the ids the model learned."""
    try:
        carried = checkpoint.tokenizer_files(step) if model_files.is_sharded_checkpoint(step) else {}
    except OSError:  # not there, or not a step: init_model says so
        return
    if carried:
        ours = chat.Tokenizer(cfg["tokenizer"])
        theirs = chat.Tokenizer(step, legacy=None if "tokenizer_config.json" in carried else ours.legacy)
        if (theirs.vocab_size, theirs.encode(rl.PROBE)) != (ours.vocab_size, ours.encode(rl.PROBE)):
            raise SystemExit(f"tokenizer {cfg['tokenizer']!r} encodes text unlike {theirs.path}, the tokenizer "
                             f"{step} was trained with; train with that one")


def data_model_config(cfg, resume_from):
    """The VLMConfig the data is encoded for, read before the model is built (the checkpoint's config.json, ours or
    an HF LLaVA's, else the preset), so that data a model cannot train on is refused first; None where it cannot be
    read (train.py's init_model then says why)."""
    source = resume_from or (cfg["init_from"] if cfg["init_from"] not in ("scratch", "resume") else None)
    if source is None:
        return model_config(cfg)
    check_carried_tokenizer(source, cfg)  # another tokenizer is the cause, whatever the data then says
    try:
        saved = json.loads(storage.read_text(storage.join(source, "config.json")))
        return llava_config(saved, source) if saved.get("model_type") in HF_ARCHITECTURES else VLMConfig.from_dict(saved)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # ConversionError is a ValueError
        return None
