"""Checkpoints committed without any rename, the same protocol on a local folder, on a filesystem that can neither rename
folders nor append (a default gcsfuse mount, Mountpoint for S3), and in a bucket (moto's S3 server, fake-gcs-server): the
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
from types import SimpleNamespace

import forkserver
import pytest
from conftest import ROOT, checkpoint_bytes, train_on_xla
from shapes import make_shapes
from test_train import args, free_port, run, torchrun_workers

import checkpoint
import pack
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


MOUNT = """
import builtins, io, os, signal, sys
sys.path.insert(0, {root!r})
mount = {mount!r}


def refused(what, path):
    return OSError(95, f"Operation not supported ({{what}})", str(path))


def no_folder_renames(real):  # gcsfuse without --rename-dir-limit, Mountpoint for S3: a folder cannot be renamed
    def rename(src, dst, *a, **kw):
        if os.path.isdir(src):
            raise refused("folder rename", src)
        return real(src, dst, *a, **kw)
    return rename


def no_appends(real):  # Mountpoint for S3: a file cannot be appended to
    def open_(file, mode="r", *a, **kw):
        if "a" in mode and isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(mount):
            raise refused("append", file)
        return real(file, mode, *a, **kw)
    return open_


def no_renames(real):  # Mountpoint for S3 by default: no rename of any kind
    def rename(src, dst, *a, **kw):
        if os.path.abspath(src).startswith(mount) or os.path.abspath(dst).startswith(mount):
            raise refused("rename", src)
        return real(src, dst, *a, **kw)
    return rename


def no_overwrites(real):  # Mountpoint for S3 by default: an existing file cannot be opened for writing
    def open_(file, mode="r", *a, **kw):
        under = isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(mount)
        if under and any(m in mode for m in "wa+") and os.path.exists(file):
            raise refused("overwrite", file)
        return real(file, mode, *a, **kw)
    return open_


if {strict}:
    os.rename, os.replace = no_renames(os.rename), no_renames(os.replace)
    builtins.open = io.open = no_overwrites(no_appends(io.open))
else:
    os.rename, os.replace = no_folder_renames(os.rename), no_folder_renames(os.replace)
    builtins.open = io.open = no_appends(io.open)
import train
if {stop_at}:  # SIGTERM to the whole process group once step N is logged, as a scheduler delivers it
    os.setsid()
    log_progress = train.log_progress
    def signalling(meter, it, *a):
        log_progress(meter, it, *a)
        if it == {stop_at}:
            os.killpg(0, signal.SIGTERM)
    train.log_progress = signalling
train.main({argv!r})
"""


def on_mount(argv, mount, stop_at=0, strict=False):
    """train.main(argv) where `mount` behaves as a bucket mounted with gcsfuse or Mountpoint for S3 does: no folder
    renames, no appends under it; strict: no rename at all and no overwrite of an existing file either (Mountpoint for
    S3's defaults)."""
    script = MOUNT.format(root=str(ROOT), mount=str(mount), argv=argv, stop_at=stop_at, strict=strict)
    r = forkserver.run([sys.executable, "-c", script], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.mark.parametrize("strict", [pytest.param(False, marks=pytest.mark.full), True],  # mountpoint_s3 refuses more
                         ids=["no_folder_renames", "mountpoint_s3"])
def test_a_run_on_a_mount_without_appends_or_folder_renames(shapes, local_run, tmp_path, strict):
    # stopped by SIGTERM at step 7: the detached writer (its pid file on the mount) commits step 7, then prunes
    common = ["--max_iters=9", "--ckpt_interval=3", "--keep_last=2"]
    r = on_mount(args(shapes, tmp_path, *common), tmp_path, stop_at=7, strict=strict)
    assert ("refuses renames and overwrites" in r.stdout) == strict, r.stdout[-2000:]
    assert "stopped at step 7 by a signal" in r.stdout, r.stdout[-2000:]
    stop = tmp_path / "step-000007"
    assert checkpoint.verify_checkpoint(stop) is None and not list(tmp_path.glob(".stop-writer*"))
    shard = stop / "__0_0.distcp"  # then it rots on the mount
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    # resumed: step 7 marked CORRUPT (a new file, no rename), step 6 taken, 9 written, 3 pruned, DONE
    r = on_mount(args(shapes, tmp_path, *common, "--init_from=resume"), tmp_path, strict=strict)
    assert f"skipping {stop}: __0_0.distcp differs from its sha256" in r.stdout
    assert f"resuming from {tmp_path / 'step-000006'}" in r.stdout
    assert "sha256" in json.loads((stop / "CORRUPT").read_text())["reason"]
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000006", "step-000009"]
    assert not (tmp_path / "step-000003").exists() and json.loads((tmp_path / "DONE").read_text()) == {"step": 9}
    same_state(tmp_path / "step-000009", local_run / "step-000009", tmp_path)
    # the log, never appended to here: the whole run's losses, as the uninterrupted local run logged them
    assert log_losses((tmp_path / "log.jsonl").read_text()) == log_losses((local_run / "log.jsonl").read_text())
    assert not list(tmp_path.glob(".*.tmp-*"))  # no temporary file left behind by a write


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


@pytest.mark.full  # make test: tests/test_checkpoint.py kills a rank mid-write on a folder
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


@pytest.mark.full  # make test: tests/test_xla.py moves steps between XLA and FSDP2 on a folder
def test_xla_and_fsdp2_share_a_bucket_and_resume_on_other_world_sizes(shapes, s3_bucket, s3_proxy, tmp_path):
    out, bucket = f"{s3_bucket}/run", storage.bucket(s3_bucket)
    # a mixture of two sources (the dataset's first 60% at weight 2, its last 40% at weight 1): its order resumes too
    mix = [{"path": str(shapes / "shards"), "weight": 2, "take": "first:60%", "name": "head"},
           {"path": str(shapes / "shards"), "weight": 1, "take": "end:40%", "name": "tail"}]
    common = ["--ckpt_interval=3", "--keep_last=5", f"--data_dir={mix!r}"]
    # XLA SPMD on 4 CPU devices (one host) writes step 3 to the bucket
    train_on_xla(args(shapes, out, "--max_iters=3", *common))
    # FSDP2 on 2 ranks resumes it there; a rank is SIGKILLed while step 6's shards upload (as the OOM killer does)
    shard_put = rf"^PUT /{bucket}/run/step-000006/__\d_0\.distcp"
    s3_proxy.inject(shard_put, "hold", 2)
    s3_proxy.hold = 2.0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train.py"),
           *args(shapes, out, "--max_iters=6", "--init_from=resume", "--parallel=fsdp", "--micro_batch_size=4", *common)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    t0 = time.time()
    while not any(re.search(shard_put, r) for r in s3_proxy.requests) and proc.poll() is None and time.time() < t0 + 180:
        time.sleep(0.05)
    os.kill(max(torchrun_workers(proc.pid)), signal.SIGKILL)
    output = proc.stdout.read()
    proc.wait(timeout=120)
    time.sleep(s3_proxy.hold + 0.5)  # the held uploads end: a killed client's stores nothing
    assert "world changed from 1 to 2" in output, output[-3000:]
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000003"], output[-3000:]
    assert not storage.exists(f"{out}/step-000006/.metadata") and not storage.exists(f"{out}/step-000006/manifest.json")
    fsdp2 = log_losses(storage.read_text(f"{out}/log.jsonl"))  # 1-3 by XLA, 4-6 by FSDP2 before the kill
    # one process resumes XLA's step 3 from the bucket, and the same step copied to a local folder: bit for bit
    local = tmp_path / "local"
    for name in storage.ls(f"{out}/step-000003"):
        storage.write_bytes(local / "step-000003" / name, storage.read_bytes(f"{out}/step-000003/{name}"))
    r = run(args(shapes, out, "--max_iters=6", "--init_from=resume", *common))
    assert f"removing {out}/step-000006: its write did not finish" in r.stdout
    assert f"resuming from {out}/step-000003" in r.stdout
    run(args(shapes, local, "--max_iters=6", "--init_from=resume", *common))
    resumed, reference = log_losses(storage.read_text(f"{out}/log.jsonl")), log_losses((local / "log.jsonl").read_text())
    assert sorted(reference) == [4, 5, 6] and all(resumed[s] == reference[s] for s in reference), (resumed, reference)
    same_state(f"{out}/step-000006", local / "step-000006", tmp_path)
    # and FSDP2 had loaded what XLA wrote: its steps 4-6 agree with one process's up to the order of summation
    assert all(abs(fsdp2[s] - reference[s]) <= 1e-4 * abs(reference[s]) for s in reference), (fsdp2, reference)
    counts = [{k: v for k, v in json.loads(line).items() if k.startswith(("samples/", "tokens/"))}
              for text in (storage.read_text(f"{out}/log.jsonl"), (local / "log.jsonl").read_text())
              for line in text.splitlines() if '"step": 6,' in line and "samples/head" in line]
    assert len(counts) >= 3 and all(c == counts[-1] for c in counts), counts  # XLA -> FSDP2, -> bucket, -> local
    assert counts[-1]["samples/head"] + counts[-1]["samples/tail"] == 6 * 8, counts


def flip_a_bit(path):
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 1
    storage.write_bytes(path, bytes(data))


KILLED_AT_COMMIT = """
import os, signal, sys
sys.path.insert(0, {root!r})
import checkpoint_writer, train
real = checkpoint_writer.write_manifest
def dying(path, files=None):  # every shard of step {step} is in the bucket; the manifest, the commit, is next
    if str(path).endswith("step-{step:06d}"):
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, files)
checkpoint_writer.write_manifest = dying
train.main({argv!r})
"""


def test_resume_takes_the_newest_verified_step_of_either_tier(shapes, local_run, s3_bucket, tmp_path):
    # every 3rd step to the bucket, every 2nd between them to this host's disk; killed while step 9 commits
    out, local = f"{s3_bucket}/run", tmp_path / "local"
    common = ["--max_iters=9", "--ckpt_interval=3", f"--local_ckpt_dir={local}", "--local_ckpt_interval=2",
              "--keep_last=5"]
    script = KILLED_AT_COMMIT.format(root=str(ROOT), step=9, argv=args(shapes, out, *common))
    r = forkserver.run([sys.executable, "-c", script], os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000003", "step-000006"]
    tier = checkpoint.local_tier(local, out)  # this run's folder in local_ckpt_dir
    assert [p.name for p in checkpoint.checkpoints(tier)] == ["step-000002", "step-000004", "step-000008"]
    # resumed: the local step 8 is the newest that verifies; step 9 lands in the bucket as an uninterrupted run has it
    r = run(args(shapes, out, *common, "--init_from=resume"))
    assert f"resuming from {tier / 'step-000008'}" in r.stdout, r.stdout[-3000:]
    same_state(f"{out}/step-000009", local_run / "step-000009", tmp_path)
    assert log_losses(storage.read_text(f"{out}/log.jsonl")) == log_losses((local_run / "log.jsonl").read_text())
    # the bucket's step 9 rots: the newest that verifies is then the local step 8, not the bucket's step 6
    flip_a_bit(f"{out}/step-000009/__0_0.distcp")
    master = SimpleNamespace(master=True)
    assert checkpoint.newest_good_checkpoint([out, tier], master) == tier / "step-000008"
    assert storage.exists(f"{out}/step-000009/CORRUPT")
    # a new run into the bucket prefix that holds this one's checkpoints: one sentence, nothing touched
    before = {p: storage.read_bytes(f"{p}/manifest.json") for p in checkpoint.checkpoints(out)}
    r = run(args(shapes, out, "--max_iters=2"), check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"out_dir {out} already holds checkpoints (step-000003, step-000006): continue that run" in r.stderr
    assert before == {p: storage.read_bytes(f"{p}/manifest.json") for p in checkpoint.checkpoints(out)}


@pytest.mark.full  # make test: the S3 run above
def test_resume_from_gcs_equals_a_local_run(shapes, local_run, gcs_bucket, tmp_path):
    out = f"{gcs_bucket}/run"
    run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5"))
    storage.rm(f"{out}/step-000006/manifest.json")  # killed before the commit
    r = run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5", "--init_from=resume"))
    assert f"resuming from {out}/step-000003" in r.stdout
    same_state(f"{out}/step-000006", local_run / "step-000006", tmp_path)


def test_runs_sharing_a_local_tier_never_take_each_others_steps(shapes, s3_bucket, tmp_path):
    """Run A writes its local tier on this host; run B, another out_dir with the same local_ckpt_dir and --resume=True,
    starts from scratch (A's steps ignored, and said); A resumes from its own steps, none of them touched by B."""
    local, a, b = tmp_path / "scratch", f"{s3_bucket}/runA", f"{s3_bucket}/runB"
    tier = ["--ckpt_interval=0", f"--local_ckpt_dir={local}", "--local_ckpt_interval=2", "--keep_last=5"]
    run(args(shapes, a, "--max_iters=5", *tier))
    mine = checkpoint.local_tier(local, a)
    assert [p.name for p in checkpoint.checkpoints(mine)] == ["step-000002", "step-000004"]
    before = {p.name: (p / "manifest.json").read_bytes() for p in checkpoint.checkpoints(mine)}
    r = run(args(shapes, b, "--max_iters=4", "--lr=5e-4", "--resume=True", *tier))
    assert "resuming from" not in r.stdout and "starting from scratch" in r.stdout, r.stdout[-3000:]
    assert f"local_ckpt_dir: ignoring the steps in {mine}: another run's (out_dir {a})" in r.stdout
    assert {p.name: (p / "manifest.json").read_bytes() for p in checkpoint.checkpoints(mine)} == before
    r = run(args(shapes, a, "--max_iters=6", "--resume=True", *tier))
    assert f"resuming from {a}/step-000005" in r.stdout, r.stdout[-3000:]


def test_resume_takes_urls_and_paths_however_they_are_typed(shapes, s3_bucket, tmp_path):
    """A bucket path typed with a trailing slash, a doubled one or the scheme in capitals names the same prefix: resume
    does not refuse it as a changed data_dir or tokenizer, and reads the same run."""
    pack.pack(shapes / "shapes.json", shapes / "images", f"{s3_bucket}/data", shard_size=150,
              val_ids=lambda i: str(i).startswith("val"))
    storage.upload(shapes / "tokenizer.model", f"{s3_bucket}/tok/tokenizer.model")
    out = f"{s3_bucket}/typed"
    run(args(shapes, out, "--max_iters=3", "--ckpt_interval=3", f"--data_dir={s3_bucket}/data",
             f"--tokenizer={s3_bucket}/tok/tokenizer.model"))
    retyped = s3_bucket.replace("s3://", "S3://")
    r = run(args(shapes, f"{s3_bucket}//typed/", "--max_iters=5", "--ckpt_interval=3", "--resume=True",
                 f"--data_dir={s3_bucket}/data/", f"--tokenizer={retyped}/tok//tokenizer.model"))
    assert f"resuming from {out}/step-000003" in r.stdout and "refused" not in r.stdout, r.stdout[-3000:]
    assert "resume: data_dir changed" not in r.stdout and "resume: tokenizer changed" not in r.stdout


@pytest.mark.full
def test_a_checkpoint_whose_upload_fails_is_skipped_and_the_next_commits(shapes, s3_bucket, s3_proxy, tmp_path):
    """The endpoint answers only 503s to step 3's shard upload, through every retry: step 3 is not committed (said in
    one line, no traceback), training goes on, and step 6 commits once the endpoint answers again; three such
    checkpoints in a row (max_failed_checkpoints) stop the run in one sentence (the next test)."""
    out, bucket = f"{s3_bucket}/fails", storage.bucket(s3_bucket)
    s3_proxy.inject(rf"^PUT /{bucket}/fails/step-000003/__0_0\.distcp", 503, 10**6)
    r = run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5"))
    said = [line for line in r.stderr.splitlines() if "not committed" in line]
    assert len(said) == 1 and f"checkpoint {out}/step-000003 not committed: writing it failed on rank 0" in said[0], \
        r.stderr[-3000:]
    assert "training goes on and the next checkpoint tries again (1 in a row" in said[0] and "Traceback" not in r.stderr
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000006"] and storage.exists(f"{out}/DONE")


@pytest.mark.full
def test_checkpoints_failing_in_a_row_stop_the_run_in_one_sentence(shapes, s3_bucket, s3_proxy):
    bucket = storage.bucket(s3_bucket)
    s3_proxy.inject(rf"^PUT /{bucket}/fails2/step-\d+/__0_0\.distcp", 503, 10**6)
    r = run(args(shapes, f"{s3_bucket}/fails2", "--max_iters=12", "--ckpt_interval=2", "--max_failed_checkpoints=2"),
            check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(f"checkpoint {s3_bucket}/fails2/step-"), \
        r.stderr[-3000:]
    assert "2 checkpoints in a row failed (max_failed_checkpoints=2): stopping" in r.stderr


def test_a_gcs_commit_renames_nothing(shapes, gcs_bucket, gcs_proxy):
    """A GCS server without objects.moveTo (the pure-Python emulator answers 501; gcsfs retried it for 34 s a commit
    and printed two tracebacks): every file of a step is written under its own name, so no rename, no moveTo, no
    copy is ever asked for, and nothing is printed."""
    gcs_proxy.inject(r"moveTo|rewriteTo|copyTo", 501, 10**6)
    out = f"{gcs_bucket}/norename"
    r = run(args(shapes, out, "--max_iters=3", "--ckpt_interval=3"))
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000003"]
    assert checkpoint.verify_checkpoint(f"{out}/step-000003") is None
    assert not [q for q in gcs_proxy.requests if re.search(r"moveTo|rewriteTo|copyTo", q)], gcs_proxy.requests
    assert "Traceback" not in r.stderr and "out of retries" not in r.stderr and gcs_proxy.faults == 0


@pytest.mark.parametrize("service", ["s3", pytest.param("gs", marks=pytest.mark.full)])
def test_a_wedged_upload_is_abandoned_after_storage_stall_s_and_the_next_checkpoint_commits(shapes, service, request):
    """The endpoint takes step 3's shard upload whole, then answers nothing for 90 s (a wedged endpoint): after
    storage_stall_s (2 s) the upload is abandoned, not tried again, and step 3 is never committed (one line, no
    traceback); training goes on, and step 6 commits through the same endpoint. The run never waits out the wedge."""
    proxy = request.getfixturevalue("s3_proxy" if service == "s3" else "gcs_proxy")
    root = request.getfixturevalue("s3_bucket" if service == "s3" else "gcs_bucket")
    out, bucket = f"{root}/wedged", storage.bucket(root)
    proxy.hold = 90.0
    if service == "s3":
        proxy.inject(rf"^PUT /{bucket}/wedged/step-000003/__0_0\.distcp", "wedge", 1)
    else:  # the object's name is in the upload's body
        proxy.inject(rf"^POST /upload/storage/v1/b/{bucket}/o\?", "wedge", 1,
                     body=r'"name": ?"wedged/step-000003/__0_0\.distcp"')
    t0 = time.monotonic()
    r = run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--storage_stall_s=2"))
    assert time.monotonic() - t0 < proxy.hold - 10 and proxy.faults == 1, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "not committed" in line]
    assert len(said) == 1 and f"checkpoint {out}/step-000003 not committed" in said[0], r.stderr[-3000:]
    assert "had no answer for 2 s (storage_stall_s): abandoned" in said[0] and "Traceback" not in r.stderr, said[0]
    assert "the last committed step is none" in said[0]
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000006"]
    assert checkpoint.verify_checkpoint(f"{out}/step-000006") is None and storage.exists(f"{out}/DONE")
