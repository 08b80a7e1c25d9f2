"""GRPO against TRL 1.16's GRPOTrainer: on a fixed batch (prompts with images, completions, rewards, old and reference
log-probs) our advantages and loss equal what its _compute_loss computes with the same tiny random LLaVA."""

import math
import os

import pytest
import torch
from conftest import run_log, tiny_hf_llava
from test_dpo import EOS, IMAGE, N_IMAGE_TOKENS, PAD, hf_llava, our_model, shapes_pairs, word_level_processor  # noqa: F401

import chat
import config
import images
import model_files
import rl
import train
from losses import group_advantages, grpo_loss

os.environ["USE_TORCH_XLA"] = "0"  # TRL would otherwise import torch_xla and move to an XLA device

G, C = 3, 6  # completions a prompt, completion slots


def trl_grpo(model, loss_type, beta, tmp_path, n_prompts=2, rewards=None, **settings):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    processor = word_level_processor()
    args = GRPOConfig(str(tmp_path / "trl"), loss_type=loss_type, beta=beta, epsilon=0.2, num_generations=G,
                      per_device_train_batch_size=n_prompts * G, max_completion_length=C, report_to=[], use_cpu=True,
                      bf16=False, temperature=1.0, **settings)
    data = Dataset.from_list([{"prompt": "x", "image": [[0]]}] * n_prompts)
    reward_fn = lambda completions, **kw: rewards.tolist() if rewards is not None else [0.0] * len(completions)  # noqa: E731
    trainer = GRPOTrainer(model, reward_funcs=reward_fn, args=args, train_dataset=data, processing_class=processor)
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


@pytest.mark.parametrize("loss_type,beta,epsilon_high,family", [
    ("grpo", 0.0, None, "llama"), ("dapo", 0.0, None, "llama"), ("grpo", 0.04, None, "llama"),
    ("dapo", 0.1, None, "llama"), ("dr_grpo", 0.04, None, "llama"), ("dapo", 0.0, 0.28, "llama"),
    ("grpo", 0.04, 0.25, "llama"), ("dapo", 0.04, None, "qwen3"), ("dapo", 0.04, None, "gemma3")])
def test_grpo_loss_matches_trl_compute_loss(tmp_path, loss_type, beta, epsilon_high, family):
    """epsilon_high: DAPO's clip-higher, TRL's epsilon_high, reached through the config key grpo_epsilon_high. Qwen3
    and Gemma 3: tests/test_families.py's decoders, the 15-token rows past their 8-token windows."""
    from trl.trainer.utils import nanstd

    hf = hf_llava(family)
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

    trainer = trl_grpo(str(tmp_path / "policy"), loss_type, beta, tmp_path, epsilon_high=epsilon_high)  # a path: TRL
    # loads its reference too
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
              "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum(), "pixel_values": pixels,
              "num_images": [1] * len(prompts)}
    trl_loss = trainer._compute_loss(trainer.model, inputs)

    policy.train()
    new, entropy = rl.completion_logps(policy, ids, mask, pixels, C)
    loss, metrics = grpo_loss(new, old, advantages, completion_mask, loss_type, epsilon=0.2, epsilon_high=epsilon_high,
                              beta=beta, ref_logps=ref, max_completion_length=C)
    assert abs(loss.item() - trl_loss.item()) <= 1e-5 * max(1.0, abs(trl_loss.item())), (loss.item(), trl_loss.item())
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(metrics["clip_ratio"].item() - logged["clip_ratio/region_mean"]) < 1e-6, logged
    assert metrics["clip_ratio"] > 0
    if epsilon_high:  # some ratios lie between the two upper bounds, so clip-higher changes the loss
        ratio, positive = (new - old).exp(), advantages[:, None] > 0
        assert ((ratio > 1.2) & (ratio <= 1 + epsilon_high) & positive & (completion_mask > 0)).any()
        symmetric, _ = grpo_loss(new, old, advantages, completion_mask, loss_type, epsilon=0.2, beta=beta,
                                 ref_logps=ref, max_completion_length=C)
        assert abs(symmetric.item() - loss.item()) > 1e-4
        cfg = config.DEFAULTS | {"grpo_loss": loss_type, "grpo_beta": beta, "grpo_epsilon_high": epsilon_high,
                                 "grpo_max_new_tokens": C}
        r = {"ids": ids, "mask": mask, "pixel_values": pixels, "completion_mask": completion_mask, "metrics": {},
             "advantages": advantages, "old_logps": old, "ref_logps": ref}
        summed, _ = rl.rl_loss(policy, r, cfg)  # the config key reaches grpo_loss
        units = completion_mask.sum() if loss_type == "dapo" else len(ids)
        assert abs(summed.item() / units - trl_loss.item()) <= 1e-5 * max(1.0, abs(trl_loss.item()))
    assert abs((entropy * completion_mask).sum().item() / completion_mask.sum().item() - logged["entropy"]) < 1e-4
    if beta:
        assert abs(metrics["kl"].item() - logged["kl"]) < 1e-5


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl_scale_rewards(tmp_path, scale):
    """TRL 1.16's own _generate_and_score_completions (its generation replaced by fixed completions, its reward function
    returning fixed rewards: a tie, a group of equal rewards, rewards far from 0) gives the advantages group_advantages
    gives with that scale_rewards; 'batch' also when the generation batch comes as two micro-batches, one with a group
    of padding rows (a static rollout's rows without a prompt) whose rewards must not count (rl.batch_std)."""
    hf = tiny_hf_llava(seed=0)
    hf.save_pretrained(tmp_path / "policy")
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0, -1.0, 0.25, 31.0, 30.5, 31.25])
    trainer = trl_grpo(str(tmp_path / "policy"), "dapo", 0.0, tmp_path, n_prompts=4, rewards=rewards,
                       scale_rewards=scale)
    completions = [[5, 6, EOS], [7, EOS], [8, 9, 10, EOS]] * 4
    trainer._generate = lambda prompts: ([[3, 4]] * len(prompts), completions, None, ["y"] * len(prompts), None, {},
                                         None, None)
    trl_advantages = trainer._generate_and_score_completions([{"prompt": "x"}] * len(rewards))["advantages"]

    advantages = group_advantages(rewards, G, scale)
    assert torch.allclose(advantages, trl_advantages, atol=1e-5, rtol=1e-6), (advantages, trl_advantages)
    assert (advantages[3:6] == 0).all() and advantages.abs().max() > 0.1
    if scale == "batch":
        pad = torch.tensor([100.0, -100.0, 7.0])
        rows = [torch.cat([rewards[:6], pad]), rewards[6:]]
        micro = [{"rewards": r, "completion_mask": torch.ones(len(r), 2),
                  "mask": torch.cat([torch.ones(len(r), 1), torch.ones(len(r), 2)], 1)} for r in rows]
        micro[0]["mask"][6:, 0] = 0  # the padding rows: no prompt
        std = rl.batch_std(micro, lambda t: t)
        split = torch.cat([group_advantages(r["rewards"], G, "batch", batch_std=std) for r in micro])
        assert torch.allclose(torch.cat([split[:6], split[9:]]), trl_advantages, atol=1e-5, rtol=1e-6)


def test_grpo_loss_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="expected one of"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), "ppo")


# -----------------------------------------------------------------------------
# objective='grpo' in train.py's loop


def short_answers(completions, answers):
    """A reward rule for the tests (--grpo_reward=test_grpo:short_answers): shorter completions score higher."""
    return [1.0 - len(c) / 16 for c in completions]


def test_generate_never_samples_suppressed_tokens():
    from model import build_model
    from model_config import vlm_preset

    cfg = vlm_preset("debug").with_overrides({"llm": {"vocab_size": 64}, "image_token_id": 60})
    model = build_model(cfg, seed=0)
    suppress = torch.arange(64) >= 40  # the padded vocab and the image token
    ids = torch.randint(1, 40, (6, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=12, temperature=3.0, generator=torch.Generator().manual_seed(1),
                         suppress=suppress)
    free = model.generate(ids, max_new_tokens=12, temperature=3.0, generator=torch.Generator().manual_seed(1))
    assert out.shape == (6, 12) and (out < 40).all() and (free >= 40).any()  # at temperature 3 they would appear


def test_static_draws_follow_the_sampling_distribution():
    """generate(static=True)'s exponential race over hashed noise: 20,000 draws (rows x slots) of one distribution at
    temperature 0.7, plain and with top_p 0.8; frequencies within 4 standard errors of the probabilities computed here
    from softmax and the nucleus rule (the draws are deterministic: a seed, not luck, makes this pass or fail)."""
    from model import race_noise, sample_token

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = torch.softmax(logits / 0.7, -1)
    nucleus = torch.where(p.cumsum(-1) - p <= 0.8, p, 0.0)  # the smallest prefix of the sorted p reaching 0.8
    seed, n = torch.tensor(12345), 2000
    for top_p, want in ((1.0, p), (0.8, nucleus / nucleus.sum())):
        tokens = torch.cat([sample_token(logits.expand(n, 6), 0.7, top_p, noise=race_noise(seed, torch.tensor([s]), (n, 6)))
                            for s in range(10)])
        freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
        assert ((freq - want).abs() <= 4 * (want * (1 - want) / len(tokens)).sqrt() + 1e-12).all(), (top_p, freq, want)
    other = sample_token(logits.expand(n, 6), 0.7, 1.0, noise=race_noise(torch.tensor(54321), torch.tensor([0]), (n, 6)))
    assert (other != tokens[:n]).float().mean() > 0.3  # another seed, other draws


@pytest.mark.slow
def test_static_generation_on_xla_compiles_the_same_graphs_whatever_the_length_and_draws_as_cpu():
    """generate(static=True) under torch_xla SPMD (4 CPU devices, rows sharded), temperature 1.5, top_p 0.9, an eos and
    suppressed ids: the same tokens as CPU eager, and as many compiled graphs for 12 new tokens as for 3 (each decode
    step is one graph: the cache slot is a tensor); a second call with new prompts compiles nothing."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_NUM_THREADS": "1",
                        "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    r = subprocess.run([sys.executable, str(ROOT / "tests/xla_generate.py")], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = json.loads(r.stdout.splitlines()[-1])
    assert [c["max_new"] for c in calls] == [3, 12, 12]
    for c in calls:
        assert c["xla"] == c["cpu"] and len(c["xla"]) == 8 and all(len(row) == c["max_new"] for row in c["xla"])
    assert any(5 in row for row in calls[1]["xla"]) and all(t < 80 for c in calls for row in c["xla"] for t in row)
    assert calls[0]["compiles"] == calls[1]["compiles"] <= 4 and calls[2]["compiles"] == 0, calls


def test_logits_to_keep_are_the_last_positions_logits():
    """RL's log-probs read only the completion's logits (HF's logits_to_keep): (B, k, vocab), not (B, T, vocab)."""
    from model import build_model
    from model_config import vlm_preset

    model = build_model(vlm_preset("debug").with_overrides({"llm": {"vocab_size": 64}, "image_token_id": 60}), seed=0)
    ids = torch.randint(1, 60, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(11) >= torch.tensor([[0], [4], [7]])).long()  # left padding
    with torch.no_grad():
        full, _ = model(ids, attention_mask=mask)
        kept, _ = model(ids, attention_mask=mask, logits_to_keep=5)
    assert kept.shape == (3, 5, 64) and torch.allclose(kept, full[:, -5:], atol=1e-6)


def test_prompts_are_cut_where_the_answer_starts(tmp_path):
    import loader
    from shapes import make_shapes

    make_shapes(tmp_path, n=24, seed=0, val_fraction=0.2)
    stream = loader.ShardStream(tmp_path / "shards", tmp_path / "tokenizer.model", split="train", batch_size=8, seq_len=48,
                              image_size=28, image_token_id=512, n_image_tokens=4, template="llama_3")
    b = stream.batch(0)
    stop = chat.stop_token_id("llama_3", stream.tok)
    for r, prompt, answer in rl.prompts_of(b):
        conv, image = loader.sample_conversation(stream.read(int(b["sample_id"][r]))[1])
        want_prompt, want_answer = chat.prompt_and_answer(conv, image is not None, "llama_3", stream.tok, 512, 4)
        assert prompt == list(want_prompt) and chat.decode_answer(stream.tok, answer, stop) == want_answer.strip()


@pytest.mark.parametrize("reward", ["rule", "reward_model"])
def test_grpo_loop_logs_its_metrics(shapes_pairs, tmp_path, reward):  # noqa: F811
    from test_dpo import debug_init, dpo_args

    from model import build_model

    init = debug_init(tmp_path / "init")
    spec = "test_grpo:short_answers"
    if reward == "reward_model":
        judge = build_model(model_files.load_model(init).cfg.with_overrides({"reward_head": True}), seed=5)
        model_files.save_model(judge, tmp_path / "judge")
        spec = str(tmp_path / "judge")
    steps = 4 if reward == "rule" else 2
    train.main(dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--objective=grpo",
                        f"--data_dir={shapes_pairs / 'shards'}", f"--grpo_reward={spec}", f"--max_iters={steps}",
                        "--batch_size=4", "--micro_batch_size=2", "--grpo_group=4", "--grpo_iterations=2",
                        "--grpo_beta=0.05", "--lr=3e-3", "--warmup_iters=1", f"--lr_decay_iters={steps}",
                        "--eval_interval=0", "--final_accuracy_samples=8", "--grpo_max_new_tokens=6"))
    events = run_log(tmp_path / "out")
    logged = [e for e in events if "rl/reward" in e]
    assert [e["step"] for e in logged] == list(range(1, steps + 1))
    for key in ("rl/kl", "rl/clip_ratio", "rl/entropy", "rl/completion_length", "rl/reward_std"):
        assert all(math.isfinite(e[key]) for e in logged), key
    generated = [e["step"] for e in logged if e.get("gen_samples_per_s", 0) > 0 and e["train_samples_per_s"] > 0]
    assert generated == list(range(1, steps + 1, 2))  # rollouts every grpo_iterations steps
    assert logged[0]["rl/kl"] == 0 and logged[0]["rl/clip_ratio"] == 0  # the first step: policy = reference = sampler
    assert logged[1]["rl/kl"] > 0  # the second step reuses the rollouts after one update: ratio and KL move


def small_model_and_stream(dataset, batch_size, seq_len):
    """The debug VLM at 28 px (4 image tokens) and the shapes SFT stream it reads: the rollout tests' setup."""
    import loader
    from model_config import vlm_preset

    cfg = vlm_preset("debug").with_overrides({"vision": {"image_size": 28, "patch_size": 14},
                                             "llm": {"vocab_size": 576}, "image_token_id": 512})
    return cfg, loader.ShardStream(dataset / "shards", dataset / "tokenizer.model", split="train",
                                 batch_size=batch_size, seq_len=seq_len, image_size=28, image_token_id=512,
                                 n_image_tokens=4, template="llama_3")


def test_one_grpo_update_moves_probability_towards_positive_advantages(shapes_pairs):  # noqa: F811
    """A rollout from a shapes batch, one small SGD step on rl_loss: sum_i A_i (log-prob_i after - before) > 0 (the
    policy gradient's first-order effect), and the completions' stop token and suppressed ids are as sampled."""
    from model import build_model

    cfg, stream = small_model_and_stream(shapes_pairs, batch_size=4, seq_len=48)
    model = build_model(cfg, seed=0)
    b = stream.batch(0)
    stop = chat.stop_token_id("llama_3", stream.tok)
    run = dict(config.DEFAULTS) | {"grpo_group": 4, "grpo_max_new_tokens": 6}
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


@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo"])
def test_a_static_rollout_trains_on_its_skipped_rows_as_if_they_were_absent(shapes_pairs, kind):  # noqa: F811
    """Static rollouts keep every row: a prompt longer than the bucket (and a row the loader dropped) is generated from
    padding. Those rows must weigh nothing: the loss per unit, its KL, clip ratio and entropy, and the reward metrics
    equal those of the kept rows alone (taken out of the same rollout and scored as an eager rollout would be)."""
    from model import build_model

    cfg, stream = small_model_and_stream(shapes_pairs, batch_size=8, seq_len=48)
    model, reference = build_model(cfg, seed=0), build_model(cfg, seed=1)
    b = stream.batch(1)
    lengths = sorted(len(p) for _, p, _ in rl.prompts_of(b))
    bucket = next(n for n in lengths if n < lengths[-1])  # the shortest prompts fit, the longest do not
    run = dict(config.DEFAULTS) | {"grpo_group": 3, "grpo_max_new_tokens": 6, "grpo_prompt_len": bucket,
                                  "grpo_loss": kind, "grpo_beta": 0.1, "grpo_iterations": 2}
    score = lambda texts, answers, *_: torch.tensor(short_answers(texts, answers))  # noqa: E731
    stop = chat.stop_token_id("llama_3", stream.tok)
    r, _, texts = rl.rollout(model, b, stream.tok, stop, run, score, torch.Generator().manual_seed(0), reference,
                             static=True)
    kept = r["mask"][:, bucket - 1] == 1  # a row with a prompt ends it with a real token
    assert r["skipped"] == sum(n > bucket for n in lengths) and 0 < kept.sum() < len(kept)
    assert (r["completion_mask"][~kept] == 0).all()
    alone = {k: r[k][kept] for k in ("ids", "mask", "pixel_values", "completion_mask", "advantages", "old_logps",
                                     "ref_logps")}
    n = int(kept.sum())
    alone["units"] = alone["completion_mask"].sum() if kind == "dapo" else torch.tensor(float(n * (6 if kind == "dr_grpo"
                                                                                              else 1)))
    with torch.no_grad():
        loss, metrics = rl.rl_loss(model, r, run)
        loss_alone, metrics_alone = rl.rl_loss(model, alone | {"metrics": {}}, run)
    assert abs(loss / r["units"] - loss_alone / alone["units"]) < 1e-6 and r["units"] == alone["units"]
    for k in ("rl/kl", "rl/clip_ratio", "rl/entropy"):
        assert abs(metrics[k] - metrics_alone[k]) < 1e-6, k
    rewards = torch.tensor(short_answers([t for t, keep in zip(texts, kept) if keep], []))
    assert abs(metrics["rl/reward"] - rewards.mean()) < 1e-6
    assert abs(metrics["rl/reward_std"] - rewards.view(-1, 3).std(dim=1).mean()) < 1e-6


@pytest.mark.parametrize("extra,message", [
    (["--grpo_loss=ppo"], "grpo_loss must be one of"),
    (["--grpo_group=1"], "grpo_group must be >= 2"),
    (["--grpo_reward=no_such_module:f"], "grpo_reward 'no_such_module:f': cannot import it"),
    (["--grpo_reward=cosine"], "expected \\['exact_match'\\]"),
    (["--pack=2"], "pack must be 0"),
    (["--grpo_static=True", "--grpo_prompt_len=41"], "static rollouts need grpo_prompt_len in \\[1, seq_len - grpo_"),
    (["--device=xla", "--grpo_max_new_tokens=48"], "static rollouts need grpo_prompt_len in \\[1, .* = 0\\]"),
    (["--grpo_beta=0.1", "--init_from=scratch"], "grpo_beta > 0 needs a reference checkpoint"),
    (["--grpo_scale_rewards=std"], "grpo_scale_rewards must be one of \\('group', 'batch', 'none'\\), got 'std'"),
    (["--grpo_epsilon_high=-0.1"], "grpo_epsilon_high must be >= 0"),
])
def test_grpo_config_errors_are_one_sentence(tmp_path, extra, message):
    from test_dpo import dpo_args

    with pytest.raises(SystemExit, match=message):
        train.main(dpo_args(tmp_path, tmp_path / "out", "--init_from=ckpt", "--objective=grpo", *extra))


def test_rl_configs_parse():
    from conftest import ROOT

    assert config.load_config([str(ROOT / "configs/grpo_shapes.py")])["objective"] == "grpo"
    assert config.load_config([str(ROOT / "configs/reward_shapes.py")])["objective"] == "reward"


def test_grpo_onevision_config_is_trls_recipe():
    """configs/grpo_onevision.py against TRL 1.16's own GRPOConfig defaults (what its grpo_vlm.py runs with) and
    train.py's checks: every value that has a TRL counterpart is TRL's."""
    import dataclasses

    from conftest import ROOT
    from trl import GRPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    cfg = config.load_config([str(ROOT / "configs/grpo_onevision.py")])
    config.check_objective(cfg)
    ours = {"loss_type": "grpo_loss", "beta": "grpo_beta", "num_generations": "grpo_group", "temperature":
            "grpo_temperature", "top_p": "grpo_top_p", "epsilon": "grpo_epsilon", "num_iterations": "grpo_iterations",
            "max_completion_length": "grpo_max_new_tokens", "learning_rate": "lr", "weight_decay": "weight_decay",
            "max_grad_norm": "grad_clip", "adam_beta1": "beta1", "adam_beta2": "beta2", "warmup_steps": "warmup_iters",
            "gradient_checkpointing": "activation_checkpointing", "ds3_gather_for_generation":
            "grpo_gather_for_generation"}
    assert {k: cfg[v] for k, v in ours.items()} == {k: trl[k] for k in ours}
    assert cfg["batch_size"] * cfg["grpo_group"] == 8 * trl["per_device_train_batch_size"]  # on 8 GPUs
    assert (cfg["model"], cfg["template"], cfg["parallel"], cfg["min_lr"]) == ("llava-onevision-qwen2-7b", "chatml",
                                                                               "fsdp", 0.0)
    from model_config import vlm_preset

    assert cfg["seq_len"] + cfg["grpo_max_new_tokens"] <= vlm_preset(cfg["model"]).llm.max_seq_len


@pytest.mark.parametrize("iterations,stop,scale", [(1, 2, "group"), (2, 3, "batch")])
def test_grpo_resumes_exactly(shapes_pairs, tmp_path, iterations, stop, scale):  # noqa: F811
    """4 steps straight, or `stop` then a resume for the rest: the same rollouts (sampler seeded by step), rewards and
    loss; stopped inside a generation batch (grpo_iterations 2, step 3), the resume trains on the saved rollouts (with
    grpo_scale_rewards='batch', two micro-batches: their advantages divided by the whole generation batch's std)."""
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = ["--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=test_grpo:short_answers",
              "--batch_size=2", f"--micro_batch_size={2 if scale == 'group' else 1}", "--grpo_group=3",
              "--grpo_beta=0.05", f"--grpo_reference={init}", "--lr=3e-3", "--warmup_iters=1", "--lr_decay_iters=4",
              "--eval_interval=0", "--final_accuracy_samples=0", "--grpo_max_new_tokens=5", "--ckpt_interval=2",
              f"--grpo_iterations={iterations}", f"--grpo_scale_rewards={scale}"]
    train.main(dpo_args(shapes_pairs, tmp_path / "straight", f"--init_from={init}", "--max_iters=4", *common))
    train.main(dpo_args(shapes_pairs, tmp_path / "resumed", f"--init_from={init}", f"--max_iters={stop}", *common))
    train.main(dpo_args(shapes_pairs, tmp_path / "resumed", "--init_from=resume", "--max_iters=4", *common))
    straight, resumed = run_log(tmp_path / "straight", "rl/reward"), run_log(tmp_path / "resumed", "rl/reward")
    assert [e["step"] for e in resumed] == [1, 2, 3, 4]
    for want, got in zip(straight, resumed, strict=True):
        for k in ("loss", "rl/reward", "rl/kl", "rl/completion_length"):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
    assert (tmp_path / "resumed" / f"step-{stop:06d}" / "rank0.safetensors").exists() == (stop % iterations != 0)


@pytest.mark.full  # make test: GRPO in one process, FSDP2 by tests/test_train.py
def test_grpo_under_torchrun_fsdp_matches_ddp_and_resumes_exactly(shapes_pairs, tmp_path):  # noqa: F811
    """2 ranks x 2 prompts, rewards from a reward-model checkpoint, a KL to a reference, 2 updates a generation batch:
    FSDP2 (judge and reference sharded too) logs what DDP logs (each rank samples the same prompts, seeded by rank,
    step and micro-batch), and FSDP2 stopped after 3 steps (inside a generation batch) and resumed gives the
    uninterrupted run's steps 4 to 6 (step 4's rollouts kept in the checkpoint, the loader's position, the reward
    model and reference reloaded). The first FSDP2 run keeps the blocks gathered through a generation
    (grpo_gather_for_generation), the resumed one gathers each block at every decoding step, the ranks in lockstep."""
    from test_dpo import debug_init, dpo_args
    from test_train import run

    from model import build_model


    policy = model_files.load_model(debug_init(tmp_path / "random"))
    stop = chat.stop_token_id("llama_3", chat.Tokenizer(shapes_pairs / "tokenizer.model"))
    with torch.no_grad():  # the stop token likely at about half the positions: completions of different lengths, so
        policy.llm.output.weight[stop] *= 10  # FSDP2's ranks, which decode every step, must end where DDP's stop
    model_files.save_model(policy, init := tmp_path / "init")
    judge = build_model(policy.cfg.with_overrides({"reward_head": True}), seed=5)
    model_files.save_model(judge, tmp_path / "judge")  # a random reward model: rewards that differ within a group
    common = [f"--grpo_reward={tmp_path / 'judge'}", "--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}",
              "--batch_size=4", "--micro_batch_size=1", "--grpo_group=3", "--grpo_beta=0.05",
              f"--grpo_reference={init}", "--grpo_iterations=2", "--lr=1e-4", "--warmup_iters=1",
              "--lr_decay_iters=6", "--eval_interval=0", "--final_accuracy_samples=6", "--grpo_max_new_tokens=6",
              "--ckpt_interval=2"]
    ddp_out = run(dpo_args(shapes_pairs, tmp_path / "ddp", f"--init_from={init}", "--max_iters=6", "--parallel=ddp",
                           *common), nproc=2).stdout
    # stopped inside a generation batch: step 4 reuses step 3's rollouts, saved in the checkpoint; step 5 samples
    # anew, scored by the reloaded reward model, with the reloaded reference's KL
    run(dpo_args(shapes_pairs, tmp_path / "fsdp", f"--init_from={init}", "--max_iters=3", "--parallel=fsdp", *common,
                 "--grpo_gather_for_generation=True"), nproc=2)
    fsdp_out = run(dpo_args(shapes_pairs, tmp_path / "fsdp", "--init_from=resume", "--max_iters=6", "--parallel=fsdp",
                            *common), nproc=2).stdout
    ddp, fsdp = run_log(tmp_path / "ddp", "rl/reward"), run_log(tmp_path / "fsdp", "rl/reward")
    answers = lambda out: [line for line in out.splitlines() if line.startswith(("  Q: ", "held-out"))]  # noqa: E731
    assert answers(fsdp_out) == answers(ddp_out) and len(answers(ddp_out)) > 1  # the final greedy answers
    assert [e["step"] for e in fsdp] == [1, 2, 3, 4, 5, 6]
    for want, got in zip(ddp, fsdp, strict=True):
        for k in ("loss", "rl/reward", "rl/reward_std", "rl/kl", "rl/clip_ratio", "rl/completion_length", "grad_norm"):
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
    assert ddp[1]["rl/kl"] > 0 and ddp[3]["rl/kl"] > 0 and len({e["rl/reward"] for e in ddp}) > 1
    assert all(1 < e["rl/completion_length"] < 6 for e in ddp)  # rows (and ranks) that stopped at different steps


@pytest.mark.full  # make test: tests/test_xla.py for SFT on XLA
def test_grpo_on_xla_spmd_compiles_once_and_matches_cpu_eager(shapes_pairs, tmp_path, capsys):  # noqa: F811
    """5 GRPO steps under torch_xla SPMD on 4 CPU devices (fsdp 4), with a KL reference, against the same run on CPU
    eager with grpo_static=True: static rollouts draw from hashed noise, so both sample the same completions, and
    rewards, KL and losses agree. Prompts of 23-28 tokens in a bucket of 26: both skip the same longer ones. The first
    rollout compiles its graphs (prefill, decode step, last draw); after step 2 (AdamW's step count) nothing compiles."""
    from conftest import ROOT, assert_same_logs, run_log, train_on_xla
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", "--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}",
              "--grpo_reward=test_grpo:short_answers", "--batch_size=4", "--micro_batch_size=4", "--grpo_group=3",
              "--grpo_beta=0.05", "--grpo_max_new_tokens=5", "--grpo_prompt_len=26", "--seq_len=40", "--max_iters=5",
              "--lr=3e-3", "--warmup_iters=1", "--eval_interval=0", "--ckpt_interval=0", "--final_accuracy_samples=0"]
    train.main(dpo_args(shapes_pairs, tmp_path / "cpu", *common, "--grpo_static=True"))
    cpu_out = capsys.readouterr().out
    r = train_on_xla(dpo_args(shapes_pairs, tmp_path / "xla", *common), timeout=600,
                     env={"PYTHONPATH": str(ROOT / "tests")})
    assert "grpo: static rollouts, prompts left-padded to 26 tokens" in r.stdout  # XLA needs no grpo_static
    skipped = [line for line in cpu_out.splitlines() if "longer than grpo_prompt_len=26 skipped" in line]
    assert skipped and skipped == [line for line in r.stdout.splitlines() if "longer than grpo_prompt_len" in line]
    cpu, xla = run_log(tmp_path / "cpu", "rl/reward"), run_log(tmp_path / "xla", "rl/reward")
    assert [e["step"] for e in cpu] == [1, 2, 3, 4, 5]
    assert_same_logs(cpu, xla, ("loss", "rl/reward", "rl/reward_std", "rl/kl", "rl/entropy", "rl/completion_length"))
    assert cpu[-1]["rl/kl"] > 0 and len({e["rl/reward"] for e in cpu}) > 1  # the policy moved; the samples differ


@pytest.mark.parametrize("static", [False, True])
def test_tiled_rollouts_place_each_prompts_tiles_as_the_row_run_alone(shapes_pairs, tmp_path, static):  # noqa: F811
    """The tile path (anyres_max, several image sizes, questions of several lengths): the rollout left-pads the prompts,
    shifting each row's tile placement with it; every completion's log-probs equal those of its row run alone, unpadded,
    with the placement the loader gave it. The tiles reach generation: other pixels, other samples. Static: prompts
    padded to a bucket below the longest (which is skipped: no completion) and above the others."""
    from test_dpo import tiled_pairs
    from xla_runs import TILED_MODEL

    import loader
    from model import build_model
    from model_config import vlm_preset

    tiled_pairs(tmp_path, ["How many circles are there?",
                           "Count the circles in this picture, please. How many are there?", "Circles?"])
    cfg = vlm_preset("debug").with_overrides(TILED_MODEL)
    stream = loader.ShardStream(tmp_path / "shards", shapes_pairs / "tokenizer.model", batch_size=3, seq_len=160,
                              image_size=28, image_token_id=512, n_image_tokens=4, template="llama_3", vlm=cfg,
                              max_tiles=5, shuffle_block=1)
    model = build_model(cfg, seed=0).eval()
    stop = chat.stop_token_id("llama_3", stream.tok)
    run = dict(config.DEFAULTS) | {"grpo_group": 2, "grpo_max_new_tokens": 5, "grpo_beta": 0.1, "grpo_iterations": 2}
    lengths = sorted({len(p) for k in range(2) for _, p, _ in rl.prompts_of(stream.batch(k))})
    bucket = lengths[-1] - 1  # the longest prompts are skipped, the others padded by 1 or more beyond their batch's
    if static:
        run |= {"grpo_static": True, "grpo_prompt_len": bucket}
    score = lambda texts, answers, *_: torch.tensor(short_answers(texts, answers))  # noqa: E731
    for k in range(2):
        b = stream.batch(k)  # the loader's host batch, as train.py hands it to rollout (which normalises the pixels)
        pixels = images.normalize_images(b["pixel_values"], *cfg.vision.image_stats)
        asked = rl.prompts_of(b)
        assert len({len(p) for _, p, _ in asked}) > 1  # prompts of different lengths: left padding moves the tiles
        r, _, _ = rl.rollout(model, b, stream.tok, stop, run, score, torch.Generator().manual_seed(k), ref_model=model,
                             static=static)
        C = r["completion_mask"].shape[1]
        assert r["skipped"] == (sum(len(p) > bucket for _, p, _ in asked) if static else 0)
        for row in range(len(r["ids"])):
            src, prompt = asked[row // 2][0], asked[row // 2][1]
            n = int(r["completion_mask"][row].sum())
            if static and len(prompt) > bucket:
                assert n == 0
                continue
            ids = torch.tensor(prompt + r["ids"][row, -C:][:n].tolist())[None]
            tiles = {key: torch.nn.functional.pad(b[key][src, : len(prompt)], (0, 0, 0, n))[None]
                     for key in ("image_index", "image_weight")}
            with torch.no_grad():
                alone, _ = rl.completion_logps(model, ids, torch.ones_like(ids), pixels[src][None], n,
                                               tiles=tiles)
            assert torch.allclose(r["old_logps"][row, :n], alone[0], atol=1e-5), (k, row)
            assert torch.allclose(r["ref_logps"][row, :n], alone[0], atol=1e-5)
        other = dict(b, pixel_values=torch.randint_like(b["pixel_values"], 0, 256))  # other images (uint8, as loaded)
        again, _, _ = rl.rollout(model, other, stream.tok, stop, run, score, torch.Generator().manual_seed(k), model,
                                 static=static)
        assert not torch.equal(again["ids"], r["ids"])


@pytest.mark.parametrize("dropped", [[0, 1, 2, 3], [1, 2]])
def test_rows_the_loader_dropped_are_generated_from_padding_and_weigh_nothing(shapes_pairs, dropped):  # noqa: F811
    """A micro-batch whose prompts the loader dropped (too long for seq_len: no labels), all or some, outside static
    rollouts: every row is still generated (under FSDP2 every rank must run generate's collectives), a dropped one
    from padding, and it weighs nothing: no completion tokens, no units, no gradient."""
    from model import build_model

    cfg, stream = small_model_and_stream(shapes_pairs, batch_size=4, seq_len=48)
    model = build_model(cfg, seed=0)
    b = stream.batch(0)
    b["labels"][dropped] = -100  # as the loader leaves a dropped sample
    stop = chat.stop_token_id("llama_3", stream.tok)
    run = dict(config.DEFAULTS) | {"grpo_group": 3, "grpo_max_new_tokens": 6, "grpo_beta": 0.1, "grpo_iterations": 2}
    score = lambda texts, answers, *_: torch.tensor(short_answers(texts, answers))  # noqa: E731
    r, _, texts = rl.rollout(model, b, stream.tok, stop, run, score, torch.Generator().manual_seed(0), model)
    gone = torch.zeros(4, dtype=torch.bool)
    gone[dropped] = True
    gone = gone.repeat_interleave(3)
    assert len(r["ids"]) == len(texts) == 12 and (r["completion_mask"][gone] == 0).all()
    assert (r["completion_mask"][~gone].sum(1) > 0).all() and r["units"] == r["completion_mask"].sum()
    loss, metrics = rl.rl_loss(model, r, run)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and all(math.isfinite(float(v)) for v in metrics.values())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert all((g == 0).all() for g in grads) == bool(gone.all())
    resumed = rl.rollouts_from_state(rl.rollouts_state([r]), "cpu")[0]  # a checkpoint inside the generation batch
    assert resumed["asked"] == r["asked"] == 4 - len(dropped)  # whether the micro-batch's metrics count


def test_grpo_under_torchrun_fsdp_survives_a_rank_whose_prompts_were_all_dropped(shapes_pairs, tmp_path):  # noqa: F811
    """seq_len 25 drops the prompts of 25 tokens or more (about half of them): with one prompt a rank a micro-batch, a
    rank often has none while the other has one; lockstep decoding needs both to generate (one raising or skipping
    would hang or kill the other)."""
    from test_dpo import debug_init, dpo_args
    from test_train import run

    init = debug_init(tmp_path / "init")
    r = run(dpo_args(shapes_pairs, tmp_path / "fsdp", f"--init_from={init}", "--objective=grpo",
                     f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=exact_match", "--seq_len=25",
                     "--batch_size=2", "--micro_batch_size=1", "--max_iters=3", "--grpo_group=2",
                     "--grpo_max_new_tokens=3", "--parallel=fsdp", "--eval_interval=0", "--ckpt_interval=0",
                     "--final_accuracy_samples=0"), nproc=2)
    assert "no_supervised_tokens" in r.stdout + r.stderr
    logged = run_log(tmp_path / "fsdp")
    assert [e["step"] for e in logged if "rl/reward" in e] == [1, 2, 3]
    # the metrics are means over the micro-batches with prompts: an empty one does not halve them (3 new tokens, a
    # random policy that never stops: every completion has 3)
    assert all(e["rl/completion_length"] in (0, 3) for e in logged if "rl/reward" in e), logged


def test_a_skipped_step_that_starts_a_generation_batch_leaves_no_rollouts_behind(shapes_pairs, tmp_path):  # noqa: F811
    """grpo_iterations 2, skip_steps [(2, 3)]: iteration 2 would start a generation batch; its batch is consumed and
    nothing trains, so iteration 3 has no rollouts of its own and must sample a new batch (the policy that sampled it
    is the one trained: clip ratio 0), not train again on iteration 0's. Stopped at 3 and resumed, the same."""
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", "--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}",
              "--grpo_reward=test_grpo:short_answers", "--batch_size=2", "--micro_batch_size=2", "--grpo_group=3",
              "--grpo_iterations=2", "--skip_steps=[(2, 3)]", "--lr=3e-2", "--warmup_iters=0", "--eval_interval=0",
              "--final_accuracy_samples=0", "--grpo_max_new_tokens=5", "--ckpt_interval=3"]
    train.main(dpo_args(shapes_pairs, tmp_path / "straight", "--max_iters=5", *common))
    train.main(dpo_args(shapes_pairs, tmp_path / "resumed", "--max_iters=3", *common))
    train.main(dpo_args(shapes_pairs, tmp_path / "resumed", "--max_iters=5", *common[1:], "--init_from=resume"))
    straight, resumed = run_log(tmp_path / "straight", "rl/reward"), run_log(tmp_path / "resumed", "rl/reward")
    assert [e["step"] for e in straight] == [1, 2, 4, 5]
    assert [e["step"] for e in straight if e.get("gen_samples_per_s")] == [1, 4, 5]
    assert straight[2]["rl/clip_ratio"] == 0 and straight[1]["rl/clip_ratio"] > 0
    for want, got in zip(straight, resumed, strict=True):
        for k in ("loss", "rl/reward", "rl/completion_length"):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])


@pytest.mark.parametrize("judge,message", [
    ({"llm": {"vocab_size": 300}, "image_token_id": 290}, "vocab_size 300 != 576"),  # an IndexError in the embedding
    ({"image_token_id": 513}, "image_token_id 513 != 512"),  # silently: the policy's images were text to it
    ({"vision": {"image_size": 42, "patch_size": 14}}, "image_size 42 != 28"),  # a shape error inside its ViT
    ("tokenizer", "its tokenizer .* encodes text unlike the run's"),  # same sizes, other pieces
])
def test_a_reward_model_that_reads_ids_or_images_unlike_the_policy_is_refused(shapes_pairs, tmp_path,  # noqa: F811
                                                                              judge, message):
    """The reward model scores the policy's token ids and pixels: another vocabulary, image placeholder, image size or
    tokenizer (its checkpoint's own, trained on other text) is one sentence at setup, not a wrong index later. A
    reward model of another width reads them as the policy does and is accepted."""
    import shutil

    from test_dpo import debug_init, dpo_args

    from model import build_model
    from shapes import train_tokenizer

    init = debug_init(tmp_path / "init")
    policy = model_files.load_model(init).cfg
    overrides = {"reward_head": True} | (judge if judge != "tokenizer" else {})
    model_files.save_model(build_model(policy.with_overrides(overrides), seed=5), tmp_path / "judge")
    if judge == "tokenizer":
        texts = [f"{w} {n} {w[::-1]}" for n in range(200) for w in ("alpha", "beta", "gamma", "delta")]
        train_tokenizer(texts, tmp_path / "judge" / "tokenizer", 300)
    else:
        shutil.copy(shapes_pairs / "tokenizer.model", tmp_path / "judge")  # the run's own: not what is refused
    args = dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--objective=grpo",
                    f"--data_dir={shapes_pairs / 'shards'}", f"--grpo_reward={tmp_path / 'judge'}", "--max_iters=1",
                    "--batch_size=2", "--micro_batch_size=2", "--grpo_group=2", "--grpo_max_new_tokens=3",
                    "--eval_interval=0", "--ckpt_interval=0", "--final_accuracy_samples=0")
    with pytest.raises(SystemExit, match=f"grpo_reward '{tmp_path / 'judge'}': .*{message}"):
        train.main(args)
    if judge == "tokenizer":  # a narrower reward model with the run's tokenizer: accepted
        shutil.rmtree(tmp_path / "judge")
        model_files.save_model(build_model(policy.with_overrides({"reward_head": True, "llm": {"dim": 32, "n_heads": 2,
                                                                                          "n_kv_heads": 2}}), seed=5),
                            tmp_path / "judge")
        shutil.copy(shapes_pairs / "tokenizer.model", tmp_path / "judge")
        train.main(args)


def test_rollouts_past_the_models_max_seq_len_are_refused_at_setup(shapes_pairs, tmp_path):  # noqa: F811
    """A model of max_seq_len 30 and seq_len 30: prompts of up to 29 tokens plus 8 new ones do not fit the model;
    one sentence at setup, not a ValueError from generate at the first long prompt."""
    from test_dpo import debug_init, dpo_args

    from model import build_model

    model = model_files.load_model(debug_init(tmp_path / "init"))
    model.cfg.llm.max_seq_len = 30
    model_files.save_model(build_model(model.cfg, seed=0), tmp_path / "short")
    args = dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={tmp_path / 'short'}", "--objective=grpo",
                    f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=exact_match", "--max_iters=2",
                    "--batch_size=8", "--micro_batch_size=8", "--grpo_group=2", "--grpo_max_new_tokens=8",
                    "--seq_len=30", "--eval_interval=0", "--ckpt_interval=0", "--final_accuracy_samples=0")
    with pytest.raises(SystemExit, match="seq_len - 1 prompt tokens \\+ grpo_max_new_tokens = 37 exceed the model's "
                                         "max_seq_len=30"):
        train.main(args)


@pytest.mark.parametrize("change", ["--grpo_beta=0.05", "--grpo_loss=grpo", "--grpo_group=4", "--grpo_scale_rewards=none",
                                    "--grpo_reference"])
def test_a_resume_that_changes_how_rollouts_are_made_samples_a_new_generation_batch(shapes_pairs,  # noqa: F811
                                                                                   tmp_path, capsys, change):
    """Stopped inside a generation batch (grpo_iterations 2, step 3) and resumed with another grpo_beta (the saved
    rollouts have no reference log-probs: a TypeError), grpo_loss (their loss units are the old kind's) or grpo_group:
    the saved batch is not trained on, a new one is sampled, and the run says why. Naming the reference that was
    init_from (as a resume must) keeps it."""
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = ["--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=test_grpo:short_answers",
              "--batch_size=2", "--micro_batch_size=2", "--grpo_group=3", "--grpo_iterations=2", "--lr=3e-3",
              "--warmup_iters=1", "--eval_interval=0", "--final_accuracy_samples=0", "--grpo_max_new_tokens=5",
              "--ckpt_interval=2"]
    reference = f"--grpo_reference={init}"
    first = ["--grpo_beta=0.05"] if change == "--grpo_reference" else [reference]
    train.main(dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--max_iters=3", *common, *first))
    capsys.readouterr()
    again = [reference, "--grpo_beta=0.05"] if change == "--grpo_reference" else [reference, change]
    train.main(dpo_args(shapes_pairs, tmp_path / "out", "--init_from=resume", "--max_iters=4", *common, *again))
    out = capsys.readouterr().out
    logged = run_log(tmp_path / "out")
    if change == "--grpo_reference":
        assert "sampled with other" not in out
        assert [e["step"] for e in logged if e.get("gen_samples_per_s")] == [1, 3]
        return
    assert f"sampled with other {change[2:].split('=')[0]}" in out
    assert [e["step"] for e in logged if e.get("gen_samples_per_s")] == [1, 3, 4]
    assert math.isfinite(logged[-1]["loss"]) and logged[-1]["rl/clip_ratio"] == 0


@pytest.mark.parametrize("reward", ["rule", "reward_model"])
def test_a_reference_answer_cut_at_seq_len_is_not_a_rules_reference(shapes_pairs, tmp_path, reward):  # noqa: F811
    """seq_len 26: a prompt of 25 tokens keeps one answer token of two (the word, not <|eot_id|>): exact_match would
    reward a completion that stops there. A rule reward skips (and counts) those rows; a reward model, which never
    reads the reference, keeps them. Answers that end with the stop token are kept either way."""
    from model import build_model

    cfg, stream = small_model_and_stream(shapes_pairs, batch_size=8, seq_len=26)
    model = build_model(cfg, seed=0)
    stop = chat.stop_token_id("llama_3", stream.tok)
    b = next(stream.batch(k) for k in range(20) if any(stop not in a for _, _, a in rl.prompts_of(stream.batch(k))))
    cut = {r for r, _, a in rl.prompts_of(b) if stop not in a}
    whole = {r for r, _, a in rl.prompts_of(b) if stop in a}
    assert cut and whole
    run = dict(config.DEFAULTS) | {"grpo_group": 2, "grpo_max_new_tokens": 4,
                                  "grpo_reward": "exact_match" if reward == "rule" else str(tmp_path)}
    seen = []
    score = lambda texts, answers, *_: seen.extend(answers) or torch.zeros(len(texts))  # noqa: E731
    r, _, _ = rl.rollout(model, b, stream.tok, stop, run, score, torch.Generator().manual_seed(0))
    kept = {row // 2 for row in range(len(r["ids"])) if r["completion_mask"][row].sum() > 0}
    assert kept == (whole if reward == "rule" else whole | cut) and r.get("cut", 0) == (len(cut) if reward == "rule" else 0)


def one_reward_short(completions, answers):
    return [1.0] * (len(completions) - 1)


def reward_none(completions, answers):
    return None


def reward_strings(completions, answers):
    return ["1"] * len(completions)


def reward_scalar(completions, answers):
    return 1.0


@pytest.mark.parametrize("rule", ["one_reward_short", "reward_none", "reward_strings", "reward_scalar"])
def test_a_reward_rule_that_does_not_return_one_float_a_completion_is_one_sentence(shapes_pairs, tmp_path,  # noqa: F811
                                                                                    rule):
    """A user's 'module:function' returning one reward too few, None, strings or a scalar: one sentence naming the
    rule (it raised a shape error in group_advantages, or a TypeError / ValueError inside torch.tensor)."""
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    with pytest.raises(SystemExit, match=f"grpo_reward 'test_grpo:{rule}': expected a list of 8 floats, one a "
                                         f"completion"):
        train.main(dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--objective=grpo",
                            f"--data_dir={shapes_pairs / 'shards'}", f"--grpo_reward=test_grpo:{rule}", "--max_iters=1",
                            "--batch_size=4", "--micro_batch_size=4", "--grpo_group=2", "--grpo_max_new_tokens=3",
                            "--eval_interval=0", "--ckpt_interval=0", "--final_accuracy_samples=0"))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.full)])
def test_lora_grpo_kl_reference_is_the_policy_with_adapters_off(shapes_pairs, tmp_path, capsys, dtype):  # noqa: F811
    """grpo_beta > 0 with LoRA and no grpo_reference: the policy with its adapters off (and its projector at its
    start values) gives the frozen copy's rollouts, KL and loss. bf16: autocast's cast cache handed the reference
    the projector the policy had generated with (the KL 15x too small)."""
    from test_dpo import debug_init, dpo_args

    init = debug_init(tmp_path / "init")
    common = ["--objective=grpo", f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=test_grpo:short_answers",
              "--batch_size=2", "--micro_batch_size=2", "--grpo_group=3", "--grpo_beta=0.05", "--lr=3e-3",
              "--warmup_iters=1", "--eval_interval=0", "--final_accuracy_samples=0", "--grpo_max_new_tokens=5",
              "--max_iters=3", "--stage=2", "--lora={'r': 4, 'alpha': 8, 'targets': ['llm']}", f"--init_from={init}",
              f"--dtype={dtype}"]
    train.main(dpo_args(shapes_pairs, tmp_path / "off", *common))
    assert "grpo: reference model = the policy with its LoRA adapters off" in capsys.readouterr().out
    train.main(dpo_args(shapes_pairs, tmp_path / "copy", *common, f"--grpo_reference={init}"))
    off, copy = run_log(tmp_path / "off", "rl/reward"), run_log(tmp_path / "copy", "rl/reward")
    assert len(off) == 3 and any(e["rl/kl"] > 0 for e in off[1:])
    for want, got in zip(copy, off, strict=True):
        for k in ("loss", "rl/reward", "rl/kl", "rl/completion_length"):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
