"""
Training checkpoints on torch.distributed.checkpoint (DCP): every rank (torchrun) or host (torch_xla SPMD, through
its SPMD planners) writes only its own shards, in parallel and in the background (checkpoint_writer.py), and reads
into its own shards whatever wrote them (here, with the steps' listing and verification). A step directory holds:

    .metadata, __R_I.distcp     DCP: model.NAME (the weights) and optim.state.NAME.FIELD (AdamW's moments and step)
    config.json                 the model's config (model_files.py reads the directory as a model)
    state.json                  iteration, loader position (global), run config, world size, optimizer param groups
    rng.safetensors, tokenizer  each rank's RNG; the run's tokenizer
    manifest.json               size and sha256 of every file above, every rank's included: written last, by rank 0,
                                once every rank has finished: the commit
    CORRUPT                     (only in a step found damaged at resume) why: such a step is never taken again

A step directory may be a local folder or a prefix in a bucket (s3://, gs://, storage.py), and the protocol is the same
on both, with no rename anywhere (buckets have none; gcsfuse and Mountpoint for S3 mounts cannot rename folders):
each rank writes its shards straight into step-N/, rank 0 writes the manifest last, and readers take a step only if
its manifest is there and verifies. A rank killed mid-write leaves a step-N without a manifest, which nothing takes
and the next run deletes; deleting a step removes its manifest first. DCP reshards on load: a checkpoint resumes on
another world size, mesh, or backend (XLA <-> torchrun), because the keys name parameters, not ranks.
"""

import contextlib
import hashlib
import json
import os
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from safetensors.torch import load as load_safetensors

import storage
from chat import tokenizer_file
from model import VLM
from model_config import VLMConfig
from parallel import print0

MANIFEST = "manifest.json"
CORRUPT = "CORRUPT"  # in a step found damaged: the reason; the step is skipped, not renamed


def steps(out):
    """Every step-N in out_dir, committed or not, oldest first: N of any width (step-1000000 follows step-999999)."""
    found = [(int(m.group(1)), name) for name in storage.ls(out) if (m := re.fullmatch(r"step-(\d+)", name))]
    return [storage.join(out, name) for _, name in sorted(found)]


def checkpoints(out):
    """The committed steps (a manifest, no CORRUPT mark), oldest first."""
    committed = {storage.name(storage.parent(p)) for p in storage.glob(out, f"step-*/{MANIFEST}")}
    marked = {storage.name(storage.parent(p)) for p in storage.glob(out, f"step-*/{CORRUPT}")}
    return [p for p in steps(out) if storage.name(p) in committed - marked]


def unfinished_steps(out):
    """The steps whose write did not finish: no manifest (and no CORRUPT mark: a damaged step is kept for a look)."""
    kept = set(map(str, checkpoints(out))) | {str(storage.parent(p)) for p in storage.glob(out, f"step-*/{CORRUPT}")}
    return [p for p in steps(out) if str(p) not in kept]


def remove_step(path):
    """Delete a step, its manifest first: a step half deleted is never taken for a complete one."""
    storage.rm(storage.join(path, MANIFEST))
    storage.rm(path, recursive=True)


def file_sha256(path):
    h = hashlib.sha256()
    with storage.open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def describe(files):
    """{name: {size, sha256}} of files (paths, local or in a bucket: read back), hashed in parallel: hashlib and the
    downloads release the GIL."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return {storage.name(f): {"size": storage.size(f), "sha256": d} for f, d in zip(files, pool.map(file_sha256, files))}


class BucketFiles(FsspecFileSystem):
    """DCP's file system on a bucket: storage.py's fsspec instance, and every path a bucket/key. torch's own makes its
    instance from the URL with fsspec's url_to_fs, which reads :: anywhere in a key as a chain of file systems
    (s3://b/run::v2 failed every checkpoint) and gcsfs reads #N or ?generation=N as an object's version."""

    def __init__(self, fs):
        self.fs = fs

    def init_path(self, path, **kwargs):
        return path

    def rm_file(self, path):  # not fsspec's rm: it expands [ * ? in a key as a pattern, removing what that matches
        self.fs.rm_file(path)


def dcp_reader(path):
    reader = dcp.FileSystemReader(storage.key(path) if storage.is_url(path) else str(path))
    if storage.is_url(path):
        reader.fs, reader.path = BucketFiles(storage.filesystem(path)), storage.key(path)
    return reader


def read_json(path):
    return json.loads(storage.read_text(path))


# -----------------------------------------------------------------------------
# verification: the manifest, then DCP's own index against what the model and optimizer hold


def expected_keys(path, state):
    """{DCP key: shape} every complete checkpoint of this model (and PPO's value model) and these param groups holds."""
    def weight_shapes(config_file, prefix):
        cfg = VLMConfig.from_dict(read_json(storage.join(path, config_file)))
        with torch.device("meta"):
            shapes = {prefix + k: tuple(v.shape) for k, v in VLM(cfg).state_dict().items()}
        if cfg.llm.tie_embeddings:
            shapes.pop(f"{prefix}llm.output.weight", None)
        return shapes

    shapes = weight_shapes("config.json", "") | \
        (weight_shapes(VALUE_CONFIG, VALUE) if storage.exists(storage.join(path, VALUE_CONFIG)) else {})
    keys = {(k if k.startswith(VALUE) else f"model.{k}"): s for k, s in shapes.items()}
    for group in state["param_groups"]:
        for name in group["params"]:
            keys |= {f"optim.state.{name}.exp_avg": shapes[name], f"optim.state.{name}.exp_avg_sq": shapes[name],
                     f"optim.state.{name}.step": ()}
    return keys


def saved_tensors(path):
    """{DCP key: its metadata} from DCP's index (.metadata)."""
    return dcp_reader(path).read_metadata().state_dict_metadata


def verify_checkpoint(path):
    """None when checkpoint directory `path` is complete and unchanged since it was written, else the reason."""
    try:
        files = read_json(storage.join(path, MANIFEST))["files"]
        expected = {name: (int(f["size"]), str(f["sha256"])) for name, f in files.items()}
    except FileNotFoundError:
        return f"no {MANIFEST} (written last: the write did not finish, or it is not a llavax training checkpoint)"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name in ("state.json", "config.json", ".metadata"):
        if name not in expected:
            return f"{MANIFEST} does not list {name}"
    for name, (size, _) in expected.items():
        try:
            now = storage.size(storage.join(path, name))
        except FileNotFoundError:
            return f"{name} is missing"
        if now != size:
            return f"{name} is {now} bytes, {size} when written (truncated or overwritten)"
    for name, now in describe([storage.join(path, n) for n in expected]).items():
        if now["sha256"] != expected[name][1]:
            return f"{name} differs from its sha256 when written (corrupted on disk or edited)"
    try:  # a planner that drops tensors (torch_xla 2.9's, pytorch/xla#7919) writes a complete-looking checkpoint
        want, have = expected_keys(path, read_json(storage.join(path, "state.json"))), saved_tensors(path)
    except Exception as e:  # noqa: BLE001  whatever a foreign or damaged index raises, named
        return f"its index cannot be checked ({type(e).__name__}: {e})"
    missing = sorted(set(want) - set(have))
    wrong = [k for k in want if k in have and tuple(getattr(have[k], "size", ())) != want[k]]
    if missing or wrong:
        return (f"the tensors written do not cover the model: {len(missing)} missing ({', '.join(missing[:3])}), "
                f"{len(wrong)} of another shape ({', '.join(wrong[:3])})")
    return None


def run_key(out):
    """out_dir as one name however it is typed: a URL normalised (storage.normal), a local path made absolute."""
    return storage.normal(out) if storage.is_url(out) else os.path.abspath(out)


def local_tier(local_dir, out):
    """This run's folder in local_ckpt_dir, named by its out_dir: runs that share a host's disk never take, prune or
    overwrite each other's steps. Its OUT_DIR file names the run's out_dir."""
    key = run_key(out)
    return Path(local_dir, f"{storage.name(key)}-{hashlib.sha1(key.encode()).hexdigest()[:8]}")


def other_runs_steps(local_dir, mine):
    """{folder: its out_dir} of the other runs' tiers in local_ckpt_dir that hold committed steps (and the flat steps
    of a tier written before tiers were named by run)."""
    found = {str(local_dir): "a run of an older llavax"} if checkpoints(local_dir) else {}
    for folder in sorted(Path(local_dir).iterdir()) if Path(local_dir).is_dir() else []:
        if folder.is_dir() and folder != mine and (folder / "OUT_DIR").exists() and checkpoints(folder):
            found[str(folder)] = (folder / "OUT_DIR").read_text().strip()
    return found


def newest_good_checkpoint(folders, env):
    """The newest checkpoint that verifies, in whichever of `folders` it lives (out_dir, and local_ckpt_dir's tier:
    the higher step wins, the earlier folder on a tie). Newer ones that do not get a CORRUPT file that says why (kept
    for a look until this run writes its own step-N there), with the reason printed. Decided by rank 0, broadcast."""
    choice = [None, []]  # the good one, [(a bad one, why)]
    if env.master:
        found = [(step_number(p), -tier, p) for tier, folder in enumerate(folders) for p in checkpoints(folder)]
        for *_, path in sorted(found, key=lambda f: f[:2], reverse=True):
            reason = verify_checkpoint(path)
            if reason is None:
                choice[0] = path
                break
            choice[1].append((path, reason))
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None and choice[1]:
        raise SystemExit(f"resume: no checkpoint in {' or '.join(map(str, folders))} verifies:\n"
                         + "".join(f"  {p}: {why}\n" for p, why in choice[1])
                         + "move them away to start from scratch, or point init_from at a good one")
    for bad, why in choice[1]:
        print0(env, f"resume: skipping {bad}: {why}")
        if env.master:
            storage.write_text(storage.join(bad, CORRUPT), json.dumps({"reason": why, "time": time.time()}))
    if dist.is_initialized():
        dist.barrier()
    return choice[0]


def prune_checkpoints(out, newest, keep_last):
    """Keep the keep_last newest checkpoints up to `newest` (just written and verified); never touch a newer one."""
    upto = [p for p in checkpoints(out) if step_number(p) <= step_number(newest)]
    for old in upto[:-keep_last] if keep_last > 0 else []:
        remove_step(old)


def step_number(path):
    return int(storage.name(path)[5:])


# -----------------------------------------------------------------------------
# the state: each rank's (host's) own shards, by DCP key


def train_state(model, raw, optimizer, env, value=None):
    """({model.NAME / optim.state.NAME.FIELD: tensor}, param groups with parameter names). The tensors are the live
    ones (FSDP2 DTensors hold this rank's shards; under SPMD, sharded XLA tensors), so DCP can load into them.
    value: PPO's value model (as the step runs it, unwrapped), trained by the same optimizer: its weights are
    value.NAME, its parameters value.NAME in the optimizer's state and groups (a step directory still loads as the
    policy: model_files.load_model reads model.* only)."""
    if env.kind == "xla":
        parts = {"": raw} | ({VALUE: value[1]} if value else {})
        names = {p: prefix + n for prefix, m in parts.items() for n, p in m.named_parameters()}
        weights = {prefix + k: v for prefix, m in parts.items() for k, v in m.state_dict().items()}
        state = {names[p]: s for p, s in optimizer.state.items()}
        groups = [g | {"params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        from torch.distributed.fsdp import FSDPModule

        trained = trained_modules(model, value)
        for m in trained.modules():  # a forward without backward (an evaluation) leaves FSDP2's root gathered: its
            if isinstance(m, FSDPModule):  # full tensors are then registered, which the optimizer does not hold
                m.reshard()
        osd = get_optimizer_state_dict(trained, optimizer)  # creates the moments of a fresh optimizer (for a load)
        weights, state, groups = get_model_state_dict(trained), osd["state"], osd["param_groups"]
        if value:
            weights, state = ({k.removeprefix(POLICY): v for k, v in d.items()} for d in (weights, state))
            groups = [g | {"params": [n.removeprefix(POLICY) for n in g["params"]]} for g in groups]
    untied = lambda k: not ((raw if not k.startswith(VALUE) else value[1]).cfg.llm.tie_embeddings  # noqa: E731
                            and k.removeprefix(VALUE) == "llm.output.weight")
    tensors = {(k if k.startswith(VALUE) else f"model.{k}"): v.detach() for k, v in weights.items() if untied(k)}
    tensors |= {f"optim.state.{name}.{k}": v for name, s in state.items() for k, v in s.items()}
    return tensors, [json.loads(json.dumps(g)) for g in groups]  # tuples to lists, as JSON holds them


POLICY, VALUE = "policy.", "value."  # the trained modules' names when PPO's value model trains beside the policy
VALUE_CONFIG = "value_config.json"  # PPO's value model's VLMConfig, beside the policy's config.json


def trained_modules(model, value):
    """The module whose parameters the optimizer holds, for torch's state-dict functions: the policy, or the policy
    and PPO's value model side by side."""
    return model if value is None else torch.nn.ModuleDict({POLICY[:-1]: model, VALUE[:-1]: value[0]})


@contextlib.contextmanager
def quiet():
    """Without DCP's warnings that say nothing to a user: 'torch.distributed is disabled ... assuming ... a single
    process' (it is one) and TypedStorage's deprecation inside its own writer."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(torch.distributed is disabled|TypedStorage is deprecated|"
                                                  "non-tuple sequence).*")
        yield


def planners(env):
    """(save planner, load planner): torch_xla's SPMD ones on XLA, with its save planner's data loss fixed. New ones
    for every save and load: torch_xla's save planner remembers the shards it has written."""
    if env.kind != "xla":
        return None, None
    import dataclasses

    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

    class ReplicaSafeSavePlanner(SPMDSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):  # torch 2.9's signature
            super().set_up_planner(state_dict, is_coordinator)

        # torch_xla 2.9 deletes every copy of a shard that several local devices hold (its dedup compares only fqn
        # and offset, then drops them all): keep the first local one of each
        def create_local_plan(self):
            plan, seen, items = super().create_local_plan(), set(), []
            for item in plan.items:
                key = (item.index.fqn, tuple(item.index.offset or ()))
                if key not in seen:
                    seen.add(key)
                    items.append(item)
            return dataclasses.replace(plan, items=items)

    return ReplicaSafeSavePlanner(), SPMDLoadPlanner()


def tokenizer_files(tokenizer):
    """{name in a step: its source} of a run's tokenizer, as chat.Tokenizer reads it: the tokenizer file (the one
    named, or in the folder named) and the tokenizer_config.json beside it (sentencepiece's legacy flag, the special
    tokens), so that sample.py and convert.py read a step's tokenizer as its training did. {} for none there."""
    try:
        source = tokenizer_file(tokenizer)
    except FileNotFoundError:
        return {}
    config = storage.join(storage.parent(source), "tokenizer_config.json")
    return {"tokenizer.model" if storage.name(source).endswith(".model") else "tokenizer.json": source} | \
        ({"tokenizer_config.json": config} if storage.exists(config) else {})


# -----------------------------------------------------------------------------
# loading: into this run's own (sharded) tensors, whatever world size or backend wrote the checkpoint


def load_checkpoint(path, model, raw, optimizer, loader, env, allow_new_data=False, value=None):
    """Load step `path` into this run's own (sharded) tensors, optimizer, RNG and loader position; returns its
    iteration. allow_new_data: a data_dir change allowed on resume (Loader.load_state_dict). value: PPO's value
    model, as for Checkpointer.save."""
    state = read_json(storage.join(path, "state.json"))
    tensors, groups = train_state(model, raw, optimizer, env, value)
    have = saved_tensors(path)
    missing = sorted(set(tensors) - set(have))
    extra = sorted(k for k in set(have) - set(tensors) if k.startswith(("model.", VALUE, "optim.state.")))
    wrong = [k for k in tensors if k in have and tuple(have[k].size) != tuple(tensors[k].shape)]
    if missing or extra or wrong or len(state["param_groups"]) != len(groups):
        raise SystemExit(f"{path}: does not fit this run (another model, stage or lora setting): "
                         f"{len(missing)} tensors missing ({', '.join(missing[:3])}), {len(extra)} not in this run "
                         f"({', '.join(extra[:3])}), {len(wrong)} of another shape ({', '.join(wrong[:3])}); "
                         f"{len(state['param_groups'])} optimizer groups saved, {len(groups)} now")
    # on a CPU group (env.cpu_group), as the writer's collectives: DCP's plans are gathered as objects
    with quiet():  # 'torch.distributed is disabled' on every single-process resume
        dcp.load(tensors, storage_reader=dcp_reader(path), planner=planners(env)[1], process_group=env.cpu_group)
    weights = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    value_weights = {k.removeprefix(VALUE): v for k, v in tensors.items() if k.startswith(VALUE)}
    moments = {}
    for key, v in tensors.items():
        if key.startswith("optim.state."):
            name, field = key[12:].rsplit(".", 1)
            moments.setdefault(name, {})[field] = v
    for g, saved in zip(groups, state["param_groups"]):  # hyperparameters as saved; lr follows the schedule
        g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()
                  if k not in ("params", "lr", "foreach", "fused", "capturable", "differentiable")})
    if env.kind == "xla":
        raw.load_state_dict(weights, strict=not raw.cfg.llm.tie_embeddings)
        params = dict(raw.named_parameters())
        if value:
            value[1].load_state_dict(value_weights, strict=not value[1].cfg.llm.tie_embeddings)
            params |= {VALUE + n: p for n, p in value[1].named_parameters()}
        for name, s in moments.items():
            optimizer.state[params[name]] = s
        for g, saved in zip(optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        tied = raw.cfg.llm.tie_embeddings or (value is not None and value[1].cfg.llm.tie_embeddings)
        if value:  # the names torch's functions give the policy's tensors beside the value model's
            weights = {POLICY + k: v for k, v in weights.items()} | {VALUE + k: v for k, v in value_weights.items()}
            named = lambda n: n if n.startswith(VALUE) else POLICY + n  # noqa: E731
            moments = {named(n): s for n, s in moments.items()}
            groups = [g | {"params": [named(n) for n in g["params"]]} for g in groups]
        trained = trained_modules(model, value)
        set_model_state_dict(trained, weights, options=StateDictOptions(strict=not tied))
        set_optimizer_state_dict(trained, optimizer, {"state": moments, "param_groups": groups})
    rng = load_safetensors(storage.read_bytes(storage.join(path, "rng.safetensors")))
    if f"rank{env.rank}.cpu" in rng:  # a rank the writing run did not have keeps its seeded generator
        torch.set_rng_state(rng[f"rank{env.rank}.cpu"])
        if env.kind == "cuda" and f"rank{env.rank}.cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{env.rank}.cuda"], env.device)
    if state.get("world", env.world) != env.world:
        print0(env, f"resume: {path} was written by {state['world']} rank(s), this run has {env.world}: the "
               f"weights and moments are resharded; the loader continues the same global sample order")
    try:
        loader.load_state_dict(state["loader"], allow_new_data)
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None
    return state["iter"]


# -----------------------------------------------------------------------------
# resuming


def saved_own(path, env):
    """What this rank saved alone (Checkpointer.save's own), or None: none saved, or another world size wrote it."""
    f, world = storage.join(path, f"rank{env.rank}.safetensors"), read_json(storage.join(path, "state.json"))["world"]
    return load_safetensors(storage.read_bytes(f)) if world == env.world and storage.exists(f) else None


# keys whose change on resume would alter the data order, the batches or the model: refused unless listed in
# allow_config_change (the model itself always comes from the checkpoint). Every other key may change: the world
# size and micro_batch_size among them (the global batch and the sample order are what must hold).
FIXED_ON_RESUME = ("seed", "batch_size", "pack", "max_tiles", "seq_len", "data_dir", "tokenizer", "template",
                   "image_mode", "shuffle_block", "group_by_modality_length", "stage", "model",
                   "model_overrides")  # lora: add_lora refuses a change


def same_path(value):
    """A config value as compared on resume: a path or URL however it is typed (trailing slash, the scheme's case,
    ./), also inside a mixture's sources; anything else as it is."""
    if isinstance(value, str) and ("/" in value or storage.is_url(value)):
        return storage.canonical(value)
    if isinstance(value, list):
        return [same_path(v) for v in value]
    if isinstance(value, dict):
        return {k: same_path(v) if k == "path" else v for k, v in value.items()}
    return value


def check_resume_config(path, cfg, env):
    """Say which keys differ from the checkpoint's config; stop if one that may not change did."""
    try:
        state = read_json(storage.join(path, "state.json"))
        saved = state["config"] | {"world": state.get("world", env.world)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{storage.join(path, 'state.json')}: unreadable ({type(e).__name__}: {e})") from None
    now = json.loads(json.dumps(cfg | {"world": env.world}))  # tuples become lists, as in the saved one
    # init_from and resume say how this start was made, not what it trains
    changed = {k: (saved[k], now[k]) for k in now if k in saved and same_path(saved[k]) != same_path(now[k])
               and k not in ("init_from", "resume")}
    refused = [k for k in changed if k in FIXED_ON_RESUME and k not in cfg["allow_config_change"]]
    for k, (a, b) in changed.items():
        verdict = "refused" if k in refused else "allowed by allow_config_change" if k in FIXED_ON_RESUME else "allowed"
        print0(env, f"resume: {k} changed from {a!r} to {b!r} ({verdict})")
    if refused:
        raise SystemExit(f"resume: {path} was trained with other {', '.join(refused)} (see above); these set the "
                         f"data order, the batches or the model. Resume with the same values, list the keys in "
                         f"--allow_config_change=[...] to accept the change, or start a new out_dir")
