"""Image preprocessing against transformers' CLIPImageProcessor (crop) and LlavaImageProcessor(do_pad=True) (pad).
Without torchvision installed (as here) both resolve to their PIL backends (CLIPImageProcessorPil, ...), the
pipeline LLaVA-1.5 was trained with; the torchvision backend resizes with torch's uint8 bicubic instead."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import images
import loader
import pack
import shards

SIZE = 336


def photo(w, h, seed=0):
    """A photo-like RGB image: smooth colour fields, hard-edged objects, sensor noise."""
    rng = np.random.default_rng(seed)
    field = Image.fromarray((rng.random((max(2, h // 64), max(2, w // 64), 3)) * 255).astype(np.uint8))
    x = np.asarray(field.resize((w, h), Image.BICUBIC)).astype(np.float32)
    for _ in range(6):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        x[y0 : y0 + max(1, h // 4), x0 : x0 + max(1, w // 5)] = rng.integers(0, 256, 3)
    return Image.fromarray(np.clip(x + rng.normal(0, 6, x.shape), 0, 255).astype(np.uint8))


def encode(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def processors():
    from transformers import CLIPImageProcessor, LlavaImageProcessor

    kw = {"size": {"shortest_edge": SIZE}, "crop_size": {"height": SIZE, "width": SIZE}}
    return {"crop": CLIPImageProcessor(**kw), "pad": LlavaImageProcessor(do_pad=True, **kw)}


def reference_levels(processors, raw, mode):
    """The processor's pixel_values de-normalised back to 0..255, for the image as LLaVA's LazySupervisedDataset
    opens it: Image.open(...).convert("RGB"), alpha dropped. (Given RGBA, or an RGB image whose info still names a
    transparent colour, transformers 5 composites on white instead: a model trained by LLaVA never saw that.)"""
    img = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    ref = processors[mode](images=img, return_tensors="pt", input_data_format="channels_last")["pixel_values"][0]
    mean, std = torch.tensor(images.CLIP_MEAN).view(3, 1, 1), torch.tensor(images.CLIP_STD).view(3, 1, 1)
    return (ref * std + mean) * 255


def max_level_diff(processors, raw, mode, **kw):
    return (images.load_image(raw, SIZE, mode, **kw).float() - reference_levels(processors, raw, mode)).abs().max()


# COCO/LAION-range photos, portrait and landscape, sizes whose scaled side has a fractional part >= 0.5
# (500x333 -> 336x504.5), very wide and very tall, tiny, odd, one pixel off square;
# a phone photo's 4:3 (halved, for time) as JPEG
SWEEP = [(640, 480, "PNG"), (480, 640, "PNG"), (500, 333, "PNG"), (333, 500, "PNG"), (500, 375, "PNG"),
         (612, 612, "PNG"), (1024, 768, "JPEG"), (1920, 1080, "JPEG"), (2016, 1512, "JPEG"), (3000, 200, "PNG"),
         (200, 3000, "PNG"), (1, 1, "PNG"), (17, 9, "PNG"), (336, 335, "PNG"), (337, 336, "PNG")]


@pytest.mark.parametrize("w,h,fmt", SWEEP, ids=[f"{w}x{h}" for w, h, _ in SWEEP])
def test_crop_and_pad_are_within_one_level_of_the_transformers_processors(processors, w, h, fmt):
    raw = encode(photo(w, h, seed=w + h), fmt, **({"quality": 90} if fmt == "JPEG" else {"compress_level": 1}))
    for mode in ("crop", "pad"):
        assert max_level_diff(processors, raw, mode) <= 1, mode


# every mode PIL hands a loader, in the containers that carry it
MODES = [("RGBA", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("P", "GIF"), ("L", "JPEG"), ("CMYK", "JPEG"),
         ("I;16", "PNG"), ("1", "PNG"), ("RGBA", "WEBP"), ("CMYK", "TIFF")]


def in_mode(mode, fmt, w=500, h=333):
    img = photo(w, h, seed=7)
    if mode == "P":
        img = img.quantize(64)
        img.info["transparency"] = 0
    elif mode in ("RGBA", "LA"):
        img = img.convert(mode[:-1])
        img.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, w, dtype=np.uint8), (h, 1))))
    elif mode == "I;16":
        img = Image.fromarray(np.asarray(img.convert("L")).astype(np.uint16) * 257)
    else:
        img = img.convert(mode)
    kw = {"transparency": 0} if mode == "P" else {"lossless": True} if fmt == "WEBP" else {}
    raw = encode(img, fmt, **kw)
    assert Image.open(io.BytesIO(raw)).mode == mode, (mode, fmt)
    return raw


@pytest.mark.parametrize("mode,fmt", MODES, ids=[f"{m}-{f}" for m, f in MODES])
def test_every_image_mode_is_read_like_the_processors(processors, mode, fmt):
    raw = in_mode(mode, fmt)
    for image_mode in ("crop", "pad"):
        assert max_level_diff(processors, raw, image_mode) <= 1, image_mode


def test_pack_keeps_every_source_lossless(processors, tmp_path):
    (tmp_path / "images").mkdir()
    records = []
    for i, (mode, fmt) in enumerate(MODES):
        name = f"{i}.{fmt.lower()}"
        (tmp_path / "images" / name).write_bytes(in_mode(mode, fmt, 150, 200))
        records.append({"id": name, "image": name, "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                                       {"from": "gpt", "value": "A photo."}]})
    (tmp_path / "data.json").write_text(json.dumps(records))
    pack.pack(tmp_path / "data.json", tmp_path / "images", tmp_path / "shards", shard_size=100)
    (tar,) = sorted((tmp_path / "shards").glob("*.tar"))
    with open(tar, "rb") as f:
        samples = [shards.read_members(f, s, e)[1] for s, e in shards.sample_offsets(tar)]
    assert len(samples) == len(MODES)
    for members in samples:
        name = json.loads(members["json"])["id"]
        source = (tmp_path / "images" / name).read_bytes()
        _, stored = loader.sample_conversation(members)
        if name.endswith((".png", ".jpeg")):
            assert stored == source  # the file itself
        else:
            assert "png" in members  # re-encoded losslessly, never as JPEG
        ours = images.load_image(stored, SIZE, "crop").float()  # against the processor on the original file
        assert (ours - reference_levels(processors, source, "crop")).abs().max() <= 1


def test_fast_images_is_off_by_default_and_its_cost_is_bounded(processors):
    raw = encode(photo(2048, 1536, seed=3), "JPEG", quality=90)
    exact = images.load_image(raw, SIZE, "crop")
    assert torch.equal(exact, images.load_image(raw, SIZE, "crop", fast=False))
    img = Image.open(io.BytesIO(raw))
    img.draft("RGB", (2 * SIZE * 2048 // 1536 + 1, 2 * SIZE))
    assert img.size == (1024, 768)  # decoded at 1/2 scale, still twice the target
    diff = (images.load_image(raw, SIZE, "crop", fast=True).float() - reference_levels(processors, raw, "crop")).abs()
    assert 1 < diff.max() <= 16 and diff.flatten().quantile(0.999) <= 6  # the cost README states


@pytest.mark.parametrize("w,h", [(640, 480), (333, 500), (1920, 1080)])
def test_a_siglip_tower_gets_siglips_statistics_and_pad_colour(w, h):
    """A SigLIP tower was trained on (x - 0.5) / 0.5 and (LLaVA-OneVision) padded in its own mean colour: the
    loader, the normaliser and the exported processor follow the tower's kind, checked against transformers'
    SiglipImageProcessor (squash to size) and LlavaImageProcessor(do_pad=True) given SigLIP's statistics."""
    from transformers import LlavaImageProcessor, SiglipImageProcessor

    import processor
    from model_config import ViTConfig

    siglip = ViTConfig(image_size=384, patch_size=14, kind="siglip", act="gelu_pytorch_tanh")
    mean, std = siglip.image_stats
    assert (mean, std) == ((0.5,) * 3, (0.5,) * 3) and ViTConfig().image_stats == (images.CLIP_MEAN, images.CLIP_STD)
    raw = encode(photo(w, h, seed=w), "PNG", compress_level=1)
    img = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    references = {"resize": SiglipImageProcessor(size={"height": 384, "width": 384}),
                  "pad": LlavaImageProcessor(do_pad=True, size={"shortest_edge": 384},
                                             crop_size={"height": 384, "width": 384}, image_mean=mean, image_std=std)}
    for mode, reference in references.items():
        theirs = reference(images=img, return_tensors="pt", input_data_format="channels_last")["pixel_values"]
        ours = images.normalize_images(images.load_image(raw, 384, mode, mean=mean)[None], mean, std)
        assert ((theirs - ours) * 0.5 * 255).abs().max() <= 1.0 + 1e-3, mode  # within one uint8 level
    exported = processor.image_processor_config(384, "pad", *siglip.image_stats)
    assert exported["image_mean"] == [0.5] * 3 and exported["image_std"] == [0.5] * 3


# -----------------------------------------------------------------------------
# SigLIP2's processors resize bilinear: google/siglip2-base-patch16-224's published preprocessor_config.json
SIGLIP2_PROCESSOR = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                     "image_processor_type": "SiglipImageProcessor", "image_std": [0.5, 0.5, 0.5],
                     "processor_class": "SiglipProcessor", "resample": 2, "rescale_factor": 0.00392156862745098,
                     "size": {"height": 224, "width": 224}}
ODD = [(500, 333), (333, 500), (17, 9), (225, 223), (641, 479)]


def siglip2_vlm(**change):
    from dataclasses import replace

    import model_config

    return replace(model_config.vlm_preset("debug"), vision=model_config.VIT_PRESETS["siglip2-base-patch16-224"],
                   vision_select="cls_patch", **change)


def levels(pixel_values):
    """SigLIP's normalised pixels back to 0..255 (mean and std 0.5)."""
    return (pixel_values * 0.5 + 0.5) * 255


@pytest.mark.parametrize("w,h", ODD, ids=[f"{w}x{h}" for w, h in ODD])
def test_siglip2_pixels_are_within_one_level_of_its_published_processor(w, h):
    """Every path a SigLIP2 tower's pixels take (squash, pad, anyres tiles, video frames) resizes bilinear, as
    SiglipImageProcessor with the published config does; bicubic was 14-16 levels away on photos of odd sizes."""
    from transformers import LlavaImageProcessor, LlavaOnevisionImageProcessor, SiglipImageProcessor

    raw = encode(photo(w, h, seed=w * h), "PNG", compress_level=1)
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    siglip2 = SiglipImageProcessor(**SIGLIP2_PROCESSOR)
    squashed = levels(siglip2(images=rgb, return_tensors="pt")["pixel_values"][0])
    vlm = siglip2_vlm()
    assert (images.image_tiles(raw, vlm, "image", "resize")[0].float() - squashed).abs().max() <= 1
    assert (images.image_tiles(raw, vlm, "video")[0].float() - squashed).abs().max() <= 1  # a frame
    pad = {k: v for k, v in SIGLIP2_PROCESSOR.items() if k not in ("size", "image_processor_type", "processor_class")}
    padded = LlavaImageProcessor(do_pad=True, size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                 **pad)(images=rgb, return_tensors="pt")["pixel_values"][0]
    assert (images.image_tiles(raw, vlm, "image", "pad")[0].float() - levels(padded)).abs().max() <= 1
    pinpoints = [[224, 448], [448, 224], [448, 448], [224, 672]]
    tiled = siglip2_vlm(anyres="anyres_max_9", grid_pinpoints=pinpoints, video_token_id=510)
    theirs = LlavaOnevisionImageProcessor(image_grid_pinpoints=pinpoints, **{**pad, "size": SIGLIP2_PROCESSOR["size"]})
    want = levels(theirs(images=rgb, return_tensors="pt")["pixel_values"][0])
    ours = images.image_tiles(raw, tiled, "image").float()
    assert ours.shape == want.shape and (ours - want).abs().max() <= 1
    assert (images.load_image(raw, 224, "resize", mean=(0.5,) * 3).float() - squashed).abs().max() > 4  # bicubic


def test_the_export_and_from_hf_carry_the_towers_resize_filter(tmp_path):
    """to-hf writes the tower's filter ("resample" 2 for SigLIP2, 3 for CLIP and SigLIP), which transformers' processor
    then resizes with (our pixels, within a level); from-hf reads it from the processor config beside the weights."""
    import json

    from transformers import AutoImageProcessor

    import model_config
    import processor
    from hf_names import processor_resample
    from weight_files import ConversionError

    raw = encode(photo(333, 500, seed=3), "PNG", compress_level=1)
    for vlm, want in [(siglip2_vlm(), 2), (model_config.vlm_preset("debug"), 3)]:
        out = tmp_path / str(want)
        out.mkdir()
        processor.write_processor(vlm, out, "chatml", "resize")
        assert json.loads((out / "preprocessor_config.json").read_text())["resample"] == want
        theirs = AutoImageProcessor.from_pretrained(out)(images=np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")),
                                                        return_tensors="pt")["pixel_values"][0]
        mean, std = (torch.tensor(s).view(3, 1, 1) for s in vlm.vision.image_stats)
        ours = images.image_tiles(raw, vlm, "image", "resize")[0].float()
        assert (ours - (theirs * std + mean) * 255).abs().max() <= 1
        assert processor_resample(out, model_config.ViTConfig()).resample == want
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "processor_config.json").write_text(json.dumps({"image_processor": SIGLIP2_PROCESSOR}))
    assert processor_resample(tmp_path / "t5", model_config.ViTConfig()).resample == 2
    (tmp_path / "t5" / "processor_config.json").write_text(json.dumps({"image_processor": {"resample": 1}}))
    with pytest.raises(ConversionError, match="resample 1 is a filter llavax does not resize with"):
        processor_resample(tmp_path / "t5", model_config.ViTConfig())
