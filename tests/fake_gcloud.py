#!/usr/bin/env python3
"""A stand-in for gcloud in tests/test_scripts.py: records its argv and plays back queued-resource states.

FAKE_GCLOUD_DIR holds calls.jsonl (one argv a line), states (one describe answer a line, consumed in
order, the last repeated; MISSING means "does not exist"), copies of scp'd files, and a count of launches.
An ssh that tests for DONE succeeds once the training command has been launched FAKE_DONE_AFTER times."""

import json
import os
import shutil
import sys
from pathlib import Path

d = Path(os.environ["FAKE_GCLOUD_DIR"])
argv = sys.argv[1:]
with open(d / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\n")
if argv[:3] == ["compute", "tpus", "queued-resources"] and argv[3] == "describe":
    states = (d / "states").read_text().split()
    used = int((d / "describes").read_text()) if (d / "describes").exists() else 0
    (d / "describes").write_text(str(used + 1))
    state = states[min(used, len(states) - 1)]
    if state == "MISSING":
        print("ERROR: (gcloud) NOT_FOUND", file=sys.stderr)
        sys.exit(1)
    print(state)
elif argv[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    shutil.copy(argv[4], d / f"scp-{len(list(d.glob('scp-*')))}")
elif argv[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    command = next(a.split("=", 1)[1] for a in argv if a.startswith("--command="))
    launches = d / "launches"
    if "nohup" in command:
        launches.write_text(str(int(launches.read_text()) + 1 if launches.exists() else 1))
    if command.startswith("test -f") and command.endswith("/DONE"):
        done_after = int(os.environ.get("FAKE_DONE_AFTER", "1"))
        sys.exit(0 if launches.exists() and int(launches.read_text()) >= done_after else 1)
