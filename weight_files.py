"""
Weight files: finding them in a directory (HF shards and their index, ours), reading safetensors and weights-only
pickles, writing safetensors one tensor at a time (HF-style shards above a size), and writing a directory
atomically. convert.py (formats) and checkpoint.py (training checkpoints) build on these.

Split from convert.py along the seam between moving bytes and mapping names: nothing here knows a model.
"""

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

SHARD_BYTES = 5 * 2**30  # shard above this, like HF's default max_shard_size
PROGRESS_BYTES = 2**30  # show a progress bar for reads and writes larger than this


class ConversionError(ValueError):  # every conversion error, raised here, in hf_config.py and in convert.py
    pass


def say(msg):
    print(f"convert: {msg}", file=sys.stderr)



def weight_files(directory):
    d = Path(directory)
    if not d.is_dir():
        raise ConversionError(f"{d}: not a directory")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (d / index).exists():
            return [d / f for f in sorted(set(json.loads((d / index).read_text())["weight_map"].values()))]
    # model*.safetensors first: a training checkpoint also holds optimizer.safetensors and rng.safetensors
    files = sorted(d.glob("model*.safetensors")) or sorted(d.glob("*.safetensors")) or \
        sorted(d.glob("pytorch_model*.bin")) or sorted(d.glob("mm_projector.bin"))
    if not files:
        raise ConversionError(f"{d}: no *.safetensors, pytorch_model*.bin or mm_projector.bin weights found")
    return files


def read_weights(directory):
    files = weight_files(directory)
    total = sum(f.stat().st_size for f in files if f.exists())
    state = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {directory}", disable=total < PROGRESS_BYTES) as bar:
        for f in files:
            if not f.exists():
                raise ConversionError(f"{f}: listed in the index but missing")
            if f.suffix == ".bin":
                # a pickle: weights_only=True refuses anything but tensors and plain containers
                say(f"{f} is a pickle; loading it with torch.load(weights_only=True)")
                try:
                    state |= torch.load(f, map_location="cpu", weights_only=True)
                except Exception as e:
                    raise ConversionError(f"{f}: cannot load as a weights-only torch file ({e})") from None
            else:
                try:
                    with safe_open(f, framework="pt") as sf:
                        state |= {k: sf.get_tensor(k) for k in sf.keys()}
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise ConversionError(f"{f}: not a readable safetensors file ({e}); "
                                          "it may be truncated by an interrupted download or copy") from None
            bar.update(f.stat().st_size)
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
    for name, keys in tqdm(list(zip(names, shards)), desc=f"writing {directory}", disable=total < PROGRESS_BYTES):
        write_safetensors({k: state[k] for k in keys}, os.path.join(directory, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, ks in zip(names, shards) for k in ks}}
        Path(directory, f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_dir(out, fill, overwrite=False):
    """Run fill(tmp_dir) and rename tmp_dir to `out` only when complete, so no half-written `out` exists."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConversionError(f"{out}: already exists; refusing to overwrite it (choose another --out)")
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed write to the same `out`
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and Path("/proc/self").exists() and not Path(f"/proc/{pid}").exists():
            say(f"removing {stale}, left by a write that was killed")
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
