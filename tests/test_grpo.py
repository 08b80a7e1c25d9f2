"""GRPO against TRL 1.16's GRPOTrainer: on a fixed batch (prompts with images, completions, rewards, old and reference
log-probs) our advantages and loss equal what its _compute_loss computes with the same tiny random LLaVA."""

import math
import os

import pytest
import torch
from conftest import tiny_hf_llava
from test_dpo import EOS, IMAGE, N_IMAGE_TOKENS, PAD, our_model, shapes_pairs, word_level_processor  # noqa: F401

import rl
import train
from model import group_advantages, grpo_loss

os.environ["USE_TORCH_XLA"] = "0"  # TRL would otherwise import torch_xla and move to an XLA device

G, C = 3, 6  # completions a prompt, completion slots


def trl_grpo(model, loss_type, beta, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    processor = word_level_processor()
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


# -----------------------------------------------------------------------------
# objective='grpo' in train.py's loop


def short_answers(completions, answers):
    """A reward rule for the tests (--grpo_reward=test_grpo:short_answers): shorter completions score higher."""
    return [1.0 - len(c) / 16 for c in completions]


def test_generate_never_samples_suppressed_tokens():
    from model import build_model, vlm_preset

    cfg = vlm_preset("debug").with_overrides({"llm": {"vocab_size": 64}, "image_token_id": 60})
    model = build_model(cfg, seed=0)
    suppress = torch.arange(64) >= 40  # the padded vocab and the image token
    ids = torch.randint(1, 40, (6, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=12, temperature=3.0, generator=torch.Generator().manual_seed(1),
                         suppress=suppress)
    free = model.generate(ids, max_new_tokens=12, temperature=3.0, generator=torch.Generator().manual_seed(1))
    assert out.shape == (6, 12) and (out < 40).all() and (free >= 40).any()  # at temperature 3 they would appear


def test_prompts_are_cut_where_the_answer_starts(tmp_path):
    import data
    from shapes import make_shapes

    make_shapes(tmp_path, n=24, seed=0, val_fraction=0.2)
    stream = data.ShardStream(tmp_path / "shards", tmp_path / "tokenizer.model", split="train", batch_size=8, seq_len=48,
                              image_size=28, image_token_id=512, n_image_tokens=4, template="llama_3")
    b = stream.batch(0)
    stop = data.stop_token_id("llama_3", stream.tok)
    for r, prompt, answer in rl.prompts_of(b):
        conv, image = data.sample_conversation(stream.read(int(b["sample_id"][r]))[1])
        want_prompt, want_answer = data.prompt_and_answer(conv, image is not None, "llama_3", stream.tok, 512, 4)
        assert prompt == list(want_prompt) and data.decode_answer(stream.tok, answer, stop) == want_answer.strip()


@pytest.mark.parametrize("reward", ["rule", "reward_model"])
def test_grpo_loop_logs_its_metrics(shapes_pairs, tmp_path, reward):  # noqa: F811
    import json

    import convert
    from model import build_model
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    spec = "test_grpo:short_answers"
    if reward == "reward_model":
        judge = build_model(convert.load_model(init).cfg.with_overrides({"reward_head": True}), seed=5)
        convert.save_model(judge, tmp_path / "judge")
        spec = str(tmp_path / "judge")
    steps = 4 if reward == "rule" else 2
    train.main(dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--objective=grpo",
                        f"--data_dir={shapes_pairs / 'shards'}", f"--grpo_reward={spec}", f"--max_iters={steps}",
                        "--batch_size=4", "--micro_batch_size=2", "--grpo_group=4", "--grpo_iterations=2",
                        "--grpo_beta=0.05", "--lr=3e-3", "--warmup_iters=1", f"--lr_decay_iters={steps}",
                        "--eval_interval=0", "--final_accuracy_samples=8", "--grpo_max_new_tokens=6"))
    events = [json.loads(line) for line in (tmp_path / "out/log.jsonl").read_text().splitlines()]
    logged = [e for e in events if "rl/reward" in e]
    assert [e["step"] for e in logged] == list(range(1, steps + 1))
    for key in ("rl/kl", "rl/clip_ratio", "rl/entropy", "rl/completion_length", "rl/reward_std"):
        assert all(math.isfinite(e[key]) for e in logged), key
    generated = [e["step"] for e in logged if e.get("gen_samples_per_s", 0) > 0 and e["train_samples_per_s"] > 0]
    assert generated == list(range(1, steps + 1, 2))  # rollouts every grpo_iterations steps
    assert logged[0]["rl/kl"] == 0 and logged[0]["rl/clip_ratio"] == 0  # the first step: policy = reference = sampler
    assert logged[1]["rl/kl"] > 0  # the second step reuses the rollouts after one update: ratio and KL move


def test_one_grpo_update_moves_probability_towards_positive_advantages(shapes_pairs):  # noqa: F811
    """A rollout from a shapes batch, one small SGD step on rl_loss: sum_i A_i (log-prob_i after - before) > 0 (the
    policy gradient's first-order effect), and the completions' stop token and suppressed ids are as sampled."""
    import data
    from model import build_model, vlm_preset

    cfg = vlm_preset("debug").with_overrides({"vision": {"image_size": 28, "patch_size": 14},
                                             "llm": {"vocab_size": 576}, "image_token_id": 512})
    model = build_model(cfg, seed=0)
    stream = data.ShardStream(shapes_pairs / "shards", shapes_pairs / "tokenizer.model", split="train", batch_size=4,
                              seq_len=48, image_size=28, image_token_id=512, n_image_tokens=4, template="llama_3")
    b = stream.batch(0)
    b["pixel_values"] = data.normalize_images(b["pixel_values"], *cfg.vision.image_stats)
    stop = data.stop_token_id("llama_3", stream.tok)
    run = dict(train.DEFAULTS) | {"grpo_group": 4, "grpo_max_new_tokens": 6}
    score = lambda texts, answers, *_: torch.tensor(short_answers(texts, answers))  # noqa: E731
    r, _, texts = rl.rollout(model, b, stream.tok, stop, run, score, torch.Generator().manual_seed(0))
    new = r["ids"][:, -r["completion_mask"].shape[1]:]
    assert (new[r["completion_mask"] == 0] == stop).all() and (new < stream.tok.vocab_size).all()
    assert r["advantages"].abs().sum() > 0 and len(texts) == len(r["ids"]) == 16

    def sequence_logps():
        logps, _ = rl.completion_logps(model, r["ids"], r["mask"], r["pixel_values"], new.shape[1])
        return (logps * r["completion_mask"]).sum(1)

    with torch.no_grad():
        before = sequence_logps()
    loss, _ = rl.rl_loss(model, r, run)
    (loss / r["units"]).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # the ViT above the selected layer never reaches the loss
                p -= 1e-3 * p.grad
        after = sequence_logps()
    assert (r["advantages"] * (after - before)).sum() > 0


@pytest.mark.parametrize("extra,message", [
    (["--grpo_loss=ppo"], "grpo_loss must be one of"),
    (["--grpo_group=1"], "grpo_group must be >= 2"),
    (["--grpo_reward=no_such_module:f"], "grpo_reward 'no_such_module:f': cannot import it"),
    (["--grpo_reward=cosine"], "expected \\['exact_match'\\]"),
    (["--parallel=fsdp"], "FSDP and XLA generation are not built"),
    (["--pack=2"], "pack and max_tiles must be 0"),
    (["--grpo_beta=0.1", "--init_from=scratch"], "grpo_beta > 0 needs a reference checkpoint"),
])
def test_grpo_config_errors_are_one_sentence(tmp_path, extra, message):
    from test_dpo import dpo_args

    with pytest.raises(SystemExit, match=message):
        train.main(dpo_args(tmp_path, tmp_path / "out", "--init_from=ckpt", "--objective=grpo", *extra))


def test_rl_configs_parse():
    from conftest import ROOT

    assert train.load_config([str(ROOT / "configs/grpo_shapes.py")])["objective"] == "grpo"
    assert train.load_config([str(ROOT / "configs/reward_shapes.py")])["objective"] == "reward"


def test_grpo_resumes_exactly(shapes_pairs, tmp_path):  # noqa: F811
    """4 steps straight, or 2 then a resume for 2 more: the same rollouts (sampler seeded by step), rewards and loss."""
    import json

    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = ["--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=test_grpo:short_answers",
              "--batch_size=2", "--micro_batch_size=2", "--grpo_group=3", "--grpo_beta=0.05",
              f"--grpo_reference={init}", "--lr=3e-3", "--warmup_iters=1", "--lr_decay_iters=4", "--eval_interval=0",
              "--final_accuracy_samples=0", "--grpo_max_new_tokens=5", "--ckpt_interval=2"]
    train.main(dpo_args(shapes_pairs, tmp_path / "straight", f"--init_from={init}", "--max_iters=4", *common))
    train.main(dpo_args(shapes_pairs, tmp_path / "resumed", f"--init_from={init}", "--max_iters=2", *common))
    train.main(dpo_args(shapes_pairs, tmp_path / "resumed", "--init_from=resume", "--max_iters=4", *common))
    read = lambda run: [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()  # noqa: E731
                        if "rl/reward" in line]
    straight, resumed = read("straight"), read("resumed")
    assert [e["step"] for e in resumed] == [1, 2, 3, 4]
    for want, got in zip(straight, resumed, strict=True):
        for k in ("loss", "rl/reward", "rl/kl", "rl/completion_length"):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])


@pytest.mark.slow
def test_grpo_under_torchrun_ddp_runs_two_ranks(shapes_pairs, tmp_path):  # noqa: F811
    """2 ranks x 2 prompts under DDP, rewards from a reward-model checkpoint: each rank samples its own prompts
    (seeded by rank and step), the loss is finite and the weights move."""
    import json

    from safetensors.torch import load_file
    from test_dpo import debug_init, dpo_args
    from test_train import run

    import convert
    from model import build_model

    init = debug_init(tmp_path / "init")
    judge = build_model(convert.load_model(init).cfg.with_overrides({"reward_head": True}), seed=5)
    convert.save_model(judge, tmp_path / "judge")  # a random reward model: rewards that differ within a group
    run(dpo_args(shapes_pairs, tmp_path / "ddp", f"--init_from={init}", "--objective=grpo",
                 f"--grpo_reward={tmp_path / 'judge'}",
                 f"--data_dir={shapes_pairs / 'shards'}", "--max_iters=2", "--batch_size=4", "--micro_batch_size=2",
                 "--grpo_group=3", "--grpo_beta=0.05", "--lr=3e-3", "--eval_interval=0", "--final_accuracy_samples=0",
                 "--grpo_max_new_tokens=4", "--ckpt_interval=2", "--parallel=ddp"), nproc=2)
    logged = [json.loads(line) for line in (tmp_path / "ddp/log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "rl/reward" in e] == [1, 2]
    assert all(math.isfinite(e["loss"]) and math.isfinite(e["rl/kl"]) for e in logged if "rl/reward" in e)
    from conftest import checkpoint_tensors

    after = {k[len("model."):]: v for k, v in checkpoint_tensors(tmp_path / "ddp/step-000002", "model.").items()}
    assert any(not torch.equal(v, load_file(init / "model.safetensors")[k]) for k, v in after.items())


def test_lora_grpo_kl_reference_is_the_policy_with_adapters_off(shapes_pairs, tmp_path, capsys):  # noqa: F811
    """grpo_beta > 0 with LoRA and no grpo_reference: the policy with its adapters off (and its projector at its
    start values) gives the frozen copy's rollouts, KL and loss."""
    import json

    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = ["--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=test_grpo:short_answers",
              "--batch_size=2", "--micro_batch_size=2", "--grpo_group=3", "--grpo_beta=0.05", "--lr=3e-3",
              "--warmup_iters=1", "--eval_interval=0", "--final_accuracy_samples=0", "--grpo_max_new_tokens=5",
              "--max_iters=3", "--stage=2", "--lora={'r': 4, 'alpha': 8, 'targets': ['llm']}", f"--init_from={init}"]
    train.main(dpo_args(shapes_pairs, tmp_path / "off", *common))
    assert "grpo: reference model = the policy with its LoRA adapters off" in capsys.readouterr().out
    train.main(dpo_args(shapes_pairs, tmp_path / "copy", *common, f"--grpo_reference={init}"))
    read = lambda run: [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()  # noqa: E731
                        if "rl/reward" in line]
    off, copy = read("off"), read("copy")
    assert len(off) == 3 and any(e["rl/kl"] > 0 for e in off[1:])
    for want, got in zip(copy, off, strict=True):
        for k in ("loss", "rl/reward", "rl/kl", "rl/completion_length"):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
