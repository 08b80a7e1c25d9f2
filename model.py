"""
The LLaVA-style vision-language model in one file: a CLIP ViT, a projector and LLaMA.

No device, distributed or file code lives here (see STYLE.md); train.py and convert.py
do that. Parameter names follow OpenAI CLIP for the ViT and Meta's reference model.py for
LLaMA; Hugging Face names exist only in hf_names.py's tables. The configs and named presets the
modules are built from live in model_config.py (every name re-exported here).
"""

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from lora import LoRALinear, apply_lora  # model.X for callers that build models with adapters
from model_config import (
    VIT_ACTIVATIONS,
    LlamaConfig,
    ViTConfig,
    VLMConfig,  # model.X: the configs are the model's
    projector_depth,
)

# -----------------------------------------------------------------------------
# the CLIP vision tower


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm written elementwise (mean and variance in fp32, the output dtype F.layer_norm gives). torch_xla
    lowers F.layer_norm to batch-norm-training over a (1, B*T, D) reshape that GSPMD cannot shard: every one
    all-gathered the global batch's activations on each device."""

    def forward(self, x):
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * self.weight.float() + self.bias.float()
        return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)


class ViTAttention(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (w(x).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class ViTMLP(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.dim)
        self.act = VIT_ACTIVATIONS[cfg.act]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class ViTBlock(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = ViTAttention(cfg)
        self.ln_2 = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = ViTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        clip = cfg.kind == "clip"  # SigLIP: no class token, no pre-LayerNorm, a bias on the patch conv
        self.conv1 = nn.Conv2d(3, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=not clip)
        self.class_embedding = nn.Parameter(torch.empty(cfg.dim)) if clip else None
        self.positional_embedding = nn.Parameter(torch.empty(cfg.n_positions, cfg.dim))
        self.ln_pre = LayerNorm(cfg.dim, eps=cfg.norm_eps) if clip else nn.Identity()
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.n_layers))
        # ln_post only feeds the pooled output (CLIP's) or the last hidden state (SigLIP's); LLaVA reads
        # neither, but we keep it so checkpoints round-trip without losing weights.
        self.ln_post = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.checkpoint = None  # checkpoint(fn, *args): recompute each block in backward (train.py sets torch's or XLA's)

    def forward(self, pixel_values, layers=(-1,)):
        """Hidden states at the given HF indices: 0 is after ln_pre (SigLIP: the embeddings), i after block i, -1 last."""
        n = self.cfg.n_layers
        wanted = [i if i >= 0 else n + 1 + i for i in layers]
        if not all(0 <= i <= n for i in wanted):
            raise ValueError(f"vision layers {list(layers)} out of range for a {n}-layer ViT")
        x = self.conv1(pixel_values.to(self.conv1.weight.dtype))  # (B, D, h, w)
        x = x.flatten(2).transpose(1, 2)  # (B, n_patches, D)
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, D)
            x = torch.cat([cls, x], dim=1)  # (B, 1 + n_patches, D)
        x = x + self.positional_embedding.to(x.dtype)  # (B, n_positions, D)
        x = self.ln_pre(x)
        states = {0: x}
        for i, block in enumerate(self.blocks[: max(wanted)], start=1):
            x = self.checkpoint(block, x) if self.checkpoint and self.training else block(x)
            states[i] = x
        return [states[i] for i in wanted]


# -----------------------------------------------------------------------------
# the projector


class Projector(nn.Module):
    """LLaVA's mm_projector: Linear, then (GELU, Linear) N-1 times. GELU is exact erf."""

    def __init__(self, kind, in_dim, out_dim):
        super().__init__()
        depth = projector_depth(kind)
        self.fc = nn.ModuleList(nn.Linear(in_dim if i == 0 else out_dim, out_dim) for i in range(depth))

    def forward(self, x):
        x = self.fc[0](x)
        for fc in self.fc[1:]:
            x = fc(F.gelu(x))
        return x


# -----------------------------------------------------------------------------
# LLaMA


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        # normalise in fp32, then cast back before the scale, as HF and Meta do
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(cfg: LlamaConfig):
    """Inverse frequencies, with Llama 3.1's smooth low/high frequency rescaling when asked."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) in (None, "default"):
        return inv_freq
    if rs.get("rope_type", rs.get("type")) == "linear":  # positions divided by factor
        return inv_freq / rs["factor"]
    if rs.get("rope_type", rs.get("type")) != "llama3":
        raise ValueError(f"unsupported rope_scaling {rs}: only 'linear' and 'llama3' are implemented")
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, blended, scaled)


def apply_rope(x, cos, sin):
    # HF's half-rotation convention, so HF weights load without permuting wq/wk
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """Preallocated keys and values for generation: one (B, n_kv_heads, max_len, head_dim) pair per layer."""

    def __init__(self, cfg: LlamaConfig, batch_size, max_len, dtype, device):
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        in_window = cfg.sliding_layers is None or layer_id in cfg.sliding_layers
        self.window = cfg.sliding_window if in_window else None

    def forward(self, x, cos, sin, cache=None, start_pos=0, mask=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        # RoPE in the tables' precision, as HF; then back to v's dtype (autocast on XLA does not cast SDPA's inputs)
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        if isinstance(mask, BlockMask):  # packed rows on CUDA: FlexAttention skips the masked blocks
            if self.window:
                raise ValueError("FlexAttention packing with a sliding window is not implemented; train unpacked")
            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)
            return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)
        causal = mask is None
        static = torch.is_tensor(start_pos)  # a decode step at the slot a (1,) tensor holds: one graph for every step
        if cache is not None and static:  # the whole cache is read; Llama's mask (B, 1, 1, max_len) hides empty slots
            cache.k[self.layer_id].index_copy_(2, start_pos, k.to(cache.k[self.layer_id].dtype))
            cache.v[self.layer_id].index_copy_(2, start_pos, v.to(cache.v[self.layer_id].dtype))
            k, v = cache.k[self.layer_id].to(q.dtype), cache.v[self.layer_id].to(q.dtype)  # (B, Hkv, max_len, hd)
        elif cache is not None:
            end = start_pos + T
            cache.k[self.layer_id][:, :, start_pos:end] = k
            cache.v[self.layer_id][:, :, start_pos:end] = v
            # in q's dtype: the cache holds the embeddings' (fp32 under autocast), and XLA's autocast leaves SDPA alone
            k, v = cache.k[self.layer_id][:, :, :end].to(q.dtype), cache.v[self.layer_id][:, :, :end].to(q.dtype)
            # query t sits at start_pos + t and sees every key up to there; a given mask (B, 1, 1, end) adds padding
            seen = torch.arange(end, device=x.device)[None, :] <= torch.arange(start_pos, end, device=x.device)[:, None]
            mask, causal = seen if mask is None else mask & seen, False
        if self.window and (static or start_pos + T > self.window):  # keys up to window - 1 back (HF: kv > q - window)
            S = k.shape[2]
            # (T, 1) cache slots; packed rows: row offsets
            q_at = start_pos[:, None] if static else torch.arange(S - T, S, device=x.device)[:, None]
            near = q_at - torch.arange(S, device=x.device)[None, :] < self.window  # (T, S)
            mask = near & (torch.arange(S, device=x.device)[None, :] <= q_at) if causal else mask & near
            causal = False
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, cache=None, start_pos=0, mask=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, start_pos, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # real cos/sin tables (no complex dtypes: XLA handles them poorly); rebuilt by init_buffers
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.checkpoint = None  # checkpoint(fn, *args): recompute each block in backward (train.py sets torch's or XLA's)
        self.flex_attention = False  # packed rows through FlexAttention (CUDA, compiled blocks) rather than a dense mask

    def init_buffers(self):
        inv_freq = rope_frequencies(self.cfg).to(self.rope_cos.device)
        t = torch.arange(self.cfg.max_seq_len, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)  # (max_seq_len, head_dim / 2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_seq_len, head_dim)
        self.rope_cos.copy_(emb.cos())
        self.rope_sin.copy_(emb.sin())

    def forward(self, h, cache=None, start_pos=0, position_ids=None, pad=None):
        """Embeddings (B, T, D) in, final-normed hidden states (B, T, D) out; self.output makes logits.

        position_ids (B, T) marks packed rows: a new sample starts wherever the position is 0, and no
        sample attends to another (tokens after the last sample form one more, unsupervised, sample).
        pad (B, start_pos + T), True at left padding (generation): no query attends a padded key, and
        positions count from each row's first real token, as HF derives them from the attention mask.
        Static decoding (generate(static=True)): start_pos a (1,) tensor, T = 1, pad (B, the cache's max_len)."""
        T, static = h.shape[1], torch.is_tensor(start_pos)
        if not static and start_pos + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        mask = None
        if pad is not None:
            positions = ((~pad).long().cumsum(dim=1) - 1).clamp(min=0)
            positions = positions.index_select(1, start_pos) if static else positions[:, start_pos:]  # (B, T)
            cos = self.rope_cos[positions].to(h.dtype)[:, None]  # (B, 1, T, hd)
            sin = self.rope_sin[positions].to(h.dtype)[:, None]
            # causal; a padded query sees only itself (a row with every key masked would make SDPA return NaN)
            key_at = torch.arange(pad.shape[1], device=h.device)
            query_at = (start_pos if static else torch.arange(start_pos, start_pos + T, device=h.device))[:, None]
            mask = ((~pad[:, None, None, :]) | (key_at == query_at)) & (key_at <= query_at)  # (B, 1, T, start_pos + T)
        elif position_ids is None:
            cos = self.rope_cos[start_pos : start_pos + T].to(h.dtype)  # (T, hd)
            sin = self.rope_sin[start_pos : start_pos + T].to(h.dtype)
        else:
            cos = self.rope_cos[position_ids].to(h.dtype)[:, None]  # (B, 1, T, hd)
            sin = self.rope_sin[position_ids].to(h.dtype)[:, None]
            mask = self.document_mask((position_ids == 0).cumsum(dim=1))
        for layer in self.layers:
            if self.checkpoint and self.training:
                h = self.checkpoint(layer, h, cos, sin, None, 0, mask)
            else:
                h = layer(h, cos, sin, cache, start_pos, mask)
        return self.norm(h)

    def document_mask(self, doc):
        """Causal attention within each sample of a packed row; doc (B, T) numbers the samples along the row."""
        B, T = doc.shape
        if self.flex_attention:
            same_doc = lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)  # noqa: E731
            return create_block_mask(same_doc, B, None, T, T, device=doc.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
        return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T): static, XLA compiles it


def chunked_cross_entropy(h, weight, targets, chunk, recompute, per_row=False):
    """Summed token losses of logits = h @ weight.T, about `chunk` positions at a time: the same span of every row,
    so a batch-sharded h stays sharded (XLA all-gathered a slice of the flattened batch). Each chunk's logits are
    recomputed in backward, so the full fp32 (B*T, vocab) logits never exist (2.1 GB at 8 x 2048 x 32k).
    per_row: each row's sum (B,), as DPO's sequence log-probs want."""
    span = max(1, chunk // h.shape[0])
    total = h.new_zeros(h.shape[0] if per_row else (), dtype=torch.float32)
    for i in range(0, h.shape[1], span):
        total = total + recompute(partial(_chunk_loss, per_row=per_row), h[:, i : i + span], weight,
                                  targets[:, i : i + span])
    return total


def _chunk_loss(h, weight, targets, per_row=False):
    logits = F.linear(h, weight).float().flatten(0, 1)  # (B * span, vocab)
    loss = F.cross_entropy(logits, targets.flatten(), ignore_index=-100, reduction="none" if per_row else "sum")
    return loss.view(targets.shape).sum(dim=1) if per_row else loss


DPO_LOSSES = ("sigmoid", "ipo", "hinge")


def dpo_loss(logps, ref_logps, n_tokens, beta, kind="sigmoid", sft_weight=0.0):
    """Preference loss over rows [chosen..., rejected...] (2B,): logps and ref_logps are each row's summed completion
    log-probs under the policy and the frozen reference, n_tokens its completion length. TRL 1.16's DPOTrainer
    formulas: the mean over the B pairs (ipo length-normalised as TRL does), plus sft_weight x the mean NLL of the
    chosen tokens (TRL's "sft" loss; LLaVA-NeXT's gamma). Returns (loss, metrics: means over the pairs, detached)."""
    chosen, rejected = logps.chunk(2)
    chosen_ratio, rejected_ratio = (chosen - ref_logps.chunk(2)[0]), (rejected - ref_logps.chunk(2)[1])
    n_chosen, n_rejected = n_tokens.chunk(2)
    # a pair the loader dropped has rows with no completion: it is left out of every mean (static shapes)
    real = ((n_chosen > 0) & (n_rejected > 0)).to(logps.dtype)
    mean = lambda x: (x * real).sum() / real.sum().clamp(min=1)  # noqa: E731
    delta = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif kind == "ipo":  # per-token log ratios, so beta means the same whatever the lengths
        losses = (chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo_loss {kind!r}: expected one of {DPO_LOSSES}")
    loss = mean(losses)
    if sft_weight:
        loss = loss + sft_weight * -chosen.sum() / n_chosen.sum().clamp(min=1)
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {"rewards/chosen": mean(chosen_reward), "rewards/rejected": mean(rejected_reward),
               "rewards/margins": mean(chosen_reward - rejected_reward),
               "rewards/accuracies": mean((chosen_reward > rejected_reward).to(logps.dtype)),  # strict, as TRL
               "logps/chosen": mean(chosen.detach()), "logps/rejected": mean(rejected.detach())}
    return loss, metrics


def reward_loss(rewards, n_tokens, margin=0.0, center_weight=0.0):
    """Bradley-Terry loss over rows [chosen..., rejected...] (2B,) of scalar rewards: -log sigmoid(r_c - r_r - margin),
    plus center_weight x (r_c + r_r)^2 (TRL's center_rewards_coefficient: keeps rewards near 0), the mean over the
    pairs. n_tokens (2B,) each row's completion length: a dropped pair (0) is left out. Returns (loss, metrics)."""
    chosen, rejected = rewards.float().chunk(2)
    n_chosen, n_rejected = n_tokens.chunk(2)
    real = ((n_chosen > 0) & (n_rejected > 0)).float()
    mean = lambda x: (x * real).sum() / real.sum().clamp(min=1)  # noqa: E731
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_weight:
        losses = losses + center_weight * (chosen + rejected) ** 2
    c, r = chosen.detach(), rejected.detach()
    metrics = {"reward/accuracy": mean((c > r).float()), "reward/margin": mean(c - r),
               "reward/chosen": mean(c), "reward/rejected": mean(r)}
    return mean(losses), metrics


GRPO_LOSSES = ("grpo", "dapo", "dr_grpo")
GRPO_SCALES = ("group", "batch", "none")


def group_advantages(rewards, group_size, scale="group", valid=None, batch_std=None):
    """GRPO's advantages over consecutive groups of group_size completions of a prompt: r - the group mean, divided by
    (std + 1e-4) as TRL 1.16's scale_rewards says: "group" the group's std (a group of equal rewards gets 0), "batch"
    the std of every reward given (valid (B,): only the rows with a prompt; batch_std: one computed over the whole
    generation batch, see rl.batch_std), "none" no division (Dr. GRPO). Every std is the unbiased one, as TRL's."""
    if scale not in GRPO_SCALES:
        raise ValueError(f"group_advantages scale {scale!r}: expected one of {GRPO_SCALES}")
    grouped = rewards.float().view(-1, group_size)  # (prompts, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.flatten()
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True)
    else:
        std = masked_std(rewards.float(), torch.ones_like(rewards.float()) if valid is None else valid.float()) \
            if batch_std is None else batch_std
    return (centred / (std + 1e-4)).flatten()


def masked_std(x, weights):
    """The unbiased std of the x whose weight is 1 (0 when fewer than two)."""
    n = weights.sum()
    mean = (x * weights).sum() / n.clamp(min=1)
    return (((x - mean) ** 2 * weights).sum() / (n - 1).clamp(min=1)).sqrt()


def grpo_loss(logps, old_logps, advantages, mask, kind="dapo", epsilon=0.2, epsilon_high=None, beta=0.0,
              ref_logps=None, n_tokens=None, max_completion_length=None, kl_correction=True):
    """The clipped policy loss of GRPO over completion tokens (B, C): logps under the policy being trained, old_logps
    under the policy that sampled them (the importance ratio), advantages (B,), mask (B, C) 1 at real completion
    tokens; beta > 0 adds the k3 KL estimate to ref_logps, times the ratio with kl_correction (TRL 1.16's default
    use_bias_correction_kl: the unbiased reverse-KL gradient off-policy). TRL 1.16's GRPOTrainer formulas: "grpo"
    the mean of each completion's token mean, "dapo" token sum / n_tokens (the generation batch's completion tokens;
    default this batch's), "dr_grpo" token sum / (B x max_completion_length). Returns (loss, metrics, detached)."""
    if kind not in GRPO_LOSSES:
        raise ValueError(f"grpo_loss {kind!r}: expected one of {GRPO_LOSSES}")
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    A = advantages[:, None].to(logps.dtype)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high))
    per_token = -torch.min(ratio * A, clipped * A)
    metrics = {}
    if beta:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # k3: unbiased, >= 0
        kl = kl * ratio if kl_correction else kl
        per_token = per_token + beta * kl
        metrics["kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
    if kind == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif kind == "dapo":
        loss = (per_token * mask).sum() / (mask.sum() if n_tokens is None else n_tokens).clamp(min=1)
    else:
        loss = (per_token * mask).sum() / (per_token.shape[0] * (max_completion_length or per_token.shape[1]))
    low, high = (ratio < 1 - epsilon) & (A < 0), (ratio > clipped) & (A > 0)  # where the clip stopped the gradient
    metrics["clip_ratio"] = ((low | high).to(mask.dtype) * mask).sum().detach() / mask.sum().clamp(min=1)
    return loss, metrics


# -----------------------------------------------------------------------------
# PPO over completion tokens (B, C), as EasyLM's llama_train_ppo and TRL <= 1.12's PPOTrainer compute it: the rollout's
# log-probs, reference log-probs and values fixed, mask (B, C) 1 at each completion's tokens (a prefix of its row)

KL_ESTIMATORS = ("k1", "k3")


def ppo_score(rewards, ended, gain=1.0, bias=0.0, missing_end_penalty=0.0):
    """Each completion's score (B,): gain x its reward (a reward model's or a rule's) + bias, minus missing_end_penalty
    where it has no end of turn (ended (B,) False). TRL subtracts its missing_eos_penalty so; EasyLM sets such a
    reward to -10 before gain and bias."""
    return gain * rewards.float() + bias - missing_end_penalty * (~ended.bool()).float()


def ppo_rewards(logps, ref_logps, scores, mask, kl_coef, estimator="k1"):
    """Per-token rewards (B, C): -kl_coef x the KL estimate to the reference at each completion token (k1: logp -
    ref_logp; k3: (rho - 1) - log rho, rho = p_ref / p: unbiased and >= 0), plus the score (B,) at the last token.
    Returns (rewards, kl), both 0 outside mask."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"ppo_rewards estimator {estimator!r}: expected one of {KL_ESTIMATORS}")
    mask = mask.float()
    log_rho = ref_logps.float() - logps.float()
    kl = (-log_rho if estimator == "k1" else (torch.exp(log_rho) - 1) - log_rho) * mask
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(dim=1)  # (B,)
    at_last = F.one_hot(last, mask.shape[1]).float() * mask  # (B, C); a row without completion tokens scores nowhere
    return -kl_coef * kl + scores.float()[:, None] * at_last, kl


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation: delta_t = r_t + gamma V_(t+1) - V_t, A_t = delta_t + gamma lam A_(t+1), with r
    and V 0 outside mask (after the last token the episode has ended: nothing to bootstrap). Returns (advantages,
    returns = A + V), 0 outside mask. One step a position from the end, as EasyLM and TRL: C ops, static shapes."""
    mask = mask.float()
    rewards, values = rewards.float() * mask, values.float() * mask
    next_value = next_advantage = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(values.shape[1])):
        next_advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        next_value = values[:, t]
        advantages.append(next_advantage)
    advantages = torch.stack(advantages[::-1], dim=1) * mask
    return advantages, advantages + values


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, moments=None):
    """(x - mean) / sqrt(var + eps) with the mean and unbiased variance of x where mask is 1 (one pair for the whole
    tensor: give it the whole rollout batch, or its moments, those of a batch held in parts: see rl.batch_moments), 0
    elsewhere; shift_mean=False adds the mean back (rewards keep their level). TRL's masked_whiten (eps 1e-8);
    EasyLM's whiten has eps 1e-6."""
    mask = mask.float()
    if moments is None:
        n = mask.sum()
        mean = (x * mask).sum() / n.clamp(min=1)
        var = ((x - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)
    else:
        mean, var = moments
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return (whitened if shift_mean else whitened + mean) * mask


def ppo_policy_loss(logps, old_logps, advantages, mask, clip=0.2, n_tokens=None):
    """PPO's clipped surrogate max(-A rho, -A clip(rho, 1 - clip, 1 + clip)), rho = exp(logps - old_logps), summed over
    mask and divided by n_tokens (default: this batch's tokens, a token mean). Metrics (token means, detached):
    policy_clipfrac, where the clipped term is the larger; approx_kl, 0.5 (logps - old_logps)^2."""
    mask = mask.float()
    log_rho = logps.float() - old_logps.float()
    rho = torch.exp(log_rho)
    unclipped, clipped = -advantages * rho, -advantages * torch.clamp(rho, 1 - clip, 1 + clip)
    loss = (torch.max(unclipped, clipped) * mask).sum() / (mask.sum().clamp(min=1) if n_tokens is None else n_tokens)
    token_mean = lambda x: (x.detach().float() * mask).sum() / mask.sum().clamp(min=1)  # noqa: E731
    return loss, {"policy_clipfrac": token_mean(clipped > unclipped), "approx_kl": token_mean(0.5 * log_rho**2)}


def ppo_value_loss(values, old_values, returns, mask, clip=0.2, n_tokens=None):
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) summed over mask, divided by n_tokens (default:
    this batch's tokens). Metric value_clipfrac: the share of tokens where the clipped term is the larger."""
    mask = mask.float()
    values = values.float()
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * (torch.max(unclipped_loss, clipped_loss) * mask).sum() / \
        (mask.sum().clamp(min=1) if n_tokens is None else n_tokens)
    return loss, {"value_clipfrac": ((clipped_loss > unclipped_loss).float() * mask).sum() / mask.sum().clamp(min=1)}


def ppo_loss(logps, old_logps, values, old_values, advantages, returns, mask, clip=0.2, clip_value=0.2, vf_coef=0.1,
             n_tokens=None):
    """The policy loss + vf_coef x the value loss (see ppo_policy_loss, ppo_value_loss), and their metrics."""
    policy, metrics = ppo_policy_loss(logps, old_logps, advantages, mask, clip, n_tokens)
    value, value_metrics = ppo_value_loss(values, old_values, returns, mask, clip_value, n_tokens)
    return policy + vf_coef * value, metrics | value_metrics | {"policy_loss": policy.detach(),
                                                                "value_loss": value.detach()}


def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over mask: 1 when the values predict the returns, <= 0 when no better than their mean."""
    mask = mask.float()
    var = lambda x: masked_std(x.float(), mask) ** 2  # noqa: E731
    return 1 - var(returns - values) / var(returns).clamp(min=1e-12)


# -----------------------------------------------------------------------------
# the VLM


class VLM(nn.Module):
    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = ViT(cfg.vision)
        self.projector = Projector(cfg.projector, cfg.vision.dim * len(cfg.vision_layers), cfg.llm.dim)
        self.llm = Llama(cfg.llm)
        # anyres / video: the learned embedding after each row of tiles' features (HF's image_newline)
        self.image_newline = nn.Parameter(torch.empty(cfg.llm.dim)) if cfg.anyres or cfg.video_token_id is not None \
            else None
        self.reward_head = nn.Linear(cfg.llm.dim, 1) if cfg.reward_head else None
        self.loss_chunk = 0  # > 0: the loss is computed this many positions at a time and forward returns no logits
        self.recompute = partial(checkpoint, use_reentrant=False)  # for the loss chunks; train.py sets torch_xla's on XLA
        if cfg.lora:
            apply_lora(self, cfg.lora)

    @torch.no_grad()
    def init_weights(self, seed=None):
        """Random init for a model built on the meta device and moved with to_empty()."""
        gen = None if seed is None else torch.Generator(device=self.llm.rope_cos.device).manual_seed(seed)
        # std 1/sqrt(fan_in) for matmuls: at small widths GPT-2's fixed 0.02 starves the attention of
        # signal, and a from-scratch VLM then takes hundreds of steps to start reading its image tokens
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                fan_in = module.weight[0].numel()
                nn.init.normal_(module.weight, std=fan_in**-0.5, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02, generator=gen)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2's scaled init for the projections that write into a residual stream
        for name, p in self.named_parameters():
            n_layers = self.cfg.vision.n_layers if name.startswith("vision.") else self.cfg.llm.n_layers
            if name.endswith(("attn.wo.weight", "mlp.c_proj.weight", "attention.wo.weight", "feed_forward.w2.weight")):
                p.mul_(1 / math.sqrt(2 * n_layers))
        if self.vision.class_embedding is not None:
            nn.init.normal_(self.vision.class_embedding, std=0.02, generator=gen)
        nn.init.normal_(self.vision.positional_embedding, std=0.02, generator=gen)
        if self.image_newline is not None:
            nn.init.normal_(self.image_newline, std=self.cfg.llm.dim**-0.5, generator=gen)  # HF's
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.reset_adapter(gen)
        self.llm.init_buffers()

    def encode_images(self, pixel_values):
        """(B, 3, H, W) or (B, n_images, 3, H, W) -> (B, n_images * n_image_tokens, llm dim)."""
        B = pixel_values.shape[0]
        images = pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values  # (B * n_images, 3, H, W)
        states = self.vision(images, self.cfg.vision_layers)
        if self.cfg.vision_select == "patch":
            states = [s[:, 1:] for s in states]  # drop CLS
        features = self.projector(torch.cat(states, dim=-1))  # (B * n_images, n_image_tokens, D)
        return features.reshape(B, -1, features.shape[-1])  # (B, n_images * n_image_tokens, D)

    def embed(self, input_ids, pixel_values=None, packed=False):
        """Token embeddings with image features written over the image placeholders.

        Unpacked, row b's k-th placeholder takes feature k of row b's images (a row with no placeholders
        ignores its dummy image). Packed, pixel_values is (N, 3, H, W) in the order the placeholders appear in
        the flattened batch (HF's convention), unused images at the end. Slots come from a cumulative count,
        so shapes stay static: no boolean-mask assignment, no loop over the batch."""
        is_image = input_ids == self.cfg.image_token_id
        h = self.llm.tok_embeddings(torch.where(is_image, 0, input_ids))  # the image id may lie outside the vocab
        if pixel_values is None:
            return h
        B, T, D = h.shape
        features = self.encode_images(pixel_values).to(h.dtype)  # (B, S, D)
        if not packed:
            features = pair_rows(features, B)
        if packed:
            features, is_image, h = features.reshape(1, -1, D), is_image.reshape(1, -1), h.reshape(1, -1, D)  # one row
        slot = (is_image.long().cumsum(dim=1) - 1).clamp(0, features.shape[1] - 1)  # (B, T)
        placed = torch.gather(features, 1, slot[..., None].expand(-1, -1, D))  # (B, T, D)
        return torch.where(is_image[..., None], placed, h).reshape(B, T, D)

    def place_features(self, input_ids, pixel_values, image_index, image_weight):
        """Token embeddings with placeholder t of row b = sum_k image_weight[b, t, k] * table[b, image_index[b, t, k]],
        table = [image_newline, the row's n_slots * P projected tile features] (see image_layout, place_images).
        pixel_values (B, n_slots, 3, S, S); unpadding, OneVision's reduction and video pooling act on projected
        features, as in HF. Static shapes: a gather per tap, whatever the images."""
        is_image = input_ids == self.cfg.image_token_id
        if self.cfg.video_token_id is not None:
            is_image = is_image | (input_ids == self.cfg.video_token_id)
        h = self.llm.tok_embeddings(torch.where(is_image, 0, input_ids))  # (B, T, D)
        B, T, D = h.shape
        features = h.new_zeros(B, 0, D) if pixel_values is None else self.encode_images(pixel_values).to(h.dtype)
        features = pair_rows(features, B)
        newline = features.new_zeros(D) if self.image_newline is None else self.image_newline.to(h.dtype)
        table = torch.cat([newline.expand(B, 1, D), features], dim=1)  # (B, 1 + n_slots * P, D)
        placed = torch.zeros_like(h)
        for k in range(image_index.shape[-1]):
            tap = torch.gather(table, 1, image_index[..., k, None].expand(-1, -1, D))  # (B, T, D)
            placed = placed + image_weight[..., k, None].to(h.dtype) * tap
        return torch.where(is_image[..., None], placed, h)

    def forward(self, input_ids, pixel_values=None, labels=None, loss_reduction="mean", position_ids=None,
                image_index=None, image_weight=None, attention_mask=None, reward=False, logits_to_keep=0,
                values=False):
        """Logits (B, T, vocab) and, with labels aligned to input_ids (-100 = ignore), the next-token loss: the mean
        over supervised tokens, their sum with loss_reduction="sum" (train.py divides by a global count), each
        row's sum (B,) with "row" (DPO), or per position (B, T) with "none". position_ids (B, T) packs several
        samples into a row (see Llama.forward).
        image_index, image_weight (B, T, taps): tiled images, several a row (see place_features).
        attention_mask (B, T), 0 at padding on either side (positions count from each row's first real token);
        reward=True returns (None, rewards (B,)): the reward head read at each row's last real token; values=True
        (PPO's value model) returns (None, values (B, T)): the same head read at every position (the last
        logits_to_keep > 0 only).
        logits_to_keep > 0 (no labels): only the last logits_to_keep positions' logits, as HF's (RL: a completion's)."""
        packed = position_ids is not None
        if image_index is None:
            h = self.embed(input_ids, pixel_values, packed)
        else:
            h = self.place_features(input_ids, pixel_values, image_index, image_weight)
        h = self.llm(h, position_ids=position_ids, pad=None if attention_mask is None else attention_mask == 0)
        if reward:
            return None, self.read_reward(h, attention_mask)
        if values:
            return None, self.read_values(h[:, -logits_to_keep:] if logits_to_keep else h)
        if labels is None:
            return self.llm.output(h[:, -logits_to_keep:] if logits_to_keep else h), None
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T): position t predicts token t + 1
        if packed:  # the last token of a sample does not predict the first of the next
            targets = targets.masked_fill(F.pad(position_ids[:, 1:], (0, 1), value=0) == 0, -100)
        if self.loss_chunk and loss_reduction in ("sum", "row"):
            return None, chunked_cross_entropy(h, self.llm.output.weight, targets, self.loss_chunk, self.recompute,
                                               per_row=loss_reduction == "row")
        logits = self.llm.output(h)
        reduction = "none" if loss_reduction == "row" else loss_reduction
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
        if loss_reduction == "row":
            return logits, loss.view(targets.shape).sum(dim=1)
        return logits, loss.view(targets.shape) if loss_reduction == "none" else loss

    def read_reward(self, h, attention_mask):
        """The reward head at each row's last real token (the last 1 of attention_mask, whichever side is padded)."""
        if self.reward_head is None:
            raise ValueError("forward(reward=True) needs a model built with reward_head=True")
        T = h.shape[1]
        last = (torch.arange(T, device=h.device) * attention_mask).amax(dim=1) if attention_mask is not None else \
            torch.full(h.shape[:1], T - 1, device=h.device)  # (B,)
        return self.reward_head(h[torch.arange(h.shape[0], device=h.device), last]).squeeze(-1).float()  # (B,)

    def read_values(self, h):
        """A value model's estimate at every position (B, T): the reward head of the reward-model checkpoint it starts
        from (as EasyLM, TRL and LLaVA-RLHF initialise it) read at each token instead of the last."""
        if self.reward_head is None:
            raise ValueError("forward(values=True) needs a model built with reward_head=True (a reward-model checkpoint)")
        return self.reward_head(h).squeeze(-1).float()

    @torch.no_grad()
    def generate(self, input_ids, pixel_values=None, max_new_tokens=32, temperature=0.0, top_p=1.0,
                 eos_id=None, generator=None, attention_mask=None, image_index=None, image_weight=None, suppress=None,
                 static=False, after_token=None):
        """New tokens (B, <= max_new_tokens) after the prompts; greedy when temperature == 0. Prompts of
        different lengths come left-padded with attention_mask (B, T) 0 at the padding (see left_pad), as
        HF's generate takes them. Rows that reached eos_id keep emitting eos_id until every row has.
        suppress (vocab,) bool: tokens never sampled (RL: the image placeholder, as TRL's GRPOTrainer does).
        static=True keeps every shape fixed and the host out of the loop, so XLA compiles a rollout once: always
        max_new_tokens steps, each decode step one graph (the cache slot in a tensor), and draws from hashed noise
        seeded by generator (race_noise: the same tokens on every device). after_token() runs after the prefill and
        each step (XLA: cut the graph there)."""
        B, T = input_ids.shape
        if image_index is None:
            h = self.embed(input_ids, pixel_values)
        else:
            h = self.place_features(input_ids, pixel_values, image_index, image_weight)
        pad = None
        if static:
            if T + max_new_tokens > self.cfg.llm.max_seq_len:
                raise ValueError(f"generate: {T} prompt + {max_new_tokens} new tokens exceed max_seq_len="
                                 f"{self.cfg.llm.max_seq_len}")
            attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        elif attention_mask is not None and bool(((attention_mask[:, -1] == 0) & (attention_mask == 1).any(1)).any()):
            raise ValueError("generate: attention_mask has padding at the end of a row; pad prompts on the left")
        if attention_mask is not None:
            pad = F.pad(attention_mask == 0, (0, max_new_tokens), value=False)  # (B, T + max_new_tokens)
        cache = KVCache(self.cfg.llm, B, T + max_new_tokens, h.dtype, h.device)
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        if attention_mask is not None and eos_id is not None:  # a row of padding alone (RL: no prompt) is done
            done = attention_mask.sum(1) == 0
        slot = torch.tensor([T], device=input_ids.device) if static else T  # the next token's cache slot
        seed = None
        if static and temperature > 0:
            seed = torch.randint(2**31 - 1, (), generator=generator, device=generator.device if generator else "cpu")
            seed = seed.to(input_ids.device)
        logits = self.llm.output(self.llm(h, cache, 0, pad=None if pad is None else pad[:, :T])[:, -1])  # (B, vocab)
        if after_token:
            after_token()
        out = []
        for i in range(max_new_tokens):
            if suppress is not None:
                logits = logits.masked_fill(suppress, float("-inf"))
            noise = None if seed is None else race_noise(seed, slot, logits.shape)
            token = sample_token(logits, temperature, top_p, generator, noise)  # (B,)
            if eos_id is not None:
                token = torch.where(done, eos_id, token)
                done = done | (token == eos_id)
            out.append(token)
            if (not static and eos_id is not None and bool(done.all())) or i == max_new_tokens - 1:
                break
            h = self.llm.tok_embeddings(token[:, None])  # (B, 1, D)
            seen = pad if static or pad is None else pad[:, : slot + 1]
            logits = self.llm.output(self.llm(h, cache, slot, pad=seen)[:, -1])
            slot = slot + 1
            if after_token:
                after_token()
        return torch.stack(out, dim=1)


def pair_rows(features, n_rows):
    """Image features (B, S, D) for 2B rows [chosen..., rejected...] (DPO): both rows of a pair read the pair's
    features, so the ViT runs once a pair."""
    return features.repeat(2, 1, 1) if n_rows == 2 * features.shape[0] else features


def param_group(name):
    """The part a parameter trains with: "vision", "projector" or "llm". image_newline goes with the LLM, as
    LLaVA-NeXT's train.py unfreezes it (mm_tunable_parts "mm_language_model": all but vision tower and projector).
    A reward model's head trains at the LLM's learning rate."""
    return "llm" if name == "image_newline" or name.startswith("reward_head.") else name.split(".")[0]


def left_pad(prompts, pad_id=0, length=None):
    """Token id lists of different lengths -> input_ids (B, T) padded on the left and attention_mask (B, T); T is the
    longest prompt, or length (a fixed bucket) when given."""
    T = length or max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hash32(x):
    """A 32-bit integer mix (int64 tensors; every product stays below 2**63): counter-based random numbers."""
    x = x & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def race_noise(seed, slot, shape):
    """Exp(1) draws (B, vocab) hashed from (seed, slot, row, token): no generator state on the device, the same numbers
    on CPU, CUDA and XLA (whose RNGs differ), and seed and slot are tensors, so every step is the same graph."""
    rows = torch.arange(shape[0], device=seed.device)[:, None]
    tokens = torch.arange(shape[1], device=seed.device)[None, :]
    bits = hash32(hash32(hash32(seed + slot) + rows) + tokens) >> 8  # (B, vocab), 24 bits: exact in float32
    return -torch.log((bits.float() + 0.5) / 2**24)


def sample_token(logits, temperature, top_p, generator=None, noise=None):
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if noise is not None:  # the exponential race: argmax p_i / E_i over iid E_i ~ Exp(1) is a draw from p
        return (probs / noise).argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def build_model(cfg: VLMConfig, device="cpu", seed=None, init=True):
    """Build on the meta device, materialise on `device`, then one init pass (buffers only if init=False)."""
    with torch.device("meta"):
        model = VLM(cfg)
    model.to_empty(device=device)
    if cfg.llm.tie_embeddings:  # to_empty replaces parameters one by one, which unties them
        model.llm.output.weight = model.llm.tok_embeddings.weight
    if init:
        model.init_weights(seed)
    else:
        model.llm.init_buffers()
    return model
