"""
Weight files: finding them in a directory (HF shards and their index, ours), reading safetensors and weights-only
pickles, writing safetensors one tensor at a time (HF-style shards above a size), and writing a directory without a
rename, its config last. Every directory may be a local folder or a prefix in a bucket (storage.py). convert.py
(formats) and model_files.py (our model directories) build on these.

Split from convert.py along the seam between moving bytes and mapping names: nothing here knows a model.
"""

import fnmatch
import io
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors

import storage
from progress import progress

SHARD_BYTES = 5 * 2**30  # shard above this, like HF's default max_shard_size
PROGRESS_BYTES = 2**30  # show a progress bar for reads and writes larger than this


class ConversionError(ValueError):  # every conversion error, raised here, in hf_config.py and in convert.py
    pass


def say(msg):
    print(f"convert: {msg}", file=sys.stderr)



def weight_files(directory):
    """The weight files of a local folder or a bucket prefix: the index's shards, else ours or HF's safetensors, else
    weights-only pickles."""
    if not storage.is_url(directory) and not Path(directory).is_dir():
        raise ConversionError(f"{directory}: not a directory")
    names = storage.ls(directory)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            listed = json.loads(storage.read_text(storage.join(directory, index)))["weight_map"].values()
            return [storage.join(directory, f) for f in sorted(set(listed))]
    # model*.safetensors first: a training checkpoint also holds optimizer.safetensors and rng.safetensors
    for pattern in ("model*.safetensors", "*.safetensors", "pytorch_model*.bin", "mm_projector.bin"):
        if found := fnmatch.filter(names, pattern):
            return [storage.join(directory, f) for f in found]
    raise ConversionError(f"{directory}: no *.safetensors, pytorch_model*.bin or mm_projector.bin weights found")


def read_weights(directory):
    """{name: tensor} of every weight file in a local folder (safetensors memory-mapped) or a bucket prefix (each file
    fetched whole into memory and parsed there: safetensors and torch.load read bytes, so nothing lands on a disk)."""
    files = weight_files(directory)
    for f in files:
        if not storage.exists(f):
            raise ConversionError(f"{f}: listed in the index but missing")
    sizes = [storage.size(f) for f in files]
    state = {}
    with progress(total=sum(sizes), unit="B", unit_scale=True, desc=f"reading {directory}",
                  disable=sum(sizes) < PROGRESS_BYTES) as bar:
        for f, size in zip(files, sizes):
            if storage.name(f).endswith(".bin"):
                # a pickle: weights_only=True refuses anything but tensors and plain containers
                say(f"{f} is a pickle; loading it with torch.load(weights_only=True)")
                try:
                    state |= torch.load(io.BytesIO(storage.read_bytes(f, big=True)) if storage.is_url(f) else f,
                                        map_location="cpu", weights_only=True)
                except Exception as e:
                    raise ConversionError(f"{f}: cannot load as a weights-only torch file ({e})") from None
            else:
                try:
                    if storage.is_url(f):
                        state |= load_safetensors(storage.read_bytes(f, big=True))
                    else:
                        with safe_open(f, framework="pt") as sf:
                            state |= {k: sf.get_tensor(k) for k in sf.keys()}
                except (SafetensorError, OSError, RuntimeError) as e:
                    if isinstance(e, storage.StorageError):
                        raise
                    raise ConversionError(f"{f}: not a readable safetensors file ({e}); "
                                          "it may be truncated by an interrupted download or copy") from None
            bar.update(size)
    return state


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors, path, metadata=None):
    """A safetensors file written one tensor at a time: the header comes from shapes alone, then each tensor is
    fetched to the host and written. Tensors may live on any device (sharded XLA tensors are gathered one by one),
    so the host never holds more than one of them."""
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_weights(state, directory, prefix="model", shard_bytes=SHARD_BYTES):
    """One file, or HF-style shards plus `{prefix}.safetensors.index.json` when larger than shard_bytes."""
    shards, size = [[]], 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    total = sum(t.numel() * t.element_size() for t in state.values())
    names = [f"{prefix}.safetensors"] if len(shards) == 1 else \
        [f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in progress(list(zip(names, shards)), desc=f"writing {directory}", unit="file",
                               disable=total < PROGRESS_BYTES):
        write_safetensors({k: state[k] for k in keys}, os.path.join(directory, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, ks in zip(names, shards) for k in ks}}
        Path(directory, f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))


UNFINISHED = ".unfinished"  # in an output folder while write_dir puts its files there


def write_dir(out, fill, overwrite=False, commit="config.json"):
    """Run fill(folder) on an empty local folder, then put its files into `out` (a local folder, a mount, or a prefix
    in a bucket) one at a time, `commit` last: ours, transformers' from_pretrained and peft's open that file first,
    so an `out` without it is never taken for a whole one. No folder is ever renamed (a bucket has none; gcsfuse and
    Mountpoint for S3 mounts cannot): a local file moves into `out` with one os.replace from a folder beside it, an
    object appears whole when its upload completes (a bucket's files are staged in the local temporary directory:
    fill's writers, the tokenizer and processor exporters among them, need a local folder).

    An `out` that holds files is refused, unless it is an unfinished write of ours (the UNFINISHED marker, written
    before the first file and removed after the commit): then its files are replaced. overwrite=True replaces a
    finished one too: its commit file goes first, so a reader meanwhile finds no model rather than a mix of two."""
    if storage.is_object(out):  # a bucket would take out/config.json beside the object
        raise ConversionError(f"{out}: {'an existing object' if storage.is_url(out) else 'a file'}, not a folder; "
                              f"choose another --out")
    held = storage.ls(out)
    if held and UNFINISHED not in held and not overwrite:
        raise ConversionError(f"{out}: already exists; refusing to overwrite it (choose another --out)")
    staging = staging_folder(out)
    for stale in staging.parent.glob(re.sub(r"\d+$", "*", staging.name)):  # left by a killed write to the same `out`
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and Path("/proc/self").exists() and not Path(f"/proc/{pid}").exists():
            say(f"removing {stale}, left by a write that was killed")
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        fill(staging)
        files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
        files = sorted(files, key=lambda name: name == commit)  # the commit last
        if held:
            say(f"{out}: replacing {'the unfinished write there' if UNFINISHED in held else 'it (overwrite)'}")
        storage.write_bytes(storage.join(out, UNFINISHED), b"")
        storage.rm(storage.join(out, commit))
        sizes = {name: (staging / name).stat().st_size for name in files}
        with progress(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"uploading to {out}",
                      disable=not storage.is_url(out) or sum(sizes.values()) < PROGRESS_BYTES) as bar:
            for name in files:
                put_file(staging / name, storage.join(out, name))
                bar.update(sizes[name])
        for name in set(held) - {f.split("/")[0] for f in files} - {UNFINISHED}:  # the old write's, not in this one
            storage.rm(storage.join(out, name), recursive=True)
        storage.rm(storage.join(out, UNFINISHED))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out if storage.is_url(out) else Path(out)


def staging_folder(out):
    """Where write_dir's fill writes: beside a local `out` (one file system: each file then moves with a rename),
    in the temporary directory for a bucket."""
    if storage.is_url(out):
        name = re.sub(r"[^\w.-]+", "_", str(out))
        return Path(tempfile.gettempdir(), "llavax", f".{name}.tmp-{os.getpid()}")
    return Path(out).parent / f".{Path(out).name}.tmp-{os.getpid()}"


def put_file(local, path):
    if storage.is_url(path):
        storage.upload(local, path)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(local, path)  # a file's rename, within one file system (folders are never renamed)
