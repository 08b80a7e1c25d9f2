"""Sharded checkpoints (torch.distributed.checkpoint) under real torchrun: each rank writes its own shards; a
checkpoint resumes on another world size with every weight and moment equal and the global sample order kept;
a rank killed mid-write or a SIGTERM during a background write never costs the previous good checkpoint; a step
directory reads as a model (consolidate, to-hf, init_from)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import ROOT, checkpoint_bytes, checkpoint_tensors
from test_train import args, free_port, losses, run, torchrun_workers

import checkpoint
import checkpoint_writer
import convert
import model_files
from loader import Loader, ShardStream


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=400, seed=0, val_fraction=0.1)


def resumed_unchanged(shapes, src, dst, nproc, *extra):
    """Resume src's newest step N in dst on nproc ranks, skip iteration N (its batch is consumed, nothing trains) and
    checkpoint N+1: the weights and moments it writes are the ones the load produced."""
    step = checkpoint.checkpoints(src)[-1]
    shutil.copytree(step, dst / step.name)
    n = int(step.name[5:])
    r = run(args(shapes, dst, "--init_from=resume", f"--skip_steps=[({n}, {n + 1})]", f"--max_iters={n + 1}",
                 "--keep_last=5", *extra), nproc=nproc)
    return step, dst / f"step-{n + 1:06d}", r


@pytest.fixture(scope="module")
def fsdp2(shapes, tmp_path_factory):
    """FSDP2 on 2 ranks, global batch 12 (6 a rank), checkpoints at steps 5 and 10."""
    out = tmp_path_factory.mktemp("fsdp2")
    run(args(shapes, out, "--max_iters=10", "--ckpt_interval=5", "--keep_last=5", "--parallel=fsdp",
             "--batch_size=12", "--micro_batch_size=6"), nproc=2)
    return out


@pytest.mark.slow
def test_each_rank_writes_its_own_shards_and_the_manifest_lists_them(fsdp2):
    step = fsdp2 / "step-000010"
    files = json.loads((step / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json", "config.json", "rng.safetensors"} <= set(files)
    assert checkpoint.verify_checkpoint(step) is None
    # FSDP2 splits each matrix over the ranks: neither rank's file holds the whole state
    total = sum(t.numel() * t.element_size() for t in checkpoint_tensors(step).values())
    assert max(files["__0_0.distcp"]["size"], files["__1_0.distcp"]["size"]) < 0.75 * total
    state = json.loads((step / "state.json").read_text())
    assert state["world"] == 2 and state["loader"]["global_position"] == 10 * 12


@pytest.mark.slow
@pytest.mark.parametrize("nproc,parallel,micro", [(3, "fsdp", 4), (1, "ddp", 12)])
def test_resharded_resume_loads_every_weight_and_moment_bit_for_bit(shapes, fsdp2, tmp_path, nproc, parallel, micro):
    # 2 -> 3 ranks and 2 -> 1 process: the same global batch (12), another split of it
    saved, written, r = resumed_unchanged(shapes, fsdp2, tmp_path, nproc, f"--parallel={parallel}",
                                          "--batch_size=12", f"--micro_batch_size={micro}")
    assert f"world changed from 2 to {nproc}" in r.stdout and "resharded" in r.stdout, r.stdout
    for prefix in ("model.", "optim."):
        assert checkpoint_bytes(written, prefix) == checkpoint_bytes(saved, prefix), prefix
    state = json.loads((written / "state.json").read_text())
    assert state["world"] == nproc and state["loader"]["global_position"] == 11 * 12


@pytest.mark.slow
@pytest.mark.full
def test_ddp_4_to_2_ranks_continues_the_run(shapes, tmp_path):
    common = ["--parallel=ddp", "--batch_size=8", "--keep_last=5"]
    a, b = tmp_path / "a", tmp_path / "b"
    run(args(shapes, a, "--max_iters=12", "--micro_batch_size=2", *common), nproc=4)
    run(args(shapes, b, "--max_iters=6", "--ckpt_interval=6", "--micro_batch_size=2", *common), nproc=4)
    run(args(shapes, b, "--max_iters=12", "--init_from=resume", "--micro_batch_size=4", *common), nproc=2)
    # the same samples in the same steps: the losses of 4 and 2 ranks differ only by summation order
    ref, got = losses(a), losses(b)
    assert all(abs(got[s] - ref[s]) < 1e-4 for s in range(7, 13)), (got, ref)


def test_the_global_sample_order_survives_a_world_size_change(shapes):
    def stream(rank, world, batch):
        return ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=batch, seq_len=48,
                                image_size=28, image_token_id=512, n_image_tokens=4, rank=rank, world_size=world,
                                shuffle_block=50)

    n = len(stream(0, 1, 4))
    seen, state = [], None
    for world, steps in ((2, 7), (3, 9), (1, 5)):  # global batch 12 throughout: 6 x 2, 4 x 3, 12 x 1
        loaders = [Loader(stream(r, world, 12 // world)) for r in range(world)]
        for loader in loaders:
            if state:
                loader.load_state_dict(state)
            it = iter(loader)
            for _ in range(steps):
                seen += next(it)["sample_id"].tolist()
        state = loaders[0].state_dict()
    # exactly the first 252 samples of the epoch's order, each once, whatever the world size was when
    assert n == 360 and len(seen) == 21 * 12 == len(set(seen))
    assert sorted(seen) == sorted(stream(0, 1, 4).order(0)[: len(seen)].tolist())
    bad = Loader(stream(0, 2, 5))
    with pytest.raises(ValueError, match="whole number of this run's global batches"):
        bad.load_state_dict(state)  # 21 x 12 samples consumed is not a multiple of a global batch of 10


@pytest.mark.slow
def test_a_rank_killed_mid_write_leaves_no_checkpoint_that_is_taken(shapes, tmp_path):
    common = ["--max_iters=10", "--ckpt_interval=5", "--keep_last=5", "--parallel=fsdp", "--micro_batch_size=4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train.py"), *args(shapes, tmp_path, *common)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LLAVAX_TEST_SLOW_CHECKPOINT": "2"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 10: checkpoint"):  # step 5's is committed; step 10's write has begun
            tmp = tmp_path / "step-000010"
            while not list(tmp.glob("__*_0.distcp")):  # shards on disk, not yet committed (the disk is slow)
                time.sleep(0.02)
            os.kill(max(torchrun_workers(proc.pid)), signal.SIGKILL)  # one rank, as the OOM killer does it
            break
    rest = proc.stdout.read()
    proc.wait(timeout=120)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000005"], "".join(lines) + rest
    assert not (tmp_path / "step-000010/manifest.json").exists()  # the half-written one, never committed
    r = run(args(shapes, tmp_path, "--init_from=resume", *common[1:], "--max_iters=7"), nproc=2)
    assert f"resuming from {tmp_path / 'step-000005'}" in r.stdout
    assert not (tmp_path / "step-000010").exists()


def test_sigterm_during_a_background_write_commits_it_then_the_stop_checkpoint(shapes, single_run_10, tmp_path):
    common = ["--ckpt_interval=4", "--keep_last=5"]
    cmd = [sys.executable, str(ROOT / "train.py"), *args(shapes, tmp_path, "--max_iters=10", *common)]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LLAVAX_TEST_SLOW_CHECKPOINT": "2"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step 4: checkpoint"):  # the write sleeps 2 s in the background: signal it now
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, rest
    found = [p.name for p in checkpoint.checkpoints(tmp_path)]
    assert found[0] == "step-000004" and len(found) == 2, (found, rest)
    assert all(checkpoint.verify_checkpoint(p) is None for p in checkpoint.checkpoints(tmp_path))
    run(args(shapes, tmp_path, "--max_iters=10", "--init_from=resume", *common))
    assert checkpoint_bytes(tmp_path / "step-000010") == checkpoint_bytes(single_run_10 / "step-000010")


def test_the_stop_checkpoint_outlives_the_sigkill_that_follows_the_signal(shapes, single_run_10, tmp_path):
    """SIGTERM, then SIGKILL to the process while its stop checkpoint is written (torchrun's and SLURM's kill after
    their grace period, brought forward; a slow disk: 3 s a write): the writer, in a session of its own, commits the
    step, and the resume ends with the uninterrupted run's weights bit for bit. (make test-full: the same under torchrun
    and through scripts/slurm.sbatch with its requeue.)"""
    common = ["--max_iters=10", "--ckpt_interval=4", "--keep_last=5"]
    proc = forkserver.spawn([sys.executable, str(ROOT / "train.py"), *args(shapes, tmp_path, *common)],
                            os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                          "LLAVAX_TEST_SLOW_CHECKPOINT": "3"})
    said, t0 = Path(proc.job["stdout"]), time.monotonic()
    while "step 2:" not in (said.read_text() if said.exists() else ""):
        assert proc.poll() is None and time.monotonic() - t0 < 120, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    marker = checkpoint_writer.writer_pid_file(tmp_path, 0)
    while not marker.exists():  # the stop's writer is forked
        assert proc.poll() is None and time.monotonic() - t0 < 120, proc.communicate()
        time.sleep(0.02)
    writer = int(marker.read_text())
    assert not checkpoint.checkpoints(tmp_path)  # the kill comes mid-write
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    while os.path.exists(f"/proc/{writer}") and time.monotonic() - t0 < 120:  # it lives on, in its own session
        time.sleep(0.1)
    (step,) = checkpoint.checkpoints(tmp_path)
    assert 2 <= json.loads((step / "state.json").read_text())["iter"] < 10 and checkpoint.verify_checkpoint(step) is None
    r = run(args(shapes, tmp_path, "--init_from=resume", *common))
    assert f"resuming from {step}" in r.stdout
    assert checkpoint_bytes(tmp_path / "step-000010") == checkpoint_bytes(single_run_10 / "step-000010")


@pytest.fixture(scope="module")
def single_run_10(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("single10")
    run(args(shapes, out, "--max_iters=10", "--ckpt_interval=4", "--keep_last=5"))
    return out


def test_a_step_directory_reads_as_a_model_and_consolidates(single_run_10, tmp_path):
    step = single_run_10 / "step-000010"
    r = forkserver.run([sys.executable, str(ROOT / "convert.py"), "consolidate", "--ckpt", str(step), "--out",
                        str(tmp_path / "model")], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert {"model.safetensors", "config.json", "tokenizer.model"} <= {p.name for p in (tmp_path / "model").iterdir()}
    a, b = model_files.load_model(step).state_dict(), model_files.load_model(tmp_path / "model").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved = checkpoint_tensors(step, "model.")
    assert all(torch.equal(a[k[6:]], v) for k, v in saved.items())
    # the HF export streams from the shards and equals the one from the consolidated copy
    convert.llava_to_hf(step, tmp_path / "hf1")
    convert.llava_to_hf(tmp_path / "model", tmp_path / "hf2")
    assert (tmp_path / "hf1/model.safetensors").read_bytes() == (tmp_path / "hf2/model.safetensors").read_bytes()


def test_consolidate_holds_one_tensor_at_a_time(single_run_10, tmp_path, monkeypatch):
    import weakref

    alive, most, read = weakref.WeakSet(), [0], model_files.SavedTensor.detach

    def tracked(self):
        t = read(self)
        alive.add(t)
        most[0] = max(most[0], len(alive))
        return t

    monkeypatch.setattr(model_files.SavedTensor, "detach", tracked)
    convert.main(["consolidate", "--ckpt", str(single_run_10 / "step-000010"), "--out", str(tmp_path / "model")])
    assert most[0] == 1  # each tensor is read, written and dropped before the next
    assert (tmp_path / "model/model.safetensors").exists()
