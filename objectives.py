"""
The training objectives, chosen once at set-up (as torchtitan builds its loss_fn): for each of sft, dpo, reward, grpo and
ppo its loss, the units a step's loss is divided by, its held-out pass and what a step trains on (ReadBatches, or
rl.py's rollout batches). train.py's loop reads the same for every one. Split from train.py, over its line budget.
"""

from types import SimpleNamespace

import torch

import rl
from dpo import evaluate_preference, preference_loss, reward_pairs
from evaluation import device_batch, evaluate


def token_loss(model, b, cfg, ref_model, value_model=None):
    _, loss = model(b["input_ids"], b["pixel_values"], b["labels"], "sum", b.get("position_ids"),
                    image_index=b.get("image_index"), image_weight=b.get("image_weight"))
    return loss, {}


def held_out_loss(model, ref_model, val_loaders, env, cfg, vision, loss):
    return evaluate(model, val_loaders, env, cfg, cfg["eval_iters"], vision)


def held_out_pairs(model, ref_model, val_loaders, env, cfg, vision, loss):
    return evaluate_preference(model, ref_model, val_loaders, env, cfg, cfg["eval_iters"], vision, loss)


class ReadBatches:
    """sft, dpo, reward: every step reads its micro-batches from the loader and places them on the device (GRPO's
    counterpart, rl.GenerationBatches, samples completions from them and keeps them for grpo_iterations steps)."""

    def __init__(self, cfg, env, loader, resume_from, raw, value_model=None):
        self.env, self.vision = env, raw.cfg.vision
        self.rows_per_step, self.completions_per_prompt = cfg["batch_size"], 1

    def fresh(self, it):
        return True

    def prepare(self, micro, raw, ref_model, meter, it):
        return [device_batch(b, self.env, self.vision) for b in micro]

    def skipped(self, fresh):
        pass

    def in_flight(self, it):
        return None


supervised_tokens = lambda b: (b["labels"][:, 1:] != -100).sum()  # noqa: E731  sft: a sum over them
per_micro_batch = lambda b: torch.ones((), device=b["labels"].device)  # noqa: E731  a mean over the micro-batch's pairs
dpo_loss = lambda model, b, cfg, ref_model, value_model=None: preference_loss(model, ref_model, b, cfg)  # noqa: E731
reward_loss = lambda model, b, cfg, ref_model, value_model=None: reward_pairs(model, b, cfg)  # noqa: E731  on the head
grpo_loss = lambda model, b, cfg, ref_model, value_model: rl.rl_loss(model, b, cfg)  # noqa: E731
ppo_loss = lambda model, b, cfg, ref_model, value_model: rl.ppo_micro_loss(model, value_model, b, cfg)  # noqa: E731
completion_units = lambda b: b["units"]  # noqa: E731  completion tokens (dapo, ppo), completions (grpo), slots (dr_grpo)
# loss(model, micro-batch, cfg, reference, value model) -> (summed loss, metrics); units(micro-batch): what a step's
# loss is divided by; evaluate: the held-out pass; batches: what a step trains on; pairs: the loader reads preference
# rows [chosen..., rejected...]; reward_head: a scalar head on the LLM; answers: it generates (final accuracy);
# reference(cfg): it needs the frozen reference model; value: it trains a value model beside the policy
OBJECTIVES = {
    "sft": SimpleNamespace(loss=token_loss, units=supervised_tokens, evaluate=held_out_loss, batches=ReadBatches,
                           pairs=False, reward_head=False, answers=True, reference=lambda cfg: False, value=False),
    "dpo": SimpleNamespace(loss=dpo_loss, units=per_micro_batch, evaluate=held_out_pairs, batches=ReadBatches,
                           pairs=True, reward_head=False, answers=True, reference=lambda cfg: True, value=False),
    "reward": SimpleNamespace(loss=reward_loss, units=per_micro_batch, evaluate=held_out_pairs, batches=ReadBatches,
                              pairs=True, reward_head=True, answers=False, reference=lambda cfg: False, value=False),
    "grpo": SimpleNamespace(loss=grpo_loss, units=completion_units, evaluate=held_out_loss,
                            batches=rl.GenerationBatches, pairs=False, reward_head=False, answers=True,
                            reference=lambda cfg: bool(cfg["grpo_beta"]), value=False),
    "ppo": SimpleNamespace(loss=ppo_loss, units=completion_units, evaluate=held_out_loss, batches=rl.PPOBatches,
                           pairs=False, reward_head=False, answers=True, reference=lambda cfg: True, value=True),
}
