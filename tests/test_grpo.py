"""GRPO against TRL 1.16's GRPOTrainer: on a fixed batch (prompts with images, completions, rewards, old and reference
log-probs) our advantages and loss equal what its _compute_loss computes with the same tiny random LLaVA."""

import os

import pytest
import torch
from conftest import tiny_hf_llava
from test_dpo import EOS, IMAGE, N_IMAGE_TOKENS, PAD, our_model

import rl
from model import group_advantages, grpo_loss

os.environ["USE_TORCH_XLA"] = "0"  # TRL would otherwise import torch_xla and move to an XLA device

G, C = 3, 6  # completions a prompt, completion slots


def trl_grpo(model, loss_type, beta, tmp_path):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {f"t{i}": i for i in range(IMAGE)} | {"<image>": IMAGE}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                     pad_token="t0", eos_token="t2", unk_token="t1")
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                                 crop_size={"height": 28, "width": 28}),
                               tokenizer=hf_tok, patch_size=14, vision_feature_select_strategy="default")
    args = GRPOConfig(str(tmp_path / "trl"), loss_type=loss_type, beta=beta, epsilon=0.2, num_generations=G,
                      per_device_train_batch_size=2 * G, max_completion_length=C, report_to=[], use_cpu=True,
                      bf16=False, temperature=1.0)
    data = Dataset.from_list([{"prompt": "x", "image": [[0]]}] * 2)
    trainer = GRPOTrainer(model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=data, processing_class=processor)
    trainer.current_gradient_accumulation_steps = 1  # set by training_step, which we do not run
    trainer.model.train()
    return trainer


def rollout(seed=0):
    """Two prompts with an image, G completions each of different lengths (EOS-terminated, right-padded), rewards
    with a tie inside a group, and sampling and reference log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, IMAGE, (n,), generator=g)  # noqa: E731
    prompts = torch.stack([torch.cat([words(2), torch.full((N_IMAGE_TOKENS,), IMAGE), words(3)]) for _ in range(2)])
    prompts = prompts.repeat_interleave(G, 0)  # (2 * G, 9): one length, as TRL's training forward counts positions

    completions = torch.full((2 * G, C), PAD)
    completion_mask = torch.zeros(2 * G, C, dtype=torch.long)
    for i, n in enumerate([6, 2, 4, 5, 1, 3]):
        completions[i, : n - 1] = torch.randint(3, IMAGE, (n - 1,), generator=g)
        completions[i, n - 1] = EOS
        completion_mask[i, :n] = 1
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    pixels = torch.randn(2, 3, 28, 28, generator=g).repeat_interleave(G, 0)
    return prompts, completions, completion_mask, rewards, pixels, g


@pytest.mark.parametrize("loss_type,beta", [("grpo", 0.0), ("dapo", 0.0), ("grpo", 0.04), ("dapo", 0.1),
                                            ("dr_grpo", 0.04)])
def test_grpo_loss_matches_trl_compute_loss(tmp_path, loss_type, beta):
    from trl.trainer.utils import nanstd

    hf = tiny_hf_llava(seed=0)
    policy, _ = our_model(hf, tmp_path, "policy")
    prompts, completions, completion_mask, rewards, pixels, g = rollout()
    ids = torch.cat([prompts, completions], 1)
    mask = torch.cat([torch.ones_like(prompts), completion_mask], 1)
    with torch.no_grad():
        logps, _ = rl.completion_logps(policy, ids, mask, pixels, C)
    old = logps + 0.3 * torch.randn(logps.shape, generator=g)  # off-policy enough that some ratios clip
    ref = logps + 0.2 * torch.randn(logps.shape, generator=g)

    advantages = group_advantages(rewards, G)
    grouped = rewards.view(-1, G)  # TRL's own formula (grpo_trainer._generate_and_score_completions)
    want = (rewards - grouped.mean(1).repeat_interleave(G)) / (nanstd(grouped, dim=1).repeat_interleave(G) + 1e-4)
    assert torch.allclose(advantages, want, atol=1e-6) and advantages[3:5].abs().max() > 0.1

    trainer = trl_grpo(str(tmp_path / "policy"), loss_type, beta, tmp_path)  # a path: TRL loads its reference too
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
              "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum(), "pixel_values": pixels,
              "num_images": [1] * len(prompts)}
    trl_loss = trainer._compute_loss(trainer.model, inputs)

    policy.train()
    new, entropy = rl.completion_logps(policy, ids, mask, pixels, C)
    loss, metrics = grpo_loss(new, old, advantages, completion_mask, loss_type, epsilon=0.2, beta=beta, ref_logps=ref,
                              max_completion_length=C)
    assert abs(loss.item() - trl_loss.item()) <= 1e-5 * max(1.0, abs(trl_loss.item())), (loss.item(), trl_loss.item())
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(metrics["clip_ratio"].item() - logged["clip_ratio/region_mean"]) < 1e-6, logged
    assert metrics["clip_ratio"] > 0
    assert abs((entropy * completion_mask).sum().item() / completion_mask.sum().item() - logged["entropy"]) < 1e-4
    if beta:
        assert abs(metrics["kl"].item() - logged["kl"]) < 1e-5


def test_grpo_loss_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="expected one of"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), "ppo")
