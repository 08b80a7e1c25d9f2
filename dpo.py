"""
Preference training for train.py (objective='dpo', and 'reward': a reward model on the same pairs): the frozen
reference, each row's completion log-prob, the pair losses and their held-out pass. The losses themselves
(`dpo_loss`, `reward_loss`) are beside the token loss in model.py; the data (pairs as rows [chosen...,
rejected...], one image a pair) is data.ShardStream(preference=True). And a program: on-policy pairs, the model's
own wrong answers as the rejected side (docs/post-training.md "DPO"):

    python dpo.py pairs --ckpt out/shapes-dpo-sft-250/step-000250 --data data/shapes-dpo/preference \\
        --out data/shapes-dpo/onpolicy
"""

import argparse
import io
import json
import shutil
from collections import Counter
from pathlib import Path

import torch
from PIL import Image
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

import chat
from images import load_image, normalize_images
import loader
import model_files
import weight_files
from evaluation import device_batch
from lora import adapters_off, is_lora_parameter
from losses import dpo_loss as pair_loss  # train.py's config key dpo_loss names its kind
from losses import reward_loss
from model import left_pad
from pack import pack
from parallel import autocast, checkpoint_fn, print0, shard


def reference_model(cfg, env, policy=None):
    """The frozen reference (dpo, grpo with a KL term, ppo), placed as the policy is (FSDP/SPMD-sharded, or whole under
    DDP). With LoRA and no reference named: the policy itself with its adapters off (AdapterFreeReference)."""
    named = cfg["grpo_reference" if cfg["objective"] in ("grpo", "ppo") else "dpo_reference"]
    if cfg["lora"] and not named and policy is not None and not trained_adapters(policy):
        ref = AdapterFreeReference(policy)
        print0(env, f"{cfg['objective']}: reference model = the policy with its LoRA adapters off"
               + (f" and its {len(ref.start)} tensors trained in full at their start values" if ref.start else ""))
        return ref
    source = named or cfg["init_from"]
    build_on = "cpu" if env.kind == "xla" else env.device
    try:
        ref = model_files.load_model(source, device=build_on).requires_grad_(False).eval()
    except (weight_files.ConversionError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{cfg['objective']} reference {str(source)!r}: cannot load the model ({e})") from None
    ref.loss_chunk, ref.recompute = cfg["loss_chunk"], checkpoint_fn(env.kind)  # its log-probs as the policy's
    print0(env, f"{cfg['objective']}: reference model {source} (frozen)")
    return ref if env.distributed and env.kind != "xla" and env.parallel == "ddp" else shard(ref, env)


def trained_adapters(policy):
    """Whether the policy starts with adapters already trained (init_from a LoRA run with the same lora, whose
    reference is that run's model, adapters included): a B not zero."""
    bs = [p.detach() for n, p in policy.named_parameters() if n.endswith(".lora_B.weight")]
    return any(bool((b.full_tensor() if hasattr(b, "full_tensor") else b).ne(0).any()) for b in bs)  # FSDP2: whole


class AdapterFreeReference:
    """LoRA's reference without a second copy of the model, as TRL does with peft's disable_adapter: the policy run
    with its adapters off (lora.adapters_off), and what it trains in full beside them (LLaVA's projector) swapped
    for a copy of its start values, as peft swaps modules_to_save back. Memory: that copy, not a whole model. Call
    it before the policy's own forward (the swap is in place: a graph that saved those weights would break)."""

    def __init__(self, policy):
        self.policy = policy
        self.start = {n: p.detach().clone() for n, p in policy.named_parameters()
                      if p.requires_grad and not is_lora_parameter(n)}  # clones keep FSDP's and SPMD's sharding

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        self.reshard()
        trained = {n: p.detach().clone() for n, p in self.policy.named_parameters() if n in self.start}
        # autocast keeps its bf16 cast of a trained weight for the rest of the region, keyed by the tensor and blind
        # to the swap: the reference ran on the policy's projector, or the policy's next forward on the reference's
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        with adapters_off(self.policy):
            try:
                self.swap_in(self.start)
                return self.policy(*args, **kwargs)
            finally:
                self.swap_in(trained)
                torch.set_autocast_cache_enabled(cache)

    def swap_in(self, values):
        self.reshard()
        params = dict(self.policy.named_parameters())
        for n, v in values.items():
            params[n].copy_(v)

    def reshard(self):
        """FSDP2 keeps the root's gathered weights after a forward (registered in place of its shards): drop them,
        so that the shards are what we swap and the next forward gathers them anew."""
        for m in self.policy.modules() if self.start else ():
            if isinstance(m, FSDPModule):
                m.reshard()


def sequence_logps(model, b):
    """Each row's summed log-prob of its supervised (completion) tokens, and their count: (rows,), (rows,)."""
    _, row_loss = model(b["input_ids"], b["pixel_values"], b["labels"], "row",
                        image_index=b.get("image_index"), image_weight=b.get("image_weight"))
    return -row_loss, (b["labels"][:, 1:] != -100).sum(dim=1)


def without_last_label(labels):
    """labels (rows, T) with each row's last supervised one set to -100 (a row with none is unchanged)."""
    at = torch.arange(labels.shape[1], device=labels.device)
    last = (at * (labels != -100)).amax(dim=1, keepdim=True)  # (rows, 1)
    return torch.where((at == last) & (labels != -100), -100, labels)


def preference_loss(model, ref_model, b, cfg):
    """Rows [chosen..., rejected...] with one image a pair; the reference is frozen. dpo_end_of_turn=False: each
    row's last supervised token (the end of turn after the answer, in both sides of a pair) is left out."""
    if not cfg["dpo_end_of_turn"]:
        b = b | {"labels": without_last_label(b["labels"])}
    with torch.no_grad():  # the reference first: AdapterFreeReference swaps weights the policy's graph would hold
        ref_logps, _ = sequence_logps(ref_model, b)
    logps, n_tokens = sequence_logps(model, b)
    return pair_loss(logps, ref_logps, n_tokens, cfg["dpo_beta"], cfg["dpo_loss"], cfg["dpo_sft_weight"])


@torch.no_grad()
def evaluate_preference(model, ref_model, val_loaders, env, cfg, n_batches, vision, pair_loss):
    """Validation loss and metrics (pair_loss(model, b, cfg, ref_model): dpo or reward) on the same held-out pairs
    every time, n_batches of each source's val split; a mixture's also by source ("val_loss/NAME"), the pooled
    figures their mean."""
    per = {name: held_out_pairs(model, ref_model, val_loader, env, cfg, n_batches, vision, pair_loss)
           for name, val_loader in val_loaders.items()}
    pooled = {k: sum(m[k] for m in per.values()) / len(per) for k in next(iter(per.values()))}
    return pooled | ({f"{k}/{name}": v for name, m in per.items() for k, v in m.items()} if len(per) > 1 else {})


def held_out_pairs(model, ref_model, val_loader, env, cfg, n_batches, vision, pair_loss):
    model.eval()
    sums, n = {}, 0
    val_loader.position = 0
    for i, batch in enumerate(val_loader):
        if i == n_batches:
            break
        b = device_batch(batch, env, vision)
        with autocast(env):
            loss, metrics = pair_loss(model, b, cfg, ref_model)
        for k, v in ({"loss": loss} | metrics).items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
        env.step_end()
    model.train()
    total = env.all_sum(torch.tensor(float(n), device=env.device))
    return {f"val_{k}": (env.all_sum(v) / total).item() for k, v in sums.items()}


def reward_pairs(model, b, cfg):
    """objective='reward': rows [chosen..., rejected...] right-padded; the head reads each answer's last token (the
    last supervised one: the end of turn), attention_mask 1 up to it."""
    supervised = b["labels"] != -100
    at = torch.arange(supervised.shape[1], device=supervised.device)
    last = (at * supervised).amax(dim=1)  # (rows,)
    _, rewards = model(b["input_ids"], b["pixel_values"], attention_mask=(at <= last[:, None]).long(), reward=True,
                       image_index=b.get("image_index"), image_weight=b.get("image_weight"))
    return reward_loss(rewards, supervised[:, 1:].sum(dim=1), cfg["reward_margin"], cfg["reward_center_weight"])



# -----------------------------------------------------------------------------
# on-policy pairs (OneVision-Chat's iterative DPO): the rejected answer is the model's own mistake
#   python dpo.py pairs --ckpt out/shapes-dpo-sft-250/step-000250 --data data/shapes-dpo/preference \
#       --out data/shapes-dpo/onpolicy


def answer_prompt(conv, has_image, template, tok, image_token_id, n_image_tokens):
    """The ids before the conversation's last answer, as a preference row holds them (data.encode_preference)."""
    answered = conv[:-1] + [{"from": conv[-1]["from"], "value": conv[-1]["value"]}]
    ids, labels, _ = chat.encode_conversation(answered, has_image, template, tok, 1 << 30, image_token_id,
                                              n_image_tokens)
    start = max(i for i, label in enumerate(labels) if label != -100)
    while start > 0 and labels[start - 1] != -100:  # back to the first token of the last answer
        start -= 1
    return ids[:start]


@torch.no_grad()
def model_answers(model, questions, stream, template, n_samples, temperature, max_new_tokens, generator):
    """Each question's answers [greedy, sampled...]: n_samples in all, one left-padded batch. questions: [(prompt
    ids, image bytes or None)]."""
    tok, cfg, stop = stream.tok, model.cfg, chat.stop_token_id(template, stream.tok)
    ids, mask = left_pad([prompt for prompt, _ in questions], tok.pad_id)
    blank = torch.zeros(3, stream.image_size, stream.image_size, dtype=torch.uint8)  # rows without an image
    images = [blank if blob is None else load_image(blob, stream.image_size, stream.image_mode,
                                                         mean=stream.image_mean, resample=stream.resample)
              for _, blob in questions]
    pixels = normalize_images(torch.stack(images), *cfg.vision.image_stats)
    pixels = pixels if (ids == cfg.image_token_id).any() else None
    suppress = torch.arange(cfg.llm.vocab_size)
    suppress = (suppress >= tok.vocab_size) | (suppress == cfg.image_token_id)  # as GRPO samples (rl.rollout)
    max_new = min(max_new_tokens, cfg.llm.max_seq_len - ids.shape[1])
    new = [model.generate(ids, pixels, max_new, eos_id=stop, attention_mask=mask, suppress=suppress)]
    if n_samples > 1:
        k = n_samples - 1
        new.append(model.generate(ids.repeat_interleave(k, 0), None if pixels is None else pixels.repeat_interleave(
            k, 0), max_new, temperature, eos_id=stop, generator=generator, attention_mask=mask.repeat_interleave(k, 0),
            suppress=suppress))
    texts = [[chat.decode_answer(tok, row, stop) for row in rows.tolist()] for rows in new]
    return [[texts[0][q]] + texts[1][q * (n_samples - 1) : (q + 1) * (n_samples - 1)] if n_samples > 1 else
            [texts[0][q]] for q in range(len(questions))]


def rejected_answer(chosen, answers):
    """(the model's wrong answer, 'greedy' or 'sampled') or (None, None): the greedy answer when it is wrong, else
    the most frequent wrong sample. Wrong as exact match counts it (evaluation.answer_accuracy); an empty answer is
    no answer to prefer against."""
    wrong = [a for a in answers if a and a.lower() != chosen.strip().lower()]
    if not wrong:
        return None, None
    if answers[0] in wrong:
        return answers[0], "greedy"
    return Counter(wrong).most_common(1)[0][0], "sampled"


def on_policy_pairs(model, stream, template, n_samples=4, temperature=1.0, max_new_tokens=8, batch_size=64, seed=0,
                    keep_answered=False, limit=0):
    """Preference records for one split (pack.preference_record's format, images as bytes under "image_bytes"), and
    their counts: for each question the model's greedy answer and n_samples - 1 sampled ones; chosen is the data's
    answer, rejected the model's own wrong one (rejected_answer). A question it answered right every time keeps the
    data's rejected answer (preference shards) if keep_answered, else is dropped."""
    counts, records, batch = Counter(), [], []
    generator = torch.Generator().manual_seed(seed)
    n = min(limit or len(stream), len(stream))

    def flush():
        questions = [(prompt, images[0] if images else None) for _, _, images, prompt in batch]
        answered = model_answers(model, questions, stream, template, n_samples, temperature, max_new_tokens, generator)
        for (where, conv, blobs, _), answers in zip(batch, answered, strict=True):
            chosen, source = conv[-1]["value"], conv[-1].get("rejected")
            counts["greedy_right"] += answers[0].lower() == chosen.strip().lower()
            rejected, origin = rejected_answer(chosen, answers)
            if rejected is None and keep_answered and source:
                rejected, origin = source, "data"
            if rejected is None:
                counts["dropped: answered right every time" if all(answers) else "dropped: right or empty every time"] += 1
                continue
            counts[f"rejected: {origin}"] += 1
            records.append({"id": where, "conversations": conv[:-1], "chosen": chosen, "rejected": rejected,
                            "rejected_from": origin, "image_bytes": blobs})
        batch.clear()

    for sample in tqdm(range(n), desc=f"answering {stream.split} questions", unit="q"):
        counts["questions"] += 1
        try:
            where, conv, kind, blobs = stream.read_conversation(sample)
            where = json.loads(stream.read(sample)[1].get("json", b"{}")).get("id", where)  # the packed record's id
            if len(blobs) > 1 or kind == "video":
                raise chat.DropSample("several_images (the tile path is not generated here)")
            if chat.ROLES[conv[-1]["from"]] != "assistant":
                raise chat.DropSample("last_turn_not_an_answer")
            prompt = answer_prompt(conv, bool(blobs), template, stream.tok, stream.image_token_id, stream.n_image_tokens)
        except chat.DropSample as e:
            counts[f"dropped: {str(e).split(' ')[0]}"] += 1
            continue
        if len(prompt) + max_new_tokens > model.cfg.llm.max_seq_len:  # else it cut every answer of its batch shorter
            counts["dropped: prompt_and_answer_beyond_max_seq_len"] += 1
            continue
        batch.append((where, conv, blobs, prompt))
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return records, counts


def write_pairs(records_by_split, out, overwrite=False):
    """The records' images and JSON in out/source, packed into preference shards in out (val: the val split)."""
    source = Path(out, "source")
    shutil.rmtree(source, ignore_errors=True)  # the previous answers' images (--overwrite)
    (source / "images").mkdir(parents=True)
    rows = []
    for split, records in records_by_split.items():
        for i, rec in enumerate(records):
            names = []
            for j, blob in enumerate(rec.pop("image_bytes")):
                names.append(f"{split}-{i:06d}-{j}.{Image.open(io.BytesIO(blob)).format.lower()}")
                (source / "images" / names[-1]).write_bytes(blob)
            rows.append(rec | {"id": f"{split}-{i:06d}", "source_id": rec["id"]} | ({"image": names} if names else {}))
    (source / "pairs.json").write_text(json.dumps(rows))
    pack(source / "pairs.json", source / "images", out, shard_size=2000, val_ids=lambda i: str(i).startswith("val-"),
         overwrite=overwrite)


def pairs_command(args):
    ckpt, out = Path(args.ckpt), Path(args.out)
    if out.resolve() == Path(args.data).resolve():  # --overwrite would replace the questions with the answers
        raise SystemExit(f"pairs: --out {out} is --data; write the pairs elsewhere")
    held = sorted(p.name for p in out.glob("*.tar")) if out.is_dir() else []
    held += ["source/"] if (out / "source").exists() else []  # write_pairs replaces it: it may hold someone's images
    if held and not args.overwrite:  # refused before the answering, not after
        raise SystemExit(f"pairs: --out {out} already holds a dataset ({held[0]}, ...); pass --overwrite to replace it")
    try:
        model = model_files.load_model(ckpt).eval()
        tok = chat.Tokenizer(args.tokenizer or ckpt)
        trained = json.loads((ckpt / "state.json").read_text())["config"] if (ckpt / "state.json").exists() else {}
    except (weight_files.ConversionError, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise SystemExit(f"pairs: --ckpt {args.ckpt}: cannot load the model and its tokenizer ({e})") from None
    template = args.template or trained.get("template")
    if template not in chat.TEMPLATES:
        raise SystemExit(f"pairs: template {template!r} (the checkpoint's training config has none): pass --template, "
                         f"one of {sorted(chat.TEMPLATES)}")
    vocab, image_id = tok.vocab_size, model.cfg.image_token_id  # as train.py checks them (make_loaders)
    collides = image_id < vocab and tok.decode([image_id]) != chat.IMAGE_TAG  # an HF <image> is fine
    if collides or image_id >= model.cfg.llm.vocab_size or vocab > model.cfg.llm.vocab_size:
        raise SystemExit(f"pairs: the tokenizer ({args.tokenizer or ckpt}: {vocab} ids) does not fit --ckpt "
                         f"{args.ckpt} (vocab {model.cfg.llm.vocab_size}, image token {image_id}): pass the tokenizer "
                         "the model was trained with")
    if model.cfg.anyres or model.cfg.video_token_id is not None:
        raise SystemExit(f"pairs: --ckpt {args.ckpt}: a tiling (anyres or video) model; pairs generates for one image "
                         "a question")
    records = {}
    for split in ("train", "val"):
        try:
            stream = loader.ShardStream(args.data, tok, 1, model.cfg.llm.max_seq_len, model.cfg.vision.image_size,
                                      model.cfg.image_token_id, model.cfg.n_image_tokens, template,
                                      args.image_mode or trained.get("image_mode", "pad"), split=split,
                                      image_mean=model.cfg.vision.image_stats[0], resample=model.cfg.vision.resample)
        except FileNotFoundError:
            if split == "val":
                continue
            raise SystemExit(f"pairs: --data {args.data}: no train shards") from None
        except (OSError, ValueError) as e:
            raise SystemExit(f"pairs: --data {args.data}: {e}") from None
        keep = args.keep_answered or split == "val"  # held-out accuracy is then asked on the same questions
        records[split], counts = on_policy_pairs(model, stream, template, args.samples, args.temperature,
                                                 args.max_new_tokens, args.batch_size, args.seed, keep, args.limit)
        q = counts.pop("questions", 0)  # a split with no question, or all dropped, has no counts but its drops
        print(f"pairs: {split}: {q} questions, greedy exact match {counts.pop('greedy_right', 0) / max(1, q):.1%}; "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if not any(records.values()):  # the counts printed above say why
        raise SystemExit(f"pairs: no pair to write from {args.data}: every question was dropped (see the counts above)")
    write_pairs(records, args.out, args.overwrite)


def main(argv=None):
    p = argparse.ArgumentParser(prog="dpo.py", description="on-policy preference pairs for objective='dpo'")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pairs", help="the model's own wrong answers as the rejected side, the data's as chosen")
    a.add_argument("--ckpt", required=True, help="the model that answers (a training step or a convert.py directory)")
    a.add_argument("--data", required=True, help="shards whose questions it answers: SFT or preference shards")
    a.add_argument("--out", required=True, help="where the preference shards go (their JSON and images in OUT/source)")
    a.add_argument("--samples", type=int, default=4, help="answers a question: the greedy one, then sampled ones")
    a.add_argument("--temperature", type=float, default=1.0, help="of the sampled answers")
    a.add_argument("--max-new-tokens", type=int, default=8)
    a.add_argument("--batch-size", type=int, default=64, help="questions a generate call")
    a.add_argument("--limit", type=int, default=0, help="only the first N questions of each split (0: all)")
    a.add_argument("--keep-answered", action="store_true", help="a train question answered right every time keeps "
                   "the data's own rejected answer (preference shards) instead of being dropped; val always does")
    a.add_argument("--template", help="default: the checkpoint's training config's")
    a.add_argument("--tokenizer", help="default: the tokenizer in --ckpt")
    a.add_argument("--image-mode", choices=("pad", "crop", "resize"), help="default: the checkpoint's config's")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--overwrite", action="store_true", help="replace the shards already in --out")
    args = p.parse_args(argv)
    if args.samples < 1 or args.temperature <= 0 or args.max_new_tokens < 1 or args.batch_size < 1 or args.limit < 0:
        p.error("--samples, --max-new-tokens and --batch-size must be >= 1, --temperature > 0, --limit >= 0")
    pairs_command(args)


if __name__ == "__main__":
    main()
