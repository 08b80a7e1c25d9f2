"""
The writing side of llavax's data: LLaVA JSON/JSONL + images -> tar shards with energon metadata.

    python data.py pack --json llava_v1_5_mix665k.json --images DIR --out SHARDS [--shard-size 1000] [--val-ratio 0.01]

A sample is KEY.jpg (image), KEY.txt (first answer) and KEY.json ({"question", "conversations", "id"}),
the layout of Megatron-Energon's VQA datasets; .nv-meta/ and SHARD.tar.idx are written too, so
`energon` reads the folder with no prepare step and webdataset reads the tars as they are.
data.py reads the shards back.
"""

import codecs
import hashlib
import io
import json
import os
import re
import shutil
import struct
import sys
import tarfile
from multiprocessing import Pool
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from data import IMAGE_TAG, ROLES, Skips, conversation_problem, log

ENERGON_VERSION = "7.4.1"  # the megatron-energon release whose .nv-meta layout we write

# -----------------------------------------------------------------------------
# packing LLaVA JSON into shards


def read_text(path):
    """The text of a JSON/JSONL file: UTF-8 with or without a BOM, or UTF-16/32 with a BOM; anything else exits."""
    raw = Path(path).read_bytes()
    boms = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
            (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))  # UTF-32-LE's BOM starts like UTF-16-LE's
    codec = next((codec for bom, codec in boms if raw.startswith(bom)), "utf-8")
    if codec == "utf-8" and b"\x00" in raw[:4096]:
        sys.exit(f"pack: {path}: NUL bytes: UTF-16/32 text without a byte-order mark? Convert it to UTF-8")
    try:
        return raw.decode(codec)
    except UnicodeDecodeError as e:
        sys.exit(f"pack: {path}: not valid {codec} text (byte {e.start}: {e.reason}); convert it to UTF-8")


def read_records(path):
    """Yield (record, None) or (None, (where, reason)) from a LLaVA JSON array or a JSONL file."""
    text = read_text(path)
    if text.lstrip().startswith("{"):  # JSONL, or one JSON object
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # several lines of JSON: JSONL
        if isinstance(whole, dict) and "conversations" not in whole:
            sys.exit(f"pack: {path}: one JSON object (keys {', '.join(list(whole)[:5])}), not LLaVA data: a JSON array "
                     "or JSONL of {\"id\", \"image\", \"conversations\"} records")
        if isinstance(whole, dict):  # one record, perhaps over several lines
            yield whole, None
            return
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
    reason = conversation_problem(conv)  # the same check the loader applies to foreign shards
    if reason:
        return reason
    n_tags = sum(t["value"].count(IMAGE_TAG) for t in conv)
    if n_tags > 1:
        return "multiple_image_tags"
    if isinstance(rec.get("image"), list) and len(rec["image"]) > 1:
        return "multiple_images"  # until multi-image samples are supported
    if n_tags and not rec.get("image"):
        return "image_tag_without_image"
    return None


def image_path(images_dir, name):
    """(path, None), or (None, reason) for a name that is not a plain relative path inside images_dir."""
    name = name[0] if isinstance(name, list) and len(name) == 1 else name
    if not isinstance(name, str) or "\x00" in name:
        return None, "malformed_image_field"
    root = Path(images_dir).resolve()
    path = Path(root, name)
    # a shared dataset JSON must not make pack read files elsewhere: absolute paths, ../ and symlinks out
    try:
        inside = not os.path.isabs(name) and path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        return None, "malformed_image_field"
    if not inside:
        return None, "image_outside_images_dir"
    return path, None


def prepare_record(args):
    """One record -> (sample, None) or (None, reason). Runs in pool workers, so it returns instead of raising."""
    index, rec, images_dir = args
    if not isinstance(rec, dict):
        return None, "malformed_record"
    reason = check_conversations(rec)
    if reason:
        return None, reason
    conv = [{"from": t["from"], "value": t["value"]} for t in rec["conversations"]]
    image = None  # (member extension, bytes)
    if rec.get("image"):
        path, reason = image_path(images_dir, rec["image"])
        if reason:
            return None, reason
        if not path.is_file():
            return None, "missing_image"
        data = path.read_bytes()
        try:
            img = Image.open(io.BytesIO(data))
            img.load()  # a full decode: truncated files pass Image.verify()
        except Exception:  # noqa: BLE001  PIL raises many types for corrupt files
            return None, "corrupt_image"
        image = stored_image(data, img)
        if not any(IMAGE_TAG in t["value"] for t in conv):  # LLaVA puts the image before the first question
            conv[0] = {"from": conv[0]["from"], "value": IMAGE_TAG + "\n" + conv[0]["value"]}
    first_q = next((t["value"] for t in conv if ROLES[t["from"]] == "user"), "")
    answer = next(t["value"] for t in conv if ROLES[t["from"]] == "assistant")
    meta = {"question": first_q.replace(IMAGE_TAG, "").strip(), "conversations": conv, "id": rec.get("id", index)}
    try:
        text = json.dumps(meta, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (JSON "\\ud800") has no UTF-8 form
        return None, "invalid_unicode"
    sample = {"txt": answer.encode(), "json": text}
    if image:
        sample[image[0]] = image[1]
    return sample, None


def stored_image(data, img):
    """(extension, bytes) to store for a decoded source image, never lossy: JPEG and PNG files keep their bytes;
    other formats (WebP, GIF, TIFF, BMP...) become PNG in their own mode (RGBA, LA, P, I;16 kept: the reader
    converts to RGB as the processors do), or in RGB when PNG cannot hold the mode (CMYK, YCbCr, I, F)."""
    if img.format in ("JPEG", "MPO"):  # MPO: a phone's multi-picture JPEG, read as its first picture
        return "jpg", data
    if img.format == "PNG":
        return "png", data
    buf = io.BytesIO()
    img = img if img.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16") else img.convert("RGB")
    img.save(buf, format="PNG", compress_level=1)
    return "png", buf.getvalue()


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
        self.done.append((self.name, len(self.offsets) - 1, path.stat().st_size))
        self.tar, self.next_shard = None, self.next_shard + 1
        return self.done


# energon's VQA field map needs an image in every sample and drops the rest without a word, so the folder
# names this loader instead: every sample loads, text-only ones with image=None, multi-turn ones by their
# first exchange (the whole conversation is in KEY.json). Parts arrive decoded (json -> dict, txt -> str).
SAMPLE_LOADER = '''"""Written by llavax pack.py: lets megatron-energon load every sample of this folder as a VQASample."""
import json


def sample_loader(raw):
    meta = json.loads(raw["json"]) if isinstance(raw["json"], (bytes, str)) else raw["json"]
    answer = raw["txt"].decode() if isinstance(raw["txt"], bytes) else raw["txt"]
    image = raw["jpg"] if "jpg" in raw else raw.get("png")
    return dict(__key__=raw["__key__"], image=image, context=meta["question"], answers=answer)  # as field_map gave


def part_filter(part):
    return part in ("jpg", "png", "txt", "json")
'''


def write_energon_meta(out_dir, train, val, skips):
    """.nv-meta as `energon prepare` writes it, with our sample loader, plus llavax.json (each shard's sample
    count and byte size, what was skipped). .info.json goes last: a folder without it is not a dataset."""
    meta = Path(out_dir, ".nv-meta")
    meta.mkdir(exist_ok=True)
    listing = lambda shards: "".join(f"\n    - {s[0]}" for s in shards) or " []"  # noqa: E731
    split = f"split_parts:\n  train:{listing(train)}\n  val:{listing(val)}\n  test: []\nexclude: []\n"
    (meta / "split.yaml").write_text(split)
    (meta / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
        "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n")
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER)
    shards = {name: {"samples": n, "bytes": size} for name, n, size in train + val}
    (meta / "llavax.json").write_text(json.dumps({"shards": shards, "skipped": dict(sorted(skips.counts.items()))},
                                                 indent=1))
    info = {"energon_version": ENERGON_VERSION, "shard_counts": {name: s["samples"] for name, s in shards.items()}}
    (meta / ".info.json.tmp").write_text(json.dumps(info, indent=2))
    os.replace(meta / ".info.json.tmp", meta / ".info.json")


OUR_FILES = re.compile(r"^(shard|val)-\d{6}\.tar(\.idx|\.tmp)?$")


def clear_out_dir(out_dir, overwrite):
    """Refuse to pack over an existing dataset unless overwrite; then remove it, metadata first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    old = sorted(p.name for p in out_dir.iterdir() if p.name == ".nv-meta" or p.name.endswith((".tar", ".idx", ".tmp")))
    if not old:
        return
    if not overwrite:
        sys.exit(f"pack: {out_dir} already holds a dataset ({', '.join(old[:3])}{', ...' if len(old) > 3 else ''}); "
                 "pass --overwrite to replace it, or choose another --out")
    foreign = [name for name in old if name != ".nv-meta" and not OUR_FILES.match(name)]
    if foreign:
        sys.exit(f"pack: --overwrite removes only what pack writes, and {out_dir} also holds {foreign[0]}: "
                 "move it away or choose another --out")
    # metadata first: an interrupted removal never leaves a folder that looks complete
    shutil.rmtree(out_dir / ".nv-meta", ignore_errors=True)
    for name in old:
        (out_dir / name).unlink(missing_ok=True)


def is_val(sample_id, val_ratio):
    # by a hash of the id, so the split survives reordering and re-runs
    return int(hashlib.md5(str(sample_id).encode()).hexdigest()[:8], 16) / 2**32 < val_ratio


def pack(json_path, images_dir, out_dir, shard_size=1000, val_ratio=0.0, workers=1, strict=False, val_ids=None,
         overwrite=False):
    """Pack a LLaVA JSON/JSONL file; a record goes to val by a hash of its id (val_ratio) or by val_ids(id)."""
    out_dir = Path(out_dir)
    clear_out_dir(out_dir, overwrite)
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
        members = [(ext, sample[ext]) for ext in ("jpg", "png", "txt", "json") if sample.get(ext) is not None]
        split = "val" if (val_ids(sample_id) if val_ids else val_ratio and is_val(sample_id, val_ratio)) else "train"
        writers[split].add(f"sample{n:09d}", members)
        n += 1
    if pool:
        pool.close()
    good = {split: w.close() for split, w in writers.items()}
    if n == 0:
        sys.exit(f"pack: {json_path}: no record could be packed, so no dataset was written\npack: {skips.summary()}")
    write_energon_meta(out_dir, good["train"], good["val"], skips)
    n_train, n_val = (sum(s[1] for s in good[split]) for split in ("train", "val"))
    log(f"pack: wrote {n_train} train and {n_val} val samples in {len(good['train']) + len(good['val'])} shards "
        f"to {out_dir}\npack: {skips.summary()}")
    if strict and skips.counts:
        sys.exit(f"pack: --strict: {sum(skips.counts.values())} records were skipped")
    return skips
