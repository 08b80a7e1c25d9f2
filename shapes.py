"""
The synthetic shapes dataset, the embedded default that `make demo` trains on: small images of
coloured circles, squares and triangles, one question each with exactly one right answer, packed
into shards by pack.pack, with a sentencepiece tokenizer trained on the text.

    python data.py shapes --out data/shapes [--n 20000] [--seed 0] [--turns 1] [--overwrite]
    python data.py shapes --out data/shapes2 --images 2     # two images a sample: "Which image has more circles?"
    python data.py shapes --out gs://BUCKET/shapes          # shards, tokenizer and JSON in a bucket
"""

import json
import re
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

import storage
from chat import IMAGE_TAG, TEMPLATES
from pack import OUR_FILES, pack
from shards import log

COLORS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
          "purple": (140, 60, 170)}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("zero", "one", "two", "three")


def draw_scene(rng, size=48, circles=None):
    """1-3 shapes in distinct cells of a 3x3 grid, with jittered position and size. -> (image, objects)
    With size 48 and 16 px patches, each cell is exactly one ViT patch. circles=n: exactly n of them are circles."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw, cell, objects = ImageDraw.Draw(img), size / 3, []
    n = rng.integers(1, 4) if circles is None else rng.integers(max(1, circles), 4)
    kinds = None if circles is None else \
        rng.permutation(["circle"] * circles + [SHAPES[rng.integers(1, 3)] for _ in range(n - circles)])
    for i, c in enumerate(rng.choice(9, size=n, replace=False)):
        shape = SHAPES[rng.integers(3)] if kinds is None else str(kinds[i])
        color = list(COLORS)[rng.integers(len(COLORS))]
        r = cell * rng.uniform(0.34, 0.46)
        x = (c % 3 + 0.5) * cell + rng.uniform(-1, 1) * (cell / 2 - r)
        y = (c // 3 + 0.5) * cell + rng.uniform(-1, 1) * (cell / 2 - r)
        box = [x - r, y - r, x + r, y + r]
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLORS[color])
        objects.append((shape, color, x, int(c)))
    return img, objects


CELLS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")


def shape_question(objects, rng):
    """One question with exactly one right answer about the scene. "What is at the top left?" names
    what one patch holds: the most direct lesson in shape identity, which the others build on."""
    count = Counter(s for s, *_ in objects)
    unique = [s for s in SHAPES if count[s] == 1]
    column = {s: c % 3 for s, _, _, c in objects if s in unique}
    # "left of" only for shapes in different grid columns, so the answer never hangs on a pixel of jitter
    pairs = [(a, b) for a in unique for b in unique if column[a] != column[b]]
    kinds = ["count", "where"] + ["color"] * bool(unique) + ["left"] * bool(pairs)
    kind = kinds[rng.integers(len(kinds))]
    if kind == "where":
        cell = int(rng.integers(9))
        return f"What is at the {CELLS[cell]}?", next((s for s, _, _, c in objects if c == cell), "nothing")
    if kind == "color":
        shape = unique[rng.integers(len(unique))]
        return f"What color is the {shape}?", next(c for s, c, *_ in objects if s == shape)
    if kind == "left":
        a, b = pairs[rng.integers(len(pairs))]
        return f"Is the {a} left of the {b}?", "yes" if column[a] < column[b] else "no"
    shape = SHAPES[rng.integers(3)]
    return f"How many {shape}s are there?", NUMBERS[count[shape]]


MORE_CIRCLES = ("the first", "the second", "neither")


def two_scenes(rng, size):
    """Two scenes and the answer to "Which image has more circles?", drawn first so the three answers are equally
    frequent; equal counts (0-3 each) answer "neither". -> (image, image, answer)"""
    answer, more, same = int(rng.integers(3)), int(rng.integers(1, 4)), int(rng.integers(4))
    fewer = int(rng.integers(more))
    counts = {0: (more, fewer), 1: (fewer, more), 2: (same, same)}[answer]
    (first, _), (second, _) = (draw_scene(rng, size, circles=c) for c in counts)
    return first, second, MORE_CIRCLES[answer]


ANSWER_SETS = (SHAPES + ("nothing",), tuple(COLORS), ("yes", "no"), NUMBERS, MORE_CIRCLES)


def wrong_answer(answer, rng):
    """A plausible wrong answer: another answer of the same kind (a colour for a colour, a number for a number)."""
    choices = next(c for c in ANSWER_SETS if answer in c)
    return str(rng.choice([c for c in choices if c != answer]))


def preference_records(records, seed):
    """The samples as preference pairs for DPO: the prompt is every turn but the last answer, chosen is the right
    answer and rejected a plausible wrong one."""
    rng = np.random.default_rng([seed, 1])
    return [{k: v for k, v in r.items() if k != "conversations"} | {
        "conversations": r["conversations"][:-1], "chosen": r["conversations"][-1]["value"],
        "rejected": wrong_answer(r["conversations"][-1]["value"], rng)} for r in records]


# the templates whose scaffolding the tokenizer learns: those its pieces can write (check_template refuses the
# ones that need special tokens, qwen3 and gemma3, on it). A fixed list, not chat.TEMPLATES: a template added there
# must not redraw the demo's vocabulary, and with it every figure measured on the demo
TOKENIZER_TEMPLATES = ("plain", "vicuna_v1", "llama_2", "llama_3", "chatml")


def train_tokenizer(texts, out_prefix, vocab_size):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(out_prefix), vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, byte_fallback=True, pad_id=3, bos_id=1, eos_id=2, unk_id=0,
        user_defined_symbols=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|im_start|>", "<|im_end|>"],
        hard_vocab_limit=False, num_threads=1, minloglevel=2)


# what make_shapes writes into out; anything else there is someone's own, which shapes neither replaces nor removes
OUTPUTS = ("shards", "preference", "tokenizer.model", "tokenizer.vocab", "shapes.json", "preference.json", "images")
DRAWN = re.compile(r"\d{6}(-[01])?\.png")  # the images' names


def clear_shapes(out, overwrite):
    """Refuse an out that already holds a shapes dataset (pack refuses likewise) unless overwrite, and one that holds
    anything make_shapes does not write, even with overwrite: shards without shapes.json (pack's, not ours), an image
    of another name. Then remove what make_shapes wrote, each dataset's .info.json first, so that an interrupted
    removal never leaves one that looks finished."""
    found = storage.ls(out)
    foreign = [name for name in found if name not in OUTPUTS]
    for name in {"shards", "preference"} & set(found):
        inside = storage.ls(storage.join(out, name))
        foreign += [f"{name}/{f}" for f in inside if f != ".nv-meta" and not OUR_FILES.match(f)]
        foreign += [] if "shapes.json" in found else [f"{name} (a dataset beside no shapes.json)"]
    if "images" in found and not storage.is_url(out):
        images = Path(out, "images")
        foreign += [f"images/{f.name}" for f in images.iterdir() if not DRAWN.fullmatch(f.name)] \
            if images.is_dir() and not images.is_symlink() else ["images (not a folder of its own)"]
    if foreign:
        raise SystemExit(f"shapes: {out} holds what the shapes demo does not write ({', '.join(sorted(foreign)[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); it writes only into an empty folder or its own: "
                         "choose another --out")
    if found and not overwrite:
        raise SystemExit(f"shapes: {out} already holds a shapes dataset ({', '.join(found)}); pass --overwrite to "
                         "replace it, or choose another --out")
    for name in found:
        if name in ("shards", "preference"):
            storage.rm(storage.join(out, name, ".nv-meta", ".info.json"))
        if name == "images" and not storage.is_url(out):
            for image in Path(out, "images").iterdir():  # another --n or --images leaves others behind
                image.unlink()
        else:
            storage.rm(storage.join(out, name), recursive=True)


def make_shapes(out, n=20000, seed=0, val_fraction=0.1, image_size=48, vocab_size=512, turns=1, images=1,
                preference=False, tokenizer=None, overwrite=False):
    """n samples of one image and `turns` questions, or (images=2) of two images and "Which image has more
    circles?", in the OneVision format: "image": [first, second] and one <image> tag for each, in order.
    preference: the same samples as right/wrong answer pairs too, in out/preference (objective='dpo').
    out may be a bucket (s3://, gs://): drawn in a local temporary folder, the shards packed into the bucket and the
    tokenizer and JSON uploaded beside them (the images stay local, and go). tokenizer: a tokenizer.model to use
    (copied in) instead of training one, so that several shapes datasets can be mixed in one run; the shards record
    the tokenizer they are made for. An out that holds a shapes dataset is refused unless overwrite."""
    if images not in (1, 2):
        raise SystemExit(f"shapes: --images must be 1 or 2, got {images}")
    if storage.is_url(out):
        storage.check_bucket(out)
    clear_shapes(str(out).rstrip("/") if storage.is_url(out) else out, overwrite)
    if not storage.is_url(out):
        return draw_and_pack(Path(out), out, n, seed, val_fraction, image_size, vocab_size, turns, images, preference,
                             tokenizer)
    with tempfile.TemporaryDirectory(prefix="llavax-shapes-") as local:
        draw_and_pack(Path(local), str(out).rstrip("/"), n, seed, val_fraction, image_size, vocab_size, turns, images,
                      preference, tokenizer)
        for name in ("tokenizer.model", "tokenizer.vocab", "shapes.json", "preference.json"):
            if Path(local, name).exists():
                storage.upload(Path(local, name), storage.join(out, name))
    return out


def draw_and_pack(out, packed, n, seed, val_fraction, image_size, vocab_size, turns, images, preference, tokenizer=None):
    """make_shapes with its images, JSON and tokenizer in the local folder `out`, its shards in `packed`/shards."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in tqdm(range(n), desc="drawing shapes", unit="sample"):
        split = "val" if i >= n * (1 - val_fraction) else "train"
        if images == 2:
            first, second, answer = two_scenes(rng, image_size)
            first.save(out / "images" / f"{i:06d}-0.png")
            second.save(out / "images" / f"{i:06d}-1.png")
            conv = [{"from": "human", "value": f"{IMAGE_TAG}\n{IMAGE_TAG}\nWhich image has more circles?"},
                    {"from": "gpt", "value": answer}]
            records.append({"id": f"{split}-{i:06d}", "image": [f"{i:06d}-0.png", f"{i:06d}-1.png"],
                            "conversations": conv})
            continue
        img, objects = draw_scene(rng, image_size)
        img.save(out / "images" / f"{i:06d}.png")
        qa = {}
        for _ in range(4 * turns):  # several different questions about one image: more supervision per image
            if len(qa) < turns:
                q, a = shape_question(objects, rng)
                qa.setdefault(q, a)
        conv = [t for q, a in qa.items() for t in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]
        conv[0] = {"from": "human", "value": f"{IMAGE_TAG}\n{conv[0]['value']}"}
        records.append({"id": f"{split}-{i:06d}", "image": f"{i:06d}.png", "conversations": conv})
    texts = [t["value"].replace(IMAGE_TAG, "").strip() for r in records for t in r["conversations"]]
    for name in TOKENIZER_TEMPLATES:  # so the template scaffolding tokenizes compactly too
        texts += ["".join(t for t, _ in TEMPLATES[name](r["conversations"])).replace(IMAGE_TAG, "") for r in records[:50]]
    if tokenizer:
        (out / "tokenizer.model").write_bytes(storage.read_bytes(tokenizer))
    else:
        train_tokenizer(texts, out / "tokenizer", vocab_size)
    for name, kept in (("shapes", records), ("preference", preference and preference_records(records, seed))):
        if kept:
            (out / f"{name}.json").write_text(json.dumps(kept))
            pack(out / f"{name}.json", out / "images", storage.join(packed, "shards" if name == "shapes" else name),
                 shard_size=2000, val_ids=lambda i: str(i).startswith("val"), overwrite=True,
                 tokenizer=out / "tokenizer.model")
    log(f"shapes: {n} samples of {images} image(s), tokenizer {storage.join(packed, 'tokenizer.model')}, shards in "
        f"{storage.join(packed, 'shards')}")
    return out


