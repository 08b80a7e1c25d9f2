"""
The LLaVA-style vision-language model in one file: a ViT (CLIP, SigLIP or InternViT), a connector (an optional pixel
shuffle or average pool, then the projector: LLaVA's, InternVL's, Idefics3's or Gemma 3's) and LLaMA with the decoder
families' switches, its attention causal or with blocks of tokens that see each other both ways (Gemma 3's images).

No device, distributed or file code lives here (see STYLE.md); train.py and convert.py
do that. Parameter names follow OpenAI CLIP for the ViT and Meta's reference model.py for
LLaMA; Hugging Face names exist only in hf_names.py's tables. The configs and named presets the
modules are built from live in model_config.py; the post-training losses in losses.py; the blockwise
attention (what Llama.attention_kernel may run in place of SDPA) in attention.py.
"""

import math
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from lora import LoRALinear, apply_lora
from model_config import MLP_ACTIVATIONS, VIT_ACTIVATIONS, LlamaConfig, ViTConfig, VLMConfig, projector_parts

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
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=cfg.qkv_bias)
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
        scaled = cfg.kind == "internvit"  # layer scale: each branch times a learned per-channel gain before its add
        self.ls_1 = nn.Parameter(torch.empty(cfg.dim)) if scaled else None
        self.ls_2 = nn.Parameter(torch.empty(cfg.dim)) if scaled else None

    def forward(self, x):
        h = self.attn(self.ln_1(x))
        x = x + (h if self.ls_1 is None else self.ls_1 * h)
        h = self.mlp(self.ln_2(x))
        return x + (h if self.ls_2 is None else self.ls_2 * h)


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        clip = cfg.kind == "clip"  # SigLIP: no class token, no pre-LayerNorm, a bias on the patch conv; InternViT:
        # CLIP's class token, SigLIP's conv bias and no pre-LayerNorm
        self.conv1 = nn.Conv2d(3, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=not clip)
        self.class_embedding = nn.Parameter(torch.empty(cfg.dim)) if cfg.kind != "siglip" else None
        self.positional_embedding = nn.Parameter(torch.empty(cfg.n_positions, cfg.dim))
        self.ln_pre = LayerNorm(cfg.dim, eps=cfg.norm_eps) if clip else nn.Identity()
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.n_layers))
        # ln_post feeds the pooled output (CLIP's) or the last hidden state (SigLIP's); LLaVA reads neither, Idefics3
        # reads SigLIP's (VLMConfig.vision_post_norm); kept either way so checkpoints round-trip whole
        self.ln_post = LayerNorm(cfg.dim, eps=cfg.norm_eps) if cfg.post_norm else None
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
    """LLaVA's mm_projector: Linear, then (GELU, Linear) N-1 times. GELU is exact erf. InternVL's LayerNorm first
    (eps 1e-5, nn.LayerNorm's), Idefics3's one Linear without a bias, Gemma 3's RMSNorm (1 + w, the tower's eps) before
    one: model_config.projector_parts."""

    def __init__(self, kind, in_dim, out_dim, eps=1e-6):
        super().__init__()
        norm, depth, bias = projector_parts(kind)
        self.norm = LayerNorm(in_dim, eps=1e-5) if norm == "ln" else RMSNorm(in_dim, eps, offset=1.0) if norm else None
        self.fc = nn.ModuleList(nn.Linear(in_dim if i == 0 else out_dim, out_dim, bias=bias) for i in range(depth))

    def forward(self, x):
        x = self.fc[0](x if self.norm is None else self.norm(x))
        for fc in self.fc[1:]:
            x = fc(F.gelu(x))
        return x


# -----------------------------------------------------------------------------
# LLaMA


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, offset=0.0):
        super().__init__()
        self.eps, self.offset = eps, offset  # offset: scale by (offset + w) (Gemma's, stored as w)
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in fp32, then casts
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)  # Llama casts back before the scale, as HF and Meta do


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
        if cfg.qk_norm:  # over each head's features (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset)
        in_window = cfg.sliding_layers is None or layer_id in cfg.sliding_layers
        self.window = cfg.sliding_window if in_window else None
        self.rope = layer_id not in (cfg.no_rope_layers or ())
        self.scale, self.softcap = cfg.query_scale or cfg.head_dim**-0.5, cfg.attn_softcap

    def forward(self, x, cos, sin, cache=None, start_pos=0, mask=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        if self.rope:  # in the tables' precision, as HF; then v's dtype (XLA's autocast does not cast SDPA's inputs)
            q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        if isinstance(mask, BlockMask):  # packed rows on CUDA: FlexAttention skips the masked blocks
            if self.window:
                raise ValueError("FlexAttention packing with a sliding window is not implemented; train unpacked")
            cap = self.softcap
            capped = (lambda score, b, h, q_at, kv_at: cap * torch.tanh(score / cap)) if cap else None
            y = flex_attention(q, k, v, score_mod=capped, block_mask=mask, scale=self.scale,
                               enable_gqa=self.n_heads != self.n_kv_heads)
            return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)
        if callable(mask):  # the backend's attention (Llama.attention_kernel), each row's segment ids bound in
            # scale and softcap only where a family sets them: a kernel of (q, k, v, segments, window) still fits
            extra = {"scale": self.scale} if self.scale != self.head_dim**-0.5 else {}
            y = mask(q, k, v, window=self.window, **extra | ({"softcap": self.softcap} if self.softcap else {}))
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
            # query t sits at start_pos + t and sees every key up to there; a given mask (B, 1, T, end) is whole (Llama's:
            # causal, padding and the prefill's blocks, which see later keys of their own block)
            seen = torch.arange(end, device=x.device)[None, :] <= torch.arange(start_pos, end, device=x.device)[:, None]
            mask, causal = seen if mask is None else mask, False
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
        if self.softcap:
            y = capped_attention(q, k, v, mask, causal, self.scale, self.softcap)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


def capped_attention(q, k, v, mask, causal, scale, cap):
    """SDPA with the scores soft-capped, cap * tanh(scores / cap), before the mask (Gemma 2), as HF's eager path: the
    probabilities in fp32, then q's dtype. mask (..., T, S) True where a query sees a key."""
    scores = q @ k.transpose(-1, -2) * scale  # (B, H, T, S)
    scores = cap * torch.tanh(scores / cap)
    if causal:  # the last T of S positions are the queries
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v  # (B, H, T, hd)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.act = MLP_ACTIVATIONS[cfg.mlp_act]

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.feed_forward = FeedForward(cfg)
        if cfg.sandwich_norms:  # Gemma: each branch's output normed too, before its residual add
            self.attention_post_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
            self.ffn_post_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)

    def forward(self, x, cos, sin, cache=None, start_pos=0, mask=None):
        h = self.attention(self.attention_norm(x), cos, sin, cache, start_pos, mask)
        x = x + (self.attention_post_norm(h) if hasattr(self, "attention_post_norm") else h)
        h = self.feed_forward(self.ffn_norm(x))
        return x + (self.ffn_post_norm(h) if hasattr(self, "ffn_post_norm") else h)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # real cos/sin tables (no complex dtypes: XLA handles them poorly); rebuilt by init_buffers
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        if cfg.local_rope_theta:  # the sliding-window layers' own tables (Gemma 3: base 10k, unscaled)
            self.register_buffer("local_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("local_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.checkpoint = None  # checkpoint(fn, *args): recompute each block in backward (train.py sets torch's or XLA's)
        self.flex_attention = False  # packed rows through FlexAttention (CUDA, compiled blocks) rather than a dense mask
        # f(q, k, v, segments, window) -> (B, H, T, hd) in place of SDPA outside generation: the backend's bounded-memory
        # attention (attention.blockwise_attention, or a TPU kernel), given segment ids rather than a (B, 1, T, T) mask
        self.attention_kernel = None

    def init_buffers(self):
        tables = [(rope_frequencies(self.cfg), self.rope_cos, self.rope_sin)]
        if self.cfg.local_rope_theta:
            local = rope_frequencies(replace(self.cfg, rope_theta=self.cfg.local_rope_theta, rope_scaling=None))
            tables.append((local, self.local_cos, self.local_sin))
        for inv_freq, cos, sin in tables:
            t = torch.arange(self.cfg.max_seq_len, dtype=torch.float32, device=cos.device)
            freqs = torch.outer(t, inv_freq.to(cos.device))  # (max_seq_len, head_dim / 2)
            emb = torch.cat([freqs, freqs], dim=-1)  # (max_seq_len, head_dim)
            cos.copy_(emb.cos())
            sin.copy_(emb.sin())

    def embed_tokens(self, ids):
        h = self.tok_embeddings(ids)
        # Gemma: times sqrt(dim) rounded to the embeddings' dtype, as HF's scaled embedding (image features are not)
        return h * torch.tensor(self.cfg.dim**0.5, dtype=h.dtype) if self.cfg.embed_scale else h

    def logits(self, h):
        logits = self.output(h)
        cap = self.cfg.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def forward(self, h, cache=None, start_pos=0, position_ids=None, pad=None, blocks=None):
        """Embeddings (B, T, D) in, final-normed hidden states (B, T, D) out; self.output makes logits.

        position_ids (B, T) marks packed rows: a new sample starts wherever the position is 0, and no
        sample attends to another (tokens after the last sample form one more, unsupervised, sample).
        pad (B, start_pos + T), True at left padding (generation): no query attends a padded key, and
        positions count from each row's first real token, as HF derives them from the attention mask.
        Static decoding (generate(static=True)): start_pos a (1,) tensor, T = 1, pad (B, the cache's max_len).
        blocks (B, T), from position 0 (a whole sequence or a prefill): tokens of one block id >= 0 see each other both
        ways (Gemma 3's images), -1 only what causal attention sees; the sliding window and the samples still bound it."""
        T, static = h.shape[1], torch.is_tensor(start_pos)
        if not static and start_pos + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        if blocks is not None and (static or start_pos):
            raise ValueError("blocks cover a sequence from its first token (a prefill), not a decode step")
        mask, kernel, doc = None, self.attention_kernel if cache is None and pad is None else None, None
        if pad is not None:
            positions = ((~pad).long().cumsum(dim=1) - 1).clamp(min=0)
            positions = positions.index_select(1, start_pos) if static else positions[:, start_pos:]  # (B, T)
            at = lambda table: table[positions].to(h.dtype)[:, None]  # noqa: E731  (B, 1, T, hd)
            # causal; a padded query sees only itself (a row with every key masked would make SDPA return NaN)
            key_at = torch.arange(pad.shape[1], device=h.device)
            query_at = (start_pos if static else torch.arange(start_pos, start_pos + T, device=h.device))[:, None]
            mask = ((~pad[:, None, None, :]) | (key_at == query_at)) & (key_at <= query_at)  # (B, 1, T, start_pos + T)
        elif position_ids is None:
            at = lambda table: table[start_pos : start_pos + T].to(h.dtype)  # noqa: E731  (T, hd)
        else:
            at = lambda table: table[position_ids].to(h.dtype)[:, None]  # noqa: E731  (B, 1, T, hd)
            doc = (position_ids == 0).cumsum(dim=1)  # (B, T) numbers the samples along each row
            mask = doc if kernel else self.document_mask(doc, blocks)
        if kernel:
            mask = partial(kernel, segments=mask) if blocks is None else partial(kernel, segments=mask, blocks=blocks)
        elif blocks is not None and not isinstance(mask, BlockMask):  # OR'ed with what causal attention sees
            both_ways = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)  # (B, T, T)
            if doc is not None:
                both_ways = both_ways & (doc[:, :, None] == doc[:, None, :])
            seen = torch.ones(T, T, dtype=torch.bool, device=h.device).tril() if mask is None else mask
            mask = seen | both_ways[:, None]  # (B, 1, T, T); Attention ANDs the sliding window
        cos, sin = at(self.rope_cos), at(self.rope_sin)
        local = (at(self.local_cos), at(self.local_sin)) if self.cfg.local_rope_theta else (cos, sin)
        for layer in self.layers:
            c, s = local if layer.attention.window else (cos, sin)
            if self.checkpoint and self.training:
                h = self.checkpoint(layer, h, c, s, None, 0, mask)
            else:
                h = layer(h, c, s, cache, start_pos, mask)
        return self.norm(h)

    def document_mask(self, doc, blocks=None):
        """Causal attention within each sample of a packed row; doc (B, T) numbers the samples along the row. FlexAttention
        reads blocks (B, T) here too (see forward); the dense mask gets them in forward."""
        B, T = doc.shape
        if self.flex_attention and blocks is not None:
            def seen(b, h, q, kv):
                return (doc[b, q] == doc[b, kv]) & ((q >= kv) | ((blocks[b, q] == blocks[b, kv]) & (blocks[b, q] >= 0)))
            return create_block_mask(seen, B, None, T, T, device=doc.device)
        if self.flex_attention:
            same_doc = lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)  # noqa: E731
            return create_block_mask(same_doc, B, None, T, T, device=doc.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
        return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T): static, XLA compiles it


def chunked_cross_entropy(h, weight, targets, chunk, recompute, per_row=False, softcap=None):
    """Summed token losses of logits = h @ weight.T, about `chunk` positions at a time: the same span of every row,
    so a batch-sharded h stays sharded (XLA all-gathered a slice of the flattened batch). Each chunk's logits are
    recomputed in backward, so the full fp32 (B*T, vocab) logits never exist (2.1 GB at 8 x 2048 x 32k).
    per_row: each row's sum (B,), as DPO's sequence log-probs want. softcap: the logits' (Llama.logits)."""
    span = max(1, chunk // h.shape[0])
    total = h.new_zeros(h.shape[0] if per_row else (), dtype=torch.float32)
    for i in range(0, h.shape[1], span):
        total = total + recompute(partial(_chunk_loss, per_row=per_row, softcap=softcap), h[:, i : i + span], weight,
                                  targets[:, i : i + span])
    return total


def _chunk_loss(h, weight, targets, per_row=False, softcap=None):
    logits = F.linear(h, weight)
    logits = (softcap * torch.tanh(logits / softcap) if softcap else logits).float().flatten(0, 1)  # (B * span, vocab)
    loss = F.cross_entropy(logits, targets.flatten(), ignore_index=-100, reduction="none" if per_row else "sum")
    return loss.view(targets.shape).sum(dim=1) if per_row else loss


# -----------------------------------------------------------------------------
# the VLM


class VLM(nn.Module):
    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = ViT(cfg.vision)
        in_dim = cfg.vision.dim * len(cfg.vision_layers) * cfg.pixel_shuffle**2
        self.projector = Projector(cfg.projector, in_dim, cfg.llm.dim, cfg.vision.norm_eps)
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
                nn.init.constant_(module.weight, 1.0 - getattr(module, "offset", 0.0))  # a scale of 1
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
        for block in self.vision.blocks:
            if block.ls_1 is not None:  # InternViT's layer_scale_init_value
                nn.init.constant_(block.ls_1, 0.1)
                nn.init.constant_(block.ls_2, 0.1)
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.reset_adapter(gen)
        self.llm.init_buffers()

    def encode_images(self, pixel_values):
        """(B, 3, H, W) or (B, n_images, 3, H, W) -> (B, n_images * n_image_tokens, llm dim)."""
        B = pixel_values.shape[0]
        images = pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values  # (B * n_images, 3, H, W)
        states = self.vision(images, self.cfg.vision_layers)
        if self.cfg.vision_post_norm:
            states = [self.vision.ln_post(s) for s in states]
        if self.cfg.vision_select == "patch":
            states = [s[:, 1:] for s in states]  # drop CLS
        features = torch.cat(states, dim=-1)  # (B * n_images, n_read, C)
        if self.cfg.pixel_shuffle > 1:
            features = pixel_shuffle(features, self.cfg.pixel_shuffle)
        if self.cfg.pool > 1:
            features = average_pool(features, self.cfg.pool)
        features = self.projector(features)  # (B * n_images, n_image_tokens, D)
        return features.reshape(B, -1, features.shape[-1])  # (B, n_images * n_image_tokens, D)

    def embed(self, input_ids, pixel_values=None, packed=False):
        """Token embeddings with image features written over the image placeholders.

        Unpacked, row b's k-th placeholder takes feature k of row b's images (a row with no placeholders
        ignores its dummy image). Packed, pixel_values is (N, 3, H, W) in the order the placeholders appear in
        the flattened batch (HF's convention), unused images at the end. Slots come from a cumulative count,
        so shapes stay static: no boolean-mask assignment, no loop over the batch."""
        is_image = input_ids == self.cfg.image_token_id
        h = self.llm.embed_tokens(torch.where(is_image, 0, input_ids))  # the image id may lie outside the vocab
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
        h = self.llm.embed_tokens(torch.where(is_image, 0, input_ids))  # (B, T, D)
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
        h = self.llm(h, position_ids=position_ids, pad=None if attention_mask is None else attention_mask == 0,
                     blocks=self.attention_blocks(input_ids, position_ids))
        if reward:
            return None, self.read_reward(h, attention_mask)
        if values:
            return None, self.read_values(h[:, -logits_to_keep:] if logits_to_keep else h)
        if labels is None:
            return self.llm.logits(h[:, -logits_to_keep:] if logits_to_keep else h), None
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T): position t predicts token t + 1
        if packed:  # the last token of a sample does not predict the first of the next
            targets = targets.masked_fill(F.pad(position_ids[:, 1:], (0, 1), value=0) == 0, -100)
        if self.loss_chunk and loss_reduction in ("sum", "row"):
            return None, chunked_cross_entropy(h, self.llm.output.weight, targets, self.loss_chunk, self.recompute,
                                               per_row=loss_reduction == "row", softcap=self.cfg.llm.final_softcap)
        logits = self.llm.logits(h)
        reduction = "none" if loss_reduction == "row" else loss_reduction
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
        if loss_reduction == "row":
            return logits, loss.view(targets.shape).sum(dim=1)
        return logits, loss.view(targets.shape) if loss_reduction == "none" else loss

    def attention_blocks(self, input_ids, position_ids=None):
        """Block ids (B, T) for Llama.forward, or None (causal): with attention_blocks "images", each run of image
        placeholders is a block (0, 1, ... along the row; a packed sample's first token starts a new one), text -1.
        HF's Gemma 3 makes the same from token_type_ids (its get_block_sequence_ids_for_mask). A cumulative count:
        no loop over the batch, no nonzero."""
        if not self.cfg.attention_blocks:
            return None
        is_image = input_ids == self.cfg.image_token_id
        starts = is_image & ~F.pad(is_image, (1, 0), value=False)[:, :-1]  # (B, T): an image token after a text one
        if position_ids is not None:
            starts = starts | (is_image & (position_ids == 0))
        return torch.where(is_image, starts.long().cumsum(dim=1) - 1, -1)  # (B, T)

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
                 static=False, after_token=None, stop_every=0):
        """New tokens (B, <= max_new_tokens) after the prompts; greedy when temperature == 0. Prompts of
        different lengths come left-padded with attention_mask (B, T) 0 at the padding (see left_pad), as
        HF's generate takes them. Rows that reached eos_id keep emitting eos_id until every row has.
        suppress (vocab,) bool: tokens never sampled (RL: the image placeholder, as TRL's GRPOTrainer does).
        static=True keeps every shape fixed and the host out of the loop, so XLA compiles a rollout once: always
        max_new_tokens steps, each decode step one graph (the cache slot in a tensor), and draws from hashed noise
        seeded by generator (race_noise: the same tokens on every device). after_token() runs after the prefill and
        each step (XLA: cut the graph there). stop_every > 0 (static): every that many tokens the host asks whether
        every row has ended, and the loop stops there (one sync, no new graph for the steps)."""
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
        # the prompt with its blocks; the new tokens decode causally, as HF's generate (no token_type_ids after the first)
        h = self.llm(h, cache, 0, pad=None if pad is None else pad[:, :T], blocks=self.attention_blocks(input_ids))
        logits = self.llm.logits(h[:, -1])  # (B, vocab)
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
            ask = not static or (stop_every and (i + 1) % stop_every == 0)  # static: the host asks only now and then
            if (ask and eos_id is not None and bool(done.all())) or i == max_new_tokens - 1:
                break
            h = self.llm.embed_tokens(token[:, None])  # (B, 1, D)
            seen = pad if static or pad is None else pad[:, : slot + 1]
            logits = self.llm.logits(self.llm(h, cache, slot, pad=seen)[:, -1])
            slot = slot + 1
            if after_token:
                after_token()
        return torch.stack(out, dim=1)


def pixel_shuffle(x, factor):
    """(N, side * side, C) -> (N, side * side / factor**2, factor**2 * C): each factor x factor block of the square
    feature map becomes one token, its features in row-major order of the block, the tokens in row-major order of
    the blocks (Idefics3's and InternVL's pixel shuffle, a space-to-depth)."""
    N, T, C = x.shape
    n = math.isqrt(T) // factor  # blocks a side
    x = x.view(N, n, factor, n, factor, C)  # (N, block row, row in block, block col, col in block, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(N, n * n, factor * factor * C)  # (N, n_blocks, factor**2 * C)


def average_pool(x, factor):
    """(N, side * side, C) -> (N, side * side / factor**2, C): each factor x factor block of the square feature map
    averaged into one token, the tokens in row-major order of the blocks (Gemma 3's AvgPool2d over the patch map)."""
    N, T, C = x.shape
    n = math.isqrt(T) // factor  # blocks a side
    x = x.view(N, n, factor, n, factor, C)  # (N, block row, row in block, block col, col in block, C)
    return x.mean(dim=(2, 4)).reshape(N, n * n, C)  # (N, n_blocks, C)


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
