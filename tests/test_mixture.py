"""Mixtures of datasets (mixture.py): the shares Energon's blend and blend_epochized promise, LLaVA-NeXT's sampling
rules on packed indices, the order as a function of (seed, position) across world sizes, and the sentences bad
mixtures get."""

import json
import math
import os
import sys

import numpy as np
import pytest

import mixture
import pack
from loader import Loader, ShardStream
from mixture import Mixture, MixtureError


def text_dataset(folder, n, val=0, shard_size=16, tag="x"):
    """A packed dataset of n text-only samples (ids tag-0 ...) and val more, in shards of shard_size."""
    records = [{"id": f"{'val' if i >= n else 'tr'}-{tag}-{i}",
                "conversations": [{"from": "human", "value": f"question {i} of {tag}"},
                                  {"from": "gpt", "value": f"answer {i}"}]} for i in range(n + val)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder.parent / f"{folder.name}.json").write_text(json.dumps(records))
    pack.pack(folder.parent / f"{folder.name}.json", folder.parent, folder, shard_size=shard_size,
              val_ids=lambda i: str(i).startswith("val"), overwrite=True)
    return folder


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three datasets of sizes that divide nothing evenly: 37, 101 and 250 samples (val: 5, 0, 9)."""
    root = tmp_path_factory.mktemp("mix")
    return [text_dataset(root / name, n, val, tag=name) for name, n, val in (("a", 37, 5), ("b", 101, 0), ("c", 250, 9))]


def drawn_sources(mix, positions):
    ends = np.array(mix.bases[1:] + [len(mix.index)])
    return np.searchsorted(ends, [mix.sample_at(p) for p in positions], side="right")


def test_weighted_shares_lie_within_three_standard_errors(three):
    mix = Mixture([{"path": str(p), "weight": w} for p, w in zip(three, (5, 2, 1))], seed=3)
    n = 20_000
    counts = np.bincount(drawn_sources(mix, range(n)), minlength=3)
    for count, p in zip(counts, (5 / 8, 2 / 8, 1 / 8)):
        assert abs(count - n * p) <= 3 * math.sqrt(n * p * (1 - p)), (counts, p)
    # each source runs through its own passes: its first 37 draws of a are 37 different samples
    a = [mix.sample_at(q) for q in range(n) if mix.sample_at(q) < 37][:37]
    assert sorted(a) == list(range(37))
    # and another seed draws another order
    assert [mix.sample_at(q) for q in range(50)] != [Mixture(mix.sources, seed=4).sample_at(q) for q in range(50)]


def test_repetitions_are_exact_and_interleaved(three):
    mix = Mixture([{"path": str(p), "repeat": r} for p, r in zip(three, (2, 1, 0.5))], seed=0)
    epoch = 2 * 37 + 101 + 125
    assert mix.blend.epoch_len == epoch
    for e in range(2):
        drawn = [mix.sample_at(q) for q in range(e * epoch, (e + 1) * epoch)]
        seen = np.bincount(drawn, minlength=len(mix.index))
        assert (seen[:37] == 2).all() and (seen[37:138] == 1).all(), e
        assert seen[138:].sum() == 125 and seen[138:].max() == 1  # half of c an epoch, the other half the next
        first_half = drawn_sources(mix, range(e * epoch, e * epoch + epoch // 2))
        assert set(first_half) == {0, 1, 2}  # interleaved, not one source after another
    both = np.bincount([mix.sample_at(q) for q in range(2 * epoch)], minlength=len(mix.index))
    assert (both[138:] == 1).all()  # two mixture epochs: every sample of c once


@pytest.mark.parametrize("rule,expected", [
    ("first:10%", range(0, 11)),  # ceil(10.1): as LLaVA-NeXT rounds a percentage
    ("end:20%", range(101 - 21, 101)),  # ceil(20.2)
    ("first:5", range(0, 5)),
    ("end:7", range(94, 101)),
    ("first:100%", range(0, 101)),
    ("first:500", range(0, 101)),
    ("all", range(0, 101)),
])
def test_take_rules_pick_exactly_the_expected_indices(three, rule, expected):
    mix = Mixture([{"path": str(three[1]), "take": rule}])
    kept = mix.orders[0].kept
    assert kept.tolist() == list(expected)
    drawn = {mix.sample_at(q) for q in range(2 * len(kept))}
    assert drawn == set(expected)


def test_random_take_is_seeded_and_the_same_whatever_the_sources_order(three):
    a = Mixture([{"path": str(three[1]), "take": "random:50%", "name": "b"}, {"path": str(three[0]), "name": "a"}])
    b = Mixture([{"path": str(three[0]), "name": "a"}, {"path": str(three[1]), "take": "random:50%", "name": "b"}])
    kept_a, kept_b = a.orders[0].kept, b.orders[1].kept
    assert len(kept_a) == 51 and len(set(kept_a.tolist())) == 51 and kept_a.tolist() == kept_b.tolist()
    assert kept_a.tolist() != list(range(51)) and max(kept_a) > 60
    assert Mixture([{"path": str(three[1]), "take": "random:50%", "name": "b"}], seed=1).orders[0].kept.tolist() \
        != kept_a.tolist()


def test_a_lone_dataset_is_read_in_the_order_it_always_was(three):
    """One dataset draws as before mixtures existed: the shards shuffled by (seed, epoch), then blocks."""
    mix = Mixture(str(three[2]), seed=5, shuffle_block=20)
    rng = np.random.default_rng([5, 1])  # epoch 1
    starts = [0] + [16 * (i + 1) for i in range(250 // 16)] + [250]
    order = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in rng.permutation(len(starts) - 1)])
    for b in range(0, 250, 20):
        order[b : b + 20] = rng.permutation(order[b : b + 20])
    assert [mix.sample_at(250 + i) for i in range(250)] == order.tolist()


def test_a_mixture_resumes_at_any_position_and_world_size(three, tmp_path):
    """The global order is a function of (seed, position): ranks 1 -> 2 -> 3 with the same global batch read
    exactly the positions a single process reads, with two loader workers and packing."""
    spec = [{"path": str(p), "weight": w} for p, w in zip(three, (3, 1, 1))]
    tokenizer = byte_tokenizer(tmp_path / "tok")

    def stream(rank, world):
        return ShardStream(spec, tokenizer, batch_size=12 // world, seq_len=40, image_size=28, image_token_id=300,
                           n_image_tokens=1, rank=rank, world_size=world, shuffle_block=7, template="plain", pack=2)

    reference = Loader(stream(0, 1), num_workers=0)
    it = iter(reference)
    want = [next(it)["sample_id"].tolist() for _ in range(20)]  # 20 global batches of 24 samples
    seen, _ = batches_across_world_sizes(stream, ((2, 7), (3, 9), (1, 4)))
    assert [sorted(x for b in s for x in b["sample_id"].tolist()) for s in seen] == [sorted(w) for w in want]


def batches_across_world_sizes(stream, schedule):
    """([every rank's batch, for each global step], the last state): a run resumed through each (world size, steps) of
    schedule in turn, every rank's Loader (stream(rank, world)) restored from rank 0's state of the stage before."""
    seen, state = [], None
    for world, steps in schedule:
        loaders = [Loader(stream(r, world), num_workers=2 if world == 2 else 0) for r in range(world)]
        stage = [[] for _ in range(steps)]
        for ld in loaders:
            if state:
                ld.load_state_dict(state)
            it = iter(ld)
            for k in range(steps):
                stage[k].append(next(it))
        seen, state = seen + stage, loaders[0].state_dict()
    return seen, state


def byte_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import chat

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["question answer of"] * 10, trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(exist_ok=True)
    t.save(str(folder / "tokenizer.json"))
    return chat.Tokenizer(folder / "tokenizer.json")


# -----------------------------------------------------------------------------
# reading mixture files


def test_an_energon_metadataset_reads_as_energon_reads_it(three, tmp_path):
    """Weights normalised at each level and multiplied down a nested metadataset, paths relative to the file,
    a percentage subset truncated to indices, the val split its own."""
    meta = three[0].parent / "meta"
    meta.mkdir(exist_ok=True)
    (meta / "nested.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - weight: 1\n        path: ../b\n      - weight: 3\n        path: ../c\n")
    (meta / "mix.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 2\n        path: {three[0]}\n        subset:\n          range: ['0%', '50%']\n"
        "      - path: nested.yaml\n        weight: 2\n"
        "  val:\n    path: ../c\n")
    train = mixture.sources(str(meta / "mix.yaml"), "train")
    assert [(s.name, s.weight, s.take, s.part) for s in train] == [
        ("a", 0.5, "range:0%,50%", "train"), ("b", 0.125, "all", "train"), ("c", 0.375, "all", "train")]
    assert [(s.path, s.part) for s in mixture.sources(str(meta / "mix.yaml"), "val")] == [(str(three[2]), "val")]
    assert Mixture(str(meta / "mix.yaml")).orders[0].kept.tolist() == list(range(18))  # int(18.5), as Energon cuts


BAD = [
    ([{"path": "A", "weight": 0}], "data_dir[0]: weight must be a number > 0, got 0"),
    ([{"path": "A", "weight": -1.5}], "weight must be a number > 0, got -1.5"),
    ([{"path": "A", "weight": 1}, {"path": "B"}], "a has a weight but b has none"),
    ([{"path": "A", "wieght": 1}], "data_dir[0]: unknown key 'wieght'"),
    ([{"path": "A", "take": "frist:10%"}], "take (sampling_strategy) must be 'all', 'first:N'"),
    ([{"path": "A", "weight": 1, "repeat": 2}], "both a weight and a repeat count"),
    (["A", 3], "data_dir[1]: a source is a dict"),
]


@pytest.mark.parametrize("spec,said", BAD)
def test_a_bad_mixture_is_one_sentence(three, spec, said):
    root = three[0].parent
    spec = [x if not isinstance(x, dict) else x | {"path": str(root / x["path"].lower())} for x in spec]
    with pytest.raises(MixtureError, match=re_escape(said)):
        mixture.sources(spec, "train")


def re_escape(text):
    import re

    return re.escape(text)


BAD_YAML = [
    ("__module__: megatron.energon\n__class__: Metadataset\nsplits:\n  train:\n    path: a\n",
     "splits.train: a V1 metadataset (__class__: Metadataset) has splits of `datasets:` only, got ['path']"),
    ("__module__: megatron.energon\n__class__: Metadatset\nsplits:\n  train:\n    path: a\n",
     "__class__: MetadatasetV2 expected, got 'megatron.energon' / 'Metadatset' (Energon also reads V1's Metadataset)"),
    ("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n      - weight: 1\n"
     "        path: a\n        wieght: 2\n", "splits.train.blend[0]: unknown key 'wieght'"),
    ("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n      - weight: 0\n"
     "        path: a\n", "splits.train.blend[0]: weight must be a number > 0, got 0"),
    ("__module__: megatron.energon\n__class__: MetadatasetV2\nsplitz:\n  train:\n    path: a\n",
     "unknown key 'splitz' in an Energon metadataset"),
    ("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  val:\n    path: a\n",
     "no splits: train: in the metadataset"),
    ("datasets:\n  - json_path: llava_v1_5_mix665k.json\n    sampling_strategy: all\n",
     "is a LLaVA JSON, not a packed dataset: pack it with `python data.py pack --json"),
    ("datasets:\n  - path: a\n    sampling_strategy: half\n", "take (sampling_strategy) must be"),
    ("datasets: [a, b\n", "not valid YAML"),
    ("- a\n- b\n", "a mixture file is a mapping"),
]


@pytest.mark.parametrize("text,said", BAD_YAML)
def test_a_bad_mixture_file_is_one_sentence(tmp_path, text, said):
    (tmp_path / "mix.yaml").write_text(text)
    with pytest.raises(MixtureError, match=re_escape(said)):
        mixture.sources(str(tmp_path / "mix.yaml"), "train")


def test_a_llava_next_data_yaml_keeps_its_rules(three, tmp_path):
    (tmp_path / "next.yaml").write_text(
        "datasets:\n"
        f"  - json_path: {three[0]}\n    sampling_strategy: all\n"
        f"  - path: {three[1]}\n    sampling_strategy: \"end:20%\"\n"
        f"  - path: {three[2]}\n    sampling_strategy: \"random:10\"\n")
    mix = Mixture(str(tmp_path / "next.yaml"))
    assert [s.repeat for s in mix.sources] == [1.0, 1.0, 1.0]  # LLaVA-NeXT concatenates the kept records
    assert mix.kept_sizes == [37, 21, 10] and mix.blend.epoch_len == 68
    epoch = np.bincount([mix.sample_at(q) for q in range(68)], minlength=len(mix.index))
    assert epoch.sum() == 68 and epoch.max() == 1  # each kept record once an epoch, as its sampler does


# -----------------------------------------------------------------------------
# the same metadataset through megatron-energon's own loader


def energon_draws(yaml_path, n, repeat=True):
    """Which dataset folder each of the first n samples of Energon's train loader came from."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    ds = get_train_dataset(str(yaml_path), split_part="train", batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, repeat=repeat,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    drawn = []
    for sample in get_loader(ds):
        drawn.append(str(sample.__sources__[0].dataset_path))
        if len(drawn) == n:
            break
    return drawn


def test_energon_draws_the_same_shares_from_the_same_metadataset(three, tmp_path):
    blend = tmp_path / "blend.yaml"
    blend.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                     + "".join(f"      - weight: {w}\n        path: {p}\n" for p, w in zip(three, (5, 2, 1))))
    n = 1500
    theirs = np.array([[d == str(p) for p in three] for d in energon_draws(blend, n)]).sum(0)
    ours = np.bincount(drawn_sources(Mixture(str(blend), seed=1), range(20_000)), minlength=3)
    for k, p in enumerate((5 / 8, 2 / 8, 1 / 8)):
        assert abs(theirs[k] - n * p) <= 3 * math.sqrt(n * p * (1 - p)), (theirs, p)
        assert abs(ours[k] - 20_000 * p) <= 3 * math.sqrt(20_000 * p * (1 - p)), (ours, p)
    # blend_epochized: an epoch holds int(n x repetitions) samples of each, in Energon as here
    epochized = tmp_path / "epochized.yaml"
    epochized.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                         "    blend_epochized:\n" + "".join(f"      - repetitions: {r}\n        path: {p}\n"
                                                            for p, r in zip(three, (2, 1, 0.5))))
    theirs = energon_draws(epochized, 10_000, repeat=False)  # one epoch, then the loader stops
    mix = Mixture(str(epochized))
    ours = np.bincount(drawn_sources(mix, range(mix.blend.epoch_len)), minlength=3)
    assert len(theirs) == mix.blend.epoch_len == 74 + 101 + 125
    assert [sum(d == str(p) for d in theirs) for p in three] == ours.tolist() == [74, 101, 125]


# -----------------------------------------------------------------------------
# train.py on a mixture: the figures by source, a resume, a changed mixture, bad mixtures


@pytest.fixture(scope="module")
def two_shapes(shapes_data):
    """Two shapes datasets, the second drawn with the first's tokenizer (they mix in one run)."""
    a = shapes_data(n=400, seed=0)
    return a, shapes_data(n=300, seed=1, val_fraction=0.2, tokenizer=str(a / "tokenizer.model"))


def mixture_spec(a, b, weights=(3, 1)):
    return [{"path": str(a / "shards"), "weight": weights[0], "name": "one"},
            {"path": str(b / "shards"), "weight": weights[1], "name": "two", "take": "random:60%"}]


def mixture_run(two_shapes, out, *extra, spec=None):
    from test_train import args

    a, b = two_shapes
    spec = mixture_spec(a, b) if spec is None else spec
    return args(a, out, f"--data_dir={spec!r}", "--pack=2", "--num_workers=2", "--seq_len=64", "--log_interval=2",
                "--eval_interval=4", "--eval_iters=2", "--ckpt_interval=4", "--keep_last=5", *extra)


def test_per_source_figures_are_what_was_drawn_and_survive_a_resume(two_shapes, tmp_path):
    from conftest import run_log
    from test_train import args, losses, run

    a, b = two_shapes
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    run(mixture_run(two_shapes, whole, "--max_iters=8"))
    run(mixture_run(two_shapes, halves, "--max_iters=4"))
    r = run(mixture_run(two_shapes, halves, "--max_iters=8", "--resume=True"))
    assert "resuming from" in r.stdout
    assert all(losses(halves)[s] == losses(whole)[s] for s in (6, 8)), (losses(halves), losses(whole))
    # the counts logged at step 8 are the samples of the first 8 batches of 16 (8 rows x pack 2), drawn again here
    stream = ShardStream(mixture_spec(a, b), a / "tokenizer.model", batch_size=8, seq_len=64, image_size=28,
                         image_token_id=512, n_image_tokens=4, template="llama_3", pack=2)
    drawn = [stream.batch(k) for k in range(8)]
    names = ["one", "two"]
    want = {f"samples/{n}": sum(int((d["source"] == i).sum()) for d in drawn) for i, n in enumerate(names)}
    ends = stream.mixture.ends
    assert all(int(np.searchsorted(ends, s, side="right")) == int(src) for d in drawn
               for s, src in zip(d["sample_id"], d["source"]))
    want |= {f"tokens/{n}": sum(int(d["tokens"][d["source"] == i].sum()) for d in drawn) for i, n in enumerate(names)}
    # supervised tokens by source add up to the loss's units (labels[:, 1:] != -100), dropped samples counting none
    assert sum(want[f"tokens/{n}"] for n in names) == sum(int((d["labels"][:, 1:] != -100).sum()) for d in drawn)
    for out in (whole, halves):
        logged = [e for e in run_log(out, "samples/one") if e["step"] == 8][-1]
        assert {k: logged[k] for k in want} == want, (out, logged, want)
        assert 0.6 < want["samples/one"] / 128 < 0.9
        # each source's held-out loss, weighted by its supervised tokens, is the pooled loss
        val = [e for e in run_log(out, "val_loss") if e["step"] == 8][-1]
        pooled = sum(val[f"val_loss/{n}"] * val[f"val_tokens/{n}"] for n in names) / \
            sum(val[f"val_tokens/{n}"] for n in names)
        assert abs(pooled - val["val_loss"]) <= 1e-5 * val["val_loss"], val
    # and source two's held-out loss is what a run on source two alone measures with the same weights (lr 0)
    alone = tmp_path / "alone"
    run(args(a, alone, f"--data_dir={b / 'shards'}", f"--init_from={whole / 'step-000008'}", "--lr=0", "--min_lr=0",
             "--max_iters=1", "--eval_interval=1", "--eval_iters=2", "--pack=2", "--seq_len=64"))
    assert abs(run_log(alone, "val_loss")[-1]["val_loss"] - val["val_loss/two"]) <= 1e-6 * val["val_loss/two"]
    # a changed mixture is refused on resume, unless allow_config_change names data_dir; then it is read from
    # the resumed position on, and the log says so
    other = mixture_spec(a, b, weights=(1, 1))
    r = run(mixture_run(two_shapes, halves, "--max_iters=10", "--resume=True", spec=other), check=False)
    assert r.returncode == 1 and "data_dir changed" in r.stdout and "refused" in r.stdout, r.stdout[-2000:]
    r = run(mixture_run(two_shapes, halves, "--max_iters=10", "--resume=True", "--allow_config_change=['data_dir']",
                        spec=other))
    assert "the new mixture is read from global position 128" in r.stdout + r.stderr, r.stderr[-2000:]
    # its figures go on from the saved ones: the new mixture's draws at positions 128-159 added, by name
    new = ShardStream(other, a / "tokenizer.model", batch_size=8, seq_len=64, image_size=28, image_token_id=512,
                      n_image_tokens=4, template="llama_3", pack=2)
    later = [new.batch(k) for k in (8, 9)]
    step8 = [e for e in run_log(halves, "samples/one") if e["step"] == 8][-1]
    step10 = [e for e in run_log(halves, "samples/one") if e["step"] == 10][-1]
    for i, n in enumerate(names):
        assert step10[f"samples/{n}"] == step8[f"samples/{n}"] + sum(int((d["source"] == i).sum()) for d in later)
        assert step10[f"tokens/{n}"] == step8[f"tokens/{n}"] + sum(int(d["tokens"][d["source"] == i].sum())
                                                                  for d in later)


def test_bad_mixtures_are_one_sentence_before_the_model_is_built(two_shapes, shapes_data, tmp_path):
    from test_train import run

    a, b = two_shapes
    pairs = shapes_data(n=300, seed=1, val_fraction=0.2, preference=True, tokenizer=str(a / "tokenizer.model"))
    own_tokenizer = shapes_data(n=100, seed=2)
    only_val = text_dataset(tmp_path / "only_val", 0, val=6)
    (tmp_path / "class.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\nsplits: {}\n")
    (tmp_path / "self.yaml").write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                                        "    path: self.yaml\n")
    (tmp_path / "key.yaml").write_text(
        f"__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 1\n        path: {a / 'shards'}\n        sample_weight: 2\n")
    cases = [
        ([{"path": str(a / "shards"), "weight": 2}, {"path": str(b / "shards"), "weight": 0}],
         "data_dir: data_dir[1]: weight must be a number > 0, got 0"),
        ([str(a / "shards"), str(tmp_path / "missing")], f"data_dir source missing ({tmp_path / 'missing'}) does not "
                                                         "exist"),
        ([str(a / "shards"), str(only_val)], "data_dir source only_val"),
        ([str(a / "shards"), {"path": str(b / "shards"), "take": "first:0"}],
         "take 'first:0' keeps none of its 240 samples"),
        ([str(a / "shards"), str(pairs / "preference")], f"a mixture of preference pairs ({pairs.name}/preference) "
                                                          f"and single answers ({a.name}) under objective='sft'"),
        ([str(a / "shards"), str(own_tokenizer / "shards")],
         f"data_dir source {own_tokenizer.name} ({own_tokenizer / 'shards'}) was made for another tokenizer "
         f"(tokenizer.model, sha256 "),
        ([str(a / "shards"), str(a / "shapes.json")], "is a file but not a .tar of shards: pack a LLaVA JSON first"),
        ([{"path": str(a / "shards"), "repeat": 1}, {"path": str(b / "shards"), "repeat": 0.001}],
         "repeat 0.001 draws none of its 240 samples an epoch"),
        ([], "data_dir: a mixture with no sources"),
        (str(tmp_path / "class.yaml"), "__class__: MetadatasetV2 expected, got 'megatron.energon' / 'CrudeWebdataset'"),
        (str(tmp_path / "key.yaml"), "splits.train.blend[0]: unknown key 'sample_weight'"),
        (str(tmp_path / "self.yaml"), "self.yaml: names itself"),  # not Python's RecursionError, 3,000 lines long
    ]
    for spec, said in cases:
        r = run(mixture_run(two_shapes, tmp_path / "out", spec=spec), check=False)
        assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, (said, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1 and "model:" not in r.stdout, r.stdout[-2000:]
    r = run(mixture_run(two_shapes, tmp_path / "out", spec=[str(a / "shards"), str(only_val)]), check=False)
    assert "no train split" in r.stderr, r.stderr


def test_audit_of_a_mixture_tables_each_source(two_shapes, tmp_path, capsys):
    import data

    a, b = two_shapes
    (tmp_path / "mix.yaml").write_text(f"datasets:\n  - path: {a / 'shards'}\n    repeat: 2\n"
                                       f"  - path: {b / 'shards'}\n    sampling_strategy: end:25%\n    repeat: 1\n")
    (tmp_path / "cfg.py").write_text(f"data_dir = {str(tmp_path / 'mix.yaml')!r}\ntokenizer = "
                                     f"{str(a / 'tokenizer.model')!r}\nmax_iters = 30\nbatch_size = 16\n"
                                     f"micro_batch_size = 16\n")
    with pytest.raises(SystemExit) as stop:
        data.main(["audit", "--config", str(tmp_path / "cfg.py"), "--progress", "0"])
    out = capsys.readouterr().out
    assert stop.value.code == 0, out
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| shapes")}
    # 360 train samples of a, twice an epoch; b's rule selects ceil(25% of its JSON's 300 records) = 75, as LLaVA-NeXT
    # does: the last 60 are its val split (shapes holds out its last 20%), so 15 of its 240 train samples train
    assert rows[a.name][2:4] == ["360", "0"] and rows[b.name][2:4] == ["15", "225"], out
    assert "take rules leave out 225 of 600 samples" in out
    # the run's 30 x 16 samples, drawn as the loader draws them; tokens and supervised tokens of b's: as it encodes them
    stream = ShardStream(str(tmp_path / "mix.yaml"), a / "tokenizer.model", batch_size=1, seq_len=36, image_size=48,
                         image_token_id=512, n_image_tokens=9, template="llama_3")
    drawn = [stream.sample_at(p) for p in range(480)]
    of_b = [stream.encode(s) for s in drawn if stream.mixture.source_of(s) == 1]
    assert rows[a.name][4:7] == [f"{480 - len(of_b)}"] * 2 + ["0"] and rows[b.name][4:7] == [f"{len(of_b)}"] * 2 + ["0"]
    assert rows[b.name][7] == f"{sum(len(e[0]) for e in of_b):,}"
    assert rows[b.name][8] == f"{sum(sum(x != -100 for x in e[1]) for e in of_b):,}"
    assert rows[a.name][11] == f"{(480 - len(of_b)) / 480:.1%}" and 0.85 < (480 - len(of_b)) / 480 < 0.99
    assert rows[a.name][13] == f"{(480 - len(of_b)) / 360:.2f} |"  # epochs of a in 30 x 16 samples


@pytest.mark.parametrize("name,said", [
    ("dpo_shapes", "init_from 'out/shapes-dpo-sft-250/step-000250' does not exist; this config's inputs are made "
                   "by: (1) python data.py shapes --out data/shapes-dpo --n 20000 --preference; (2) python train.py "
                   "configs/shapes.py --data_dir=data/shapes-dpo/shards --tokenizer=data/shapes-dpo/tokenizer.model "
                   "--out_dir=out/shapes-dpo-sft-250 --max_iters=250 --eval_interval=250; (3) python dpo.py pairs "
                   "--ckpt out/shapes-dpo-sft-250/step-000250 --data data/shapes-dpo/preference --out "
                   "data/shapes-dpo/onpolicy"),
    ("grpo_shapes", "(2) python train.py configs/shapes.py --data_dir=data/shapes-grpo/shards"),
    ("ppo_shapes", "no such reward-model checkpoint directory; this config's inputs are made by: (1) python data.py "
                   "shapes --out data/shapes-ppo --n 6000 --preference; (2) "),
    ("shapes_mixture", "data_dir source one_image (data/shapes/shards) does not exist. This config's inputs are made "
                       "by: (1) python data.py shapes --out data/shapes; (2) python data.py shapes --out "
                       "data/shapes2-mixture --images 2 --tokenizer data/shapes/tokenizer.model"),
])
def test_a_missing_input_made_by_other_runs_names_the_commands(tmp_path, name, said):
    """After `make demo` alone, the post-training demos' inputs (an SFT step, on-policy pairs) do not exist yet: the
    run says which commands make them, not only the first."""
    import forkserver
    from conftest import ROOT

    r = forkserver.run([sys.executable, str(ROOT / "train.py"), str(ROOT / f"configs/{name}.py")],
                       os.environ | {"OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_recipes_mixture_files_hold_the_published_rules():
    """configs/mixtures/: LLaVA-NeXT's published OneVision stages (scripts/train/*.yaml @df17966), read as data_dir."""
    from conftest import ROOT

    stages = {name: mixture.sources(str(ROOT / f"configs/mixtures/{name}.yaml"), every=True)
              for name in ("onevision_mid_stage", "onevision_single_image", "onevision")}
    assert {k: len(v) for k, v in stages.items()} == {"onevision_mid_stage": 8, "onevision_single_image": 90,
                                                      "onevision": 82}
    # what the release lacks (the files' headers say so) is left out where it is not there, and only that
    unreleased = {k: sorted(s.name for s in mixture.sources(str(ROOT / f"configs/mixtures/{k}.yaml"), every=True)
                            if not s.released) for k in stages}
    assert unreleased["onevision_mid_stage"] == ["instruct_azure_dc_zh_92K"]
    assert len(unreleased["onevision"]) == 5 and len(unreleased["onevision_single_image"]) == 6
    assert {k: len(mixture.sources(str(ROOT / f"configs/mixtures/{k}.yaml"))) for k in stages} == {
        k: len(v) - len(unreleased[k]) for k, v in stages.items()}
    rules = {s.name: s.take for s in stages["onevision"]}
    assert rules["llava_next_fit_mix_filtered_text_wild_738590"] == "first:50%"
    assert rules["magpie_pro_l3_80b_st_300000"] == "end:20%" and rules["sharegpt4o_dataset"] == "all"
    assert sum(s.take == "all" for s in stages["onevision_single_image"]) == 73
    assert all(s.repeat == 1.0 and s.path == str(ROOT / "data/onevision" / s.name) for v in stages.values() for s in v)
    assert "configs/mixtures/onevision.yaml" in (ROOT / "configs/onevision_qwen2_7b.py").read_text()


# -----------------------------------------------------------------------------
# the edges a hostile review found


def test_a_nested_metadatasets_split_part_names_the_split_read_as_energon_does(three, tmp_path):
    (tmp_path / "nested.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
        f"  train:\n    blend:\n      - path: {three[1]}\n  val:\n    path: {three[2]}\n")
    (tmp_path / "outer.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - weight: 1\n        path: nested.yaml\n        split_part: val\n"
        f"      - weight: 3\n        path: {three[0]}\n")
    # the nested file's val split (c's 9 held-out samples), not its train entries read at their val parts
    assert [(s.path, s.part, s.weight) for s in mixture.sources(str(tmp_path / "outer.yaml"))] == [
        (str(three[2]), "val", 0.25), (str(three[0]), "train", 0.75)]
    theirs = energon_draws(tmp_path / "outer.yaml", 400)
    assert {d for d in theirs} == {str(three[2]), str(three[0])}
    assert Mixture(str(tmp_path / "outer.yaml")).kept_sizes == [9, 37]


def test_yaml_numbers_subsets_names_and_weights_at_their_edges(three, tmp_path):
    (tmp_path / "sci.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 1e-3\n        path: {three[0]}\n      - weight: 1\n        path: {three[1]}\n")
    assert [s.weight for s in mixture.sources(str(tmp_path / "sci.yaml"))] == pytest.approx([0.001 / 1.001,
                                                                                             1 / 1.001])
    # Energon truncates int(n * (p / 100.0)): 29% of 100 is 28 there (28.999...), not 29
    assert len(mixture.take_indices("range:0%,29%", 100, "x", 0)) == 28
    a = str(three[0])
    names = [s.name for s in mixture.sources([{"path": a, "name": "a#1"}, {"path": a}, {"path": a}])]
    assert len(set(names)) == 3 and names[0] == "a#1"
    assert [s.name for s in mixture.sources([{"path": a, "take": "first:50%"}, {"path": a, "take": "end:50%"}],
                                            "val")] == ["a"]  # one dataset's val split, evaluated once
    assert Mixture([{"path": a, "weight": 1e308}, {"path": str(three[1]), "weight": 1e308}]).shares() == [0.5, 0.5]


def test_an_epoch_of_more_than_a_billion_samples_keeps_its_exact_counts():
    blend = mixture.Blend([4 * 10**8, 7 * 10**8], repeats=[1.0, 1.0], seed=0)
    assert blend.locate(5 * 10**8)[0] in (0, 1)
    assert blend.counts_before(blend.epoch_len).tolist() == [4 * 10**8, 7 * 10**8]
    half = blend.counts_before(blend.epoch_len // 2)
    assert abs(half[0] - 2 * 10**8) < 10**6 and half.sum() == blend.epoch_len // 2
