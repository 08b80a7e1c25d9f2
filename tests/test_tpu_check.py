"""scripts/tpu_check.sh: --dry-run prints its command; --cpu, the dry version on 4 CPU XLA devices, gives a verdict
table in which every check passes (the Pallas kernels skipped with their refusal): the recipes, and DPO, GRPO and PPO
through their OneVision configs, each with its compile count and a resume (make test-full)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, start_in_background, wait_for_background

SCRIPT = ROOT / "scripts/tpu_check.sh"


BACKGROUND_FIXTURE = "verdict"  # the fixture that waits for start_background's job


def start_background(tmp_path_factory):  # at the start of the session (tests/conftest.py)
    out = tmp_path_factory.mktemp("tpu_check")
    start_in_background(__name__, ["bash", SCRIPT, "--cpu", f"--out={out / 'verdict'}"],
                        os.environ | {"PYTHON": sys.executable}, out)


@pytest.fixture(scope="module")
def verdict():
    folder = wait_for_background(__name__, timeout=900)
    table = (folder / "verdict/verdict.md").read_text()
    assert table in (folder / "log.txt").read_text()  # printed too
    return json.loads((folder / "verdict/verdict.json").read_text())


def test_dry_run_prints_the_command_and_runs_nothing(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--cpu", f"--out={tmp_path / 'v'}"], capture_output=True,
                       text=True, env=os.environ | {"PYTHON": "python3"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "PJRT_DEVICE=CPU CPU_NUM_DEVICES=4" in r.stdout and "scripts/tpu_check.py --cpu --out" in r.stdout
    assert not (tmp_path / "v").exists()
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
                       env=os.environ | {"PYTHON": "python3"})
    assert "LIBTPU" not in r.stdout and "scripts/tpu_check.py --out" in r.stdout and "--cpu" not in r.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--tpu=v4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: scripts/tpu_check.sh")


@pytest.mark.full  # make test: the --dry-run above
def test_cpu_verdict_passes_every_check(verdict):
    assert [r for r in verdict if r["verdict"] == "FAIL"] == []
    checks = [r["check"] for r in verdict]
    assert checks.count("recipe step") == checks.count("objective step") == 3
    assert checks.count("compiles after warm-up") == 6 and checks.count("checkpoint") == 4
    objectives = [r["setting"] for r in verdict if r["check"] == "objective step"]
    assert [s.split(" ")[0] for s in objectives] == [f"configs/{o}_onevision.py" for o in ("dpo", "grpo", "ppo")]


@pytest.mark.full  # make test: the --dry-run above
def test_cpu_verdict_compares_blockwise_with_dense_and_refuses_pallas(verdict):
    rows = {r["setting"].split(",")[0]: r for r in verdict if r["check"] == "attention"}
    assert rows["dense"]["verdict"] == rows["blockwise"]["verdict"] == "PASS"
    assert "against dense: loss" in rows["blockwise"]["result"]
    for kind in ("flash", "splash"):
        assert rows[kind]["verdict"] == "SKIP"
        assert rows[kind]["result"].startswith(f"refused: config: attention='{kind}' is torch_xla's Pallas kernel, "
                                               "which runs only on a TPU")
