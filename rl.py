"""
On-policy RL for train.py's objectives 'grpo' and 'ppo' (docs/post-training.md): the prompts of an SFT micro-batch,
sampled from VLM.generate and scored by a rule or a reward model. GRPO: G samples a prompt, group-normalised
advantages, the clipped policy loss (losses.grpo_loss) on each step that reuses the generation batch. PPO: one sample a
prompt, a value model, per-token KL rewards and GAE advantages (losses.ppo_*), ppo_epochs passes of mini-batches.
"""

import importlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import chat
import checkpoint
import images
import model_files
import storage
import weight_files
from checkpoint import saved_own
from losses import (GRPO_LOSSES, GRPO_SCALES, KL_ESTIMATORS, explained_variance, gae, group_advantages, grpo_loss,
                    masked_whiten, ppo_loss, ppo_rewards, ppo_score)
from model import build_model, left_pad
from model_config import VLMConfig
from parallel import autocast, gathered_for_generation, print0, shard


def exact_match(completions, answers):
    return [float(c.strip().lower() == a.strip().lower()) for c, a in zip(completions, answers, strict=True)]


RULES = {"exact_match": exact_match}


def is_model_dir(spec):
    """Whether a reward spec names a checkpoint (a local folder, or a bucket URL: read when loaded), not a rule."""
    return storage.is_url(spec) or Path(spec).is_dir()


def reward_rule(spec):
    """A rule by name ('exact_match') or 'module:function' importable from the working directory: a callable
    (completions: list[str], answers: list[str]) -> list[float], the answers being the data's reference answers."""
    if spec in RULES:
        return RULES[spec]
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if name else None
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"grpo_reward {spec!r}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ValueError(f"grpo_reward {spec!r}: expected {sorted(RULES)}, 'module:function' or a reward-model "
                         f"checkpoint directory")
    return fn


def completion_logps(model, ids, attention_mask, pixel_values, n_completion, temperature=1.0, tiles=None):
    """Per-token log-probs (B, C) of the last C = n_completion tokens of ids (prompts left-padded, completions
    right-padded, attention_mask 0 at both), from logits / temperature as generate sampled them; and the entropies
    (B, C) of those distributions. tiles: image_index / image_weight of the tile path (see placed_prompts)."""
    logits, _ = model(ids, pixel_values, attention_mask=attention_mask, logits_to_keep=n_completion + 1, **(tiles or {}))
    logprobs = (logits[:, :-1].float() / temperature).log_softmax(-1)  # position t predicts t + 1
    token_logps = logprobs.gather(-1, ids[:, -n_completion:, None]).squeeze(-1)
    return token_logps, -(logprobs.exp() * logprobs).sum(-1)


def completion_values(value_model, ids, attention_mask, pixel_values, n_completion, tiles=None):
    """PPO's value estimates (B, C) for the last C = n_completion tokens of ids: the value model read where each token
    is predicted (the state before it), the positions completion_logps reads; EasyLM's and TRL's layout."""
    _, values = value_model(ids, pixel_values, attention_mask=attention_mask, values=True,
                            logits_to_keep=n_completion + 1, **(tiles or {}))
    return values[:, :-1]


def prompts_of(b):
    """(row, prompt ids, reference answer ids) of each row of an SFT batch with a supervised answer: the prompt ends
    where the row's first answer starts (later turns are left out)."""
    asked = []
    labels, ids = b["labels"].cpu(), b["input_ids"].cpu()
    for r in range(labels.shape[0]):
        supervised = (labels[r] != -100).nonzero().flatten()
        if not len(supervised):  # a dropped sample has no labels
            continue
        start = int(supervised[0])
        end = start + int((supervised - start == torch.arange(len(supervised))).cumprod(0).sum())
        asked.append((r, ids[r, :start].tolist(), ids[r, start:end].tolist()))
    return asked


def placed_prompts(b, asked, G, T):
    """The tile path (max_tiles): image_index / image_weight (B * G, T, taps) of the prompts as left_pad pads them,
    each row's placement shifted right by its padding (index 0 and weight 0 there: nothing placed); {} without tiles."""
    if "image_index" not in b:
        return {}
    return {k: torch.stack([F.pad(b[k][r, : len(p)], (0, 0, T - len(p), 0)) for r, p, _ in asked]).repeat_interleave(G, 0)
            for k in ("image_index", "image_weight")}


def tiles_of(r):
    return {k: r[k] for k in ("image_index", "image_weight") if r.get(k) is not None}


def prompt_bucket(cfg):
    """The prompt length of static rollouts: grpo_prompt_len, or what seq_len leaves after grpo_max_new_tokens."""
    return cfg["grpo_prompt_len"] or cfg["seq_len"] - cfg["grpo_max_new_tokens"]


@torch.no_grad()
def sample(raw, b, tok, stop, cfg, score, generator, G, static=False, env=None):
    """Each prompt of the loader's batch b (on the host) G times, sampled with the image token and the ids beyond the
    tokenizer suppressed, and scored: rewards = score(completions, answers, ids, attention_mask, pixels, tiles). Every
    row of b: a row without a prompt (dropped by the loader, or longer than a static bucket: counted in "skipped"; or,
    with a rule reward, whose reference answer seq_len cut: "cut") is generated from padding and masked out (its
    "valid" 0). static (XLA): prompts left-padded to prompt_bucket(cfg), generate(static=True), so every rollout has
    the same shapes and graphs. env puts rows on the device (XLA: split over the data axes), cuts the graph after each
    token and fetches the completions (without env: the rows stay on b's device). With tiles (max_tiles), score also
    takes each row's image_index / image_weight. Returns the rows (prompt left-padded, completion right-padded with
    the stop token), their texts and the seconds it took."""
    max_new, temperature = cfg["grpo_max_new_tokens"], cfg["grpo_temperature"]
    place = env.place_rows if env is not None else (lambda rows: rows)
    asked = prompts_of(b)
    n_asked, T = len(asked), b["labels"].shape[1]
    if not is_model_dir(cfg["grpo_reward"]):  # a rule reads the reference answer: not one cut short by seq_len
        asked = [(r, p, a) for r, p, a in asked if stop in a or len(p) + len(a) < T]
    n_cut = n_asked - len(asked)
    bucket = prompt_bucket(cfg) if static else max([len(p) for _, p, _ in asked], default=1)
    # every row, a dropped one too: under FSDP2 every rank must generate, even one whose prompts were all dropped
    fits = {r: (p, a) for r, p, a in asked if len(p) <= bucket}
    asked = [(r, *fits.get(r, ([], []))) for r in range(b["input_ids"].shape[0])]
    prompt_ids, prompt_mask = left_pad([p for _, p, _ in asked], tok.pad_id, bucket)
    prompt_ids, prompt_mask = place(prompt_ids.repeat_interleave(G, 0)), place(prompt_mask.repeat_interleave(G, 0))
    pixels = place(b["pixel_values"][torch.tensor([r for r, _, _ in asked]).repeat_interleave(G)])
    pixels, device = images.normalize_images(pixels, *raw.cfg.vision.image_stats), prompt_ids.device
    suppress = torch.arange(raw.cfg.llm.vocab_size, device=device)
    placeholders = [t for t in (raw.cfg.image_token_id, raw.cfg.video_token_id) if t is not None]
    suppress = (suppress >= tok.vocab_size) | torch.isin(suppress, torch.tensor(placeholders, device=device))
    tiles = {k: place(v) for k, v in placed_prompts(b, asked, G, prompt_ids.shape[1]).items()}
    t0 = time.perf_counter()
    raw.eval()
    with gathered_for_generation(raw, cfg["grpo_gather_for_generation"]) as lockstep:
        new = raw.generate(prompt_ids, pixels, max_new, temperature, cfg["grpo_top_p"],
                           eos_id=None if lockstep else stop, generator=generator, attention_mask=prompt_mask,
                           suppress=suppress, static=static, after_token=None if env is None else env.step_end,
                           **tiles)  # (B * G, C)
    raw.train()
    if lockstep:  # all max_new steps ran (FSDP2): what generate keeps, stop after each row's first and no more columns
        stopped = (new == stop).long().cumsum(1) > 0
        new = torch.where(stopped, stop, new)[:, : int((~stopped).sum(1).max()) + 1]
    valid = prompt_mask[:, -1]  # (B * G,): 0 where a static rollout had no prompt
    is_stop = (new == stop).long()
    completion_mask = (is_stop.cumsum(1) - is_stop == 0).long() * valid[:, None]  # up to and including the first stop
    host = new if env is None else env.to_host(new)  # the rollout's one transfer from the device
    texts = [chat.decode_answer(tok, row, stop) for row in host.tolist()]
    answers = [chat.decode_answer(tok, a, stop) for _, _, a in asked for _ in range(G)]
    ids, mask = torch.cat([prompt_ids, new], 1), torch.cat([prompt_mask, completion_mask], 1)
    C = new.shape[1]
    tiles = {k: F.pad(v, (0, 0, 0, C)) for k, v in tiles.items()}  # (B * G, T + C, taps): nothing in the completions
    rewards = score(texts, answers, ids, mask, pixels, tiles).float().to(device)  # (B * G,)
    s = {"ids": ids, "mask": mask, "pixel_values": pixels, "completion_mask": completion_mask, "rewards": rewards,
         "valid": valid, "ended": (is_stop.sum(1) > 0) & (valid > 0),
         "skipped": n_asked - n_cut - sum(1 for _, p, _ in asked if p), "cut": n_cut,
         "asked": sum(1 for _, p, _ in asked if p)} | tiles
    return s, time.perf_counter() - t0, texts


@torch.no_grad()
def rollout(raw, b, tok, stop, cfg, score, generator, ref_model=None, static=False, env=None):
    """One micro-batch's GRPO generation batch: sample's grpo_group completions a prompt, their group-normalised
    advantages, the sampling policy's log-probs (grpo_iterations > 1) and the reference's (grpo_beta > 0), the loss
    units and the rollout's metrics."""
    G, max_new, temperature = cfg["grpo_group"], cfg["grpo_max_new_tokens"], cfg["grpo_temperature"]
    s, gen_seconds, texts = sample(raw, b, tok, stop, cfg, score, generator, G, static, env)
    ids, mask, pixels, completion_mask, rewards, valid = (s[k] for k in ("ids", "mask", "pixel_values",
                                                                         "completion_mask", "rewards", "valid"))
    tiles, C = tiles_of(s), completion_mask.shape[1]
    r = {k: s[k] for k in ("ids", "mask", "pixel_values", "completion_mask", "rewards", "skipped", "cut", "asked")}
    r |= {"advantages": group_advantages(rewards, G, cfg["grpo_scale_rewards"], valid), "old_logps": None,
          "ref_logps": None} | tiles
    if cfg["grpo_iterations"] > 1:  # the sampling policy's log-probs, for the ratio after the first update
        r["old_logps"] = completion_logps(raw, ids, mask, pixels, C, temperature, tiles)[0]
    if cfg["grpo_beta"]:
        r["ref_logps"] = completion_logps(ref_model, ids, mask, pixels, C, temperature, tiles)[0]
    kind = cfg["grpo_loss"]  # what the step's summed loss is divided by, summed over micro-steps and ranks
    r["units"] = completion_mask.sum() if kind == "dapo" else valid.sum().float() * (max_new if kind == "dr_grpo" else 1)
    row, group = valid.float(), valid.view(-1, G)[:, 0].float()  # the rows and groups with a prompt
    std = rewards.view(-1, G).std(dim=1)
    r["metrics"] = {"rl/reward": masked_mean(rewards, row), "rl/reward_std": masked_mean(std, group),
                    "rl/completion_length": masked_mean(completion_mask.sum(1).float(), row),
                    "rl/zero_std_groups": masked_mean((std == 0).float(), group)}
    return r, gen_seconds, texts


def masked_mean(values, weights):
    return (values * weights).sum() / weights.sum().clamp(min=1)


def rollouts_state(rollouts):
    """A generation batch (rollout's dicts, one a micro-batch) as {name: tensor}, for a checkpoint taken inside it."""
    flat = {}
    for m, r in enumerate(rollouts):
        flat |= {f"{m}.{k}": v for k, v in r.items() if torch.is_tensor(v)} | {f"{m}.asked": torch.tensor(r["asked"])}
        flat |= {f"{m}.metrics.{k}": v for k, v in r["metrics"].items()}
    return flat


def rollouts_from_state(flat, device):
    rollouts = {}
    for name, v in flat.items():
        m, key = name.split(".", 1)
        r = rollouts.setdefault(int(m), {"old_logps": None, "ref_logps": None, "metrics": {}})
        if key.startswith("metrics."):
            r["metrics"][key[len("metrics."):]] = v.to(device)
        elif key == "asked":  # rows with a prompt: whether the micro-batch's metrics count (train.train_step)
            r[key] = int(v)
        else:
            r[key] = v.to(device)
    return [rollouts[m] for m in sorted(rollouts)]


def rl_loss(model, r, cfg):
    """The micro-step's summed GRPO loss (divided by the step's units outside) and its metrics."""
    logps, entropy = completion_logps(model, r["ids"], r["mask"], r["pixel_values"], r["completion_mask"].shape[1],
                                      cfg["grpo_temperature"], tiles_of(r))
    old = logps.detach() if r["old_logps"] is None else r["old_logps"]  # one update a generation batch: ratio 1
    loss, metrics = grpo_loss(logps, old, r["advantages"], r["completion_mask"], cfg["grpo_loss"], cfg["grpo_epsilon"],
                              cfg["grpo_epsilon_high"] or None, beta=cfg["grpo_beta"], ref_logps=r["ref_logps"],
                              max_completion_length=cfg["grpo_max_new_tokens"])
    m = r["completion_mask"]
    metrics = {f"rl/{k}": v for k, v in metrics.items()} | r["metrics"]
    metrics["rl/entropy"] = (entropy.detach() * m).sum() / m.sum().clamp(min=1)
    # back to a sum: grpo_loss divided by the micro-batch's completion tokens (dapo), rows (grpo) or rows x
    # grpo_max_new_tokens (dr_grpo), padding rows of a static rollout included; r["units"] leaves those out
    kind = cfg["grpo_loss"]
    return loss * (m.sum() if kind == "dapo" else len(m) * (cfg["grpo_max_new_tokens"] if kind == "dr_grpo" else 1)), metrics


def reads_inputs(vlm):
    """What decides how a model reads token ids and pixels (a reward model must read the policy's as the policy does)."""
    return {"vocab_size": vlm.llm.vocab_size, "image_token_id": vlm.image_token_id, "video_token_id": vlm.video_token_id,
            "image_size": vlm.vision.image_size, "n_image_tokens": vlm.n_image_tokens,
            "image_stats": vlm.vision.image_stats, "anyres": vlm.anyres, "grid_pinpoints": vlm.grid_pinpoints}


PROBE = "How many circles? Two; 12 squares, 3.5% ÄÖü 漢字 😀\n\t<|eot_id|></s> Hello world"


def check_judge(spec, judge, policy, tok, key="grpo_reward", what="reward model"):
    """A reward (or value) model of another vocabulary, image placeholder or image layout, or whose checkpoint holds a
    tokenizer that encodes text otherwise, would score the policy's ids and pixels wrongly (or fail deep in its
    forward). key: the config key that named it."""
    theirs, ours = reads_inputs(judge.cfg), reads_inputs(policy)
    differ = [f"{k} {theirs[k]} != {ours[k]}" for k in ours if theirs[k] != ours[k]]
    if differ:
        raise SystemExit(f"{key} {spec!r}: the {what} reads ids and images unlike the policy "
                         f"({', '.join(differ)}: the {what}'s first)")
    if any(storage.exists(storage.join(spec, name)) for name in ("tokenizer.model", "tokenizer.json")):
        try:
            judge_tok = chat.Tokenizer(spec)
        except Exception as e:  # noqa: BLE001  sentencepiece and tokenizers raise many kinds for a bogus file
            raise SystemExit(f"{key} {spec!r}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
        if judge_tok.vocab_size != tok.vocab_size or judge_tok.encode(PROBE) != tok.encode(PROBE):
            raise SystemExit(f"{key} {spec!r}: its tokenizer {str(judge_tok.path)!r} encodes text unlike the "
                             f"run's {str(tok.path)!r}")


def reward_scorer(cfg, env, policy, tok):
    """score(completions, answers, ids, attention_mask, pixels) -> rewards (rows,), from a rule (reward_rule) or a
    reward-model checkpoint (objective='reward') reading prompt and completion as the policy (VLMConfig) does."""
    spec = cfg["grpo_reward"]
    if not is_model_dir(spec):
        rule = reward_rule(spec)

        def score(texts, answers, *_):
            got = rule(texts, answers)
            try:
                rewards = torch.tensor(got, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):  # None, strings, ragged lists
                rewards = None
            if rewards is None or rewards.shape != (len(texts),):
                raise SystemExit(f"grpo_reward {spec!r}: expected a list of {len(texts)} floats, one a completion, got "
                                 f"{str(got)[:80]}")
            return rewards
        return score
    try:
        judge = model_files.load_model(spec, device=env.device).requires_grad_(False).eval()
    except (weight_files.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"grpo_reward {spec!r}: cannot load the reward model ({e})") from None
    if judge.reward_head is None:
        raise SystemExit(f"grpo_reward {spec!r}: the checkpoint has no reward head (train one with objective='reward')")
    check_judge(spec, judge, policy, tok)
    if env.distributed and env.kind != "xla" and env.parallel == "fsdp":
        judge = shard(judge, env)  # as the policy and the reference: each rank holds its shards
    print0(env, f"{cfg['objective']}: rewards from the reward model {spec}")
    return lambda texts, answers, ids, mask, pixels, tiles: judge(ids, pixels, attention_mask=mask, reward=True,
                                                                  **tiles)[1]


# -----------------------------------------------------------------------------
# train.py's objective='grpo': its config, its setup and each new generation batch

def check_config(cfg):
    """objective='grpo': its keys in train.py's config, each error one sentence."""
    if cfg["grpo_loss"] not in GRPO_LOSSES:
        raise SystemExit(f"config: grpo_loss must be one of {GRPO_LOSSES}, got {cfg['grpo_loss']!r}")
    if cfg["grpo_group"] < 2 or cfg["grpo_iterations"] < 1:
        raise SystemExit(f"config: grpo_group must be >= 2 and grpo_iterations >= 1; got {cfg['grpo_group']}, "
                         f"{cfg['grpo_iterations']}")
    if cfg["grpo_beta"] < 0 or cfg["grpo_epsilon"] <= 0:
        raise SystemExit("config: grpo_beta must be >= 0 and grpo_epsilon > 0")
    if cfg["grpo_scale_rewards"] not in GRPO_SCALES:
        raise SystemExit(f"config: grpo_scale_rewards must be one of {GRPO_SCALES}, got {cfg['grpo_scale_rewards']!r}")
    if cfg["grpo_epsilon_high"] < 0:
        raise SystemExit(f"config: grpo_epsilon_high must be >= 0 (0: grpo_epsilon), got {cfg['grpo_epsilon_high']}")
    check_rollout_config(cfg)
    if cfg["grpo_beta"] and (cfg["grpo_reference"] or cfg["init_from"]) in ("scratch", "resume"):
        raise SystemExit("config: grpo_beta > 0 needs a reference checkpoint: init_from, or grpo_reference=DIR")


def check_rollout_config(cfg):
    """The grpo_* keys that say how GRPO's and PPO's rollouts are sampled and scored."""
    if cfg["grpo_max_new_tokens"] < 1 or cfg["grpo_temperature"] <= 0 or not 0 < cfg["grpo_top_p"] <= 1:
        raise SystemExit(f"config: grpo_max_new_tokens must be >= 1, grpo_temperature > 0, grpo_top_p in (0, 1]; got "
                         f"{cfg['grpo_max_new_tokens']}, {cfg['grpo_temperature']}, {cfg['grpo_top_p']}")
    if cfg["pack"]:
        raise SystemExit(f"config: objective={cfg['objective']!r} samples one prompt a row: pack must be 0")
    room = cfg["seq_len"] - cfg["grpo_max_new_tokens"]  # static rollouts (grpo_static, XLA) must fit in seq_len
    if (cfg["grpo_static"] or cfg["device"] == "xla") and not 0 < prompt_bucket(cfg) <= room:
        raise SystemExit(f"config: static rollouts need grpo_prompt_len in [1, seq_len - grpo_max_new_tokens = {room}] "
                         f"(0 takes {room}); got {cfg['grpo_prompt_len']}")
    if "/" in cfg["grpo_reward"] and not is_model_dir(cfg["grpo_reward"]):  # not 'module:function' either
        steps = "; ".join(f"({i}) {c}" for i, c in enumerate(cfg.get("prepare", []), 1))
        raise SystemExit(f"config: grpo_reward {cfg['grpo_reward']!r}: no such reward-model checkpoint directory"
                         + (f"; this config's inputs are made by: {steps}" if steps else ""))
    if cfg["grpo_reward"] and not is_model_dir(cfg["grpo_reward"]):
        try:
            reward_rule(cfg["grpo_reward"])
        except ValueError as e:
            raise SystemExit(f"config: {e}") from None


def check_ppo_config(cfg, replicas=1):
    """objective='ppo': its keys in train.py's config, each error one sentence. replicas: the ranks (1 under SPMD, whose
    micro_batch_size is global), when known: a mini-batch is whole micro-steps of micro_batch_size x replicas."""
    if not (0 <= cfg["ppo_gamma"] <= 1 and 0 <= cfg["ppo_lam"] <= 1):
        raise SystemExit(f"config: ppo_gamma and ppo_lam must lie in [0, 1], got {cfg['ppo_gamma']}, {cfg['ppo_lam']}")
    mini = cfg["ppo_mini_batch_size"] or cfg["batch_size"]
    if mini < 0 or cfg["batch_size"] % mini:
        raise SystemExit(f"config: ppo_mini_batch_size={cfg['ppo_mini_batch_size']} must divide the rollout batch "
                         f"batch_size={cfg['batch_size']} (each mini-batch is one optimizer step; 0: the whole batch)")
    if mini % (cfg["micro_batch_size"] * replicas):
        raise SystemExit(f"config: ppo_mini_batch_size={mini} must be a multiple of micro_batch_size x ranks = "
                         f"{cfg['micro_batch_size']} x {replicas}")
    if cfg["ppo_kl_estimator"] not in KL_ESTIMATORS:
        raise SystemExit(f"config: ppo_kl_estimator must be one of {KL_ESTIMATORS}, got {cfg['ppo_kl_estimator']!r}")
    if cfg["ppo_epochs"] < 1 or cfg["ppo_clip"] <= 0 or cfg["ppo_clip_value"] <= 0 or cfg["ppo_kl_coef"] < 0 or \
            cfg["ppo_vf_coef"] < 0 or cfg["ppo_missing_end_penalty"] < 0 or cfg["ppo_value_lr"] < 0:
        raise SystemExit("config: ppo_epochs must be >= 1, ppo_clip and ppo_clip_value > 0, ppo_kl_coef, ppo_vf_coef, "
                         "ppo_missing_end_penalty and ppo_value_lr >= 0")
    if not cfg["grpo_reward"]:
        raise SystemExit("config: objective='ppo' needs a reward: grpo_reward = a rule ('exact_match', "
                         "'module:function') or a reward-model checkpoint directory")
    check_rollout_config(cfg)
    value = cfg["ppo_value_init"] or (cfg["grpo_reward"] if is_model_dir(cfg["grpo_reward"]) else "")
    if not value:
        raise SystemExit(f"config: objective='ppo' needs a value model to start from: ppo_value_init = a reward-model "
                         f"checkpoint directory (grpo_reward {cfg['grpo_reward']!r} is a rule, not one)")
    if not is_model_dir(value):
        raise SystemExit(f"config: ppo_value_init {value!r}: no such checkpoint directory")
    if (cfg["grpo_reference"] or cfg["init_from"]) in ("scratch", "resume"):
        raise SystemExit("config: objective='ppo' needs a reference checkpoint for its KL penalty: init_from, or "
                         "grpo_reference=DIR")


LATER_KEYS = {"grpo_scale_rewards": "group"}  # what a checkpoint written before the key existed was made with
ROLLOUT_KEYS = ("grpo_group", "grpo_loss", "grpo_scale_rewards", "grpo_beta", "grpo_max_new_tokens", "grpo_temperature",
                "grpo_top_p", "grpo_reward", "grpo_static", "grpo_prompt_len")


class GenerationBatches:
    """What a GRPO step trains on: a generation batch, sampled from the loader's prompts every grpo_iterations steps
    and reused in between (objectives.ReadBatches is the other objectives'). Set up with the tokenizer, the stop token, the
    reward scorer and the sampler of the rollouts, and the generation batch in flight when a checkpoint taken inside
    one (grpo_iterations > 1) was written."""

    def __init__(self, cfg, env, loader, resume_from, raw, value_model=None):
        self.cfg, self.env = cfg, env
        self.tok, self.stop, self.static, self.score, self.sampler = sampling(cfg, env, loader, raw)
        saved = saved_batch(resume_from, env, cfg, ROLLOUT_KEYS, cfg["grpo_iterations"], "generation batch")
        self.rollouts = rollouts_from_state(saved, env.device) if saved else None
        self.rows_per_step, self.completions_per_prompt = cfg["batch_size"], cfg["grpo_group"]

    def fresh(self, it):
        return it % self.cfg["grpo_iterations"] == 0 or self.rollouts is None

    def prepare(self, micro, raw, ref_model, meter, it):
        """The step's generation batch: a new one from the host batches when they are fresh, else the one in hand."""
        return generation_batch(self, raw, micro, ref_model, meter, self.cfg, self.env, it) if micro else self.rollouts

    def skipped(self, fresh):
        if fresh:  # a skipped step leaves no generation batch for the steps after it: the next one samples
            self.rollouts = None

    def in_flight(self, it):
        """The generation batch the next step reuses, for a checkpoint taken inside it."""
        return rollouts_state(self.rollouts) if it % self.cfg["grpo_iterations"] and self.rollouts else None


def sampling(cfg, env, loader, raw):
    """(tokenizer, stop token, static, reward scorer, sampler) of GRPO's and PPO's rollouts, their setup checked."""
    policy = raw.cfg
    static = cfg["grpo_static"] or env.kind == "xla"  # one compiled rollout: fixed prompt bucket and length
    if env.kind == "xla" and env.world > 1:
        raise SystemExit(f"config: objective={cfg['objective']!r} under XLA runs on one host (multi-host rollouts are "
                         f"not built)")
    longest = cfg["seq_len"] - 1 + cfg["grpo_max_new_tokens"]  # a prompt and its completion (static: in seq_len)
    if not static and longest > policy.llm.max_seq_len:
        raise SystemExit(f"config: seq_len - 1 prompt tokens + grpo_max_new_tokens = {longest} exceed the model's "
                         f"max_seq_len={policy.llm.max_seq_len}: lower seq_len (longer prompts are dropped)")
    if static:
        print0(env, f"{cfg['objective']}: static rollouts, prompts left-padded to {prompt_bucket(cfg)} tokens (longer "
               f"ones skipped), {cfg['grpo_max_new_tokens']} new tokens, hashed draws")
    tok = loader.stream.tok
    sampler = torch.Generator("cpu" if env.kind == "xla" else env.device)
    return tok, chat.stop_token_id(cfg["template"], tok), static, reward_scorer(cfg, env, policy, tok), sampler


def saved_batch(resume_from, env, cfg, keys, steps_a_batch, what):
    """The rollouts in flight that a checkpoint holds (Checkpointer.save's own), or None: none saved, another world
    size wrote them, or they were made with other values of the keys that make them (then said)."""
    if not resume_from:
        return None
    saved = saved_own(resume_from, env)
    state = json.loads(storage.read_text(storage.join(resume_from, "state.json")))
    made_with = lambda c: {k: bool(c.get(k)) if k == "grpo_beta" else c.get(k, LATER_KEYS.get(k))  # noqa: E731
                           for k in keys}
    changed = [k for k in keys if made_with(state.get("config", {}))[k] != made_with(cfg)[k]] if saved else []
    if changed:  # its rollouts lack reference log-probs, or hold other groups, loss units, samples, advantages
        print0(env, f"resume: the {what} in {resume_from} was sampled with other {', '.join(changed)}: sampling a new one")
        return None
    if saved is None and state["iter"] % steps_a_batch:
        print0(env, f"resume: {resume_from} holds no {what} for this world size: sampling a new one")
    return saved


def generation_batch(grpo, raw, micro, ref_model, meter, cfg, env, it):
    """A new generation batch: each micro-batch's prompts sampled grpo_group times and scored (seeded by rank, step
    and micro-batch: a step's samples survive a resume)."""
    env.step_end()  # XLA: what is pending (the first step: the setup's work) stays out of the rollouts' graphs
    done = []
    for m, b in enumerate(micro):  # each micro-batch its own seed: its samples whatever the others drew (FSDP2 = DDP)
        grpo.sampler.manual_seed(cfg["seed"] + 7919 * env.rank + 104729 * it + 1299709 * m)
        with autocast(env):
            done.append(rollout(raw, b, grpo.tok, grpo.stop, cfg, grpo.score, grpo.sampler, ref_model, grpo.static,
                                   env))
    env.step_end()  # XLA: the rollouts' last graph apart from the training step's
    report_sampled(done, meter, cfg, env, it)
    grpo.rollouts = [r for r, _, _ in done]
    if cfg["grpo_scale_rewards"] == "batch":  # TRL divides by the std of the whole generation batch, every rank's
        std = batch_std(grpo.rollouts, env.all_sum)
        for r in grpo.rollouts:
            r["advantages"] = group_advantages(r["rewards"], cfg["grpo_group"], "batch", batch_std=std)
    return grpo.rollouts


def report_sampled(done, meter, cfg, env, it):
    """The prompts a rollout batch ((rollout, seconds, texts) a micro-batch) skipped, said; its time and rows metered."""
    skipped = sum(r["skipped"] for r, _, _ in done)
    if skipped:
        print0(env, f"step {it + 1}: {skipped} prompt(s) longer than grpo_prompt_len={prompt_bucket(cfg)} skipped")
    cut = sum(r["cut"] for r, _, _ in done)
    if cut:
        print0(env, f"step {it + 1}: {cut} prompt(s) skipped: their reference answer (the rule's) was cut at "
               f"seq_len={cfg['seq_len']}")
    meter.gen_seconds += sum(seconds for _, seconds, _ in done)
    meter.gen_rows += sum(len(r["ids"]) for r, _, _ in done)


def batch_std(rollouts, all_sum):
    """The unbiased std of the rewards of a generation batch's rows with a prompt, over its micro-batches (rollout's
    dicts) and, through all_sum, every rank's."""
    valid = [r["mask"][:, -r["completion_mask"].shape[1] - 1].float() for r in rollouts]  # the prompt's last token
    return batch_moments([r["rewards"] for r in rollouts], valid, all_sum)[1].sqrt()


def batch_moments(parts, masks, all_sum):
    """(mean, unbiased variance) of the values of parts (tensors, a batch's micro-batches) where masks are 1, over all
    of them and, through all_sum, every rank's (two passes: values far from 0 lose nothing to cancellation)."""
    total = lambda f: all_sum(torch.stack([(m * f(x)).sum() for x, m in zip(parts, masks)]).sum())  # noqa: E731
    n = total(torch.ones_like)
    mean = total(lambda x: x) / n.clamp(min=1)
    return mean, total(lambda x: (x - mean) ** 2) / (n - 1).clamp(min=1)


# -----------------------------------------------------------------------------
# train.py's objective='ppo': the value model, each rollout batch and the mini-batches of its epochs

PPO_ROLLOUT_KEYS = ("grpo_max_new_tokens", "grpo_temperature", "grpo_top_p", "grpo_reward", "grpo_static",
                    "grpo_prompt_len", "ppo_kl_coef", "ppo_kl_estimator", "ppo_reward_gain", "ppo_reward_bias",
                    "ppo_missing_end_penalty", "ppo_gamma", "ppo_lam", "ppo_whiten_rewards", "ppo_epochs",
                    "ppo_mini_batch_size", "micro_batch_size")
TRAINED_ON = ("ids", "mask", "completion_mask", "pixel_values", "image_index", "image_weight", "old_logps",
              "old_values", "advantages", "returns")  # a rollout batch's rows that a step places on the device


def load_value_model(cfg, env, policy, tok, resume_from=None):
    """PPO's value model, unsharded: the reward-model checkpoint ppo_value_init (else grpo_reward's), its head read at
    every token (VLM.forward(values=True)), as EasyLM, TRL and LLaVA-RLHF start it; or, resuming, built empty as the
    checkpoint's (which checkpoint.load_checkpoint fills). It must read ids and images as the policy (a VLM) does."""
    spec = cfg["ppo_value_init"] or cfg["grpo_reward"]
    build_on = "cpu" if env.kind == "xla" else env.device
    if resume_from:
        saved = VLMConfig.from_dict(json.loads(storage.read_text(storage.join(resume_from, checkpoint.VALUE_CONFIG))))
        return build_model(saved, device=build_on, init=False)
    try:
        value_model = model_files.load_model(spec, device=build_on)
    except (weight_files.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"ppo_value_init {spec!r}: cannot load the value model ({e})") from None
    if value_model.reward_head is None:
        raise SystemExit(f"ppo_value_init {spec!r}: the checkpoint has no reward head to read values from (train one "
                         f"with objective='reward')")
    check_judge(spec, value_model, policy.cfg, tok, "ppo_value_init", "value model")
    print0(env, f"ppo: value model from {spec}")
    return value_model


class PPOBatches:
    """What a PPO step trains on: one mini-batch of a rollout batch. A rollout batch is batch_size prompts, one
    completion each, sampled and scored every ppo_epochs x batch_size / ppo_mini_batch_size steps; the sampling
    policy's log-probs, the values and the advantages stay fixed through its epochs, as TRL's PPOTrainer keeps them
    (EasyLM recomputes them in each mini-batch, so its ratio is 1 and its clip never binds). Each epoch shuffles the
    rows, seeded by the step that began the batch and the epoch: a resume inside it trains on the same mini-batches.
    The batch is held on the host (in a checkpoint taken inside it too); a step places its mini-batch on the device."""

    def __init__(self, cfg, env, loader, resume_from, raw, value_model=None):
        check_ppo_config(cfg, env.replicas)
        self.cfg, self.env, self.value_model, self.vision = cfg, env, value_model, raw.cfg.vision
        self.tok, self.stop, self.static, self.score, self.sampler = sampling(cfg, env, loader, raw)
        mini = cfg["ppo_mini_batch_size"] or cfg["batch_size"]
        self.mini_rows, self.n_mini = mini // env.replicas, cfg["batch_size"] // mini  # this rank's rows of a mini-batch
        self.cycle = cfg["ppo_epochs"] * self.n_mini  # the steps that train on one rollout batch
        self.batch = saved_batch(resume_from, env, cfg, PPO_ROLLOUT_KEYS, self.cycle, "rollout batch")
        self.rows_per_step, self.completions_per_prompt = mini, 1

    def fresh(self, it):
        return it % self.cycle == 0 or self.batch is None

    def prepare(self, micro, raw, ref_model, meter, it):
        """Step it's micro-batches: a new rollout batch from the host batches when they are fresh, then the rows of
        this step's mini-batch in its epoch's order, placed on the device."""
        self.env.step_end()  # XLA: what is pending (the log's resets) apart, so every step's graph is the same
        if micro:
            self.batch = rollout_batch(self, raw, micro, ref_model, meter, it)
        k = it % self.cycle
        epoch, j = divmod(k, self.n_mini)
        order = torch.randperm(len(self.batch["valid"]), generator=torch.Generator().manual_seed(
            self.cfg["seed"] + 104729 * (it - k) + 7919 * epoch))
        rows = order[j * self.mini_rows: (j + 1) * self.mini_rows]
        return [self.placed(idx) for idx in rows.split(self.cfg["micro_batch_size"])]

    def placed(self, idx):
        env, b = self.env, self.batch
        m = {k: env.place_rows(b[k][idx]) for k in TRAINED_ON if k in b}
        m["pixel_values"] = images.normalize_images(m["pixel_values"], *self.vision.image_stats)
        asked = int(b["valid"][idx].sum())  # rows with a prompt: whether the micro-batch's metrics count
        names = sorted(k for k in b if k.startswith("metrics."))
        # one vector: XLA would make a 0-d tensor holding 0 or 1 a constant of the graph (a graph for each value)
        values = (torch.stack([b[k] for k in names]) * bool(asked)).to(env.device)
        return m | {"units": m["completion_mask"].sum(), "asked": asked,
                    "metrics": {k.removeprefix("metrics."): values[i] for i, k in enumerate(names)}}

    def skipped(self, fresh):
        if fresh:  # a skipped step leaves no rollout batch for the steps after it: the next one samples
            self.batch = None

    def in_flight(self, it):
        """The rollout batch the next step trains on, for a checkpoint taken inside it."""
        return self.batch if it % self.cycle and self.batch is not None else None


@torch.no_grad()
def rollout_batch(ppo, raw, micro, ref_model, meter, it):
    """A new rollout batch: each micro-batch's prompts sampled once and scored (seeded by rank, step and micro-batch as
    GRPO's), padded to one shape; the sampling policy's and the reference's log-probs and the values; then on the
    host the per-token rewards, GAE advantages and returns, advantages whitened over the whole batch, every rank's.
    Returns {name: host tensor}: the rows, and the batch's metrics ("metrics.rl/...")."""
    cfg, env = ppo.cfg, ppo.env
    done = []
    for m, b in enumerate(micro):
        ppo.sampler.manual_seed(cfg["seed"] + 7919 * env.rank + 104729 * it + 1299709 * m)
        with autocast(env):
            done.append(sample(raw, b, ppo.tok, ppo.stop, cfg, ppo.score, ppo.sampler, 1, ppo.static, env))
    report_sampled(done, meter, cfg, env, it)
    C = max(s["completion_mask"].shape[1] for s, _, _ in done)
    P = max(s["ids"].shape[1] - s["completion_mask"].shape[1] for s, _, _ in done)
    parts = [pad_rollout(s, P, C, ppo.tok.pad_id, ppo.stop) for s, _, _ in done]
    for s in parts:
        args = (s["ids"], s["mask"], s["pixel_values"], C)
        with autocast(env):
            s["old_logps"] = completion_logps(raw, *args, cfg["grpo_temperature"], tiles_of(s))[0]
            s["ref_logps"] = completion_logps(ref_model, *args, cfg["grpo_temperature"], tiles_of(s))[0]
            s["old_values"] = completion_values(ppo.value_model, *args, tiles_of(s))
    env.step_end()  # XLA: the forwards' graph apart from the fetches
    fetched = ("ids", "mask", "completion_mask", "old_logps", "ref_logps", "old_values", "rewards", "ended", "valid",
               *tiles_of(parts[0]))
    h = {k: torch.cat([env.to_host(s[k]) for s in parts]) for k in fetched}
    h["pixel_values"] = torch.cat([b["pixel_values"] for b in micro])  # uint8, one completion a prompt: b's rows
    return h | advantages_of(h, cfg, env)


def pad_rollout(s, P, C, pad_id, stop):
    """A sample's rows with prompts left-padded to P tokens and completions right-padded to C (with attention_mask 0
    there, each row's logits and values are those of its tokens alone)."""
    p, c = s["ids"].shape[1] - s["completion_mask"].shape[1], s["completion_mask"].shape[1]
    if (p, c) == (P, C):
        return s
    both = lambda x, before, after: torch.cat([F.pad(x[:, :p], (P - p, 0), value=before),  # noqa: E731
                                              F.pad(x[:, p:], (0, C - c), value=after)], 1)
    return s | {"ids": both(s["ids"], pad_id, stop), "mask": both(s["mask"], 0, 0),
                "completion_mask": F.pad(s["completion_mask"], (0, C - c))} | \
        {k: F.pad(v, (0, 0, P - p, C - c)) for k, v in tiles_of(s).items()}


def advantages_of(h, cfg, env):
    """A rollout batch's (on the host) score, per-token rewards, GAE advantages (whitened over every rank's batch) and
    returns, and its metrics: the reward, the KL to the reference (a completion's sum, as TRL logs it), how well the
    values explained the returns."""
    mask, row = h["completion_mask"].float(), h["valid"].float()
    score = ppo_score(h["rewards"], h["ended"], cfg["ppo_reward_gain"], cfg["ppo_reward_bias"],
                      cfg["ppo_missing_end_penalty"]) * row
    rewards, kl = ppo_rewards(h["old_logps"], h["ref_logps"], score, mask, cfg["ppo_kl_coef"], cfg["ppo_kl_estimator"])
    over_ranks = (lambda t: env.all_sum(t.to(env.device)).cpu()) if env.distributed else (lambda t: t)
    if cfg["ppo_whiten_rewards"]:
        rewards = masked_whiten(rewards, mask, shift_mean=False, moments=batch_moments([rewards], [mask], over_ranks))
    advantages, returns = gae(rewards, h["old_values"], mask, cfg["ppo_gamma"], cfg["ppo_lam"])
    advantages = masked_whiten(advantages, mask, moments=batch_moments([advantages], [mask], over_ranks))
    metrics = {"rl/reward": masked_mean(h["rewards"], row), "rl/score": masked_mean(score, row),
               "rl/kl": masked_mean(kl.sum(1), row), "rl/completion_length": masked_mean(mask.sum(1), row),
               "rl/explained_variance": explained_variance(h["old_values"], returns, mask)}
    return {"advantages": advantages, "returns": returns} | {f"metrics.{k}": v for k, v in metrics.items()}


def ppo_micro_loss(model, value_model, b, cfg):
    """The micro-step's PPO loss summed over its completion tokens (train.py divides by the mini-batch's) and its
    metrics: the policy and value losses as token means, the clip fractions, the approximate KL to the sampling policy,
    the entropy, and the rollout batch's."""
    m, C, tiles = b["completion_mask"], b["completion_mask"].shape[1], tiles_of(b)
    logps, entropy = completion_logps(model, b["ids"], b["mask"], b["pixel_values"], C, cfg["grpo_temperature"], tiles)
    values = completion_values(value_model, b["ids"], b["mask"], b["pixel_values"], C, tiles)
    loss, metrics = ppo_loss(logps, b["old_logps"], values, b["old_values"], b["advantages"], b["returns"], m,
                             cfg["ppo_clip"], cfg["ppo_clip_value"], cfg["ppo_vf_coef"], n_tokens=1)
    tokens = m.sum().clamp(min=1)
    metrics = {f"rl/{k}": v / tokens if k.endswith("_loss") else v for k, v in metrics.items()} | b["metrics"]
    metrics["rl/entropy"] = (entropy.detach() * m).sum() / tokens
    return loss, metrics
