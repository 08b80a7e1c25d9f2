"""TRL 1.12's PPOTrainer.train() (trl.experimental.ppo: TRL 1.13 deleted it) for one rollout batch of the tiny LLaVA,
beside losses.py's PPO functions on the same rollout; run by tests/test_ppo.py in a process of its own, TRL 1.12 first on
sys.path (the venv's TRL 1.16 serves the DPO and GRPO parity). Installs TRL 1.12 into SIDE_DIR first if it is not there.

TRL's PPO reads text only: each LLaVA's inner LlavaModel gets the prompt's pixels by the prompt's ids. TRL samples
in train(); its batch_generation is replaced by the fixed completions and the sampling policy's logits (the policy's,
perturbed: an older policy, so ratios clip), and the rollout's values are perturbed the same way (so the value clip
binds). Everything else is TRL's own code: the reference and value forward passes, the reward model's score at the
last token, the missing-EOS penalty, the KL estimators, reward whitening, GAE, advantage whitening, both losses and the
logged statistics, recorded by wrapping its helpers (masked_whiten, forward, get_reward) and its log. Transcribed from
its train(), not called: returns = raw advantages + values zeroed past the extra token, the entropy formula applied to
its recorded logits, and approxkl's mean over every slot (padding's zeros included).

usage: python tests/trl_ppo.py SIDE_DIR OUT_JSON
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, C, TEMPERATURE = 8, 7, 0.7  # rows (TRL's whiten_rewards wants a mini-batch of >= 8), completion slots
ENDS = [6, 1, None, 3, 0, 4, 2, 5]  # each completion's EOS slot (None: cut at C without one, as a truncated sample)
CASES = {  # TRL PPOConfig settings
    "k1": {"kl_estimator": "k1", "whiten_rewards": False, "gamma": 1.0, "lam": 0.95},
    "k3_whitened_rewards": {"kl_estimator": "k3", "whiten_rewards": True, "gamma": 0.9, "lam": 0.8},
    "gamma_lam_1": {"kl_estimator": "k1", "whiten_rewards": False, "gamma": 1.0, "lam": 1.0},
}


def install(side):
    """TRL as requirements-trl-ppo.txt pins it, without dependencies (the venv's serve), into side: once, and again
    when the pin changes."""
    pin = (ROOT / "requirements-trl-ppo.txt").read_text()
    if (side / ".installed").exists() and (side / ".installed").read_text() == pin:
        return
    shutil.rmtree(side, ignore_errors=True)
    side.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=side.name + ".", dir=side.parent))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--target", str(tmp), "-r", str(ROOT / "requirements-trl-ppo.txt")], check=True)
    (tmp / ".installed").write_text(pin)
    try:
        tmp.rename(side)
    except OSError:  # another process installed it meanwhile
        shutil.rmtree(tmp)


def main(side, out):
    install(side)
    sys.path[:0] = [str(side), str(ROOT), str(ROOT / "tests")]
    os.environ |= {"USE_TORCH_XLA": "0", "TRL_EXPERIMENTAL_SILENCE": "1"}
    import torch
    import trl

    assert trl.__version__ == "1.12.0", trl.__file__
    from conftest import tiny_hf_llava
    from test_dpo import EOS, IMAGE, N_IMAGE_TOKENS, PAD, word_level_processor

    import hf_names
    import losses
    import model
    import model_files
    import rl

    # ---- the models: policy, reference, value and reward, each a tiny LLaVA; the last two with a scalar head
    tmp = out.parent / "models"
    hf, ours = {}, {}
    for seed, name in enumerate(("policy", "reference", "value", "reward")):
        hf[name] = tiny_hf_llava(seed=seed)
        hf[name].save_pretrained(tmp / name)
        state, cfg = hf_names.llava_from_hf(tmp / name)
        if name in ("value", "reward"):
            hf[name].score = torch.nn.Linear(64, 1)
            torch.nn.init.normal_(hf[name].score.bias, std=0.5)
            cfg = cfg.with_overrides({"reward_head": True})
            state |= {"reward_head.weight": hf[name].score.weight.detach(), "reward_head.bias": hf[name].score.bias.detach()}
        ours[name] = model.build_model(cfg, init=False)
        ours[name].load_state_dict(state)
        ours[name].eval()
    model_files.save_model(ours["value"], tmp / "value_ckpt")  # the value model starts from a reward-model checkpoint
    ours["value"] = model_files.load_model(tmp / "value_ckpt").eval()

    # ---- the rollout: prompts of different lengths (left-padded) with an image each, completions of every length
    g = torch.Generator().manual_seed(0)
    words = lambda n: torch.randint(3, IMAGE, (n,), generator=g)  # noqa: E731
    prompts = [torch.cat([words(1 + i % 3), torch.full((N_IMAGE_TOKENS,), IMAGE), words(2 + 2 * i % 5)]) for i in range(B)]
    P = max(len(p) for p in prompts)
    queries = torch.stack([torch.cat([torch.full((P - len(p),), PAD), p]) for p in prompts])
    completions = torch.full((B, C), PAD)
    for i, end in enumerate(ENDS):
        n = C if end is None else end + 1
        completions[i, :n] = words(n)
        if end is not None:
            completions[i, end] = EOS
    pixels = torch.randn(B, 3, 28, 28, generator=g)
    logit_noise, value_noise = torch.randn(B, C, 512, generator=g), torch.randn(B, P + C, generator=g)
    row_of = {tuple(q.tolist()): i for i, q in enumerate(queries)}
    rows = lambda ids: [row_of[tuple(q.tolist())] for q in ids[:, :P]]  # noqa: E731  TRL shuffles the prompts

    for llava in hf.values():  # TRL passes ids alone: the LlavaModel inside each takes its prompt's pixels
        def with_pixels(*args, inner=llava.model.forward, **kw):
            kw.pop("pixel_values", None)
            return inner(*args, pixel_values=pixels[rows(kw["input_ids"])], **kw)
        llava.model.forward = with_pixels

    from datasets import Dataset
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    record = {}
    real_forward, real_get_reward, real_whiten = trl_ppo.forward, trl_ppo.get_reward, trl_ppo.masked_whiten

    def batch_generation(policy, queries, *_):  # the fixed completions, and the logits of an older policy
        order = rows(queries)
        record["order"], record["completions"] = order, completions[order]
        query_responses = torch.cat([queries, completions[order]], 1)
        logits = real_forward(hf["policy"], query_responses, PAD).logits[:, P - 1 : -1] / (TEMPERATURE + 1e-7)
        record["old_logits"] = logits + 0.5 * logit_noise[order]
        return query_responses, record["old_logits"]

    def get_reward(scorer, query_responses, pad_token_id, context_length):
        logits, final, lengths = real_get_reward(scorer, query_responses, pad_token_id, context_length)
        if scorer is hf["value"]:  # the rollout's values, from an older value model
            logits = logits + 0.3 * value_noise[rows(query_responses), :, None]
            record["old_values"] = logits[:, context_length - 1 : -1, 0]
        else:
            record["rm_scores"] = final
        return logits, final, lengths

    def forward(net, query_responses, pad_token_id):
        outputs = real_forward(net, query_responses, pad_token_id)
        if isinstance(outputs, tuple):  # the training forward: policy and value
            record["train_logits"] = outputs[0].logits[:, P - 1 : -1] / (TEMPERATURE + 1e-7)
            record["train_values"] = outputs[1][:, P - 1 : -1, 0]
            record["train_order"] = rows(query_responses)
        return outputs

    def masked_whiten(values, mask, shift_mean=True):
        whitened = real_whiten(values, mask, shift_mean)
        record.setdefault("whiten", []).append((values.clone(), whitened.clone()))
        return whitened

    trl_ppo.batch_generation, trl_ppo.get_reward, trl_ppo.forward, trl_ppo.masked_whiten = \
        batch_generation, get_reward, forward, masked_whiten

    def ours_on_the_rollout(settings):
        """model.py's PPO on the rollout TRL drew (its order), our models' log-probs and values: TRL's layout (the
        score one past the last token, the value loss over one more token) and ours (EasyLM's: both at the last)."""
        order = record["order"]
        ids = torch.cat([queries[order], completions[order]], 1)
        ended = (completions[order] == EOS).any(1)
        mask = ((completions[order] == EOS).long().cumsum(1) - (completions[order] == EOS).long() == 0).float()
        attention = torch.cat([(queries[order] != PAD).long(), mask.long()], 1)
        with torch.no_grad():
            logps, entropy = rl.completion_logps(ours["policy"], ids, attention, pixels[order], C, TEMPERATURE)
            ref_logps, _ = rl.completion_logps(ours["reference"], ids, attention, pixels[order], C, TEMPERATURE)
            values = rl.completion_values(ours["value"], ids, attention, pixels[order], C)
            rm = ours["reward"](ids, pixels[order], attention_mask=attention, reward=True)[1]
        old_logps = record["old_logits"].log_softmax(-1).gather(-1, completions[order, :, None]).squeeze(-1)
        old_values = values + 0.3 * value_noise[order, P - 1 : -1]
        scores = losses.ppo_score(rm, ended, missing_end_penalty=1.5)
        mask_p1 = torch.maximum(mask, torch.nn.functional.pad(mask, (1, 0))[:, :C])  # TRL's ~padding_mask_p1
        got = {"mask": mask, "mask_p1": mask_p1, "logps": logps, "entropy": entropy, "values": values, "rm": rm,
               "scores": scores}
        for layout, value_mask in (("trl", mask_p1), ("easylm", mask)):
            # TRL's padding log-probs are equal (INVALID_LOGPROB): no KL at its extra token
            old, ref = old_logps.masked_fill(mask == 0, 1.0), ref_logps.masked_fill(mask == 0, 1.0)
            rewards, kl = losses.ppo_rewards(old, ref, scores, value_mask, 0.3, settings["kl_estimator"])
            if settings["whiten_rewards"]:
                rewards = losses.masked_whiten(rewards, value_mask, shift_mean=False)
            advantages, returns = losses.gae(rewards, old_values, value_mask, settings["gamma"], settings["lam"])
            advantages = losses.masked_whiten(advantages, mask)
            policy_loss, policy_metrics = losses.ppo_policy_loss(logps, old, advantages, mask, 0.2)
            value_loss, value_metrics = losses.ppo_value_loss(values, old_values, returns, value_mask, 0.2)
            got[layout] = {"rewards": rewards, "kl": kl, "advantages": advantages, "returns": returns,
                           "policy_loss": policy_loss, "value_loss": value_loss} | policy_metrics | value_metrics
        return got

    results = {}
    tok = word_level_processor().tokenizer
    data = Dataset.from_list([{"input_ids": q.tolist()} for q in queries])
    initial = {name: {k: v.clone() for k, v in llava.state_dict().items()} for name, llava in hf.items()}
    for case, settings in CASES.items():
        record.clear()
        for name, llava in hf.items():  # train() took an optimizer step on the policy and the value model
            llava.load_state_dict(initial[name])
        args = PPOConfig(str(tmp / case), per_device_train_batch_size=B, gradient_accumulation_steps=1,
                         num_mini_batches=1, num_ppo_epochs=1, total_episodes=B, local_rollout_forward_batch_size=B,
                         response_length=C, stop_token_id=EOS, temperature=TEMPERATURE, missing_eos_penalty=1.5,
                         kl_coef=0.3, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, num_sample_generations=0,
                         report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, **settings)
        trainer = PPOTrainer(args, tok, hf["policy"], hf["reference"], hf["reward"], data, hf["value"],
                             eval_dataset=data)
        logged = {}
        trainer.log = lambda logs, *a, **k: logged.update(logs)  # noqa: B023
        trainer.train()
        results[case] = figures(record, logged, ours_on_the_rollout(settings), torch)
    out.write_text(json.dumps(results, indent=1))


def figures(record, trl, got, torch):
    """{quantity: [ours, TRL's, largest difference]}: TRL's as train() computed and logged them."""
    mask, mask_p1, order = got["mask"], got["mask_p1"], record["order"]
    in_rollout_order = [record["train_order"].index(r) for r in order]  # TRL's mini-batch is a shuffle of the rollout
    train_logits, train_values = record["train_logits"][in_rollout_order], record["train_values"][in_rollout_order]
    (raw_advantages, advantages) = record["whiten"][-1]  # TRL's last masked_whiten: the advantages
    old_values = record["old_values"].masked_fill(mask_p1 == 0, 0)  # TRL: values masked past the extra token
    trl_entropy = torch.logsumexp(train_logits, -1) - (train_logits.softmax(-1) * train_logits).sum(-1)  # its formula
    rows = lambda x: x.detach().double()  # noqa: E731
    pairs = {
        # the models: our VLM's log-probs, values and reward against transformers' LLaVA under TRL's forward
        "logps": (got["logps"], train_logits.log_softmax(-1).gather(-1, record["completions"][:, :, None]).squeeze(-1),
                  mask),
        "values": (got["values"], train_values, mask_p1),
        "scores": (got["scores"].mean(), torch.tensor(trl["objective/scores"]), None),
        "entropy": ((got["entropy"] * mask).sum() / mask.sum(), (trl_entropy * mask).sum() / mask.sum(), None),
        # PPO in TRL's layout
        "kl": (got["trl"]["kl"].sum(1).mean(), torch.tensor(trl["objective/kl"]), None),
        "advantages": (got["trl"]["advantages"], advantages.masked_fill(mask == 0, 0), mask),
        "returns": (got["trl"]["returns"], raw_advantages + old_values, mask_p1),
        "policy_loss": (got["trl"]["policy_loss"], torch.tensor(trl["loss/policy_avg"]), None),
        "value_loss": (got["trl"]["value_loss"], torch.tensor(trl["loss/value_avg"]), None),
        "policy_clipfrac": (got["trl"]["policy_clipfrac"], torch.tensor(trl["policy/clipfrac_avg"]), None),
        "value_clipfrac": (got["trl"]["value_clipfrac"], torch.tensor(trl["val/clipfrac_avg"]), None),
        # TRL's approxkl is a mean over every slot, padding's zeros included
        "approx_kl": (got["trl"]["approx_kl"] * mask.sum() / mask.numel(), torch.tensor(trl["policy/approxkl_avg"]), None),
        # ours (EasyLM's layout) against TRL's
        "easylm_advantages": (got["easylm"]["advantages"], advantages.masked_fill(mask == 0, 0), mask),
        "easylm_returns": (got["easylm"]["returns"], raw_advantages + old_values, mask),
        "easylm_policy_loss": (got["easylm"]["policy_loss"], torch.tensor(trl["loss/policy_avg"]), None),
    }
    out = {}
    for name, (a, b, m) in pairs.items():
        a, b = rows(a), rows(b)
        diff = (a - b).abs() if m is None else ((a - b).abs() * m)
        out[name] = [a.abs().max().item() if m is not None else a.item(),
                     b.abs().max().item() if m is not None else b.item(), diff.max().item()]
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    main(Path(sys.argv[1]), Path(sys.argv[2]))
