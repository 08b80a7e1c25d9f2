"""
Where a shapes model's answers go (docs/notes/dpo-shapes.md, the pure-DPO diagnosis): for each held-out
question its greedy answer and the log-prob of every answer of the question's kind (shapes.ANSWER_SETS), split
into the answer's tokens and the end-of-turn token after it. Two checkpoints: where the greedy answers moved.

    python scripts/answer_options.py out/shapes-sft-250/step-000250 out/X/step-000200 [--data data/shapes/shards]
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import chat
import images
import loader  # noqa: E402
import model_files
from model import left_pad  # noqa: E402
from shapes import ANSWER_SETS  # noqa: E402


@torch.no_grad()
def answers(ckpt, data_dir, n, batch_size=50):
    """[(truth, greedy, {option: (answer-token logp, end-of-turn logp)})] for the first n val questions."""
    model, tok = model_files.load_model(ckpt).eval(), chat.Tokenizer(ckpt)
    template, cfg = "llama_3", model.cfg
    stop = chat.stop_token_id(template, tok)
    stream = loader.ShardStream(data_dir, tok, 1, cfg.llm.max_seq_len, cfg.vision.image_size, cfg.image_token_id,
                              cfg.n_image_tokens, template, split="val", image_mean=cfg.vision.image_stats[0],
                              resample=cfg.vision.resample)
    out = []
    for first in range(0, min(n, len(stream)), batch_size):
        qs = []
        for s in range(first, min(first + batch_size, n, len(stream))):
            conv, image = loader.sample_conversation(stream.read(s)[1])
            prompt, truth = chat.prompt_and_answer(conv, True, template, tok, stream.image_token_id, stream.n_image_tokens)
            qs.append((conv, image, prompt, truth))
        pixels = images.normalize_images(torch.stack([images.load_image(im, stream.image_size, stream.image_mode,
                                                                    mean=stream.image_mean, resample=stream.resample)
                                                  for _, im, _, _ in qs]),
                                       *cfg.vision.image_stats)
        ids, mask = left_pad([p for _, _, p, _ in qs], tok.pad_id)
        said = [chat.decode_answer(tok, r, stop) for r in
                model.generate(ids, pixels, 8, eos_id=stop, attention_mask=mask).tolist()]
        rows, where = [], []  # every option of every question, right-padded
        for q, (conv, _, prompt, truth) in enumerate(qs):
            for opt in next(c for c in ANSWER_SETS if truth in c):
                full, _, _ = chat.encode_conversation(conv[:-1] + [{"from": "gpt", "value": opt}], True, template, tok,
                                                      1 << 30, stream.image_token_id, stream.n_image_tokens)
                end = full.index(stop, len(prompt))
                rows.append(full[: end + 1])
                where.append((q, opt, len(prompt), end))
        width = max(map(len, rows))
        x = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
        logits, _ = model(x, pixels[torch.tensor([q for q, *_ in where])])
        logp = logits.float().log_softmax(-1)
        options = [{} for _ in qs]
        for i, (q, opt, start, end) in enumerate(where):
            tok_lp = logp[i, start - 1 : end].gather(-1, x[i, start : end + 1, None])[:, 0]  # answer tokens, then eot
            options[q][opt] = (tok_lp[:-1].sum().item(), tok_lp[-1].item())
        out += [(truth, s, o) for (_, _, _, truth), s, o in zip(qs, said, options, strict=True)]
    return out


def cached(ckpt, a):
    if not a.cache:
        return answers(ckpt, a.data, a.n)
    path = Path(a.cache, str(Path(ckpt).resolve()).strip("/").replace("/", "+") + f"-{a.n}.json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(answers(ckpt, a.data, a.n)))
    return [(t, s, {k: tuple(v) for k, v in o.items()}) for t, s, o in json.loads(path.read_text())]


def summary(name, res):
    right = sum(s.lower() == t.lower() for t, s, _ in res)
    in_set = sum(s in o for _, s, o in res)
    p_truth = sum(torch.tensor(o[t][0] + o[t][1]).exp().item() for t, _, o in res) / len(res)
    p_set = sum(sum(torch.tensor(a + e).exp().item() for a, e in o.values()) for *_, o in res) / len(res)
    eot = sum(min(e for _, e in o.values()) for *_, o in res) / len(res)
    lp_truth = sum(o[t][0] for t, _, o in res) / len(res)
    print(f"{name}: exact match {right / len(res):.1%}; greedy answer one of the kind's options {in_set / len(res):.1%}; "
          f"mean p(right answer + eot) {p_truth:.3f}, mean p(any option of the kind + eot) {p_set:.3f}, "
          f"mean answer-token logp of the right answer {lp_truth:.2f}, mean min end-of-turn logp {eot:.2f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--data", default="data/shapes/shards")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--cache", help="a folder to keep each checkpoint's answers in (the 'before' one is asked often)")
    a = p.parse_args()
    before, after = (cached(ckpt, a) for ckpt in (a.before, a.after))
    summary("before", before)
    summary("after", after)
    moves = Counter()
    for (t, s0, _), (_, s1, o1) in zip(before, after, strict=True):
        r0, r1 = s0 == t, s1 == t
        moves["right -> right" if r0 and r1 else "wrong -> right" if r1 else
              ("right -> " if r0 else "wrong -> same wrong" if s1 == s0 else "wrong -> ")
              + ("" if (not r0 and s1 == s0) else "another option of the kind" if s1 in o1 else "not an option")] += 1
    said0, said1, truth = (Counter(s for _, s, _ in before), Counter(s for _, s, _ in after),
                           Counter(t for t, _, _ in before))
    print("answer: right count / greedy before / greedy after: " + ", ".join(
        f"{k} {truth[k]}/{said0[k]}/{said1[k]}" for k in sorted(set(truth) | set(said0) | set(said1),
                                                             key=lambda k: -truth[k])))
    print("greedy answers moved: " + ", ".join(f"{k} {v}" for k, v in sorted(moves.items())))


if __name__ == "__main__":
    main()
