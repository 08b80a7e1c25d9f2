"""
Mixtures of datasets: the sources a run's data_dir names, the samples each keeps, and the order in which a run draws
them (the loader, loader.py, reads them; one packed dataset is a mixture of one source). data_dir is one of:
  - one dataset: a folder written by `data.py pack` or `energon prepare`, or a .tar (local, s3:// or gs://);
  - a list in the config file, a dict a source: {"path": ..., "weight": 2.0} or {"path": ..., "repeat": 1}, with
    optionally "take": "first:10%" (LLaVA-NeXT's sampling_strategy) and "name";
  - a YAML file: Megatron-Energon's metadataset (MetadatasetV2: blend, blend_epochized, subset; paths relative to the
    file), or LLaVA-NeXT's data YAML (datasets: [{path, sampling_strategy}], each `path` a packed dataset).
Weighted sources (Energon's blend): each position of the global order draws a source with probability
weight / sum of weights. Repeated sources (blend_epochized; LLaVA-NeXT's concatenation, repeat 1): a mixture epoch
holds each kept sample of source i repeat_i times, the sources interleaved at random. Either way the sample at a
position is a function of (seed, position): a resume needs only the position.
"""

import functools
import json
import math
import os
import random
import re
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

import storage
from shards import all_sample_offsets, shard_files

BLOCK = 1 << 14  # positions whose sources are drawn together: their counts, then their arrangement
CUM_EVERY = 64  # blocks between the per-source counts kept, so that any position is reached without a replay
# LLaVA-NeXT's rule: split(":"), then int(N) (whitespace around N allowed), N% as ceil(N x records / 100)
TAKE_RE = re.compile(r"^(first|end|random):\s*(\d+)\s*(%?)\s*$")
GROUP_CYCLE = 1 << 16  # groups whose modalities are drawn together: each modality's share of them exact over a cycle


class MixtureError(ValueError):
    """A mixture that cannot be read or drawn from: one sentence naming the source or file and the reason."""


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its folder (or tar), the split part read, how often it is drawn, what it keeps."""

    name: str
    path: str
    part: str = "train"
    weight: float | None = None  # Energon's blend: drawn with probability weight / sum
    repeat: float | None = None  # blend_epochized: its kept samples repeat times a mixture epoch
    take: str = "all"  # all, first:N, end:N, random:N; N a count or a percentage (N%)
    raw: str = ""  # the published file it is packed from, where the mixture names one (json_path beside path)
    # False: a source of the recipe that was never published (a LLaVA-NeXT file's `released: false`): left out, and
    # said, where its dataset is not there; records: the count of the file the recipe read (its share, when left out)
    released: bool = True
    records: int | None = None


# -----------------------------------------------------------------------------
# reading a mixture: a config list, an Energon metadataset, a LLaVA-NeXT data YAML


def sources(data_dir, split="train", every=False):
    """[Source] that data_dir names for `split` ('train' or 'val'). A val source reads its dataset's val part whole.
    A source marked never published whose dataset is not there is left out (left_out says which), unless every."""
    if isinstance(data_dir, Source) or (isinstance(data_dir, (list, tuple)) and data_dir and
                                        all(isinstance(x, Source) for x in data_dir)):
        return [data_dir] if isinstance(data_dir, Source) else list(data_dir)  # resolved already
    if isinstance(data_dir, (list, tuple)) and not data_dir:
        raise MixtureError("data_dir: a mixture with no sources (an empty list)")
    if isinstance(data_dir, (list, tuple)) and all(isinstance(x, (str, Path)) for x in data_dir):
        data_dir = [{"path": str(x)} for x in data_dir] if len(data_dir) > 1 else str(data_dir[0])
    if isinstance(data_dir, (list, tuple)):
        found = config_sources(data_dir, split)
    elif str(data_dir).endswith((".yaml", ".yml")):
        found = yaml_sources(str(data_dir), split)
    else:
        found = [Source(dataset_name(data_dir), str(data_dir), split, weight=1.0)]
    if split != "train":  # one dataset under two take rules has one val split, evaluated once
        kept = {}
        for s in found:
            kept.setdefault((s.path.rstrip("/"), s.part), s)
        found = list(kept.values())
    found = unique_names(found)
    gone = [] if every else left_out(found)
    if gone and len(gone) == len(found):
        raise MixtureError(f"{data_dir}: every source is one nobody published (released: false) and none is there")
    return [s for s in found if s not in gone]


def left_out(found):
    """The sources of `found` a mixture marks never published (released: false) whose dataset is not there: packing
    and training the recipe as released leave them out, and say so (Mixture.left_out_line, pack --mixture)."""
    return [s for s in found if not s.released and not storage.exists(s.path)]


GENERIC = ("shards", "data", "train", "val", "preference", "onpolicy")  # folder names data.py and dpo.py write


def dataset_name(path):
    """A source's default name: its folder's name; its parent's for 'shards', parent/name for another generic one
    (data/shapes/preference: shapes/preference)."""
    parts = [p for p in str(path).rstrip("/").split("/") if p and not p.endswith(":")]
    name = parts[-1] if parts else str(path)
    if name in GENERIC and len(parts) > 1:
        name = f"{parts[-2]}/{name}" if name != "shards" else parts[-2]
    return re.sub(r"\.(tar|ya?ml)$", "", name)


def unique_names(found):
    """The sources, a name given twice numbered in order (one dataset under two rules: a#1, a#2), never onto a name
    another source has."""
    seen = {}
    for s in found:
        seen[s.name] = seen.get(s.name, 0) + 1
    used, out = {s.name for s in found}, []
    for s in found:
        if seen[s.name] == 1:
            out.append(s)
            continue
        k = 1
        while f"{s.name}#{k}" in used:
            k += 1
        used.add(f"{s.name}#{k}")
        out.append(Source(**(asdict(s) | {"name": f"{s.name}#{k}"})))
    return out


SOURCE_KEYS = {"path", "weight", "repeat", "take", "name"}


def config_sources(entries, split, where="data_dir"):
    """Sources from a config list of dicts {path, weight | repeat, take, name}."""
    out = []
    for i, e in enumerate(entries):
        at = f"{where}[{i}]"
        e = {"path": str(e)} if isinstance(e, (str, Path)) else e
        if not isinstance(e, dict):
            raise MixtureError(f"{at}: a source is a dict like {{'path': 'data/x', 'weight': 1.0}}, got {e!r}")
        unknown = sorted(set(e) - SOURCE_KEYS)
        if unknown:
            raise MixtureError(f"{at}: unknown key {unknown[0]!r} (a source takes {sorted(SOURCE_KEYS)})")
        if not isinstance(e.get("path"), (str, Path)) or not str(e["path"]):
            raise MixtureError(f"{at}: no 'path' (the packed dataset it reads)")
        out.append(make_source(at, str(e["path"]), e.get("name"), split, e.get("weight"), e.get("repeat"),
                               e.get("take", "all")))
    return check_modes(out, where)


def number(value):
    """A YAML number: PyYAML reads 1e-3 (no dot) as a string, which Energon's reader takes as a float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def positive(value):
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def make_source(at, path, name, split, weight, repeat, take):
    if path.endswith((".yaml", ".yml")):  # read as a tar it was a page of tarfile's errors; LLaVA-NeXT refuses it too
        raise MixtureError(f"{at}: {path} is a mixture file, not a packed dataset: a source of a list or of a "
                           "LLaVA-NeXT data file is a dataset (only an Energon metadataset nests other files)")
    if weight is not None and repeat is not None:
        raise MixtureError(f"{at}: both a weight and a repeat count; a mixture draws by weight or by repetition")
    weight, repeat = number(weight), number(repeat)
    for key, value in (("weight", weight), ("repeat", repeat)):
        if value is not None and not positive(value):
            raise MixtureError(f"{at}: {key} must be a number > 0, got {value!r}")
    take = parse_take(at, take)
    if split != "train":  # held out: each source's val part, whole, unweighted
        return Source(name or dataset_name(path), path, split)
    return Source(name or dataset_name(path), path, split, None if weight is None else float(weight),
                  None if repeat is None else float(repeat), take)


def check_modes(found, where):
    """Every source of a mixture weighted, or every one repeated; none of either: each kept sample once an epoch."""
    if not found:
        raise MixtureError(f"{where}: a mixture with no sources")
    weighted = [s.name for s in found if s.weight is not None]
    repeated = [s.name for s in found if s.repeat is not None]
    if weighted and len(weighted) != len(found):
        other = next(s.name for s in found if s.weight is None)
        raise MixtureError(f"{where}: {weighted[0]} has a weight but {other} has none: weigh every source, or give "
                           "each a repeat count")
    if not weighted and not repeated:
        return [Source(**(asdict(s) | {"repeat": 1.0})) if s.part == "train" else s for s in found]
    if repeated and len(repeated) != len(found):
        other = next(s.name for s in found if s.repeat is None)
        raise MixtureError(f"{where}: {repeated[0]} has a repeat count but {other} has none")
    return found


def parse_take(at, take):
    """A take rule as LLaVA-NeXT's LazySupervisedDataset reads a sampling_strategy, written without its spaces
    ('first: 10%' -> 'first:10%'). Where LLaVA-NeXT's reading is an accident (it keeps every record of a rule it
    does not know, and of end:0, whose slice [-0:] is the whole list), the rule is refused instead."""
    if take == "all":
        return take
    m = TAKE_RE.match(take) if isinstance(take, str) else None
    if m and m[1] == "end" and int(m[2]) == 0:
        raise MixtureError(f"{at}: take {take!r} keeps every record in LLaVA-NeXT (its slice records[-0:] is the whole "
                           "list), which cannot be what is meant: write 'all', or leave the source out")
    if m:
        return f"{m[1]}:{int(m[2])}{m[3]}"
    near = re.match(r"^\s*(first|end|random)\s*:\s*([^%]*?)\s*%?\s*$", take) if isinstance(take, str) else None
    if near and not re.fullmatch(r"\d+", near[2]):
        raise MixtureError(f"{at}: take {take!r}: N must be a whole number of records or a whole percentage like 10% "
                           f"(LLaVA-NeXT reads N with int(), which fails on {near[2]!r} or, when it is negative, slices "
                           "from the other end)")
    if near:
        raise MixtureError(f"{at}: take {take!r}: LLaVA-NeXT reads {take.split(':')[0]!r} (the text before the colon) "
                           f"as no rule and keeps every record: write it without spaces there, like '{near[1]}:10%'")
    raise MixtureError(f"{at}: take (sampling_strategy) must be 'all', 'first:N', 'end:N' or 'random:N' with N a "
                       f"count or a percentage like 10%, got {take!r} (LLaVA-NeXT keeps every record of a rule it "
                       "does not know)")


def load_yaml(path):
    import yaml

    try:
        doc = yaml.safe_load(storage.read_text(path))
    except FileNotFoundError:
        raise MixtureError(f"{path}: no such mixture file") from None
    except yaml.YAMLError as e:
        raise MixtureError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise MixtureError(f"{path}: a mixture file is a mapping (Energon's MetadatasetV2 or LLaVA-NeXT's "
                           f"datasets: list), got {type(doc).__name__}")
    return doc


def relative(yaml_path, path):
    """A path of a mixture file, relative to the file's folder unless absolute or a URL (as Energon resolves them)."""
    path = str(path)
    if storage.is_url(path) or Path(path).is_absolute():
        return path
    return storage.join(storage.parent(yaml_path), path) if storage.is_url(yaml_path) \
        else os.path.normpath(Path(yaml_path).parent / path)


def yaml_sources(path, split):
    doc = load_yaml(path)
    if "__class__" in doc or "splits" in doc:
        return energon_sources(path, doc, split)
    if "datasets" in doc:
        return next_sources(path, doc, split)
    raise MixtureError(f"{path}: neither an Energon metadataset (__class__: MetadatasetV2, splits:) nor a LLaVA-NeXT "
                       f"data file (datasets:); its keys: {sorted(doc)}")


NEXT_KEYS = {"json_path", "path", "sampling_strategy", "weight", "repeat", "name", "released", "records"}


def check_entry(at, e, allowed, what):
    """One entry of a mixture file: a mapping with no key but `allowed`."""
    if not isinstance(e, dict):
        raise MixtureError(f"{at}: expected {what}, got {e!r}")
    unknown = sorted(set(e) - allowed)
    if unknown:
        raise MixtureError(f"{at}: unknown key {unknown[0]!r} (expected {sorted(allowed)})")


def next_sources(path, doc, split):
    """LLaVA-NeXT's data YAML: `datasets:` a list of {json_path | path, sampling_strategy}; each path is the dataset
    that `data.py pack` made of the JSON (LLaVA-NeXT reads the JSON itself; we read packed shards); a json_path beside
    a path names the raw input `pack --mixture` packs it from."""
    entries = doc["datasets"]
    if not isinstance(entries, list):
        raise MixtureError(f"{path}: datasets must be a list of {{path, sampling_strategy}}")
    out = []
    for i, e in enumerate(entries):
        at = f"{path}: datasets[{i}]"
        check_entry(at, e, NEXT_KEYS, "a mapping with path and sampling_strategy")
        where = e.get("path") or e.get("json_path")
        if not where:
            raise MixtureError(f"{at}: no path")
        if str(where).endswith((".json", ".jsonl")):
            raise MixtureError(f"{at}: {where} is a LLaVA JSON, not a packed dataset: pack it with `python data.py "
                               f"pack --json {where} --images DIR --out DATASET` and give `path: DATASET`")
        source = make_source(at, relative(path, where), e.get("name"), split, e.get("weight"), e.get("repeat"),
                             str(e.get("sampling_strategy", "all")))
        if e.get("path") and e.get("json_path"):
            source = replace(source, raw=str(e["json_path"]))
        out.append(replace(source, **unpublished(at, e)))
    return check_modes(out, path)


def unpublished(at, e):
    """An entry's released: false and records: N (the recipe's records of a file that was never published)."""
    released, records = e.get("released", True), e.get("records")
    if not isinstance(released, bool):
        raise MixtureError(f"{at}: released must be true or false, got {released!r}")
    if records is not None and (isinstance(records, bool) or not isinstance(records, int) or records < 1):
        raise MixtureError(f"{at}: records must be a whole number >= 1 (the records of the file the recipe read), "
                           f"got {records!r}")
    return {"released": released, "records": records}


ENERGON_TOP = {"__module__", "__class__", "splits"}
ENERGON_SPLIT = {"path", "blend", "blend_epochized", "split_part", "subflavors", "subset", "dataset_config",
                 "shuffle_over_epochs_multiplier"}
# what an entry may hold besides its weight or repetitions; subflavors, dataset_config (field maps) and
# shuffle_over_epochs_multiplier change how Energon decodes or shuffles, not which samples a run reads
ENERGON_ENTRY = {"path", "split_part", "subflavors", "subset", "dataset_config", "shuffle_over_epochs_multiplier"}
# a V1 metadataset (__class__: Metadataset): each split a `datasets:` list, blended by weight; no subsets
ENERGON_V1_ENTRY = {"path", "split_part", "subflavor", "subflavors", "dataset_config", "shuffle_over_epochs_multiplier",
                    "weight"}


def energon_class(path, doc):
    """'MetadatasetV2' or 'Metadataset' (V1): what Energon's load_config builds of a metadataset file (V1 when it
    names no class)."""
    unknown = sorted(set(doc) - ENERGON_TOP)
    if unknown:
        raise MixtureError(f"{path}: unknown key {unknown[0]!r} in an Energon metadataset (expected {sorted(ENERGON_TOP)})")
    module, cls = doc.get("__module__", "megatron.energon"), doc.get("__class__", "Metadataset")
    if module != "megatron.energon" or cls not in ("MetadatasetV2", "Metadataset"):
        raise MixtureError(f"{path}: __module__: megatron.energon and __class__: MetadatasetV2 expected, got "
                           f"{doc.get('__module__')!r} / {doc.get('__class__')!r} (Energon also reads V1's Metadataset)")
    return cls


def in_chain(path, chain):
    """chain + (path,), or one sentence when path is already in it: a metadataset that names itself, directly or
    through others (Energon recurses until Python's stack runs out)."""
    key = path if storage.is_url(path) else os.path.realpath(path)
    names = [p for p, _ in chain] + [path]
    if key in [k for _, k in chain]:
        what = "names itself" if chain[-1][1] == key else f"names {path}, which leads back to it"
        raise MixtureError(f"{chain[-1][0]}: {what} ({' -> '.join(names)}): nested metadatasets in a cycle have no "
                           "end; name each file once")
    return chain + ((path, key),)


def energon_sources(path, doc, split, amount=1.0, mode=None, want=None, chain=()):
    """Megatron-Energon's metadataset (MetadatasetV2, or V1's Metadataset) for `split`, read as Energon 7.4 reads it:
    `path`, `blend` (weights, default 1, normalised at each level and multiplied down nested metadatasets),
    `blend_epochized` (repetitions, default 1, multiplied down) or V1's `datasets` (a blend); paths relative to the
    file; an entry's split_part defaults to the split read, and names the split of a nested metadataset read.
    want: 'train' or 'val', what the run builds (val sources are unweighted). chain: the files that led here."""
    want, chain = want or split, in_chain(path, chain)
    v1 = energon_class(path, doc) == "Metadataset"
    splits = doc.get("splits")
    if not isinstance(splits, dict) or (want == "train" and split not in splits):
        raise MixtureError(f"{path}: no splits: {split}: in the metadataset")
    if split not in splits:
        return []
    spec, at = splits[split], f"{path}: splits.{split}"
    if not isinstance(spec, dict):
        raise MixtureError(f"{at}: expected a mapping (path, blend or blend_epochized)")
    if v1 and set(spec) != {"datasets"}:
        named = "" if "__class__" in doc else ", which Energon reads a file that names no class as"
        raise MixtureError(f"{at}: a V1 metadataset (__class__: Metadataset{named}) has splits of `datasets:` only, "
                           f"got {sorted(spec)}")
    if "join" in spec:
        raise MixtureError(f"{at}: join (samples of several datasets zipped into one) is not something llavax reads; "
                           "give each dataset as a source of a blend")
    unknown = sorted(set(spec) - ENERGON_SPLIT - ({"datasets"} if v1 else set()))
    if unknown:
        raise MixtureError(f"{at}: unknown key {unknown[0]!r} (expected one of {sorted(ENERGON_SPLIT)})")
    kinds = [k for k in ("path", "blend", "blend_epochized", "datasets") if k in spec]
    if len(kinds) != 1:
        raise MixtureError(f"{at}: needs exactly one of path, blend, blend_epochized; has {kinds or 'none'}")
    if kinds[0] == "path":  # a nested file keeps its own blend mode, as Energon's DatasetReference passes it on
        return energon_entry(path, at, spec, split, amount, mode, want, chain)
    if "subset" in spec:
        raise MixtureError(f"{at}: a subset of a whole blend is not read here; give each entry its own subset")
    return energon_blend(path, f"{at}.{kinds[0]}", spec[kinds[0]], kinds[0], split, amount, mode, want, chain)


def energon_blend(path, at, entries, kind, split, amount, mode, want, chain):
    """The entries of a blend (or V1's datasets), each with its share of `amount`."""
    new_mode = "repeat" if kind == "blend_epochized" else "weight"
    if mode not in (None, new_mode):
        raise MixtureError(f"{at}: a {kind} inside a {'blend' if mode == 'weight' else 'blend_epochized'}: Energon "
                           "can only blend datasets of the same blend mode")
    key = "weight" if new_mode == "weight" else "repetitions"
    if not isinstance(entries, list) or not entries:
        raise MixtureError(f"{at}: expected a non-empty list of datasets")
    values = []
    for i, e in enumerate(entries):
        check_entry(f"{at}[{i}]", e, ENERGON_V1_ENTRY if kind == "datasets" else ENERGON_ENTRY | {key}, "a mapping")
        value = number(e.get(key, 1.0))
        if not positive(value):
            raise MixtureError(f"{at}[{i}]: {key} must be a number > 0, got {value!r}")
        values.append(value)
    total = sum(values) if new_mode == "weight" else 1.0
    out = [s for i, (e, v) in enumerate(zip(entries, values))
           for s in energon_entry(path, f"{at}[{i}]", e, split, amount * v / total, new_mode, want, chain)]
    return check_modes(out, path) if want == "train" else out


def energon_entry(path, at, e, split, amount, mode, want, chain=()):
    if "path" not in e:
        raise MixtureError(f"{at}: no path")
    target, part = relative(path, e["path"]), e.get("split_part") or split
    if str(target).endswith(".yml"):
        raise MixtureError(f"{at}: {e['path']}: Energon reads a nested metadataset only from a .yaml file")
    if str(target).endswith(".yaml"):  # a nested metadataset: its split `part`, inside this entry's share
        if "subset" in e:
            raise MixtureError(f"{at}: a subset of a nested metadataset is not read here; give its entries subsets")
        in_chain(target, chain)  # before reading it: a file that names itself is said so, not read again
        return energon_sources(target, load_yaml(target), part, amount, mode, want, chain)
    take = energon_subset(at, e.get("subset"))
    if want != "train":
        return [Source(dataset_name(target), target, part)]
    return [Source(dataset_name(target), target, part, amount if mode != "repeat" else None,
                   amount if mode == "repeat" else None, take)]


def energon_subset(at, subset):
    """Energon's `subset: {range: [start, end]}`: sample indices (end may be 'end'; past the split's samples it is
    refused when the split is read), or two percentages ('10%') with 0 <= start <= end <= 100, as a take rule; what
    Energon refuses is refused."""
    if subset is None:
        return "all"
    bounds = subset.get("range") if isinstance(subset, dict) and set(subset) == {"range"} else None
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise MixtureError(f"{at}: subset must be {{range: [start, end]}}, got {subset!r}")
    if all(type(b) is int or (b == "end" and k == 1) for k, b in enumerate(bounds)):
        if bounds[0] < 0 or (bounds[1] != "end" and bounds[1] < bounds[0]):
            raise MixtureError(f"{at}: subset range {bounds!r}: Energon needs 0 <= start <= end")
        return f"range:{bounds[0]},{bounds[1]}"
    pct = [percentage(b) for b in bounds]
    if None in pct:
        raise MixtureError(f"{at}: subset range {bounds!r}: give two sample indices ([0, 1000], the end may be "
                           f"'end') or two percentages (['0%', '25%'])")
    if not 0 <= pct[0] <= pct[1] <= 100:
        raise MixtureError(f"{at}: subset range {bounds!r}: Energon needs 0% <= start <= end <= 100%")
    return "range:" + ",".join(b.strip() for b in bounds)


def percentage(bound):
    """A subset bound like '25%' as a number (25.0), or None."""
    if not isinstance(bound, str) or not bound.strip().endswith("%"):
        return None
    try:
        value = float(bound.strip()[:-1])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# -----------------------------------------------------------------------------
# what each source keeps (take), and its own order of passes over them


@dataclass(frozen=True)
class Records:
    """What pack recorded of a dataset's samples (.nv-meta/llavax.json): the records of the file it was packed from,
    the record each sample of the part read was packed from, the records packed into its other shards (val), and each
    sample's length as LLaVA-NeXT's modality_lengths has it (words; > 0 with an image or video, < 0 text only)."""

    count: int
    train: np.ndarray
    elsewhere: np.ndarray
    lengths: np.ndarray


def runs(pairs):
    """[[first, count], ...] -> the record indices they hold."""
    return np.concatenate([np.arange(a, a + k) for a, k in pairs] or [np.zeros(0, dtype=np.int64)])


def packed_records(path, tars):
    """Records of a dataset folder's shards `tars` (in their order), or None where pack recorded none (a lone .tar,
    a dataset from `energon prepare` or an older pack)."""
    meta_path = storage.join(path, ".nv-meta", "llavax.json")
    if str(path).endswith(".tar") or not storage.exists(meta_path):
        return None
    meta = json.loads(storage.read_text(meta_path))
    shards, names = meta.get("shards", {}), [storage.name(t) for t in tars]
    mine = [shards.get(name, {}) for name in names]
    if "records" not in meta or any("records" not in s for s in mine):
        return None
    others = [runs(s["records"]) for name, s in shards.items() if name not in names and "records" in s]
    return Records(meta["records"], np.concatenate([runs(s["records"]) for s in mine]),
                   np.concatenate(others or [np.zeros(0, dtype=np.int64)]),
                   np.concatenate([np.asarray(s["lengths"], dtype=np.int64) for s in mine]))


@functools.lru_cache(maxsize=64)
def chosen_records(rule, count, name, seed):
    """The record indices (sorted) of a file of `count` records that a LLaVA-NeXT rule selects: first:N, end:N, or
    random:N (N% is ceil(N x count / 100), as LLaVA-NeXT rounds). random shuffles the record list with Python's
    random, as LLaVA-NeXT does, seeded by (seed, source name) so that every rank and resume selects the same."""
    how, number, pct = TAKE_RE.match(rule).groups()
    k = math.ceil(int(number) * count / 100) if pct else int(number)
    if how == "first":
        return np.arange(min(k, count))
    if how == "end":
        return np.arange(max(count - k, 0), count)
    order = list(range(count))
    random.Random(f"{seed}:{name}").shuffle(order)
    return np.sort(np.array(order[:k], dtype=np.int64))


def take_indices(rule, n, name, seed, records=None):
    """The sample indices (sorted) of a source of n samples that rule keeps. LLaVA-NeXT's rules select records of
    the file the source was packed from (records: what pack recorded) and keep the samples packed from them; without
    a record of that, the packed samples are counted instead. Energon's range counts the split's samples, as Energon
    does."""
    if rule == "all":
        return np.arange(n)
    if rule.startswith("range:"):
        return subset_indices(rule, n, name)
    if records is not None:
        return np.flatnonzero(np.isin(records.train, chosen_records(rule, records.count, name, seed)))
    how, number, pct = TAKE_RE.match(rule).groups()
    count = min(n, math.ceil(int(number) * n / 100) if pct else int(number))
    if how == "first":
        return np.arange(count)
    if how == "end":
        return np.arange(n - count, n)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # the same subset whatever the sources' order
    return np.sort(rng.permutation(n)[:count])


def subset_indices(rule, n, name):
    """Energon's subset: sample indices ('end': n) or percentages truncated to indices; a range past the n samples
    is refused, as Energon refuses it."""
    bounds = [n if x == "end" else int(n * (float(x[:-1]) / 100.0)) if x.endswith("%") else int(x)
              for x in rule[6:].split(",")]
    if bounds[1] > n:
        raise MixtureError(f"source {name}: subset range [{rule[6:]}] ends past its {n} samples (Energon refuses "
                           "such a range too): end it at 'end' or below")
    return np.arange(*bounds)


def take_counts(rule, records, name, seed, kept):
    """{records, train, val, dropped} of a LLaVA-NeXT rule on a source pack recorded: the records it selects, and
    of them those this split trains on, those pack held out for val, and those pack dropped (counted apart)."""
    if records is None or rule == "all" or rule.startswith("range:"):
        return None
    chosen = chosen_records(rule, records.count, name, seed)
    val = int(np.isin(chosen, records.elsewhere).sum())
    return {"records": len(chosen), "train": len(kept), "val": val, "dropped": len(chosen) - len(kept) - val}


class SourceOrder:
    """A source's kept samples, pass after pass: each pass the shards shuffled by (seed, pass), then each block of
    shuffle_block consecutive samples shuffled, so reads stay mostly sequential (for the first source of a mixture
    with every sample kept, exactly the order a lone dataset always had)."""

    def __init__(self, kept, shard_starts, seed, which, shuffle_block):
        self.kept, self.seed, self.which, self.shuffle_block = kept, seed, which, shuffle_block
        cuts = np.searchsorted(kept, shard_starts[1:-1])
        self.groups = np.split(kept, cuts)  # the kept samples of each shard
        self.cached = (None, None)

    def order(self, n_pass):
        if self.cached[0] != n_pass:
            rng = np.random.default_rng([self.seed, n_pass] if self.which == 0 else [self.seed, n_pass, self.which])
            order = np.concatenate([self.groups[s] for s in rng.permutation(len(self.groups))])
            for b in range(0, len(order), self.shuffle_block):
                order[b : b + self.shuffle_block] = rng.permutation(order[b : b + self.shuffle_block])
            self.cached = (n_pass, order)
        return self.cached[1]

    def at(self, draw):
        n_pass, i = divmod(draw, len(self.kept))
        return self.order(n_pass)[i]


# -----------------------------------------------------------------------------
# which source each position draws


HYPERGEOMETRIC_MAX = 10**9  # numpy's hypergeometric draws need fewer than this many items


def large_hypergeometric(rng, left, n):
    """n draws without replacement from an epoch of more than 1e9 items (`left` of each source): source by source,
    a hypergeometric draw of what is left, or its binomial approximation where numpy has no exact draw. The counts
    sum to n and never exceed what is left, so every epoch still holds each source exactly its count."""
    counts, rest = np.zeros(len(left), dtype=np.int64), int(left.sum())
    for i, good in enumerate(left.tolist()):
        bad = rest - good
        if n == 0:
            break
        if bad == 0:
            x = n
        elif good < HYPERGEOMETRIC_MAX and bad < HYPERGEOMETRIC_MAX:
            x = int(rng.hypergeometric(good, bad, n)) if good else 0
        else:
            x = min(max(int(rng.binomial(n, good / rest)), n - bad), good)
        counts[i], n, rest = x, n - x, bad
    return counts


class Blend:
    """Position -> (source, how many draws of that source came before). Positions go in blocks of BLOCK: a block's
    counts per source are drawn (weights: multinomial, i.e. an independent choice a position, as Energon's blend;
    repetitions: hypergeometric from what the mixture epoch has left), then arranged by a random permutation, all
    from a generator seeded by (seed, epoch, block)."""

    def __init__(self, kept_sizes, weights=None, repeats=None, seed=0):
        self.seed, self.n = seed, len(kept_sizes)
        if weights is not None:
            w = np.asarray(weights, dtype=float) / max(weights)  # 1e308 twice: no overflow in the sum
            self.p, self.per_epoch, self.epoch_len = w / w.sum(), None, None
        else:
            # Energon's RepeatDataset: int(n x repetitions) samples an epoch (2.5 x 10: two passes and half a third)
            self.per_epoch = np.array([int(k * r) for r, k in zip(repeats, kept_sizes)], dtype=np.int64)
            self.epoch_len = int(self.per_epoch.sum())
        self.cum, self.blocks = {}, OrderedDict()

    def where(self, position):
        """(epoch, block, offset in the block)."""
        epoch, q = (0, position) if self.epoch_len is None else divmod(position, self.epoch_len)
        return (epoch, *divmod(q, BLOCK))

    def size(self, block):
        return BLOCK if self.epoch_len is None else min(BLOCK, self.epoch_len - block * BLOCK)

    def draw(self, epoch, block, before):
        rng = np.random.default_rng([self.seed, 0x6D6978, epoch, block])
        if self.epoch_len is None:
            return rng.multinomial(BLOCK, self.p), rng
        left = self.per_epoch - before
        if left.sum() < HYPERGEOMETRIC_MAX:
            return rng.multivariate_hypergeometric(left, self.size(block)), rng
        return large_hypergeometric(rng, left, self.size(block)), rng

    def before(self, epoch, block):
        """Each source's draws in the blocks of this epoch before `block`."""
        base = block - block % CUM_EVERY
        known = max((b for e, b in self.cum if e == epoch and b <= base), default=0)
        counts = self.cum.get((epoch, known), np.zeros(self.n, dtype=np.int64)).copy()
        for b in range(known, block):
            if b % CUM_EVERY == 0:
                self.cum[(epoch, b)] = counts.copy()
            counts += self.draw(epoch, b, counts)[0]
        return counts

    def block(self, epoch, block):
        """(source of each position of the block, its draw number within its source)."""
        key = (epoch, block)
        if key not in self.blocks:
            before = self.before(epoch, block)
            counts, rng = self.draw(epoch, block, before)
            labels = rng.permutation(np.repeat(np.arange(self.n), counts))
            rank = np.empty(len(labels), dtype=np.int64)  # earlier positions of the block that drew the same source
            rank[np.argsort(labels, kind="stable")] = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts,
                                                                                          counts)
            offset = before + (epoch * self.per_epoch if self.per_epoch is not None else 0)
            self.blocks[key] = (labels, rank + offset[labels])
            if len(self.blocks) > 4:  # a rank's workers each read ahead a little: a few blocks are in use
                self.blocks.popitem(last=False)
        return self.blocks[key]

    def locate(self, position):
        if self.n == 1:  # one dataset: the position is its draw
            return 0, position
        epoch, block, offset = self.where(position)
        labels, draws = self.block(epoch, block)
        return int(labels[offset]), int(draws[offset])

    def counts_before(self, position):
        """Each source's draws at positions [0, position)."""
        if self.n == 1:
            return np.array([position])
        epoch, block, offset = self.where(position)
        counts = self.before(epoch, block) + np.bincount(self.block(epoch, block)[0][:offset], minlength=self.n)
        return counts + (epoch * self.per_epoch if self.per_epoch is not None else 0)


# -----------------------------------------------------------------------------
# a mixture, resolved: its tars, one index over all of them, and the sample at each position


class Mixture:
    """The sources of data_dir for a split, their tars and samples (`files`, `index` of (tar, start, end) over all of
    them, each source a range of it), and sample_at(position): the index entry a global position reads.
    group > 0: LLaVA-NeXT's group_by_modality_length, each `group` positions (a step's samples) of one modality
    (ModalityGroups), by_length: longest first within a group."""

    def __init__(self, data_dir, split="train", seed=0, shuffle_block=1000, group=0, by_length=True):
        self.sources, self.seed = sources(data_dir, split), seed
        self.left_out = left_out(sources(data_dir, split, every=True))  # never published, and not there
        self.records, self.taken, self.shard_starts = [], [], []  # per source: what pack recorded, take_counts
        shards = [shard_files(s.path, s.part) for s in self.sources]  # FileNotFoundError: no such split
        offsets = all_sample_offsets({f: c for found in shards for f, c in found.items()})
        self.files, self.index, self.bases, self.orders, self.kept_sizes = [], [], [], [], []
        for which, (source, found) in enumerate(zip(self.sources, shards)):
            base, starts = len(self.index), [0]
            for f in found:
                self.index += [(len(self.files), a, b) for a, b in offsets[f]]
                self.files.append(f)
                starts.append(len(self.index) - base)
            n = len(self.index) - base
            if not n:
                raise MixtureError(f"source {source.name} ({source.path}): its {source.part} split holds no samples")
            records = packed_records(source.path, list(found)) if source.take != "all" or group else None
            try:
                kept = take_indices(source.take, n, source.name, seed, records)
            except MixtureError as e:
                raise MixtureError(f"source {source.name} ({source.path}): {e}") from None
            self.records.append(records)
            self.taken.append(take_counts(source.take, records, source.name, seed, kept))
            self.shard_starts.append(np.array(starts))
            if not len(kept):
                raise MixtureError(f"source {source.name} ({source.path}): take {source.take!r} keeps none of its "
                                   f"{n} samples")
            self.bases.append(base)
            self.kept_sizes.append(len(kept))
            self.orders.append(SourceOrder(kept, np.array(starts), seed, which, shuffle_block))
        weights = [s.weight for s in self.sources]
        repeats = [s.repeat if s.repeat is not None else 1.0 for s in self.sources]
        self.blend = Blend(self.kept_sizes, weights if None not in weights else None, repeats, seed)
        empty = [s.name for s, c in zip(self.sources, self.blend.per_epoch if self.blend.per_epoch is not None else [])
                 if c == 0]
        if empty:
            raise MixtureError(f"source {empty[0]}: its repeat count leaves it no sample an epoch")
        self.ends = np.array(self.bases[1:] + [len(self.index)])
        self.grouped = ModalityGroups(self, group, by_length) if group and split == "train" else None

    def sample_at(self, position):
        if self.grouped:
            return self.grouped.sample_at(position)
        source, draw = self.blend.locate(position)
        return self.bases[source] + int(self.orders[source].at(draw))

    def take_summary(self):
        """One line on the records LLaVA-NeXT's take rules select that this split does not train on (held out for
        val, dropped by pack), counted apart; None when it trains on every one."""
        apart = [(s.name, t) for s, t in zip(self.sources, self.taken) if t and (t["val"] or t["dropped"])]
        if not apart:
            return None
        total = {k: sum(t[k] for _, t in apart) for k in ("records", "train", "val", "dropped")}
        each = "; ".join(f"{name}: {t['val']} val, {t['dropped']} dropped" for name, t in apart[:5])
        return (f"take: the take rules of {len(apart)} source(s) select {total['records']:,} records of the files "
                f"packed: {total['train']:,} train, {total['val']:,} are held out for val and {total['dropped']:,} "
                f"were dropped by pack ({each}{'; ...' if len(apart) > 5 else ''})")

    def left_out_line(self):
        """One line naming each source left out (never published, not there) with the share of the recipe it held,
        which the other sources take in proportion to their own; None when none is."""
        if not self.left_out:
            return None
        if self.sources[0].weight is not None:  # drawn by weight: its weight's part of the draws
            held = [s.weight for s in self.left_out]
            total = sum(s.weight for s in self.sources) + sum(held)
            each = [f"{s.name} (weight {s.weight:g})" for s in self.left_out]
        else:  # each kept sample once an epoch (times its repeat): the samples its take rule kept of its records
            held = [len(take_indices(s.take, s.records, s.name, self.seed)) * (s.repeat or 1.0) if s.records else 0
                    for s in self.left_out]
            total = sum(self.blend.per_epoch) if self.blend.per_epoch is not None else sum(self.kept_sizes)
            total += sum(held)
            each = [f"{s.name} ({s.take} of its {s.records:,} records: {n:,.0f} samples)" if s.records else
                    f"{s.name} ({s.take}; its records unknown: no records in the mixture file)"
                    for s, n in zip(self.left_out, held)]
        return (f"mixture: left out {len(each)} source(s) the recipe names but nobody published (released: false, "
                f"not there): {'; '.join(each)}: {sum(held) / total:.2%} of the recipe's samples, which the other "
                f"{len(self.sources)} sources take in proportion to their own")

    def counts_before(self, position):
        """Each source's draws at global positions [0, position)."""
        return self.grouped.counts_before(position) if self.grouped else self.blend.counts_before(position)

    def orders_before(self, position):
        """[[(SourceOrder, its draws at positions [0, position))], ...] a source: the orders its samples are read in
        (grouped: one a modality it has, not self.orders), for what a changed mixture repeats and skips."""
        if self.grouped:
            return self.grouped.orders_before(position)
        return [[(order, int(d))] for order, d in zip(self.orders, self.counts_before(position))]

    def source_of(self, sample):
        return int(np.searchsorted(self.ends, sample, side="right"))

    def names(self):
        return [s.name for s in self.sources]

    def shares(self):
        """Each source's expected share of the drawn samples."""
        if self.blend.per_epoch is None:
            return list(self.blend.p)
        return list(self.blend.per_epoch / self.blend.epoch_len)

    def describe(self):
        """What a checkpoint records of the mixture, to tell on resume whether it is the same."""
        return [{"name": s.name, "path": storage.canonical(s.path), "part": s.part,
                 "weight": s.weight, "repeat": s.repeat, "take": s.take, "samples": int(self.ends[i] - self.bases[i])}
                for i, s in enumerate(self.sources)]


# -----------------------------------------------------------------------------
# group_by_modality_length: each step's samples of one modality


class ModalityGroups:
    """LLaVA-NeXT's group_by_modality_length (LengthGroupedSampler with group_by_modality: image-or-video samples and
    text-only ones in megabatches of their own, each a step's samples, longest first) as a function of (seed,
    position): positions go in groups of `size`, each group of one modality. A modality's samples come from a blend of
    its own, each source's samples of that modality drawn as the mixture draws the source (its weight times the
    modality's fraction of it, or its repeat count), so that each modality stream visits its samples in passes. Which
    modality a group holds is drawn so that every GROUP_CYCLE groups hold each modality's share of the mixture's
    samples: a source's share of a long window is the mixture's. Unlike LLaVA-NeXT's, no group mixes the modalities."""

    def __init__(self, mix, size, by_length=True):
        self.mix, self.size, self.by_length, self.groups = mix, size, by_length, OrderedDict()
        missing = [s for s, r in zip(mix.sources, mix.records) if r is None]
        if missing:
            raise MixtureError(f"group_by_modality_length: source {missing[0].name} ({missing[0].path}) has no record of "
                               "its samples' modalities and lengths (a dataset from `energon prepare`, a lone .tar or "
                               "an older pack): pack it again with `python data.py pack`, or set "
                               "group_by_modality_length = False")
        self.length_of = np.concatenate([r.lengths for r in mix.records])  # signed, LLaVA-NeXT's modality_lengths
        self.streams = [self.stream(modality) for modality in (0, 1)]  # image or video; text only
        shares = [0.0 if st is None else st[3] for st in self.streams]
        if 0.0 in shares:
            self.cycle = None  # one modality: every group holds it
        elif mix.blend.per_epoch is not None:
            # repetitions: a cycle is a mixture epoch, each modality's groups its samples of an epoch (whole groups,
            # the last filled up from its next pass), so that an epoch's steps read each sample, fewer than a group
            # twice (a cycle of GROUP_CYCLE left up to 10% of an epoch's samples unread and as many read twice)
            counts = [-(-st[1].epoch_len // size) for st in self.streams]
            self.cycle = Blend(counts, repeats=[1.0, 1.0], seed=mix.seed * 4 + 3)
        else:
            first = min(max(round(shares[0] / sum(shares) * GROUP_CYCLE), 1), GROUP_CYCLE - 1)
            self.cycle = Blend([first, GROUP_CYCLE - first], repeats=[1.0, 1.0], seed=mix.seed * 4 + 3)

    def stream(self, modality):
        """(sources, Blend, [SourceOrder], share of the mixture's draws) of one modality, or None if none has it."""
        mix, members, orders, sizes, weights, repeats = self.mix, [], [], [], [], []
        for i, order in enumerate(mix.orders):
            signs = self.length_of[mix.bases[i] + order.kept]
            part = order.kept[signs > 0 if modality == 0 else signs < 0]
            if not len(part):
                continue
            members.append(i)
            orders.append(SourceOrder(part, mix.shard_starts[i], mix.seed, 1 + 2 * i + modality, order.shuffle_block))
            sizes.append(len(part))
            if mix.blend.per_epoch is None:
                weights.append(mix.blend.p[i] * len(part) / len(order.kept))
            repeats.append(mix.sources[i].repeat or 1.0)
        if not members:
            return None
        blend = Blend(sizes, weights or None, repeats, mix.seed * 4 + 1 + modality)
        share = sum(weights) if weights else blend.epoch_len / mix.blend.epoch_len
        return members, blend, orders, share

    def which(self, g):
        """(modality of group g, groups of that modality before it)."""
        if self.cycle is None:
            return (0 if self.streams[0] else 1), g
        return self.cycle.locate(g)

    def group(self, g):
        """The samples of group g, in position order."""
        if g not in self.groups:
            modality, before = self.which(g)
            members, blend, orders, _ = self.streams[modality]
            samples = []
            for q in range(before * self.size, (before + 1) * self.size):
                sub, draw = blend.locate(q)
                samples.append(self.mix.bases[members[sub]] + int(orders[sub].at(draw)))
            samples = np.array(samples)
            if self.by_length:  # LLaVA-NeXT sorts each megabatch longest first (stable: ties keep their draw order)
                samples = samples[np.argsort(-np.abs(self.length_of[samples]), kind="stable")]
            self.groups[g] = samples
            if len(self.groups) > 8:  # a rank's workers each read a group or two ahead
                self.groups.popitem(last=False)
        return self.groups[g]

    def sample_at(self, position):
        g, offset = divmod(position, self.size)
        return int(self.group(g)[offset])

    def orders_before(self, position):
        """Mixture.orders_before at the start of a group (a step's: where a run stops), a source's draws of each
        modality in that modality's own order."""
        before = [position // self.size] if self.cycle is None else self.cycle.counts_before(position // self.size)
        out = [[] for _ in self.mix.sources]
        for (members, blend, orders, _), n in zip([st for st in self.streams if st is not None], before):
            for i, order, drawn in zip(members, orders, blend.counts_before(int(n) * self.size).tolist()):
                out[i].append((order, drawn))
        return out

    def counts_before(self, position):
        g, offset = divmod(position, self.size)
        before = [g] if self.cycle is None else self.cycle.counts_before(g)
        counts = np.zeros(len(self.mix.sources), dtype=np.int64)
        for stream, n in zip([st for st in self.streams if st is not None], before):
            members, blend, _, _ = stream
            counts[members] += blend.counts_before(int(n) * self.size)
        if offset:
            counts += np.bincount(np.searchsorted(self.mix.ends, self.group(g)[:offset], side="right"),
                                  minlength=len(counts))
        return counts
