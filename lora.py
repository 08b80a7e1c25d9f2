"""
LoRA as peft computes it, on the VLM's own linear layers: y = x W^T + b + scaling * B(A(dropout(x))), W and b
frozen. LoRALinear is an nn.Linear (its weight and bias keep their names: a plain checkpoint loads into it);
apply_lora puts adapters on the layers a LoRAConfig targets, merge_lora folds them back. Split from model.py (over
its budget), which builds the adapters a config names (VLM.__init__).
"""

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn


@dataclass
class LoRAConfig:
    """peft's LoRA on the linear layers `targets` names: a site ("llm.attention.wq") or a prefix of sites ("llm" is
    every linear layer of the LLM's blocks, LLaVA's recipe); the vision tower only when a target names it."""
    r: int = 8  # r and alpha: peft's defaults (LLaVA's recipe: 128 and 256)
    alpha: float = 8.0
    dropout: float = 0.0  # on the adapter's input, in training only
    targets: list = field(default_factory=lambda: ["llm"])
    rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r

    def __post_init__(self):
        if not (isinstance(self.r, int) and self.r > 0) or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"lora: r must be a positive integer, alpha > 0 and 0 <= dropout < 1; got r={self.r!r}, "
                             f"alpha={self.alpha!r}, dropout={self.dropout!r}")
        known = {".".join(s.split(".")[:i]) for s in LORA_SITES for i in (1, 2, 3)}
        self.targets = list(self.targets) if isinstance(self.targets, (list, tuple)) else [self.targets]
        unknown = [t for t in self.targets if t not in known]
        if unknown or not self.targets:
            raise ValueError(f"lora: unknown targets {unknown or '[] (none)'}; a target is one of {sorted(known)}")
        self.alpha, self.dropout = float(self.alpha), float(self.dropout)

    @property
    def scaling(self):
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def sites(self):
        return [s for s in LORA_SITES if any(s == t or s.startswith(t + ".") for t in self.targets)]


# the linear layers of a block LoRA may adapt, named without the block index (llm.layers.3.attention.wq)
LORA_SITES = tuple(f"llm.attention.{w}" for w in ("wq", "wk", "wv", "wo")) + \
    tuple(f"llm.feed_forward.{w}" for w in ("w1", "w2", "w3")) + \
    tuple(f"vision.attn.{w}" for w in ("wq", "wk", "wv", "wo")) + ("vision.mlp.c_fc", "vision.mlp.c_proj")




class LoRALinear(nn.Linear):
    """An nn.Linear that keeps its weight and bias (their names too: a plain checkpoint loads into it) and adds the
    adapter lora_A (r, in), lora_B (out, r); peft's init: A kaiming-uniform with a = sqrt(5), B zero."""

    def __init__(self, base: nn.Linear, lora: LoRAConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, lora.r, bias=False, **kw)
        self.lora_B = nn.Linear(lora.r, base.out_features, bias=False, **kw)
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        self.scaling = lora.scaling
        self.adapter_on = True  # adapters_off turns it off: the layer is then its base nn.Linear
        self.reset_adapter()

    @torch.no_grad()
    def reset_adapter(self, generator=None):
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        if not self.adapter_on:
            return super().forward(x)
        return super().forward(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


@contextmanager
def adapters_off(model):
    """Inside the block every LoRALinear of model computes its base layer alone (peft's disable_adapter): the model
    as it was before its adapters, without a second copy of its weights. Restored on leaving, an exception included."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    was_on = [m.adapter_on for m in layers]
    for m in layers:
        m.adapter_on = False
    try:
        yield model
    finally:
        for m, on in zip(layers, was_on, strict=True):
            m.adapter_on = on


def lora_layers(model, lora: LoRAConfig):
    """{name: nn.Linear} of the block linear layers lora.targets selects, e.g. llm.layers.0.attention.wq."""
    sites = lora.sites()
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and re.sub(r"^(llm|vision)\.(layers|blocks)\.\d+\.", r"\1.", name) in sites}


@torch.no_grad()
def apply_lora(model, lora: LoRAConfig, seed=None):
    """Put adapters on the target layers of a built model, in place (build or load the base weights first), and
    record them in model.cfg, so that a checkpoint of it rebuilds them (VLM.__init__)."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("apply_lora: the model has adapters already; merge_lora first")
    layers = lora_layers(model, lora)
    if not layers:
        raise ValueError(f"apply_lora: targets {lora.targets} select no layer of this model")
    device = next(iter(layers.values())).weight.device
    gen = None if seed is None or device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    for name, linear in layers.items():
        parent, _, leaf = name.rpartition(".")
        adapted = LoRALinear(linear, lora)
        adapted.reset_adapter(gen)
        setattr(model.get_submodule(parent), leaf, adapted)
    if model.cfg.lora != lora:
        model.cfg = replace(model.cfg, lora=lora)
    return model


def lora_merged(weight, lora_A, lora_B, scaling):
    """W + scaling * B @ A (peft's merge), summed in fp32 and returned in W's dtype, or the adapters' when theirs is
    wider: a bf16-stored frozen W (frozen_dtype) under fp32 adapters would lose most of a small update to rounding."""
    merged = weight.float() + scaling * (lora_B.float() @ lora_A.float())
    return merged.to(torch.promote_types(weight.dtype, lora_A.dtype))


@torch.no_grad()
def merge_lora(model):
    """Fold every adapter into its weight and put plain nn.Linear layers back (peft's merge_and_unload)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            m.weight.copy_(lora_merged(m.weight, m.lora_A.weight, m.lora_B.weight, m.scaling))
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            plain.weight, plain.bias = m.weight, m.bias
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, plain)
    model.cfg = replace(model.cfg, lora=None)
    return model


def merge_lora_state(state, lora: LoRAConfig):
    """merge_lora on a state dict: the adapters folded into their weights and dropped (no model built)."""
    out = {k: v for k, v in state.items() if not is_lora_parameter(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            site = key.removesuffix(".lora_A.weight")
            out[f"{site}.weight"] = lora_merged(state[f"{site}.weight"], state[key], state[f"{site}.lora_B.weight"],
                                                lora.scaling)
    return out


def is_lora_parameter(name):
    return name.endswith((".lora_A.weight", ".lora_B.weight"))
