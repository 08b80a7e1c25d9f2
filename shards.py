"""
Shard folders and tars for llavax's loader: the .nv-meta checks, each sample's byte range (from SHARD.tar.idx or a
header scan) and its members, read from a local folder or a bucket (s3://, gs://: through storage.py).
A folder or tar that is incomplete or inconsistent raises DatasetError: one message naming the file.
"""

import io
import json
import os
import re
import struct
import sys
import tarfile
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import storage

KEY_RE = re.compile(r"^((?:.*/)?[^./]+)\.([^/]+)$")  # webdataset/energon: the key ends at the first dot of the basename
MAX_OPEN_SHARDS = 64  # local shard files one reader keeps open


class DatasetError(SystemExit):
    """A shard folder or tar that is incomplete or inconsistent. Training cannot go on, so it exits with one
    message naming the file, not a traceback (catch it like any exception to do otherwise)."""


class VanishedShard(storage.StorageError):
    """A shard that was whole when the run indexed it and is gone or shorter now: the data changed under the run."""


def split_parts(split_yaml):
    """{part: [shard names]} from the text of .nv-meta/split.yaml (the tiny YAML subset pack and `energon prepare`
    write)."""
    parts, current = {}, None
    for line in split_yaml.splitlines():
        if m := re.match(r"^  (\w+):\s*(\[\])?\s*$", line):
            current = m.group(1)
            parts[current] = []
        elif (m := re.match(r"^\s+- (.+)$", line)) and current:
            parts[current].append(m.group(1).strip())
        elif not line.startswith(" "):
            current = None
    return parts


def dataset_shards(folder, split):
    """{shard path: sample count} of one split of a dataset folder (local, or a prefix in a bucket), after checking
    the folder is whole: pack (like `energon prepare`) writes .nv-meta/.info.json last, and every shard must match
    what it records. Two listings and three small reads, however many shards there are."""
    meta = storage.join(folder, ".nv-meta")
    meta_files = storage.file_sizes(meta)
    missing = [name for name in (".info.json", "split.yaml") if name not in meta_files]
    if missing and not storage.ls(folder):
        raise DatasetError(f"{folder}: no dataset there (nothing under it): check the path, or write one with "
                           "`python data.py pack --out`")
    refused = json.loads(storage.read_text(storage.join(meta, "llavax.json"))).get("refused") \
        if missing and "llavax.json" in meta_files else None
    if refused:
        raise DatasetError(f"{folder}: not a finished dataset: {refused} (.nv-meta/llavax.json names them); fix those "
                           "records and pack again with --overwrite, or pack without --strict")
    if missing:
        raise DatasetError(f"{folder}: no .nv-meta/{missing[0]}, so not a finished dataset (a pack that was killed "
                           "or is still running leaves this); re-run pack with --overwrite, run `energon prepare` on "
                           "a webdataset folder, or pass its .tar files themselves")
    counts = json.loads(storage.read_text(storage.join(meta, ".info.json")))["shard_counts"]
    ours = json.loads(storage.read_text(storage.join(meta, "llavax.json")))["shards"] \
        if "llavax.json" in meta_files else {}
    sizes = storage.file_sizes(folder)
    unlisted = sorted(name for name in sizes if name.endswith(".tar") and name not in counts)
    if unlisted:
        raise DatasetError(f"{storage.join(folder, unlisted[0])}: a shard that .nv-meta/.info.json does not list "
                           "(left by an earlier pack?); remove it, or re-pack with --overwrite")
    shards = {}
    for name in split_parts(storage.read_text(storage.join(meta, "split.yaml"))).get(split, []):
        path = storage.join(folder, name)
        if name not in counts or name not in sizes:
            raise DatasetError(f"{path}: listed in {storage.join(meta, 'split.yaml')} but "
                               f"{'missing' if name in counts else 'not in .info.json'}")
        size, expected = sizes[name], ours.get(name, {}).get("bytes")
        if expected is not None and size != expected:
            raise DatasetError(f"{path}: {size} bytes where .nv-meta/llavax.json records {expected}: truncated "
                               "or replaced; re-pack with --overwrite")
        shards[path] = counts[name]
    return shards


def shard_files(paths, split="train"):
    """{tar: expected sample count or None} of `paths`: tar files, or dataset folders (their `split` part); each a
    local path or a bucket URL (a URL ending in .tar is a tar)."""
    out = {}
    for p in [paths] if isinstance(paths, (str, Path)) else paths:
        if storage.is_url(p):
            storage.check_key(p)
            storage.check_bucket(p)  # a bucket that is not there, or credentials that cannot reach it: said so
            out |= {str(p): None} if str(p).endswith(".tar") else dataset_shards(str(p).rstrip("/"), split)
        else:
            out |= {Path(p): None} if Path(p).is_file() else dataset_shards(Path(p), split)
    if not out:
        raise FileNotFoundError(f"no {split} shards found in {paths}")
    return out


def index_path(tar_path):
    return f"{tar_path}.idx" if storage.is_url(tar_path) else Path(f"{tar_path}.idx")


def sample_offsets(tar_path, count=None):
    """[(start, end)] byte ranges of the samples in one tar, from its .tar.idx or a scan of the headers.
    An index that does not fit its tar (stale, short, or the tar truncated) is an error naming the file."""
    idx, size = index_path(tar_path), storage.size(tar_path)
    try:
        raw = storage.read_bytes(idx)
    except FileNotFoundError:
        return scanned_offsets(tar_path, count, size)
    offsets = struct.unpack(f"{len(raw) // 8}Q", raw)
    # the index ends where the last sample ends: the tar's end-of-archive zeros must follow
    last = offsets[-1] if offsets else 0
    tail = storage.read_bytes(tar_path, last, min(last + 512, size)) if last < size else b""
    problem = ("not a whole number of 8-byte offsets" if len(raw) % 8 or len(offsets) < 2 else
               "offsets not increasing" if any(b <= a for a, b in zip(offsets, offsets[1:])) else
               f"ends at byte {offsets[-1]} of a {size}-byte tar" if offsets[-1] > size else
               f"{len(offsets) - 1} samples where .nv-meta says {count}" if count not in (None, len(offsets) - 1)
               else f"more samples follow its last offset {offsets[-1]}" if tail.strip(b"\0") else None)
    if problem:
        raise DatasetError(f"{idx}: does not match {storage.name(tar_path)} ({problem}): stale or short; "
                           "re-pack, or delete the .idx to read the tar by scanning")
    return list(zip(offsets[:-1], offsets[1:]))


def scanned_offsets(tar_path, count, size):
    """sample_offsets of a tar without an index, by reading its headers."""
    ranges, last_key = [], None
    try:
        with storage.open(tar_path) as f, tarfile.open(fileobj=f) as tar:  # only headers are read; data is skipped
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
        raise DatasetError(f"{tar_path}: not a readable tar ({' '.join(str(e).split())})") from None  # one line
    if ranges:
        ranges[-1][1] = end
    if count not in (None, len(ranges)):
        raise DatasetError(f"{tar_path}: {len(ranges)} samples where .nv-meta says {count}")
    return [tuple(r) for r in ranges]


def all_sample_offsets(files):
    """{tar: sample_offsets(tar, count)} of shard_files' {tar: count}; a bucket's tars several at a time (each
    costs three requests: its size, its index, the end of its last sample)."""
    threads = 16 if any(storage.is_url(f) for f in files) else 1
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(files, pool.map(lambda f: sample_offsets(f, files[f]), files)))


def read_members(f, start, end):
    """(key, {ext: bytes}) of one sample: its tar members between two header offsets of an open file."""
    f.seek(start)
    return parse_members(f.read(end - start))


def parse_members(buf):
    """(key, {ext: bytes}) of one sample's bytes: its tar members, headers and data."""
    members, key, pos = {}, None, 0
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


# -----------------------------------------------------------------------------
# reading samples: plain file reads on a disk, ranged requests fetched ahead of use from a bucket

REQUEST_BYTES = 4 << 20  # the most one ranged request reads: neighbouring samples merged up to this
MERGE_GAP = 64 << 10  # samples at most this far apart are read in one request, the gap with them
AHEAD, AHEAD_BYTES = 256, 64 << 20  # samples, and bytes, requested before they are asked for (per process)
THREADS = 16  # ranged requests in flight
VANISHED_RETRIES = 3  # reads of a sample whose shard is gone or short before the run stops


def merged_requests(ranges):
    """{(shard, start, end): the request (shard, start, end) that reads it} for `ranges`: each shard's ranges sorted,
    and neighbours at most MERGE_GAP apart joined while the request stays within REQUEST_BYTES (a request costs
    ~50-100 ms on a real bucket, a gap that small ~1 ms of reading)."""
    groups = []  # [[shard, start, end, [ranges]]]
    for shard, start, end in sorted(set(ranges)):
        last = groups[-1] if groups else None
        if last and last[0] == shard and start - last[2] <= MERGE_GAP and max(end, last[2]) - last[1] <= REQUEST_BYTES:
            last[2] = max(end, last[2])
            last[3].append((shard, start, end))
        else:
            groups.append([shard, start, end, [(shard, start, end)]])
    return {r: (shard, start, end) for shard, start, end, members in groups for r in members}


class ShardReader:
    """(key, members) of sample i of index [(shard, start, end)] over tars `files`. Local tars are read with plain
    file reads, at most MAX_OPEN_SHARDS of them open (reads run mostly shard by shard, and a process holding
    thousands hits "Too many open files"). Bucket tars are read by byte range, ahead of use: ahead(order) gives the
    order in which read() will ask for samples; the next AHEAD of them are grouped by shard, merged into requests
    (merged_requests) and fetched by THREADS threads while the caller decodes, so that 50-100 ms a request does
    not stall it. The order only decides what is fetched early: read(i) returns sample i whatever was planned.
    Every request goes through storage.read_bytes, retried on throttling and reset connections."""

    def __init__(self, files, index):
        self.files, self.index = files, index
        self.remote = any(storage.is_url(f) for f in files)
        self.open_files, self.pool, self.pid = {}, None, None
        self.order, self.more = iter(()), False  # the samples still to plan, and whether the order may hold more
        self.pending, self.pending_bytes = deque(), 0  # (sample, its request, its offset in the request's bytes)

    def __getstate__(self):  # a process of its own (DataLoader's spawn) opens its own files and threads
        return {"files": self.files, "index": self.index}

    def __setstate__(self, state):
        self.__init__(state["files"], state["index"])

    def ahead(self, order):
        """Samples in the order read() will ask for them (any iterable, endless or not); forgets an earlier order."""
        self.forget()
        if self.remote:
            self.order, self.more = iter(order), True

    def planned(self):
        return self.more or bool(self.pending)

    def forget(self):
        if self.pid == os.getpid():  # a forked child's copy has no threads to tell
            for _, request, _ in self.pending:
                request.cancel()
        self.order, self.more, self.pending, self.pending_bytes = iter(()), False, deque(), 0

    def read(self, sample):
        if not self.remote:
            return self.read_local(sample)
        self.fetch_ahead()
        shard, start, end = self.index[sample]
        if self.pending and self.pending[0][0] == sample:
            _, request, offset = self.pending.popleft()
            self.pending_bytes -= end - start
            try:
                data = request.result()[offset : offset + end - start]
            except storage.StorageError:
                raise
            except Exception:  # noqa: BLE001  gone, or a range past a truncated object's end (gcsfs: HttpError 416)
                data = b""  # read again below, then said
            if len(data) == end - start:
                return parse_members(data)
        else:
            self.forget()  # asked for another sample than planned: the plan is stale
        return parse_members(self.whole(shard, start, end))

    def whole(self, shard, start, end):
        """The bytes [start, end) of a shard this run indexed when it started. Gone or shorter now, the shard was
        deleted or replaced since: a storage failure, not a bad sample. Read again a few times (a replacement may be
        landing), then StorageError: the run stops, naming the shard, rather than train on empty batches."""
        path, problem = self.files[shard], None
        for attempt in range(VANISHED_RETRIES):
            if attempt:
                time.sleep(storage.BACKOFF * 2**attempt)
            try:
                if self.remote:
                    data = storage.read_bytes(path, start, end)
                else:
                    with open(path, "rb") as f:
                        f.seek(start)
                        data = f.read(end - start)
            except FileNotFoundError:
                problem = "gone (deleted since the run started)"
                continue
            except storage.StorageError:
                raise
            except Exception as e:  # noqa: BLE001  a range the object no longer holds (416: OSError, gcsfs's HttpError)
                try:
                    now = storage.size(path)
                except OSError:
                    now = None
                problem = f"truncated since the run started (now {now} bytes; a sample ends at byte {end})" \
                    if now is not None and now < end else f"unreadable ({type(e).__name__}: " \
                    f"{' '.join(str(e).split())[:120]})"
                continue
            if len(data) == end - start:
                return data
            problem = f"truncated since the run started (sample bytes {start}-{end}, {len(data)} read)"
        raise VanishedShard(f"shard {path} is {problem}, after {VANISHED_RETRIES} reads")

    def fetch_ahead(self):
        """Request the next samples of the order once fewer than half of AHEAD (and AHEAD_BYTES) are pending."""
        if self.pid != os.getpid():  # first use, or a DataLoader worker forked from a process that had threads
            self.pool, self.pid = ThreadPoolExecutor(THREADS, thread_name_prefix="shards"), os.getpid()
        if not self.more or len(self.pending) > AHEAD // 2 or self.pending_bytes > AHEAD_BYTES // 2:
            return
        samples, n_bytes = [], self.pending_bytes
        while len(self.pending) + len(samples) < AHEAD and n_bytes < AHEAD_BYTES:
            sample = next(self.order, None)
            if sample is None:
                self.more = False
                break
            samples.append(sample)
            n_bytes += self.index[sample][2] - self.index[sample][1]
        request_of = merged_requests([self.index[s] for s in samples])
        fetched = {}  # requests sent in the order their first sample is needed
        for s in samples:
            r = request_of[self.index[s]]
            if r not in fetched:
                fetched[r] = self.pool.submit(storage.read_bytes, self.files[r[0]], r[1], r[2])
            self.pending.append((s, fetched[r], self.index[s][1] - r[1]))
        self.pending_bytes = n_bytes

    def read_local(self, sample):
        shard, start, end = self.index[sample]
        if self.pid != os.getpid():  # files opened by the parent of a DataLoader worker share its offsets
            self.open_files, self.pid = {}, os.getpid()
        try:
            f = self.open_files.pop(shard, None) or open(self.files[shard], "rb")  # noqa: SIM115  kept open, closed below
        except FileNotFoundError:
            return parse_members(self.whole(shard, start, end))  # deleted since the run started: said there
        self.open_files[shard] = f
        if len(self.open_files) > MAX_OPEN_SHARDS:  # the least recently read closed first
            self.open_files.pop(next(iter(self.open_files))).close()
        f.seek(start)
        data = f.read(end - start)
        return parse_members(data if len(data) == end - start else self.whole(shard, start, end))


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
