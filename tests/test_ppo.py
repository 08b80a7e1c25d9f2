"""PPO's pieces (model.py: ppo_score, ppo_rewards, gae, masked_whiten, ppo_loss, explained_variance; the value model's
per-token head; rl.check_ppo_config) against TRL 1.12's PPOTrainer run on the same tiny LLaVA rollout (tests/trl_ppo.py,
in a process of its own, started with the session), EasyLM's llama_train_ppo formulas and a plain loop."""

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, start_in_background, wait_for_background

import config
import model_files
import rl
from losses import explained_variance, gae, masked_whiten, ppo_loss, ppo_rewards, ppo_score, ppo_value_loss
from model import build_model
from model_config import vlm_preset

LENGTHS = [9, 1, 5, 0, 7]  # completion tokens a row (0: a static rollout's row without a prompt), of C = 9 slots


def side_dir():
    """Where tests/trl_ppo.py keeps TRL 1.12: beside the venv's packages, else in the temporary directory."""
    return Path(sys.prefix, "trl-ppo") if os.access(sys.prefix, os.W_OK) else Path(tempfile.gettempdir(), "llavax-trl-ppo")


BACKGROUND_FIXTURE = "trl_figures"  # the fixture that waits for start_background's job


def start_background(tmp_path_factory):  # at the start of the session (tests/conftest.py)
    out = tmp_path_factory.mktemp("trl_ppo")
    env = os.environ | {"OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0"}
    start_in_background(__name__, [sys.executable, ROOT / "tests/trl_ppo.py", side_dir(), out / "figures.json"], env, out)


@pytest.fixture(scope="module")
def trl_figures():
    return json.loads((wait_for_background(__name__, timeout=900) / "figures.json").read_text())


TRL_QUANTITIES = ("logps", "values", "scores", "entropy", "kl", "advantages", "returns", "policy_loss", "value_loss",
                  "policy_clipfrac", "value_clipfrac", "approx_kl")


@pytest.mark.full  # TRL 1.12 in its side venv: installed and run in the background
@pytest.mark.parametrize("case", ["k1", "k3_whitened_rewards", "gamma_lam_1"])
def test_ppo_matches_trl_1_12_on_the_same_llava_rollout(trl_figures, case):
    """TRL 1.12's PPOTrainer.train() on one rollout batch of 8 prompts with images (left-padded, of different lengths)
    and completions of every length (one cut without EOS: the missing-EOS penalty): our VLMs' log-probs, values and
    rewards equal transformers' LLaVA's under TRL's forward, and model.py's PPO gives TRL's KL, advantages, returns,
    policy and value losses, clip fractions and approximate KL, each within 1e-5 (k1; k3 with whitened rewards, gamma
    0.9, lambda 0.8; gamma = lambda = 1). TRL puts the score one token past the last (the first padding slot) and
    trains the value there too: given that layout (its masks), ours reproduces it; our own layout (EasyLM's: score and
    value loss at the completion's tokens) gives TRL's advantages, returns and policy loss when gamma = lambda = 1 only."""
    figures = trl_figures[case]
    for name in TRL_QUANTITIES:
        ours, trl, difference = figures[name]
        assert difference <= 1e-5, (name, ours, trl, difference)
    assert figures["policy_clipfrac"][1] > 0.1 and figures["value_clipfrac"][1] > 0.1  # both clips bind
    assert figures["approx_kl"][1] > 0.01 and figures["kl"][1] > 0.1
    ours_against_trl = [figures[name][2] for name in ("easylm_advantages", "easylm_returns", "easylm_policy_loss")]
    if case == "gamma_lam_1":
        assert max(ours_against_trl) <= 1e-5, ours_against_trl
    else:
        assert min(ours_against_trl) > 1e-4, ours_against_trl  # the layouts differ, and the figures show it


# -----------------------------------------------------------------------------
# EasyLM's formulas (hamishivi/EasyLM EasyLM/models/llama/llama_train_ppo.py), transcribed in numpy, float64


def easylm_whiten(x, mask, shift_mean=True):
    mean = (x * mask).sum() / mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    whitened = (x - mean) / np.sqrt(var + 1e-6)
    return whitened if shift_mean else whitened + mean


def easylm_compute_advantages(values, rewards, mask, gamma, lam):
    values, rewards = values * mask, rewards * mask
    lastgaelam, reversed_advantages = 0, []
    for t in reversed(range(mask.shape[1])):
        nextvalues = values[:, t + 1] if t < mask.shape[1] - 1 else np.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_advantages.append(lastgaelam)
    advantages = np.stack(reversed_advantages[::-1], axis=1)
    return easylm_whiten(advantages, mask), advantages + values


def easylm_rewards(logps, ref_logps, mask, score, kl_coef):
    rewards = -kl_coef * (logps - ref_logps)
    position_ids = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    rewards[np.arange(len(rewards)), np.argmax(position_ids, axis=1)] += score
    return rewards


def easylm_loss(logps, old_logps, values, old_values, advantages, returns, mask, clip, vf_coef):
    masked_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    ratio = np.exp(logps - old_logps)
    pg_loss = masked_mean(np.maximum(-advantages * ratio, -advantages * np.clip(ratio, 1 - clip, 1 + clip)))
    clipped = old_values + np.clip(values - old_values, -clip, clip)
    vf_loss = 0.5 * masked_mean(np.maximum((values - returns) ** 2, (clipped - returns) ** 2))
    return pg_loss + vf_coef * vf_loss


def plain_gae(rewards, values, lengths, gamma, lam):
    """A_t = sum over k >= t of (gamma lam)^(k - t) delta_k, delta_k = r_k + gamma V_(k+1) - V_k, V past the end 0."""
    advantages = [[0.0] * len(rewards[0]) for _ in rewards]
    for b, n in enumerate(lengths):
        v = lambda k: float(values[b][k]) if k < n else 0.0  # noqa: B023, E731
        for t in range(n):
            advantages[b][t] = sum((gamma * lam) ** (k - t) * (float(rewards[b][k]) + gamma * v(k + 1) - v(k))
                                   for k in range(t, n))
    return torch.tensor(advantages, dtype=torch.float64)


def rollout(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(9) < torch.tensor(LENGTHS)[:, None]).float()
    rand = lambda scale=1.0: (scale * torch.randn(len(LENGTHS), 9, generator=g)).to(dtype)  # noqa: E731
    logps = -rand().abs() - 0.5
    return {"mask": mask, "logps": logps, "ref_logps": logps + rand(0.3), "old_logps": logps + rand(0.4),
            "values": rand(), "old_values": rand(), "score": torch.randn(len(LENGTHS), generator=g) * 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.5, 0.0)])
def test_rewards_gae_whitening_and_loss_match_easylm_and_a_plain_loop(dtype, gamma, lam):
    """On rows of 9, 1, 5, 0 (no prompt) and 7 completion tokens: ppo_rewards (k1) is EasyLM's per-token reward with
    the score at the last token; gae equals a plain loop over the definition and EasyLM's compute_advantages (returns =
    A + V), its advantages whitened with EasyLM's eps 1e-6; ppo_loss equals EasyLM's ppo_loss (vf_coef 0.1, clip 0.2).
    Inputs in bf16 too: the functions compute in fp32 whatever they are given."""
    r = rollout(dtype)
    mask, as_np = r["mask"], lambda x: x.double().numpy()  # noqa: E731
    rewards, kl = ppo_rewards(r["logps"], r["ref_logps"], r["score"], mask, kl_coef=0.2)
    want = easylm_rewards(as_np(r["logps"]), as_np(r["ref_logps"]), as_np(mask), as_np(r["score"]), 0.2)
    assert np.abs((rewards.double().numpy() - want) * as_np(mask)).max() < 1e-5
    assert (rewards[mask == 0] == 0).all() and (kl[mask == 0] == 0).all() and rewards.dtype == torch.float32

    advantages, returns = gae(rewards, r["values"], mask, gamma, lam)
    loop = plain_gae(rewards.tolist(), r["values"].float().tolist(), LENGTHS, gamma, lam)
    assert (advantages.double() - loop).abs().max() < 1e-5 and advantages.abs().max() > 0.5
    whitened = masked_whiten(advantages, mask, eps=1e-6)
    easylm_advantages, easylm_returns = easylm_compute_advantages(as_np(r["values"]), rewards.double().numpy(),
                                                                  as_np(mask), gamma, lam)
    assert np.abs((whitened.double().numpy() - easylm_advantages) * as_np(mask)).max() < 1e-5
    assert np.abs(returns.double().numpy() - easylm_returns * as_np(mask)).max() < 1e-5

    loss, metrics = ppo_loss(r["logps"], r["old_logps"], r["values"], r["old_values"], whitened, returns, mask,
                             clip=0.2, clip_value=0.2, vf_coef=0.1)
    want = easylm_loss(as_np(r["logps"]), as_np(r["old_logps"]), as_np(r["values"]), as_np(r["old_values"]),
                       whitened.double().numpy(), returns.double().numpy(), as_np(mask), 0.2, 0.1)
    assert abs(loss.item() - want) < 1e-5 * max(1.0, abs(want))
    assert 0 < metrics["policy_clipfrac"] < 1 and 0 < metrics["value_clipfrac"] < 1


def test_gae_runs_on_the_rollout_shapes_without_python_per_row_work():
    """A row of no tokens gets no advantage, return or score; whitening ignores it (a static rollout's padding row)."""
    r = rollout(torch.float32)
    rewards, _ = ppo_rewards(r["logps"], r["ref_logps"], r["score"], r["mask"], kl_coef=0.0)
    assert rewards[3].abs().sum() == 0 and torch.allclose(rewards.sum(1), r["score"] * (torch.tensor(LENGTHS) > 0))
    advantages, returns = gae(rewards, r["values"], r["mask"])
    assert advantages[3].abs().sum() == 0 and returns[3].abs().sum() == 0
    kept = torch.tensor([0, 1, 2, 4])
    alone = masked_whiten(advantages[kept], r["mask"][kept])
    assert torch.allclose(masked_whiten(advantages, r["mask"])[kept], alone, atol=1e-6)


def test_score_is_gain_times_reward_plus_bias_minus_the_missing_end_penalty():
    """EasyLM's score (reward_gain, reward_bias) for completions that end; TRL's subtraction of missing_eos_penalty
    for those that do not."""
    rewards, ended = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([True, False, True])
    assert torch.allclose(ppo_score(rewards, ended, gain=2.0, bias=-0.5, missing_end_penalty=1.0),
                          torch.tensor([0.5, -3.5, 3.5]))
    assert torch.equal(ppo_score(rewards, ended), rewards)


def test_value_loss_clips_around_the_rollouts_values():
    values, old = torch.tensor([[1.0, 0.0, 3.0]]), torch.tensor([[0.0, 0.0, 0.0]])
    returns, mask = torch.tensor([[1.0, 0.5, 0.0]]), torch.ones(1, 3)
    loss, metrics = ppo_value_loss(values, old, returns, mask, clip=0.2)
    # max((V - R)^2, (V_old + clip(V - V_old) - R)^2): 0.64, 0.25, 9; halved, token mean
    assert abs(loss.item() - 0.5 * (0.64 + 0.25 + 9) / 3) < 1e-6 and abs(metrics["value_clipfrac"].item() - 1 / 3) < 1e-6


def test_explained_variance():
    """1 - Var(R - V) / Var(R) over the completion tokens, as CleanRL computes it (numpy's biased variances)."""
    r = rollout(torch.float32)
    mask = r["mask"].bool()
    returns, values = r["values"] + 0.5 * r["old_values"], r["values"]
    want = 1 - np.var((returns - values)[mask].numpy()) / np.var(returns[mask].numpy())
    assert abs(explained_variance(values, returns, r["mask"]).item() - want) < 1e-5 and 0 < want < 1
    assert abs(explained_variance(returns, returns, r["mask"]).item() - 1) < 1e-6


def test_the_value_model_is_a_reward_model_checkpoint_read_at_every_token(tmp_path):
    """A reward-model checkpoint (reward_head) loads as the value model: forward(values=True) reads the head at every
    position, so at each row's last real token it is the reward; rl.completion_values reads the positions that predict
    the completion tokens (those completion_logps reads). A checkpoint without a head is refused in one sentence."""
    cfg = vlm_preset("debug").with_overrides({"vision": {"image_size": 28, "patch_size": 14}, "llm": {"vocab_size": 96},
                                             "image_token_id": 95, "reward_head": True})
    model_files.save_model(build_model(cfg, seed=3), tmp_path / "reward")
    value_model = model_files.load_model(tmp_path / "reward").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 90, (3, 13), generator=g)
    ids[:, 2:6] = 95  # 4 image tokens
    mask = torch.ones_like(ids)
    mask[0, :2], mask[1, -3:], mask[2, -1:] = 0, 0, 0  # left padding, and completions of different lengths
    pixels = torch.randn(3, 3, 28, 28, generator=g)
    with torch.no_grad():
        values = value_model(ids, pixels, attention_mask=mask, values=True)[1]
        rewards = value_model(ids, pixels, attention_mask=mask, reward=True)[1]
        completion = rl.completion_values(value_model, ids, mask, pixels, 5)
    last = torch.tensor([12, 9, 11])
    assert values.shape == (3, 13) and torch.allclose(values[torch.arange(3), last], rewards, atol=1e-6)
    assert torch.allclose(completion, values[:, -6:-1], atol=1e-6) and values.std() > 0
    with pytest.raises(ValueError, match="needs a model built with reward_head=True"):
        build_model(cfg.with_overrides({"reward_head": False}), seed=0)(ids, pixels, values=True)


@pytest.mark.parametrize("change,message", [
    ({"ppo_gamma": 1.5}, "ppo_gamma and ppo_lam must lie in \\[0, 1\\], got 1.5, 0.95"),
    ({"ppo_lam": -0.1}, "ppo_gamma and ppo_lam must lie in \\[0, 1\\], got 1.0, -0.1"),
    ({"ppo_mini_batch_size": 3}, "ppo_mini_batch_size=3 must divide the rollout batch batch_size=8"),
    ({"ppo_mini_batch_size": 2, "micro_batch_size": 2}, "must be a multiple of micro_batch_size x ranks = 2 x 2"),
    ({"ppo_kl_estimator": "k2"}, "ppo_kl_estimator must be one of \\('k1', 'k3'\\)"),
    ({"ppo_epochs": 0}, "ppo_epochs must be >= 1"),
    ({"grpo_reward": ""}, "objective='ppo' needs a reward: grpo_reward = a rule"),
    ({"grpo_reward": "exact_match", "ppo_value_init": ""}, "needs a value model to start from: ppo_value_init = a "
                                                           "reward-model checkpoint directory \\(grpo_reward"),
    ({"ppo_value_init": "no/such/dir"}, "ppo_value_init 'no/such/dir': no such checkpoint directory"),
])
def test_ppo_config_errors_are_one_sentence(tmp_path, change, message):
    good = config.DEFAULTS | {"batch_size": 8, "micro_batch_size": 1, "grpo_reward": str(tmp_path),
                              "init_from": str(tmp_path)}
    with pytest.raises(SystemExit, match=message):
        rl.check_ppo_config(good | change, replicas=2)
    rl.check_ppo_config(good | {"ppo_mini_batch_size": 4}, replicas=2)  # the value model: the reward's
