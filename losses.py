"""
The losses of the post-training objectives, beside model.py's token loss: DPO's pair losses, the reward model's
Bradley-Terry loss, GRPO's group advantages and clipped loss, and PPO's score, KL penalty, GAE, whitening and
clipped policy and value losses. Pure functions of tensors: no model, device or config.
"""

import torch
import torch.nn.functional as F

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
