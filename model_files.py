"""
Model directories, read and written: what every program that only loads or saves weights uses (convert.py, sample.py,
init_from, the DPO reference, the reward and value models). Ours holds config.json (a VLMConfig), the weights as
safetensors (weight_files.py: one file, or shards and their index above a size) and the tokenizer files;
read_checkpoint also reads a training step (checkpoint.py: verified, then DCP's shards one tensor at a time) and an
HF LLaVA directory (converted in memory). A directory may be a local folder or a prefix in a bucket (storage.py).
"""

import json
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import storage
from checkpoint import MANIFEST, dcp_reader, quiet, saved_tensors, verify_checkpoint
from hf_config import HF_ARCHITECTURES
from hf_names import expected_shapes, llava_from_hf, remap
from model import build_model
from model_config import VLMConfig
from weight_files import SHARD_BYTES, UNFINISHED, ConversionError, read_weights, write_dir, write_weights


# -----------------------------------------------------------------------------
# reading a step directory as a model (convert.py, sample.py, init_from): one tensor at a time


class SavedTensor:
    """One weight of a step directory, read when asked: write_safetensors streams these one at a time."""

    def __init__(self, path, key, meta):
        self.path, self.key, self.shape, self.dtype = path, key, torch.Size(meta.size), meta.properties.dtype

    def numel(self):
        return self.shape.numel()

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def detach(self):
        t = torch.empty(self.shape, dtype=self.dtype)
        with quiet():
            # a new reader each time (it reads the index again): a shared index keeps every loaded tensor alive
            dcp.load({self.key: t}, storage_reader=dcp_reader(self.path), no_dist=True)
        return t


def is_sharded_checkpoint(path):
    return storage.exists(storage.join(path, ".metadata"))


def saved_weights(path):
    """{our weight name: SavedTensor} of a sharded step directory, nothing read yet."""
    return {k[6:]: SavedTensor(path, k, meta) for k, meta in saved_tensors(path).items() if k.startswith("model.")}


def load_weights(path):
    """{our weight name: tensor} of a sharded step directory, read in one pass over its files."""
    tensors = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in saved_weights(path).items()}
    with quiet():
        dcp.load({f"model.{k}": t for k, t in tensors.items()}, storage_reader=dcp_reader(path), no_dist=True)
    return tensors


# -----------------------------------------------------------------------------
# our directories: config.json, safetensors, the tokenizer


# tokenizer and processor files travel with the weights (from-hf carries an HF directory's through to ours)
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                   "processor_config.json")


def copy_tokenizer(src, dst):
    """The tokenizer files of folder src (local or in a bucket) into the local folder dst."""
    held = set(storage.ls(src)) if src else set()
    for name in TOKENIZER_FILES:
        if name in held:
            Path(dst, name).write_bytes(storage.read_bytes(storage.join(src, name), big=True))


def save_checkpoint(state, cfg: VLMConfig, out, tokenizer_dir=None, overwrite=False, shard_bytes=SHARD_BYTES):
    def fill(tmp):
        write_weights(state, tmp, shard_bytes=shard_bytes)
        Path(tmp, "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        copy_tokenizer(tokenizer_dir, tmp)
    return write_dir(out, fill, overwrite)


def save_model(model, ckpt_dir, tokenizer_dir=None, overwrite=False, shard_bytes=SHARD_BYTES):
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()
             if not (model.cfg.llm.tie_embeddings and k == "llm.output.weight")}
    return save_checkpoint(state, model.cfg, ckpt_dir, tokenizer_dir, overwrite, shard_bytes)


def read_checkpoint(ckpt_dir, lazy=False):
    """(state dict, VLMConfig) from our directory (a training step's shards included), or from an HF LLaVA
    directory converted in memory. lazy: a training step's tensors are read when written (one at a time)."""
    path = storage.join(ckpt_dir, "config.json")
    if re.fullmatch(r"\..+\.tmp-\d+", storage.name(ckpt_dir)):
        raise ConversionError(f"{ckpt_dir}: the temporary folder of a write that was killed (incomplete); use the "
                              f"finished directory, or run the conversion again")
    try:
        raw = json.loads(storage.read_text(path))
    except (FileNotFoundError, NotADirectoryError):
        if storage.exists(storage.join(ckpt_dir, UNFINISHED)):
            raise ConversionError(f"{ckpt_dir}: a write that did not finish (no config.json); run the conversion "
                                  f"again") from None
        raise ConversionError(f"{ckpt_dir}: no config.json; not a llavax or HF LLaVA checkpoint directory") from None
    except ValueError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: not a config (a JSON object), got {type(raw).__name__}")
    if raw.get("model_type") in HF_ARCHITECTURES:
        return llava_from_hf(ckpt_dir)
    try:
        cfg = VLMConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{path}: not a llavax config ({e})") from None
    if is_sharded_checkpoint(ckpt_dir):  # a training step: DCP's shards of every rank, checked before they are read
        damaged = verify_checkpoint(ckpt_dir) if storage.exists(storage.join(ckpt_dir, MANIFEST)) else None
        if damaged:
            raise ConversionError(f"{ckpt_dir}: not a complete training checkpoint: {damaged}")
        state = saved_weights(ckpt_dir) if lazy else load_weights(ckpt_dir)
    else:
        state = read_weights(ckpt_dir)
    shapes = expected_shapes(cfg)
    return remap(state, {k: k for k in shapes}, shapes, str(ckpt_dir)), cfg


def load_model(ckpt_dir, device="cpu", dtype=torch.float32):
    state, cfg = read_checkpoint(ckpt_dir)
    model = build_model(cfg, device=device, init=False)
    model.load_state_dict(state, strict=not cfg.llm.tie_embeddings)
    return model.to(dtype)
