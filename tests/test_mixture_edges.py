"""Mixtures at their edges: LLaVA-NeXT's take rules on the records of the JSON a source was packed from,
Energon 7.4's own decisions (fractional repetitions, subsets, nested blend_epochized and V1 files, cycles), and
group_by_modality_length (LLaVA-NeXT's LengthGroupedSampler with group_by_modality) as a function of position."""

import json
import math
import os
import random
import re
import subprocess
import sys
import tarfile

import forkserver
import numpy as np
import pytest
from PIL import Image
from test_mixture import batches_across_world_sizes

import config
import mixture
import pack
from loader import Loader, ShardStream
from mixture import Mixture, MixtureError
from shards import ShardReader
from conftest import ROOT
from test_mixture import byte_tokenizer, energon_draws, text_dataset

# -----------------------------------------------------------------------------
# take rules: LLaVA-NeXT's selection of the JSON's records, whatever pack held out or dropped


def llava_next_take(records, rule, seed_key):
    """The records LLaVA-NeXT's LazySupervisedDataset keeps of one data-YAML entry (llava/train/train.py @df17966,
    the sampling_strategy branch), transcribed as the oracle: LLaVA-NeXT itself cannot be imported here. Its
    random.shuffle draws from the global `random`, seeded here as llavax seeds its own."""
    records, number = list(records), None
    if ":" in rule:
        rule, number = rule.split(":")
        number = math.ceil(int(number.split("%")[0]) * len(records) / 100) if "%" in number else int(number)
    if rule == "first" and number is not None:
        records = records[:number]
    elif rule == "end" and number is not None:
        records = records[-number:]
    elif rule == "random" and number is not None:
        random.seed(seed_key)
        random.shuffle(records)
        records = records[:number]
    return records


@pytest.fixture(scope="module")
def source_317(tmp_path_factory):
    """317 records packed with a val split (by a hash of the id) and 8 records pack drops (no answer)."""
    root = tmp_path_factory.mktemp("take")
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"}]
                + ([] if i % 41 == 7 else [{"from": "gpt", "value": f"answer {i}"}])} for i in range(317)]
    (root / "s.json").write_text(json.dumps(records))
    pack.pack(root / "s.json", root, root / "s", shard_size=50, val_ratio=0.1, overwrite=True)
    return root / "s", records


def split_ids(path, prefix):
    """The record ids in a packed dataset's shards named prefix-*.tar, read from the tars."""
    ids = set()
    for shard in path.glob(f"{prefix}-*.tar"):
        with tarfile.open(shard) as t:
            ids |= {json.loads(t.extractfile(m).read())["id"] for m in t if m.name.endswith(".json")}
    return ids


def kept_ids(mix):
    reader = ShardReader(mix.files, mix.index)
    return [json.loads(reader.read(int(i))[1]["json"])["id"] for i in mix.orders[0].kept]


@pytest.mark.parametrize("rule", ["first:10%", "end:20%", "first:100", "end:7", "random:50", "random:10%",
                                  "first: 10%", "end:150%", "first:500"])
def test_take_rules_keep_the_records_llava_next_keeps(source_317, rule):
    path, records = source_317
    mix = Mixture([{"path": str(path), "take": rule, "name": "s"}], seed=3)
    theirs = [r["id"] for r in llava_next_take(records, rule.replace(" ", ""), "3:s")]
    val = split_ids(path, "val")
    dropped = {r["id"] for r in records if len(r["conversations"]) == 1}
    assert sorted(kept_ids(mix)) == sorted(set(theirs) - val - dropped)
    assert mix.taken[0] == {"records": len(theirs), "train": len(set(theirs) - val - dropped),
                            "val": len(set(theirs) & val), "dropped": len(set(theirs) & dropped)}
    if rule == "first:10%":  # the case: 32 records selected, as upstream; 28 of them train
        assert mix.taken[0]["records"] == 32 and mix.taken[0]["val"] + mix.taken[0]["dropped"] == 4
        assert "held out for val" in mix.take_summary()


@pytest.mark.parametrize("rule,said", [
    ("end:0", "take 'end:0' keeps every record in LLaVA-NeXT (its slice records[-0:] is the whole list)"),
    ("end:0%", "take 'end:0%' keeps every record in LLaVA-NeXT"),
    ("first :10%", "LLaVA-NeXT reads 'first ' (the text before the colon) as no rule and keeps every record"),
    ("first:10.5%", "LLaVA-NeXT reads N with int(), which fails on '10.5'"),
    ("first:-5", "when it is negative, slices from the other end"),
    ("half", "LLaVA-NeXT keeps every record of a rule it does not know"),
])
def test_take_rules_llava_next_reads_by_accident_are_one_sentence(rule, said):
    with pytest.raises(MixtureError, match=re.escape(said)) as e:
        mixture.sources([{"path": "a", "take": rule}])
    assert "\n" not in str(e.value)
    assert mixture.sources([{"path": "a", "take": "first: 10%"}])[0].take == "first:10%"  # a space, as upstream reads


# -----------------------------------------------------------------------------
# Energon 7.4's decisions, against Energon itself


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("energon")
    return text_dataset(root / "a", 37, 5, tag="a"), text_dataset(root / "b", 101, 0, tag="b")


HEAD = "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"


def energon_epoch(yaml_path, ranks):
    """Samples in one epoch of Energon's loader over `ranks` ranks of one in-process worker each."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    total = 0
    for rank in range(ranks):
        ds = get_train_dataset(str(yaml_path), split_part="train", batch_size=None, shuffle_buffer_size=None,
                               max_samples_per_sequence=None, repeat=False,
                               worker_config=WorkerConfig(rank=rank, world_size=ranks, num_workers=0))
        total += sum(1 for _ in get_loader(ds))
    return total


def test_fractional_repetitions_differ_from_energons_by_what_docs_say(two, tmp_path):
    """Energon rounds int(n_w x fraction) per global worker (ranks x workers; 4 ranks x 1 splits the samples as 2 x 2
    does); llavax rounds int(n x repetitions) once, so that the order is the same on any world size. docs/data.md
    gives Energon's count; here it is measured."""
    path = tmp_path / "rep.yaml"
    path.write_text(HEAD + f"    blend_epochized:\n      - path: {two[0]}\n        repetitions: 0.33\n")
    ours = Mixture(str(path)).blend.epoch_len
    theirs = energon_epoch(path, 4)
    q, m, frac = 37 // 4, 37 % 4, 0.33
    assert ours == int(37 * 0.33) == 12 and theirs == (4 - m) * int(q * frac) + m * int((q + 1) * frac) == 9
    assert energon_epoch(path, 1) == ours  # one rank of one worker: the same rounding


@pytest.mark.parametrize("bounds,said", [
    ("[0, 500]", "subset range [0,500] ends past its 37 samples (Energon refuses such a range too)"),
    ("['10%', '150%']", "Energon needs 0% <= start <= end <= 100%"),
    ("['50%', '10%']", "Energon needs 0% <= start <= end <= 100%"),
    ("[20, 10]", "Energon needs 0 <= start <= end"),
    ("[-1, 10]", "Energon needs 0 <= start <= end"),
])
def test_an_out_of_range_subset_is_refused_as_energon_refuses_it(two, tmp_path, bounds, said):
    path = tmp_path / "sub.yaml"
    path.write_text(HEAD + f"    blend:\n      - path: {two[0]}\n        subset:\n          range: {bounds}\n")
    with pytest.raises(MixtureError, match=re.escape(said)):
        Mixture(str(path))
    with pytest.raises(Exception):  # Energon's own loader refuses it too  # noqa: B017
        energon_draws(path, 1)


def test_nested_blend_epochized_and_v1_files_read_as_energon_reads_them(two, tmp_path):
    a, b = two
    (tmp_path / "ep.yaml").write_text(HEAD + f"    blend_epochized:\n      - path: {a}\n        repetitions: 2\n"
                                      f"      - path: {b}\n")
    (tmp_path / "top.yaml").write_text(HEAD + "    path: ep.yaml\n")  # a top-level path to it: legal in Energon
    mix = Mixture(str(tmp_path / "top.yaml"))
    theirs = energon_draws(tmp_path / "top.yaml", 10_000, repeat=False)
    assert mix.blend.epoch_len == len(theirs) == 175 and sum(d == str(a) for d in theirs) == 74
    (tmp_path / "v1.yaml").write_text("__module__: megatron.energon\n__class__: Metadataset\nsplits:\n  train:\n"
                                      f"    datasets:\n      - weight: 3\n        path: {a}\n      - path: {b}\n")
    (tmp_path / "outer.yaml").write_text(HEAD + "    blend:\n      - path: v1.yaml\n      - path: " + str(b) + "\n")
    assert [(s.path, s.weight) for s in mixture.sources(str(tmp_path / "outer.yaml"))] == [
        (str(a), 0.375), (str(b), 0.125), (str(b), 0.5)]
    n = 1500
    theirs = energon_draws(tmp_path / "outer.yaml", n)
    share = sum(d == str(a) for d in theirs) / n
    assert abs(share - 0.375) <= 3 * math.sqrt(0.375 * 0.625 / n), share


def test_a_cycle_of_metadatasets_is_one_sentence(two, tmp_path):
    (tmp_path / "self.yaml").write_text(HEAD + "    path: self.yaml\n")
    (tmp_path / "A.yaml").write_text(HEAD + f"    blend:\n      - path: B.yaml\n      - path: {two[0]}\n")
    (tmp_path / "B.yaml").write_text(HEAD + "    blend:\n      - path: A.yaml\n")
    with pytest.raises(MixtureError, match="self.yaml: names itself .*self.yaml -> .*self.yaml\\)"):
        mixture.sources(str(tmp_path / "self.yaml"))
    with pytest.raises(MixtureError, match="B.yaml: names .*A.yaml, which leads back to it .*A.yaml -> .*B.yaml -> "):
        mixture.sources(str(tmp_path / "A.yaml"))
    byte_tokenizer(tmp_path / "tok")
    (tmp_path / "cfg.py").write_text(f"data_dir = {str(tmp_path / 'A.yaml')!r}\n"
                                     f"tokenizer = {str(tmp_path / 'tok/tokenizer.json')!r}\n")
    r = forkserver.run([sys.executable, "data.py", "audit", "--config", str(tmp_path / "cfg.py")],
                       os.environ | {"OMP_NUM_THREADS": "1"})
    said = [line for line in (r.stdout + r.stderr).splitlines() if "leads back" in line]
    assert len(said) == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_mixture_file_as_a_source_of_a_list_or_a_data_yaml_is_one_sentence(two, tmp_path):
    """A LLaVA-NeXT data file that names itself (or any .yaml among its datasets, or a list's) is no dataset: one
    sentence, in train's check and in the audit (which read it as a tar: a page of tarfile's errors)."""
    (tmp_path / "next.yaml").write_text(f"datasets:\n  - path: next.yaml\n  - path: {two[0]}\n")
    with pytest.raises(MixtureError, match="datasets\\[0\\]: .*next.yaml is a mixture file, not a packed dataset"):
        mixture.sources(str(tmp_path / "next.yaml"))
    with pytest.raises(MixtureError, match="data_dir\\[1\\]: .*next.yaml is a mixture file"):
        mixture.sources([str(two[0]), str(tmp_path / "next.yaml")])
    import data

    byte_tokenizer(tmp_path / "tok")
    (tmp_path / "x.json").write_text("[]")
    for data_dir in (str(tmp_path / "next.yaml"), [str(two[0]), str(tmp_path / "x.json")]):
        (tmp_path / "cfg.py").write_text(f"data_dir = {data_dir!r}\ntokenizer = {str(tmp_path / 'tok/tokenizer.json')!r}\n")
        with pytest.raises(SystemExit) as e:
            data.main(["audit", "--config", str(tmp_path / "cfg.py")])
        assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code


def test_a_list_that_is_no_literal_on_the_command_line_is_one_sentence():
    with pytest.raises(SystemExit) as e:
        config.parse(["--data_dir=[{'path': 'a', 'weight': float('inf')}, 'b']"], config.DEFAULTS)
    assert "is a list or dict that Python's literal_eval cannot read" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(MixtureError, match="weight must be a number > 0, got inf"):  # 1e999, as the sentence says
        mixture.sources(config.parse(["--data_dir=[{'path': 'a', 'weight': 1e999}, {'path': 'b', 'weight': 1}]"],
                                     config.DEFAULTS)["data_dir"])


# -----------------------------------------------------------------------------
# group_by_modality_length


def modal_dataset(folder, n, image_every, tag):
    """n records, every image_every-th with a tiny image, of varied lengths."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(folder.parent / f"{tag}.png")
    records = [{"id": f"{tag}{i}", "conversations": [
        {"from": "human", "value": ("<image>\n" if i % image_every == 0 else "") + " ".join(["word"] * (1 + i % 13))},
        {"from": "gpt", "value": f"answer {i}"}]} | ({"image": f"{tag}.png"} if i % image_every == 0 else {})
        for i in range(n)]
    (folder.parent / f"{tag}.json").write_text(json.dumps(records))
    pack.pack(folder.parent / f"{tag}.json", folder.parent, folder, shard_size=20, overwrite=True)
    return folder


@pytest.fixture(scope="module")
def modal(tmp_path_factory):
    root = tmp_path_factory.mktemp("modal")
    return modal_dataset(root / "m", 90, 3, "m"), modal_dataset(root / "t", 61, 5, "t")


def has_image(mix, sample):
    return any(k not in ("txt", "json") for k in ShardReader(mix.files, mix.index).read(int(sample))[1])


@pytest.mark.parametrize("spec", [((3, None), (1, None)), ((None, 2), (None, 0.5))])
def test_grouped_steps_hold_one_modality_and_the_mixtures_shares(modal, spec):
    data_dir = [{"path": str(p), "weight": w} if w else {"path": str(p), "repeat": r}
                for p, (w, r) in zip(modal, spec)]
    G, n = 12, 12 * 400
    mix, plain = Mixture(data_dir, seed=2, group=G), Mixture(data_dir, seed=2)
    image = {s: has_image(mix, s) for s in range(len(mix.index))}  # from the shards, not pack's record
    drawn = np.array([mix.sample_at(p) for p in range(n)])
    groups = drawn.reshape(-1, G)
    assert all(len({image[s] for s in g}) == 1 for g in groups.tolist())
    assert {image[g[0]] for g in groups.tolist()} == {True, False}
    lengths = np.abs(mix.grouped.length_of[groups])
    assert (np.diff(lengths, axis=1) <= 0).all()  # longest first, as LLaVA-NeXT sorts a megabatch
    sources = np.searchsorted(mix.ends, drawn, side="right")
    share = np.bincount(sources, minlength=2) / n
    assert np.abs(share - np.array(plain.shares())).max() < 0.03, (share, plain.shares())
    for p in (0, 5, 17 * G + 3, n):  # the figures by source count the grouped draws
        assert mix.counts_before(p).tolist() == np.bincount(sources[:p], minlength=2).tolist()
    again = Mixture(data_dir, seed=2, group=G)  # a stream re-created at a position reads what it read
    assert [again.sample_at(p) for p in range(n - 1, 3 * G, -37)] == drawn[n - 1 : 3 * G : -37].tolist()


@pytest.mark.parametrize("G", [12, 20])
def test_grouped_steps_of_a_repeat_mixture_read_each_sample_once_an_epoch(modal, G):
    """LLaVA-NeXT's grouped sampler permutes an epoch: each sample once. Grouped steps of a repeat-1 mixture read
    every kept sample in the epoch's steps, the few read twice only where a modality's last group is filled up."""
    mix = Mixture([{"path": str(p), "repeat": 1} for p in modal], seed=2, group=G)
    per_group = [mix.grouped.streams[m][1].epoch_len for m in (0, 1)]  # each modality's samples an epoch
    steps = sum(-(-n // G) for n in per_group)
    drawn = [mix.sample_at(p) for p in range(steps * G)]
    assert set(drawn) == set(range(len(mix.index)))
    assert len(drawn) - len(set(drawn)) == sum(-(-n // G) * G - n for n in per_group) < 2 * G


def test_grouped_stream_resumes_bit_for_bit_on_another_world_size(modal, tmp_path):
    spec = [{"path": str(p), "weight": w} for p, w in zip(modal, (2, 1))]
    tokenizer = byte_tokenizer(tmp_path / "tok")

    def stream(rank, world):
        return ShardStream(spec, tokenizer, batch_size=6 // world, seq_len=48, image_size=28, image_token_id=300,
                           n_image_tokens=1, rank=rank, world_size=world, shuffle_block=7, template="plain", pack=2,
                           group=12)

    it = iter(Loader(stream(0, 1), num_workers=0))
    want = [next(it) for _ in range(12)]
    seen, state = batches_across_world_sizes(stream, ((2, 5), (3, 4), (1, 3)))
    for w, got in zip(want, seen):
        assert sorted(w["sample_id"].tolist()) == sorted(x for b in got for x in b["sample_id"].tolist())
        assert len(set(w["has_image"][~w["dropped"]].tolist())) <= 1  # one modality a step
    assert state["by_source"]["samples"] == {
        name: int(sum((b["source"] == i).sum() for b in want)) for i, name in enumerate(("m", "t"))}
    with pytest.raises(ValueError, match="'group': \\(12, 0\\)"):  # a resume that would regroup is refused
        Loader(ShardStream(spec, tokenizer, batch_size=6, seq_len=48, image_size=28, image_token_id=300,
                           n_image_tokens=1, template="plain", pack=2), 0).load_state_dict(state)


def test_grouping_needs_what_pack_records_and_the_recipes_turn_it_on(two, tmp_path):
    tar = next(two[1].glob("shard-*.tar"))
    with pytest.raises(MixtureError, match="group_by_modality_length: source .* has no record of its samples' "
                                           "modalities and lengths"):
        Mixture([str(tar), str(two[0])], group=8)
    for name in ("onevision_qwen2_7b", "onevision_qwen3_8b"):
        r = subprocess.run([sys.executable, "-c", f"import runpy; print(runpy.run_path('configs/{name}.py')"
                            "['group_by_modality_length'])"], cwd=ROOT, capture_output=True, text=True)
        assert r.stdout.strip() == "True", r.stderr
