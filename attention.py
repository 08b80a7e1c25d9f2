"""
Blockwise attention: softmax(q k^T) v over key/value blocks with an online softmax, as FlashAttention computes it, so
no T x T scores exist. XLA has no fused kernel behind SDPA: it materialises the scores (28 heads x 8,759 tokens in fp32
is 8.6 GB a layer a row) and packed rows add a dense (B, 1, T, T) mask. Here the memory grows linearly in T: one
(B, H, T, block) tile at a time, forward and backward.

What Llama.attention_kernel calls in place of SDPA on every device; parallel.py chooses the scan (a Python loop, or
torch_xla's compiled one) and holds torch_xla's Pallas kernels. Like model.py: no device or distributed code.
"""

from functools import partial

import torch
import torch.nn.functional as F

MASKED = -1e30  # a masked score: finite, so a block where a query sees no key makes no NaN


def loop_scan(fn, init, xs):
    """torch_xla's scan(fn, init, xs) as a Python loop: the carry through fn over the leading dimension of each of
    the tuple xs, and fn's outputs stacked."""
    carry, ys = init, []
    for i in range(len(xs[0])):
        carry, y = fn(carry, tuple(x[i] for x in xs))
        ys.append(y)
    return carry, tuple(torch.stack(column) for column in zip(*ys))


def blockwise_attention(q, k, v, segments=None, window=None, block=512, scan=loop_scan, scale=None, softcap=None,
                        blocks=None):
    """Causal attention, equal to SDPA's: q (B, H, T, hd), k and v (B, Hkv, T, hd) with H a multiple of Hkv (GQA);
    segments (B, T) numbers the samples of packed rows (a query sees only its own sample's keys); window: a query
    sees the `window` keys up to itself (Qwen2's sliding window); scale: the scores' (None: hd ** -0.5); softcap: the
    scores become softcap * tanh(scores / softcap) (Gemma 2); blocks (B, T): tokens of one block id >= 0 see each other
    both ways, later keys of the block too (Gemma 3's images; the window still bounds the earlier ones). Keys are
    visited `block` at a time (T need not be
    a multiple); scan(fn, init, xs) runs the loop: torch_xla's compiles it to one XLA While, so the program's size
    does not grow with T. Backward recomputes each block's scores from the saved log-sum-exp. Every block is computed,
    masked or not (static shapes): twice the FLOPs of a kernel that skips them, as the Pallas ones do."""
    return BlockwiseAttention.apply(q, k, v, segments, window, min(block, q.shape[2]), scan, scale, softcap, blocks)


def _visible(q_seg, q_at, k_seg, k_at, window, q_blk, k_blk, blocked):
    """(B, 1, R, block): query r sees key j in its own sample, at or before it (or in its block), fewer than `window`
    positions back."""
    back = q_at[:, None] - k_at[None, :]  # (R, block)
    seen = back >= 0
    if blocked:
        seen = seen | ((q_blk[:, None, :, None] == k_blk[:, None, None, :]) & (q_blk[:, None, :, None] >= 0))
    return (q_seg[:, None, :, None] == k_seg[:, None, None, :]) & seen & (back < window)


def _forward_step(carry, kv, capped, blocked):
    # the scanned step: every tensor it reads comes in the carry or the block (torch_xla's scan traces it alone)
    q, q_seg, q_blk, q_at, window, cap, top, total, acc = carry  # each query's running max score, sum of exp and output
    k, v, k_seg, k_blk, k_at = kv
    visible = _visible(q_seg, q_at, k_seg, k_at, window, q_blk, k_blk, blocked)
    s = (q @ k.transpose(-1, -2)).float()  # (B, Hkv, R, block)
    s = torch.where(visible, cap * torch.tanh(s / cap) if capped else s, MASKED)
    new_top = torch.maximum(top, s.amax(dim=-1))
    p = torch.where(visible, torch.exp(s - new_top[..., None]), 0.0)
    rescale = torch.exp(top - new_top)  # the running sums were taken against the old maximum
    acc = acc * rescale[..., None] + (p.to(v.dtype) @ v).float()
    return (q, q_seg, q_blk, q_at, window, cap, new_top, total * rescale + p.sum(dim=-1), acc), ()


def _backward_step(carry, kv, capped, blocked):
    q, q_seg, q_blk, q_at, window, cap, dout, lse, delta, dq = carry
    k, v, k_seg, k_blk, k_at = kv
    visible = _visible(q_seg, q_at, k_seg, k_at, window, q_blk, k_blk, blocked)
    s = (q @ k.transpose(-1, -2)).float()
    if capped:
        s = cap * torch.tanh(s / cap)
    p = torch.where(visible, torch.exp(s - lse[..., None]), 0.0)  # (B, Hkv, R, block)
    dv = (p.to(dout.dtype).transpose(-1, -2) @ dout).float()  # (B, Hkv, block, hd): summed over the group's heads
    ds = p * ((dout @ v.transpose(-1, -2)).float() - delta[..., None])
    if capped:  # through the cap: d(cap * tanh(x / cap))/dx = 1 - tanh^2
        ds = ds * (1 - (s / cap) ** 2)
    dq = dq + (ds.to(k.dtype) @ k).float()
    dk = (ds.to(q.dtype).transpose(-1, -2) @ q).float()
    return (q, q_seg, q_blk, q_at, window, cap, dout, lse, delta, dq), (dk, dv)


# one step function each way and kind, chosen in Python: the uncapped scores pay for no tanh, causal rows for no blocks
STEPS = {(capped, blocked): (partial(_forward_step, capped=capped, blocked=blocked),
                             partial(_backward_step, capped=capped, blocked=blocked))
         for capped in (False, True) for blocked in (False, True)}


class BlockwiseAttention(torch.autograd.Function):
    """FlashAttention's algorithm: forward keeps only the output and each query's log-sum-exp; backward visits the
    key blocks again, recomputing their probabilities (autograd through the loop would keep every block's)."""

    @staticmethod
    def forward(ctx, q, k, v, segments, window, block, scan, scale=None, softcap=None, blocks=None):
        B, H, T, hd = q.shape
        n_kv, n_blocks = k.shape[1], -(-T // block)
        rep, pad = H // n_kv, n_blocks * block - T
        scale = scale or hd**-0.5
        # a key/value head's queries side by side: (B, Hkv, rep * T, hd), with their samples and positions
        qg = (q * scale).reshape(B, n_kv, rep * T, hd)
        seg = (segments if segments is not None else torch.zeros(B, T, device=q.device)).float()
        q_seg, q_at = seg.repeat(1, rep), torch.arange(T, device=q.device).float().repeat(rep)  # (B, R), (R,)
        # the blocks: (n_blocks, B, Hkv, block, hd); padding keys are in no sample (-1), so no query sees them
        k_seg = F.pad(seg, (0, pad), value=-1.0).view(B, n_blocks, block).transpose(0, 1)  # (n_blocks, B, block)
        blk = (blocks if blocks is not None else torch.full((B, T), -1, device=q.device)).float()  # -1: in no block
        q_blk = blk.repeat(1, rep)  # (B, R)
        k_blk = F.pad(blk, (0, pad), value=-1.0).view(B, n_blocks, block).transpose(0, 1)  # (n_blocks, B, block)
        k_at = torch.arange(n_blocks * block, device=q.device).float().view(n_blocks, block)
        ks, vs = (F.pad(x, (0, 0, 0, pad)).view(B, n_kv, n_blocks, block, hd).permute(2, 0, 1, 3, 4) for x in (k, v))
        span = torch.tensor(float(window or n_blocks * block + 1), device=q.device)  # no window: every earlier key
        R = rep * T
        cap = torch.tensor(float(softcap or 1.0), device=q.device)
        init = (qg, q_seg, q_blk, q_at, span, cap, torch.full((B, n_kv, R), MASKED, device=q.device),
                torch.zeros(B, n_kv, R, device=q.device), torch.zeros(B, n_kv, R, hd, device=q.device))
        kind = (bool(softcap), blocks is not None)
        (*_, top, total, acc), _ = scan(STEPS[kind][0], init, (ks, vs, k_seg, k_blk, k_at))
        out = (acc / total[..., None]).to(q.dtype)  # (B, Hkv, R, hd)
        ctx.save_for_backward(qg, ks, vs, k_seg, k_blk, k_at, q_seg, q_blk, q_at, span, cap, out, top + torch.log(total))
        ctx.scan, ctx.shape, ctx.scale, ctx.kind = scan, q.shape, scale, kind
        return out.view(B, H, T, hd)

    @staticmethod
    def backward(ctx, dout):
        qg, ks, vs, k_seg, k_blk, k_at, q_seg, q_blk, q_at, span, cap, out, lse = ctx.saved_tensors
        B, H, T, hd = ctx.shape
        n_blocks, _, n_kv, block, _ = ks.shape
        dout = dout.reshape(out.shape)  # (B, Hkv, R, hd)
        delta = (dout.float() * out.float()).sum(dim=-1)  # each query's sum of p * dp over every key
        init = (qg, q_seg, q_blk, q_at, span, cap, dout, lse, delta, torch.zeros(qg.shape, device=qg.device))
        (*_, dq), (dk, dv) = ctx.scan(STEPS[ctx.kind][1], init, (ks, vs, k_seg, k_blk, k_at))
        # (n_blocks, B, Hkv, block, hd) -> (B, Hkv, T, hd)
        dk, dv = (x.permute(1, 2, 0, 3, 4).reshape(B, n_kv, n_blocks * block, hd)[:, :, :T] for x in (dk, dv))
        dq = (dq * ctx.scale).view(B, H, T, hd)
        return dq.to(qg.dtype), dk.to(ks.dtype), dv.to(vs.dtype), None, None, None, None, None, None, None
