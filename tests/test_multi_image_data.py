"""Several images a sample, video frames and anyres tiles: pack.py's records and members against tarfile,
webdataset and megatron-energon; images.py's tiles against transformers' LLaVA-NeXT / OneVision / SigLIP image
processors (PIL backends); the loader's static tile slots against anyres.image_layout / place_images."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from test_images import encode, photo

import chat
import images
import loader
import model_files
import audit
import pack

# -----------------------------------------------------------------------------
# records and shards: KEY.0.jpg, KEY.1.png... in tag order; KEY.f0.jpg... video frames


def conv(question, answer="Two."):
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


@pytest.fixture(scope="module")
def multi_json(tmp_path_factory):
    """OneVision-format records: several images with a tag each, video frames, and each way to get them wrong."""
    d = tmp_path_factory.mktemp("multi")
    imgs = d / "images"
    imgs.mkdir()
    sizes = {"a.jpg": (640, 480), "b.png": (333, 500), "c.jpg": (500, 333), "p.jpg": (1920, 1080)}
    for name, (w, h) in sizes.items():
        photo(w, h, seed=w).save(imgs / name, **({"quality": 90} if name.endswith("jpg") else {}))
    for i in range(3):
        photo(120, 90, seed=i).save(imgs / f"f{i}.jpg")
    (imgs / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")  # an MP4 header and nothing after it
    good = [
        {"id": "two", "image": ["a.jpg", "b.png"], "conversations": conv("<image> or <image>: which has more?")},
        {"id": "three", "image": ["c.jpg", "a.jpg", "b.png"],
         "conversations": conv("First <image>\nthen <image>\nand <image>?", "The third.")},
        {"id": "single", "image": "p.jpg", "conversations": conv("What is it?", "A photo.")},
        {"id": "video", "video": ["f0.jpg", "f1.jpg", "f2.jpg"],
         "conversations": conv("<video>\nWhat happens?", "It moves.")},
        {"id": "text", "conversations": conv("Hi?", "Hello.")},
    ]
    bad = [
        {"id": "one_tag_two_images", "image": ["a.jpg", "b.png"], "conversations": conv("<image> which?")},
        {"id": "three_tags_two_images", "image": ["a.jpg", "b.png"], "conversations": conv("<image><image><image>")},
        {"id": "video_file", "video": "clip.mp4", "conversations": conv("<video> what?")},
        {"id": "missing_frame", "video": ["f0.jpg", "f9.jpg"], "conversations": conv("<video> what?")},
        {"id": "both", "image": "a.jpg", "video": ["f0.jpg"], "conversations": conv("<video> what?")},
        {"id": "video_tag_no_video", "image": "a.jpg", "conversations": conv("<video> <image> what?")},
        {"id": "missing_second", "image": ["a.jpg", "nope.jpg"], "conversations": conv("<image> <image>")},
    ]
    (d / "d.json").write_text(json.dumps(good + bad))
    skips = pack.pack(d / "d.json", imgs, d / "out", shard_size=3)
    return d, good, skips


def test_multi_image_and_video_records_pack_and_bad_ones_are_skipped_by_reason(multi_json):
    d, good, skips = multi_json
    assert dict(skips.counts) == {"image_tag_count_mismatch": 2, "video_unreadable": 1, "missing_video_frame": 1,
                                  "image_and_video": 1, "video_tag_without_video": 1, "missing_image": 1}
    names = [m.name for p in sorted((d / "out").glob("*.tar")) for m in tarfile.open(p)]
    # the documented naming: one member per image, numbered in tag order; frames with an f
    assert names[:5] == ["sample000000000.0.jpg", "sample000000000.1.png", "sample000000000.txt",
                         "sample000000000.json", "sample000000001.0.jpg"]
    assert "sample000000002.jpg" in names and [n for n in names if ".f" in n] == \
        ["sample000000003.f0.jpg", "sample000000003.f1.jpg", "sample000000003.f2.jpg"]


def test_webdataset_and_energon_yield_every_image_of_a_sample_in_order(multi_json):
    import webdataset as wds
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    d, good, _ = multi_json
    want = {r["conversations"][1]["value"]: [Image.open(d / "images" / n).size for n in
                                            ([r["image"]] if isinstance(r.get("image"), str) else
                                             r.get("image") or r.get("video") or [])] for r in good}
    tars = sorted(str(p) for p in (d / "out").glob("*.tar"))
    got = {}
    for s in wds.WebDataset(tars, shardshuffle=False):
        keys = sorted((k for k in s if k.endswith((".jpg", ".png")) or k in ("jpg", "png")),
                      key=lambda k: int(k.split(".")[0].lstrip("f")) if "." in k else 0)
        got[s["txt"].decode()] = [Image.open(io.BytesIO(s[k])).size for k in keys]
    assert got == want
    ds = get_train_dataset(d / "out", split_part="train", batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, repeat=False,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    got = {}
    for s in get_loader(ds):  # energon decodes images to (3, H, W) tensors
        images = s.image if isinstance(s.image, list) else [] if s.image is None else [s.image]
        got[s.answers] = [(img.shape[-1], img.shape[-2]) for img in images]
    assert got == want


# -----------------------------------------------------------------------------
# tiles: equal to the transformers image processors (PIL backends, as here without torchvision)

NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-hf v1.6
OV_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]  # llava-onevision-qwen2-*-ov-hf


def next_config(**kw):  # llava-v1.6: CLIP ViT-L/14-336, "default" features
    from model_config import VIT_PRESETS, VLMConfig, vlm_preset

    return VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=vlm_preset("debug").llm,
                     **{"image_token_id": 1, "anyres": "anyres", "grid_pinpoints": NEXT_PINPOINTS} | kw)


def onevision_config(**kw):  # llava-onevision: SigLIP so400m 384, "full" features
    from model_config import VIT_PRESETS, VLMConfig, vlm_preset

    return VLMConfig(vision=VIT_PRESETS["siglip-so400m-patch14-384"], llm=vlm_preset("debug").llm, vision_layer=-1,
                     vision_select="cls_patch", **{"image_token_id": 1, "video_token_id": 2, "anyres": "anyres_max_9",
                                                   "grid_pinpoints": OV_PINPOINTS} | kw)


def levels(pixel_values, stats):
    """A processor's normalised pixel_values (n, 3, S, S) mapped back to 0..255."""
    mean, std = (torch.tensor(s).view(3, 1, 1) for s in stats)
    return (pixel_values * std + mean) * 255


# (width, height): a photo each way, sizes whose scaled side has a fraction (500x333), full HD, a panorama,
# a tiny odd one; they select different grids (LLaVA-NeXT 1x2, 2x1, 2x2, 1x3; OneVision up to 3x5 and 1x6)
TILE_SIZES = [(640, 480), (500, 333), (333, 500), (1920, 1080), (3000, 200), (17, 9), (1, 3000)]


@pytest.mark.parametrize("w,h", TILE_SIZES, ids=[f"{w}x{h}" for w, h in TILE_SIZES])
def test_tiles_equal_the_llava_next_and_onevision_processors(w, h):
    """Base view + grid (LlavaNextImageProcessorPil, CLIP 336, v1.6 pinpoints; LlavaOnevisionImageProcessorPil,
    SigLIP 384, OneVision pinpoints) and OneVision's view of an image among several (pad to square in the mean
    colour): within one uint8 level of the processors, and as many tiles as anyres.image_layout places."""
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    import images
    from anyres import image_layout

    raw = encode(photo(w, h, seed=w + h), "JPEG", quality=90)
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    other = np.asarray(photo(300, 200, seed=1))
    nxt, ov = next_config(), onevision_config()
    next_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                                image_grid_pinpoints=NEXT_PINPOINTS)
    stats = ov.vision.image_stats
    ov_processor = LlavaOnevisionImageProcessorPil(image_mean=list(stats[0]), image_std=list(stats[1]),
                                                   image_grid_pinpoints=OV_PINPOINTS)
    cases = [(nxt, "image", next_processor(images=rgb, input_data_format="channels_last")),
             (ov, "image", ov_processor(images=rgb, input_data_format="channels_last")),
             (ov, "multi", ov_processor(images=[[other, rgb]], input_data_format="channels_last"))]
    for cfg, kind, ref in cases:
        ref = torch.as_tensor(np.asarray(ref["pixel_values"][-1 if kind == "multi" else 0]))
        ours = images.image_tiles(raw, cfg, kind)
        assert ours.dtype == torch.uint8 and ours.shape == ref.shape, (cfg.anyres, kind)
        assert (ours.float() - levels(ref, cfg.vision.image_stats)).abs().max() <= 1, (cfg.anyres, kind)
        assert len(ours) == image_layout(cfg, h, w, kind)[0]
    # pad colours: the grid pads with black, OneVision's square view with int(255 * mean)
    wide = images.image_tiles(encode(Image.new("RGB", (1000, 100), (255, 255, 255)), "PNG"), ov, "image")
    assert wide[1:, :, 0].min() == 0 and wide[0].min() == 255  # the grid's top rows; the base view is squashed
    square = images.image_tiles(encode(Image.new("RGB", (1000, 100), (255, 255, 255)), "PNG"), ov, "multi")
    assert square[0, :, 0].unique().tolist() == [127]


def test_video_frames_are_squashed_as_llava_onevision_preprocesses_them():
    """LLaVA-NeXT's training code runs each frame through the SigLIP image processor (resize to 384 x 384);
    transformers' LlavaOnevisionVideoProcessor needs torchvision, which is not installed here."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    import images
    from anyres import image_layout

    cfg = onevision_config()
    processor = SiglipImageProcessorPil(size={"height": 384, "width": 384}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for w, h in [(640, 360), (333, 500)]:
        raw = encode(photo(w, h, seed=w), "JPEG", quality=90)
        ref = processor(images=np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")), return_tensors="pt")
        ours = images.image_tiles(raw, cfg, "video")
        assert (ours.float() - levels(ref["pixel_values"], cfg.vision.image_stats)).abs().max() <= 1
    assert image_layout(cfg, h, w, "video", n_frames=3)[0] == 3


# -----------------------------------------------------------------------------
# the loader's tile slots: the prompt LlavaOnevisionProcessor builds, the tiles in order, drops counted


def chat_tokenizer(folder):
    """A byte-level BPE tokenizer.json with Qwen2's chat markers and <image>/<video> as special tokens; the same
    file read by data.Tokenizer (ours) and PreTrainedTokenizerFast (transformers')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["system user assistant You are a helpful assistant. Which image has more circles?"] * 10,
                          trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                             "<|im_end|>", "<image>", "<video>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(exist_ok=True)
    t.save(str(folder / "tokenizer.json"))
    return chat.Tokenizer(folder / "tokenizer.json")


def onevision_processor(folder):
    """LlavaOnevisionProcessor without its video processor (that needs torchvision): images only."""
    from transformers import LlavaOnevisionProcessor, PreTrainedTokenizerFast
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    p = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    p.image_processor = LlavaOnevisionImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                        image_grid_pinpoints=OV_PINPOINTS)
    p.tokenizer, p.num_image_tokens, p.vision_feature_select_strategy = tok, 729, "full"
    p.vision_aspect_ratio, p.image_token, p.video_token = "anyres_max_9", "<image>", "<video>"
    p.image_token_id, p.video_token_id = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("<video>")
    return p


def tiny_onevision_config(tok):
    """OneVision's layout at test size: SigLIP-style 28 px tiles of 2x2 features, pinpoints up to 4x4 tiles (so
    anyres_max_9 reduces the biggest grids), <image>/<video> ids from `tok`."""
    from model_config import VIT_PRESETS, VLMConfig, vlm_preset

    vision = VIT_PRESETS["debug"].__class__(**{**vars(VIT_PRESETS["debug"]), "kind": "siglip"})
    return VLMConfig(vision=vision, llm=vlm_preset("debug").llm, vision_layer=-1, vision_select="cls_patch",
                     image_token_id=tok.specials["<image>"], video_token_id=tok.specials["<video>"],
                     anyres="anyres_max_9", grid_pinpoints=[[28 * i, 28 * j] for i in range(1, 5) for j in range(1, 5)])


def test_tiled_loader_resumes_at_the_exact_next_batch_and_the_legacy_one_refuses_several_images(multi_json, tmp_path):
    d, good, _ = multi_json
    tok = chat_tokenizer(tmp_path / "tok")
    cfg = tiny_onevision_config(tok)
    kw = {"batch_size": 2, "seq_len": 200, "image_size": 28, "image_token_id": cfg.image_token_id,
          "n_image_tokens": cfg.n_image_tokens, "template": "chatml", "shuffle_block": 2}
    run = loader.Loader(loader.ShardStream(d / "out", tok, vlm=cfg, max_tiles=17, **kw))
    batches = [b for b, _ in zip(run, range(4))]
    assert sum(b["image_weight"].gt(0).any(-1).sum() for b in batches) > 0
    resumed = loader.Loader(loader.ShardStream(d / "out", tok, vlm=cfg, max_tiles=17, **kw))
    state = {**run.state_dict(), "position": 2 * 2}  # after two batches
    resumed.load_state_dict(state)
    again = [b for b, _ in zip(resumed, range(2))]
    for a, b in zip(batches[2:], again):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    short = loader.ShardStream(d / "out", tok, vlm=cfg, max_tiles=17, **kw | {"batch_size": len(good), "seq_len": 40})
    assert short.batch(0)["dropped"].tolist() == [True] * 4 + [False]  # only the text-only sample fits in 40
    # the 3-image sample and the 13-tile photo: their image tokens would be cut; the others lose their answer
    assert dict(short.skips.counts) == {"image_beyond_seq_len": 2, "no_supervised_tokens": 2}
    legacy = loader.ShardStream(d / "out", tok, **kw | {"batch_size": len(good)})
    legacy.batch(0)
    assert legacy.skips.counts["multi_needs_max_tiles"] == 2 and legacy.skips.counts["video_needs_max_tiles"] == 1
    with pytest.raises(ValueError, match="max_tiles > 0 .* needs the model config"):
        loader.ShardStream(d / "out", tok, max_tiles=4, **kw)


def test_tiled_batches_hold_the_prompts_and_tiles_llava_onevision_processor_gives(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    processor = onevision_processor(tmp_path / "tok")
    imgs = tmp_path / "images"
    imgs.mkdir()
    for name, (w, h) in {"a.jpg": (640, 480), "b.png": (333, 500), "c.jpg": (500, 333), "big.jpg": (1920, 1080),
                         "f0.jpg": (160, 90), "f1.jpg": (160, 90)}.items():
        photo(w, h, seed=w + h).save(imgs / name)
    recs = [{"id": "two", "image": ["a.jpg", "b.png"], "conversations": conv("<image>\n<image>\nWhich has more?")},
            {"id": "one", "image": "c.jpg", "conversations": conv("What is <image> it?", "A photo.")},
            {"id": "text", "conversations": conv("Hi?", "Hello.")},
            {"id": "video", "video": ["f0.jpg", "f1.jpg"], "conversations": conv("<video>\nWhat happens?", "It moves.")},
            {"id": "big", "image": "big.jpg", "conversations": conv("<image>\nWhat is it?", "Too big.")}]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    cfg = onevision_config(image_token_id=processor.image_token_id, video_token_id=processor.video_token_id)
    stream = loader.ShardStream(tmp_path / "out", tok, batch_size=5, seq_len=2200, image_size=384,
                              image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template="chatml",
                              shuffle_block=1, vlm=cfg, max_tiles=4, image_mean=cfg.vision.image_stats[0])
    b = stream.batch(0)
    assert b["pixel_values"].shape == (5, 4, 3, 384, 384) and b["pixel_values"].dtype == torch.uint8
    assert b["image_index"].shape == b["image_weight"].shape == (5, 2200, 4)
    assert b["sample_id"].tolist() == [0, 1, 2, 3, 4] and b["dropped"].tolist() == [False] * 4 + [True]
    assert dict(stream.skips.counts) == {"too_many_tiles": 1}  # the 1920 x 1080 photo needs 16 tiles
    for row, rec in enumerate(recs[:4]):
        stored = json.loads(pack.prepare_record((0, rec, imgs))[0]["json"])["conversations"]  # tag added if absent
        prompt = "".join(text for text, _ in chat.render("chatml", stored, tok))
        names = rec.get("image") or rec.get("video") or []
        pictures = [np.asarray(Image.open(imgs / n).convert("RGB")) for n in ([names] if isinstance(names, str) else
                                                                               names)]
        if "video" in rec:  # the processor's own count for a 2-frame video (its frames need torchvision)
            prompt = prompt.replace("<video>", processor.replace_video_token(
                {"pixel_values_videos": [np.zeros((2, 3, 384, 384))]}, 0))
            ref = processor.tokenizer([prompt])
        else:
            ref = processor(text=[prompt], images=[pictures] if pictures else None)
        want = list(ref["input_ids"][0])
        ours = b["input_ids"][row].tolist()
        assert ours[: len(want)] == want and set(ours[len(want):]) <= {tok.pad_id}, rec["id"]
        placeholders = [i for i, t in enumerate(want) if t in (cfg.image_token_id, cfg.video_token_id)]
        weights = b["image_weight"][row].sum(-1)
        assert torch.allclose(weights[placeholders], torch.ones(len(placeholders)))  # each a view, newline or mix
        assert weights.sum() == len(placeholders)  # and nothing elsewhere: text rows take no image feature
        if pictures and "video" not in rec:  # the slots hold the processor's tiles, image after image
            tiles = torch.cat([torch.as_tensor(np.asarray(x)) for x in ref["pixel_values"]])
            n = len(tiles)
            assert (b["pixel_values"][row, :n].float() - levels(tiles, cfg.vision.image_stats)).abs().max() <= 1
            assert b["pixel_values"][row, n:].eq(0).all()
        if not names:
            assert b["pixel_values"][row].eq(0).all() and not b["has_image"][row]


def test_packed_rows_with_varying_image_tokens_give_each_sample_its_unpacked_loss(tmp_path):
    """A tiny OneVision-style model (anyres_max_9 over 28 px tiles, video pooling) on samples with 0, 1 (tiled),
    2 images and a video: packed three a row, each sample's summed loss equals its loss alone in a row."""
    from model import VLM

    tok = chat_tokenizer(tmp_path / "tok")
    imgs = tmp_path / "images"
    imgs.mkdir()
    for name, (w, h) in {"a.jpg": (640, 480), "b.png": (333, 500), "c.jpg": (500, 333), "f0.jpg": (160, 90),
                         "f1.jpg": (160, 90)}.items():
        photo(w, h, seed=w + h).save(imgs / name)
    recs = [{"id": "two", "image": ["a.jpg", "b.png"], "conversations": conv("<image>\n<image>\nWhich has more?")},
            {"id": "big", "image": "a.jpg", "conversations": conv("What is it?", "A photo of a thing.")},
            {"id": "text", "conversations": conv("Hi?", "Hello.")},
            {"id": "video", "video": ["f0.jpg", "f1.jpg"], "conversations": conv("<video>\nWhat happens?", "It moves.")},
            {"id": "small", "image": "c.jpg", "conversations": conv("<image>\nAnd this?", "Another one.")},
            {"id": "text2", "conversations": conv("Which is more, two or three?", "Three.")}]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    cfg = tiny_onevision_config(tok)
    with torch.device("meta"):
        model = VLM(cfg)
    model.to_empty(device="cpu").init_weights(seed=0)
    model.eval()
    kw = {"image_size": 28, "image_token_id": cfg.image_token_id, "n_image_tokens": cfg.n_image_tokens,
          "template": "chatml", "shuffle_block": 1, "vlm": cfg, "max_tiles": 20}

    def sample_losses(batch):
        pixels = images.normalize_images(batch["pixel_values"], *cfg.vision.image_stats)
        with torch.no_grad():
            _, loss = model(batch["input_ids"], pixels, batch["labels"], loss_reduction="none",
                            position_ids=batch.get("position_ids"), image_index=batch["image_index"],
                            image_weight=batch["image_weight"])  # (B, T) per token, 0 where unsupervised
        positions = batch.get("position_ids", torch.arange(loss.shape[1]).expand_as(loss))  # 0 starts a sample
        segment = (positions == 0).long().cumsum(1)  # which sample of its row each token belongs to
        return sorted(float(loss[r][segment[r] == s].sum()) for r in range(len(loss)) for s in segment[r].unique()
                      if loss[r][segment[r] == s].abs().sum() > 0)

    alone = loader.ShardStream(tmp_path / "out", tok, batch_size=6, seq_len=160, **kw).batch(0)
    packed_stream = loader.ShardStream(tmp_path / "out", tok, batch_size=2, seq_len=240, pack=3, **kw)
    packed = packed_stream.batch(0)
    assert not alone["dropped"].any() and not packed["dropped"].any()
    tiles_per_row = packed["pixel_values"].flatten(2).any(-1).sum(1)  # slots holding a tile
    assert tiles_per_row.sum() == alone["pixel_values"].flatten(2).any(-1).sum() > 20  # more than one row's slots
    assert (packed["image_weight"].sum(-1) > 0).sum() == (alone["image_weight"].sum(-1) > 0).sum()
    ours, theirs = sample_losses(packed), sample_losses(alone)
    assert len(theirs) == 6 and np.allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_sample_py_asks_about_several_images_as_the_processor_and_the_loader_build_them(tmp_path, capsys):
    """data.tiled_prompt (sample.py's) gives LlavaOnevisionProcessor's ids for a two-image question, and sample.py
    --together answers a tiny model exactly as generate() does on the tiled loader's own row for that sample."""
    import sample
    from model import VLM, left_pad

    tok = chat_tokenizer(tmp_path / "tok")
    processor = onevision_processor(tmp_path / "tok")
    imgs = tmp_path / "images"
    imgs.mkdir()
    photo(640, 480, seed=1).save(imgs / "a.jpg")
    photo(333, 500, seed=2).save(imgs / "b.png")
    blobs = [(imgs / n).read_bytes() for n in ("a.jpg", "b.png")]
    question = "Which image has more circles?"
    cfg = onevision_config(image_token_id=processor.image_token_id, video_token_id=processor.video_token_id)
    ids, tiles, _ = loader.tiled_prompt(cfg, "chatml", tok, question, blobs, image_mode="pad",
                                      mean=cfg.vision.image_stats[0])
    prompt = chat.generation_prompt("chatml", "<image>\n<image>\n" + question, tok)
    pictures = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs]
    ref = processor(text=[prompt], images=[pictures])
    assert ids == list(ref["input_ids"][0]) and len(tiles) == 2

    cfg = tiny_onevision_config(tok)
    with torch.device("meta"):
        model = VLM(cfg)
    model.to_empty(device="cpu").init_weights(seed=0)
    model_files.save_model(model, tmp_path / "ckpt", tmp_path / "tok")
    (tmp_path / "d.json").write_text(json.dumps([{"id": "q", "image": ["a.jpg", "b.png"],
                                                  "conversations": conv("<image>\n<image>\n" + question, "The first.")}]))
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    stream = loader.ShardStream(tmp_path / "out", tok, batch_size=1, seq_len=100, image_size=28,
                              image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template="chatml",
                              vlm=cfg, max_tiles=4, image_mean=cfg.vision.image_stats[0])
    b = stream.batch(0)
    start = int((b["labels"][0] != -100).nonzero()[0])  # the answer starts here: the prompt is what precedes it
    ids, mask = left_pad([b["input_ids"][0, :start].tolist()], tok.pad_id)
    want = model.eval().generate(ids, images.normalize_images(b["pixel_values"], *cfg.vision.image_stats),
                                 max_new_tokens=4, attention_mask=mask, image_index=b["image_index"][:, :start],
                                 image_weight=b["image_weight"][:, :start])
    capsys.readouterr()
    sample.main(["--ckpt", str(tmp_path / "ckpt"), "--image", str(imgs / "a.jpg"), str(imgs / "b.png"), "--together",
                 "--prompt", question, "--template", "chatml", "--max-new-tokens", "4", "--device", "cpu"])
    stop = chat.stop_token_id("chatml", tok)
    tokens = want[0].tolist()
    assert capsys.readouterr().out.strip() == tok.decode(tokens[: tokens.index(stop)] if stop in tokens else tokens).strip()
    with pytest.raises(SystemExit, match="video"):  # this model has a <video> id; a plain anyres one would not
        sample.main(["--ckpt", str(tmp_path / "ckpt"), "--image", str(imgs / "a.jpg"), "--video", "--prompt",
                     "<image> and <video>?", "--template", "chatml", "--device", "cpu"])


def test_audit_counts_what_the_tiled_and_the_one_image_loaders_would_drop(multi_json, tmp_path):
    d, good, _ = multi_json
    tok = chat_tokenizer(tmp_path / "tok")
    cfg = tiny_onevision_config(tok)
    args = (d / "out", tok, "chatml", 200, 28, cfg.n_image_tokens, cfg.image_token_id)
    tiled, single = io.StringIO(), io.StringIO()
    assert audit.audit(*args, show=0, out=tiled, vlm=cfg, max_tiles=12) == 0
    audit.audit(*args, show=0, out=single)
    # the 1920 x 1080 photo needs a base view and a 3x4 grid of 28 px tiles (pinpoint 84 x 112): 13
    assert "kept: 4" in tiled.getvalue() and "dropped, too_many_tiles: 1" in tiled.getvalue()
    assert "dropped, multi_needs_max_tiles: 2" in single.getvalue()
    assert "dropped, video_needs_max_tiles: 1" in single.getvalue() and "kept: 2" in single.getvalue()


def test_llava_next_rows_hold_the_prompts_and_tiles_llava_next_processor_gives(tmp_path):
    """LLaVA-NeXT tiles every image, one of several too: two grids in one row (CLIP 336, v1.6 pinpoints)."""
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = chat_tokenizer(tmp_path / "tok")
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok/tokenizer.json"))
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                                   image_grid_pinpoints=NEXT_PINPOINTS),
        tokenizer=hf_tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    imgs = tmp_path / "images"
    imgs.mkdir()
    photo(640, 480, seed=1).save(imgs / "a.jpg")
    photo(333, 500, seed=2).save(imgs / "b.png")
    rec = {"id": "two", "image": ["a.jpg", "b.png"], "conversations": conv("<image> and <image>: which has more?")}
    (tmp_path / "d.json").write_text(json.dumps([rec]))
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    cfg = next_config(image_token_id=tok.specials["<image>"])
    stream = loader.ShardStream(tmp_path / "out", tok, batch_size=1, seq_len=4000, image_size=336,
                              image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template="chatml",
                              vlm=cfg, max_tiles=8, image_mean=cfg.vision.image_stats[0])
    b = stream.batch(0)
    prompt = "".join(text for text, _ in chat.render("chatml", rec["conversations"], tok))
    pictures = [np.asarray(Image.open(imgs / n).convert("RGB")) for n in rec["image"]]
    ref = processor(text=[prompt], images=pictures)
    want = list(ref["input_ids"][0])
    assert b["input_ids"][0, : len(want)].tolist() == want and len(want) > 2340  # 480 x 640 alone takes 2340
    # the processor zero-pads each image's tiles to the batch's most: keep each image's own (480 x 640: base + 2x2,
    # 500 x 333: base + 2x1)
    tiles = torch.cat([torch.as_tensor(np.asarray(ref["pixel_values"][0]))[:5],
                       torch.as_tensor(np.asarray(ref["pixel_values"][1]))[:3]])
    assert (b["pixel_values"][0].float() - levels(tiles, cfg.vision.image_stats)).abs().max() <= 1


def test_one_image_loader_drops_a_one_frame_video_with_a_reason(tmp_path):
    """A video of one frame is still a <video> sample: the one-image loader (max_tiles 0) drops it by reason,
    never trains on it as text with a stray <video> tag."""
    imgs = tmp_path / "images"
    imgs.mkdir()
    photo(120, 90, seed=0).save(imgs / "f0.jpg")
    records = [{"id": "clip", "video": ["f0.jpg"], "conversations": conv("<video>\nWhat happens?", "It moves.")},
               {"id": "text", "conversations": conv("Hi?", "Hello.")}]
    (tmp_path / "d.json").write_text(json.dumps(records))
    pack.pack(tmp_path / "d.json", imgs, tmp_path / "out", shard_size=2)
    tok = chat_tokenizer(tmp_path / "tok")
    stream = loader.ShardStream(tmp_path / "out", tok, batch_size=2, seq_len=64, image_size=28,
                              image_token_id=tok.specials["<image>"], n_image_tokens=4, template="chatml")
    assert stream.batch(0)["dropped"].sum() == 1
    assert dict(stream.skips.counts) == {"video_needs_max_tiles": 1}
