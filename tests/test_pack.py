"""pack.py's records and shards, and the loader's checks on them, against webdataset, tarfile and megatron-energon."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
from conftest import ROOT
from PIL import Image

import chat
import loader
import pack
import shards

# -----------------------------------------------------------------------------
# helpers: photo-sized JPEGs, ShareGPT/LLaVA-style records, a byte-level tokenizer


def jpeg(w=64, h=48, seed=0, fmt="JPEG"):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def record(i, question="What is in the image?", answer="A dog on a beach.", image=True, **kw):
    conv = [{"from": "human", "value": ("<image>\n" if image else "") + question}, {"from": "gpt", "value": answer}]
    return {"id": f"rec{i}", **({"image": f"{i}.jpg"} if image else {}), "conversations": conv} | kw


def images_dir(tmp_path, n=4):
    d = tmp_path / "images"
    d.mkdir(exist_ok=True)
    for i in range(n):
        (d / f"{i}.jpg").write_bytes(jpeg(64 + 7 * i, 48, seed=i))
    return d


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE tokenizer.json (any text round-trips), with LLaMA's <s> and </s> as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["A chat between a curious user and an assistant. USER: ASSISTANT: a photo of"] * 10,
                          trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tok")
    t.save(str(d / "tokenizer.json"))
    return chat.Tokenizer(d / "tokenizer.json")


def open_stream(paths, tok, split="train", **kw):
    args = {"batch_size": 2, "seq_len": 256, "image_size": 28, "image_token_id": 999, "n_image_tokens": 4,
            "template": "vicuna_v1", "shuffle_block": 1} | kw
    return loader.ShardStream(paths, tok, split=split, **args)


def answers(stream, tok):
    """The supervised text of every sample of one epoch, in sample order; None for a dropped sample."""
    out = {}
    for k in range(-(-len(stream) // stream.batch_size)):
        b = stream.batch(k)
        for sid, row, dropped in zip(b["sample_id"].tolist(), b["labels"].tolist(), b["dropped"].tolist()):
            out[sid] = None if dropped else tok.decode([t for t in row if t != -100]).removesuffix("</s>").strip()
    return [out[i] for i in range(len(stream))]


# -----------------------------------------------------------------------------
# records: every bad one is a counted skip with its own reason, never fatal, never packed as something else


def test_unknown_roles_are_skipped_by_reason_and_strict_fails(tmp_path, capfd):
    imgs = images_dir(tmp_path)
    good = [record(0), record(1, image=False, question="Hi", answer="Hello!")]
    # as found in raw ShareGPT dumps and hand-made LLaVA files
    bad_roles = {"Human": "capitalised", "chatgpt": "sharegpt", "bing": "sharegpt", "bard": "sharegpt"}
    bad = [record(10 + j, image=False) for j in range(len(bad_roles) + 1)]
    for rec, role in zip(bad, [*bad_roles, ["human"]]):
        rec["conversations"][0]["from"] = role
    (tmp_path / "d.json").write_text(json.dumps(good + bad))
    skips = pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    assert dict(skips.counts) == {"unknown_role": 5}
    with pytest.raises(SystemExit, match="--strict: 5 records were skipped"):
        pack.pack(tmp_path / "d.json", imgs, tmp_path / "strict", strict=True)
    assert "unknown_role: 5 (first: rec10, rec11" in capfd.readouterr().err


def test_null_list_and_surrogate_values_are_skipped_each_with_its_reason(tmp_path):
    imgs = images_dir(tmp_path)
    null, listed, surrogate, multi = record(1), record(2), record(3, answer="caf\ud800"), record(0)
    null["conversations"][1]["value"] = None
    listed["conversations"][1]["value"] = ["a", "b"]
    multi["image"] = ["0.jpg", "1.jpg"]  # LLaVA-OneVision style, one tag for two images (tests/test_multi_image_data.py)
    one_in_list = record(2) | {"id": "single", "image": ["2.jpg"]}
    # json.dumps writes the lone surrogate as the escape "\ud800", as a real file would hold it
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in [record(0), null, listed, surrogate, multi,
                                                                       one_in_list]))
    skips = pack.pack(tmp_path / "d.jsonl", imgs, tmp_path / "out")
    assert dict(skips.counts) == {"non_text_value": 2, "invalid_unicode": 1, "image_tag_count_mismatch": 1}
    import webdataset as wds

    texts = [s["txt"].decode() for s in wds.WebDataset(str(tmp_path / "out/shard-000000.tar"), shardshuffle=False)]
    assert texts == ["A dog on a beach."] * 2 and "None" not in texts


@pytest.mark.parametrize("layout", ["array", "jsonl"])
@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_bom_and_utf16_inputs_keep_every_record(tmp_path, layout, encoding):
    imgs = images_dir(tmp_path)
    recs = [record(i % 4, answer=f"Ein Hund, Nummer {i} — süß.") for i in range(6)]
    text = json.dumps(recs, ensure_ascii=False) if layout == "array" else \
        "\n".join(json.dumps(r, ensure_ascii=False) for r in recs)
    (tmp_path / "d.json").write_text(text, encoding=encoding)  # Python writes the byte-order mark
    skips = pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    assert not skips.counts
    info = json.loads((tmp_path / "out/.nv-meta/.info.json").read_text())
    assert sum(info["shard_counts"].values()) == 6


def test_a_top_level_object_or_nothing_kept_exits_nonzero_with_a_reason(tmp_path, capfd):
    imgs = images_dir(tmp_path)
    (tmp_path / "obj.json").write_text(json.dumps({"data": [record(0)], "version": 1}, indent=2))
    with pytest.raises(SystemExit, match="one JSON object .keys data, version., not LLaVA data"):
        pack.pack(tmp_path / "obj.json", imgs, tmp_path / "a")
    assert "malformed JSON" not in capfd.readouterr().err  # no per-line noise
    (tmp_path / "one.json").write_text(json.dumps(record(0), indent=2))  # one record, pretty-printed, is fine
    assert not pack.pack(tmp_path / "one.json", imgs, tmp_path / "one").counts
    (tmp_path / "none.json").write_text(json.dumps([record(0) | {"image": "missing.jpg"}]))
    with pytest.raises(SystemExit, match="no record could be packed(.|\\n)*missing_image: 1"):
        pack.pack(tmp_path / "none.json", imgs, tmp_path / "b")
    assert not (tmp_path / "b/.nv-meta").exists()
    (tmp_path / "nobom16.json").write_bytes(json.dumps([record(0)]).encode("utf-16-le"))
    with pytest.raises(SystemExit, match="nobom16.json: NUL bytes: UTF-16/32 text without a byte-order mark"):
        pack.pack(tmp_path / "nobom16.json", imgs, tmp_path / "c")


def test_image_paths_that_leave_the_images_folder_are_refused(tmp_path):
    imgs = images_dir(tmp_path)
    (tmp_path / "secret.jpg").write_bytes(jpeg(40, 40, seed=9))
    (imgs / "sub").mkdir()
    (imgs / "sub/link_out.jpg").symlink_to(tmp_path / "secret.jpg")
    (imgs / "sub/link_in.jpg").symlink_to(imgs / "1.jpg")  # a symlink that stays inside is fine
    recs = [record(0) | {"image": str(tmp_path / "secret.jpg")}, record(0) | {"image": "../secret.jpg"},
            record(0) | {"image": "sub/../../secret.jpg"}, record(0) | {"image": "sub/link_out.jpg"},
            record(0) | {"image": "sub/link_in.jpg"}, record(2)]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    skips = pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    assert dict(skips.counts) == {"image_outside_images_dir": 4}
    assert sum(json.loads((tmp_path / "out/.nv-meta/.info.json").read_text())["shard_counts"].values()) == 2


# -----------------------------------------------------------------------------
# foreign shards: read what webdataset and tarfile write; a malformed sample is a counted drop


def test_loader_reads_long_pax_keys_and_captions_kept_only_in_json(tmp_path, tok):
    import webdataset as wds

    long_dir = "laion/part-00017/" + "x" * 90  # keys over tar's 100-byte name field
    with wds.TarWriter(str(tmp_path / "wds.tar")) as sink:
        sink.write({"__key__": f"{long_dir}/000000001", "jpg": jpeg(), "json": {"caption": "a photo of a red bus"}})
        sink.write({"__key__": f"{long_dir}/000000002", "jpg": jpeg(seed=1), "txt": "a photo of a cat"})
    with tarfile.open(tmp_path / "tf.tar", "w") as tar:  # tarfile's default format is PAX too
        for name, payload in ((f"{long_dir}/000000003.jpg", jpeg(seed=2)),
                              (f"{long_dir}/000000003.json", json.dumps({"caption": "a photo of a lake"}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    s = open_stream([tmp_path / "wds.tar", tmp_path / "tf.tar"], tok, template="plain")
    assert len(s) == 3
    assert s.read(0)[0] == f"{long_dir}/000000001"
    assert answers(s, tok) == ["a photo of a red bus", "a photo of a cat", "a photo of a lake"]


def test_loader_drops_malformed_foreign_conversations_and_keeps_going(tmp_path, tok):
    import webdataset as wds

    convs = [[{"from": "Human", "value": "<image>\nWhat?"}, {"from": "chatgpt", "value": "A cat."}],
             [{"from": ["human"], "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
             [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": None}],
             [{"from": "human", "value": "Hi"}],
             [{"from": "human", "value": "Is it?"}, {"from": "gpt", "value": "Yes, it is."}]]
    with wds.TarWriter(str(tmp_path / "f.tar")) as sink:
        for i, c in enumerate(convs):
            sink.write({"__key__": f"s{i}", "json": {"conversations": c}})
    s = open_stream(tmp_path / "f.tar", tok, batch_size=5)
    assert answers(s, tok) == [None, None, None, None, "Yes, it is."]
    assert dict(s.skips.counts) == {"unknown_role": 2, "non_text_value": 1, "no_gpt_turn": 1}


# -----------------------------------------------------------------------------
# megatron-energon loads every packed sample


def test_energon_yields_every_packed_sample_per_split(tmp_path, capfd):
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    imgs = images_dir(tmp_path)
    Image.open(io.BytesIO(jpeg(30, 50, seed=5))).save(imgs / "p.png")
    recs = []
    for i in range(40):
        kind = i % 4
        if kind == 0:
            recs.append(record(i % 4, answer=f"Image answer {i}."))
        elif kind == 1:
            recs.append(record(i, image=False, question=f"Text question {i}?", answer=f"Text answer {i}."))
        elif kind == 2:  # multi-turn, text-only, with a system turn
            recs.append({"id": f"mt{i}", "conversations": [
                {"from": "system", "value": "Be brief."}, {"from": "human", "value": f"First {i}?"},
                {"from": "gpt", "value": f"One {i}."}, {"from": "human", "value": "Second?"},
                {"from": "gpt", "value": "Two."}]})
        else:
            recs.append(record(i, answer=f"Png answer {i}.") | {"image": "p.png"})
    (tmp_path / "d.json").write_text(json.dumps(recs))
    capfd.readouterr()
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out", shard_size=7, val_ratio=0.3)
    reported = re.search(r"wrote (\d+) train and (\d+) val samples", capfd.readouterr().err)
    n_train, n_val = int(reported[1]), int(reported[2])
    assert n_train + n_val == 40 and n_val > 0
    want = {next(t["value"] for t in r["conversations"] if t["from"] == "gpt") for r in recs}  # all distinct
    got = {}
    for split, n in (("train", n_train), ("val", n_val)):
        ds = get_train_dataset(tmp_path / "out", split_part=split, batch_size=None, shuffle_buffer_size=None,
                               max_samples_per_sequence=None, repeat=False,
                               worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        samples = list(get_loader(ds))
        assert len(samples) == n, split
        got |= {s.answers: s.image for s in samples}
    assert set(got) == want
    assert all((img is None) == ("Text" in a or "One" in a) for a, img in got.items())


# -----------------------------------------------------------------------------
# a dataset is complete only when its metadata is written, last; the loader refuses anything else


@pytest.mark.slow  # one python + torch start-up in a subprocess, to kill it
def test_a_killed_pack_leaves_a_folder_the_loader_refuses(tmp_path, tok):
    imgs = images_dir(tmp_path)
    recs = [record(i % 4, answer=f"Answer {i}.") for i in range(1500)]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "data.py"), "pack", "--json", str(tmp_path / "d.json"),
                             "--images", str(imgs), "--out", str(out), "--shard-size", "20"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "shard-000002.tar").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "shard-000001.tar").exists() and not (out / "shard-000074.tar").exists(), "killed too late"
    with pytest.raises(shards.DatasetError, match=r"out: no \.nv-meta/\.info\.json, so not a finished dataset"):
        open_stream(out, tok)
    import train

    with pytest.raises(SystemExit, match=r"out: no \.nv-meta/\.info\.json"):  # a message, not a traceback
        train.main([str(ROOT / "configs/debug.py"), f"--data_dir={out}", f"--tokenizer={tok.path}",
                    f"--out_dir={tmp_path / 'run'}"])
    # its lock file stays, naming it; the lock died with it, so the rerun is not refused as a live pack's
    assert json.loads((out / pack.PACK_LOCK).read_text())["pid"] == proc.pid
    with pytest.raises(SystemExit, match="already holds a dataset .*pass --overwrite"):
        pack.pack(tmp_path / "d.json", imgs, out, shard_size=1000)
    pack.pack(tmp_path / "d.json", imgs, out, shard_size=1000, overwrite=True)
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]  # no stale shard
    assert not (out / pack.PACK_LOCK).exists()
    assert len(open_stream(out, tok)) == 1500


def started_pack(args, out, first_file):
    """A `data.py pack` process, stopped with its children (SIGSTOP to its process group: a host that hangs) once it
    has written first_file in out; it holds out all the while (SIGCONT to the group goes on)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "data.py"), "pack", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (out / first_file).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGSTOP)
    assert proc.poll() is None, f"the first pack ended before it was caught: {proc.communicate()}"
    return proc


def second_pack(args, capsys):
    """(exit status, stderr) of `data.py pack ARGS` in this process: the second of two processes."""
    import data

    with pytest.raises(SystemExit) as e:
        data.main(["pack", *map(str, args)])
    code = e.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err + (code if isinstance(code, str) else "")


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a python + torch start-up
def test_a_second_pack_into_the_same_folder_refuses_naming_the_first(tmp_path, tok, capsys):
    """Two `data.py pack --out SAME`: the second, started while the first writes, stops in one sentence naming the
    first (pid, host, start) and touches none of its files (before, it took the first's unfinished dataset for a killed
    run's: --overwrite removed it under the first, whose dataset then could not load); the first finishes whole."""
    imgs = images_dir(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([record(i % 4, answer=f"Answer {i}.") for i in range(1500)]))
    out = tmp_path / "out"
    args = ["--json", tmp_path / "d.json", "--images", imgs, "--out", out, "--shard-size", "20", "--overwrite"]
    first = started_pack(args, out, "shard-000001.tar")
    try:
        before = tree(out)
        code, said = second_pack(args, capsys)
        assert code == 1 and tree(out) == before
        said = said.strip()
        assert said.count("\n") == 0 and "Traceback" not in said, said
        assert re.fullmatch(rf"pack: {re.escape(str(out))} is being written by another pack \(pid {first.pid} on host "
                            rf"\S+, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: data\.py pack --json .*\); wait for it "
                            "to end, or choose another --out", said), said
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert first.wait(120) == 0, first.communicate()
    assert len(open_stream(out, tok)) == 1500 and not (out / pack.PACK_LOCK).exists()


@pytest.mark.slow  # a python + torch start-up
def test_a_second_pack_of_the_same_mixture_refuses_naming_the_first(tmp_path, tok, capsys):
    """`data.py pack --mixture M --raw RAW` twice, the second while the first packs: the second stops in one
    sentence naming the first and removes nothing (before, it took the first's unfinished datasets for a killed
    run's, the first said "packed" of datasets that could not load, and a rerun said "already packed"); the first
    finishes, and both datasets load."""
    (tmp_path / "raw").mkdir()
    imgs = images_dir(tmp_path / "raw")
    (tmp_path / "raw/big.json").write_text(json.dumps([record(i % 4, answer=f"Answer {i}.") for i in range(1500)]))
    (tmp_path / "raw/small.json").write_text(json.dumps([record(i % 4, answer=f"Small {i}.") for i in range(7)]))
    (tmp_path / "mix.yaml").write_text("datasets:\n  - json_path: big.json\n    path: packed/big\n"
                                       "  - json_path: small.json\n    path: packed/small\n")
    args = ["--mixture", tmp_path / "mix.yaml", "--raw", tmp_path / "raw", "--images", imgs, "--shard-size", "20"]
    first = started_pack(args, tmp_path / "packed/big", "shard-000001.tar")
    try:
        before = tree(tmp_path / "packed")
        code, said = second_pack(args, capsys)
        assert code == 1 and tree(tmp_path / "packed") == before
        said = said.strip()
        assert said.count("\n") == 0 and "Traceback" not in said, said
        assert re.fullmatch(rf"pack: \S+/packed/(big|small) is being written by another pack \(pid {first.pid} on "
                            r"host \S+, started [-\d]+ [:\d]+: data\.py pack --mixture .*\); wait for it to end, or "
                            "choose another --out", said), said
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert first.wait(120) == 0, first.communicate()
    assert len(open_stream(tmp_path / "packed/big", tok)) == 1500 and len(open_stream(tmp_path / "packed/small", tok)) == 7


def test_where_flock_is_refused_the_pid_in_the_lock_file_decides(tmp_path, monkeypatch, capsys):
    """A file system without locks (flock: ENOLCK): a lock file naming a live process on this host refuses the pack,
    naming it; one whose process is gone is stale, and the pack goes on, saying the folder could not be locked."""
    import errno
    import socket

    imgs = images_dir(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([record(i) for i in range(4)]))
    out = tmp_path / "out"
    out.mkdir()

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(pack.fcntl, "flock", no_locks)
    live = subprocess.Popen(["sleep", "60"])
    try:
        (out / pack.PACK_LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid, "started": 0}))
        with pytest.raises(SystemExit, match=rf"is being written by another pack \(pid {live.pid} on host .*remove "):
            pack.pack(tmp_path / "d.json", imgs, out)
    finally:
        live.kill()
        live.wait()
    assert json.loads((out / pack.PACK_LOCK).read_text())["pid"] == live.pid  # nothing written
    pack.pack(tmp_path / "d.json", imgs, out)  # its process is gone: stale
    assert pack.finished(out) and "cannot be locked (No locks available)" in capsys.readouterr().err


@pytest.mark.slow  # a python + torch start-up (and two spawned workers: ~20 s, make test-full only)
@pytest.mark.parametrize("stop, workers", [("SIGTERM to the command", 1),
                                           pytest.param("Ctrl-C to its process group", 2, marks=pytest.mark.full)])
def test_a_stopped_pack_says_it_was_interrupted_and_exits_nonzero(tmp_path, stop, workers):
    """SIGTERM (a scheduler's stop) or Ctrl-C (SIGINT to the terminal's group, record workers too) mid-pack: the last
    line says interrupted and what is left (before: killed with no word, a worker's traceback, or a progress line's
    "done in" last), the exit status is 130, and the folder is released."""
    imgs = images_dir(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([record(i % 4, answer=f"Answer {i}.") for i in range(1500)]))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "data.py"), "pack", "--json", str(tmp_path / "d.json"),
                             "--images", str(imgs), "--out", str(out), "--shard-size", "20", "--workers", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (out / "shard-000001.tar").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    if workers == 1:
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert not (out / "shard-000074.tar").exists(), "stopped too late"
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and "done" not in err and "Traceback" not in err and "Worker" not in err, err
    assert re.fullmatch(rf"pack: interrupted after [\d,]+ of 1,500 records: {re.escape(str(out))} is left unfinished "
                        r"\(no \.nv-meta/\.info\.json: training and audit refuse it\); pack it again with --overwrite.*",
                        last), last
    assert not pack.finished(out) and not (out / pack.PACK_LOCK).exists()


@pytest.fixture
def packed(tmp_path):
    imgs = images_dir(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([record(i % 4, answer=f"Answer {i}.") for i in range(9)]))
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out", shard_size=4)
    return tmp_path / "out"


def truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage,message", [
    ("truncated_tar", r"shard-000001\.tar: \d+ bytes where .*llavax\.json records"),
    ("short_idx", r"shard-000001\.tar\.idx: does not match .*3 samples where \.nv-meta says 4"),
    ("stale_idx", r"shard-000001\.tar\.idx: does not match .*samples where \.nv-meta says 4"),
    ("unlisted_shard", r"shard-000007\.tar: a shard that \.nv-meta/\.info\.json does not list"),
    ("missing_shard", r"shard-000002\.tar: listed in .*split\.yaml but missing"),
])
def test_loader_refuses_an_inconsistent_folder_naming_the_file(packed, tok, damage, message):
    open_stream(packed, tok)  # whole, it loads
    shard = packed / "shard-000001.tar"
    idx = packed / "shard-000001.tar.idx"
    if damage == "truncated_tar":
        truncate(shard, shard.stat().st_size // 2)
    elif damage == "short_idx":
        truncate(idx, idx.stat().st_size - 8)
    elif damage == "stale_idx":
        idx.write_bytes((packed / "shard-000002.tar.idx").read_bytes())  # the 1-sample last shard's index
    elif damage == "unlisted_shard":
        (packed / "shard-000007.tar").write_bytes(shard.read_bytes())
    else:
        (packed / "shard-000002.tar").unlink()
    with pytest.raises(shards.DatasetError, match=message):
        open_stream(packed, tok)


def test_a_bare_tar_with_a_short_or_truncated_index_is_refused(packed, tok):
    tar = packed / "shard-000000.tar"
    idx = packed / "shard-000000.tar.idx"
    assert len(open_stream(tar, tok)) == 4
    truncate(idx, idx.stat().st_size - 8)
    with pytest.raises(shards.DatasetError, match=r"shard-000000\.tar\.idx: .*more samples follow"):
        open_stream(tar, tok)
    idx.unlink()
    truncate(tar, tar.stat().st_size // 2)
    with pytest.raises(shards.DatasetError, match=r"shard-000000\.tar: truncated"):
        open_stream(tar, tok)


def test_pack_over_an_existing_dataset_refuses_unless_overwrite_which_removes_stale_shards(packed, tmp_path, tok):
    (tmp_path / "small.json").write_text(json.dumps([record(0), record(1)]))
    with pytest.raises(SystemExit, match="already holds a dataset"):
        pack.pack(tmp_path / "small.json", tmp_path / "images", packed, shard_size=4)
    assert len(open_stream(packed, tok)) == 9  # untouched
    pack.pack(tmp_path / "small.json", tmp_path / "images", packed, shard_size=4, overwrite=True)
    assert sorted(p.name for p in packed.iterdir() if p.name != ".nv-meta") == ["shard-000000.tar",
                                                                                "shard-000000.tar.idx"]
    assert len(open_stream(packed, tok)) == 2


# -----------------------------------------------------------------------------
# open files


def test_the_loader_keeps_a_bounded_number_of_shards_open(tmp_path, tok):
    (tmp_path / "images").mkdir()
    recs = [record(i, image=False, answer=f"Answer {i}.") for i in range(3 * shards.MAX_OPEN_SHARDS)]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    pack.pack(tmp_path / "d.json", tmp_path / "images", tmp_path / "out", shard_size=1)
    s = open_stream(tmp_path / "out", tok, batch_size=8, shuffle_block=1)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    got = answers(s, tok)
    assert sorted(got) == sorted(r["conversations"][1]["value"] for r in recs)
    assert fds() - before <= shards.MAX_OPEN_SHARDS


def test_a_strict_pack_that_skips_leaves_no_dataset_training_would_read(tmp_path, capfd):
    """--strict with a skip exits non-zero and writes no .info.json: the loader (and so training and audit) refuses
    the folder in one sentence naming --strict, its llavax.json keeps the skips, and a mixture's pack counts it
    as refused, not packed."""
    imgs = images_dir(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([record(0), record(1), record(7)]))  # 7.jpg is missing
    with pytest.raises(SystemExit, match="--strict: 1 records were skipped, so .* is left unfinished"):
        pack.pack(tmp_path / "d.json", imgs, tmp_path / "strict", strict=True)
    out = tmp_path / "strict"
    assert not (out / ".nv-meta" / ".info.json").exists() and not pack.finished(out) and pack.refused(out)
    recorded = json.loads((out / ".nv-meta" / "llavax.json").read_text())
    assert recorded["skipped"] == {"missing_image": 1} and recorded["skipped_first"] == {"missing_image": ["rec7"]}
    with pytest.raises(shards.DatasetError, match="not a finished dataset: pack --strict: 1 records were skipped"):
        shards.shard_files(str(out))  # what ShardStream reads a folder by
    with pytest.raises(SystemExit, match="already holds a dataset"):  # and a plain pack over it asks for --overwrite
        pack.pack(tmp_path / "d.json", imgs, out)
    assert dict(pack.pack(tmp_path / "d.json", imgs, out, overwrite=True).counts) == {"missing_image": 1}
    assert pack.finished(out) and not pack.refused(out)


# -----------------------------------------------------------------------------
# settings: one no pack could mean is refused before anything is read, never blamed on the data


@pytest.mark.parametrize("flags,named", [
    (["--video-fps", "nan"], "--video-fps: 'nan' is not a finite number > 0"),
    (["--video-fps", "0"], "--video-fps: '0' is not a finite number > 0"),
    (["--video-timeout", "0"], "--video-timeout: '0' is not a finite number > 0"),
    (["--video-timeout", "inf"], "--video-timeout: 'inf' is not a finite number > 0"),
    (["--video-memory-mb", "0"], "--video-memory-mb: '0' is not a whole number >= 1"),
    (["--video-max-pixels", "-1"], "--video-max-pixels: '-1' is not a whole number >= 1"),
    (["--frames-upbound", "-2"], "--frames-upbound: '-2' is not a whole number >= 0"),
    (["--force-sample", "--frames-upbound", "0"], "--force-sample takes --frames-upbound frames a video"),
    (["--val-ratio", "1"], "--val-ratio: '1' is not a share >= 0 and < 1"),
    (["--val-ratio", "nan"], "--val-ratio: 'nan' is not a share >= 0 and < 1"),
    (["--shard-size", "0"], "--shard-size: '0' is not a whole number >= 1"),
    (["--workers", "-3"], "--workers: '-3' is not a whole number >= 1"),
])
def test_nonsense_pack_and_video_flags_exit_2_before_anything_is_read(tmp_path, capsys, flags, named):
    """Before, --video-fps nan (and a zero timeout, memory or pixel bound) dropped every video as video_corrupt and
    exited 0, --val-ratio 1 packed every record into val, and --shard-size 0 / --workers -3 were taken."""
    import data

    imgs = images_dir(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps([record(i) for i in range(4)]))
    with pytest.raises(SystemExit) as e:
        data.main(["pack", "--json", str(tmp_path / "d.json"), "--images", str(imgs), "--out", str(tmp_path / "out"),
                   *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert " pack: error: " in err[-1] and named in err[-1], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="shard_size and workers must be whole numbers >= 1 and val_ratio"):
        pack.pack(tmp_path / "d.json", imgs, tmp_path / "out", val_ratio=1.0)
