"""
train.py's evaluation passes: the held-out loss at eval_interval, and at the end of a run the exact-match accuracy of
greedy answers (one image a row, or the loader's tiled rows). Split from train.py, over its line budget.
"""

from types import SimpleNamespace

import torch

import chat
from images import load_image, normalize_images
import loader
from model import build_model, left_pad
from parallel import autocast, gathered_for_generation, print0


def device_batch(batch, env, vision):
    """The model's inputs on the device, images normalised there with the tower's statistics: they leave the
    loader as uint8 (4x fewer bytes). With max_tiles they are (B, max_tiles, 3, S, S) and image_index/image_weight
    say where each tile's features go."""
    b = env.to_device(batch)
    return b | {"pixel_values": normalize_images(b["pixel_values"], *vision.image_stats)}


@torch.no_grad()
def evaluate(model, val_loaders, env, cfg, n_batches, vision):
    """{"val_loss": the held-out loss over n_batches of every source}; for a mixture also each source's own
    ("val_loss/NAME", over its val split) and its supervised tokens ("val_tokens/NAME"): the pooled loss is the
    token-weighted mean of the sources'."""
    sums = {name: held_out_sums(model, val_loader, env, n_batches, vision) for name, val_loader in val_loaders.items()}
    total, count = (sum(x[i] for x in sums.values()) for i in (0, 1))
    out = {"val_loss": (total / count.clamp(min=1)).item()}
    if len(sums) > 1:
        # a source whose held-out samples all dropped has no loss (None), not 0.0
        out |= {f"val_loss/{name}": (t / c).item() if c.item() else None for name, (t, c) in sums.items()}
        out |= {f"val_tokens/{name}": int(c.item()) for name, (_, c) in sums.items()}
    return out


def held_out_sums(model, val_loader, env, n_batches, vision):
    """(summed token loss, supervised tokens) of the first n_batches of a val loader, over all ranks."""
    model.eval()
    total, count = torch.zeros((), device=env.device), torch.zeros((), device=env.device)
    val_loader.position = 0  # the same held-out batches every time
    for i, batch in enumerate(val_loader):
        if i == n_batches:
            break
        b = device_batch(batch, env, vision)
        with autocast(env):
            _, loss = model(b["input_ids"], b["pixel_values"], b["labels"], "sum", b.get("position_ids"),
                            image_index=b.get("image_index"), image_weight=b.get("image_weight"))
        total += loss
        count += (b["labels"][:, 1:] != -100).sum()
        env.step_end()
    model.train()
    return env.all_sum(total), env.all_sum(count)


@torch.no_grad()
def answer_accuracy(raw, stream, env, cfg, n, show=5, batch_size=32):
    """Exact-match accuracy of greedy answers to the first n val samples, a few of them to show, the number asked
    and the number skipped because prompt and answer exceed the model's max_seq_len. Questions go batch_size at a
    time, left-padded (rows without an image get a blank one they never read)."""
    raw.eval()
    tok, stop = stream.tok, chat.stop_token_id(cfg["template"], stream.tok)
    right, shown, total, too_long, max_new = 0, [], 0, 0, 8
    asked = []
    for sample in range(min(n, len(stream))):
        conv, image = loader.sample_conversation(stream.read(sample)[1])
        if chat.conversation_problem(conv):  # a malformed foreign sample, which training drops too
            continue
        prompt, answer = chat.prompt_and_answer(conv, image is not None, cfg["template"], tok, stream.image_token_id,
                                                stream.n_image_tokens)
        if len(prompt) + max_new > raw.cfg.llm.max_seq_len:  # the model cannot hold it: counted, not a crash
            too_long += 1
            continue
        question = next(t["value"] for t in conv if t["from"] in ("human", "user"))
        asked.append((prompt, answer, image, question))
    for first in range(0, len(asked), batch_size):
        batch = asked[first : first + batch_size]
        ids, mask = left_pad([prompt for prompt, *_ in batch], tok.pad_id)
        blank = torch.zeros(3, stream.image_size, stream.image_size, dtype=torch.uint8)
        images = [load_image(image, stream.image_size, stream.image_mode, mean=stream.image_mean, resample=stream.resample)
                  if image is not None else blank for _, _, image, _ in batch]
        pixels = normalize_images(torch.stack(images).to(env.device), *raw.cfg.vision.image_stats) \
            if stream.image_token_id in ids else None
        with autocast(env):
            out = raw.generate(ids.to(env.device), pixels, max_new_tokens=max_new, eos_id=stop,
                               attention_mask=mask.to(env.device)).tolist()
        for tokens, (_, answer, _, question) in zip(out, batch):
            said = chat.decode_answer(tok, tokens, stop)
            right += said.lower() == answer.strip().lower()
            total += 1
            if len(shown) < show:
                shown.append((question.replace(chat.IMAGE_TAG, "").strip(), said, answer))
    raw.train()
    return right / max(1, total), shown, total, too_long


@torch.no_grad()
def tiled_answer_accuracy(raw, stream, env, cfg, n, show=5):
    """answer_accuracy on the tile path (max_tiles > 0), from the loader's own unpacked val batches: each row is cut
    where its first answer starts, the prompts left-padded, and image_index/image_weight shifted with them."""
    raw.eval()
    tok, stop, max_new = stream.tok, chat.stop_token_id(stream.template, stream.tok), 8
    right, shown, total, too_long, n = 0, [], 0, 0, min(n, len(stream))
    for k in range(-(-n // stream.batch_size)):
        b, asked = stream.batch(k), []
        for r in range(min(stream.batch_size, n - k * stream.batch_size)):
            supervised = (b["labels"][r] != -100).nonzero().flatten()  # labels align with input_ids
            if b["dropped"][r] or not len(supervised):
                continue
            start = int(supervised[0])
            end = start + int((supervised - start == torch.arange(len(supervised))).cumprod(0).sum())  # first answer
            if start + max_new > raw.cfg.llm.max_seq_len:
                too_long += 1
                continue
            answer = b["input_ids"][r, start:end].tolist()
            asked.append((r, start, chat.decode_answer(tok, answer, stop)))
        if not asked:
            continue
        ids, mask = left_pad([b["input_ids"][r, :start].tolist() for r, start, _ in asked], tok.pad_id)
        index = torch.zeros(ids.shape + b["image_index"].shape[2:], dtype=torch.long)  # (B, T, K)
        weight = torch.zeros(index.shape)
        for i, (r, start, _) in enumerate(asked):
            index[i, ids.shape[1] - start :], weight[i, ids.shape[1] - start :] = \
                b["image_index"][r, :start], b["image_weight"][r, :start]
        rows = torch.tensor([r for r, _, _ in asked])
        pixels = normalize_images(b["pixel_values"][rows].to(env.device), *raw.cfg.vision.image_stats)
        with autocast(env):
            out = raw.generate(ids.to(env.device), pixels, max_new_tokens=max_new, eos_id=stop,
                               attention_mask=mask.to(env.device), image_index=index.to(env.device),
                               image_weight=weight.to(env.device)).tolist()
        for tokens, (r, _, answer) in zip(out, asked):
            said = chat.decode_answer(tok, tokens, stop)
            right += said.lower() == answer.lower()
            total += 1
            if len(shown) < show:
                conv = loader.sample_conversation(stream.read(int(b["sample_id"][r]))[1])[0]
                question = next(t["value"] for t in conv if t["from"] in ("human", "user"))
                shown.append((question.replace(chat.IMAGE_TAG, "").strip(), said, answer))
    raw.train()
    return right / max(1, total), shown, total, too_long


def final_accuracy(raw, val_streams, stream_args, env, cfg):
    """The end of a run: held-out exact-match accuracy on final_accuracy_samples of each source's val split, printed
    with a few answers: {"accuracy": over all the questions} and, for a mixture, "accuracy/NAME" of each source."""
    asker, asker_env = raw, env
    if env.kind == "xla":  # token-by-token generation would recompile at every length: answer on the host
        asker = build_model(raw.cfg, device="cpu", init=False)
        asker.load_state_dict({k: v.cpu() for k, v in raw.state_dict().items()})
        asker_env = SimpleNamespace(kind="cpu", device=torch.device("cpu"), distributed=False, bf16=env.bf16,
                                    parallel=env.parallel)
    results = {}
    # FSDP2: the whole model gathered on every rank, which then answers its own questions with no collective
    with gathered_for_generation(asker, whole=True):
        for name, val_stream in val_streams.items():
            if cfg["max_tiles"]:  # the questions as the loader tiles and places their images, one sample a row
                unpacked = loader.ShardStream(val_stream.mixture.sources[0], split="val", **(stream_args | {"pack": 0}))
                results[name] = tiled_answer_accuracy(asker, unpacked, asker_env, cfg, cfg["final_accuracy_samples"])
            else:
                results[name] = answer_accuracy(asker, val_stream, asker_env, cfg, cfg["final_accuracy_samples"])
    for name, (acc, shown, n_asked, too_long) in results.items():
        print0(env, f"held-out exact-match accuracy{f' of {name}' if len(results) > 1 else ''}: {100 * acc:.1f}% on "
               f"{n_asked} questions" + (f" ({too_long} longer than the model's max_seq_len skipped)" if too_long else ""))
        for q, said, answer in shown:
            print0(env, f"  Q: {q:<36} model: {said:<8} truth: {answer}")
    n_asked = sum(r[2] for r in results.values())
    pooled = sum(r[0] * r[2] for r in results.values()) / max(1, n_asked)
    if len(results) > 1:
        print0(env, f"held-out exact-match accuracy over the {len(results)} sources: {100 * pooled:.1f}% on "
               f"{n_asked} questions")
        return {"accuracy": pooled} | {f"accuracy/{name}": r[0] for name, r in results.items()}
    return {"accuracy": pooled}
