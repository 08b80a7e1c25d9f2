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

A look at the lease, then a write, is not enough: a process paused between the two (a host that hangs, a VM paused)
would write once over the run that took out_dir meanwhile. So locally each look and its write happen under a lock
(LEASE.lock beside the lease, flock; the lease's token is the fencing token), and in a bucket the lease is written
only if it is still the version this run wrote last (S3's If-Match on its ETag, GCS's ifGenerationMatch; created with
If-None-Match: * or generation 0). What is written under the lease (a checkpoint's manifest, DONE, the log) is
written locally inside that same lock, after the token's check: nothing comes between (and a process stopped inside
the lock holds the other runs' looks: they wait LOCK_WAIT_S for it, then stop in one sentence). In a bucket it is
written right after a conditional rewrite of the lease, and a pause in the one request between the two can still land
that one write after a successor took over: no object store makes a write to one object conditional on another. So
after a manifest or DONE the lease is looked at again, and if it was taken meanwhile that write is removed if still as
written (what a successor read of it meanwhile stays read: it may as well have landed before the takeover). A server
that ignores or refuses the conditions (a probe at the start tells, said in one line) gets a look, then the
write, as before. Such a server may also write an object in place (s3rver shows a part of the lease being written):
a lease that cannot be read, or is missing, for a moment is looked at again for UNREADABLE_S, and one that stays so is
nobody's takeover (only a readable lease with another token is); this process's own looks and writes take turns.
"""

import contextlib
import fcntl
import json
import os
import signal
import socket
import threading
import time
import uuid
import weakref

import storage

LEASE, LOCK = "LEASE.json", "LEASE.lock"
SETTLE_S = 0.5  # in a bucket, between writing the lease and reading it back: longer than a run takes from read to write
UNREADABLE_S = 5.0  # in a bucket, how long a lease that cannot be read (one being written in place) is looked at again
LOCK_WAIT_S = 60.0  # the most a look at the lease waits for LEASE.lock: one held longer is a process stopped in there
PAUSED = set()  # tests only (pause_for_test): where this process has stopped itself already


class LockHeld(storage.StorageError):
    """LEASE.lock was held by another process for LOCK_WAIT_S."""


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


def pause_for_test(name):
    """Tests only: LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE=NAME stops this process (SIGSTOP, as a host that hangs) once,
    after its look at the lease and before it writes NAME: LEASE.json (a refresh), or manifest.json or DONE (written
    under the lease; in a bucket the stop comes before the lease's conditional rewrite that goes first; with NAME
    after:manifest.json, after that rewrite and before the write; written:manifest.json, once it is written)."""
    if os.environ.get("LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE") == name and name not in PAUSED:
        PAUSED.add(name)
        # to this thread, which then stops before the call returns (and the whole process with it); a stop sent to the
        # process may be taken by its main thread while this one (the checkpoint writer's) runs on into its write
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


# the locks this process holds (their fds): a process forked meanwhile (a stop checkpoint's writer, a loader worker)
# closes its copies at once, or the lock, which belongs to the open file and not to a process, would stay held as
# long as that child lives (nothing here forks while it holds one)
HELD = set()


LEASES = weakref.WeakSet()  # this process's leases: a child forked while a thread took its turn (turn) gets new turns


def forget_locks():
    for fd in HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    HELD.clear()
    for held in LEASES:
        held.turn = threading.Lock()


os.register_at_fork(after_in_child=forget_locks)


@contextlib.contextmanager
def locked(path):
    """An exclusive flock on the file path (made if missing), held inside. Each call opens the file, so the threads of
    one process exclude each other too. A run that releases its lease removes the file, inside the lock: a process
    that was waiting on the removed file locks the new one instead."""
    t0, said = time.monotonic(), False
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        HELD.add(fd)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - t0 > LOCK_WAIT_S:
                        raise LockHeld(f"out_dir's lease lock {path} has been held by another process for "
                                       f"{LOCK_WAIT_S:.0f} s (one stopped while it wrote the lease?): end that "
                                       f"process, then start this run again") from None
                    if not said and time.monotonic() - t0 > 1:
                        print(f"lease: waiting for {path}: another process holds it", flush=True)
                        said = True
                    time.sleep(0.05)
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
        except BaseException:
            unlock(fd)
            raise
        unlock(fd)
    try:
        yield
    finally:
        unlock(fd)


def unlock(fd):
    HELD.discard(fd)
    os.close(fd)


class Lease:
    """The lease of out_dir held by this process (rank 0 only: the others hold none and check nothing)."""

    def __init__(self, out, stale_s):
        self.path, self.lock, self.stale_s = storage.join(out, LEASE), storage.join(out, LOCK), stale_s
        self.token, self.run, self.started = uuid.uuid4().hex, run_id(), time.time()
        self.stale_after, self.lost, self.acquired = stale_s, None, False  # lost: who took it, once we know
        self.left_to_writer = None  # a stop checkpoint's writer (pid) that outlives this process: the lease stays its
        # how a write is fenced (choose()): "lock" (a local folder), "conditional" (a bucket that honours them; version:
        # our last write's, deletes: a conditional delete too) or "read-back" (a look, then the write)
        self.mode, self.version, self.deletes = None, None, False
        self.last_refresh = time.time()
        # the threads of this process (the loop's refresh, the checkpoint writer's commit) take turns at the lease: a
        # look never meets this process's own rewrite (locally LEASE.lock, opened by each, does that already)
        self.turn = threading.Lock()
        LEASES.add(self)

    def choose(self):
        """How this lease's looks and writes are fenced; said in one line when they cannot be."""
        if not storage.is_url(self.path):
            storage.makedirs(storage.parent(self.path))
            try:
                with locked(self.lock):
                    self.mode = "lock"
                    return
            except OSError as e:  # flock refused (a FUSE mount, a file system without locks): look, then write
                if isinstance(e, LockHeld):
                    raise
                reason = f"{self.lock} cannot be locked ({e.strerror or e})"
        else:
            honoured = storage.conditions(storage.parent(self.path))
            self.deletes = "delete" in honoured
            if {"create", "replace"} <= honoured:
                self.mode = "conditional"
                return
            named = "If-None-Match: * and If-Match" if storage.scheme(self.path) == "s3" else "ifGenerationMatch"
            reason = f"{storage.endpoint(self.path)} does not honour {named} on a write"
        self.mode = "read-back"
        print(f"lease: {reason}: the lease is read back before each write instead, and a run paused between that look "
              f"and its write could write once over a run that took out_dir over meanwhile", flush=True)

    def look(self):
        """(the lease as written, its version): None when there is none, {} when it is not one after looks for
        UNREADABLE_S (a local one: 0.2 s, as it may be being created this moment; a bucket's may be being written in
        place). The version, read with the bytes, only in a bucket that honours conditional writes."""
        version, until = None, time.monotonic() + (0.2 if self.mode == "lock" else UNREADABLE_S)
        while True:
            try:
                if self.mode == "conditional":
                    data, version = storage.read_versioned(self.path)
                else:
                    data = storage.read_bytes(self.path)
                held = json.loads(data)
                return (held if isinstance(held, dict) and held else {}), version
            except FileNotFoundError:
                return None, None
            except ValueError:
                if time.monotonic() > until:
                    return {}, version
                time.sleep(0.2)

    def read(self):
        return self.look()[0]

    @contextlib.contextmanager
    def exclusive(self):
        """Locally, LEASE.lock held: no other run's look and write comes between ours. In a bucket, this process's turn
        (its other threads wait)."""
        if self.mode == "lock":
            with locked(self.lock):
                yield
        else:
            with self.turn:
                yield

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
        return {"token": self.token, "run": self.run, "host": socket.gethostname(), "pid": os.getpid(),
                "process_start": process_start(os.getpid()), "started": self.started, "refreshed": time.time(),
                "stale_after_s": self.stale_after}

    def write(self):
        storage.write_text(self.path, json.dumps(self.record()))

    def acquire(self, take_over):
        """Take the lease or stop in one sentence; what was taken over is printed."""
        try:
            if self.mode is None:
                self.choose()
            for _ in range(10):
                with self.exclusive():
                    held, version = self.look()
                    self.decide(held, take_over)
                    if self.take(held, version):
                        break
                # another run wrote between our look and our write (refused by its condition): decide again on it
            else:
                raise SystemExit(f"out_dir {storage.parent(self.path)} is being taken by other runs this moment: give "
                                 f"this run another out_dir")
        except LockHeld as e:
            raise SystemExit(str(e)) from None
        self.acquired, self.last_refresh = True, time.time()
        if not self.held():  # another run started at the same moment, and wrote after us
            raise SystemExit(f"out_dir {storage.parent(self.path)} was taken at the same moment by "
                             f"{describe(self.read() or {}, time.time())}: give this run another out_dir")

    def decide(self, held, take_over):
        """Go on (saying whose lease is taken over), or stop in one sentence while another run holds it."""
        now = time.time()
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

    def take(self, held, version):
        """Write our lease over `held` (as looked at, at `version`): False when another run wrote first."""
        if self.mode == "conditional":
            version = storage.write_if(self.path, json.dumps(self.record()).encode(),
                                       None if held is None else version)
            if version is None:
                return self.ours_after_all()
            self.version = version
            return True
        if held is None and not storage.is_url(self.path):
            return self.create()
        self.write()
        if self.mode == "read-back":
            # no exclusive create in a bucket: a run that looked when we did writes now; and a holder taken over may be
            # between its look and its write (refresh): its write lands after ours, so we write once more
            if storage.is_url(self.path) or held:
                time.sleep(SETTLE_S)
            if held and (back := self.read()) and back.get("token") == held.get("token"):
                self.write()
                time.sleep(SETTLE_S)
        return True

    def held(self):
        """Whether the lease is still ours (a run that lost it records who has it in self.lost)."""
        if self.lost:
            return False
        held = self.read()
        until = time.monotonic() + (0.2 if self.mode == "lock" else UNREADABLE_S)
        while held is None and self.acquired and time.monotonic() < until:  # a rewrite that deletes, then creates
            time.sleep(0.2)
            held = self.read()
        return self.ours(held)

    def ours(self, held):
        """Whether `held`, the lease as read, is ours; if not, who took it goes in self.lost. One that cannot be read
        ({}) is no one's takeover."""
        if held is None and self.acquired:  # removed by a run that took it over and has ended since
            self.lost = "a run that has ended since (out_dir's lease is gone)"
        elif held and held.get("token") != self.token:
            self.lost = describe(held, time.time())
        return not self.lost

    def ours_after_all(self):
        """After a conditional write of the lease was refused: whether the lease is ours all the same (our retry of a
        write that had landed; a stop checkpoint's writer, forked from this run, wrote it since), its version then
        taken as ours."""
        held, version = self.look()
        if held and held.get("token") == self.token:
            self.version = version
            return True
        if self.acquired:
            self.ours(held)
            if held == {}:  # a version not ours, unreadable: another writer's all the same (the condition tells)
                self.lost = "another process, which wrote out_dir's lease unreadable"
        return False

    def rewrite(self, name):
        """Write the lease again if it is still ours: True, else False (self.lost says who took it). name: what the
        test pause names (LEASE.json, or what is written under the lease next)."""
        if self.lost:
            return False
        if self.mode == "conditional":  # the condition is the look: one request, nothing between
            pause_for_test(name)
            version = storage.write_if(self.path, json.dumps(self.record()).encode(), self.version)
            if version is None:
                return self.ours_after_all()
            self.version = version
            return True
        if not self.held():
            return False
        pause_for_test(name)
        self.write()
        return True

    def under(self, name, write, rewrite):
        """write() only while the lease is ours, the lease rewritten first if `rewrite` (always in a bucket that
        honours conditions: the rewrite is the look); False once another run took it (nothing written)."""
        with self.exclusive():
            if rewrite or self.mode == "conditional":
                ours = self.rewrite(name)
            elif ours := self.held():
                pause_for_test(name)
            if ours and write is not None and self.mode == "lock":
                write()  # inside the lock, after the token's check: no other run's takeover comes between
                return True
        if ours and write is not None:
            pause_for_test(f"after:{name}")
            write()
        return ours

    def refresh(self, write=None):
        """Still ours: write it again, stale after max(lease_stale_s, 10 x the time since the last refresh); then
        write() (the log) under it. False once another run took it: nothing written."""
        self.stale_after = max(self.stale_s, 10 * (time.time() - self.last_refresh))
        self.last_refresh = time.time()
        return self.under(LEASE, write, rewrite=True)

    def fenced(self, path, write):
        """write(), which writes path (a checkpoint's manifest, DONE), only while the lease is ours: False if not. In a
        bucket the write follows the lease's look by one request, and may land after a takeover: the lease is looked
        at again once it is written, and if it was taken meanwhile what was written is removed (if still as written).
        What the successor read of it between the two (it may have resumed from it) it keeps: the write may as well
        have landed before the takeover."""
        if not self.under(storage.name(path), write, rewrite=False):
            return False
        if self.mode == "lock":
            return True
        pause_for_test(f"written:{storage.name(path)}")
        try:
            written = storage.read_bytes(path)
            with self.exclusive():
                if self.rewrite(LEASE) if self.mode == "conditional" else self.held():
                    return True
        except storage.StorageError:  # the write landed, then the bucket stopped answering: it stays committed (the
            return True  # loop's next look at the lease stops the run in one sentence naming it)
        with contextlib.suppress(OSError):
            if storage.read_bytes(path) == written:
                storage.rm(path)
                print(f"lease: removed {path}, written as out_dir was taken over by {self.lost}", flush=True)
        return False

    def release(self):
        """Remove the lease if it is ours (a run that ends, stopped or done)."""
        if self.left_to_writer:  # it reads the lease before each file it writes; stale once it is gone too
            return
        try:
            if not self.acquired:
                return
            with self.exclusive():
                if self.mode == "conditional" and self.deletes:  # the condition is the look, as for a write
                    if not storage.rm_if(self.path, self.version) and self.ours_after_all():
                        storage.rm_if(self.path, self.version)
                elif self.held():
                    storage.rm(self.path)
                    if self.mode == "lock":  # inside the lock: a run waiting on it locks a new file (locked())
                        os.unlink(self.lock)
        except (OSError, storage.StorageError) as e:  # the out_dir's bucket is gone too: the lease goes stale
            print(f"lease: could not remove {self.path} ({e}); it goes stale in {self.stale_after:.0f} s", flush=True)
