"""
One writer per out_dir: out_dir/LEASE.json names the run that writes there (its host, pid, start time, run id and a
token of this start). Rank 0 takes it before touching out_dir, refreshes it at every log event, looks at it before
every checkpoint write and commit, and removes it when the run ends. A second run on the same out_dir, local or in a
bucket, stops in one sentence while the lease is fresh; a lease not refreshed for its holder's stale_after_s (at
least lease_stale_s, and 10 log intervals) is taken over; so is one whose process is gone (on this host), and one of
the same run id (a SLURM job requeued, a pod
the babysitter restarts: LLAVAX_RUN_ID, else SLURM_JOB_ID); --take_over=True takes it at once. A run whose lease was
taken (a zombie continued after its successor started) commits nothing more and stops. The lease is written whole
(an object appears whole; a local file is replaced atomically) and never renamed by us.
"""

import json
import os
import socket
import time
import uuid

import storage

LEASE = "LEASE.json"
SETTLE_S = 0.5  # in a bucket, between writing the lease and reading it back: longer than a run takes from read to write


def run_id():
    """What names one run across its restarts: LLAVAX_RUN_ID (the TPU babysitter sets it), SLURM's job id (the same
    after a requeue), torchrun's rendezvous id, or its agent (the same across --max-restarts on one node); else None:
    every start is a run of its own."""
    env = os.environ
    if env.get("LLAVAX_RUN_ID"):
        return env["LLAVAX_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    return f"torchrun-{socket.gethostname()}-{os.getppid()}" if "TORCHELASTIC_RESTART_COUNT" in env else None


def describe(held, now):
    return (f"run {held.get('run') or 'without a run id'} (host {held.get('host')}, pid {held.get('pid')}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held.get('started', 0)))}), its lease refreshed "
            f"{now - held.get('refreshed', 0):.0f} s ago")


def process_start(pid):
    """When process pid started (Linux: the start time in /proc/PID/stat, ticks since boot), None if there is no such
    process (or no /proc): with the pid, it names one process, never a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def alive(held):
    """Whether the lease holder's process still runs: True or False on this host, None (unknown) on another."""
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return None
    if os.path.isdir("/proc"):
        start = process_start(held["pid"])
        return start is not None and start == held.get("process_start", start)
    try:
        os.kill(held["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: there
        pass
    return True


class Lease:
    """The lease of out_dir held by this process (rank 0 only: the others hold none and check nothing)."""

    def __init__(self, out, stale_s):
        self.path, self.stale_s = storage.join(out, LEASE), stale_s
        self.token, self.run, self.started = uuid.uuid4().hex, run_id(), time.time()
        self.stale_after, self.lost, self.acquired = stale_s, None, False  # lost: who took it, once we know

    def read(self):
        """The lease as written, None when there is none, {} when it is not one (after a second look: a local lease
        may be being created this moment)."""
        for _ in range(2):
            try:
                held = json.loads(storage.read_text(self.path))
                return held if isinstance(held, dict) and held else {}
            except FileNotFoundError:
                return None
            except ValueError:
                time.sleep(0.2)
        return {}

    def create(self):
        """A local lease where there is none, written only if no other run creates one first (O_EXCL)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.record()))
            f.flush()
            os.fsync(f.fileno())
        return True

    def record(self):
        self.last_write = time.time()
        return {"token": self.token, "run": self.run, "host": socket.gethostname(), "pid": os.getpid(),
                "process_start": process_start(os.getpid()), "started": self.started, "refreshed": self.last_write,
                "stale_after_s": self.stale_after}

    def write(self):
        storage.write_text(self.path, json.dumps(self.record()))

    def acquire(self, take_over):
        """Take the lease or stop in one sentence; what was taken over is printed."""
        held, now = self.read(), time.time()
        if held == {}:
            print(f"lease: {self.path} is not a lease this run can read; taking it", flush=True)
        elif held and held.get("token") != self.token:
            age, stale_after = now - held.get("refreshed", 0), held.get("stale_after_s", self.stale_s)
            if take_over:
                print(f"lease: taking over out_dir from {describe(held, now)} (--take_over=True)", flush=True)
            elif self.run is not None and held.get("run") == self.run:
                print(f"lease: taking over out_dir from this run's earlier start ({describe(held, now)})", flush=True)
            elif alive(held) is False:
                print(f"lease: taking over out_dir from {describe(held, now)}: its process is gone", flush=True)
            elif age > stale_after:
                print(f"lease: taking over out_dir from {describe(held, now)}, stale after {stale_after:.0f} s",
                      flush=True)
            else:
                raise SystemExit(
                    f"out_dir {storage.parent(self.path)} is in use by {describe(held, now)}: wait for it to end, "
                    f"give this run another out_dir, or pass --take_over=True if it is dead (its lease goes stale "
                    f"{stale_after - age:.0f} s from now)")
        if held is None and not storage.is_url(self.path):
            if not self.create():  # another run created one since we looked: decide again on what it wrote
                return self.acquire(take_over)
        else:
            self.write()
            # no exclusive create in a bucket: a run that looked when we did writes now; and a holder taken over may be
            # between its look and its write (refresh): its write lands after ours, so we write once more
            if storage.is_url(self.path) or held:
                time.sleep(SETTLE_S)
            if held and (back := self.read()) and back.get("token") == held.get("token"):
                self.write()
                time.sleep(SETTLE_S)
        self.acquired = True
        if not self.held():  # another run started at the same moment, and wrote after us
            raise SystemExit(f"out_dir {storage.parent(self.path)} was taken at the same moment by "
                             f"{describe(self.read() or {}, time.time())}: give this run another out_dir")

    def held(self):
        """Whether the lease is still ours (a run that lost it records who has it in self.lost)."""
        if self.lost:
            return False
        held = self.read()
        if held is None and self.acquired:  # a refresh on a mount deletes, then creates: look once more
            time.sleep(0.2)
            held = self.read()
        if held is None and self.acquired:  # removed by a run that took it over and has ended since
            self.lost = "a run that has ended since (out_dir's lease is gone)"
        elif held is not None and held.get("token") != self.token:
            self.lost = describe(held, time.time())
        return not self.lost

    def refresh(self):
        """Still ours: write it again, stale after max(lease_stale_s, 10 x the time since the last refresh)."""
        if not self.held():
            return False
        self.stale_after = max(self.stale_s, 10 * (time.time() - self.last_write))
        self.write()
        return True

    def release(self):
        """Remove the lease if it is ours (a run that ends, stopped or done)."""
        try:
            if self.acquired and self.held():
                storage.rm(self.path)
        except (OSError, storage.StorageError) as e:  # the out_dir's bucket is gone too: the lease goes stale
            print(f"lease: could not remove {self.path} ({e}); it goes stale in {self.stale_after:.0f} s", flush=True)
