#!/usr/bin/env python3
"""A stand-in for srun and scontrol (by the name it is called as) in tests/test_scripts.py.

srun runs its command as the one task of a job step, the way slurmstepd does: in a container of its own (here:
a child subreaper, so every descendant stays ours, even one in a new session), --signal's SIGTERM to EVERY process
of the step (when FAKE_SLURM_SIGNAL_AT_STEP: once OUT_DIR/log.jsonl shows that step), and SIGKILL to whatever is
left when the task exits. scontrol answers `show hostnames` and records `requeue` in FAKE_SLURM_DIR/requeues."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
at_step, log = os.environ.get("FAKE_SLURM_SIGNAL_AT_STEP"), Path(os.environ.get("OUT_DIR", ".")) / "log.jsonl"
while task.poll() is None:
    if at_step and log.exists() and any(json.loads(e).get("step", 0) >= int(at_step) for e in log.read_text().splitlines()):
        signal_all(descendants(os.getpid()), signal.SIGTERM)
        (d / "signalled").write_text(str(time.time()))
        at_step = None
    time.sleep(0.05)
signal_all(descendants(os.getpid()), signal.SIGKILL)  # the step ends with its task
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(task.returncode)
