"""Training data in a bucket (moto's S3 server, fake-gcs-server: tests/buckets.py): `pack --out` a bucket writes the
same bytes as a local pack, each shard when complete and .nv-meta last; the loader reads it by byte range, ahead of
use, and gives the batches a local folder gives, through a mid-epoch resume, DataLoader workers, throttling and reset
connections; a pack that dies midway leaves nothing a reader takes for a dataset; bad paths get one sentence."""

import json
import os
import re
import sys
import time

import forkserver
import pytest
import s3fs
import torch
from buckets import forget_filesystems
from conftest import ROOT
from test_train import args

import checkpoint
import data
import audit
import pack
import shards
import storage
import train
from loader import Loader, ShardStream


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=240, seed=0, val_fraction=0.25)


def pack_shapes(shapes, out, **kw):
    """The shapes records in shards of 37 samples (an odd size: the last shard is short), val by id."""
    return pack.pack(shapes / "shapes.json", shapes / "images", out, shard_size=37,
                     val_ids=lambda i: str(i).startswith("val"), **kw)


@pytest.fixture(scope="module")
def local(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    pack_shapes(shapes, out)
    return out


def stream(shapes, where, **kw):
    kw = {"batch_size": 8, "seq_len": 64, "image_size": 28, "image_token_id": 512, "n_image_tokens": 4,
          "template": "plain", "shuffle_block": 50} | kw
    return ShardStream(where, shapes / "tokenizer.model", **kw)


def take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def local_files(folder):
    """{relative name: bytes} of a packed folder."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def bucket_files(url):
    return {name: storage.read_bytes(storage.join(url, name))
            for name in [*storage.file_sizes(url), *(f".nv-meta/{n}" for n in storage.file_sizes(f"{url}/.nv-meta"))]}


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_dataset_packed_to_a_bucket_reads_as_the_local_one_across_a_resume(kind, shapes, local, request):
    url = request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_bucket") + "/shapes/shards"
    pack_shapes(shapes, url)
    assert bucket_files(url) == local_files(local)  # every shard, index and metadata file, byte for byte

    # 180 train samples, 8 a batch: batch 23 starts the second epoch
    straight = take(Loader(stream(shapes, local)), 26)
    first = Loader(stream(shapes, url), num_workers=2)  # workers forked after the parent has used the bucket
    assert_same_batches(take(first, 9), straight[:9])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Loader(stream(shapes, url), num_workers=0)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 17), straight[9:])
    val = stream(shapes, url, split="val")
    assert_same_batches([val.batch(k) for k in (0, 7)], [stream(shapes, local, split="val").batch(k) for k in (0, 7)])


def test_ranged_reads_are_merged_and_retried_through_throttling_and_resets(shapes, local, s3_bucket, s3_proxy,
                                                                            monkeypatch):
    url, bucket = s3_bucket + "/shards", storage.bucket(s3_bucket)
    pack_shapes(shapes, url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore gives up at once: storage.py's own retries are tested
    monkeypatch.setattr(storage, "BACKOFF", 0.01)
    forget_filesystems()
    s = stream(shapes, url)
    want = take(Loader(stream(shapes, local)), 12)
    n_before = len(s3_proxy.requests)
    shard_gets = rf"^GET /{bucket}/shards/shard-00000\d\.tar"
    for fault, count in ((503, 3), (429, 2), ("reset", 3)):
        s3_proxy.inject(shard_gets, fault, count)
    assert_same_batches(take(Loader(s), 12), want)
    assert s3_proxy.faults == 8
    gets = [r for r in s3_proxy.requests[n_before:] if re.match(shard_gets, r)]
    assert 8 < len(gets) < 96 // 4  # 96 samples came in far fewer requests (neighbours merged), faults retried

    # an outage outlasting the retries stops the loader in one sentence: no sample is dropped as unreadable
    s = stream(shapes, url, seed=3)
    s3_proxy.inject(shard_gets, 503, 1000)
    monkeypatch.setattr(storage, "RETRIES", 2)
    with pytest.raises(storage.StorageError, match=r"shard-00000\d\.tar: still failing after 2 attempts"):
        take(Loader(s), 1)


def test_ranged_reads_are_retried_on_gcs(shapes, local, gcs_bucket, gcs_proxy):
    url = gcs_bucket + "/shards"
    pack_shapes(shapes, url)
    for fault in (503, 429, "reset"):
        gcs_proxy.inject(r"^GET .*shards%2Fshard-00000\d\.tar", fault, 1)
    assert_same_batches(take(Loader(stream(shapes, url)), 4), take(Loader(stream(shapes, local)), 4))
    assert gcs_proxy.faults == 3


def audit_text(source, shapes, capsys):
    status = audit.audit(source, shapes / "tokenizer.model", "plain", 64, 28, 4, 512, show=2, progress=0)
    return status, capsys.readouterr().out.replace(str(source), "SOURCE")


def test_a_pack_that_dies_midway_leaves_no_dataset_and_audit_reads_the_finished_one(shapes, local, s3_bucket,
                                                                                     s3_proxy, monkeypatch, capsys):
    url, bucket = s3_bucket + "/shards", storage.bucket(s3_bucket)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(storage, "BACKOFF", 0.01)
    monkeypatch.setattr(storage, "RETRIES", 2)
    forget_filesystems()
    s3_proxy.inject(rf"^PUT /{bucket}/shards/shard-000002\.tar", 503, 1000)  # the third shard's upload never lands
    with pytest.raises(storage.StorageError, match="shard-000002.tar: still failing"):
        pack_shapes(shapes, url)
    assert storage.exists(f"{url}/shard-000001.tar") and not storage.exists(f"{url}/.nv-meta/.info.json")
    for read in (lambda: stream(shapes, url), lambda: audit_text(url, shapes, capsys)):
        with pytest.raises(SystemExit, match=r"shards: no \.nv-meta/\.info\.json, so not a finished dataset"):
            read()
    s3_proxy.rules.clear()
    with pytest.raises(SystemExit, match=r"already holds a dataset \(shard-000000\.tar, .*pass --overwrite"):
        pack_shapes(shapes, url)  # the killed pack's shards are not overwritten without asking

    pack_shapes(shapes, url, overwrite=True)
    assert bucket_files(url) == local_files(local)
    capsys.readouterr()
    assert audit_text(url, shapes, capsys) == audit_text(local, shapes, capsys)
    with pytest.raises(SystemExit, match=r"already holds a dataset \(.nv-meta, shard-000000.tar"):
        data.main(["pack", "--json", str(shapes / "shapes.json"), "--images", str(shapes / "images"), "--out", url])
    assert bucket_files(url) == local_files(local)


def test_bad_data_paths_are_one_sentence(shapes, s3_bucket, gcs_bucket, tmp_path, capsys):
    storage.write_text(f"{s3_bucket}/other/notes.txt", "not a dataset")
    cases = [("s3://llavax-no-such-bucket/shards", "bucket 'llavax-no-such-bucket' does not exist"),
             ("gs://llavax-no-such-bucket/shards", "bucket 'llavax-no-such-bucket' does not exist"),
             ("ftp://host/shards", "unknown storage scheme 'ftp://'"),
             (f"{s3_bucket}/shards", "no dataset there"),
             (f"{gcs_bucket}/shards", "no dataset there"),
             (f"{s3_bucket}/other", r"no \.nv-meta/\.info\.json, so not a finished dataset")]
    for url, said in cases:
        with pytest.raises((storage.StorageError, SystemExit), match=said):
            stream(shapes, url)
    with pytest.raises(SystemExit, match="audit: s3://llavax-no-such-bucket/shards: bucket 'llavax-no-such-bucket'"):
        data.main(["audit", "s3://llavax-no-such-bucket/shards", "--tokenizer", str(shapes / "tokenizer.model")])
    # train.py says so before it builds anything
    (tmp_path / "empty").mkdir()
    for url, said in [*cases[3:], (tmp_path / "empty", "no dataset there"), (f"{s3_bucket}/x.tar", "no such object")]:
        with pytest.raises(SystemExit) as e:
            train.main(args(shapes, tmp_path / "out", f"--data_dir={url}", "--max_iters=1"))
        assert re.match(rf"data_dir {url}: {said}", str(e.value)) and "\n" not in str(e.value), str(e.value)
        assert "model:" not in capsys.readouterr().out


def test_train_from_a_bucket_logs_the_local_runs_losses_bit_for_bit(shapes, s3_bucket, tmp_path):
    url = f"{s3_bucket}/shapes/shards"
    for f in sorted(p for p in (shapes / "shards").rglob("*") if p.is_file()):  # the demo's shards, as they are
        storage.upload(f, f"{url}/{f.relative_to(shapes / 'shards')}")
    runs = {"local": shapes / "shards", "bucket": url, "no_bucket": "s3://llavax-no-such-bucket/shards"}
    results = dict(zip(runs, forkserver.run_many(
        [[sys.executable, str(ROOT / "train.py"), *args(shapes, tmp_path / name, f"--data_dir={where}", "--max_iters=3",
                                                        "--num_workers=1", "--ckpt_interval=0")]
         for name, where in runs.items()], os.environ | {"OMP_NUM_THREADS": "1"}, parallel=2)))
    for name in ("local", "bucket"):
        assert results[name].returncode == 0, results[name].stderr[-3000:]
    losses = {name: [(e["step"], e["loss"]) for e in map(json.loads, (tmp_path / name / "log.jsonl").read_text()
                                                          .splitlines()) if "loss" in e] for name in ("local", "bucket")}
    assert len(losses["local"]) == 3 and losses["bucket"] == losses["local"]
    r = results["no_bucket"]
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr  # one sentence, no traceback
    assert "data_dir s3://llavax-no-such-bucket/shards: bucket 'llavax-no-such-bucket' does not exist" in r.stderr


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bucket_that_goes_down_mid_run_stops_training_in_one_sentence(workers, shapes, s3_bucket, s3_proxy, tmp_path,
                                                                        monkeypatch):
    """The shards' bucket answers for a few steps, then only 503s: the run stops in one sentence naming the shard and
    the reason, in the main process or a DataLoader worker, and the checkpoints it wrote verify (resume takes them)."""
    url, bucket = s3_bucket + "/shards", storage.bucket(s3_bucket)
    pack_shapes(shapes, url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(storage, "BACKOFF", 0.01)
    monkeypatch.setattr(storage, "RETRIES", 2)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs gives up at once too
    monkeypatch.setattr(shards, "AHEAD", 16)  # two batches fetched ahead: the outage meets the run, not its prefetch
    forget_filesystems()
    s3_proxy.inject(rf"^GET /{bucket}/shards/shard-\d+\.tar$", 503, 10**6, after=20)
    with pytest.raises(SystemExit) as e:
        train.main(args(shapes, tmp_path, f"--data_dir={url}", "--max_iters=50", "--ckpt_interval=2",
                        f"--num_workers={workers}"))
    said = str(e.value)
    assert re.fullmatch(rf"stopping at step \d+: {url}/shard-\d+\.tar: still failing after 2 attempts in \d+ s "
                        r"\(.*reduce your request rate.*\) at http://\S+ \(AWS_ENDPOINT_URL\); the last checkpoint is "
                        r".*: resume with --resume=True once the bucket answers", said) and "\n" not in said, said
    steps = checkpoint.checkpoints(tmp_path)
    assert steps and all(checkpoint.verify_checkpoint(p) is None for p in steps), steps
    assert f"the last checkpoint is {steps[-1]}:" in said


def test_merged_requests_cover_each_range_within_the_request_cap():
    ranges = [(0, 0, 10), (0, 10, 30), (0, 30 + shards.MERGE_GAP + 1, 200_000), (1, 0, 5), (0, 10, 30),
              (0, 200_000, 200_000 + shards.REQUEST_BYTES - 100)]
    request_of = shards.merged_requests(ranges)
    assert set(request_of) == set(ranges)
    assert sorted(set(request_of.values())) == [(0, 0, 30), (0, 30 + shards.MERGE_GAP + 1, 200_000),
                                                (0, 200_000, 200_000 + shards.REQUEST_BYTES - 100), (1, 0, 5)]
    for (shard, start, end), (r_shard, r_start, r_end) in request_of.items():
        assert shard == r_shard and r_start <= start < end <= r_end and r_end - r_start <= shards.REQUEST_BYTES


def test_shapes_out_to_a_bucket_packs_its_shards_there(s3_bucket, tmp_path):
    from shapes import make_shapes

    make_shapes(f"{s3_bucket}/shapes", n=16, val_fraction=0.25)
    assert {"tokenizer.model", "shapes.json"} <= set(storage.file_sizes(f"{s3_bucket}/shapes"))
    (tmp_path / "tokenizer.model").write_bytes(storage.read_bytes(f"{s3_bucket}/shapes/tokenizer.model"))
    s = ShardStream(f"{s3_bucket}/shapes/shards", tmp_path / "tokenizer.model", batch_size=2, seq_len=64, image_size=28,
                    image_token_id=512, n_image_tokens=4)
    assert len(s) == 12 and s.batch(0)["dropped"].sum() == 0


# -----------------------------------------------------------------------------
# data that vanishes mid-run: a storage failure that stops the run, never empty batches trained on


@pytest.mark.parametrize("where,fault,workers", [("s3", "deleted", 1),
                                                 pytest.param("s3", "truncated", 0, marks=pytest.mark.full),
                                                 pytest.param("gs", "deleted", 0, marks=pytest.mark.full),
                                                 ("gs", "truncated", 0), ("local", "truncated", 0),
                                                 ("local", "truncated", 1)])
def test_a_shard_deleted_or_truncated_mid_run_stops_it_and_nothing_is_committed_after(where, fault, workers, shapes,
                                                                                     tmp_path, request, monkeypatch):
    """The shards were whole when the run indexed them; at step 4 one is deleted (or cut to half) under it: the run
    reads it again, then stops in one sentence naming the shard, the step and the last committed checkpoint, read in
    the main process or in a DataLoader worker (whose exception crosses to the main process as what it is: a shard
    gone, not a bucket that stopped answering; a local shard's hint names no bucket); every committed step was
    trained on real data (its interval's loss finite, nothing dropped), and there is no DONE."""
    import threading

    bucket = {"s3": "s3_bucket", "gs": "gcs_bucket"}.get(where)
    url = str(tmp_path / "shards") if where == "local" else request.getfixturevalue(bucket) + "/shards"
    pack_shapes(shapes, url)
    monkeypatch.setattr(shards, "AHEAD", 16)  # two batches fetched ahead: the loss meets the run, not its prefetch
    monkeypatch.setattr(storage, "BACKOFF", 0.01)
    out, victim = tmp_path / "out", f"{url}/shard-000001.tar"

    def break_the_shard():
        while not (out / "step-000004" / "manifest.json").exists():
            time.sleep(0.02)
        if fault == "deleted":
            storage.rm(victim)
        elif where == "local":  # cut in place (a replaced file would leave the reader's open copy whole, and right)
            os.truncate(victim, storage.size(victim) // 2)
        else:
            storage.write_bytes(victim, storage.read_bytes(victim)[: storage.size(victim) // 2])

    threading.Thread(target=break_the_shard, daemon=True).start()
    with pytest.raises(SystemExit) as e:
        train.main(args(shapes, out, f"--data_dir={url}", "--max_iters=200", "--ckpt_interval=2", "--keep_last=50",
                        "--log_interval=1", f"--num_workers={workers}"))
    said = str(e.value)
    problem = "gone (deleted since the run started)" if fault == "deleted" else "truncated since the run started"
    assert re.fullmatch(rf"stopping at step (\d+): shard {re.escape(victim)} is {re.escape(problem)}.*, after 3 reads; "
                        rf"the last checkpoint is \S+/step-(\d+): resume with --resume=True once the shard is back "
                        r"\(restored, or the dataset re-packed\)", said) and "\n" not in said, said
    assert where != "local" or "bucket" not in said.replace(victim, ""), said
    steps = checkpoint.checkpoints(out)
    assert f"the last checkpoint is {steps[-1]}:" in said and not (out / "DONE").exists()
    assert all(checkpoint.verify_checkpoint(p) is None for p in steps)
    events = [e for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in e]
    assert all(e["loss"] is not None and e["dropped_samples"] == 0 for e in events), events
    assert max(e["step"] for e in events) >= checkpoint.step_number(steps[-1])
