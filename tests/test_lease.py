"""One writer per out_dir (lease.py), on a local folder and against the S3 and GCS servers: two runs started together,
one trains; a SIGKILLed run's lease goes stale and is taken over, the resume bit for bit; a zombie continued after
its successor took over commits nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, checkpoint_bytes
from test_train import args

import checkpoint
import lease
import storage


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=200, seed=3, val_fraction=0.1)


def start(shapes, out, *extra, env=None):
    cmd = [sys.executable, str(ROOT / "train.py"), *args(shapes, out, "--ckpt_interval=3", "--keep_last=10", *extra)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {}))


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def out_dir(where, s3_bucket_or_none, gcs_bucket_or_none, tmp_path, name):
    return {"local": str(tmp_path / name), "s3": f"{s3_bucket_or_none}/{name}", "gs": f"{gcs_bucket_or_none}/{name}"}[where]


@pytest.fixture(params=["local", "s3", "gs"])
def where(request):
    return request.param


@pytest.fixture
def place(where, request, tmp_path):
    """out_dir maker for the parametrised storage: a local folder, an S3 bucket or a GCS bucket."""
    bucket = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[where]) if where != "local" else None
    return lambda name: str(tmp_path / name) if where == "local" else f"{bucket}/{name}"


def committed(out):
    return [storage.name(p) for p in checkpoint.checkpoints(out)]


def wait_for(predicate, proc, timeout=180, what=""):
    t0 = time.time()
    while not predicate():
        if proc.poll() is not None or time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"no {what} (exit {proc.poll()}): {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)


def test_two_runs_started_together_one_trains_the_other_refuses(shapes, place):
    out = place("together")
    procs = [start(shapes, out, "--max_iters=6") for _ in range(2)]
    results = [finish(p) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 1], [r[2][-2000:] for r in results]
    _, _, err = next(r for r in results if r[0] == 1)
    assert err.strip().count("\n") == 0 and ("is in use by run" in err or "was taken at the same moment" in err), err
    assert committed(out) == ["step-000003", "step-000006"]
    assert not storage.exists(storage.join(out, "LEASE.json"))  # the run that trained removed it at the end


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_killed_runs_lease_goes_stale_and_the_resume_is_bit_for_bit(shapes, place, tmp_path):
    out, straight = place("killed"), tmp_path / "straight"
    subprocess.run([sys.executable, str(ROOT / "train.py"), *args(shapes, straight, "--max_iters=9", "--ckpt_interval=3")],
                   check=True, capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    proc = start(shapes, out, "--max_iters=200", "--lease_stale_s=3")
    wait_for(lambda: storage.exists(f"{out}/step-000003/manifest.json"), proc, what="step 3")
    proc.kill()  # as the OOM killer or a lost node does: no stop path, the lease stays
    proc.communicate()
    held = json.loads(storage.read_text(storage.join(out, "LEASE.json")))
    with pytest.raises(SystemExit, match="is in use by run without a run id .* --take_over=True if it is dead"):
        lease.Lease(out, 3).acquire(take_over=False)  # still fresh: a second run is refused
    time.sleep(max(0.0, held["refreshed"] + held["stale_after_s"] - time.time()) + 0.5)
    code, stdout, err = finish(start(shapes, out, "--max_iters=9", "--resume=True"))
    assert code == 0 and "lease: taking over out_dir from run without a run id" in stdout and "stale after" in stdout, \
        err[-2000:]
    final = f"{out}/step-000009"
    local = tmp_path / "copy"
    for name in storage.ls(final):
        storage.write_bytes(local / name, storage.read_bytes(f"{final}/{name}"))
    assert checkpoint_bytes(local, "") == checkpoint_bytes(straight / "step-000009", "")


def test_a_restart_of_the_same_run_takes_its_lease_at_once(shapes, tmp_path):
    """A SLURM job requeued (the same SLURM_JOB_ID) or a pod the babysitter restarts (LLAVAX_RUN_ID) is the same run:
    its predecessor's fresh lease is taken over with no wait and no flag; another job's is not."""
    out = tmp_path / "requeued"
    proc = start(shapes, out, "--max_iters=200", env={"SLURM_JOB_ID": "4242"})
    wait_for(lambda: storage.exists(f"{out}/step-000003/manifest.json"), proc, what="step 3")
    proc.kill()
    proc.communicate()
    code, _, err = finish(start(shapes, out, "--max_iters=6", "--resume=True", env={"SLURM_JOB_ID": "4243"}))
    assert code == 1 and "is in use by run slurm-4242" in err, err
    code, stdout, err = finish(start(shapes, out, "--max_iters=6", "--resume=True", env={"SLURM_JOB_ID": "4242"}))
    assert code == 0 and "taking over out_dir from this run's earlier start" in stdout, err[-2000:]


@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_zombie_continued_after_its_successor_took_over_commits_nothing(shapes, place):
    out = place("zombie")
    zombie = start(shapes, out, "--max_iters=400", "--log_interval=1")
    wait_for(lambda: storage.exists(f"{out}/step-000003/manifest.json"), zombie, what="step 3")
    zombie.send_signal(signal.SIGSTOP)  # a host that hangs (or a VM paused), then comes back
    try:
        code, stdout, err = finish(start(shapes, out, "--max_iters=12", "--resume=True", "--take_over=True"))
        assert code == 0 and "--take_over=True" in stdout, err[-2000:]
        after = {name: storage.read_text(f"{out}/{name}/manifest.json") for name in committed(out)}
        log = storage.read_text(f"{out}/log.jsonl")
    finally:
        zombie.send_signal(signal.SIGCONT)
    code, _, err = finish(zombie)
    assert code == 1 and "out_dir was taken over by" in err and "writes nothing more there" in err, err[-2000:]
    # nothing the successor committed was touched, and nothing was added
    assert {name: storage.read_text(f"{out}/{name}/manifest.json") for name in committed(out)} == after
    assert all(checkpoint.verify_checkpoint(storage.join(out, name)) is None for name in after)
    assert storage.read_text(f"{out}/log.jsonl") == log and "step-000012" in after
    assert storage.exists(f"{out}/DONE")


def test_the_lease_names_its_owner_and_a_bad_one_is_taken(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "LEASE.json").write_text("{not json")
    mine = lease.Lease(str(out), 300)
    mine.acquire(take_over=False)  # an unreadable lease is no one's
    held = json.loads((out / "LEASE.json").read_text())
    assert held["token"] == mine.token and held["pid"] == os.getpid() and held["stale_after_s"] == 300
    other = lease.Lease(str(out), 300)
    with pytest.raises(SystemExit, match=r"is in use by run without a run id \(host .*, pid \d+, started .*\), its "
                                         r"lease refreshed \d+ s ago"):
        other.acquire(take_over=False)
    other.acquire(take_over=True)
    assert not mine.refresh() and "run without a run id" in mine.lost  # the first learns it lost it
    mine.release()
    assert Path(out / "LEASE.json").exists()  # not the first's to remove
    other.release()
    assert not Path(out / "LEASE.json").exists()
