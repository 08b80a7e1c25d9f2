"""sources.py and pack --mixture: parquet and Arrow rows in LLaVA-OneVision-Data's schema pack to the bytes their JSON
twin with the images on disk packs to, locally and from S3 and GCS servers; a schema it cannot read is one sentence
naming the columns found; a parquet source is read a row group at a time; `pack --mixture` packs every dataset of a
mixture file, several at once, and a run killed midway, run again, gives the datasets of an uninterrupted run."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT
from PIL import Image

import data
import mixture
import pack
import sources
import storage

# -----------------------------------------------------------------------------
# twins: the same records as LLaVA JSON + an image folder, and as parquet rows with the images inside


def photo(w, h, seed):
    """Smooth gradients plus noise: compresses like a photo, not like flat colour or pure noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(xx / rng.uniform(5, 40) + c) * np.cos(yy / rng.uniform(5, 40)) for c in range(3)], -1)
    return np.clip(127 + 100 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def encoded(i):
    """(file name, bytes): the formats and modes real sets hold, at sizes that divide nothing evenly."""
    img = Image.fromarray(photo(61 + 13 * (i % 7), 47 + 5 * (i % 4), i))
    kinds = [("jpg", "JPEG", img), ("png", "PNG", img.convert("RGBA")), ("jpg", "JPEG", img.convert("L")),
             ("webp", "WEBP", img), ("jpg", "JPEG", img.convert("CMYK")), ("png", "PNG", img.convert("P"))]
    ext, fmt, im = kinds[i % len(kinds)]
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return f"img/{i:03d}.{ext}", buf.getvalue()


def twins(n, first=0, several=False):
    """[(JSON record, parquet row, {file: bytes})]: images of six formats, text-only rows, a row without an id, a
    truncated image, an image named but absent, an untagged image, an unknown role, a multi-turn conversation.
    several: two images a row (an `image` list column, LLaVA-OneVision's multi-image records)."""
    out = []
    for i in range(first, first + n):
        files = dict(encoded(i + k * 1000) for k in range(1 + several))
        if i % 11 == 3:  # a truncated download
            files = {name: b[: len(b) // 3] for name, b in files.items()}
        text_only = i % 5 == 0 and not several
        tag = "" if i % 7 == 2 or text_only else "<image>\n" * (1 + several)
        conv = [{"from": "human", "value": f"{tag}What is in picture {i}?"}, {"from": "gpt", "value": f"Waves, {i}."}]
        if i % 4 == 1:
            conv += [{"from": "human", "value": "And the colour?"}, {"from": "gpt", "value": "Grey-blue."}]
        if i % 13 == 6:
            conv[0]["from"] = "Human"  # unknown_role
        rec = {} if i % 17 == 8 else {"id": f"ov-{i}"}
        cells = [{"bytes": b, "path": name} for name, b in files.items()]
        if i % 19 == 10:  # listed in the row without its bytes, as a JSON names a file that is not there
            cells[0]["bytes"], files = None, {}
        names = [c["path"] for c in cells]
        json_rec = rec | ({} if text_only else {"image": names if several else names[0]}) | {"conversations": conv}
        row = rec | {"image": None if text_only else cells if several else cells[0], "conversations": conv}
        out.append((json_rec, row, files))
    return out


def write_json_twin(folder, records):
    """The JSON file and the image folder its names are relative to."""
    folder.mkdir(parents=True, exist_ok=True)
    for _, _, files in records:
        for name, b in files.items():
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_bytes(b)
    (folder / "data.json").write_text(json.dumps([r for r, _, _ in records]))
    return folder / "data.json"


def table(records):
    rows = [{"id": None} | row for _, row, _ in records]
    return pa.Table.from_pylist(rows).append_column("data_source", pa.array(["unit-test"] * len(rows)))


def tree(folder):
    """{relative path: bytes} of every file under folder."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """40 single-image records and 9 with two images: a JSON file and its images packed (shards of 7, 20% val),
    and the same rows as two parquet files (row groups of 5 rows)."""
    d = tmp_path_factory.mktemp("twin")
    single, several = twins(40), twins(9, first=40, several=True)
    write_json_twin(d / "json", single + several)
    pack.pack(d / "json/data.json", d / "json", d / "from-json", shard_size=7, val_ratio=0.2)
    (d / "parquet").mkdir()
    pq.write_table(table(single), d / "parquet/train-00000-of-00002.parquet", row_group_size=5)
    pq.write_table(table(several), d / "parquet/train-00001-of-00002.parquet", row_group_size=5)
    return d


def test_parquet_rows_pack_to_the_bytes_of_their_json_twin(twin, tmp_path):
    """Through the command line, a glob of two files, two workers: every shard, index and .nv-meta file equal."""
    data.main(["pack", "--parquet", str(twin / "parquet/*.parquet"), "--out", str(tmp_path / "out"), "--shard-size",
               "7", "--val-ratio", "0.2", "--workers", "2"])
    expected = tree(twin / "from-json")
    assert tree(tmp_path / "out") == expected
    meta = json.loads(expected[".nv-meta/llavax.json"])
    kept = sum(s["samples"] for s in meta["shards"].values())
    assert kept == 49 - sum(meta["skipped"].values()) and {"corrupt_image", "missing_image", "unknown_role"} <= \
        set(meta["skipped"]) and any(name.startswith("val-") for name in meta["shards"])
    names = [m.name for s in meta["shards"] for m in tarfile.open(twin / "from-json" / s)]  # images, not only text
    assert any(n.endswith(".1.jpg") for n in names) and any(n.endswith(".png") for n in names)


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_arrow_files_pack_as_their_parquet_does(twin, tmp_path, kind):
    """HF datasets' cache files are Arrow IPC streams; the IPC file format (with a footer) reads the same."""
    parquet = sorted((twin / "parquet").glob("*.parquet"))
    for path in parquet:
        t = pq.read_table(path)
        with pa.OSFile(str(tmp_path / f"{path.stem}.arrow"), "wb") as sink:
            writer = (pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file)(sink, t.schema)
            for batch in t.to_batches(max_chunksize=4):
                writer.write_batch(batch)
            writer.close()
    pack.pack_source(sources.ParquetRows(str(tmp_path)), tmp_path / "out", shard_size=7, val_ratio=0.2)
    assert tree(tmp_path / "out") == tree(twin / "from-json")


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_parquet_in_a_bucket_packs_as_the_local_files_do(twin, tmp_path, bucket, request):
    url = request.getfixturevalue(bucket)
    for path in sorted((twin / "parquet").glob("*.parquet")):
        storage.write_bytes(f"{url}/raw/{path.name}", path.read_bytes())
    pack.pack_source(sources.ParquetRows(f"{url}/raw/train-*.parquet"), tmp_path / "out", shard_size=7, val_ratio=0.2)
    assert tree(tmp_path / "out") == tree(twin / "from-json")
    pack.pack_source(sources.ParquetRows(f"{url}/raw"), f"{url}/packed", shard_size=7, val_ratio=0.2)  # a folder
    assert storage.read_bytes(f"{url}/packed/shard-000000.tar") == (twin / "from-json/shard-000000.tar").read_bytes()


# -----------------------------------------------------------------------------
# other schemas: mapped by --columns, or refused in one sentence naming the columns found


def test_other_column_names_are_mapped_and_unreadable_schemas_refused(twin, tmp_path, capsys):
    """A set with its own names (uid, img as plain binary, messages) packs as the twin once mapped; unmapped, or with a
    column of the wrong type, it is refused in one line that lists what the file has."""
    # a binary column has no path: an image named without bytes has no form there
    records = [r for r in twins(40) if not (r[1]["image"] and r[1]["image"]["bytes"] is None)]
    rows = [{"uid": row.get("id"), "img": (row["image"] or {}).get("bytes"), "messages": row["conversations"]}
            for _, row, _ in records]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "own.parquet", row_group_size=8)
    pack.pack(write_json_twin(tmp_path / "json", records), tmp_path / "json", tmp_path / "from-json", shard_size=7)
    data.main(["pack", "--parquet", str(tmp_path / "own.parquet"), "--out", str(tmp_path / "mapped"), "--shard-size",
               "7", "--columns", "image=img,conversations=messages,id=uid"])
    assert tree(tmp_path / "mapped") == tree(tmp_path / "from-json")

    with pytest.raises(SystemExit) as e:
        data.main(["pack", "--parquet", str(tmp_path / "own.parquet"), "--out", str(tmp_path / "x")])
    said = str(e.value)
    assert "no 'conversations' column" in said and "uid (string), img (binary), messages (list<" in said and \
        "\n" not in said, said
    turns = [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]] * 2
    for columns, expected in (({"image": [1, 2], "conversations": ["a", "b"]},
                               "column 'conversations' is string, not a list of {from, value} strings; its columns are "
                               "image (int64), conversations (string)"),
                              ({"image": [1, 2], "conversations": turns}, "column 'image' is int64, not an image")):
        pq.write_table(pa.table(columns), tmp_path / "bad.parquet")
        with pytest.raises(SystemExit) as e:
            pack.pack_source(sources.ParquetRows(tmp_path / "bad.parquet"), tmp_path / "y")
        assert expected in str(e.value), str(e.value)
    # a bad file after a good one is refused before any shard is written
    with pytest.raises(SystemExit, match="bad.parquet: column 'image' is int64"):
        pack.pack_source(sources.ParquetRows([twin / "parquet/train-00000-of-00002.parquet", tmp_path / "bad.parquet"]),
                         tmp_path / "z", shard_size=2)
    assert not list((tmp_path / "z").iterdir())
    with pytest.raises(SystemExit, match="OURS one of id, image, conversations"):
        sources.column_map("picture=img")
    # image= : a text-only set with no image column at all
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in rows]), tmp_path / "text.parquet")
    pack.pack_source(sources.ParquetRows(tmp_path / "text.parquet", "image=,conversations=messages"), tmp_path / "t")
    skipped = json.loads((tmp_path / "t/.nv-meta/llavax.json").read_text())["skipped"]
    assert skipped.get("image_tag_without_image", 0) > 0 and "unknown_role" in skipped  # tags with no image: counted


def test_without_pyarrow_a_parquet_source_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(SystemExit, match=r"need the pyarrow package: pip install pyarrow$"):
        data.main(["pack", "--parquet", str(tmp_path / "a.parquet"), "--out", str(tmp_path / "out")])


def test_a_parquet_source_is_read_a_row_group_at_a_time(tmp_path):
    """40 row groups of 5 incompressible 100 KB images (20 MB): the first record costs pyarrow about one row group, and
    pack's pipeline pulls at most two chunks of records ahead of the shard it writes."""
    blob = np.random.default_rng(0).bytes(100_000)
    rows = [{"id": str(i), "image": {"bytes": blob[i:] + blob[:i], "path": None},
             "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]} for i in range(200)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "big.parquet", row_group_size=5, compression="none")
    del rows
    before = pa.total_allocated_bytes()
    it = iter(sources.ParquetRows(tmp_path / "big.parquet"))
    next(it)
    # one row group's column chunk and its decoded rows (2 x 500 KB), with slack; not the 20 MB file, nor the 7 MB that
    # iter_batches over the whole file held here, reading row groups ahead on threads
    assert pa.total_allocated_bytes() - before < 3 * 5 * 100_000
    pulled = []

    class Counted:
        name = "counted"

        def __iter__(self):
            for k in range(100_000):
                pulled.append(k)
                yield {"id": k, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, None

    first = next(pack.prepared(Counted(), None, 1, chunk=256))
    assert first[0] == 0 and len(pulled) <= 2 * 256 + 1, len(pulled)


# -----------------------------------------------------------------------------
# a mixture packed in one command

# Each raw kind: how a source's raw input is laid out under --raw (sources.raw_source), and the records it holds.
# A video kind (a JSON of "video" records and its files) goes here once pack decodes video files.


def raw_json(raw, name):
    """NAME.json in RAW, its images under RAW (LLaVA-NeXT's one image folder)."""
    write_json_twin(raw, twins(23))
    (raw / "data.json").rename(raw / f"{name}.json")


def raw_parquet(raw, name):
    """A folder NAME/ of parquet files (LLaVA-OneVision-Data's layout)."""
    (raw / name).mkdir(parents=True)
    records = twins(31, first=100)
    pq.write_table(table(records[:20]), raw / name / "part-0.parquet", row_group_size=6)
    pq.write_table(table(records[20:]), raw / name / "part-1.parquet", row_group_size=6)


RAW_KINDS = {"json": raw_json, "parquet": raw_parquet}


def mixture_folder(root):
    """A LLaVA-NeXT data YAML of one dataset a raw kind, and their raw inputs under root/raw: the JSON named by a
    json_path from the machine it was made on (its folder ignored), the parquet folder by the packed folder's name."""
    lines = ["datasets:"]
    for kind, write in RAW_KINDS.items():
        write(root / "raw", f"{kind}_set")
        lines += [f"  - json_path: /mnt/bn/elsewhere/{kind}_set.json", f"    path: packed/{kind}"] if kind == "json" \
            else [f"  - path: packed/{kind}_set"]
        lines.append('    sampling_strategy: "first:50%"')
    (root / "mix.yaml").write_text("\n".join(lines) + "\n")
    return root / "mix.yaml"


OUT = {"json": "json", "parquet": "parquet_set"}  # where each is packed, under packed/


def test_a_mixture_killed_midway_and_run_again_gives_the_datasets_of_one_run(tmp_path, monkeypatch, capsys):
    """Two datasets packed at once (--workers 2); the parquet one's process dies at its 14th record (shards 0 and 1
    written, no .nv-meta), the JSON one finishes. The rerun skips the finished one (its files untouched) and packs the
    other again from its start: every file equals an uninterrupted run's, and the mixture reads."""
    whole, broken = mixture_folder(tmp_path / "whole"), mixture_folder(tmp_path / "broken")
    table_rows = pack.pack_mixture(whole, whole.parent / "raw", workers=2, shard_size=6, val_ratio=0.1)
    assert [(r["path"].split("/")[-1], r["raw"], r["status"]) for r in table_rows] == \
        [("json", "json_set", "packed"), ("parquet_set", "parquet_set", "packed")]
    printed = capsys.readouterr().out
    assert "| dataset | raw input | status | kept train | kept val | dropped | drop reasons |" in printed

    real = pack.prepare_record

    def dies_midway(args):
        if isinstance(args[2], dict) and args[0] == 25:  # a parquet row (its images inside): SIGKILL, as the OOM killer
            os.kill(os.getpid(), signal.SIGKILL)
        return real(args)

    monkeypatch.setattr(pack, "prepare_record", dies_midway)  # the forked sources' processes inherit it
    with pytest.raises(SystemExit, match="1 datasets failed \\(parquet_set\\): run the same command again"):
        pack.pack_mixture(broken, broken.parent / "raw", workers=2, shard_size=6, val_ratio=0.1)
    left = tree(broken.parent / "packed/parquet_set")
    assert "shard-000001.tar" in left and not any(k.startswith(".nv-meta") for k in left), sorted(left)
    assert "failed (exit -9)" in capsys.readouterr().out
    monkeypatch.setattr(pack, "prepare_record", real)
    json_files = {p: p.stat().st_mtime_ns for p in (broken.parent / "packed/json").rglob("*")}
    table_rows = pack.pack_mixture(broken, broken.parent / "raw", workers=2, shard_size=6, val_ratio=0.1)
    assert [r["status"] for r in table_rows] == ["already packed", "packed"]
    assert {p: p.stat().st_mtime_ns for p in (broken.parent / "packed/json").rglob("*")} == json_files
    for kind in RAW_KINDS:
        assert tree(broken.parent / "packed" / OUT[kind]) == tree(whole.parent / "packed" / OUT[kind]), kind
    assert [r["kept"] for r in table_rows] == [r["kept"] for r in pack.pack_mixture(whole, whole.parent / "raw")]
    mix = mixture.Mixture(str(broken), seed=0)  # the mixture file now trains: its take rules over what was packed
    assert len(mix.sources) == len(RAW_KINDS)


def test_a_mixture_without_its_raw_input_is_one_sentence_before_any_work(tmp_path):
    yaml = mixture_folder(tmp_path)
    (tmp_path / "raw/json_set.json").unlink()
    with pytest.raises(SystemExit) as e:
        pack.pack_mixture(yaml, tmp_path / "raw")
    assert "no raw input under" in str(e.value) and "json_set" in str(e.value) and \
        "parquet_set" not in str(e.value) and not (tmp_path / "packed").exists()
    (tmp_path / "raw/json_set.jsonl").write_text("")
    (tmp_path / "raw/json_set").mkdir()
    (tmp_path / "raw/json_set/a.parquet").write_bytes(b"")
    with pytest.raises(SystemExit, match="the raw input of json_set is ambiguous: json_set.jsonl, json_set/"):
        pack.pack_mixture(yaml, tmp_path / "raw")


@pytest.mark.full  # the command line and a kill from outside, over the resume the test above covers in process
def test_a_killed_pack_command_leaves_no_writer_and_its_rerun_matches(tmp_path):
    """`data.py pack --mixture` killed (SIGKILL to the command alone) once the first dataset is finished and the second
    has written a shard: its source process ends with it (none writes on), and the same command again packs the
    second from its start, as one uninterrupted pack of it."""
    yaml = mixture_folder(tmp_path)
    big = tmp_path / "raw/parquet_set/part-2.parquet"  # enough rows that the second dataset is still being packed
    pq.write_table(table(twins(600, first=1000)), big, row_group_size=50)
    cmd = [sys.executable, str(ROOT / "data.py"), "pack", "--mixture", str(yaml), "--raw", str(tmp_path / "raw"),
           "--shard-size", "6"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    done, started = tmp_path / "packed/json/.nv-meta/.info.json", tmp_path / "packed/parquet_set/shard-000000.tar"
    t0 = time.monotonic()
    while not started.exists() and proc.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # the command alone, once its second dataset has written a shard
    proc.wait()
    assert done.exists() and not (tmp_path / "packed/parquet_set/.nv-meta/.info.json").exists(), proc.stdout.read()
    t0 = time.monotonic()
    while session_processes(proc.pid) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    # gone, and none went on writing: the second dataset is still unfinished (an orphan would have completed it)
    assert not session_processes(proc.pid) and not (tmp_path / "packed/parquet_set/.nv-meta/.info.json").exists()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "| already packed |" in r.stdout and "| packed |" in r.stdout, r.stdout + r.stderr
    pack.pack_source(sources.ParquetRows(tmp_path / "raw/parquet_set"), tmp_path / "straight", shard_size=6)
    assert tree(tmp_path / "packed/parquet_set") == tree(tmp_path / "straight")


def session_processes(sid):
    """The live processes of session sid (the killed command's children and their pool workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if proc.name.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(proc.name))
    return found
