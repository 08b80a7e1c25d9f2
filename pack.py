"""
The writing side of llavax's data: LLaVA JSON/JSONL + images -> tar shards with energon metadata.

    python data.py pack --json llava_v1_5_mix665k.json --images DIR --out SHARDS [--shard-size 1000] [--val-ratio 0.01]

A sample is KEY.jpg (image), KEY.txt (first answer) and KEY.json ({"question", "conversations", "id"}),
the layout of Megatron-Energon's VQA datasets; .nv-meta/ and SHARD.tar.idx are written too, so
`energon` reads the folder with no prepare step and webdataset reads the tars as they are.
data.py reads the shards back.
"""

import hashlib
import io
import json
import os
import struct
import sys
import tarfile
from multiprocessing import Pool
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from data import IMAGE_TAG, Skips, log

ENERGON_VERSION = "7.4.1"  # the megatron-energon release whose .nv-meta layout we write

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
