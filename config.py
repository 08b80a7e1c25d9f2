"""
train.py's configuration, nanoGPT-style (its configurator.py): the defaults at the top of train.py, then each config
file (a Python file of `key = value` lines) and --key=value argument in order (parse). Each value keeps its default's
type; an unknown key, a wrong type or a file that is not such a Python file is one sentence; then every value is
checked (check), each objective's keys by its module (rl.check_config for GRPO).
"""

import ast
import builtins
import traceback
from pathlib import Path

import data
import rl
from lora import LoRAConfig
from model import DPO_LOSSES, vlm_preset
from parallel import ATTENTION, PALLAS, pallas_refusal


def parse(argv, defaults):
    """defaults updated by argv (config files and --key=value, in order), each value of its default's type."""
    cfg = dict(defaults)
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
            cfg[key] = _typed(key, value, defaults[key])
        else:
            ns = run_config_file(arg)
            for key, value in ns.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                if key not in cfg:
                    raise SystemExit(f"config: unknown key {key!r} in {arg}")
                cfg[key] = _typed(key, value, defaults[key])
    return cfg


def _typed(key, value, default):
    ok = isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int)) or \
        (isinstance(default, list) and isinstance(value, (list, tuple)))
    if not ok or (isinstance(default, int) and isinstance(value, bool) != isinstance(default, bool)):
        raise SystemExit(f"config: {key} must be {type(default).__name__}, got {value!r} ({type(value).__name__})")
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
            "max_nonfinite_steps", "checkpoint_every", "attention_block")
NON_NEGATIVE = ("eval_interval", "eval_iters", "ckpt_interval", "keep_last", "num_workers", "pack", "warmup_iters",
                "lr_decay_iters", "max_tiles", "final_accuracy_samples", "lr", "min_lr", "weight_decay", "grad_clip",
                "loss_chunk", "peak_flops")


def check(cfg):
    """cfg (what parse read) with every value checked: one sentence for the first that is wrong."""
    for key in POSITIVE + NON_NEGATIVE:
        if cfg[key] < 0 or (cfg[key] == 0 and key in POSITIVE):
            raise SystemExit(f"config: {key} must be {'> 0' if key in POSITIVE else '>= 0'}, got {cfg[key]}")
    if cfg["eval_interval"] and not cfg["eval_iters"]:
        raise SystemExit("config: eval_iters must be > 0 when eval_interval is (eval_interval=0 turns evaluation off)")
    if cfg["template"] not in data.TEMPLATES:
        raise SystemExit(f"config: unknown template {cfg['template']!r}; choose from {sorted(data.TEMPLATES)}")
    if cfg["image_mode"] not in ("pad", "crop", "resize"):
        raise SystemExit(f"config: unknown image_mode {cfg['image_mode']!r}; choose 'pad', 'crop' or 'resize'")
    if cfg["stage"] not in (0, 1, 2):
        raise SystemExit(f"config: stage must be 0, 1 or 2, got {cfg['stage']}")
    if cfg["parallel"] not in ("ddp", "fsdp"):
        raise SystemExit(f"config: parallel must be 'ddp' or 'fsdp', got {cfg['parallel']!r}")
    if cfg["dtype"] not in ("float32", "bfloat16"):
        raise SystemExit(f"config: dtype must be 'float32' or 'bfloat16', got {cfg['dtype']!r}")
    check_objective(cfg)
    check_speed_levers(cfg)
    unknown = set(cfg["lr_scale"]) - {"vision", "projector", "llm"}
    if unknown:
        raise SystemExit(f"config: lr_scale has unknown modules {sorted(unknown)}")
    lora_config(cfg)
    return cfg


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


OBJECTIVES = ("sft", "dpo", "reward", "grpo")


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
    if cfg["reward_center_weight"] < 0:
        raise SystemExit(f"config: reward_center_weight must be >= 0, got {cfg['reward_center_weight']}")
    if cfg["objective"] == "dpo" and (cfg["dpo_reference"] or cfg["init_from"]) in ("scratch", "resume"):
        raise SystemExit("config: objective='dpo' needs a reference checkpoint: init_from (the SFT checkpoint the run "
                         "starts from), or dpo_reference=DIR when init_from is 'resume' or 'scratch'")


def model_config(cfg):
    """The VLMConfig that init_from='scratch' builds: the preset `model` with `model_overrides` merged in."""
    try:
        return vlm_preset(cfg["model"]).with_overrides(cfg["model_overrides"])
    except (ValueError, TypeError) as e:
        raise SystemExit(f"config: model_overrides {cfg['model_overrides']!r} do not make a model: {e}") from None


def lora_config(cfg):
    try:
        return LoRAConfig(**cfg["lora"]) if cfg["lora"] else None
    except (TypeError, ValueError) as e:
        raise SystemExit(f"config: lora={cfg['lora']!r}: {str(e).replace('__init__() got an ', '')}") from None
