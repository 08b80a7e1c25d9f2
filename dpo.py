"""
Preference training (objective='dpo') for train.py: the frozen reference, each row's completion log-prob, the pair
loss and its held-out pass. The loss itself (`dpo_loss`) is beside the token loss in model.py; the data (pairs as
rows [chosen..., rejected...], one image a pair) is data.ShardStream(preference=True).
"""

import torch

import convert
from evaluation import device_batch
from model import dpo_loss as pair_loss  # train.py's config key dpo_loss names its kind
from parallel import autocast, checkpoint_fn, print0, shard


def reference_model(cfg, env):
    """The frozen reference, placed as the policy is (FSDP/SPMD-sharded, or whole under DDP)."""
    source = cfg["dpo_reference"] or cfg["init_from"]
    build_on = "cpu" if env.kind == "xla" else env.device
    try:
        ref = convert.load_model(source, device=build_on).requires_grad_(False).eval()
    except (convert.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"dpo reference {str(source)!r}: cannot load the model ({e})") from None
    ref.loss_chunk, ref.recompute = cfg["loss_chunk"], checkpoint_fn(env.kind)  # its log-probs as the policy's
    print0(env, f"dpo: reference model {source} (frozen), loss {cfg['dpo_loss']}, beta {cfg['dpo_beta']}")
    return ref if env.distributed and env.kind != "xla" and cfg["parallel"] == "ddp" else shard(ref, env, cfg)


def sequence_logps(model, b):
    """Each row's summed log-prob of its supervised (completion) tokens, and their count: (rows,), (rows,)."""
    _, row_loss = model(b["input_ids"], b["pixel_values"], b["labels"], "row",
                        image_index=b.get("image_index"), image_weight=b.get("image_weight"))
    return -row_loss, (b["labels"][:, 1:] != -100).sum(dim=1)


def preference_loss(model, ref_model, b, cfg):
    """Rows [chosen..., rejected...] with one image a pair; the reference is frozen."""
    logps, n_tokens = sequence_logps(model, b)
    with torch.no_grad():
        ref_logps, _ = sequence_logps(ref_model, b)
    return pair_loss(logps, ref_logps, n_tokens, cfg["dpo_beta"], cfg["dpo_loss"], cfg["dpo_sft_weight"])


@torch.no_grad()
def evaluate_preference(model, ref_model, val_loader, env, cfg, n_batches, vision):
    """Validation loss and metrics on the same held-out pairs every time."""
    model.eval()
    sums, n = {}, 0
    val_loader.position = 0
    for i, batch in enumerate(val_loader):
        if i == n_batches:
            break
        b = device_batch(batch, env, vision)
        with autocast(env, cfg):
            loss, metrics = preference_loss(model, ref_model, b, cfg)
        for k, v in ({"loss": loss} | metrics).items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
        env.step_end()
    model.train()
    total = env.all_sum(torch.tensor(float(n), device=env.device))
    return {f"val_{k}": (env.all_sum(v) / total).item() for k, v in sums.items()}
