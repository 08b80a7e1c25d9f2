"""
The writing side of llavax's data: LLaVA JSON/JSONL + images -> tar shards with energon metadata.

    python data.py pack --json llava_v1_5_mix665k.json --images DIR --out SHARDS [--shard-size 1000] [--val-ratio 0.01]
    python data.py pack ... --out gs://BUCKET/SHARDS     # or s3://: each shard uploaded when complete, .nv-meta last
    python data.py pack --parquet DIR/*.parquet --out SHARDS [--columns image=img,conversations=messages]
    python data.py pack --mixture configs/mixtures/onevision.yaml --raw RAW [--workers 16]   # every source it names

A sample is KEY.jpg (image), KEY.txt (first answer) and KEY.json ({"question", "conversations", "id"}),
the layout of Megatron-Energon's VQA datasets (several images: KEY.0.jpg, KEY.1.png... in tag order; a video's
frames: KEY.f0.jpg, KEY.f1.jpg...); .nv-meta/ and SHARD.tar.idx are written too, so
`energon` reads the folder with no prepare step and webdataset reads the tars as they are.
Reading the published sources (a JSON file and its images, parquet rows) is sources.py's; data.py reads the shards
back.
"""

import contextlib
import ctypes
import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import re
import signal
import socket
import struct
import sys
import tarfile
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from itertools import islice
from multiprocessing import Process, connection
from pathlib import Path

from PIL import Image, ImageOps
from tqdm import tqdm

import lease
import mixture
import storage
from chat import (IMAGE_TAG, ROLES, VIDEO_TAG, conversation_problem,
                  place_image_tags)
from images import orientation
from progress import progress
from shards import Skips, log
from sources import JsonRecords, image_bytes, image_path, raw_source
from video import VideoDropped, VideoSettings, read_video, time_instruction, video_conversation

ENERGON_VERSION = "7.4.1"  # the megatron-energon release whose .nv-meta layout we write
# record workers start from a fresh interpreter: a fork copies every lock another thread of the parent held at that
# moment (a test runner's, a library's), and a worker that takes one waits forever. Each costs an import of this
# module (~3 s of CPU), paid once a pack
SPAWN = multiprocessing.get_context("spawn")

# -----------------------------------------------------------------------------
# packing LLaVA JSON into shards


def record_images(rec):
    """("image" | "multi" | "video" | "video_file", [names]) of a record, or (None, reason). One image: "image":
    "a.jpg" (or a one-element list); several: "image": [...], one <image> tag each, in tag order (LLaVA-OneVision's
    format); a video: "video": [frame paths] (pre-extracted frames), or "video": "clip.mp4" (a file pack decodes,
    video.py), with one <video> tag (or LLaVA-NeXT's one <image>)."""
    image, video = rec.get("image"), rec.get("video")
    if image and video:
        return None, "image_and_video"
    if video:
        if isinstance(video, str):
            return "video_file", [video]
        return ("video", video) if isinstance(video, list) else (None, "malformed_video_field")
    if not image:
        return "image", []
    names = image if isinstance(image, list) else [image]
    return ("multi" if len(names) > 1 else "image"), names


def check_conversations(rec):
    """The reason a record cannot be trained on, or None."""
    conv = rec.get("conversations")
    reason = conversation_problem(conv)  # the same check the loader applies to foreign shards
    if reason:
        return reason
    kind, names = record_images(rec)
    if kind is None:
        return names
    n_tags = sum(t["value"].count(IMAGE_TAG) for t in conv)
    n_video_tags = sum(t["value"].count(VIDEO_TAG) for t in conv)
    if kind in ("video", "video_file"):  # LLaVA-NeXT's video data tags its video <image>: one alone is the video's
        if n_tags and (n_video_tags or n_tags > 1):
            return "image_tag_in_video_sample"
        return "video_tag_count_mismatch" if n_video_tags > 1 else None
    if n_video_tags:
        return "video_tag_without_video"
    if n_tags and not names:
        return "image_tag_without_image"
    if n_tags and n_tags != len(names):  # untagged images go first (place_image_tags)
        return "image_tag_count_mismatch"
    return None


def preference_record(rec):
    """A preference record ({"image", "conversations": [prompt turns], "chosen", "rejected"}) as the record pack
    stores: its conversation ends in the chosen answer, which holds the rejected one. Or (None, reason)."""
    chosen, rejected, conv = rec.get("chosen"), rec.get("rejected"), rec.get("conversations")
    if not all(isinstance(side, str) and side.strip() for side in (chosen, rejected)):
        return None, "preference_missing_side"
    if chosen.strip() == rejected.strip():
        return None, "preference_identical_sides"  # no preference to learn; DPO's loss would be a constant
    if not rec.get("image"):
        return None, "preference_without_image"
    if not isinstance(conv, list) or not conv or not isinstance(conv[-1], dict) or conv[-1].get("from") not in \
            ("human", "user"):
        return None, "preference_prompt_not_ending_in_question"
    return rec | {"conversations": conv + [{"from": "gpt", "value": chosen, "rejected": rejected}]}, None


def prepare_record(args):
    """One record -> (sample, None) or (None, reason). Runs in pool workers, so it returns instead of raising.
    images: where its image names are read (sources.image_bytes): its image folder, or a parquet row's {name: bytes}.
    video: the VideoSettings a video file is read with (default: VideoSettings())."""
    index, rec, images, video = args if len(args) == 4 else (*args, None)
    if not isinstance(rec, dict):
        return None, "malformed_record"
    preference = "chosen" in rec or "rejected" in rec
    if preference:
        rec, reason = preference_record(rec)
        if reason:
            return None, reason
    reason = check_conversations(rec)
    if reason:
        return None, reason
    conv = [{"from": t["from"], "value": t["value"]} for t in rec["conversations"]]
    if preference:
        conv[-1]["rejected"] = rec["conversations"][-1]["rejected"]
    kind, names = record_images(rec)
    stored = []  # (member extension, bytes): KEY.jpg alone; KEY.0.jpg, KEY.1.png... for several; KEY.f0.jpg... frames
    video_info = None
    if kind in ("video", "video_file"):
        conv = video_conversation(conv)  # its tag as <video>
    if kind == "video_file":  # decoded here; its frames are stored as extracted frames are
        video = video or VideoSettings()
        stored, video_info, reason = video_frames(images, names[0], video)
        if reason:
            return None, reason
        if video.time_instruction:
            conv = video_conversation(conv, time_instruction(video_info["video_time"], video_info["frame_times"]))
        kind, names = "video", []
    for n, name in enumerate(names):
        data, reason = image_bytes(images, name)
        if reason:
            return None, "missing_video_frame" if kind == "video" and reason == "missing_image" else reason
        try:
            img = Image.open(io.BytesIO(data))
            img.load()  # a full decode: truncated files pass Image.verify()
        except Exception:  # noqa: BLE001  PIL raises many types for corrupt files
            return None, "corrupt_image"
        ext, data = stored_image(data, img)
        stored.append((ext if kind == "image" else f"{'f' * (kind == 'video')}{n}.{ext}", data))
    if stored:  # untagged images go before the first question (LLaVA's rule; the chat templates' user turn)
        conv = place_image_tags(conv, VIDEO_TAG if kind == "video" else IMAGE_TAG, len(stored) if kind == "multi" else 1)
    first_q = next((t["value"] for t in conv if ROLES[t["from"]] == "user"), "")
    answer = next(t["value"] for t in conv if ROLES[t["from"]] == "assistant")
    question = first_q.replace(IMAGE_TAG, "").replace(VIDEO_TAG, "").strip()
    meta = {"question": question, "conversations": conv, "id": rec.get("id", index)}
    if video_info:  # which frames of which file, for a check against another loader
        meta["video"] = {"file": rec["video"]} | {k: video_info[k] for k in VIDEO_META}
    try:
        text = json.dumps(meta, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (JSON "\\ud800") has no UTF-8 form
        return None, "invalid_unicode"
    return dict(stored) | {"txt": answer.encode(), "json": text}, None


VIDEO_META = ("total_frames", "fps", "frame_indices", "video_time")


def video_frames(images, name, settings):
    """(members [("f0.jpg", bytes), ...], video.read_video's info, None) of a record's video file, from its folder or
    its row, or (None, None, reason)."""
    if isinstance(images, dict):  # a row's own bytes
        source, reason = image_bytes(images, name)
    else:  # a path: a long video is not read into this process
        source, reason = image_path(images, name)
        reason = reason or (None if source.is_file() else "missing_image")
    if reason:
        return None, None, "missing_video" if reason == "missing_image" else reason
    try:
        frames, info = read_video(source, settings)
    except VideoDropped as e:
        return None, None, e.reason
    return [(f"f{n}.{ext}", data) for n, (ext, data) in enumerate(frames)], info, None


def stored_image(data, img):
    """(extension, bytes) to store for a decoded source image, never lossy: JPEG and PNG files keep their bytes;
    other formats (WebP, GIF, TIFF, BMP...) become PNG in their own mode (RGBA, LA, P, I;16 kept: the reader
    converts to RGB as the processors do), or in RGB when PNG cannot hold the mode (CMYK, YCbCr, I, F), turned
    upright first as the reader turns a JPEG or PNG by its EXIF orientation (images.open_rgb)."""
    if img.format in ("JPEG", "MPO"):  # MPO: a phone's multi-picture JPEG, read as its first picture
        return "jpg", data
    if img.format == "PNG":
        return "png", data
    img = ImageOps.exif_transpose(img) if orientation(img) != 1 else img  # the PNG written below keeps no EXIF
    buf = io.BytesIO()
    img = img if img.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16") else img.convert("RGB")
    img.save(buf, format="PNG", compress_level=1)
    return "png", buf.getvalue()


class ShardWriter:
    """Deterministic tars (fixed mtime/owner), each with an energon .tar.idx. In a local out_dir a tar is written as
    NAME.tmp, then renamed; for a bucket it is written in a local staging folder and uploaded when it is complete
    (the object appears whole, or not at all), then deleted there."""

    def __init__(self, out_dir, shard_size, prefix="shard", staging=None):
        self.out_dir, self.shard_size, self.prefix, self.next_shard = out_dir, shard_size, prefix, 0
        self.local = Path(staging or out_dir)  # where the tar being written lies
        self.tar, self.offsets, self.done = None, [], []

    def add(self, key, members):
        if self.tar is None:
            self.name = f"{self.prefix}-{self.next_shard:06d}.tar"
            self.tar = tarfile.open(self.local / (self.name + ".tmp"), "w", format=tarfile.USTAR_FORMAT)
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
        tmp, index = self.local / (self.name + ".tmp"), b"".join(struct.pack("Q", o) for o in self.offsets)
        self.done.append((self.name, len(self.offsets) - 1, tmp.stat().st_size))
        if storage.is_url(self.out_dir):
            storage.upload(tmp, storage.join(self.out_dir, self.name))
            storage.write_bytes(storage.join(self.out_dir, self.name + ".idx"), index)
            tmp.unlink()
        else:
            Path(self.out_dir, self.name + ".idx").write_bytes(index)
            os.replace(tmp, Path(self.out_dir, self.name))
        self.tar, self.next_shard = None, self.next_shard + 1
        return self.done


# energon's VQA field map needs an image in every sample and drops the rest without a word, so the folder
# names this loader instead: every sample loads, text-only ones with image=None, multi-turn ones by their
# first exchange (the whole conversation is in KEY.json), several images (KEY.0.jpg, KEY.1.png...) or video
# frames (KEY.f0.jpg...) as a list in order. Parts arrive decoded (json -> dict, txt -> str, images).
SAMPLE_LOADER = '''"""Written by llavax pack.py: lets megatron-energon load every sample of this folder as a VQASample."""
import json
import re

NUMBERED = re.compile(r"(f?)(\\d+)\\.(jpg|png)")  # KEY.0.jpg: image 0 of several; KEY.f0.jpg: video frame 0


def sample_loader(raw):
    meta = json.loads(raw["json"]) if isinstance(raw["json"], (bytes, str)) else raw["json"]
    answer = raw["txt"].decode() if isinstance(raw["txt"], bytes) else raw["txt"]
    numbered = sorted(((int(m[2]), raw[part]) for part in raw if (m := NUMBERED.fullmatch(part))),
                      key=lambda x: x[0])
    image = raw["jpg"] if "jpg" in raw else raw.get("png", [img for _, img in numbered] or None)
    return dict(__key__=raw["__key__"], image=image, context=meta["question"], answers=answer)  # as field_map gave


def part_filter(part):
    return part in ("jpg", "png", "txt", "json") or NUMBERED.fullmatch(part) is not None
'''


def write_energon_meta(out_dir, train, val, skips, made_for=None, refused="", facts=None):
    """.nv-meta as `energon prepare` writes it, with our sample loader, plus llavax.json (each shard's sample
    count and byte size, what was skipped and the first ids of each reason). .info.json goes last: a folder without
    it is not a dataset. refused (--strict with skips): llavax.json says why, and .info.json is not written. Each
    file is written whole (storage.write_text), on a disk or in a bucket."""
    meta = storage.join(out_dir, ".nv-meta")
    storage.makedirs(meta)
    listing = lambda shards: "".join(f"\n    - {s[0]}" for s in shards) or " []"  # noqa: E731
    split = f"split_parts:\n  train:{listing(train)}\n  val:{listing(val)}\n  test: []\nexclude: []\n"
    storage.write_text(storage.join(meta, "split.yaml"), split)
    storage.write_text(storage.join(meta, "dataset.yaml"),
                       "sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
                       "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n")
    storage.write_text(storage.join(meta, "sample_loader.py"), SAMPLE_LOADER)
    shards = {name: {"samples": n, "bytes": size} for name, n, size in train + val}
    if facts:  # each sample's record in the source file, and its length: take rules and group_by_modality_length
        add_record_facts(shards, train, val, facts)
    storage.write_text(storage.join(meta, "llavax.json"),
                       json.dumps({"shards": shards, "skipped": dict(sorted(skips.counts.items())),
                                   "skipped_first": {r: skips.examples[r] for r in sorted(skips.counts)}}
                                  | ({"tokenizer": made_for} if made_for else {})
                                  | ({"records": facts["count"]} if facts else {})
                                  | ({"refused": refused} if refused else {}), indent=1))
    if refused:
        return
    info = {"energon_version": ENERGON_VERSION, "shard_counts": {name: s["samples"] for name, s in shards.items()}}
    storage.write_text(storage.join(meta, ".info.json"), json.dumps(info, indent=2))


OUR_FILES = re.compile(r"^(shard|val)-\d{6}\.tar(\.idx|\.tmp)?$")


def clear_out_dir(out_dir, overwrite):
    """Refuse to pack over an existing dataset (or the shards of a killed pack) unless overwrite; then remove it,
    metadata first. out_dir: a local folder (held by this pack: holding) or a bucket prefix."""
    storage.refuse_object(out_dir, "--out")
    storage.makedirs(out_dir)
    old = [name for name in storage.ls(out_dir) if name == ".nv-meta" or name.endswith((".tar", ".idx", ".tmp"))]
    if not old:
        return
    if not overwrite:
        sys.exit(f"pack: {out_dir} already holds a dataset ({', '.join(old[:3])}{', ...' if len(old) > 3 else ''}); "
                 "pass --overwrite to replace it, or choose another --out")
    foreign = [name for name in old if name != ".nv-meta" and not OUR_FILES.match(name)]
    if foreign:
        sys.exit(f"pack: --overwrite removes only what pack writes, and {out_dir} also holds {foreign[0]}: "
                 "move it away or choose another --out")
    # metadata first, .info.json before the rest: an interrupted removal never leaves a folder that looks complete
    storage.rm(storage.join(out_dir, ".nv-meta", ".info.json"))
    storage.rm(storage.join(out_dir, ".nv-meta"), recursive=True)
    for name in old:
        if name != ".nv-meta":
            storage.rm(storage.join(out_dir, name))


# -----------------------------------------------------------------------------
# one pack at a time in a folder: an unfinished dataset there is a killed pack's only when no pack holds the folder

PACK_LOCK = ".pack.lock"  # flock'd by the pack writing the folder, holding its host, pid and start time


def holder_text(held):
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("started", 0)))
    return f"pid {held.get('pid')} on host {held.get('host')}, started {started}" + \
        (f": {held['command']}" if held.get("command") else "")


def read_holder(path):
    try:
        held = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) else {}


def take_out_dir(out_dir):
    """The fd of OUT/.pack.lock, flock'd by this process, its host, pid and start time written in it; or exit in one
    sentence naming the pack that holds it. A pack that dies (even by SIGKILL) drops its flock with it, so its lock
    never blocks a rerun. Where flock is refused (a file system without locks) the pid decides: a holder on this host
    whose process is gone (lease.alive) is stale."""
    path = Path(out_dir, PACK_LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SystemExit(f"pack: {out_dir} is being written by another pack ({holder_text(read_holder(path))}); "
                             "wait for it to end, or choose another --out") from None
        except OSError as e:
            held = read_holder(path)
            if held and held.get("pid") != os.getpid() and lease.alive(held) is not False:
                os.close(fd)
                raise SystemExit(f"pack: {out_dir} is being written by another pack ({holder_text(held)}), as {path} "
                                 f"says where it cannot be locked ({e.strerror or e}); wait for it to end, or remove "
                                 f"{path} if that pack is gone") from None
            log(f"pack: {path} cannot be locked ({e.strerror or e}): a second pack into {out_dir} is told apart by the "
                "pid it names only")
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a file a finishing pack removed meanwhile
                break
        os.close(fd)
    lease.HELD.add(fd)  # a process forked from here (a pool worker) closes its copy: the lock ends with this one
    me = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": lease.process_start(os.getpid()),
          "started": time.time(), "command": " ".join(["data.py", *sys.argv[1:]])[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def give_out_dir(out_dir, fd):
    """Remove the lock file (inside the lock: a pack waiting on it takes a new one), then drop the lock."""
    with contextlib.suppress(OSError):
        os.unlink(Path(out_dir, PACK_LOCK))
    lease.unlock(fd)


@contextlib.contextmanager
def holding(out_dirs):
    """Hold every local folder of out_dirs (made if missing) for this pack, or exit in one sentence naming the pack
    that holds one. Bucket prefixes are not held: an object store has no lock."""
    held = []
    try:
        for out_dir in filter(lambda d: not storage.is_url(d), out_dirs):
            storage.refuse_object(out_dir, "--out")
            storage.makedirs(out_dir)
            held.append((out_dir, take_out_dir(out_dir)))
        yield
    finally:
        for out_dir, fd in reversed(held):
            give_out_dir(out_dir, fd)


def repeated_frames(sample, sample_id, repeats):
    """Count a video sample whose frame indices repeat (force_sample asked for more frames than the video has), by the
    most times one frame is stored: LLaVA-NeXT's loader takes the same frames, so pack keeps them, and says so."""
    indices = json.loads(sample["json"]).get("video", {}).get("frame_indices", [])
    most = max(Counter(indices).values(), default=1)
    if most > 1:
        repeats.add(str(most), sample_id)


def is_val(sample_id, val_ratio):
    # by a hash of the id, so the split survives reordering and re-runs
    return int(hashlib.md5(str(sample_id).encode()).hexdigest()[:8], 16) / 2**32 < val_ratio


def pack(json_path, images_dir, out_dir, **options):
    """Pack a LLaVA JSON/JSONL file and the image folder its names are relative to (pack_source's options)."""
    return pack_source(JsonRecords(json_path, images_dir), out_dir, **options)


def pack_source(source, out_dir, shard_size=1000, val_ratio=0.0, workers=1, strict=False, val_ids=None,
                overwrite=False, tokenizer=None, position=None, video=None, held=False):
    """Pack a source (sources.py: a JSON file and its images, parquet rows) into out_dir, a local folder or a bucket
    prefix (s3://, gs://: each shard uploaded when it is complete, .nv-meta last); a record goes to val by a hash of
    its id (val_ratio) or by val_ids(id). tokenizer: the tokenizer file the data is made for (its text was written for
    it, as the shapes demo's is), recorded so that a run with another is refused (config.check_data). position: the
    line of its progress bar among several (pack_mixture). video: how video files are read (video.VideoSettings).
    A local out_dir is held (holding) while it is written; held: the caller holds it already (pack_mixture)."""
    if not (isinstance(shard_size, int) and shard_size >= 1 and isinstance(workers, int) and workers >= 1
            and 0 <= val_ratio < 1):
        raise ValueError(f"pack: shard_size and workers must be whole numbers >= 1 and val_ratio >= 0 and < 1, not "
                         f"{shard_size!r}, {workers!r} and {val_ratio!r}")
    if not held:
        with holding([out_dir]):
            return pack_source(source, out_dir, shard_size, val_ratio, workers, strict, val_ids, overwrite, tokenizer,
                               position, video, held=True)
    made_for = tokenizer_record(tokenizer) if tokenizer else None
    if storage.is_url(out_dir):
        storage.check_bucket(out_dir)  # a bucket that is not there, or no credentials: one sentence, before any work
        with tempfile.TemporaryDirectory(prefix="llavax-pack-") as staging:
            return pack_into(source, str(out_dir).rstrip("/"), shard_size, val_ratio, workers, strict, val_ids,
                             overwrite, made_for, staging, position, video)
    return pack_into(source, Path(out_dir), shard_size, val_ratio, workers, strict, val_ids, overwrite, made_for,
                     None, position, video)


def modality_length(sample):
    """LLaVA-NeXT's modality_lengths of a packed sample: the words of its conversation, negative for one with no
    image or video (LazySupervisedDataset.modality_lengths, what group_by_modality_length sorts and splits by)."""
    words = sum(len(t["value"].split()) for t in json.loads(sample["json"])["conversations"])
    return max(words, 1) * (1 if any(k not in ("txt", "json") for k in sample) else -1)


def add_record_facts(shards, train, val, facts):
    """Each shard's `records` ([[first, count], ...]: the record indices in the source file of its samples, in
    order) and `lengths` (modality_length), from each split's (index, length) pairs in the order they were written."""
    for split, written in (("train", train), ("val", val)):
        at = 0
        for name, n, _ in written:
            part, at = facts[split][at : at + n], at + n
            found = []
            for index, _ in part:
                if found and found[-1][0] + found[-1][1] == index:
                    found[-1][1] += 1
                else:
                    found.append([index, 1])
            shards[name] |= {"records": found, "lengths": [length for _, length in part]}


def tokenizer_record(path):
    """What .nv-meta/llavax.json records of the tokenizer a dataset is made for: its file name and sha256."""
    return {"file": storage.name(path), "sha256": hashlib.sha256(storage.read_bytes(path, big=True)).hexdigest()}


def prepared(source, pool, workers, video=None, chunk=256):
    """(sample id, sample, None) or (sample id or where, None, reason) for each entry of source, in order.
    prepare_record runs on one chunk in the pool while the chunk before it is written: Pool.imap would read the whole
    source ahead of the writer, and a parquet source's images would all come to sit in memory."""
    entries, pending = enumerate(source), None
    while True:
        batch = list(islice(entries, chunk))
        jobs = [(i, rec, images, video) for i, (rec, images) in batch if rec is not None]
        results = pool.map_async(prepare_record, jobs, chunksize=max(1, len(jobs) // (4 * workers))) if pool else None
        if pending:
            done, outs = pending
            outs = iter(outs.get()) if pool else map(prepare_record, ((*job, video) for job in done if job[1] is not None))
            for i, rec, err in done:
                if rec is None:  # an entry the source could not read: (where, reason)
                    yield err[0], None, err[1]
                    continue
                sample, reason = next(outs)
                yield (rec.get("id", i) if isinstance(rec, dict) else i), sample, reason  # the id prepare_record stores
        if not batch:
            return
        pending = ([(i, rec, images) for i, (rec, images) in batch], results)


def pack_into(source, out_dir, shard_size, val_ratio, workers, strict, val_ids, overwrite, made_for=None, staging=None,
              position=None, video=None):
    clear_out_dir(out_dir, overwrite)
    skips = Skips()
    # train and val stream into their own shards; keys count across both, so they stay unique
    writers = {split: ShardWriter(out_dir, shard_size, prefix, staging)
               for split, prefix in (("train", "shard"), ("val", "val"))}
    n, facts = 0, {"count": 0, "train": [], "val": []}  # (record index in the source, modality length) a sample
    repeats = Skips()  # videos whose frames repeat (force_sample over a short video), by the most repeats of one
    total = source.count()
    try:
        with record_pool(workers) if workers > 1 else nullcontext() as pool, \
                progress(prepared(source, pool, workers, video), total=total, unit="rec", desc=f"packing {source.name}",
                         position=position, leave=position is None) as entries:
            for index, (sample_id, sample, reason) in enumerate(entries):  # one entry a record, unreadable ones too
                facts["count"] = index + 1
                if reason:
                    skips.add(reason, sample_id)
                    continue
                members = list(sample.items())  # images in tag order, then txt and json
                split = "val" if (val_ids(sample_id) if val_ids else val_ratio and is_val(sample_id, val_ratio)) \
                    else "train"
                writers[split].add(f"sample{n:09d}", members)
                facts[split].append((index, modality_length(sample)))
                n += 1
                if "f0.jpg" in sample or "f0.png" in sample:
                    repeated_frames(sample, sample_id, repeats)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (data.py): said last, never "done"
        of = f" of {total:,}" if total is not None else ""
        log(f"pack: interrupted after {facts['count']:,}{of} records: {out_dir} is left unfinished (no "
            ".nv-meta/.info.json: training and audit refuse it); pack it again with --overwrite (a mixture: run the "
            "same command again)")
        raise SystemExit(130) from None
    good = {split: w.close() for split, w in writers.items()}
    if n == 0:
        sys.exit(f"pack: {source.name}: no record could be packed, so no dataset was written\npack: {skips.summary()}")
    refusal = f"pack --strict: {sum(skips.counts.values())} records were skipped" if strict and skips.counts else ""
    write_energon_meta(out_dir, good["train"], good["val"], skips, made_for, refusal, facts)
    n_train, n_val = (sum(s[1] for s in good[split]) for split in ("train", "val"))
    log(f"pack: wrote {n_train} train and {n_val} val samples in {len(good['train']) + len(good['val'])} shards "
        f"to {out_dir}\npack: {skips.summary()}")
    if repeats.counts:
        most = max(int(r) for r in repeats.counts)
        log(f"pack: {sum(repeats.counts.values())} videos have fewer frames than frames_upbound "
            f"{(video or VideoSettings()).frames_upbound} (force_sample): their frames are stored repeated, one up to "
            f"{most} times, as LLaVA-NeXT's loader repeats them (np.linspace over the frames; first: "
            f"{', '.join(repeats.examples[str(most)])})")
    if refusal:  # no .info.json: training, audit and a mixture's pack take it for unfinished
        sys.exit(f"pack: --strict: {sum(skips.counts.values())} records were skipped, so {out_dir} is left unfinished "
                 "(no .nv-meta/.info.json; its skips are in .nv-meta/llavax.json): fix them and pack again with "
                 "--overwrite, or pack without --strict")
    return skips


# -----------------------------------------------------------------------------
# packing a mixture: every dataset a mixture file names, from its raw input, several at once, resumable


def mixture_targets(yaml_path):
    """[(packed dataset path, raw input name)] of every dataset a mixture file names (train and val splits), each once;
    the raw name is the file name of a LLaVA-NeXT entry's json_path without .json/.jsonl, else the dataset folder's."""
    targets = {}
    for split in ("train", "val"):
        try:
            found = mixture.sources(yaml_path, split, every=True)  # never-published ones too: packed where given
        except mixture.MixtureError as e:
            sys.exit(f"pack: --mixture: {e}")
        for s in found:
            if str(s.path).endswith(".tar"):
                sys.exit(f"pack: --mixture {yaml_path}: source {s.name} is a .tar ({s.path}); pack writes folders")
            raw = re.sub(r"\.jsonl?$", "", storage.name(s.raw)) if s.raw else storage.name(s.path)
            out = storage.canonical(s.path)
            if targets.setdefault(out, raw) != raw:
                sys.exit(f"pack: --mixture {yaml_path}: {out} is named twice, packed from {targets[out]} and {raw}")
    return list(targets.items())


def finished(out_dir):
    return storage.exists(storage.join(out_dir, ".nv-meta", ".info.json"))


def refused(out_dir):
    """Whether out_dir is a dataset that --strict left unfinished (its llavax.json says so)."""
    meta = storage.join(out_dir, ".nv-meta", "llavax.json")
    return storage.exists(meta) and "refused" in json.loads(storage.read_text(meta))


def die_with_parent():
    """A pack child's first act: it is SIGKILLed when its parent ends, so a killed pack leaves no worker behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != multiprocessing.parent_process().pid:  # the parent died before that: no signal will come
            os._exit(1)


def record_pool(workers):
    """The record workers, which leave Ctrl-C (sent to the whole terminal's group) to the parent: it ends the pool and
    says what was interrupted. SIGINT is ignored while they start, as an ignored signal stays ignored through exec: a
    worker still importing when Ctrl-C comes would print a traceback."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: no signal reaches this one anyway
        previous = None
    try:
        return SPAWN.Pool(workers, initializer=record_worker)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def record_worker():
    """A record worker's first act: it dies with its parent, and ignores Ctrl-C (one the pool starts again too)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pack_one(source, out_dir, options, position):
    """One source of a mixture, in its own process, out_dir held by its parent (pack_mixture): what a killed run left
    in out_dir (never a finished dataset: those are skipped) is removed first. The process ends with its parent, so a
    killed pack leaves no writer behind."""
    die_with_parent()
    try:
        pack_source(source, out_dir, overwrite=True, position=position, held=True, **options)
    except storage.StorageError as e:
        sys.exit(f"pack: {storage.name(out_dir)}: {e}")


def pack_mixture(yaml_path, raw_dir, workers=1, images_dir=None, columns=None, overwrite=False, **options):
    """Pack every dataset a mixture file names into its path, each from its raw input under raw_dir
    (sources.raw_source), up to `workers` at once (a pool of workers // at-once record workers each). Finished
    datasets are skipped (overwrite: packed again); a dataset a killed run left unfinished is packed again from its
    start. The local folders to pack are held (holding) until the end: a second pack of the same mixture stops in one
    sentence naming this one, and never takes what this one is writing for a killed run's. Prints a table of what each
    kept and dropped; returns its rows, or exits 1 when a source failed."""
    targets, todo, rows, missing = mixture_targets(yaml_path), [], {}, []
    unpublished = {storage.canonical(s.path): s for s in mixture.sources(yaml_path, "train", every=True)
                   if not s.released}
    for out, raw in targets:
        if not overwrite and finished(out):
            rows[out] = "already packed"
            continue
        source = raw_source(raw_dir, raw, images_dir, columns)
        if source is None and out in unpublished:  # never published: left out, and said (training says its share)
            log(f"pack: {raw}: left out: the recipe names it but nobody published it (released: false in "
                f"{yaml_path}) and {raw_dir} has no raw input for it")
            continue
        if source is None:
            missing.append(raw)
        todo.append((out, raw, source))
    targets = [(out, raw) for out, raw in targets if out in rows or any(out == job[0] for job in todo)]
    if missing:
        sys.exit(f"pack: --mixture {yaml_path}: no raw input under {raw_dir} for {len(missing)} of its datasets: "
                 f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''} (each NAME is NAME.json or NAME.jsonl, "
                 "its images under --images, or a folder NAME/ of .parquet / .arrow files)")
    with holding([out for out, _, _ in todo]):
        for out, _, _ in todo:  # looked at again, held: another pack may have finished one meanwhile
            if not overwrite and finished(out):
                rows[out] = "already packed"
        todo = [job for job in todo if job[0] not in rows]
        table = pack_todo(yaml_path, targets, todo, rows, workers, **options)
    if len(targets) < len(mixture_targets(yaml_path)):
        say_left_out(yaml_path)
    return table


def say_left_out(yaml_path):
    """The share of the recipe the never-published sources held, which the packed ones take (as training says)."""
    try:
        line = mixture.Mixture(yaml_path, "train").left_out_line()
    except (mixture.MixtureError, OSError, ValueError) as e:
        line = f"pack: the share of the recipe the sources left out held is not known yet ({e})"
    log(line)


def pack_todo(yaml_path, targets, todo, rows, workers, **options):
    """pack_mixture's work once its folders are held: todo's (out, raw name, source), at most `workers` at once."""
    at_once = max(1, min(workers, len(todo)))
    options |= {"workers": max(1, workers // at_once)}
    each = f" with {options['workers']} workers each" if options["workers"] > 1 else ""
    log(f"pack: {len(targets)} datasets in {yaml_path}: {len(rows)} already packed, {len(todo)} to pack, {at_once} at "
        f"a time{each}")
    tqdm.get_lock()  # made before the fork: the bars of all processes share it
    running, free, queue = {}, list(range(at_once)), list(todo)
    try:
        run_todo(running, free, queue, rows, options)
    except KeyboardInterrupt:  # its sources' processes stop too, each saying where (SIGTERM: data.py's handler), first
        for proc, *_ in running.values():
            proc.terminate()
        for proc, *_ in running.values():
            proc.join(timeout=30)  # then ended with this process at the latest (die_with_parent)
        log(f"pack: --mixture {yaml_path} interrupted, {sum(r == 'packed' for r in rows.values())} of its datasets "
            f"packed by this run and {len(running) + len(queue)} unfinished: run the same command again to pack them")
        raise SystemExit(130) from None
    return mixture_table(targets, rows)


def run_todo(running, free, queue, rows, options):
    """Start a process (pack_one) for each job of queue while a slot is free, and note each one's end in rows."""
    while queue or running:
        while queue and free:
            out, raw, source = queue.pop(0)
            slot = free.pop(0)
            proc = Process(target=pack_one, args=(source, out, options, slot), name=f"pack {raw}")
            proc.start()
            running[proc.sentinel] = (proc, out, raw, slot, time.monotonic())
        for sentinel in connection.wait(list(running)):
            proc, out, raw, slot, t0 = running.pop(sentinel)
            proc.join()
            free.append(slot)
            rows[out] = "packed" if proc.exitcode == 0 else "refused, with skips (--strict)" if refused(out) else \
                f"failed (exit {proc.exitcode})"
            log(f"pack: {raw}: {rows[out]} in {time.monotonic() - t0:.0f} s")


def mixture_table(targets, rows):
    """Print each dataset's kept (train + val) and dropped samples from its .nv-meta/llavax.json; exit 1 if one failed."""
    print("| dataset | raw input | status | kept train | kept val | dropped | drop reasons |\n|---|---|---|---|---|---|---|")
    table, failed = [], []
    for out, raw in targets:
        kept, skipped = {"train": 0, "val": 0}, {}
        if not rows[out].startswith("failed"):
            meta = json.loads(storage.read_text(storage.join(out, ".nv-meta", "llavax.json")))
            for name, shard in meta["shards"].items():
                kept["val" if name.startswith("val-") else "train"] += shard["samples"]
            skipped = meta["skipped"]
        if rows[out] not in ("packed", "already packed"):
            failed.append(raw)
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(skipped.items(), key=lambda x: -x[1]))
        print(f"| {out} | {raw} | {rows[out]} | {kept['train']:,} | {kept['val']:,} | {sum(skipped.values()):,} | "
              f"{reasons} |")
        table.append({"path": out, "raw": raw, "status": rows[out], "kept": kept, "skipped": skipped})
    if failed:
        sys.exit(f"pack: {len(failed)} datasets failed ({', '.join(failed[:5])}): run the same command again to pack "
                 "what is unfinished (finished ones are skipped)")
    return table
