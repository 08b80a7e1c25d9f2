"""
Writing the training checkpoints (checkpoint.py: the step directory, its verification and loading). The loop blocks
only while this rank's shards are copied to host memory (stage); DCP then writes them in a background thread, each
file hashed on its way out, and rank 0 commits the step with its manifest once every rank is done, under out_dir's
lease (lease.py). A write that fails on its storage is said and tried again at the next save, up to
max_failed_checkpoints in a row. A stop's checkpoint is written by a detached child on every rank, in a session of
its own, so that it outlives the kill that follows the stop signal.
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
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as save_safetensors

import storage
from checkpoint import (CORRUPT, MANIFEST, VALUE_CONFIG, BucketFiles, checkpoints, describe, planners,
                        prune_checkpoints, quiet, remove_step, tokenizer_files, train_state)
from parallel import print0

WRITER_PID = ".stop-writer.pid"  # rank 0's detached stop-checkpoint writer's pid, while it runs (what scripts wait on)


# -----------------------------------------------------------------------------
# the detached stop writers' pid files, which scripts and the next run wait on


def writer_folder(out):
    """Where each rank names its detached stop writer while it runs: out_dir, or for a bucket out_dir a local folder
    named after it (a pid means something only on its host; scripts/slurm.sbatch asks for this folder)."""
    if storage.is_url(out):
        return Path(tempfile.gettempdir(), "llavax", re.sub(r"[^\w.-]+", "_", str(storage.join(out))))
    return Path(out)


def writer_pid_file(out, rank):
    return writer_folder(out) / (WRITER_PID if rank == 0 else f".stop-writer.rank{rank}.pid")


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


# -----------------------------------------------------------------------------
# a step's files, hashed as they are written: the manifest's entries without reading them back


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


# -----------------------------------------------------------------------------
# staging: host copies of this rank's shards


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


class Checkpointer:
    """Writes the training checkpoints of one run (checkpoint.load_checkpoint reads one). At most one write is in
    flight; the next save waits for it. Its collectives run on a gloo group of their own, so a background write never
    meets the training loop's collectives (DCP's async writes need a CPU group)."""

    def __init__(self, env, cfg, lease=None, committed=None):
        self.env, self.cfg, self.thread, self.error, self.buffers = env, cfg, None, None, {}
        # a write that failed on its storage (an outage, a stalled upload): said, not committed, training goes on and
        # the next save tries again; max_failed_checkpoints of them in a row stop the run
        self.failed, self.failed_in_a_row = None, 0
        self.committed = committed  # the newest step this run knows committed (its resume point, then its own): named when
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
