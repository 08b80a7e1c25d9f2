"""
Shard folders and tars for llavax's loader: the .nv-meta checks, each sample's byte range (from SHARD.tar.idx or a
header scan) and its members. Split out of data.py (over its line budget); data.py re-exports these names.
A folder or tar that is incomplete or inconsistent raises DatasetError: one message naming the file.
"""

import io
import json
import re
import struct
import sys
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

KEY_RE = re.compile(r"^((?:.*/)?[^./]+)\.([^/]+)$")  # webdataset/energon: the key ends at the first dot of the basename


class DatasetError(SystemExit):
    """A shard folder or tar that is incomplete or inconsistent. Training cannot go on, so it exits with one
    message naming the file, not a traceback (catch it like any exception to do otherwise)."""


def split_parts(split_yaml):
    """{part: [shard names]} from .nv-meta/split.yaml (the tiny YAML subset pack and `energon prepare` write)."""
    parts, current = {}, None
    for line in split_yaml.read_text().splitlines():
        if m := re.match(r"^  (\w+):\s*(\[\])?\s*$", line):
            current = m.group(1)
            parts[current] = []
        elif (m := re.match(r"^\s+- (.+)$", line)) and current:
            parts[current].append(m.group(1).strip())
        elif not line.startswith(" "):
            current = None
    return parts


def dataset_shards(folder, split):
    """{shard path: sample count} of one split of a dataset folder, after checking the folder is whole: pack
    (like `energon prepare`) writes .nv-meta/.info.json last, and every shard must match what it records."""
    meta = folder / ".nv-meta"
    missing = [name for name in (".info.json", "split.yaml") if not (meta / name).exists()]
    if missing:
        raise DatasetError(f"{folder}: no .nv-meta/{missing[0]}, so not a finished dataset (a pack that was killed "
                           "or is still running leaves this); re-run pack with --overwrite, run `energon prepare` on "
                           "a webdataset folder, or pass its .tar files themselves")
    counts = json.loads((meta / ".info.json").read_text())["shard_counts"]
    ours = json.loads((meta / "llavax.json").read_text())["shards"] if (meta / "llavax.json").exists() else {}
    unlisted = sorted(p.name for p in folder.glob("*.tar") if p.name not in counts)
    if unlisted:
        raise DatasetError(f"{folder / unlisted[0]}: a shard that .nv-meta/.info.json does not list (left by an "
                           "earlier pack?); remove it, or re-pack with --overwrite")
    shards = {}
    for name in split_parts(meta / "split.yaml").get(split, []):
        path = folder / name
        if name not in counts or not path.exists():
            raise DatasetError(f"{path}: listed in {meta / 'split.yaml'} but "
                               f"{'missing' if name in counts else 'not in .info.json'}")
        size, expected = path.stat().st_size, ours.get(name, {}).get("bytes")
        if expected is not None and size != expected:
            raise DatasetError(f"{path}: {size} bytes where .nv-meta/llavax.json records {expected}: truncated "
                               "or replaced; re-pack with --overwrite")
        shards[path] = counts[name]
    return shards


def shard_files(paths, split="train"):
    """{tar: expected sample count or None} of `paths`: tar files, or dataset folders (their `split` part)."""
    out = {}
    for p in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        out |= {p: None} if p.is_file() else dataset_shards(p, split)
    if not out:
        raise FileNotFoundError(f"no {split} shards found in {paths}")
    return out


def sample_offsets(tar_path, count=None):
    """[(start, end)] byte ranges of the samples in one tar, from its .tar.idx or a scan of the headers.
    An index that does not fit its tar (stale, short, or the tar truncated) is an error naming the file."""
    idx, size = Path(str(tar_path) + ".idx"), Path(tar_path).stat().st_size
    if idx.exists():
        raw = idx.read_bytes()
        offsets = struct.unpack(f"{len(raw) // 8}Q", raw)
        with open(tar_path, "rb") as f:
            # the index ends where the last sample ends: the tar's end-of-archive zeros must follow
            f.seek(offsets[-1] if offsets else 0)
            tail = f.read(512)
        problem = ("not a whole number of 8-byte offsets" if len(raw) % 8 or len(offsets) < 2 else
                   "offsets not increasing" if any(b <= a for a, b in zip(offsets, offsets[1:])) else
                   f"ends at byte {offsets[-1]} of a {size}-byte tar" if offsets[-1] > size else
                   f"{len(offsets) - 1} samples where .nv-meta says {count}" if count not in (None, len(offsets) - 1)
                   else f"more samples follow its last offset {offsets[-1]}" if tail.strip(b"\0") else None)
        if problem:
            raise DatasetError(f"{idx}: does not match {Path(tar_path).name} ({problem}): stale or short; "
                               "re-pack, or delete the .idx to read the tar by scanning")
        return list(zip(offsets[:-1], offsets[1:]))
    ranges, last_key = [], None
    try:
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
            end = tar.offset
            tar.fileobj.seek(end)
            # tarfile stops quietly at a cut-off header: a whole tar ends with two zero blocks
            if tar.fileobj.read(1024).strip(b"\0") or size < end + 1024:
                raise DatasetError(f"{tar_path}: truncated: no end-of-archive marker after byte {end}")
    except tarfile.TarError as e:
        raise DatasetError(f"{tar_path}: not a readable tar ({e})") from None
    if ranges:
        ranges[-1][1] = end
    if count not in (None, len(ranges)):
        raise DatasetError(f"{tar_path}: {len(ranges)} samples where .nv-meta says {count}")
    return [tuple(r) for r in ranges]


def read_members(f, start, end):
    """(key, {ext: bytes}) of one sample: its tar members between two header offsets."""
    f.seek(start)
    buf, members, key, pos = f.read(end - start), {}, None, 0
    while pos + 512 <= len(buf):
        info = tarfile.TarInfo.frombuf(buf[pos : pos + 512], tarfile.ENCODING, "surrogateescape")
        if info.type in LONG_NAME_TYPES:
            return read_members_by_tarfile(buf)
        data_at = pos + 512
        pos = data_at + -(-info.size // 512) * 512
        m = KEY_RE.match(info.name) if info.isreg() else None
        if m:
            key = m.group(1)
            members[m.group(2).lower()] = buf[data_at : data_at + info.size]
    return key, members


# names over 100 bytes come in PAX or GNU records before the member (webdataset's TarWriter and tarfile
# write PAX): those samples go through tarfile, which applies them; the plain walk above is ~2x faster
LONG_NAME_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


def read_members_by_tarfile(buf):
    members, key = {}, None
    with tarfile.open(fileobj=io.BytesIO(buf), mode="r:") as tar:
        for info in tar:
            m = KEY_RE.match(info.name) if info.isreg() else None
            if m:
                key = m.group(1)
                members[m.group(2).lower()] = tar.extractfile(info).read()
    return key, members


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
