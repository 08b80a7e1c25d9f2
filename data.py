"""
Data for llavax: LLaVA conversations -> Energon-compatible tar shards -> fixed-shape batches.

    python data.py pack --json llava_v1_5_mix665k.json --images DIR --out SHARDS [--shard-size 1000] [--val-ratio 0.01]
    python data.py shapes --out DIR [--n 20000] [--seed 0]      # the synthetic demo dataset (shapes.py)

A sample is KEY.jpg (image), KEY.txt (first answer) and KEY.json ({"question", "conversations", "id"}),
the layout of Megatron-Energon's VQA datasets; .nv-meta/ and SHARD.tar.idx are written too, so
`energon` reads the folder with no prepare step and webdataset reads the tars as they are.
"""

import argparse
import hashlib
import io
import json
import os
import re
import struct
import sys
import tarfile
from collections import Counter, defaultdict
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

IMAGE_TAG = "<image>"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
ENERGON_VERSION = "7.4.1"  # the megatron-energon release whose .nv-meta layout we write
KEY_RE = re.compile(r"^((?:.*/)?[^./]+)\.([^/]+)$")  # webdataset/energon: the key ends at the first dot of the basename


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Skips:
    """Counts of dropped inputs by reason, with the first few offending ids of each."""

    def __init__(self, keep=5):
        self.counts, self.examples, self.keep = Counter(), defaultdict(list), keep

    def add(self, reason, sample_id):
        self.counts[reason] += 1
        if len(self.examples[reason]) < self.keep:
            self.examples[reason].append(str(sample_id))

    def summary(self):
        if not self.counts:
            return "skipped: none"
        return "skipped:\n" + "\n".join(f"  {reason}: {n} (first: {', '.join(self.examples[reason])})"
                                        for reason, n in sorted(self.counts.items()))


# -----------------------------------------------------------------------------
# packing LLaVA JSON into shards


def read_records(path):
    """Yield (record, None) or (None, (where, reason)) from a LLaVA JSON array or a JSONL file."""
    text = Path(path).read_text()
    if not text.lstrip().startswith("["):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line), None
                except json.JSONDecodeError as e:
                    yield None, (f"line {n}", "malformed_json")
                    log(f"pack: {path} line {n}: malformed JSON ({e.msg}); skipped")
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:  # one broken array cannot be read around
        sys.exit(f"pack: {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}")
    yield from ((r, None) for r in records)


def check_conversations(rec):
    """The reason a record cannot be trained on, or None."""
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not all(isinstance(t, dict) and "from" in t and "value" in t for t in conv):
        return "malformed_conversations"
    answers = [t["value"] for t in conv if t["from"] in ("gpt", "assistant")]
    if not answers:
        return "no_gpt_turn"
    if not str(answers[0]).strip():
        return "empty_answer"
    n_tags = sum(str(t["value"]).count(IMAGE_TAG) for t in conv)
    if n_tags > 1:
        return "multiple_image_tags"
    if n_tags and not rec.get("image"):
        return "image_tag_without_image"
    return None


def prepare_record(args):
    """One record -> (sample, None) or (None, reason). Runs in pool workers, so it returns instead of raising."""
    index, rec, images_dir = args
    if not isinstance(rec, dict):
        return None, "malformed_record"
    reason = check_conversations(rec)
    if reason:
        return None, reason
    conv = [{"from": t["from"], "value": str(t["value"])} for t in rec["conversations"]]
    jpg = None
    if rec.get("image"):
        path = Path(images_dir, rec["image"])
        if not path.is_file():
            return None, "missing_image"
        data = path.read_bytes()
        try:
            img = Image.open(io.BytesIO(data))
            img.load()  # a full decode: truncated files pass Image.verify()
        except Exception:  # noqa: BLE001  PIL raises many types for corrupt files
            return None, "corrupt_image"
        if img.format == "JPEG" and img.mode in ("RGB", "L"):
            jpg = data  # keep the original bytes: no re-encoding loss
        else:
            buf = io.BytesIO()
            img.convert("RGB").save(buf, format="JPEG", quality=95)
            jpg = buf.getvalue()
        if not any(IMAGE_TAG in t["value"] for t in conv):  # LLaVA puts the image before the first question
            conv[0] = {"from": conv[0]["from"], "value": IMAGE_TAG + "\n" + conv[0]["value"]}
    first_q = next((t["value"] for t in conv if t["from"] in ("human", "user")), "")
    answer = next(t["value"] for t in conv if t["from"] in ("gpt", "assistant"))
    meta = {"question": first_q.replace(IMAGE_TAG, "").strip(), "conversations": conv, "id": rec.get("id", index)}
    return {"jpg": jpg, "txt": answer.encode(), "json": json.dumps(meta, ensure_ascii=False).encode()}, None


class ShardWriter:
    """Deterministic tars (fixed mtime/owner) written as NAME.tmp then renamed, each with an energon .tar.idx."""

    def __init__(self, out_dir, shard_size, prefix="shard"):
        self.out_dir, self.shard_size, self.prefix, self.next_shard = Path(out_dir), shard_size, prefix, 0
        self.tar, self.offsets, self.done = None, [], []

    def add(self, key, members):
        if self.tar is None:
            self.name = f"{self.prefix}-{self.next_shard:06d}.tar"
            self.tar = tarfile.open(self.out_dir / (self.name + ".tmp"), "w", format=tarfile.USTAR_FORMAT)
            self.offsets = []
        self.offsets.append(self.tar.offset)
        for ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
            self.tar.addfile(info, io.BytesIO(data))
        if len(self.offsets) == self.shard_size:
            self.close()

    def close(self):
        if self.tar is None:
            return self.done
        self.offsets.append(self.tar.offset)  # the end of the last sample, as energon's index has it
        self.tar.close()
        path = self.out_dir / self.name
        Path(str(path) + ".idx").write_bytes(b"".join(struct.pack("Q", o) for o in self.offsets))
        os.replace(self.out_dir / (self.name + ".tmp"), path)
        self.done.append((self.name, len(self.offsets) - 1))
        self.tar, self.next_shard = None, self.next_shard + 1
        return self.done


def write_energon_meta(out_dir, train, val):
    """.nv-meta as `energon prepare` writes it, with a VQASample field map."""
    meta = Path(out_dir, ".nv-meta")
    meta.mkdir(exist_ok=True)
    counts = {name: n for name, n in train + val}
    (meta / ".info.json").write_text(json.dumps({"energon_version": ENERGON_VERSION, "shard_counts": counts}, indent=2))
    listing = lambda shards: "".join(f"\n    - {name}" for name, _ in shards) or " []"  # noqa: E731
    split = f"split_parts:\n  train:{listing(train)}\n  val:{listing(val)}\n  test: []\nexclude: []\n"
    (meta / "split.yaml").write_text(split)
    (meta / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
        "field_map:\n  image: jpg\n  context: json[question]\n  answers: txt\n")


def is_val(sample_id, val_ratio):
    # by a hash of the id, so the split survives reordering and re-runs
    return int(hashlib.md5(str(sample_id).encode()).hexdigest()[:8], 16) / 2**32 < val_ratio


def pack(json_path, images_dir, out_dir, shard_size=1000, val_ratio=0.0, workers=1, strict=False, val_ids=None):
    """Pack a LLaVA JSON/JSONL file; a record goes to val by a hash of its id (val_ratio) or by val_ids(id)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    skips = Skips()
    records = list(read_records(json_path))
    for where, reason in (err for _, err in records if err):
        skips.add(reason, where)
    indexed = [(i, rec) for i, (rec, _) in enumerate(records) if rec is not None]
    jobs = ((i, rec, images_dir) for i, rec in indexed)
    # train and val stream into their own shards; keys count across both, so they stay unique
    writers = {split: ShardWriter(out_dir, shard_size, prefix) for split, prefix in (("train", "shard"), ("val", "val"))}
    pool = Pool(workers) if workers > 1 else None
    results = pool.imap(prepare_record, jobs, chunksize=16) if pool else map(prepare_record, jobs)
    n = 0
    for (i, rec), (sample, reason) in tqdm(zip(indexed, results), total=len(indexed), desc=f"packing {json_path}",
                                           unit="rec"):
        sample_id = rec.get("id", i) if isinstance(rec, dict) else i  # the same fallback prepare_record stores
        if reason:
            skips.add(reason, sample_id)
            continue
        members = [(ext, sample[ext]) for ext in ("jpg", "txt", "json") if sample[ext] is not None]
        split = "val" if (val_ids(sample_id) if val_ids else val_ratio and is_val(sample_id, val_ratio)) else "train"
        writers[split].add(f"sample{n:09d}", members)
        n += 1
    if pool:
        pool.close()
    good = {split: w.close() for split, w in writers.items()}
    write_energon_meta(out_dir, good["train"], good["val"])
    n_train, n_val = sum(c for _, c in good["train"]), sum(c for _, c in good["val"])
    log(f"pack: wrote {n_train} train and {n_val} val samples in {len(good['train']) + len(good['val'])} shards "
        f"to {out_dir}\npack: {skips.summary()}")
    if strict and skips.counts:
        sys.exit(f"pack: --strict: {sum(skips.counts.values())} records were skipped")
    return skips


# -----------------------------------------------------------------------------
# tokenizer and chat templates


class Tokenizer:
    """A sentencepiece tokenizer.model, or an HF tokenizer.json through the optional `tokenizers` package.

    Special strings such as "<s>" and "</s>" inside text map to their ids. With sentencepiece, each
    encode() call starts as if after a space (its dummy prefix), so one leading space is dropped."""

    def __init__(self, path):
        path = Path(path)
        if path.is_dir():
            found = [path / n for n in ("tokenizer.model", "tokenizer.json") if (path / n).exists()]
            path = found[0] if found else path / "tokenizer.model"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no tokenizer.model or tokenizer.json")
        self.path = path
        if path.suffix == ".model":
            import sentencepiece as spm

            self.sp = spm.SentencePieceProcessor(model_file=str(path))
            self.vocab_size = self.sp.get_piece_size()
            self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
            self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else 0
            # BOS/EOS and chat markers such as <|eot_id|> map straight to their ids
            pieces = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}
            self.specials = {p: i for p, i in pieces.items() if re.fullmatch(r"</?s>|<\|[a-z_]+\|>", p)}
        else:
            from tokenizers import Tokenizer as HFTokenizer

            self.sp = None
            self.hf = HFTokenizer.from_file(str(path))
            self.vocab_size = self.hf.get_vocab_size()
            self.specials = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items()}
            find = lambda *names: next((self.specials[n] for n in names if n in self.specials), -1)  # noqa: E731
            self.bos_id = find("<s>", "<|begin_of_text|>", "<|endoftext|>")
            self.eos_id = find("</s>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>")
            self.pad_id = find("<pad>", "<|finetune_right_pad_id|>", "<|endoftext|>", "</s>")
        alternatives = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self.special_re = re.compile(f"({alternatives})") if self.specials else None

    def encode(self, text):
        ids = []
        for part in self.special_re.split(text) if self.special_re else [text]:
            if part in self.specials:
                ids.append(self.specials[part])
            elif part and self.sp is not None:
                ids += self.sp.encode(part[1:] if part.startswith(" ") else part)
            elif part:
                ids += self.hf.encode(part, add_special_tokens=False).ids
        return ids

    def decode(self, ids):
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.sp.decode(ids) if self.sp is not None else self.hf.decode(ids, skip_special_tokens=False)


VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
LLAMA2_SYSTEM = ("You are a helpful language and vision assistant. You are able to understand the visual content "
                 "that the user provides, and assist the user with a variety of tasks using natural language.")


def turns(conv):
    """(role, text) with role 'system', 'user' or 'assistant'; LLaVA's human/gpt accepted."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    return [(roles[t["from"]], t["value"]) for t in conv]


# Each template maps a conversation to pieces (text, is_target); "".join(text) is the published
# prompt string. Pieces are tokenized one by one, so a label boundary can never drift from the text.


def template_plain(conv, system=None):
    # LLaVA stage 1: the image, then the caption; the question text is not used
    answer = next(text for role, text in turns(conv) if role == "assistant")
    return [("<s>", False), (IMAGE_TAG, False), (answer + "\n", True)]


def template_vicuna_v1(conv, system=None):
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system or VICUNA_SYSTEM)
    pieces, prompt = [("<s>", False)], sys_text + " "
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            prompt += f"USER: {text} ASSISTANT:"
        else:
            pieces += [(prompt, False), (f" {text}</s>", True)]
            prompt = ""
    return pieces + ([(prompt, False)] if prompt.strip() else [])


def template_llama_2(conv, system=None):
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system or LLAMA2_SYSTEM)
    pieces, first = [], True
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            if first and sys_text:
                text = f"<<SYS>>\n{sys_text}\n<</SYS>>\n\n{text}"
            pieces += [("<s>", False), (f"[INST] {text} [/INST]", False)]
            first = False
        else:
            pieces.append((f" {text} </s>", True))
    return pieces


def template_llama_3(conv, system=None):
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system)
    pieces = [("<|begin_of_text|>", False)]
    if sys_text:
        pieces.append((f"<|start_header_id|>system<|end_header_id|>\n\n{sys_text}<|eot_id|>", False))
    for role, text in (t for t in ts if t[0] != "system"):
        header = f"<|start_header_id|>{role}<|end_header_id|>\n\n"
        if role == "user":
            pieces.append((header + text + "<|eot_id|>", False))
        else:
            pieces += [(header, False), (text + "<|eot_id|>", True)]
    return pieces


def template_chatml(conv, system=None):
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system or "You are a helpful assistant.")
    pieces = [(f"<|im_start|>system\n{sys_text}<|im_end|>\n", False)]
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            pieces.append((f"<|im_start|>user\n{text}<|im_end|>\n", False))
        else:
            pieces += [("<|im_start|>assistant\n", False), (f"{text}<|im_end|>", True), ("\n", False)]
    return pieces


TEMPLATES = {"plain": template_plain, "vicuna_v1": template_vicuna_v1, "llama_2": template_llama_2,
             "llama_3": template_llama_3, "chatml": template_chatml}


def generation_prompt(template, question):
    """The prompt string for asking `question` at inference, ending where the answer starts."""
    if template == "plain":
        return "<s>" + IMAGE_TAG
    pieces = TEMPLATES[template]([{"from": "human", "value": question}, {"from": "gpt", "value": "\x00"}])
    text = "".join(t for t, _ in pieces)
    return text[: text.index("\x00")].rstrip(" ")


def tokenize(pieces, tok, image_token_id, n_image_tokens):
    """(ids, labels): each <image> becomes n_image_tokens image ids; labels are -100 outside targets."""
    ids, labels = [], []
    for text, target in pieces:
        for j, chunk in enumerate(text.split(IMAGE_TAG)):
            if j:
                ids += [image_token_id] * n_image_tokens
                labels += [-100] * n_image_tokens
            if chunk:
                t = tok.encode(chunk)
                ids += t
                labels += t if target else [-100] * len(t)
    return ids, labels


def encode_conversation(conv, has_image, template, tok, seq_len, image_token_id, n_image_tokens):
    """(ids, labels, truncated) or raise DropSample. Rule: cut the tail to seq_len; drop the sample if that
    would cut into its image tokens or leave no supervised token."""
    if template == "plain" and not has_image:
        raise DropSample("plain_template_without_image")
    ids, labels = tokenize(TEMPLATES[template](conv), tok, image_token_id, n_image_tokens)
    image_positions = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(image_positions) != n_image_tokens * has_image:
        raise DropSample("image_tag_mismatch")
    truncated = len(ids) > seq_len
    if image_positions and image_positions[-1] >= seq_len:
        raise DropSample("image_beyond_seq_len")
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(x == -100 for x in labels[1:]):  # the first label never counts: nothing predicts it
        raise DropSample("no_supervised_tokens")
    return ids, labels, truncated


class DropSample(Exception):
    pass


def prompt_and_answer(conv, has_image, template, tok, image_token_id, n_image_tokens):
    """The ids the model sees before the first answer (exactly as in training) and that answer's text."""
    ids, labels = tokenize(TEMPLATES[template](conv), tok, image_token_id, n_image_tokens)
    first = next(i for i, lab in enumerate(labels) if lab != -100)
    return ids[:first], next(t for r, t in turns(conv) if r == "assistant")


def stop_token_id(template, tok):
    """The token that ends an assistant turn in `template`."""
    marker = {"llama_3": "<|eot_id|>", "chatml": "<|im_end|>"}.get(template)
    ids = tok.encode(marker) if marker else []
    return ids[-1] if len(ids) and tok.decode(ids[-1:]) == marker else tok.eos_id


# -----------------------------------------------------------------------------
# images


def load_image(data, size, mode="pad"):
    """JPEG/PNG bytes -> (3, size, size) uint8. 'pad': fit the long side, pad with the CLIP mean colour
    (LLaVA's pad); 'crop': fit the short side, centre crop (CLIP's processor); 'resize': squash."""
    img = Image.open(io.BytesIO(data))
    w, h = img.size
    scale = size / (max(w, h) if mode == "pad" else min(w, h))
    if img.format == "JPEG":
        # libjpeg decodes at 1/2, 1/4 or 1/8 scale when the result is still at least this large
        img.draft("RGB", (max(1, round(w * scale)), max(1, round(h * scale))))
    img = img if img.mode == "RGB" else img.convert("RGB")
    w, h = img.size
    scale = size / (max(w, h) if mode == "pad" else min(w, h))
    nw, nh = (size, size) if mode == "resize" else (max(1, round(w * scale)), max(1, round(h * scale)))
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None]  # (1, 3, h, w) uint8, channels-last in memory
    # torch's uint8 antialiased bicubic is ~4x faster than PIL's and within one level of it
    x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True)[0]  # (3, nh, nw)
    if mode == "resize":
        return x.contiguous()
    if mode == "crop":
        top, left = (nh - size) // 2, (nw - size) // 2
        return x[:, top : top + size, left : left + size].contiguous()
    canvas = torch.tensor([int(m * 255) for m in CLIP_MEAN], dtype=torch.uint8).view(3, 1, 1).repeat(1, size, size)
    top, left = (size - nh) // 2, (size - nw) // 2
    canvas[:, top : top + nh, left : left + nw] = x
    return canvas


def normalize_images(images):
    """(B, 3, H, W) uint8 -> float32 with CLIP mean/std, as one multiply-add per pixel."""
    return images.float().mul_(NORM_SCALE).add_(NORM_SHIFT)


NORM_SCALE = torch.tensor([1 / (255 * s) for s in CLIP_STD]).view(1, 3, 1, 1)  # (x/255 - mean)/std = x*scale + shift
NORM_SHIFT = torch.tensor([-m / s for m, s in zip(CLIP_MEAN, CLIP_STD)]).view(1, 3, 1, 1)


# -----------------------------------------------------------------------------
# reading shards: an index of samples, a deterministic order, exact resume


def shard_files(paths, split="train"):
    """Tar files of `paths` (directories or tars). A directory with .nv-meta/split.yaml gives its `split` part."""
    out = []
    for p in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        if p.is_file():
            out.append(p)
            continue
        split_yaml = p / ".nv-meta" / "split.yaml"
        if split_yaml.exists():
            parts, current = {}, None
            for line in split_yaml.read_text().splitlines():  # the tiny YAML subset write_energon_meta writes
                if m := re.match(r"^  (\w+):\s*(\[\])?\s*$", line):
                    current = m.group(1)
                    parts[current] = []
                elif (m := re.match(r"^\s+- (.+)$", line)) and current:
                    parts[current].append(m.group(1).strip())
                elif not line.startswith(" "):
                    current = None
            out += [p / name for name in parts.get(split, [])]
        else:
            out += sorted(p.glob("*.tar"))
    if not out:
        raise FileNotFoundError(f"no {split} shards found in {paths}")
    return out


def sample_offsets(tar_path):
    """[(start, end)] byte ranges of the samples in one tar, from its .tar.idx or a scan of the headers."""
    idx = Path(str(tar_path) + ".idx")
    if idx.exists():
        raw = idx.read_bytes()
        offsets = struct.unpack(f"{len(raw) // 8}Q", raw)
        return list(zip(offsets[:-1], offsets[1:]))
    ranges, last_key = [], None
    with tarfile.open(tar_path) as tar:  # only headers are read; data blocks are skipped
        for member in tar:
            m = KEY_RE.match(member.name) if member.isreg() else None
            if not m:
                continue
            if m.group(1) != last_key:
                if ranges:
                    ranges[-1][1] = member.offset
                ranges.append([member.offset, None])
                last_key = m.group(1)
        if ranges:
            ranges[-1][1] = tar.offset
    return [tuple(r) for r in ranges]


def read_members(f, start, end):
    """{ext: bytes} of one sample: its tar members between two header offsets."""
    f.seek(start)
    buf, members, pos = f.read(end - start), {}, 0
    key = None
    while pos + 512 <= len(buf):
        info = tarfile.TarInfo.frombuf(buf[pos : pos + 512], tarfile.ENCODING, "surrogateescape")
        data_at = pos + 512
        pos = data_at + -(-info.size // 512) * 512
        m = KEY_RE.match(info.name) if info.isreg() else None
        if m:
            key = m.group(1)
            members[m.group(2).lower()] = buf[data_at : data_at + info.size]
    return key, members


def sample_conversation(members):
    """(conversation, image bytes or None) from our members, or from a plain webdataset jpg/png + json/txt."""
    image = next((members[e] for e in IMAGE_EXTS if e in members), None)
    meta = json.loads(members["json"]) if "json" in members else {}
    if "conversations" in meta:
        return meta["conversations"], image
    answer = members.get("txt", b"").decode()
    question = meta.get("question") or meta.get("context") or ""
    if image is not None:
        question = f"{IMAGE_TAG}\n{question}" if question else IMAGE_TAG
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}], image


class ShardStream(torch.utils.data.IterableDataset):
    """An endless stream of fixed-shape batches from shards, the same for any number of DataLoader workers.

    Epoch e visits every sample once in a deterministic order: the shards shuffled by (seed, e), then
    each block of `shuffle_block` consecutive samples shuffled, so reads stay mostly sequential. Rank r
    of W takes every W-th sample of that order (wrapping round so all ranks get the same count). Batch
    k of a rank is samples [k*N, (k+1)*N) of its stream (N = B, or pack x B when packing) and is built by
    worker k % n_workers; the
    DataLoader hands batches back in k order, so a resume needs only the position: no replay."""

    def __init__(self, paths, tokenizer, batch_size, seq_len, image_size, image_token_id, n_image_tokens,
                 template="plain", image_mode="pad", split="train", seed=0, rank=0, world_size=1, shuffle_block=1000,
                 pack=0):
        self.files = shard_files(paths, split)
        self.index = [(i, s, e) for i, f in enumerate(self.files) for s, e in sample_offsets(f)]
        if not self.index:
            raise ValueError(f"the {split} shards in {paths} hold no samples")
        ends = np.cumsum(np.bincount([i for i, _, _ in self.index], minlength=len(self.files)))
        self.shard_ranges = list(zip([0, *ends[:-1]], ends))  # each shard's samples, as a range of the index
        self.tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
        if template not in TEMPLATES:
            raise ValueError(f"unknown template {template!r}; choose from {sorted(TEMPLATES)}")
        self.batch_size, self.seq_len, self.image_size = batch_size, seq_len, image_size
        # pack > 0: a batch reads pack x batch_size samples and packs them into its rows (packed_batch)
        self.pack, self.samples_per_batch = pack, batch_size * pack if pack else batch_size
        self.image_token_id, self.n_image_tokens = image_token_id, n_image_tokens
        self.template, self.image_mode, self.split = template, image_mode, split
        self.seed, self.rank, self.world_size, self.shuffle_block = seed, rank, world_size, shuffle_block
        self.start = 0  # sample position in this rank's stream; set by Loader
        self.per_rank = -(-len(self.index) // world_size)
        self._order_cache = (None, None)
        self.skips = Skips()
        self._files = {}

    def __len__(self):
        return len(self.index)

    def order(self, epoch):
        if self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            blocks = [np.arange(*self.shard_ranges[s]) for s in rng.permutation(len(self.files))]
            order = np.concatenate(blocks)
            for b in range(0, len(order), self.shuffle_block):
                order[b : b + self.shuffle_block] = rng.permutation(order[b : b + self.shuffle_block])
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def sample_at(self, position):
        """The sample index at `position` of this rank's stream."""
        epoch, i = divmod(position, self.per_rank)
        return int(self.order(epoch)[(i * self.world_size + self.rank) % len(self.index)])

    def read(self, sample):
        """(key, {ext: bytes}) of one sample."""
        shard, start, end = self.index[sample]
        f = self._files.get(shard) or self._files.setdefault(shard, open(self.files[shard], "rb"))  # noqa: SIM115
        return read_members(f, start, end)

    def encode(self, sample):
        key, members = self.read(sample)
        where = f"{self.files[self.index[sample][0]].name}:{key}"
        try:
            conv, image = sample_conversation(members)
            pixels = load_image(image, self.image_size, self.image_mode) if image is not None else None
        except Exception as e:  # noqa: BLE001  corrupt JSON or image bytes in a foreign shard
            raise DropSample(f"unreadable_sample ({type(e).__name__}: {e})") from None
        ids, labels, truncated = encode_conversation(conv, image is not None, self.template, self.tok, self.seq_len,
                                                     self.image_token_id, self.n_image_tokens)
        if truncated:
            self.skips.add("truncated_not_dropped", where)
        return ids, labels, pixels

    def encode_or_drop(self, sample):
        """encode(sample), or None for a sample that cannot be trained on: counted, and the first few printed."""
        try:
            return self.encode(sample)
        except DropSample as e:
            self.drop(sample, str(e))
            return None

    def drop(self, sample, why):
        shard, _, _ = self.index[sample]
        reason = why.split(" ")[0]
        self.skips.add(reason, f"{self.files[shard].name}#{sample}")
        if self.skips.counts[reason] <= 3:
            log(f"data: dropped sample {sample} of {self.files[shard].name}: {why}")

    def batch(self, k):
        B, T, S, N = self.batch_size, self.seq_len, self.image_size, self.samples_per_batch
        sample_ids = torch.tensor([self.sample_at(k * N + i) for i in range(N)])
        encoded = [self.encode_or_drop(sample) for sample in sample_ids.tolist()]
        # a dropped sample keeps its place as padding with no labels: shapes are static, the position arithmetic holds
        dropped = torch.tensor([e is None for e in encoded])
        images = torch.zeros((N, 3, S, S), dtype=torch.uint8)
        has_image = torch.zeros(N, dtype=torch.bool)
        if self.pack:
            kept = [i for i, e in enumerate(encoded) if e is not None]
            b = packed_batch([encoded[i][:2] for i in kept], B, T, self.tok.pad_id)
            for i, where in zip(kept, b["where"]):
                if where is None:  # no room left in this batch's rows: lower `pack` if this is frequent
                    self.drop(int(sample_ids[i]), f"no_room_in_pack ({len(encoded[i][0])} tokens)")
                    dropped[i] = True
            with_image = [kept[j] for j in b["order"] if encoded[kept[j]][2] is not None]
            for slot, i in enumerate(with_image):  # in placeholder order, as the model's packed convention wants
                images[slot], has_image[i] = encoded[i][2], True
            extra = {"position_ids": b["position_ids"]}
            input_ids, labels = b["input_ids"], b["labels"]
        else:
            input_ids = torch.full((B, T), self.tok.pad_id, dtype=torch.long)
            labels = torch.full((B, T), -100, dtype=torch.long)
            for row, e in enumerate(encoded):
                if e is not None:
                    ids, lab, pixels = e
                    input_ids[row, : len(ids)] = torch.tensor(ids)
                    labels[row, : len(lab)] = torch.tensor(lab)
                    if pixels is not None:
                        images[row], has_image[row] = pixels, True
            extra = {}
        return {"input_ids": input_ids, "labels": labels, "pixel_values": normalize_images(images),
                "has_image": has_image, "dropped": dropped, "sample_id": sample_ids} | extra

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        self._files = {}
        k = self.start // self.samples_per_batch + worker
        while True:
            yield self.batch(k)
            k += n_workers


def pack_rows(lengths, n_rows, seq_len):
    """First-fit decreasing: place samples of the given lengths into n_rows rows of seq_len tokens.
    Returns (row, offset) per sample, None for a sample that found no room, and each row's samples in order."""
    free, rows, where = [seq_len] * n_rows, [[] for _ in range(n_rows)], [None] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r in range(n_rows) if free[r] >= lengths[i]), None)
        if row is not None:
            where[i] = (row, seq_len - free[row])
            free[row] -= lengths[i]
            rows[row].append(i)
    for r in rows:
        r.sort(key=lambda i: where[i][1])
    return where, rows


def packed_batch(samples, n_rows, seq_len, pad_id):
    """Several samples a row: input_ids, labels and position_ids (B, T); position 0 starts a sample, so the
    model keeps samples apart (model.Llama.forward). `order` lists the placed samples in flattened order: their
    images (text-only ones have none) go to pixel_values in that order; `where` is None for an unplaced sample."""
    where, rows = pack_rows([len(ids) for ids, _ in samples], n_rows, seq_len)
    input_ids = torch.full((n_rows, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n_rows, seq_len), -100, dtype=torch.long)
    position_ids = torch.zeros((n_rows, seq_len), dtype=torch.long)
    for r, members in enumerate(rows):
        end = 0
        for i in members:
            ids, lab = samples[i]
            start, end = where[i][1], where[i][1] + len(ids)
            input_ids[r, start:end] = torch.as_tensor(ids)
            labels[r, start : start + len(lab)] = torch.as_tensor(lab)
            position_ids[r, start:end] = torch.arange(len(ids))
        position_ids[r, end:] = torch.arange(seq_len - end)  # the padding tail: one more (unsupervised) sample
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "order": [i for r in rows for i in r], "where": where}


def _survive_group_signals(worker_id):
    """DataLoader worker init. Schedulers signal the whole process group (VM shutdown, SLURM, systemd, kill -- -PGID):
    a worker that died of it would make the main process raise before its stop checkpoint. SIGINT is ignored;
    SIGTERM is blocked and a thread ends the worker only when the parent sends it (DataLoader's own shutdown).
    A worker whose parent dies exits by itself (DataLoader's watchdog)."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid()

    def wait_for_parent_term():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(0)

    threading.Thread(target=wait_for_parent_term, daemon=True).start()


class Loader:
    """Wraps ShardStream in a DataLoader and counts what it hands out; state_dict() is that position."""

    def __init__(self, stream, num_workers=0, prefetch_factor=4):
        self.stream, self.num_workers, self.prefetch_factor = stream, num_workers, prefetch_factor
        self.position = 0

    def __iter__(self):
        self.stream.start = self.position
        kw = {"prefetch_factor": self.prefetch_factor, "persistent_workers": False,
              "worker_init_fn": _survive_group_signals} if self.num_workers else {}
        for batch in torch.utils.data.DataLoader(self.stream, batch_size=None, num_workers=self.num_workers, **kw):
            self.position += self.stream.samples_per_batch
            yield batch

    def state_dict(self):
        s = self.stream
        # every rank is at the same position of its own stream, so one state serves all ranks
        return {"position": self.position, "seed": s.seed, "n_samples": len(s), "world_size": s.world_size,
                "batch_size": s.batch_size, "pack": s.pack}

    def load_state_dict(self, state):
        s, state = self.stream, {"pack": 0} | state  # states from before packing existed
        mine = {"seed": s.seed, "n_samples": len(s), "world_size": s.world_size, "batch_size": s.batch_size,
                "pack": s.pack}
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            raise ValueError(f"data loader state does not match this run (saved, now): {differ}")
        self.position = state["position"]



# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="LLaVA JSON/JSONL + image folder -> tar shards with .nv-meta")
    a.add_argument("--json", required=True)
    a.add_argument("--images", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--shard-size", type=int, default=1000)
    a.add_argument("--val-ratio", type=float, default=0.0)
    a.add_argument("--workers", type=int, default=1)
    a.add_argument("--strict", action="store_true", help="exit non-zero if any record was skipped")
    b = sub.add_parser("shapes", help="generate the synthetic shapes dataset, tokenizer and shards")
    b.add_argument("--out", required=True)
    b.add_argument("--n", type=int, default=20000)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--image-size", type=int, default=48)
    b.add_argument("--turns", type=int, default=1, help="questions per image, as a multi-turn conversation")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pack(args.json, args.images, args.out, args.shard_size, args.val_ratio, args.workers, args.strict)
    else:
        import shapes  # the demo's dataset lives in its own file; it packs with pack() above

        shapes.make_shapes(args.out, args.n, args.seed, image_size=args.image_size, turns=args.turns)


if __name__ == "__main__":
    main()
