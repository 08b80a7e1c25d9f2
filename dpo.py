"""
Preference training for train.py (objective='dpo', and 'reward': a reward model on the same pairs): the frozen
reference, each row's completion log-prob, the pair losses and their held-out pass. The losses themselves
(`dpo_loss`, `reward_loss`) are beside the token loss in model.py; the data (pairs as rows [chosen...,
rejected...], one image a pair) is data.ShardStream(preference=True).
"""

import torch

import convert
from evaluation import device_batch
from model import dpo_loss as pair_loss  # train.py's config key dpo_loss names its kind
from model import reward_loss
from parallel import autocast, checkpoint_fn, print0, shard


def reference_model(cfg, env):
    """The frozen reference (dpo, grpo with a KL term), placed as the policy is (FSDP/SPMD-sharded, or whole under
    DDP)."""
    source = cfg["grpo_reference" if cfg["objective"] == "grpo" else "dpo_reference"] or cfg["init_from"]
    build_on = "cpu" if env.kind == "xla" else env.device
    try:
        ref = convert.load_model(source, device=build_on).requires_grad_(False).eval()
    except (convert.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{cfg['objective']} reference {str(source)!r}: cannot load the model ({e})") from None
    ref.loss_chunk, ref.recompute = cfg["loss_chunk"], checkpoint_fn(env.kind)  # its log-probs as the policy's
    print0(env, f"{cfg['objective']}: reference model {source} (frozen)")
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
    """Validation loss and metrics (dpo or reward) on the same held-out pairs every time."""
    model.eval()
    sums, n = {}, 0
    val_loader.position = 0
    for i, batch in enumerate(val_loader):
        if i == n_batches:
            break
        b = device_batch(batch, env, vision)
        with autocast(env, cfg):
            loss, metrics = pair_objective(model, ref_model, b, cfg)
        for k, v in ({"loss": loss} | metrics).items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
        env.step_end()
    model.train()
    total = env.all_sum(torch.tensor(float(n), device=env.device))
    return {f"val_{k}": (env.all_sum(v) / total).item() for k, v in sums.items()}


def reward_pairs(model, b, cfg):
    """objective='reward': rows [chosen..., rejected...] right-padded; the head reads each answer's last token (the
    last supervised one: the end of turn), attention_mask 1 up to it."""
    supervised = b["labels"] != -100
    at = torch.arange(supervised.shape[1], device=supervised.device)
    last = (at * supervised).amax(dim=1)  # (rows,)
    _, rewards = model(b["input_ids"], b["pixel_values"], attention_mask=(at <= last[:, None]).long(), reward=True,
                       image_index=b.get("image_index"), image_weight=b.get("image_weight"))
    return reward_loss(rewards, supervised[:, 1:].sum(dim=1), cfg["reward_margin"], cfg["reward_center_weight"])


def pair_objective(model, ref_model, b, cfg):
    """The loss of a batch of pairs: objective='reward' (Bradley-Terry on the reward head) or 'dpo'."""
    return reward_pairs(model, b, cfg) if cfg["objective"] == "reward" else preference_loss(model, ref_model, b, cfg)
