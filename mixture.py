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

import math
import os
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
TAKE_RE = re.compile(r"^(first|end|random):(\d+(?:\.\d+)?)(%?)$")


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


# -----------------------------------------------------------------------------
# reading a mixture: a config list, an Energon metadataset, a LLaVA-NeXT data YAML


def sources(data_dir, split="train"):
    """[Source] that data_dir names for `split` ('train' or 'val'). A val source reads its dataset's val part whole."""
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
    return unique_names(found)


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
    if weight is not None and repeat is not None:
        raise MixtureError(f"{at}: both a weight and a repeat count; a mixture draws by weight or by repetition")
    weight, repeat = number(weight), number(repeat)
    for key, value in (("weight", weight), ("repeat", repeat)):
        if value is not None and not positive(value):
            raise MixtureError(f"{at}: {key} must be a number > 0, got {value!r}")
    check_take(at, take)
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


def check_take(at, take):
    if not isinstance(take, str) or not (take == "all" or TAKE_RE.match(take.strip())):
        raise MixtureError(f"{at}: take (sampling_strategy) must be 'all', 'first:N', 'end:N' or 'random:N' with N a "
                           f"count or a percentage like 10%, got {take!r}")


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


NEXT_KEYS = {"json_path", "path", "sampling_strategy", "weight", "repeat", "name"}


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
                             str(e.get("sampling_strategy", "all")).strip())
        out.append(replace(source, raw=str(e["json_path"])) if e.get("path") and e.get("json_path") else source)
    return check_modes(out, path)


ENERGON_TOP = {"__module__", "__class__", "splits"}
ENERGON_SPLIT = {"path", "blend", "blend_epochized", "split_part", "subflavors", "subset", "dataset_config",
                 "shuffle_over_epochs_multiplier"}
# what an entry may hold besides its weight or repetitions; subflavors, dataset_config (field maps) and
# shuffle_over_epochs_multiplier change how Energon decodes or shuffles, not which samples a run reads
ENERGON_ENTRY = {"path", "split_part", "subflavors", "subset", "dataset_config", "shuffle_over_epochs_multiplier"}


def energon_sources(path, doc, split, amount=1.0, mode=None, want=None):
    """Megatron-Energon's MetadatasetV2 for `split`, read as Energon 7.4 reads it: `path`, `blend` (weights, default
    1, normalised at each level and multiplied down nested metadatasets) or `blend_epochized` (repetitions, default 1,
    multiplied down); paths relative to the file; an entry's split_part defaults to the split read, and names the
    split of a nested metadataset read. want: 'train' or 'val', what the run builds (val sources are unweighted)."""
    want = want or split
    unknown = sorted(set(doc) - ENERGON_TOP)
    if unknown:
        raise MixtureError(f"{path}: unknown key {unknown[0]!r} in an Energon metadataset (expected {sorted(ENERGON_TOP)})")
    if doc.get("__module__") != "megatron.energon" or doc.get("__class__") != "MetadatasetV2":
        raise MixtureError(f"{path}: __module__: megatron.energon and __class__: MetadatasetV2 expected, got "
                           f"{doc.get('__module__')!r} / {doc.get('__class__')!r}")
    splits = doc.get("splits")
    if not isinstance(splits, dict) or (want == "train" and split not in splits):
        raise MixtureError(f"{path}: no splits: {split}: in the metadataset")
    if split not in splits:
        return []
    spec, at = splits[split], f"{path}: splits.{split}"
    if not isinstance(spec, dict):
        raise MixtureError(f"{at}: expected a mapping (path, blend or blend_epochized)")
    if "join" in spec:
        raise MixtureError(f"{at}: join (samples of several datasets zipped into one) is not something llavax reads; "
                           "give each dataset as a source of a blend")
    unknown = sorted(set(spec) - ENERGON_SPLIT)
    if unknown:
        raise MixtureError(f"{at}: unknown key {unknown[0]!r} (expected one of {sorted(ENERGON_SPLIT)})")
    kinds = [k for k in ("path", "blend", "blend_epochized") if k in spec]
    if len(kinds) != 1:
        raise MixtureError(f"{at}: needs exactly one of path, blend, blend_epochized; has {kinds or 'none'}")
    if kinds[0] == "path":
        return energon_entry(path, at, spec, split, amount, mode or "weight", want)
    if "subset" in spec:
        raise MixtureError(f"{at}: a subset of a whole blend is not read here; give each entry its own subset")
    new_mode = "weight" if kinds[0] == "blend" else "repeat"
    if mode not in (None, new_mode):
        raise MixtureError(f"{at}: a {kinds[0]} inside a {'blend' if mode == 'weight' else 'blend_epochized'}: Energon "
                           "can only blend datasets of the same blend mode")
    entries, key = spec[kinds[0]], "weight" if new_mode == "weight" else "repetitions"
    if not isinstance(entries, list) or not entries:
        raise MixtureError(f"{at}.{kinds[0]}: expected a non-empty list of datasets")
    values = []
    for i, e in enumerate(entries):
        e_at = f"{at}.{kinds[0]}[{i}]"
        check_entry(e_at, e, ENERGON_ENTRY | {key}, "a mapping")
        value = number(e.get(key, 1.0))
        if not positive(value):
            raise MixtureError(f"{e_at}: {key} must be a number > 0, got {value!r}")
        values.append(value)
    total = sum(values) if new_mode == "weight" else 1.0
    out = [s for i, (e, v) in enumerate(zip(entries, values))
           for s in energon_entry(path, f"{at}.{kinds[0]}[{i}]", e, split, amount * v / total, new_mode, want)]
    return check_modes(out, path) if want == "train" else out


def energon_entry(path, at, e, split, amount, mode, want):
    if "path" not in e:
        raise MixtureError(f"{at}: no path")
    target, part = relative(path, e["path"]), e.get("split_part") or split
    if str(target).endswith(".yml"):
        raise MixtureError(f"{at}: {e['path']}: Energon reads a nested metadataset only from a .yaml file")
    if str(target).endswith(".yaml"):  # a nested metadataset: its split `part`, inside this entry's share
        if "subset" in e:
            raise MixtureError(f"{at}: a subset of a nested metadataset is not read here; give its entries subsets")
        return energon_sources(target, load_yaml(target), part, amount, mode, want)
    take = energon_subset(at, e.get("subset"))
    if want != "train":
        return [Source(dataset_name(target), target, part)]
    return [Source(dataset_name(target), target, part, amount if mode == "weight" else None,
                   amount if mode == "repeat" else None, take)]


def energon_subset(at, subset):
    """Energon's `subset: {range: [start, end]}`: sample indices (end may be 'end'), or both percentages ('10%'), as
    a take rule."""
    if subset is None:
        return "all"
    bounds = subset.get("range") if isinstance(subset, dict) and set(subset) == {"range"} else None
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise MixtureError(f"{at}: subset must be {{range: [start, end]}}, got {subset!r}")
    pct = [isinstance(b, str) and b.strip().endswith("%") for b in bounds]
    ok = all(pct) and all(0 <= float(b.strip()[:-1]) <= 100 for b in bounds) if any(pct) else \
        isinstance(bounds[0], int) and (isinstance(bounds[1], int) or bounds[1] == "end")
    if not ok:
        raise MixtureError(f"{at}: subset range {bounds!r}: give two sample indices ([0, 1000], the end may be "
                           f"'end') or two percentages (['0%', '25%'])")
    return "range:" + ",".join(str(b).strip() for b in bounds)


# -----------------------------------------------------------------------------
# what each source keeps (take), and its own order of passes over them


def take_indices(rule, n, name, seed):
    """The sample indices (sorted) of a source of n samples that rule keeps: LLaVA-NeXT's sampling_strategy on the
    packed order (first:N, end:N, random:N; N% is ceil(N% of n), as LLaVA-NeXT rounds), or Energon's range."""
    if rule == "all":
        return np.arange(n)
    if rule.startswith("range:"):  # Energon's subset: indices, or percentages truncated to indices
        bounds = [n if x == "end" else int(n * (float(x[:-1]) / 100.0)) if x.endswith("%") else int(x)
                  for x in rule[6:].split(",")]
        start, end = (min(max(b, 0), n) for b in bounds)
        return np.arange(start, end)
    how, number, pct = TAKE_RE.match(rule.strip()).groups()
    count = min(n, math.ceil(float(number) * n / 100) if pct else int(float(number)))
    if how == "first":
        return np.arange(count)
    if how == "end":
        return np.arange(n - count, n)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # the same subset whatever the sources' order
    return np.sort(rng.permutation(n)[:count])


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
    them, each source a range of it), and sample_at(position): the index entry a global position reads."""

    def __init__(self, data_dir, split="train", seed=0, shuffle_block=1000):
        self.sources, self.seed = sources(data_dir, split), seed
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
            kept = take_indices(source.take, n, source.name, seed)
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

    def sample_at(self, position):
        source, draw = self.blend.locate(position)
        return self.bases[source] + int(self.orders[source].at(draw))

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
