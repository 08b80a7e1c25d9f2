"""
Training checkpoints on torch.distributed.checkpoint (DCP): every rank (torchrun) or host (torch_xla SPMD, through
its SPMD planners) writes only its own shards, in parallel and in the background; the loop blocks only while its
shards are copied to host memory. A step directory holds:

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
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import storage
from chat import tokenizer_file
from model import VLM
from model_config import VLMConfig
from parallel import print0

MANIFEST = "manifest.json"
CORRUPT = "CORRUPT"  # in a step found damaged: the reason; the step is skipped, not renamed
WRITER_PID = ".stop-writer.pid"  # rank 0's detached stop-checkpoint writer's pid, while it runs (what scripts wait on)


def writer_folder(out):
    """Where each rank names its detached stop writer while it runs: out_dir, or for a bucket out_dir a local folder
    named after it (a pid means something only on its host; scripts/slurm.sbatch asks for this folder)."""
    if storage.is_url(out):
        return Path(tempfile.gettempdir(), "llavax", re.sub(r"[^\w.-]+", "_", str(storage.join(out))))
    return Path(out)


def writer_pid_file(out, rank):
    return writer_folder(out) / (WRITER_PID if rank == 0 else f".stop-writer.rank{rank}.pid")


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


def put(path, data):
    """Write the bytes data to path (atomically) and return its manifest entry, hashed from the bytes in hand: nothing
    is read back (from a bucket, downloaded again)."""
    storage.write_bytes(path, data)
    return {storage.name(path): {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def write_manifest(path, files=None):
    """manifest.json, the commit: {name: {size, sha256}} of `files` (default: every file in `path`, read back)."""
    if files is None:
        files = describe([storage.join(path, n) for n in storage.ls(path) if n not in (MANIFEST, CORRUPT)])
    storage.write_text(storage.join(path, MANIFEST), json.dumps({"files": dict(sorted(files.items()))}, indent=2))


class OutDirTaken(OSError):
    """This run's lease on out_dir was taken by another run: it writes nothing more there."""


class HashedStreams:
    """A DCP writer's file system, each file it writes hashed on the way out (`written`: {name: {size, sha256}}), so
    a rank's shards get their manifest entries without being read back. DCP writes a file front to back (write() and
    tell(); torch.save goes through its NoCloseWriter, which only writes), so the running hash is the file's."""

    def __init__(self, fs, in_place=False, guard=None):
        self.fs, self.written, self.guard = fs, {}, guard  # guard(): who took out_dir's lease, if another run did
        # in_place (a bucket, a mount that refuses renames): DCP's index is written under its own name, where DCP
        # writes .metadata.tmp and renames it (a copy and a delete on a bucket, refused by Mountpoint for S3). The
        # manifest written after it stays the commit
        self.in_place, self.redirected = in_place, {}

    def __getattr__(self, name):  # everything but create_stream, rm_file and rename is the file system's own
        return getattr(self.fs, name)

    def rm_file(self, path):
        if str(path) not in self.redirected.values():  # DCP clears the name it is about to rename onto: ours
            self.fs.rm_file(path)

    def check(self):
        """Before each file a zombie (a run continued after its successor took out_dir) would write: stop it."""
        if self.guard is not None and (who := self.guard()):
            raise OutDirTaken(f"out_dir was taken over by {who}")

    def rename(self, src, dst):
        self.check()
        if str(src) not in self.redirected:
            self.fs.rename(src, dst)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            self.check()
        if self.in_place and str(path).endswith(".metadata.tmp"):
            self.redirected[str(path)] = str(path)[: -len(".tmp")]
            path = type(path)(self.redirected[str(path)]) if not isinstance(path, str) else self.redirected[path]
        with self.fs.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashed = HashedStream(stream)
            yield hashed
        self.written[storage.name(path)] = {"size": hashed.size, "sha256": hashed.sha256.hexdigest()}


class HashedStream:
    def __init__(self, stream):
        self.stream, self.sha256, self.size = stream, hashlib.sha256(), 0

    def __getattr__(self, name):  # tell, flush, fileno (fsync), close: the stream's own
        return getattr(self.stream, name)

    def write(self, data):
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.stream.write(data)


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


def dcp_writer(path, guard=None):
    """DCP's writer for a step directory, local or in a bucket, its files hashed as written (HashedStreams)."""
    if storage.is_url(path):
        # not sync_files: on a remote stream it calls os.sync(); an object is durable once its upload completes. Its
        # clients try each request once: Checkpointer.write_shards writes the step again as a whole
        writer = dcp.FileSystemWriter(storage.key(path), single_file_per_rank=True, sync_files=False)
        writer.fs, writer.path = BucketFiles(storage.filesystem(path, one_attempt=True)), storage.key(path)
    else:
        writer = dcp.FileSystemWriter(str(path), sync_files=True, single_file_per_rank=True)
    writer.fs = HashedStreams(writer.fs, in_place=storage.is_url(path) or storage.write_once(path), guard=guard)
    return writer


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


def local_part(t):
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_keys(staged):
    """The keys whose host copies (this rank's shards) hold a value that is not finite."""
    def parts(t):
        return [s.data for s in t.shards] if hasattr(t, "shards") else [local_part(t)]  # XLA's _CpuShards

    return [k for k, t in staged.items()
            if any(p.is_floating_point() and not torch.isfinite(p).all() for p in parts(t))]


def stage(tensors, env, buffers):
    """Host copies of this rank's shards, which the write reads while training goes on. The buffers are kept for
    the next save (pinned on CUDA): copying into allocated, pinned memory is 30x faster than into fresh pages."""
    if env.kind == "xla":
        from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

        device = {k: t for k, t in tensors.items() if t.device.type == "xla"}
        return _sharded_cpu_state_dict(device) | {k: t.clone() for k, t in tensors.items() if k not in device}

    def copy(key, t):
        local = local_part(t)
        host = buffers.get(key)
        if host is None or host.shape != local.shape or host.dtype != local.dtype:
            host = buffers[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
        host.copy_(local, non_blocking=local.is_cuda)
        if hasattr(t, "to_local"):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(host, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        return host

    staged = {k: copy(k, t) for k, t in tensors.items()}
    if env.kind == "cuda":
        torch.cuda.synchronize(env.device)
    return staged


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


# -----------------------------------------------------------------------------
# saving: block while the shards are staged, write in the background, commit when every rank is done


class StalledUpload(OSError):
    """A checkpoint's upload had no answer for storage_stall_s: the step is abandoned, not tried again."""


def first_failure(e):
    """DCP's CheckpointException (a failure per rank, each with its traceback) as its first rank's error; e itself
    otherwise."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def one_line(e):
    """An exception as one short line: DCP's CheckpointException as its first underlying error, anything else as its
    innermost cause with a message. LLAVAX_DEBUG=1 prints the traceback."""
    if isinstance(e, StalledUpload):
        return str(e)
    e = first_failure(e)
    chain = [c for c in storage.causes(e) if str(c).strip()]
    found = chain[-1] if chain else e
    return f"{type(found).__name__}: {' '.join(str(found).split())[:200]}"


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


class Checkpointer:
    """Writes and loads the training checkpoints of one run. At most one write is in flight; the next save waits
    for it. Its collectives run on a gloo group of their own, so a background write never meets the training
    loop's collectives (DCP's async writes need a CPU group)."""

    def __init__(self, env, cfg, lease=None):
        self.env, self.cfg, self.thread, self.error, self.buffers = env, cfg, None, None, {}
        # a write that failed on its storage (an outage, a stalled upload): said, not committed, training goes on and
        # the next save tries again; max_failed_checkpoints of them in a row stop the run
        self.failed, self.failed_in_a_row = None, 0
        self.committed = None  # the newest step this run knows committed (its resume point, then its own): named when
        # a write fails, without asking a storage that may be what failed
        self.lease = lease  # rank 0's: out_dir's lease (lease.py), looked at before a step is written and committed
        self.background_s = 0.0  # the last committed write's time after save() returned: what a run's end waits for
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    def last_committed(self):
        return str(self.committed) if self.committed else "none"

    def wait(self, final=False):
        """Block until the write in flight (if any) is committed. One refused (non-finite values, a lost lease) stops
        the run, named; one whose storage failed is said and skipped, until max_failed_checkpoints in a row. final:
        the run's last write (its last step, or a stop's), which no later checkpoint can make up for: its failure
        stops the run, not marked DONE."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error:
            raise SystemExit(self.error)
        if self.failed and final:
            raise SystemExit(f"{self.failed}; this was the run's last checkpoint, so it is not marked DONE: resume with "
                             f"--resume=True once the storage answers")
        if self.failed:
            failed, self.failed = self.failed, None
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= self.cfg["max_failed_checkpoints"]:
                raise SystemExit(f"{failed}; {self.failed_in_a_row} checkpoints in a row failed "
                                 f"(max_failed_checkpoints={self.cfg['max_failed_checkpoints']}): stopping. Resume with "
                                 f"--resume=True once the storage answers")
            print(f"{failed}; training goes on and the next checkpoint tries again ({self.failed_in_a_row} in a row, "
                  f"max_failed_checkpoints={self.cfg['max_failed_checkpoints']})", file=sys.stderr, flush=True)

    def joined(self):
        """Wait for the write in flight, if any: True once it ended, False if a signal ended the wait (train.py's
        handler raises storage.Interrupted in a wait on storage, storage.waiting)."""
        if self.thread is None:
            return True
        try:
            with storage.waiting():
                self.thread.join()
        except storage.Interrupted:
            return False
        return True

    def poll(self):
        """wait() if the write in flight has ended (the loop calls this every step: a failed write stops the run
        soon, not at the next save)."""
        if self.thread is None or not self.thread.is_alive():
            self.wait()

    def finish(self):
        """On the way out of a run that stops for another reason: let the write in flight commit, or name why not."""
        try:
            self.wait()
        except SystemExit as e:
            print(e, file=sys.stderr, flush=True)

    def save(self, path, model, raw, optimizer, loader, it, stop=False, own=None, value=None, until=None):
        """own: {name: tensor} of this rank alone (GRPO's generation batch in flight), in rank{R}.safetensors. value:
        PPO's value model (as the step runs it, unwrapped), under value.*. until: a stop's deadline (time.monotonic):
        its detached writer is waited for until then. Returns whether this was a stop's checkpoint."""
        env, cfg, buffers = self.env, self.cfg, self.buffers
        if not stop and env.kind != "xla" and env.agree(not self.joined()):
            # a signal came while this save waited for the write in flight (a storage that stalls): this save is the
            # stop's, within storage_stall_s of it, as if the signal had come before the step ended
            stop, until = True, until or time.monotonic() + storage.STALL_S
            print0(env, f"{storage.name(path)}: a signal came while the checkpoint in flight was awaited: this is the "
                        f"stop's checkpoint")
        if stop and env.kind != "xla" and self.thread is not None and self.thread.is_alive():
            # a stop must not wait for a periodic write (it may take longer than the grace period): that write goes
            # on in its thread, or dies with this process, while the stop's own writers, in their own sessions and
            # group, write from fresh host copies (the kept ones are still being read)
            buffers = {}
        else:
            self.wait()
        t0 = time.perf_counter()
        tensors, groups = train_state(model, raw, optimizer, env, value)
        rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state(env.device)} if env.kind == "cuda" else {})
        ranks = [None] * env.world
        if dist.is_initialized():
            dist.all_gather_object(ranks, rng)
        else:
            ranks = [rng]
        staged = stage(tensors, env, buffers)
        blocked = time.perf_counter() - t0
        small = {"state": {"iter": it, "loader": loader.state_dict(), "config": cfg, "world": env.world,
                           "param_groups": groups},
                 "config": raw.cfg.to_dict(), "value_config": value[1].cfg.to_dict() if value else None,
                 "rng": {f"rank{r}.{k}": v for r, s in enumerate(ranks) for k, v in s.items()},
                 "own": {k: v.detach().cpu().contiguous() for k, v in (own or {}).items()}}
        args = (path, staged, small, t0, blocked)
        if stop and env.kind != "xla":
            self.write_detached(args, until)  # outlives the kill that follows the stop signal
        elif stop:  # XLA: the hosts write their parts in parallel, now
            self.write(*args)
        else:
            # a daemon: every way out of the loop waits for it (finish), but a run that must end by a deadline (a
            # signal, a storage that stopped answering) is not held at exit by a write stuck on that storage
            self.thread = threading.Thread(target=self.write, args=args, name=f"checkpoint {storage.name(path)}",
                                           daemon=True)
            self.thread.start()
        return stop

    def write(self, path, staged, small, t0, blocked):
        """DCP writes each rank's shards into the step directory; each rank hashes its own files; rank 0 adds the small
        files and, last, the manifest (the commit), and prunes. Runs in the background thread."""
        env, cfg, name = self.env, self.cfg, storage.name(path)
        try:
            rank = dist.get_rank(self.group) if self.group is not None else 0
            # never write (and so never prune for) a checkpoint of non-finite values: checked here, off the loop's time;
            # nor one of a run whose out_dir another run took over (its step may be the successor's, committed)
            checks = (env.rank, nonfinite_keys(staged), self.lost_lease())
            nonfinite = [checks]
            if self.group is not None:
                nonfinite = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(nonfinite, checks, group=self.group)
            lost = next((who for _, _, who in nonfinite if who), None)
            if lost:
                self.error = (f"step {small['state']['iter']}: not writing {name}: out_dir was taken over by {lost}; "
                              f"this run writes nothing more there")
                return
            bad = [(r, keys) for r, keys, _ in nonfinite if keys]
            if bad:
                found = checkpoints(storage.parent(path))
                self.error = (f"step {small['state']['iter']}: not writing {name}: non-finite values in "
                              f"{bad[0][1][:3]}{' and more' if len(bad[0][1]) > 3 else ''} (rank {bad[0][0]}). The "
                              f"last checkpoint is {found[-1] if found else 'none'}; resume from it with a lower lr")
                return
            writer = self.write_shards(path, staged, rank)
            time.sleep(float(os.environ.get("LLAVAX_TEST_SLOW_CHECKPOINT", "0")))  # tests only: a slow disk
            mine = {n: f for n, f in writer.fs.written.items() if n.endswith(".distcp")}  # this rank's shards
            if small["own"]:
                mine |= put(storage.join(path, f"rank{rank}.safetensors"), save_safetensors(small["own"]))
            every = [None] * (dist.get_world_size(self.group) if self.group is not None else 1)
            if self.group is not None:
                dist.all_gather_object(every, mine, group=self.group)
            else:
                every = [mine]
            if rank == 0 and self.lost_lease():  # taken while the shards were written: never committed
                self.error = (f"step {small['state']['iter']}: {name} not committed: out_dir was taken over by "
                              f"{self.lease.lost} while it was written; this run writes nothing more there")
            elif rank == 0:
                files = {k: v for part in every for k, v in part.items()}
                shards = sum(f["size"] for f in files.values())
                files |= put(storage.join(path, "state.json"), json.dumps(small["state"], indent=2).encode())
                files |= put(storage.join(path, "config.json"), json.dumps(small["config"], indent=2).encode())
                files |= put(storage.join(path, "rng.safetensors"), save_safetensors(small["rng"]))
                if small["value_config"]:
                    files |= put(storage.join(path, VALUE_CONFIG), json.dumps(small["value_config"], indent=2).encode())
                for carried, source in tokenizer_files(cfg["tokenizer"]).items():  # the run's, as chat.Tokenizer reads it
                    files |= put(storage.join(path, carried), storage.read_bytes(source))
                files |= describe([storage.join(path, ".metadata")])  # DCP's index, read back (pickled in its finish())
                if not self.commit(path, files):  # last, the manifest: the commit, only while the lease is ours
                    self.error = (f"step {small['state']['iter']}: {name} not committed: out_dir was taken over by "
                                  f"{self.lease.lost} while it was written; this run writes nothing more there")
                else:
                    try:  # committed: a storage failing now costs only the pruning, which the next commit does again
                        prune_checkpoints(storage.parent(path), path, cfg["keep_last"])
                    except OSError as e:
                        print(f"checkpoint {path}: committed, but removing older steps failed ({one_line(e)}); the "
                              f"next checkpoint tries again", file=sys.stderr, flush=True)
                    print(f"checkpoint {path}: {shards / 2**30:.2f} GiB from {len(every)} rank(s); training blocked "
                          f"{blocked:.2f} s, written in {time.perf_counter() - t0:.2f} s", flush=True)
                    self.background_s = time.perf_counter() - t0 - blocked
            if self.group is not None:
                dist.barrier(group=self.group)  # every rank knows the step is committed before the next save
        except BaseException as e:  # noqa: BLE001  named on the next wait(), in the loop's thread
            if os.environ.get("LLAVAX_DEBUG") == "1":
                traceback.print_exc()
            if self.lease is not None and self.lease.lost:  # a zombie: stopped between two files of its write (the
                # guard read the lease; a storage that failed the write is not asked again here)
                self.error = (f"step {small['state']['iter']}: {name} not committed: out_dir was taken over by "
                              f"{self.lease.lost} while it was written; this run writes nothing more there")
                return
            self.failed = (f"checkpoint {path} not committed: writing it failed on rank {env.rank} ({one_line(e)}); "
                           f"the last committed step is {self.last_committed()}")
        else:
            if not self.error:
                self.failed_in_a_row = 0

    def write_shards(self, path, staged, rank):
        """DCP writes every rank's shards into path, tried again as a whole (every rank: DCP raises the failures it
        gathered on each) while the storage fails transiently (throttled, reset): the clients try each request once.
        An upload that had no answer for storage_stall_s is not tried again: the step is abandoned. Returns the writer."""
        for attempt in range(storage.RETRIES):
            if rank == 0 and storage.exists(path):  # an earlier attempt's, never committed or marked CORRUPT
                remove_step(path)
            if self.group is not None:
                dist.barrier(group=self.group)  # no rank writes before it is gone
            writer = dcp_writer(path, guard=self.lost_lease)
            try:
                with quiet():
                    dcp.save(staged, storage_writer=writer, planner=planners(self.env)[0], process_group=self.group)
                if storage.is_url(path):
                    storage.written(path)
                return writer
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001  (DCP's is a BaseException) sorted by its cause
                cause = first_failure(e)
                if storage.stalled(cause):
                    raise StalledUpload(f"an upload had no answer for {storage.STALL_S:g} s (storage_stall_s): "
                                        f"abandoned") from e
                if attempt + 1 == storage.RETRIES or not storage.transient(cause):
                    raise
                time.sleep(storage.BACKOFF * 2**attempt)
        raise AssertionError("unreachable")

    def lost_lease(self):
        """Who holds out_dir's lease if this run (rank 0) lost it, else None."""
        return None if self.lease is None or self.lease.held() else self.lease.lost

    def commit(self, path, files):
        """The manifest of `files` written while out_dir's lease is this run's (rank 0's; lease.py: locally inside its
        lock, in a bucket right after its conditional rewrite): False, nothing written, once another run took it. The
        step is this run's last committed one as soon as its manifest landed, before the lease's look that follows (a
        bucket that stops answering holds that look for storage_stall_s and more, and a stop's message is due sooner)."""
        before = self.committed

        def write():
            write_manifest(path, files)
            self.committed = path

        if self.lease is None:
            write()
            return True
        if self.lease.fenced(storage.join(path, MANIFEST), write):
            return True
        self.committed = before  # removed again: written after a takeover
        return False

    def write_detached(self, args, until=None):
        """Run write() in a forked child in its own session on every rank, and wait for it while we live. A signalled
        job is killed soon after the signal (torchrun: 30 s, REFERENCES.md 7; SLURM: KillWait); a killpg does not
        reach another session, so the checkpoint is finished from the host copy each fork holds. The children
        cannot use their parents' process groups (the fork does not copy gloo's threads): they meet in a group of
        their own, on a store that rank 0's child serves at a port agreed on before the fork. until: the most we wait
        (a stop must end within storage_stall_s of its signal); a writer still at work then goes on by itself, its pid
        file left for the next run (wait_for_stop_writer), out_dir's lease left to it (its guard reads it)."""
        out, port = storage.parent(args[0]), [0]
        if self.group is not None:
            if self.env.master:
                with socket.socket() as s:
                    s.bind(("", 0))
                    port[0] = s.getsockname()[1]
            dist.broadcast_object_list(port, src=0, group=self.env.cpu_group)  # not self.group: a write may use it
        with warnings.catch_warnings():  # Python 3.12 warns on any fork of a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                torch.set_num_threads(1)  # as DataLoader workers do: a forked child must not reuse the parent's pool
                if self.group is not None:
                    from torch.distributed import distributed_c10d

                    distributed_c10d._world = distributed_c10d._World()  # the parent's groups, dead here: forgotten
                    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), port[0], self.env.world,
                                          is_master=self.env.master, timeout=timedelta(minutes=10))
                    dist.init_process_group("gloo", store=store, rank=self.env.rank, world_size=self.env.world)
                    self.group = dist.group.WORLD
                self.write(*args)
                if self.error or self.failed:
                    print(self.error or self.failed, file=sys.stderr, flush=True)
                code = 1 if self.error or self.failed else 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        marker = writer_pid_file(out, self.env.rank)
        marker.parent.mkdir(parents=True, exist_ok=True)
        storage.write_text(marker, str(pid))
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and (until is None or time.monotonic() < until):
            time.sleep(0.05)
        if done[0] == 0:
            if self.lease is not None:
                self.lease.left_to_writer = pid
            raise SystemExit(f"the stop checkpoint {args[0]} did not commit within storage_stall_s="
                             f"{storage.STALL_S:g} s of the signal: its writer (pid {pid}, in a session of its own) "
                             f"goes on and commits it if the storage answers; the last committed step is "
                             f"{self.last_committed()}: resume with --resume=True")
        status = done[1]
        marker.unlink(missing_ok=True)
        if not status:
            self.committed = args[0]
        if status:
            raise SystemExit(f"the stop checkpoint {args[0]} could not be written (its writer, pid {pid}, rank "
                             f"{self.env.rank}, exited {os.waitstatus_to_exitcode(status)}: its reason above); the last "
                             f"committed step is {self.last_committed()}")

    # -------------------------------------------------------------------------
    # loading: into this run's own (sharded) tensors, whatever world size or backend wrote the checkpoint

    def load(self, path, model, raw, optimizer, loader, value=None):
        env, self.committed = self.env, path
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
        with quiet():  # 'torch.distributed is disabled' on every single-process resume
            dcp.load(tensors, storage_reader=dcp_reader(path), planner=planners(env)[1], process_group=self.group)
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
            loader.load_state_dict(state["loader"], "data_dir" in self.cfg["allow_config_change"])
        except ValueError as e:
            raise SystemExit(f"{path}: {e}") from None
        return state["iter"]


# -----------------------------------------------------------------------------
# resuming


def saved_own(path, env):
    """What this rank saved alone (Checkpointer.save's own), or None: none saved, or another world size wrote it."""
    f, world = storage.join(path, f"rank{env.rank}.safetensors"), read_json(storage.join(path, "state.json"))["world"]
    return load_safetensors(storage.read_bytes(f)) if world == env.world and storage.exists(f) else None


def wait_for_stop_writer(out):
    """A run killed while its detached writers still worked left their pid files: wait for those on this host (a
    writer elsewhere shows as a pid this host does not run) to finish the checkpoint."""
    folder = writer_folder(out)
    for marker in [folder / WRITER_PID, *folder.glob(".stop-writer.rank*.pid")]:
        pid = int(marker.read_text() or 0) if marker.exists() else 0
        while pid and Path(f"/proc/{pid}").exists() and b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
            print(f"waiting for the stop checkpoint writer of the previous run (pid {pid}) to finish", flush=True)
            time.sleep(2)
        marker.unlink(missing_ok=True)
    if storage.is_url(out):  # a bucket's local folder, empty now: not left behind in the temp folder
        with contextlib.suppress(OSError):
            folder.rmdir()


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
