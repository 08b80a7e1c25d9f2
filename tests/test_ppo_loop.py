"""objective='ppo' in train.py's loop: rollout batches of one completion a prompt, the policy and a value model trained
by the one AdamW over ppo_epochs passes of mini-batches; resume inside a rollout batch, torchrun DDP and FSDP2, XLA
SPMD. PPO's formulas themselves are checked against TRL 1.12 and EasyLM in test_ppo.py."""

import json
import math

import pytest
import torch
from conftest import checkpoint_tensors, run_log
from safetensors.torch import load_file
from test_dpo import debug_init, dpo_args, shapes_pairs  # noqa: F401

import chat
import model_files
import rl
import train
from model import build_model

LOGGED = ("rl/reward", "rl/kl", "rl/value_loss", "rl/policy_clipfrac", "rl/value_clipfrac", "rl/approx_kl",
          "rl/explained_variance", "rl/entropy")


def policy_and_judge(shapes, tmp_path, stop_weight=1.0):
    """The debug VLM (random) as the policy, and a random reward model of its layout: the reward, and the value model's
    start. stop_weight > 1 makes the stop token likely: completions of different lengths, some without an end."""
    policy = model_files.load_model(debug_init(tmp_path / "random"))
    stop = chat.stop_token_id("llama_3", chat.Tokenizer(shapes / "tokenizer.model"))
    with torch.no_grad():
        policy.llm.output.weight[stop] *= stop_weight
    model_files.save_model(policy, tmp_path / "init")
    model_files.save_model(build_model(policy.cfg.with_overrides({"reward_head": True}), seed=5), tmp_path / "judge")
    return tmp_path / "init", tmp_path / "judge"


def ppo_args(shapes, out, init, judge, *extra):
    return dpo_args(shapes, out, f"--init_from={init}", "--objective=ppo", f"--data_dir={shapes / 'shards'}",
                    f"--grpo_reward={judge}", "--grpo_max_new_tokens=6", "--warmup_iters=1", "--eval_interval=0",
                    "--final_accuracy_samples=0", *extra)


@pytest.mark.full
def test_ppo_epochs_lower_the_surrogate_and_the_value_loss_and_train_both_models(shapes_pairs, tmp_path):  # noqa: F811
    """One rollout batch of 4 prompts (2 micro-batches of 2: prompts and completions of different lengths, padded to
    one shape), 4 epochs of one mini-batch: the first step's ratio is 1 (approx KL 0, nothing clipped) and its policy is
    the reference (KL 0); each epoch lowers the clipped surrogate and the value loss on the same batch; the policy and
    the value model (its head too) both move. The batch's old log-probs and values are those of each row run alone,
    unpadded, by the models that sampled it; its advantages are whitened over the whole batch."""
    init, judge = policy_and_judge(shapes_pairs, tmp_path, stop_weight=8.0)
    train.main(ppo_args(shapes_pairs, tmp_path / "out", init, judge, "--max_iters=4", "--batch_size=4",
                        "--micro_batch_size=2", "--ppo_epochs=4", "--lr=3e-5", "--min_lr=3e-5",
                        "--ckpt_interval=3"))
    logged = run_log(tmp_path / "out", "rl/reward")
    assert [e["step"] for e in logged] == [1, 2, 3, 4]
    assert all(math.isfinite(e[k]) for e in logged for k in LOGGED)
    first = logged[0]
    assert first["rl/approx_kl"] < 1e-10 and first["rl/policy_clipfrac"] == 0 and first["rl/value_clipfrac"] == 0
    assert first["rl/kl"] == 0 and len({e["rl/reward"] for e in logged}) == 1  # one rollout batch
    later = logged[1:]  # after 1, 2 and 3 updates on the same batch: the old log-probs and values stay the sampler's
    assert all(e["rl/policy_loss"] < first["rl/policy_loss"] - 0.05 for e in later), [e["rl/policy_loss"] for e in logged]
    assert all(e["rl/value_loss"] < first["rl/value_loss"] for e in later), [e["rl/value_loss"] for e in logged]
    assert all(e["rl/approx_kl"] > 0 and e["rl/policy_clipfrac"] > 0 for e in later)  # the ratio moved, the clip binds

    step = tmp_path / "out/step-000003"
    before, after = load_file(init / "model.safetensors"), checkpoint_tensors(tmp_path / "out/step-000004")
    assert set(before) == {k[len("model."):] for k in after if k.startswith("model.")}  # a policy checkpoint still
    assert (after["model.llm.layers.0.attention.wq.weight"] - before["llm.layers.0.attention.wq.weight"]).abs().max() > 0
    value_start = load_file(judge / "model.safetensors")
    for name in ("reward_head.weight", "llm.layers.1.feed_forward.w2.weight"):
        assert (after[f"value.{name}"] - value_start[name]).abs().max() > 1e-5, name
    assert "value.llm.output.weight" in after and "optim.state.value.reward_head.weight.exp_avg" in after

    batch = load_file(step / "rank0.safetensors")  # the rollout batch step 4 trains on, as sampled at step 1
    lengths, m = batch["completion_mask"].sum(1), batch["completion_mask"].bool()
    stop = chat.stop_token_id("llama_3", chat.Tokenizer(shapes_pairs / "tokenizer.model"))
    ended = ((batch["ids"][:, -m.shape[1]:] == stop) & m).any(1)  # the completion holds the stop token
    assert len(set(lengths.tolist())) > 1 and torch.equal(batch["ended"], ended) and 0 < ended.sum() < 4
    assert abs(batch["advantages"][m].mean()) < 1e-6 and abs(batch["advantages"][m].std() - 1) < 1e-5
    policy, value_model = model_files.load_model(init).eval(), model_files.load_model(judge).eval()
    pixels = rl.images.normalize_images(batch["pixel_values"], *policy.cfg.vision.image_stats)
    for r in range(4):
        real = batch["mask"][r].bool()
        ids, n = batch["ids"][r][real][None], int(lengths[r])
        with torch.no_grad():  # the row alone: no padding at all, its completion up to its stop token
            logps, _ = rl.completion_logps(policy, ids, torch.ones_like(ids), pixels[r:r + 1], n)
            values = rl.completion_values(value_model, ids, torch.ones_like(ids), pixels[r:r + 1], n)
        assert torch.allclose(batch["old_logps"][r, :n], logps[0], atol=1e-5)
        assert torch.allclose(batch["old_values"][r, :n], values[0], atol=1e-5)
    assert torch.allclose(batch["ref_logps"] * m, batch["old_logps"] * m)  # the reference is the init


@pytest.mark.full
def test_ppo_resumes_exactly_inside_a_rollout_batch(shapes_pairs, tmp_path):  # noqa: F811
    """2 epochs of 2 mini-batches a rollout batch (4 steps), 6 steps straight, or stopped at step 3 (inside the first
    batch: its rollouts, the value model and its moments in the checkpoint) and resumed: the same mini-batches in the
    same order, the same losses and metrics to 1e-5."""
    init, judge = policy_and_judge(shapes_pairs, tmp_path, stop_weight=8.0)
    common = ["--batch_size=4", "--micro_batch_size=1", "--ppo_mini_batch_size=2", "--ppo_epochs=2", "--lr=1e-3",
              "--ckpt_interval=3", "--ppo_whiten_rewards=True", "--ppo_missing_end_penalty=1.0", "--ppo_value_lr=3e-3"]
    train.main(ppo_args(shapes_pairs, tmp_path / "straight", init, judge, "--max_iters=6", *common))
    train.main(ppo_args(shapes_pairs, tmp_path / "resumed", init, judge, "--max_iters=3", *common))
    assert (tmp_path / "resumed/step-000003/rank0.safetensors").exists()
    groups = json.loads((tmp_path / "resumed/step-000003/state.json").read_text())["param_groups"]
    value_groups = [g for g in groups if g["params"][0].startswith("value.")]
    assert value_groups and all(g["lr_scale"] == pytest.approx(3.0) for g in value_groups)  # ppo_value_lr / lr
    assert all(g["lr_scale"] == 1.0 for g in groups if g not in value_groups)
    train.main(ppo_args(shapes_pairs, tmp_path / "resumed", "resume", judge, "--max_iters=6", *common,
                        f"--grpo_reference={init}"))
    straight, resumed = run_log(tmp_path / "straight", "rl/reward"), run_log(tmp_path / "resumed", "rl/reward")
    assert [e["step"] for e in resumed] == [1, 2, 3, 4, 5, 6]
    for want, got in zip(straight, resumed, strict=True):
        for k in ("loss", "grad_norm", *LOGGED):
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
    assert straight[4]["rl/reward"] != straight[3]["rl/reward"]  # step 5 sampled a new rollout batch


@pytest.mark.parametrize("value,message", [
    ({"image_token_id": 513}, "image_token_id 513 != 512"),
    ({"vision": {"image_size": 42, "patch_size": 14}}, "image_size 42 != 28"),
    ("tokenizer", "its tokenizer .* encodes text unlike the run's"),
    ("no head", "the checkpoint has no reward head to read values from"),
])
def test_a_value_model_that_reads_ids_or_images_unlike_the_policy_is_refused(shapes_pairs, tmp_path,  # noqa: F811
                                                                            value, message):
    """The value model reads the policy's ids and pixels: another image placeholder, image size or tokenizer, or a
    checkpoint without a head to read, is one sentence at setup."""
    import shutil

    from shapes import train_tokenizer

    init, judge = policy_and_judge(shapes_pairs, tmp_path)
    policy = model_files.load_model(init).cfg
    layout = value if isinstance(value, dict) else {}
    model_files.save_model(build_model(policy.with_overrides({"reward_head": value != "no head"} | layout), seed=6),
                           tmp_path / "value")
    if value == "tokenizer":
        texts = [f"{w} {n} {w[::-1]}" for n in range(200) for w in ("alpha", "beta", "gamma", "delta")]
        train_tokenizer(texts, tmp_path / "value" / "tokenizer", 300)
    else:
        shutil.copy(shapes_pairs / "tokenizer.model", tmp_path / "value")
    with pytest.raises(SystemExit, match=f"ppo_value_init '{tmp_path / 'value'}': .*{message}"):
        train.main(ppo_args(shapes_pairs, tmp_path / "out", init, judge, f"--ppo_value_init={tmp_path / 'value'}",
                            "--max_iters=1", "--batch_size=2", "--micro_batch_size=2"))


@pytest.mark.parametrize("extra,message", [
    (["--grpo_reward=exact_match"], "needs a value model to start from: ppo_value_init"),
    (["--ppo_lam=1.5"], "ppo_gamma and ppo_lam must lie in \\[0, 1\\]"),
    (["--ppo_mini_batch_size=3"], "ppo_mini_batch_size=3 must divide the rollout batch batch_size=4"),
    (["--ppo_mini_batch_size=2", "--micro_batch_size=4"], "ppo_mini_batch_size=2 must be a multiple of micro_batch_s"),
    (["--init_from=resume"], "needs a reference checkpoint for its KL penalty"),
    (["--pack=2"], "objective='ppo' samples one prompt a row: pack must be 0"),
])
def test_ppo_config_errors_are_one_sentence_from_train(shapes_pairs, tmp_path, extra, message):  # noqa: F811
    with pytest.raises(SystemExit, match=message):
        train.main(ppo_args(shapes_pairs, tmp_path / "out", "ckpt", tmp_path, "--batch_size=4", "--micro_batch_size=1",
                            *extra))


@pytest.mark.slow
@pytest.mark.full
def test_ppo_under_torchrun_fsdp_matches_ddp_and_resumes_exactly(shapes_pairs, tmp_path):  # noqa: F811
    """2 ranks, a rollout batch of 4 prompts (2 a rank), 2 epochs of 2 mini-batches: FSDP2 (the policy, value model,
    reward model and reference sharded) logs what DDP logs, and FSDP2 stopped at step 3 (inside the rollout batch)
    and resumed gives the uninterrupted run's steps 4 and 5 (step 5 samples anew). The advantages are whitened over
    both ranks' rows: mean 0 and variance 1 together, not each rank's alone."""
    from test_train import run

    init, judge = policy_and_judge(shapes_pairs, tmp_path, stop_weight=8.0)
    common = ["--batch_size=4", "--micro_batch_size=1", "--ppo_mini_batch_size=2", "--ppo_epochs=2", "--lr=3e-5",
              "--min_lr=3e-5", "--ckpt_interval=3", f"--grpo_reference={init}", "--final_accuracy_samples=4"]
    ddp_out = run(ppo_args(shapes_pairs, tmp_path / "ddp", init, judge, "--max_iters=5", "--parallel=ddp", *common),
                  nproc=2).stdout
    run(ppo_args(shapes_pairs, tmp_path / "fsdp", init, judge, "--max_iters=3", "--parallel=fsdp", *common), nproc=2)
    fsdp_out = run(ppo_args(shapes_pairs, tmp_path / "fsdp", "resume", judge, "--max_iters=5", "--parallel=fsdp",
                            *common), nproc=2).stdout
    ddp, fsdp = run_log(tmp_path / "ddp", "rl/reward"), run_log(tmp_path / "fsdp", "rl/reward")
    assert [e["step"] for e in fsdp] == [1, 2, 3, 4, 5]
    for want, got in zip(ddp, fsdp, strict=True):
        for k in ("loss", "grad_norm", *LOGGED):
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
    answers = lambda out: [line for line in out.splitlines() if line.startswith(("  Q: ", "held-out"))]  # noqa: E731
    assert answers(fsdp_out) == answers(ddp_out) and len(answers(ddp_out)) > 1
    assert ddp[3]["rl/kl"] == ddp[0]["rl/kl"] == 0 and ddp[4]["rl/kl"] != 0  # step 5: a policy the updates moved

    ranks = [load_file(tmp_path / "ddp/step-000003" / f"rank{r}.safetensors") for r in (0, 1)]
    advantages = [b["advantages"][b["completion_mask"].bool()] for b in ranks]
    both = torch.cat(advantages)
    assert abs(both.mean()) < 1e-5 and abs(both.var() - 1) < 1e-4
    assert max(abs(a.mean()) for a in advantages) > 0.05  # each rank's alone is not whitened


@pytest.mark.slow
@pytest.mark.full
def test_ppo_on_xla_spmd_compiles_once_and_matches_cpu_eager(shapes_pairs, tmp_path):  # noqa: F811
    """4 PPO steps under torch_xla SPMD on 4 CPU devices (fsdp 4; a rollout batch of 8 prompts in 2 micro-batches,
    one epoch of 2 mini-batches, the seed's ppo_epochs) against the same run on CPU eager with grpo_static=True: static
    rollouts draw from hashed noise, so both sample the same completions, and rewards, KL, values and losses agree.
    After step 2 nothing compiles: step 3's rollout batch reuses step 1's graphs."""
    from conftest import ROOT, assert_same_logs, train_on_xla

    init, judge = policy_and_judge(shapes_pairs, tmp_path, stop_weight=8.0)
    common = ["--batch_size=8", "--micro_batch_size=4", "--ppo_mini_batch_size=4", "--ppo_epochs=1", "--lr=1e-4",
              "--grpo_max_new_tokens=5", "--grpo_prompt_len=26", "--seq_len=40", "--max_iters=4", "--ckpt_interval=0"]
    train.main(ppo_args(shapes_pairs, tmp_path / "cpu", init, judge, *common, "--grpo_static=True"))
    r = train_on_xla(ppo_args(shapes_pairs, tmp_path / "xla", init, judge, *common), timeout=600,
                     env={"PYTHONPATH": str(ROOT / "tests")})
    assert "ppo: static rollouts, prompts left-padded to 26 tokens" in r.stdout
    cpu, xla = run_log(tmp_path / "cpu", "rl/reward"), run_log(tmp_path / "xla", "rl/reward")
    assert [e["step"] for e in cpu] == [1, 2, 3, 4]
    assert_same_logs(cpu, xla, ("loss", *LOGGED, "rl/completion_length"))
    assert cpu[3]["rl/kl"] != 0 and cpu[2]["rl/reward"] != cpu[1]["rl/reward"] and cpu[1]["rl/approx_kl"] > 0


# the seeds' run (EasyLM llama_train_ppo on a v3-256, REFERENCES.md 15): its flags, and EasyLM's defaults it kept
EASYLM_SEED_RUN = {"kl_coef": 0.05, "ppo_epochs": 1, "mini_batch_size": 64, "batch_size": 512, "rollouts_per_prompt": 1,
                   "lr": 1e-6, "warmup_epochs": 0.1, "reward_gain": 1.0, "reward_bias": 0.0,
                   "max_continuation_len": 1024, "weight_decay": 0.0, "temperature": 0.7, "whiten_rewards": False,
                   "gamma": 1.0, "lam": 0.95, "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1}


def test_ppo_configs_parse_and_the_onevision_recipe_is_the_seeds_easylm_run(tmp_path):
    """configs/ppo_shapes.py parses; configs/ppo_onevision.py holds every hyperparameter of the seeds' EasyLM run
    that has a counterpart here, its warmup is 10% of the updates then a constant lr (EasyLM's end_lr = lr), it trains
    on whole rollout batches, and its rows fit the model."""
    from conftest import ROOT

    import config
    from model_config import vlm_preset

    (tmp_path / "rm").mkdir()
    shapes = config.load_config([str(ROOT / "configs/ppo_shapes.py"), f"--grpo_reward={tmp_path / 'rm'}"])
    grpo_start = config.load_config([str(ROOT / "configs/grpo_shapes.py")])["init_from"]
    # GRPO's start (the same 66-step SFT), in a folder of its own: one demo's prepare never replaces another's
    assert shapes["objective"] == "ppo" and shapes["init_from"] == grpo_start.replace("shapes-grpo", "shapes-ppo")
    cfg = config.load_config([str(ROOT / "configs/ppo_onevision.py"), f"--grpo_reward={tmp_path / 'rm'}"])
    rl.check_ppo_config(cfg, replicas=8)
    ours = {"kl_coef": "ppo_kl_coef", "ppo_epochs": "ppo_epochs", "mini_batch_size": "ppo_mini_batch_size",
            "batch_size": "batch_size", "lr": "lr", "reward_gain": "ppo_reward_gain", "reward_bias": "ppo_reward_bias",
            "max_continuation_len": "grpo_max_new_tokens", "weight_decay": "weight_decay",
            "temperature": "grpo_temperature", "whiten_rewards": "ppo_whiten_rewards", "gamma": "ppo_gamma",
            "lam": "ppo_lam", "cliprange": "ppo_clip", "cliprange_value": "ppo_clip_value", "vf_coef": "ppo_vf_coef"}
    assert {k: cfg[v] for k, v in ours.items()} == {k: EASYLM_SEED_RUN[k] for k in ours}
    updates_a_batch = cfg["batch_size"] // cfg["ppo_mini_batch_size"] * cfg["ppo_epochs"]
    assert cfg["max_iters"] % updates_a_batch == 0 and cfg["min_lr"] == cfg["lr"] and cfg["ppo_value_lr"] == 0
    assert cfg["warmup_iters"] == math.ceil(EASYLM_SEED_RUN["warmup_epochs"] * cfg["max_iters"])
    assert cfg["ppo_kl_estimator"] == "k1" and cfg["grpo_reference"] == cfg["init_from"]
    assert cfg["seq_len"] + cfg["grpo_max_new_tokens"] <= vlm_preset(cfg["model"]).llm.max_seq_len


def test_lora_ppo_reference_is_the_policy_with_adapters_off(shapes_pairs, tmp_path, capsys, s3_bucket):  # noqa: F811
    """LoRA on the policy and no grpo_reference: the KL reference is the policy with its adapters off (no second copy
    of the model), and gives what a frozen copy of the start gives: the same rollouts, KL, losses and values. The value
    model trains in full (stage 2: the projector and the LLM). The copy run reads its reference, reward model and value
    model's start from a bucket (moto's S3 server): they load as init_from does."""
    import storage

    init, judge = policy_and_judge(shapes_pairs, tmp_path, stop_weight=8.0)
    for f in [*init.iterdir(), *judge.iterdir()]:
        storage.upload(f, f"{s3_bucket}/{f.parent.name}/{f.name}")
    common = ["--batch_size=2", "--micro_batch_size=2", "--ppo_epochs=2", "--lr=3e-3", "--max_iters=3", "--stage=2",
              "--lora={'r': 4, 'alpha': 8, 'targets': ['llm']}"]
    train.main(ppo_args(shapes_pairs, tmp_path / "off", init, judge, *common))
    assert "ppo: reference model = the policy with its LoRA adapters off" in capsys.readouterr().out
    train.main(ppo_args(shapes_pairs, tmp_path / "copy", init, f"{s3_bucket}/judge", *common,
                        f"--grpo_reference={s3_bucket}/init", f"--ppo_value_init={s3_bucket}/judge"))
    said = capsys.readouterr().out
    assert f"ppo: reference model {s3_bucket}/init (frozen)" in said
    assert f"ppo: rewards from the reward model {s3_bucket}/judge" in said
    off, copy = run_log(tmp_path / "off", "rl/reward"), run_log(tmp_path / "copy", "rl/reward")
    assert len(off) == 3 and off[2]["rl/kl"] != 0  # step 3 samples from the updated adapters
    for want, got in zip(copy, off, strict=True):
        for k in ("loss", "rl/kl", "rl/value_loss", "rl/policy_clipfrac", "rl/completion_length"):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
