"""Every objective and LoRA on Qwen3- and Gemma 3-shaped models. LoRA adapts the layers peft picks on transformers'
Qwen3ForCausalLM and Gemma3ForCausalLM (never a q/k norm or a sandwich norm), with peft's logits and gradients; the
rollouts GRPO and PPO sample through the KV cache (windows, per-layer RoPE, Gemma 2's soft-caps) are the full
forward's choices, and each padded row reads as the row alone; DPO, LoRA-DPO, GRPO, the reward model and PPO run
through train.py from an SFT run that set the family's switches with --model_overrides. Their losses against TRL on
these decoders: tests/test_dpo.py and tests/test_grpo.py (the family cases)."""

import json
import math
import re

import pytest
import torch
from conftest import checkpoint_tensors, run_log
from test_dpo import dpo_args, shapes_pairs  # noqa: F401
from test_families import OVERRIDES, perturbed, tiny_causal_lm
from test_lora import adapted, randomize_adapters
from test_train import args

import chat
import config
import convert
import loader
import rl
import train
from lora import LoRAConfig, LoRALinear, apply_lora, is_lora_parameter
from model import RMSNorm, build_model
from model_config import VLMConfig, vlm_preset
from parallel import freeze

FAMILIES = ["qwen3", "gemma3"]
# train.py runs: make test runs Gemma 3's (every switch but the soft-caps), make test-full Qwen3's too
RUNS = ["gemma3", pytest.param("qwen3", marks=pytest.mark.full)]


def family_overrides(family):
    """--model_overrides for the debug VLM at 28 px with the family's switches (tests/test_families.py's OVERRIDES)."""
    return {"vision": {"image_size": 28, "patch_size": 14}, "llm": {"vocab_size": 576} | OVERRIDES[family],
            "image_token_id": 512}


# -----------------------------------------------------------------------------
# LoRA against peft on transformers' causal LMs

# our layer -> the transformers causal LM's module, written out here
TEXT_NAMES = [(r"llm\.layers\.(\d+)\.attention\.w([qkvo])", r"model.layers.\1.self_attn.\2_proj"),
              (r"llm\.layers\.(\d+)\.feed_forward\.w1", r"model.layers.\1.mlp.gate_proj"),
              (r"llm\.layers\.(\d+)\.feed_forward\.w2", r"model.layers.\1.mlp.down_proj"),
              (r"llm\.layers\.(\d+)\.feed_forward\.w3", r"model.layers.\1.mlp.up_proj")]


def text_name(ours):
    for pattern, theirs in TEXT_NAMES:
        if re.fullmatch(pattern, ours):
            return re.sub(pattern, theirs, ours)
    raise KeyError(ours)


@pytest.mark.parametrize("targets,peft_targets", [(["llm"], "all-linear"),
                                                  (["llm.attention.wq", "llm.attention.wv"], None)])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_the_layers_peft_picks_with_its_logits_and_gradients(tmp_path, family, targets, peft_targets):
    """peft chooses the layers: "all-linear" (every linear layer but the LM head) is our "llm"; no target_modules is
    its table's entry for qwen3 and gemma3_text (q_proj, v_proj). Random adapter values copied into peft's give its
    logits and adapter gradients past the 8-token window. The q/k norms and Gemma's sandwich norms are adapted by
    neither, and train.py's freeze (stage 2) trains the adapters and the projector alone."""
    from peft import LoraConfig, get_peft_model

    hf = tiny_causal_lm(family, tmp_path)
    state, cfg = convert.llm_from_hf(tmp_path)
    ours = build_model(VLMConfig(vision=vlm_preset("debug").vision, llm=cfg), init=False)
    ours.load_state_dict(state, strict=False)
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=targets), seed=0)
    randomize_adapters(ours, std=0.1)
    twin = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=peft_targets))
    mine = {name: m for name, m in ours.named_modules() if isinstance(m, LoRALinear)}
    assert adapted(twin) == {text_name(n) for n in mine}
    assert len(mine) == cfg.n_layers * (7 if targets == ["llm"] else 2)
    with torch.no_grad():
        for name, m in mine.items():
            theirs = twin.base_model.model.get_submodule(text_name(name))
            theirs.lora_A["default"].weight.copy_(m.lora_A.weight)
            theirs.lora_B["default"].weight.copy_(m.lora_B.weight)

    per_layer = {"attention_norm", "ffn_norm", "attention.q_norm", "attention.k_norm"} | \
        ({"attention_post_norm", "ffn_post_norm"} if family == "gemma3" else set())
    norms = {n for n, m in ours.llm.named_modules() if isinstance(m, RMSNorm)}
    assert norms == {f"layers.{i}.{n}" for i in range(cfg.n_layers) for n in per_layer} | {"norm"}
    freeze(ours, 2)
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == \
        {n for n, _ in ours.named_parameters() if is_lora_parameter(n) or n.startswith("projector.")}

    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    ours.eval(), twin.eval()
    logits, loss = ours(ids, labels=ids)
    out = twin(input_ids=ids, labels=ids)
    assert (logits - out.logits).abs().max() <= 1e-5, (logits - out.logits).abs().max()
    assert abs(loss.item() - out.loss.item()) <= 1e-6
    loss.backward()
    out.loss.backward()
    for name, m in mine.items():
        theirs = twin.base_model.model.get_submodule(text_name(name))
        for ab in ("lora_A", "lora_B"):
            want, got = getattr(theirs, ab)["default"].weight.grad, getattr(m, ab).weight.grad
            assert want.abs().max() > 0 and (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max()), (name, ab)


# -----------------------------------------------------------------------------
# rollouts: the KV cache against the full forward, a padded row against the row alone


@pytest.mark.parametrize("family,static", [("gemma3", False), ("gemma3", True), ("qwen3", True), ("gemma2", True),
                                           pytest.param("qwen3", False, marks=pytest.mark.full),  # as HF's: test_families
                                           pytest.param("gemma2", False, marks=pytest.mark.full)])
def test_greedy_rollouts_are_the_full_forwards_choices_and_rows_read_as_alone(shapes_pairs, family, static):  # noqa: F811
    """rl.sample greedy (eager, and static as XLA runs it) on shapes prompts of several lengths, left-padded, past the
    8-token window: the logits generate computes through its cache, and so the tokens it chose, are those of the one
    forward over prompt and completion that GRPO's and PPO's log-probs come from; those log-probs, a value model's
    values and a reward model's rewards of each padded row equal the row's alone, unpadded."""
    cfg = vlm_preset("debug").with_overrides(family_overrides(family))
    model = perturbed(build_model(cfg, seed=0))
    judge = perturbed(build_model(cfg.with_overrides({"reward_head": True}), seed=5), seed=5)
    stream = loader.ShardStream(shapes_pairs / "shards", shapes_pairs / "tokenizer.model", split="train", batch_size=6,
                                seq_len=48, image_size=28, image_token_id=512, n_image_tokens=4, template="llama_3")
    b, stop = stream.batch(0), chat.stop_token_id("llama_3", stream.tok)
    run = dict(config.DEFAULTS) | {"grpo_temperature": 0.0, "grpo_max_new_tokens": 8, "seq_len": 48}
    # the LM head's outputs (before any soft-cap): generate's from its cache (the prefill's last position, then one a
    # decode step), then the full forward's
    steps = []
    hook = model.llm.output.register_forward_hook(lambda module, args, out: steps.append(out))
    s, _, _ = rl.sample(model, b, stream.tok, stop, run, lambda texts, *_: torch.zeros(len(texts)), None, 1, static)
    C = s["completion_mask"].shape[1]
    prompt_lengths = s["mask"][:, :-C].sum(1)
    assert s["valid"].all() and len(set(prompt_lengths.tolist())) > 1 and prompt_lengths.min() > 8
    new, m = s["ids"][:, -C:], s["completion_mask"].bool()
    suppress = torch.arange(cfg.llm.vocab_size)
    suppress = (suppress >= stream.tok.vocab_size) | (suppress == cfg.image_token_id)
    with torch.no_grad():
        logits, _ = model(s["ids"], s["pixel_values"], attention_mask=s["mask"], logits_to_keep=C + 1)
        hook.remove()
        cached, full = torch.stack(steps[:-1], dim=1), steps[-1][:, :-1]  # (B, C, vocab)
        assert (cached - full)[m].abs().max() <= 1e-4, (cached - full)[m].abs().max()
        logprobs = logits[:, :-1].float().log_softmax(-1).masked_fill(suppress, float("-inf"))
        chosen = logprobs.gather(-1, new[..., None]).squeeze(-1)
        assert m.sum() > 2 * len(m) and ((logprobs.amax(-1) - chosen)[m] <= 1e-5).all(), logprobs.amax(-1) - chosen
        logps, _ = rl.completion_logps(model, s["ids"], s["mask"], s["pixel_values"], C)
        values = rl.completion_values(judge, s["ids"], s["mask"], s["pixel_values"], C)
        rewards = judge(s["ids"], s["pixel_values"], attention_mask=s["mask"], reward=True)[1]
        assert torch.allclose(logps[m], chosen[m], atol=1e-5)
        for r in range(len(m)):
            ids, n = s["ids"][r][s["mask"][r].bool()][None], int(m[r].sum())
            alone = dict(ids=ids, attention_mask=torch.ones_like(ids), pixel_values=s["pixel_values"][r : r + 1],
                         n_completion=n)
            assert torch.allclose(rl.completion_logps(model, **alone)[0][0], logps[r, :n], atol=1e-5), r
            assert torch.allclose(rl.completion_values(judge, **alone)[0], values[r, :n], atol=1e-5), r
            assert torch.allclose(judge(ids, alone["pixel_values"], reward=True)[1], rewards[r], atol=1e-5), r
    assert rewards.std() > 1e-3  # rows that differ: a head reading the wrong token would not match


# -----------------------------------------------------------------------------
# train.py: each objective from an SFT run of the family

LOGGED_RL = ("rl/reward", "rl/kl", "rl/clip_ratio", "rl/entropy", "rl/completion_length")
LOGGED_PPO = ("rl/reward", "rl/kl", "rl/value_loss", "rl/policy_loss", "rl/policy_clipfrac", "rl/value_clipfrac",
              "rl/approx_kl", "rl/explained_variance", "rl/entropy")


@pytest.fixture(scope="module")
def sft(shapes_pairs, tmp_path_factory):  # noqa: F811
    """sft(family): the last step of a 3-step SFT run from scratch, the family set by --model_overrides."""
    made = {}

    def step(family):
        if family not in made:
            out = tmp_path_factory.mktemp(f"sft-{family}")
            train.main(args(shapes_pairs, out, "--max_iters=3", f"--model_overrides={family_overrides(family)!r}"))
            assert all(math.isfinite(e["loss"]) for e in run_log(out, "loss"))
            made[family] = out / "step-000003"
            saved = json.loads((made[family] / "config.json").read_text())["llm"]
            assert {k: saved[k] for k in OVERRIDES[family]} == OVERRIDES[family]
        return made[family]

    return step


def finite(events, keys):
    return all(math.isfinite(e[k]) for e in events for k in keys)


@pytest.mark.parametrize("family", RUNS)
def test_dpo_starts_at_the_reference_and_separates_the_pairs(shapes_pairs, sft, family, tmp_path):  # noqa: F811
    train.main(dpo_args(shapes_pairs, tmp_path, f"--init_from={sft(family)}", "--max_iters=6", "--eval_interval=6",
                        "--eval_iters=2", "--lr=2e-3"))
    events = run_log(tmp_path)
    steps = [e for e in events if "rewards/accuracies" in e]
    assert [e["step"] for e in steps] == list(range(1, 7))
    assert finite(steps, ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"))
    # step 1: the policy (through train.py's backends) is the reference loaded beside it: every log ratio is 0
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[0]["rewards/margins"] == 0.0
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < math.log(2)
    assert math.isfinite(next(e for e in events if "val_loss" in e)["val_rewards/margins"])


@pytest.mark.parametrize("family", RUNS)
def test_lora_dpo_trains_the_adapters_alone_against_the_policy_with_them_off(shapes_pairs, sft, family,  # noqa: F811
                                                                           tmp_path, capsys):
    """The reference is the policy with its adapters off; the adapters sit on the 7 linear layers of each block, the
    norms (q/k norms, Gemma's sandwich norms) and every other LLM weight stay as the SFT run left them."""
    start = sft(family)
    train.main(dpo_args(shapes_pairs, tmp_path, f"--init_from={start}", "--stage=2", "--max_iters=4", "--lr=3e-3",
                        "--warmup_iters=1", "--eval_interval=0", "--lora={'r': 4, 'alpha': 8, 'targets': ['llm']}"))
    assert "dpo: reference model = the policy with its LoRA adapters off" in capsys.readouterr().out
    steps = [e for e in run_log(tmp_path) if "rewards/margins" in e]
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[0]["rewards/margins"] == 0.0
    assert finite(steps, ("loss", "rewards/margins")) and steps[-1]["rewards/margins"] > 0
    before, after = checkpoint_tensors(start, "model."), checkpoint_tensors(tmp_path / "step-000004", "model.")
    assert any("q_norm" in k for k in before) and (family != "gemma3" or any("post_norm" in k for k in before))
    assert {k for k in before if not torch.equal(before[k], after[k])} == \
        {k for k in before if k.startswith("model.projector.")}
    new = sorted(set(after) - set(before))
    assert len(new) == 2 * 7 * 2 and all(re.fullmatch(r"model\.llm\.layers\.\d\.(attention|feed_forward)\.w\d?[qkvo]?\."
                                                       r"lora_[AB]\.weight", k) for k in new), new


@pytest.mark.parametrize("family", RUNS)
def test_grpo_starts_at_the_reference_and_its_second_step_moves_the_ratio(shapes_pairs, sft, family, tmp_path):  # noqa: F811
    train.main(dpo_args(shapes_pairs, tmp_path, f"--init_from={sft(family)}", "--objective=grpo",
                        f"--data_dir={shapes_pairs / 'shards'}", "--grpo_reward=test_grpo:short_answers",
                        "--max_iters=2", "--batch_size=4", "--micro_batch_size=2", "--grpo_group=4",
                        "--grpo_iterations=2", "--grpo_beta=0.05", "--lr=3e-3", "--warmup_iters=1",
                        "--lr_decay_iters=2", "--eval_interval=0", "--grpo_max_new_tokens=6"))
    logged = run_log(tmp_path, "rl/reward")
    assert [e["step"] for e in logged] == [1, 2] and finite(logged, ("loss", *LOGGED_RL))
    assert logged[0]["rl/kl"] == 0 and logged[0]["rl/clip_ratio"] == 0  # policy = reference = sampler
    assert logged[1]["rl/kl"] > 0 and logged[1]["rl/reward"] == logged[0]["rl/reward"]  # the same rollouts, updated


@pytest.mark.parametrize("family", RUNS)
def test_a_reward_model_then_ppo_with_it_as_reward_and_value_model(shapes_pairs, sft, family, tmp_path):  # noqa: F811
    """The reward model trains from the SFT run (its head added); PPO then reads it as its reward and its value
    model's start: the first step's ratio is 1 and its policy the reference."""
    train.main(dpo_args(shapes_pairs, tmp_path / "reward", f"--init_from={sft(family)}", "--objective=reward",
                        "--max_iters=3", "--eval_interval=3", "--eval_iters=1", "--lr=2e-3"))
    logged = run_log(tmp_path / "reward", "reward/accuracy")
    assert [e["step"] for e in logged] == [1, 2, 3] and finite(logged, ("loss", "reward/margin", "reward/chosen"))
    judge = tmp_path / "reward/step-000003"
    train.main(dpo_args(shapes_pairs, tmp_path / "ppo", f"--init_from={sft(family)}", "--objective=ppo",
                        f"--data_dir={shapes_pairs / 'shards'}", f"--grpo_reward={judge}", "--grpo_max_new_tokens=6",
                        "--max_iters=2", "--batch_size=4", "--micro_batch_size=2", "--ppo_epochs=2", "--lr=1e-3",
                        "--warmup_iters=1", "--eval_interval=0"))
    logged = run_log(tmp_path / "ppo", "rl/reward")
    assert [e["step"] for e in logged] == [1, 2] and finite(logged, ("loss", *LOGGED_PPO))
    first = logged[0]
    assert first["rl/approx_kl"] < 1e-10 and first["rl/policy_clipfrac"] == 0 and first["rl/value_clipfrac"] == 0
    assert first["rl/kl"] == 0 and logged[1]["rl/approx_kl"] > 0
