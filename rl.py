"""
On-policy RL for train.py's objective='grpo' (README "Reward models and RL"): the prompts of an SFT micro-batch,
G samples each from VLM.generate, rewards from a rule or a reward model, group-normalised advantages; then the
clipped policy loss (model.grpo_loss) on each optimisation step that reuses the generation batch.
"""

import importlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import convert
import data
import storage
from checkpoint import saved_own
from model import GRPO_LOSSES, group_advantages, grpo_loss, left_pad
from parallel import autocast, gathered_for_generation, print0, shard


def exact_match(completions, answers):
    return [float(c.strip().lower() == a.strip().lower()) for c, a in zip(completions, answers, strict=True)]


RULES = {"exact_match": exact_match}


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
def rollout(raw, b, tok, stop, cfg, score, generator, ref_model=None, static=False, env=None):
    """One micro-batch's generation batch: each prompt of the loader's batch b (on the host) G times, sampled with the
    image token and the ids beyond the tokenizer suppressed; rewards = score(completions, answers, ids, attention_mask,
    pixels). Every row of b: a row without a prompt (dropped by the loader, or longer than a static bucket: counted in
    r["skipped"]; or, with a rule reward, whose reference answer seq_len cut: r["cut"]) is generated from padding and
    masked out of loss and metrics. static (XLA): prompts left-padded to prompt_bucket(cfg), generate(static=True), so
    every rollout has the same shapes and graphs. env puts rows on the device (XLA: split over the data axes), cuts the
    graph after each token and fetches the completions (without env: the rows stay on b's device). With tiles
    (max_tiles), score also takes each row's image_index / image_weight."""
    G, max_new, temperature = cfg["grpo_group"], cfg["grpo_max_new_tokens"], cfg["grpo_temperature"]
    place = env.place_rows if env is not None else (lambda rows: rows)
    asked = prompts_of(b)
    n_asked, T = len(asked), b["labels"].shape[1]
    if not Path(cfg["grpo_reward"]).is_dir():  # a rule reads the reference answer: not one cut short by seq_len
        asked = [(r, p, a) for r, p, a in asked if stop in a or len(p) + len(a) < T]
    n_cut = n_asked - len(asked)
    bucket = prompt_bucket(cfg) if static else max([len(p) for _, p, _ in asked], default=1)
    # every row, a dropped one too: under FSDP2 every rank must generate, even one whose prompts were all dropped
    fits = {r: (p, a) for r, p, a in asked if len(p) <= bucket}
    asked = [(r, *fits.get(r, ([], []))) for r in range(b["input_ids"].shape[0])]
    prompt_ids, prompt_mask = left_pad([p for _, p, _ in asked], tok.pad_id, bucket)
    prompt_ids, prompt_mask = place(prompt_ids.repeat_interleave(G, 0)), place(prompt_mask.repeat_interleave(G, 0))
    pixels = place(b["pixel_values"][torch.tensor([r for r, _, _ in asked]).repeat_interleave(G)])
    pixels, device = data.normalize_images(pixels, *raw.cfg.vision.image_stats), prompt_ids.device
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
    texts = [data.decode_answer(tok, row, stop) for row in host.tolist()]
    answers = [data.decode_answer(tok, a, stop) for _, _, a in asked for _ in range(G)]
    ids, mask = torch.cat([prompt_ids, new], 1), torch.cat([prompt_mask, completion_mask], 1)
    C = new.shape[1]
    tiles = {k: F.pad(v, (0, 0, 0, C)) for k, v in tiles.items()}  # (B * G, T + C, taps): nothing in the completions
    rewards = score(texts, answers, ids, mask, pixels, tiles).float().to(device)  # (B * G,)
    gen_seconds = time.perf_counter() - t0
    r = {"ids": ids, "mask": mask, "pixel_values": pixels, "completion_mask": completion_mask,
         "advantages": group_advantages(rewards, G), "old_logps": None, "ref_logps": None,
         "skipped": n_asked - n_cut - sum(1 for _, p, _ in asked if p), "cut": n_cut,
         "asked": sum(1 for _, p, _ in asked if p)} | tiles
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
                              beta=cfg["grpo_beta"], ref_logps=r["ref_logps"],
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


def check_judge(spec, judge, policy, tok):
    """A reward model of another vocabulary, image placeholder or image layout, or whose checkpoint holds a tokenizer
    that encodes text otherwise, would score the policy's ids and pixels wrongly (or fail deep in its forward)."""
    theirs, ours = reads_inputs(judge.cfg), reads_inputs(policy)
    differ = [f"{k} {theirs[k]} != {ours[k]}" for k in ours if theirs[k] != ours[k]]
    if differ:
        raise SystemExit(f"grpo_reward {spec!r}: the reward model reads ids and images unlike the policy "
                         f"({', '.join(differ)}: the reward model's first)")
    if any((Path(spec) / name).exists() for name in ("tokenizer.model", "tokenizer.json")):
        try:
            judge_tok = data.Tokenizer(spec)
        except Exception as e:  # noqa: BLE001  sentencepiece and tokenizers raise many kinds for a bogus file
            raise SystemExit(f"grpo_reward {spec!r}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
        if judge_tok.vocab_size != tok.vocab_size or judge_tok.encode(PROBE) != tok.encode(PROBE):
            raise SystemExit(f"grpo_reward {spec!r}: its tokenizer {str(judge_tok.path)!r} encodes text unlike the "
                             f"run's {str(tok.path)!r}")


def reward_scorer(cfg, env, policy, tok):
    """score(completions, answers, ids, attention_mask, pixels) -> rewards (rows,), from a rule (reward_rule) or a
    reward-model checkpoint (objective='reward') reading prompt and completion as the policy (VLMConfig) does."""
    spec = cfg["grpo_reward"]
    if not Path(spec).is_dir():
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
        judge = convert.load_model(spec, device=env.device).requires_grad_(False).eval()
    except (convert.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"grpo_reward {spec!r}: cannot load the reward model ({e})") from None
    if judge.reward_head is None:
        raise SystemExit(f"grpo_reward {spec!r}: the checkpoint has no reward head (train one with objective='reward')")
    check_judge(spec, judge, policy, tok)
    if env.distributed and env.kind != "xla" and cfg["parallel"] == "fsdp":
        judge = shard(judge, env, cfg)  # as the policy and the reference: each rank holds its shards
    print0(env, f"grpo: rewards from the reward model {spec}")
    return lambda texts, answers, ids, mask, pixels, tiles: judge(ids, pixels, attention_mask=mask, reward=True,
                                                                  **tiles)[1]


# -----------------------------------------------------------------------------
# train.py's objective='grpo': its config, its setup and each new generation batch

def check_config(cfg):
    """objective='grpo': its keys in train.py's config, each error one sentence."""
    if cfg["grpo_loss"] not in GRPO_LOSSES:
        raise SystemExit(f"config: grpo_loss must be one of {GRPO_LOSSES}, got {cfg['grpo_loss']!r}")
    if cfg["grpo_group"] < 2 or cfg["grpo_iterations"] < 1 or cfg["grpo_max_new_tokens"] < 1:
        raise SystemExit(f"config: grpo_group must be >= 2, grpo_iterations and grpo_max_new_tokens >= 1; got "
                         f"{cfg['grpo_group']}, {cfg['grpo_iterations']}, {cfg['grpo_max_new_tokens']}")
    if cfg["grpo_beta"] < 0 or cfg["grpo_epsilon"] <= 0 or cfg["grpo_temperature"] <= 0 or not 0 < cfg["grpo_top_p"] <= 1:
        raise SystemExit("config: grpo_beta must be >= 0, grpo_epsilon and grpo_temperature > 0, grpo_top_p in (0, 1]")
    if cfg["pack"]:
        raise SystemExit("config: objective='grpo' samples one prompt a row: pack must be 0")
    room = cfg["seq_len"] - cfg["grpo_max_new_tokens"]  # static rollouts (grpo_static, XLA) must fit in seq_len
    if (cfg["grpo_static"] or cfg["device"] == "xla") and not 0 < prompt_bucket(cfg) <= room:
        raise SystemExit(f"config: static rollouts need grpo_prompt_len in [1, seq_len - grpo_max_new_tokens = {room}] "
                         f"(0 takes {room}); got {cfg['grpo_prompt_len']}")
    if cfg["grpo_beta"] and (cfg["grpo_reference"] or cfg["init_from"]) in ("scratch", "resume"):
        raise SystemExit("config: grpo_beta > 0 needs a reference checkpoint: init_from, or grpo_reference=DIR")
    if not Path(cfg["grpo_reward"]).is_dir():
        try:
            reward_rule(cfg["grpo_reward"])
        except ValueError as e:
            raise SystemExit(f"config: {e}") from None


ROLLOUT_KEYS = ("grpo_group", "grpo_loss", "grpo_beta", "grpo_max_new_tokens", "grpo_temperature", "grpo_top_p",
                "grpo_reward", "grpo_static", "grpo_prompt_len")


def setup(cfg, env, loader, resume_from, policy):
    """objective='grpo': the tokenizer, the stop token, the reward scorer and the sampler of the rollouts; and the
    generation batch in flight when a checkpoint taken inside one (grpo_iterations > 1) was written."""
    tok = loader.stream.tok
    static = cfg["grpo_static"] or env.kind == "xla"  # one compiled rollout: fixed prompt bucket and length
    if env.kind == "xla" and env.world > 1:
        raise SystemExit("config: objective='grpo' under XLA runs on one host (multi-host rollouts are not built)")
    longest = cfg["seq_len"] - 1 + cfg["grpo_max_new_tokens"]  # a prompt and its completion (static: in seq_len)
    if not static and longest > policy.llm.max_seq_len:
        raise SystemExit(f"config: seq_len - 1 prompt tokens + grpo_max_new_tokens = {longest} exceed the model's "
                         f"max_seq_len={policy.llm.max_seq_len}: lower seq_len (longer prompts are dropped)")
    if static:
        print0(env, f"grpo: static rollouts, prompts left-padded to {prompt_bucket(cfg)} tokens (longer ones skipped), "
               f"{cfg['grpo_max_new_tokens']} new tokens, hashed draws")
    saved = saved_own(resume_from, env) if resume_from else None
    state = json.loads(storage.read_text(storage.join(resume_from, "state.json"))) if resume_from else {}
    rollout_config = lambda c: {k: bool(c.get(k)) if k == "grpo_beta" else c.get(k) for k in ROLLOUT_KEYS}  # noqa: E731
    made_with, now = rollout_config(state.get("config", {})), rollout_config(cfg)
    changed = [k for k in ROLLOUT_KEYS if made_with[k] != now[k]] if saved is not None else []
    if changed:  # its rollouts lack reference log-probs, or hold other groups, loss units, samples
        print0(env, f"resume: the generation batch in {resume_from} was sampled with other {', '.join(changed)}: "
               f"sampling a new one")
        saved = None
    elif resume_from and saved is None and state["iter"] % cfg["grpo_iterations"]:
        print0(env, f"resume: {resume_from} holds no generation batch for this world size: sampling a new one")
    device = "cpu" if env.kind == "xla" else env.device
    return SimpleNamespace(tok=tok, stop=data.stop_token_id(cfg["template"], tok),
                           score=reward_scorer(cfg, env, policy, tok),
                           sampler=torch.Generator(device), static=static,
                           rollouts=rollouts_from_state(saved, env.device) if saved else None)


def generation_batch(grpo, raw, micro, ref_model, meter, cfg, env, it):
    """A new generation batch: each micro-batch's prompts sampled grpo_group times and scored (seeded by rank, step
    and micro-batch: a step's samples survive a resume)."""
    env.step_end()  # XLA: what is pending (the first step: the setup's work) stays out of the rollouts' graphs
    done = []
    for m, b in enumerate(micro):  # each micro-batch its own seed: its samples whatever the others drew (FSDP2 = DDP)
        grpo.sampler.manual_seed(cfg["seed"] + 7919 * env.rank + 104729 * it + 1299709 * m)
        with autocast(env, cfg):
            done.append(rollout(raw, b, grpo.tok, grpo.stop, cfg, grpo.score, grpo.sampler, ref_model, grpo.static,
                                   env))
    env.step_end()  # XLA: the rollouts' last graph apart from the training step's
    skipped = sum(r["skipped"] for r, _, _ in done)
    if skipped:
        print0(env, f"step {it + 1}: {skipped} prompt(s) longer than grpo_prompt_len={prompt_bucket(cfg)} skipped")
    cut = sum(r["cut"] for r, _, _ in done)
    if cut:
        print0(env, f"step {it + 1}: {cut} prompt(s) skipped: their reference answer (the rule's) was cut at "
               f"seq_len={cfg['seq_len']}")
    meter.gen_seconds += sum(seconds for _, seconds, _ in done)
    meter.gen_rows += sum(len(r["ids"]) for r, _, _ in done)
    grpo.rollouts = [r for r, _, _ in done]
    return grpo.rollouts
