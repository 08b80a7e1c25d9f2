"""data.py against webdataset, megatron-energon and transformers' CLIP processor, plus its own promises."""

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import numpy as np
import pytest
import torch
from conftest import ROOT
from PIL import Image

import chat
import images
import pack
from loader import Loader, ShardStream

# -----------------------------------------------------------------------------
# fixtures: a small LLaVA-format dataset with every kind of bad record


def jpeg_bytes(w, h, seed=0, fmt="JPEG"):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def conv(q, a, image=True):
    return [{"from": "human", "value": (f"{chat.IMAGE_TAG}\n" if image else "") + q}, {"from": "gpt", "value": a}]


@pytest.fixture(scope="module")
def llava_json(tmp_path_factory):
    d = tmp_path_factory.mktemp("llava")
    (d / "images").mkdir()
    good = []
    for i in range(12):
        (d / "images" / f"{i}.jpg").write_bytes(jpeg_bytes(40 + i, 30, seed=i))
        good.append({"id": f"good{i}", "image": f"{i}.jpg", "conversations": conv(f"What is {i}?", f"It is {i}.")})
    (d / "images/p.png").write_bytes(jpeg_bytes(20, 20, fmt="PNG"))
    good.append({"id": "png", "image": "p.png", "conversations": conv("A png?", "Yes.")})
    good.append({"id": "text", "conversations": conv("Hello?", "Hi there.", image=False)
                 + [{"from": "human", "value": "Again?"}, {"from": "gpt", "value": "Sure."}]})
    (d / "images/bad.jpg").write_bytes(jpeg_bytes(64, 64)[:300])  # truncated
    bad = [{"id": "missing", "image": "nope.jpg", "conversations": conv("q", "a")},
           {"id": "corrupt", "image": "bad.jpg", "conversations": conv("q", "a")},
           {"id": "no_gpt", "image": "0.jpg", "conversations": conv("q", "a")[:1]},
           {"id": "empty", "image": "0.jpg", "conversations": conv("q", "  ")},
           {"id": "two_tags", "image": "0.jpg", "conversations": conv("q <image>", "a")}]
    lines = [json.dumps(r) for r in good[:6]] + ['{"id": "broken", "conversations": ['] + \
            [json.dumps(r) for r in bad + good[6:]]
    (d / "data.jsonl").write_text("\n".join(lines) + "\n")
    return d, good


@pytest.fixture(scope="module")
def packed(llava_json, tmp_path_factory):
    d, good = llava_json
    out = tmp_path_factory.mktemp("shards")
    skips = pack.pack(d / "data.jsonl", d / "images", out, shard_size=4, val_ratio=0.0)
    return out, good, skips


def test_bad_records_are_counted_by_reason_and_no_good_record_is_lost(packed):
    out, good, skips = packed
    assert dict(skips.counts) == {"malformed_json": 1, "missing_image": 1, "corrupt_image": 1, "no_gpt_turn": 1,
                                  "empty_answer": 1, "image_tag_count_mismatch": 1}
    assert skips.examples["missing_image"] == ["missing"] and skips.examples["malformed_json"] == ["line 7"]
    info = json.loads((out / ".nv-meta/.info.json").read_text())
    assert sum(info["shard_counts"].values()) == len(good) == 14


def test_strict_exits_nonzero_and_summary_names_ids(llava_json, tmp_path):
    d, _ = llava_json
    r = forkserver.run([sys.executable, str(ROOT / "data.py"), "pack", "--json", str(d / "data.jsonl"), "--images",
                        str(d / "images"), "--out", str(tmp_path / "s"), "--strict"], os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "corrupt_image: 1 (first: corrupt)" in r.stderr and "--strict" in r.stderr


def test_repacking_gives_byte_identical_shards(llava_json, packed, tmp_path):
    d, _ = llava_json
    out, _, _ = packed
    pack.pack(d / "data.jsonl", d / "images", tmp_path, shard_size=4, workers=2)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    first = {p.name: digest(p) for p in out.glob("*.tar*")}
    assert first and first == {p.name: digest(p) for p in tmp_path.glob("*.tar*")}
    assert not list(tmp_path.glob("*.tmp"))


def test_webdataset_reads_every_packed_sample(packed, llava_json):
    import webdataset as wds

    out, good, _ = packed
    samples = list(wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False))
    assert len(samples) == len(good)
    keys = [s["__key__"] for s in samples]
    assert len(set(keys)) == len(keys)
    by_id = {json.loads(s["json"])["id"]: s for s in samples}
    for rec in good:
        s = by_id[rec["id"]]
        meta = json.loads(s["json"])
        assert s["txt"].decode() == rec["conversations"][1]["value"]
        assert meta["question"] == rec["conversations"][0]["value"].replace(chat.IMAGE_TAG, "").strip()
        assert meta["conversations"][-1] == rec["conversations"][-1]
        if "image" in rec:  # the source bytes, under their own extension: nothing re-encoded
            ext = "png" if rec["image"].endswith(".png") else "jpg"
            assert s[ext] == (llava_json[0] / "images" / rec["image"]).read_bytes()
        else:
            assert "jpg" not in s and "png" not in s


def test_energon_opens_packed_folder_as_vqa_without_prepare(tmp_path, llava_json):
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    d, good = llava_json
    with_images = [r for r in good if "image" in r]
    (tmp_path / "imgs.json").write_text(json.dumps(with_images))
    pack.pack(tmp_path / "imgs.json", d / "images", tmp_path / "shards", shard_size=5)
    assert not (tmp_path / "shards/.nv-meta/index.sqlite").exists()  # we did not run energon prepare
    ds = get_train_dataset(tmp_path / "shards", batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), repeat=False)
    seen = {}
    for sample in get_loader(ds):
        assert type(sample).__name__ == "VQASample" and sample.image.shape[0] == 3
        seen[sample.context] = sample.answers
    assert seen == {r["conversations"][0]["value"].split("\n", 1)[1]: r["conversations"][1]["value"] for r in with_images}
    energon = Path(sys.executable).parent / "energon"  # the venv's, wherever the checkout is
    lint = subprocess.run([str(energon), "lint", str(tmp_path / "shards")], capture_output=True)
    assert lint.returncode == 0, lint.stderr[-2000:]


# -----------------------------------------------------------------------------
# the stream


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=240, seed=0, val_fraction=0.25)


def stream(shapes, **kw):
    args = {"batch_size": 4, "seq_len": 64, "image_size": 28, "image_token_id": 512, "n_image_tokens": 4,
            "template": "plain"} | kw
    return ShardStream(shapes / "shards", shapes / "tokenizer.model", **args)


def take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_same_seed_same_order_other_seed_other_order(shapes):
    a = [b["sample_id"] for b in take(Loader(stream(shapes, seed=1)), 5)]
    b = [b["sample_id"] for b in take(Loader(stream(shapes, seed=1), num_workers=2), 5)]
    c = [b["sample_id"] for b in take(Loader(stream(shapes, seed=2)), 5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("workers_before,workers_after", [(0, 0), (2, 0), (0, 2)])
def test_resume_continues_at_the_exact_next_sample(shapes, workers_before, workers_after):
    straight = take(Loader(stream(shapes), num_workers=0), 60)  # crosses the 180-sample epoch boundary
    first = Loader(stream(shapes), num_workers=workers_before)
    take(first, 23)
    state = json.loads(json.dumps(first.state_dict()))  # it must survive JSON, as checkpoints store it
    resumed = Loader(stream(shapes), num_workers=workers_after)
    resumed.load_state_dict(state)
    for a, b in zip(straight[23:], take(resumed, 37)):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_resume_refuses_a_state_from_another_setup(shapes):
    loader = Loader(stream(shapes, seed=0))
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict(Loader(stream(shapes, seed=5)).state_dict())


@pytest.mark.parametrize("world_size,workers", [(1, 2), (2, 2), (3, 0)])
def test_ranks_and_workers_cover_every_sample_once_per_epoch(shapes, world_size, workers):
    n = len(stream(shapes))
    seen = []
    for rank in range(world_size):
        s = stream(shapes, rank=rank, world_size=world_size, batch_size=5)
        per_rank = n // world_size  # 180 divides by 1, 2 and 3
        for batch in take(Loader(s, num_workers=workers), per_rank // 5):
            seen += batch["sample_id"].tolist()
    assert sorted(seen) == list(range(n))


def test_batches_have_static_shapes_and_image_tokens_in_place(shapes):
    batch = take(Loader(stream(shapes, template="vicuna_v1", seq_len=160)), 1)[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 160)
    assert batch["pixel_values"].shape == (4, 3, 28, 28) and batch["pixel_values"].dtype == torch.uint8
    assert ((batch["input_ids"] == 512).sum(1) == 4).all() and batch["has_image"].all()
    assert ((batch["labels"] != -100).sum(1) > 0).all()


def test_val_split_is_held_out(shapes):
    train = stream(shapes, split="train")
    val = stream(shapes, split="val")
    assert (len(train), len(val)) == (180, 60)
    assert not set(map(str, train.files)) & set(map(str, val.files))


def test_our_loader_reads_webdataset_tarwriter_shards(tmp_path, shapes):
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "foreign.tar")) as sink:
        sink.write({"__key__": "dir/a", "jpg": jpeg_bytes(32, 24), "json": {"question": "What is it?"}, "txt": "A cat."})
        sink.write({"__key__": "dir/b", "png": jpeg_bytes(24, 32, fmt="PNG"), "txt": "A caption."})
    s = ShardStream(tmp_path / "foreign.tar", shapes / "tokenizer.model", batch_size=2, seq_len=200, image_size=28,
                         image_token_id=512, n_image_tokens=4, template="vicuna_v1", shuffle_block=1)
    assert len(s) == 2
    batch = s.batch(0)
    tok = chat.Tokenizer(shapes / "tokenizer.model")
    answers = sorted(tok.decode([t for t in row if t != -100]) for row in batch["labels"].tolist())
    assert answers == ["A caption.", "A cat."] and batch["has_image"].all() and not batch["dropped"].any()


def test_truncation_rule(shapes):
    tok = chat.Tokenizer(shapes / "tokenizer.model")
    c = conv("How many circles are there?", "two")
    full, labels, cut = chat.encode_conversation(c, True, "vicuna_v1", tok, 512, 512, 4)
    assert not cut
    image_end = max(i for i, t in enumerate(full) if t == 512)
    with pytest.raises(chat.DropSample, match="image_beyond_seq_len"):
        chat.encode_conversation(c, True, "vicuna_v1", tok, image_end, 512, 4)
    with pytest.raises(chat.DropSample, match="no_supervised_tokens"):
        chat.encode_conversation(c, True, "vicuna_v1", tok, image_end + 3, 512, 4)
    ids, lab, cut = chat.encode_conversation(c, True, "vicuna_v1", tok, len(full) - 1, 512, 4)
    assert cut and ids == full[:-1] and lab == labels[:-1]


def test_dropped_samples_become_empty_rows_and_are_counted(shapes):
    s = stream(shapes, template="vicuna_v1", seq_len=40)  # the vicuna system prompt alone is longer
    batch = s.batch(0)
    assert batch["dropped"].all() and (batch["labels"] == -100).all()
    assert s.skips.counts["image_beyond_seq_len"] == 4


# -----------------------------------------------------------------------------
# templates: golden strings in the published formats, and label masks

CONV = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."},
        {"from": "human", "value": "Color?"}, {"from": "gpt", "value": "Black."}]

GOLDEN = {
    # haotian-liu/LLaVA conv_vicuna_v1: sep " ", sep2 "</s>", the tokenizer's BOS in front
    "vicuna_v1": "<s>" + chat.VICUNA_SYSTEM + " USER: <image>\nWhat is it? ASSISTANT: A cat.</s>USER: Color? ASSISTANT:"
                 " Black.</s>",
    # Meta's Llama 2 chat format, as LLaVA's conv_llava_llama_2 writes it
    "llama_2": "<s>[INST] <<SYS>>\n" + chat.LLAMA2_SYSTEM + "\n<</SYS>>\n\n<image>\nWhat is it? [/INST] A cat. </s>"
               "<s>[INST] Color? [/INST] Black. </s>",
    # Meta's Llama 3 instruct format
    "llama_3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<image>\nWhat is it?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nA cat.<|eot_id|><|start_header_id|>user<|end_header_id|>"
               "\n\nColor?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nBlack.<|eot_id|>",
    # ChatML as Qwen publishes it, default system prompt included
    "chatml": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\nWhat is it?"
              "<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nColor?<|im_end|>\n"
              "<|im_start|>assistant\nBlack.<|im_end|>\n",
    # LLaVA's preprocess_plain: image, caption, "\n"
    "plain": "<s><image>A cat.\n",
}
TARGETS = {"vicuna_v1": [" A cat.</s>", " Black.</s>"], "llama_2": [" A cat. </s>", " Black. </s>"],
           "llama_3": ["A cat.<|eot_id|>", "Black.<|eot_id|>"], "chatml": ["A cat.<|im_end|>", "Black.<|im_end|>"],
           "plain": ["A cat.\n"]}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_template_golden_strings_and_targets(name):
    pieces = chat.TEMPLATES[name](CONV)
    assert "".join(t for t, _ in pieces) == GOLDEN[name]
    assert [t for t, target in pieces if target] == TARGETS[name]


def bpe_tokenizer(tmp_path):
    """A tiny HF tokenizer.json with Llama-3 and ChatML special tokens, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
                "<|im_end|>", "<|endoftext|>"]
    tok.train_from_iterator(["What is it? A cat. Color? Black. user assistant system You are a helpful assistant."] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    return chat.Tokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("name", ["llama_3", "chatml"])
def test_labels_cover_exactly_the_assistant_turns(tmp_path, name):
    tok = bpe_tokenizer(tmp_path)
    ids, labels = chat.tokenize(chat.TEMPLATES[name](CONV), tok, 999, 3)
    assert ids.count(999) == 3
    assert tok.decode(ids[: ids.index(999)]) + "<image>" + tok.decode(ids[ids.index(999) + 3:]) == GOLDEN[name]
    kept = [i for i, lab in zip(ids, labels) if lab != -100]
    assert tok.decode(kept) == "".join(TARGETS[name])
    eot = tok.specials["<|eot_id|>" if name == "llama_3" else "<|im_end|>"]
    assert labels.count(eot) == 2  # the end-of-turn token is trained, so the model learns to stop


def test_sentencepiece_targets_decode_to_the_answers(shapes):
    tok = chat.Tokenizer(shapes / "tokenizer.model")
    ids, labels = chat.tokenize(chat.TEMPLATES["vicuna_v1"](CONV), tok, 999, 3)
    assert ids[0] == tok.bos_id and labels.count(tok.eos_id) == 2
    assert tok.decode([t for t in labels if t != -100]) == "A cat. Black."
    assert chat.generation_prompt("vicuna_v1", "What?").endswith("USER: What? ASSISTANT:")


# -----------------------------------------------------------------------------
# images


def test_crop_mode_matches_transformers_clip_processor():
    from transformers import CLIPImageProcessor

    raw = jpeg_bytes(90, 60, fmt="PNG")
    proc = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    ref = proc(images=Image.open(io.BytesIO(raw)), return_tensors="pt")["pixel_values"]
    ours = images.normalize_images(images.load_image(raw, 56, "crop")[None])
    one_level = 1 / (255 * min(images.CLIP_STD))  # torch's bicubic rounds within one uint8 level of PIL's
    assert (ref - ours).abs().max() <= one_level + 1e-6 and (ref - ours).abs().mean() < 0.1 * one_level


def test_pad_mode_pads_with_the_mean_colour_and_keeps_the_image_centred():
    img = np.zeros((20, 80, 3), dtype=np.uint8)  # black, 4:1
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    out = images.load_image(buf.getvalue(), 40, "pad").permute(1, 2, 0)  # (H, W, 3)
    mean = torch.tensor([int(m * 255) for m in images.CLIP_MEAN], dtype=torch.uint8)
    assert out.shape == (40, 40, 3)
    assert (out[0, 0] == mean).all() and (out[-1, -1] == mean).all()  # padding above and below
    assert (out[20, 5] == 0).all()  # the image itself, in the middle rows


def test_draft_mode_decodes_large_jpegs_at_reduced_scale():
    big = jpeg_bytes(2048, 1536)
    img = Image.open(io.BytesIO(big))
    img.draft("RGB", (336, 252))
    assert img.size == (512, 384)  # libjpeg's 1/4 scale, still >= the target
    out = images.load_image(big, 336, "pad")
    assert out.shape == (3, 336, 336)


def test_the_demo_tokenizer_stays_when_a_template_is_added(tmp_path, monkeypatch):
    """The shapes tokenizer learns the scaffolding of the templates it can write; a template added to chat.TEMPLATES
    (qwen3 and gemma3 were) must not change its vocabulary, or every figure measured on the demo moves."""
    import chat
    from shapes import make_shapes

    make_shapes(tmp_path / "before", n=120, seed=0)
    monkeypatch.setitem(chat.TEMPLATES, "novel", lambda conv, *a: [("<|novel_turn|> zebra quokka narwhal " * 4, False)])
    make_shapes(tmp_path / "after", n=120, seed=0)
    assert (tmp_path / "before/tokenizer.vocab").read_text() == (tmp_path / "after/tokenizer.vocab").read_text()
