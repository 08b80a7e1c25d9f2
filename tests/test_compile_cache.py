"""XLA's persistent compilation cache (compile_cache_dir): a run writes each program it compiles under its key, and
beside a bucket out_dir keeps them for a recreated host; an entry that cannot be read (torch_xla's CPU devices cannot
load any; here the entries are also cut short) is a warning and a fresh compile, never a crash. A TPU loads them:
the hits of a second run there are still to be measured."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT, XLA_CPU, train_on_xla
from test_train import args

import config
import storage


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=400, seed=0, val_fraction=0.1)  # test_train's


def events_in(out):
    return [e for e in map(json.loads, storage.read_text(f"{out}/log.jsonl").splitlines()) if "loss" in e]


@pytest.mark.slow
@pytest.mark.full  # two XLA runs that compile from nothing: ~35 s; make test: the cache's warnings and mirror below
def test_a_recreated_host_finds_its_compiled_programs_beside_a_bucket_out_dir_and_a_cut_one_is_compiled_afresh(
        shapes, s3_bucket, tmp_path):
    """A spot VM recreated after a preemption starts with an empty disk: the run on it finds the programs its
    predecessor compiled in out_dir/xla-cache/VERSION/host-0 (kept at each checkpoint), copies them into its own
    cache, and resumes; here they are cut short (an upload stopped by a preemption, another torch_xla; torch_xla's CPU
    devices cannot load any anyway): one warning, compiled afresh, the resumed step's loss bit for bit."""
    out, first_cache, second_cache = f"{s3_bucket}/run", tmp_path / "vm1", tmp_path / "vm2"
    common = ["--max_iters=3", "--ckpt_interval=2", "--micro_batch_size=4", "--batch_size=4"]
    first = train_on_xla(args(shapes, out, *common, f"--compile_cache_dir={first_cache}"))
    assert f"xla: compile cache {first_cache}" in first.stdout
    log = events_in(out)
    entries = sorted(p.name for p in first_cache.iterdir() if p.is_file())
    # one file a program compiled, named by its key; nothing found, nothing unreadable on a fresh cache
    assert log[-1]["xla_cache_miss"] == len(entries) == log[-1]["xla_compiles"] >= 2 and log[-1]["xla_compile_s"] > 0
    assert all(name.isdigit() for name in entries) and log[-1]["xla_cache_hit"] == log[-1]["xla_cache_unreadable"] == 0
    mirror = f"{out}/xla-cache/{importlib.metadata.version('torch_xla')}/host-0"  # torch_xla.__version__
    kept = storage.ls(mirror)  # those compiled by the step-2 checkpoint (step 3 compiles nothing new)
    assert kept and set(kept) <= set(entries)
    for name in kept:
        data = storage.read_bytes(f"{mirror}/{name}")
        storage.write_bytes(f"{mirror}/{name}", data[: len(data) // 2])

    storage.rm(f"{out}/step-000003", recursive=True)  # preempted before step 3's checkpoint: step 2 resumes
    storage.rm(f"{out}/DONE")
    second = train_on_xla(args(shapes, out, *common, f"--compile_cache_dir={second_cache}", "--resume=True"))
    assert f"xla: {len(kept)} compiled program(s) from {mirror}" in second.stdout
    assert {p.name for p in second_cache.iterdir() if p.is_file()} >= set(kept)
    again = events_in(out)
    assert again[-1]["step"] == 3 and again[-1]["loss"] == log[-1]["loss"]  # the resumed step, bit for bit
    assert again[-1]["xla_cache_unreadable"] >= 1 and again[-1]["xla_cache_hit"] == 0, again[-1]
    warned = [line for line in second.stdout.splitlines() if "could not be read" in line]
    assert len(warned) == 1 and f"program(s) in {second_cache} could not be read" in warned[0], second.stdout[-2000:]
    assert "compiled afresh" in warned[0] and "Traceback" not in second.stderr


def test_a_cache_folder_that_cannot_be_written_is_a_warning_and_no_cache(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    code = f"import parallel; print(repr(parallel.start_compile_cache({str(blocked / 'cache')!r})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=os.environ | XLA_CPU)
    assert r.returncode == 0 and r.stdout.strip() == "('', 'its folder cannot be written')", r.stderr[-2000:]
    assert f"xla: compile_cache_dir {blocked / 'cache'} cannot be written" in r.stderr
    assert "compiling without a cache" in r.stderr and "Traceback" not in r.stderr


def test_a_compile_cache_in_a_bucket_is_refused_in_one_sentence():
    with pytest.raises(SystemExit, match=r"compile_cache_dir 's3://b/cache' must be a folder on this host's disk"):
        config.load_config(["--compile_cache_dir=s3://b/cache"])


def test_a_mirror_entry_that_cannot_be_copied_is_skipped_and_a_push_never_stops_the_run(s3_bucket, tmp_path, capsys):
    """The mirror holds two entries and a sub-folder (something else wrote there): the two are copied, the folder is
    one warning; a push whose cache folder was removed meanwhile (a tmp cleaner) is a warning, not a traceback."""
    import parallel

    mirror, env = f"{s3_bucket}/run/xla-cache/v/host-0", SimpleNamespace(compile_cache=str(tmp_path / "cache"))
    for name in ("111", "sub/333", "222"):
        storage.write_bytes(f"{mirror}/{name}", name.encode())
    (tmp_path / "cache").mkdir()
    assert parallel.pull_compile_cache(env, mirror) == {"111", "222"}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["111", "222"]
    said = capsys.readouterr()
    assert "xla: 2 compiled program(s) from" in said.out and "1 entry of the compile cache" in said.err
    (tmp_path / "cache" / "444").write_bytes(b"4")
    pushed = {"111", "222"}
    parallel.push_compile_cache(env, mirror, pushed)
    assert pushed == {"111", "222", "444"} and storage.read_bytes(f"{mirror}/444") == b"4"
    shutil.rmtree(tmp_path / "cache")
    parallel.push_compile_cache(env, mirror, pushed)
    assert "the compile cache could not be kept in" in capsys.readouterr().err
