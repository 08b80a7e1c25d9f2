"""Checkpoints committed without any rename, the same protocol on a local folder, on a filesystem that cannot rename
folders (a default gcsfuse mount, Mountpoint for S3), and in a bucket (moto's S3 server, fake-gcs-server): the
manifest, written last, is the commit; a step without one is never taken; a damaged step is marked, not renamed;
a run resumed from a bucket ends bit for bit where a local run does."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import forkserver
import pytest
from conftest import ROOT, checkpoint_bytes
from shapes import make_shapes
from test_train import args, run

import checkpoint
import storage
import train


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    make_shapes(out, n=400, seed=0, val_fraction=0.1)
    return out


@pytest.fixture(scope="module")
def local_run(shapes, tmp_path_factory):
    """The reference: 9 steps on a local disk, checkpoints at 3, 6 and 9."""
    out = tmp_path_factory.mktemp("local")
    run(args(shapes, out, "--max_iters=9", "--ckpt_interval=3", "--keep_last=5"))
    return out


def same_state(step, reference, tmp_path):
    """Every weight and moment of step (in a bucket: copied here first, one download a file) equals reference's."""
    if storage.is_url(step):
        local = Path(tempfile.mkdtemp(dir=tmp_path)) / storage.name(step)
        for name in storage.ls(step):
            storage.write_bytes(local / name, storage.read_bytes(storage.join(step, name)))
        step = local
    for prefix in ("model.", "optim."):
        assert checkpoint_bytes(step, prefix) == checkpoint_bytes(reference, prefix), (step, prefix)


def log_losses(text):
    return {e["step"]: e["loss"] for e in map(json.loads, text.splitlines()) if "loss" in e}


NO_FOLDER_RENAMES = """
import os, sys
sys.path.insert(0, {root!r})
def files_only(real):
    def rename(src, dst, *a, **kw):  # a gcsfuse mount without --rename-dir-limit: folders cannot be renamed
        if os.path.isdir(src):
            raise OSError(95, "Operation not supported (folder rename)", str(src))
        return real(src, dst, *a, **kw)
    return rename
os.rename, os.replace = files_only(os.rename), files_only(os.replace)
import train
train.main({argv!r})
"""


def test_checkpoints_commit_and_resume_where_folders_cannot_be_renamed(shapes, local_run, tmp_path):
    for argv in (args(shapes, tmp_path, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5"),
                 args(shapes, tmp_path, "--max_iters=9", "--ckpt_interval=3", "--keep_last=5", "--init_from=resume")):
        r = forkserver.run([sys.executable, "-c", NO_FOLDER_RENAMES.format(root=str(ROOT), argv=argv)],
                           os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {tmp_path / 'step-000006'}" in r.stdout
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000003", "step-000006", "step-000009"]
    same_state(tmp_path / "step-000009", local_run / "step-000009", tmp_path)


def test_resume_falls_back_past_a_bucket_step_missing_a_shard_or_holding_a_truncated_one(shapes, local_run, s3_bucket,
                                                                                         tmp_path, capsys):
    """A run's steps in a bucket, the newest missing its .distcp shard (deleted, or a lifecycle rule took it), the one
    before holding it cut short (a partial upload some tool committed): resume names both and takes the step before."""
    out = f"{s3_bucket}/run"
    for f in sorted(p for p in local_run.rglob("*") if p.is_file()):
        storage.upload(f, f"{out}/{f.relative_to(local_run).as_posix()}")
    storage.rm(f"{out}/step-000009/__0_0.distcp")
    shard = f"{out}/step-000006/__0_0.distcp"
    storage.write_bytes(shard, storage.read_bytes(shard)[:-1000])
    train.main(args(shapes, out, "--max_iters=4", "--ckpt_interval=3", "--keep_last=5", "--init_from=resume"))
    said = capsys.readouterr().out
    assert f"resume: skipping {out}/step-000009: __0_0.distcp is missing" in said
    assert re.search(rf"resume: skipping {out}/step-000006: __0_0.distcp is \d+ bytes, \d+ when written", said)
    assert f"resuming from {out}/step-000003" in said and checkpoint.verify_checkpoint(f"{out}/step-000004") is None


@pytest.mark.slow
def test_resume_from_s3_through_faults_equals_a_local_run(shapes, local_run, s3_bucket, s3_proxy, tmp_path):
    out, bucket = f"{s3_bucket}/runs/a", storage.bucket(s3_bucket)
    s3_proxy.inject(rf"^PUT /{bucket}/runs/a/step-000003/__0_0\.distcp", 503, 2)  # throttled, then reset, mid-save
    s3_proxy.inject(rf"^PUT /{bucket}/runs/a/step-000006/__0_0\.distcp", "reset", 1)
    s3_proxy.inject(rf"^PUT /{bucket}/runs/a/step-000006/manifest\.json", 503, 1)
    s3_proxy.inject(rf"^GET /{bucket}/runs/a/step-000003/", 429, 1)  # read back for its sha256
    run(args(shapes, out, "--max_iters=9", "--ckpt_interval=3", "--keep_last=5"))
    assert s3_proxy.faults == 5
    steps = checkpoint.checkpoints(out)
    assert [storage.name(p) for p in steps] == ["step-000003", "step-000006", "step-000009"]
    assert all(checkpoint.verify_checkpoint(p) is None for p in steps)
    same_state(steps[-1], local_run / "step-000009", tmp_path)

    # step 9's rank died before the commit (no manifest); step 6 rotted in the bucket
    storage.rm(f"{out}/step-000009/manifest.json")
    shard = f"{out}/step-000006/__0_0.distcp"
    data = bytearray(storage.read_bytes(shard))
    data[len(data) // 2] ^= 1
    storage.write_bytes(shard, bytes(data))
    r = run(args(shapes, out, "--max_iters=9", "--ckpt_interval=3", "--keep_last=5", "--init_from=resume"))
    assert f"removing {out}/step-000009: its write did not finish" in r.stdout
    assert f"skipping {out}/step-000006: __0_0.distcp differs from its sha256" in r.stdout
    assert f"resuming from {out}/step-000003" in r.stdout
    # written again over the marked step 6 and the removed step 9: bit for bit the local run's
    assert not storage.exists(f"{out}/step-000006/CORRUPT")
    same_state(f"{out}/step-000009", local_run / "step-000009", tmp_path)
    # the log in the bucket, uploaded whole at each event: steps 4-9 twice, the second time as the local run had them
    assert log_losses(storage.read_text(f"{out}/log.jsonl")) == log_losses((local_run / "log.jsonl").read_text())
    assert json.loads(storage.read_text(f"{out}/DONE")) == {"step": 9}


@pytest.mark.slow
def test_a_writer_killed_mid_upload_leaves_no_step_that_resume_takes(shapes, local_run, s3_bucket, s3_proxy, tmp_path):
    out, bucket = f"{s3_bucket}/run", storage.bucket(s3_bucket)
    shard_put = rf"^PUT /{bucket}/run/step-000006/__0_0\.distcp"
    s3_proxy.inject(shard_put, "hold", 1)  # the upload of step 6's shard is in flight when the kill comes
    cmd = [sys.executable, str(ROOT / "train.py"), *args(shapes, out, "--max_iters=9", "--ckpt_interval=3",
                                                         "--keep_last=5")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    t0 = time.time()
    while not any(re.search(shard_put, r) for r in s3_proxy.requests) and proc.poll() is None and time.time() < t0 + 120:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    output = proc.stdout.read()
    proc.wait(timeout=60)
    time.sleep(s3_proxy.hold + 0.5)  # the held request ends: its client is gone, nothing is stored
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000003"], output
    # the kill came before DCP's index and the manifest: whatever shard bytes reached the bucket, no commit did
    assert not storage.exists(f"{out}/step-000006/.metadata") and not storage.exists(f"{out}/step-000006/manifest.json")
    r = run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5", "--init_from=resume"))
    assert f"resuming from {out}/step-000003" in r.stdout
    same_state(f"{out}/step-000006", local_run / "step-000006", tmp_path)


@pytest.mark.slow
def test_resume_from_gcs_equals_a_local_run(shapes, local_run, gcs_bucket, tmp_path):
    out = f"{gcs_bucket}/run"
    run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5"))
    storage.rm(f"{out}/step-000006/manifest.json")  # killed before the commit
    r = run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5", "--init_from=resume"))
    assert f"resuming from {out}/step-000003" in r.stdout
    same_state(f"{out}/step-000006", local_run / "step-000006", tmp_path)
