"""One writer per out_dir (lease.py), on a local folder and against the S3 and GCS servers: two runs started together,
one trains; a SIGKILLed run's lease goes stale and is taken over, the resume bit for bit; a zombie continued after
its successor took over commits nothing, even one stopped between its look at the lease and its write (a lock on a
folder, conditional writes in a bucket: which conditions each server honours)."""

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import buckets
import forkserver
import pytest
from buckets import s3rver_proxy, s3rver_server, unconditional_gcs_proxy, unconditional_s3_proxy  # noqa: F401  fixtures
from conftest import ROOT, checkpoint_bytes
from test_train import args, run

import checkpoint
import lease
import storage


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=200, seed=3, val_fraction=0.1)


def start(shapes, out, *extra, env=None):
    """train.py started in a process forked after the imports (tests/forkserver.py), running while the test goes on."""
    cmd = [sys.executable, str(ROOT / "train.py"), *args(shapes, out, "--ckpt_interval=3", "--keep_last=10", *extra)]
    return forkserver.spawn(cmd, os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {}))


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def out_dir(where, s3_bucket_or_none, gcs_bucket_or_none, tmp_path, name):
    return {"local": str(tmp_path / name), "s3": f"{s3_bucket_or_none}/{name}", "gs": f"{gcs_bucket_or_none}/{name}"}[where]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.full), "gs"])
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


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.full)])
def test_a_killed_runs_lease_is_taken_and_the_resume_is_bit_for_bit(shapes, place, tmp_path):
    """SIGKILLed (the OOM killer, a lost node): no stop path, its lease stays. On this host its process is gone, so a
    resume takes the lease at once; the run ends bit for bit as an uninterrupted one."""
    out, straight = place("killed"), tmp_path / "straight"
    run(args(shapes, straight, "--max_iters=9", "--ckpt_interval=3"))
    proc = start(shapes, out, "--max_iters=200")
    wait_for(lambda: storage.exists(f"{out}/step-000003/manifest.json"), proc, what="step 3")
    proc.kill()
    proc.communicate()
    held = json.loads(storage.read_text(storage.join(out, "LEASE.json")))
    assert held["pid"] == proc.pid and time.time() - held["refreshed"] < held["stale_after_s"]  # fresh, and dead
    code, stdout, err = finish(start(shapes, out, "--max_iters=9", "--resume=True"))
    assert code == 0 and f"pid {proc.pid}, started" in stdout and "its process is gone" in stdout, err[-2000:]
    final = f"{out}/step-000009"
    local = tmp_path / "copy"
    for name in storage.ls(final):
        storage.write_bytes(local / name, storage.read_bytes(f"{final}/{name}"))
    assert checkpoint_bytes(local, "") == checkpoint_bytes(straight / "step-000009", "")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_another_hosts_lease_is_taken_only_once_stale(place):
    """A lease whose holder runs on another host (a pod's or a node's: its process cannot be looked at from here) is
    refused while fresh and taken once not refreshed for its stale_after_s."""
    out = place("elsewhere")
    refreshed = time.time()
    theirs = {"token": "t0", "run": None, "host": "another-host", "pid": 4242, "started": refreshed - 60,
              "refreshed": refreshed, "stale_after_s": 4.0}
    storage.write_text(storage.join(out, "LEASE.json"), json.dumps(theirs))
    # a bucket's first write and read may take a second or two on a loaded machine: the lease is refused while fresh
    with pytest.raises(SystemExit, match=r"is in use by run without a run id \(host another-host, pid 4242, started .*"
                                         r"its lease refreshed [0-4] s ago: .* --take_over=True if it is dead \(its "
                                         r"lease goes stale [0-4] s from now\)"):
        lease.Lease(out, 4.0).acquire(take_over=False)
    assert time.time() - refreshed < 4.0, "too slow to look while the lease was fresh"
    time.sleep(max(0.0, refreshed + 4.5 - time.time()))
    mine = lease.Lease(out, 4.0)
    mine.acquire(take_over=False)
    assert json.loads(storage.read_text(storage.join(out, "LEASE.json")))["token"] == mine.token


def test_a_restart_of_the_same_run_takes_its_lease_at_once(shapes, tmp_path):
    """A SLURM job requeued while its predecessor still runs (the same SLURM_JOB_ID; a pod the babysitter restarts:
    LLAVAX_RUN_ID) is the same run: it takes the fresh lease at once, with no flag, and the predecessor stops without
    committing more. Another job is refused while the holder lives."""
    out = tmp_path / "requeued"
    first = start(shapes, out, "--max_iters=400", "--log_interval=1", env={"SLURM_JOB_ID": "4242"})
    wait_for(lambda: storage.exists(f"{out}/step-000003/manifest.json"), first, what="step 3")
    code, _, err = finish(start(shapes, out, "--max_iters=6", "--resume=True", env={"SLURM_JOB_ID": "4243"}))
    assert code == 1 and "is in use by run slurm-4242" in err, err
    code, stdout, err = finish(start(shapes, out, "--max_iters=6", "--resume=True", env={"SLURM_JOB_ID": "4242"}))
    assert code == 0 and "taking over out_dir from this run's earlier start" in stdout, err[-2000:]
    after = {name: storage.read_text(f"{out}/{name}/manifest.json") for name in committed(out)}
    code, _, err = finish(first)
    assert code == 1 and "out_dir was taken over by" in err, err[-2000:]
    assert {name: storage.read_text(f"{out}/{name}/manifest.json") for name in committed(out)} == after
    assert storage.exists(f"{out}/DONE")


@pytest.mark.parametrize("where", ["local", pytest.param("gs", marks=pytest.mark.full)])
def test_a_zombie_continued_after_its_successor_took_over_commits_nothing(shapes, place, where):
    out = place("zombie")
    zombie = start(shapes, out, "--max_iters=400", "--log_interval=1")
    # paused mid-step, after step 3's checkpoint and step 4's log line. Not right as the manifest appears: the run then
    # logs the checkpoint, and in a bucket a pause between the lease's conditional rewrite and its log upload (one
    # request) lets it replace the successor's log when it comes back (locally the upload is inside LEASE.lock: lease.py)
    wait_for(lambda: storage.exists(f"{out}/step-000003/manifest.json") and storage.exists(f"{out}/log.jsonl")
             and '"step": 4, "loss"' in storage.read_text(f"{out}/log.jsonl"), zombie, what="step 4")
    # a host that hangs (or a VM paused), then comes back; locally not inside LEASE.lock (held here meanwhile), where
    # its successor would wait for it (test_a_run_paused_at_its_commit_commits_nothing_after_its_successor)
    with lease.locked(Path(out, lease.LOCK)) if where == "local" else contextlib.nullcontext():
        zombie.send_signal(signal.SIGSTOP)
        wait_for(lambda: stopped(zombie.pid), zombie, what="the stop")
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


# -----------------------------------------------------------------------------
# a look, then a write: what a process paused between the two may still do (lease.py's lock and conditional writes)

# what each server does with the conditions lease.py writes with (storage.conditions asks them)
HONOURED = {"s3": {"create", "replace", "delete"}, "gs": {"create", "replace"}, "gcp-storage-emulator": set()}


@pytest.mark.parametrize("server", list(HONOURED))
def test_the_conditions_each_server_honours(server, request):
    """moto honours If-None-Match: * and If-Match on a PUT and If-Match on a DELETE; fake-gcs-server ifGenerationMatch
    on an upload but not on a delete; gcp-storage-emulator none (its leases are read back). Where a write is
    conditional, a stale version (a zombie's) is refused and the object left as it was."""
    bucket = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}.get(server, "unconditional_gcs_bucket"))
    assert storage.conditions(f"{bucket}/run") == HONOURED[server]
    assert storage.ls(f"{bucket}/run") == []  # the probe is gone
    if not HONOURED[server]:
        return
    url = f"{bucket}/run/object"
    first = storage.write_if(url, b"one", None)
    assert first is not None and storage.write_if(url, b"two", None) is None
    assert storage.read_versioned(url) == (b"one", first)
    second = storage.write_if(url, b"three", first)
    assert second not in (None, first) and storage.read_versioned(url) == (b"three", second)
    assert storage.write_if(url, b"four", first) is None and storage.read_bytes(url) == b"three"
    if "delete" in HONOURED[server]:
        assert not storage.rm_if(url, first) and storage.read_bytes(url) == b"three"
        assert storage.rm_if(url, second) and not storage.exists(url)
    storage.rm(url)
    assert storage.write_if(url, b"five", second) is None and not storage.exists(url)  # a version of one gone


ZOMBIE = """
import sys
import threading

import lease
import storage

out = sys.argv[1]
mine = lease.Lease(out, 300)
mine.acquire(take_over=False)
manifest = storage.join(out, "manifest.json")
wrote = mine.refresh() and mine.fenced(manifest, lambda: storage.write_text(manifest, mine.token))
print("wrote" if wrote else f"lost to {mine.lost}", flush=True)
"""


def stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def snapshot(out):
    return {name: storage.read_bytes(storage.join(out, name)) for name in storage.ls(out)}


@pytest.mark.parametrize("where", ["local", "s3", "gs"])
@pytest.mark.parametrize("pause", ["LEASE.json", pytest.param("manifest.json", marks=pytest.mark.full)])
def test_a_zombie_paused_between_its_look_and_its_write_writes_nothing_after_its_successor(place, where, pause,
                                                                                         capsys):
    """A process stopped right after its look at the lease (LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE: a host that hangs)
    while a successor takes out_dir over writes nothing once it comes back: neither the lease (a refresh) nor a file
    under it (a manifest). In a bucket its write is refused (If-Match, ifGenerationMatch: the version it wrote is
    gone); locally it stopped inside LEASE.lock, so the successor waits for it, and its write comes before the
    takeover."""
    out = place("paused")
    storage.makedirs(out)
    zombie = forkserver.spawn([sys.executable, "-c", ZOMBIE, out], os.environ | {
        "OMP_NUM_THREADS": "1", "LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE": pause})
    wait_for(lambda: stopped(zombie.pid), zombie, timeout=60, what="pause")
    successor = lease.Lease(out, 300)
    taking = threading.Thread(target=successor.acquire, args=(True,))
    taking.start()
    if where == "local":
        taking.join(timeout=1.5)
        assert taking.is_alive() and "lease: waiting for" in capsys.readouterr().out  # on the paused zombie's lock
        zombie.send_signal(signal.SIGCONT)
    taking.join(timeout=60)
    assert successor.acquired
    taken = snapshot(out)
    zombie.send_signal(signal.SIGCONT)
    code, stdout, err = finish(zombie)
    assert code == 0, err
    assert snapshot(out) == taken and json.loads(taken["LEASE.json"])["token"] == successor.token
    if where != "local":
        assert stdout.startswith("lost to run without a run id") and f"pid {os.getpid()}," in stdout, stdout
        assert "manifest.json" not in taken


@pytest.mark.parametrize("where", [pytest.param("local", marks=pytest.mark.full), "gs"])
def test_a_run_paused_at_its_commit_commits_nothing_after_its_successor(shapes, place, where):
    """train.py stopped right before its first checkpoint's commit (the manifest, written under the lease), while a
    successor takes out_dir over: continued, it commits nothing more. In a bucket the successor trains to the end
    meanwhile and the zombie's commit is refused; locally the zombie stopped inside LEASE.lock, so the successor
    waits, and the commit comes before the takeover (the successor resumes from it)."""
    out = place("paused_commit")
    zombie = start(shapes, out, "--max_iters=400", "--log_interval=1",
                   env={"LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE": "manifest.json"})
    wait_for(lambda: stopped(zombie.pid), zombie, what="the pause at step 3's commit")
    successor = start(shapes, out, "--max_iters=6", "--resume=True", "--take_over=True")
    try:
        if where == "local":
            time.sleep(1.5)
            assert successor.poll() is None  # waits for the lock the zombie holds
            zombie.send_signal(signal.SIGCONT)
        code, stdout, err = finish(successor)
        assert code == 0 and "--take_over=True" in stdout, err[-2000:]
        after = {name: storage.read_text(f"{out}/{name}/manifest.json") for name in committed(out)}
        log = storage.read_text(f"{out}/log.jsonl")
    finally:
        zombie.send_signal(signal.SIGCONT)
    code, _, err = finish(zombie)
    assert code == 1 and "out_dir was taken over by" in err and "writes nothing more there" in err, err[-2000:]
    assert {name: storage.read_text(f"{out}/{name}/manifest.json") for name in committed(out)} == after
    assert all(checkpoint.verify_checkpoint(storage.join(out, name)) is None for name in after)
    assert storage.read_text(f"{out}/log.jsonl") == log and storage.exists(f"{out}/DONE")
    assert ("lease: waiting for" in stdout) == (where == "local") and list(after) == ["step-000003", "step-000006"]


@pytest.mark.full
def test_a_lease_lock_held_by_a_stopped_process_is_said(tmp_path):
    """A process stopped inside LEASE.lock (its write under the lease not done) holds every other run's look: a
    successor stops after LOCK_WAIT_S in one sentence, and the stopped one, continued, still writes (it held the
    lease)."""
    out = str(tmp_path / "held")
    zombie = forkserver.spawn([sys.executable, "-c", ZOMBIE, out], os.environ | {
        "OMP_NUM_THREADS": "1", "LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE": "manifest.json"})
    wait_for(lambda: stopped(zombie.pid), zombie, timeout=60, what="pause")
    wait = lease.LOCK_WAIT_S
    try:
        lease.LOCK_WAIT_S = 1.0
        with pytest.raises(SystemExit, match=r"^out_dir's lease lock .*/held/LEASE.lock has been held by another "
                                             r"process for 1 s \(one stopped while it wrote the lease\?\): end that "
                                             r"process, then start this run again$"):
            lease.Lease(out, 300).acquire(take_over=True)
    finally:
        lease.LOCK_WAIT_S = wait
        zombie.send_signal(signal.SIGCONT)
    code, stdout, err = finish(zombie)
    assert (code, stdout) == (0, "wrote\n"), err


PAUSED_THREAD = """
import sys
import threading
import time

import lease


def commit():  # as the checkpoint writer's thread: the pause, then the write under the lease
    lease.pause_for_test("manifest.json")
    open(sys.argv[1], "w").close()


threading.Thread(target=commit).start()
time.sleep(120)  # the main thread, as the training loop's, is elsewhere
"""


def test_a_pause_stops_the_thread_that_asks_for_it_before_it_goes_on(tmp_path):
    """The pause is asked for by the thread about to write (train.py's manifest: its checkpoint writer's, not the main
    thread): it stops before it writes anything, not only once the stop has reached the other threads."""
    written = tmp_path / "written"
    paused = forkserver.spawn([sys.executable, "-c", PAUSED_THREAD, str(written)], os.environ | {
        "OMP_NUM_THREADS": "1", "LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE": "manifest.json"})
    try:
        wait_for(lambda: stopped(paused.pid), paused, timeout=60, what="pause")
        time.sleep(0.5)
        assert not written.exists()
        paused.send_signal(signal.SIGCONT)
        wait_for(written.exists, paused, timeout=60, what="the write once continued")
    finally:
        paused.kill()
        paused.communicate()


def test_a_child_forked_while_the_lock_is_held_does_not_hold_it(tmp_path):
    """A flock belongs to the open file, which a fork shares: a stop checkpoint's writer or a loader worker forked
    while a thread holds LEASE.lock would hold it for as long as it lives. The child closes its copy."""
    path = tmp_path / lease.LOCK
    with lease.locked(path):
        child = os.fork()
        if child == 0:
            time.sleep(3)
            os._exit(0)
    try:
        t0 = time.monotonic()
        with lease.locked(path):
            assert time.monotonic() - t0 < 0.5  # at once, the child still there
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_server_that_ignores_conditions_gets_the_look_then_write(unconditional_gcs_bucket, capsys):
    """gcp-storage-emulator writes whatever ifGenerationMatch says: said in one line at the start, and the lease is
    read back as before, a second run refused while it is fresh, a run taken over told at its next refresh."""
    out = f"{unconditional_gcs_bucket}/run"
    first = lease.Lease(out, 300)
    first.acquire(take_over=False)
    assert first.mode == "read-back" and first.refresh() and first.refresh()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lease:")]
    assert said == [f"lease: {os.environ['STORAGE_EMULATOR_HOST']} (STORAGE_EMULATOR_HOST) does not honour "
                    f"ifGenerationMatch on a write: the lease is read back before each write instead, and a run paused "
                    f"between that look and its write could write once over a run that took out_dir over meanwhile"]
    with pytest.raises(SystemExit, match="is in use by run without a run id"):
        lease.Lease(out, 300).acquire(take_over=False)
    second = lease.Lease(out, 300)
    second.acquire(take_over=True)
    done = f"{out}/DONE"
    assert not first.refresh() and "run without a run id" in first.lost
    assert not first.fenced(done, lambda: storage.write_text(done, "")) and not storage.exists(done)
    first.release()
    assert json.loads(storage.read_text(f"{out}/LEASE.json"))["token"] == second.token
    second.release()
    assert not storage.exists(f"{out}/LEASE.json")


# servers that ignore the conditions, each behind a proxy that can slow the lease's upload: s3rver (which writes an
# object in place: a part of it shows meanwhile), moto with the conditions stripped, gcp-storage-emulator
UNCONDITIONAL = {"s3rver": ("s3rver_proxy", "s3", (r"^PUT /[^/]+/run/LEASE\.json", None)),
                 "moto": ("unconditional_s3_proxy", "s3", (r"^PUT /[^/]+/run/LEASE\.json", None)),
                 "gcp-storage-emulator": ("unconditional_gcs_proxy", "gs", (r"^POST /upload/", r"run/LEASE\.json"))}


@pytest.mark.parametrize("server", ["s3rver", *(pytest.param(name, marks=pytest.mark.full)  # atomic writers: the
                                                  for name in list(UNCONDITIONAL)[1:])])  # look never sees a part
def test_a_lease_being_rewritten_is_no_takeover(server, request):
    """On a server that ignores conditional writes the lease is read back before each write. A look that meets a
    rewrite of the lease (s3rver: the object half written, for as long as its upload takes) is not a takeover: the
    checkpoint's commit made while the loop refreshes the lease goes on, and another run looking then is refused
    (the lease is fresh). Only a readable lease with another token is a takeover."""
    fixture, kind, upload = UNCONDITIONAL[server]
    proxy = request.getfixturevalue(fixture)
    out = f"{buckets.new_bucket(kind)}/run"
    mine = lease.Lease(out, 300)
    mine.acquire(take_over=False)
    assert mine.mode == "read-back"
    proxy.hold, manifest, refreshed = 1.5, f"{out}/manifest.json", []

    def rewritten_slowly():
        """The loop's refresh, its upload of the lease taking proxy.hold: returns once that upload is under way."""
        proxy.inject(upload[0], "trickle", 1, body=upload[1])
        faults, t0 = proxy.faults, time.monotonic()
        refreshing = threading.Thread(target=lambda: refreshed.append(mine.refresh()))
        refreshing.start()
        while proxy.faults == faults:
            assert time.monotonic() - t0 < 30, f"no upload of the lease among {proxy.requests[-5:]}"
            time.sleep(0.01)
        time.sleep(0.3)  # half of it reached the server
        return refreshing

    refreshing = rewritten_slowly()
    assert mine.fenced(manifest, lambda: storage.write_text(manifest, "committed")), mine.lost
    refreshing.join()
    assert refreshed == [True] and storage.read_text(manifest) == "committed"
    refreshing = rewritten_slowly()
    with pytest.raises(SystemExit, match="is in use by run without a run id"):  # not "taking it"
        lease.Lease(out, 300).acquire(take_over=False)
    refreshing.join()
    assert refreshed == [True, True] and json.loads(storage.read_text(f"{out}/LEASE.json"))["token"] == mine.token
    successor = lease.Lease(out, 300)
    successor.acquire(take_over=True)
    assert not mine.refresh() and f"pid {os.getpid()}," in mine.lost
    assert not mine.fenced(manifest, lambda: storage.write_text(manifest, "zombie"))
    assert storage.read_text(manifest) == "committed"


def test_a_lease_rewritten_unreadable_where_conditions_hold_is_lost_to_its_writer(s3_bucket):
    """Where the server honours the conditions, a refused rewrite means another process wrote the lease: one it left
    unreadable is still a takeover, said as such (not 'a run without a run id')."""
    out = f"{s3_bucket}/garbled"
    mine = lease.Lease(out, 300)
    mine.acquire(take_over=False)
    assert mine.mode == "conditional"
    storage.write_text(f"{out}/LEASE.json", "{not json")
    assert not mine.refresh() and mine.lost == "another process, which wrote out_dir's lease unreadable"


@pytest.mark.parametrize("where", ["s3", pytest.param("gs", marks=pytest.mark.full)])
def test_a_write_that_lands_after_a_takeover_is_removed(place):
    """In a bucket a write under the lease follows the lease's conditional rewrite by one request: a process stopped
    between the two (a host that hangs) while a successor takes out_dir over lands its manifest after the takeover
    once it comes back. It then finds the lease taken and removes what it wrote: out_dir is as the successor left it."""
    out = place("late")
    storage.makedirs(out)
    zombie = forkserver.spawn([sys.executable, "-c", ZOMBIE, out], os.environ | {
        "OMP_NUM_THREADS": "1", "LLAVAX_TEST_PAUSE_BEFORE_LEASE_WRITE": "after:manifest.json"})
    wait_for(lambda: stopped(zombie.pid), zombie, timeout=60, what="pause")
    successor = lease.Lease(out, 300)
    successor.acquire(take_over=True)
    taken = snapshot(out)
    zombie.send_signal(signal.SIGCONT)
    code, stdout, err = finish(zombie)
    assert code == 0, err
    assert f"lease: removed {out}/manifest.json, written as out_dir was taken over by run without a run id" in stdout
    assert stdout.splitlines()[-1].startswith("lost to run without a run id") and f"pid {os.getpid()}," in stdout
    assert snapshot(out) == taken and "manifest.json" not in taken
    assert json.loads(taken["LEASE.json"])["token"] == successor.token
