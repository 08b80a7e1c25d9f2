"""
Reading the published sources that pack.py packs: a LLaVA JSON/JSONL file and its image folder, or the rows of
parquet or Arrow files with their images inside (LLaVA-OneVision-Data's schema: `id`, `image` {bytes, path},
`conversations` [{from, value}]), local or in a bucket (s3://, gs://).

Iterating a source yields, in order, (record, images) or (None, (where, reason)) for an entry that cannot be read
at all. A record is a LLaVA record ({"id", "image", "conversations"}); images is what image_bytes() reads its image
names from: the image folder, or a parquet row's own {name: bytes}.
"""

import codecs
import glob
import json
import os
import sys
from pathlib import Path

import storage
from shards import log

# -----------------------------------------------------------------------------
# a LLaVA JSON/JSONL file and its image folder


def read_text(path):
    """The text of a JSON/JSONL file: UTF-8 with or without a BOM, or UTF-16/32 with a BOM; anything else exits."""
    raw = storage.read_bytes(path, big=True)
    boms = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
            (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))  # UTF-32-LE's BOM starts like UTF-16-LE's
    codec = next((codec for bom, codec in boms if raw.startswith(bom)), "utf-8")
    if codec == "utf-8" and b"\x00" in raw[:4096]:
        sys.exit(f"pack: {path}: NUL bytes: UTF-16/32 text without a byte-order mark? Convert it to UTF-8")
    try:
        return raw.decode(codec)
    except UnicodeDecodeError as e:
        sys.exit(f"pack: {path}: not valid {codec} text (byte {e.start}: {e.reason}); convert it to UTF-8")


def read_records(path):
    """Yield (record, None) or (None, (where, reason)) from a LLaVA JSON array or a JSONL file."""
    text = read_text(path)
    if text.lstrip().startswith("{"):  # JSONL, or one JSON object
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # several lines of JSON: JSONL
        if isinstance(whole, dict) and "conversations" not in whole:
            sys.exit(f"pack: {path}: one JSON object (keys {', '.join(list(whole)[:5])}), not LLaVA data: a JSON array "
                     "or JSONL of {\"id\", \"image\", \"conversations\"} records")
        if isinstance(whole, dict):  # one record, perhaps over several lines
            yield whole, None
            return
    if not text.lstrip().startswith("["):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line), None
                except json.JSONDecodeError as e:
                    yield None, (f"line {n}", "malformed_json")
                    log(f"pack: {path} line {n}: malformed JSON ({e.msg}); skipped")
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:  # one broken array cannot be read around
        sys.exit(f"pack: {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}")
    yield from ((r, None) for r in records)


class JsonRecords:
    """The records of a LLaVA JSON/JSONL file (read whole: a JSON array cannot be streamed), images in images_dir."""

    def __init__(self, json_path, images_dir):
        self.name, self.images_dir, self.entries = str(json_path), images_dir, None

    def count(self):
        if self.entries is None:
            self.entries = list(read_records(self.name))
        return len(self.entries)

    def __iter__(self):
        self.count()
        for rec, err in self.entries:
            yield (rec, self.images_dir) if err is None else (None, err)


def image_path(images_dir, name):
    """(path, None), or (None, reason) for a name that is not a plain relative path inside images_dir."""
    name = name[0] if isinstance(name, list) and len(name) == 1 else name
    if not isinstance(name, str) or "\x00" in name:
        return None, "malformed_image_field"
    root = Path(images_dir).resolve()
    path = Path(root, name)
    # a shared dataset JSON must not make pack read files elsewhere: absolute paths, ../ and symlinks out
    try:
        inside = not os.path.isabs(name) and path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        return None, "malformed_image_field"
    if not inside:
        return None, "image_outside_images_dir"
    return path, None


def image_bytes(images, name):
    """(bytes, None) or (None, reason): the image a record names, from its row ({name: bytes}) or its image folder."""
    if isinstance(images, dict):
        data = images.get(name) if isinstance(name, str) else None
        return (data, None) if data is not None else (None, "missing_image")
    path, reason = image_path(images, name)
    if reason:
        return None, reason
    if not path.is_file():
        return None, "missing_image"
    return path.read_bytes(), None


# -----------------------------------------------------------------------------
# parquet and Arrow rows, images inside: LLaVA-OneVision-Data's schema, or other columns mapped onto it

COLUMNS = {"id": "id", "image": "image", "conversations": "conversations"}
SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 64  # rows decoded at a time: memory holds one row group's column chunks and this many rows' images


def pyarrow():
    try:
        import pyarrow as pa
    except ImportError:
        sys.exit("pack: parquet and Arrow sources need the pyarrow package: pip install pyarrow")
    return pa


def column_map(text):
    """--columns 'image=img,conversations=messages,id=uid' -> {"id", "image", "conversations": column}; an empty
    image column ('image=') reads every row as text-only."""
    found = dict(COLUMNS)
    for item in filter(None, (text or "").split(",")):
        ours, sep, theirs = item.partition("=")
        if not sep or ours.strip() not in COLUMNS or (not theirs.strip() and ours.strip() != "image"):
            sys.exit(f"pack: --columns {text!r}: give OURS=THEIRS pairs, OURS one of {', '.join(COLUMNS)} "
                     "(image= alone: no image column, every row text-only)")
        found[ours.strip()] = theirs.strip() or None
    return found


def expand(paths):
    """The parquet / Arrow files that paths name (files, folders: the files directly in them, or glob patterns),
    in the order given, each folder's and pattern's sorted."""
    found = []
    for path in paths:
        path = str(path)
        if storage.is_url(path) and any(c in path for c in "*?["):  # the prefix before the first pattern, listed
            base = path[:min(path.index(c) for c in "*?[" if c in path)].rsplit("/", 1)[0]
            found += [str(p) for p in storage.glob(base, path[len(base) + 1:])]
        elif any(c in path for c in "*?["):
            found += sorted(glob.glob(path))
        elif storage.is_url(path) and not storage.is_object(path):
            found += [str(storage.join(path, n)) for n in storage.ls(path) if n.endswith(SUFFIXES)]
        elif not storage.is_url(path) and Path(path).is_dir():
            found += sorted(str(p) for p in Path(path).iterdir() if p.name.endswith(SUFFIXES) and p.is_file())
        elif storage.is_url(path) or Path(path).is_file():
            found.append(path)
        else:
            sys.exit(f"pack: --parquet {path}: no such file, folder or pattern")
    if not found:
        sys.exit(f"pack: --parquet {' '.join(map(str, paths))}: no .parquet or .arrow file there")
    return found


class ParquetRows:
    """The rows of parquet or Arrow IPC files (HF datasets' cache files are Arrow streams), a record batch at a time:
    memory holds one row group's column chunks, not the file."""

    def __init__(self, paths, columns=None):
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        pyarrow()
        self.files, self.columns = expand(paths), column_map(columns) if not isinstance(columns, dict) else columns
        self.name = self.files[0] if len(self.files) == 1 else f"{self.files[0]} and {len(self.files) - 1} more"

    def count(self):
        """Rows in all files (None when an Arrow stream would have to be read through to know), every file's schema
        checked first: a file that cannot be read is refused before anything is written."""
        total = 0
        for path in self.files:
            with storage.open(path) as f:
                schema, rows, _ = open_table(f, path)
                check_schema(path, schema, self.columns)
            total = None if rows is None or total is None else total + rows
        return total

    def __iter__(self):
        for path in self.files:
            with storage.open(path) as f:
                schema, _, batches = open_table(f, path)
                names = check_schema(path, schema, self.columns)
                for batch in batches(names):
                    yield from batch_records(batch, self.columns)


def parquet(path):
    return str(path).endswith(".parquet")


def open_table(f, path):
    """(schema, rows or None, batches(columns) -> iterator of record batches) of a parquet file, or of an Arrow IPC
    file or stream."""
    pa = pyarrow()
    try:
        if parquet(path):
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(f)
            # one row group asked for at a time: iter_batches over the file reads several ahead, on threads
            return pf.schema_arrow, pf.metadata.num_rows, lambda names: (
                batch for g in range(pf.num_row_groups)
                for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=names, use_threads=False))
        try:
            reader = pa.ipc.open_file(f)
            return reader.schema, None, lambda names: (reader.get_batch(i).select(names)
                                                       for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # no footer: the stream format (what HF datasets writes)
            f.seek(0)
            reader = pa.ipc.open_stream(f)
            return reader.schema, None, lambda names: (batch.select(names) for batch in reader)
    except pa.ArrowInvalid as e:
        sys.exit(f"pack: {path}: not a {'parquet' if parquet(path) else 'Arrow'} file ({e})")


def image_kind(t):
    """'struct' ({bytes, path}), 'binary', or the same with '[]' for a list of them; None for anything else."""
    pa = pyarrow()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = image_kind(t.value_type)
        return inner + "[]" if inner and not inner.endswith("[]") else None
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return "struct" if binary(t.field(t.get_field_index("bytes")).type) else None
    return "binary" if binary(t) else None


def binary(t):
    pa = pyarrow()
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def turns_type(t):
    """Whether t is a list of {from, value} strings."""
    pa = pyarrow()
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    item = t.value_type
    return all(item.get_field_index(k) >= 0 and (pa.types.is_string(item.field(k).type) or
                                                 pa.types.is_large_string(item.field(k).type)) for k in ("from", "value"))


def check_schema(path, schema, columns):
    """The columns to read, or exit in one sentence that names the columns the file has."""
    conv, image, sample_id = columns["conversations"], columns["image"], columns["id"]
    fields = {f.name: f.type for f in schema}
    problem = None
    if conv not in fields:
        problem = f"no {conv!r} column (the conversations)"
    elif not turns_type(fields[conv]):
        problem = f"column {conv!r} is {fields[conv]}, not a list of {{from, value}} strings"
    elif image and image not in fields:
        problem = f"no {image!r} column (the images; image= for a text-only set)"
    elif image and not image_kind(fields[image]):
        problem = f"column {image!r} is {fields[image]}, not an image (a struct of bytes and path, binary, or a list)"
    elif sample_id != COLUMNS["id"] and sample_id not in fields:
        problem = f"no {sample_id!r} column (the ids)"
    if problem:
        found = ", ".join(f"{name} ({t})" for name, t in fields.items())
        sys.exit(f"pack: {path}: {problem}; its columns are {found} (map others with --columns "
                 "image=COL,conversations=COL,id=COL)")
    return [c for c in (sample_id, image, conv) if c and c in fields]


def row_images(value):
    """[bytes or None] of a row's image cell: None (no image), a {bytes, path} struct, bytes, or a list of those."""
    cells = value if isinstance(value, list) else [] if value is None else [value]
    return [cell.get("bytes") if isinstance(cell, dict) else cell for cell in cells
            if cell is not None and not (isinstance(cell, dict) and cell.get("bytes") is None and not cell.get("path"))]


def batch_records(batch, columns):
    """(record, {name: bytes}) for each row of a record batch: the record as its LLaVA JSON twin would be, its image
    names positions ("0", "1", ...) whose bytes the dict holds (a struct with a path but no bytes: missing_image)."""
    data = {c: batch.column(c).to_pylist() for c in batch.schema.names}
    for k in range(batch.num_rows):
        rec = {"conversations": data[columns["conversations"]][k]}
        if columns["id"] in data and data[columns["id"]][k] is not None:
            rec = {"id": data[columns["id"]][k]} | rec
        blobs = row_images(data[columns["image"]][k]) if columns["image"] else []
        names = [str(i) for i in range(len(blobs))]
        if names:
            rec["image"] = names[0] if len(names) == 1 and not isinstance(data[columns["image"]][k], list) else names
        yield rec, {n: b for n, b in zip(names, blobs) if b is not None}


# -----------------------------------------------------------------------------
# where a mixture's raw input lies (pack --mixture)


def raw_source(raw_dir, name, images_dir=None, columns=None):
    """The raw input of the dataset `name` under raw_dir: NAME.json or NAME.jsonl, its image names relative to
    images_dir (default raw_dir: LLaVA-NeXT's one image folder for every file), or a folder NAME/ of .parquet or .arrow
    files (LLaVA-OneVision-Data's layout: a folder a subset). None when neither is there; both is refused."""
    files = [path for path in (storage.join(raw_dir, name + ext) for ext in (".json", ".jsonl")) if storage.is_object(path)]
    folder = storage.join(raw_dir, name)
    tables = [n for n in storage.ls(folder) if n.endswith(SUFFIXES)]
    if len(files) + bool(tables) > 1:
        found = [storage.name(path) for path in files] + ([f"{name}/ ({len(tables)} table files)"] if tables else [])
        sys.exit(f"pack: {raw_dir}: the raw input of {name} is ambiguous: {', '.join(found)}; keep one")
    if files:
        images = images_dir or raw_dir
        if storage.is_url(images):
            sys.exit(f"pack: {files[0]}: its images must be in a local folder: give --images (got {images})")
        return JsonRecords(files[0], images)
    return ParquetRows([storage.join(folder, n) for n in tables], columns) if tables else None
