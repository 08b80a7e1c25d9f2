#!/usr/bin/env python3
"""A stand-in for srun and scontrol (by the name it is called as) in tests/test_scripts.py.

srun runs its command as the one task of a job step, the way slurmstepd does: in a container of its own (here:
a child subreaper, so every descendant stays ours, even one in a new session), --signal's SIGTERM to EVERY process
of the step (when FAKE_SLURM_SIGNAL_AT_STEP: once OUT_DIR/log.jsonl, a file or an object in a bucket, shows that
step), and SIGKILL to whatever is left when the task exits. FAKE_SLURM_KILL_WORKERS brings the launcher's grace
period forward: once a stop-checkpoint writer runs (a train.py process in a session of its own, forked by a train.py
worker), the workers are SIGKILLed, as torchrun does 30 s after the signal. scontrol answers `show hostnames` and
records `requeue` in FAKE_SLURM_DIR/requeues."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

if os.environ.get("PYTHON") and sys.executable != os.environ["PYTHON"]:  # the job's interpreter: it has s3fs
    os.execve(os.environ["PYTHON"], [os.environ["PYTHON"], *sys.argv], os.environ | {"PYTHON": os.environ["PYTHON"]})
d = Path(os.environ["FAKE_SLURM_DIR"])
name, argv = Path(sys.argv[0]).name, sys.argv[1:]
with open(d / "calls.jsonl", "a") as f:
    f.write(json.dumps([name, *argv]) + "\n")


def descendants(root):
    children = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def train_py(pid):
    """A train.py process (a torchrun worker, its loader worker or its writer), not torchrun itself."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"train.py") for a in argv) and b"torch.distributed.run" not in argv


def parent_and_session(pid):
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    return int(fields[1]), int(fields[3])


def kill_workers_once_a_writer_runs(pids):
    """True once it has SIGKILLed the train.py workers, which it does when one of them has forked its writer."""
    mine = [p for p in pids if train_py(p)]
    writers = [p for p in mine if parent_and_session(p)[1] == p and parent_and_session(p)[0] in mine]
    if not writers:
        return False
    signal_all([p for p in mine if parent_and_session(p)[0] not in mine], signal.SIGKILL)
    return True


def log_text(out):
    if "://" in out:  # a bucket: read as train.py writes it
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import storage

        return storage.read_text(storage.join(out, "log.jsonl")) if storage.exists(storage.join(out, "log.jsonl")) else ""
    log = Path(out, "log.jsonl")
    return log.read_text() if log.exists() else ""


if name == "scontrol":
    if argv[:2] == ["show", "hostnames"]:
        print("127.0.0.1")
    elif argv[:1] == ["requeue"]:
        with open(d / "requeues", "a") as f:
            f.write(argv[1] + "\n")
    sys.exit(0)

# srun [--options] CMD ...
cmd = argv[next(i for i, a in enumerate(argv) if not a.startswith("-")):]
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the step are reparented to us
task = subprocess.Popen(cmd, env=os.environ | {"SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
at_step, out = os.environ.get("FAKE_SLURM_SIGNAL_AT_STEP"), os.environ.get("OUT_DIR", ".")
kill_workers = False
while task.poll() is None:
    if at_step and any(json.loads(e).get("step", 0) >= int(at_step) for e in log_text(out).splitlines()):
        signal_all(descendants(os.getpid()), signal.SIGTERM)
        (d / "signalled").write_text(str(time.time()))
        at_step, kill_workers = None, bool(os.environ.get("FAKE_SLURM_KILL_WORKERS"))
    if kill_workers and kill_workers_once_a_writer_runs(descendants(os.getpid())):
        (d / "workers_killed").write_text(str(time.time()))
        kill_workers = False
    time.sleep(0.05 if "://" not in out else 0.2)
signal_all(descendants(os.getpid()), signal.SIGKILL)  # the step ends with its task
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(task.returncode)
