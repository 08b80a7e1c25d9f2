#!/usr/bin/env python3
"""A stand-in for gcloud in tests/test_scripts.py: records its argv and plays back queued-resource states.

FAKE_GCLOUD_DIR holds calls.jsonl (one argv a line), states (one describe answer a line, consumed in
order, the last repeated; MISSING means "does not exist", ERROR a transient failure), copies of scp'd files, and
a count of launches. An ssh that tests for DONE (test -f, or storage.exists in a bucket) succeeds once the training
command has been launched FAKE_DONE_AFTER times, or from the FAKE_DONE_AT_CHECK-th such test on. pgrep for train.py
finds it when FAKE_LIVE_RUN is set.
The first FAKE_SSH_FAILS ssh calls and FAKE_DELETE_FAILS deletes fail as a dropped connection or API error does."""

import json
import os
import shutil
import sys
from pathlib import Path

d = Path(os.environ["FAKE_GCLOUD_DIR"])
argv = sys.argv[1:]
with open(d / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\n")


def fails(kind):
    """True for the first FAKE_<KIND>_FAILS calls of that kind."""
    seen = int((d / kind).read_text()) if (d / kind).exists() else 0
    (d / kind).write_text(str(seen + 1))
    return seen < int(os.environ.get(f"FAKE_{kind.upper()}_FAILS", "0"))


if argv[:3] == ["compute", "tpus", "queued-resources"] and argv[3] == "describe":
    states = (d / "states").read_text().split()
    used = int((d / "describes").read_text()) if (d / "describes").exists() else 0
    (d / "describes").write_text(str(used + 1))
    state = states[min(used, len(states) - 1)]
    if state == "MISSING":
        print("ERROR: (gcloud) NOT_FOUND", file=sys.stderr)
        sys.exit(1)
    if state == "ERROR":
        print("ERROR: (gcloud.compute.tpus.queued-resources.describe) UNAVAILABLE: the service is unavailable",
              file=sys.stderr)
        sys.exit(1)
    print(state)
elif argv[:3] == ["compute", "tpus", "queued-resources"] and argv[3] == "delete" and fails("delete"):
    print("ERROR: (gcloud.compute.tpus.queued-resources.delete) INTERNAL: try again", file=sys.stderr)
    sys.exit(1)
elif argv[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    shutil.copy(argv[4], d / f"scp-{len(list(d.glob('scp-*')))}")
elif argv[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    command = next(a.split("=", 1)[1] for a in argv if a.startswith("--command="))
    if fails("ssh"):
        print("ssh: connect to host 10.0.0.2 port 22: Connection timed out", file=sys.stderr)
        sys.exit(255)
    launches = d / "launches"
    if "nohup" in command:
        launches.write_text(str(int(launches.read_text()) + 1 if launches.exists() else 1))
    if command.endswith("/DONE"):  # test -f, or storage.exists for a bucket
        done_after = int(os.environ.get("FAKE_DONE_AFTER", "1"))
        checks = d / "done_checks"
        checks.write_text(str(int(checks.read_text()) + 1 if checks.exists() else 1))
        at_check = int(os.environ.get("FAKE_DONE_AT_CHECK", "0"))
        sys.exit(0 if (launches.exists() and int(launches.read_text()) >= done_after)
                 or (at_check and int(checks.read_text()) >= at_check) else 1)
    if "pgrep" in command and os.environ.get("FAKE_LIVE_RUN"):
        print("RUNNING")
