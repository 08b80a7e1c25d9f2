"""Phone photos carry an EXIF orientation instead of rotated pixels. llavax shows the model the upright picture, as
transformers' load_image (a path, a URL, or an opened image) and photo viewers do: pack -> loader, the anyres tiling
and sample.py are checked against load_image(path) -> the exported image processor, on JPEGs written here with
each rotating orientation and sizes that divide by nothing."""

import io
import json

import pytest
import torch
from PIL import Image, ImageOps
from test_convert import TINY_PINPOINTS
from test_images import photo

import images
import loader
import model_files
import pack
import processor
from model import build_model
from model_config import vlm_preset

# (stored width, stored height, EXIF orientation): 6 and 8 are a phone held upright (rotate 90 one way or the
# other), 3 upside down, 5 and 7 rotated and mirrored
ROTATED = [(95, 57, 6), (95, 57, 8), (57, 95, 6), (61, 37, 3), (37, 61, 5), (83, 41, 7)]


def rotated_jpeg(path, w, h, orientation, seed=0):
    exif = Image.Exif()
    exif[0x0112] = orientation
    photo(w, h, seed=seed).save(path, "JPEG", quality=95, exif=exif.tobytes())
    return path


def image_processor(tmp_path, image_cfg):
    """The image processor an export ships, from its preprocessor_config.json."""
    from transformers import AutoImageProcessor

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image_cfg))
    return AutoImageProcessor.from_pretrained(tmp_path)


def levels(pixel_values, mean=images.CLIP_MEAN, std=images.CLIP_STD):
    """A processor's normalised pixel_values back to 0..255."""
    return pixel_values * torch.tensor(std).view(3, 1, 1) * 255 + torch.tensor(mean).view(3, 1, 1) * 255


def pack_one(tmp_path, name):
    (tmp_path / "d.json").write_text(json.dumps([{"id": "phone", "image": name, "conversations": [
        {"from": "human", "value": "What is it?"}, {"from": "gpt", "value": "A photo."}]}]))
    skips = pack.pack(tmp_path / "d.json", tmp_path, tmp_path / "shards")
    assert not skips.counts, skips.summary()
    return tmp_path / "shards"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from test_data import bpe_tokenizer

    return bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("w,h,orientation", ROTATED)
def test_packed_photo_reaches_the_model_upright_as_transformers_load_image_gives_it(tmp_path, tok, w, h, orientation):
    from transformers.image_utils import load_image

    path = rotated_jpeg(tmp_path / "phone.jpg", w, h, orientation)
    assert Image.open(path).size == (w, h)  # stored as the sensor saw it
    upright = load_image(str(path))
    assert upright.size == ((h, w) if orientation >= 5 else (w, h))
    assert images.image_hw(path.read_bytes()) == (upright.height, upright.width)
    shards = pack_one(tmp_path, "phone.jpg")
    for mode in ("crop", "pad", "resize"):
        stream = loader.ShardStream(shards, tok, 1, 64, 56, tok.vocab_size, 4, template="chatml", image_mode=mode)
        ours = stream.batch(0)["pixel_values"][0].float()
        hf = image_processor(tmp_path / mode, processor.image_processor_config(56, mode))
        theirs = levels(hf(images=upright, return_tensors="pt").pixel_values[0])
        assert (ours - theirs).abs().max() <= 1 + 1e-3, mode  # one uint8 level
        # the check can fail: the processor on the image as stored is far off
        unrotated = levels(hf(images=Image.open(path).convert("RGB"), return_tensors="pt").pixel_values[0])
        assert (ours - unrotated).abs().max() > 20, mode
        # a user who opens the file for the processor turns it upright first (README)
        opened = levels(hf(images=ImageOps.exif_transpose(Image.open(path)), return_tensors="pt").pixel_values[0])
        assert torch.equal(opened, theirs)


@pytest.mark.parametrize("orientation", [6, 8])
def test_fast_images_decodes_a_big_phone_jpeg_upright(tmp_path, tok, orientation):
    """fast_images' draft decode (here at 1/2 scale) acts on the stored pixels: the result is still the upright
    photo, within the cost README states for fast_images (test_images' photo, at 336 px)."""
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = orientation
    photo(2048, 1536, seed=3).save(tmp_path / "big.jpg", "JPEG", quality=90, exif=exif.tobytes())
    shards = pack_one(tmp_path, "big.jpg")
    stream = loader.ShardStream(shards, tok, 1, 64, 336, tok.vocab_size, 4, template="chatml", image_mode="crop",
                              fast_images=True)
    ours = stream.batch(0)["pixel_values"][0].float()
    hf = image_processor(tmp_path / "crop", processor.image_processor_config(336, "crop"))
    diff = (ours - levels(hf(images=load_image(str(tmp_path / "big.jpg")), return_tensors="pt").pixel_values[0])).abs()
    assert diff.max() <= 16 and diff.flatten().quantile(0.999) <= 6
    unrotated = levels(hf(images=Image.open(tmp_path / "big.jpg").convert("RGB"), return_tensors="pt").pixel_values[0])
    assert (ours - unrotated).abs().max() > 20


def anyres_cfg(tok):
    return vlm_preset("debug").with_overrides({"anyres": "anyres", "grid_pinpoints": TINY_PINPOINTS,
                                               "image_token_id": tok.vocab_size,
                                               "llm": {"vocab_size": -(-(tok.vocab_size + 1) // 64) * 64}})


def anyres_processor(tmp_path, cfg):
    image_cfg, _ = processor.anyres_processor_configs(cfg, processor.image_processor_config(28, "pad"), {})
    return image_processor(tmp_path, image_cfg)


# (stored w, stored h, orientation): the upright photo picks another grid than the stored one (1x3 <-> 2x1 or 3x1)
@pytest.mark.parametrize("w,h,orientation", [(90, 33, 6), (90, 33, 8), (35, 97, 8)])
def test_anyres_tiles_the_upright_photo_on_its_own_grid(tmp_path, tok, w, h, orientation):
    from transformers.image_utils import load_image

    from anyres import image_layout

    cfg = anyres_cfg(tok)
    path = rotated_jpeg(tmp_path / "phone.jpg", w, h, orientation)
    shards = pack_one(tmp_path, "phone.jpg")
    stream = loader.ShardStream(shards, tok, 1, 256, 28, tok.vocab_size, 4, template="chatml", vlm=cfg, max_tiles=8)
    ids, _, tiles, layouts = stream.encode_tiled(0)
    upright = load_image(str(path))
    theirs = anyres_processor(tmp_path / "hf", cfg)(images=upright, return_tensors="pt")
    assert theirs.image_sizes[0].tolist() == [upright.height, upright.width]
    assert tiles.shape == theirs.pixel_values[0].shape  # (1 + rows x cols, 3, 28, 28): the upright photo's grid
    assert tiles.shape[0] != image_layout(cfg, h, w)[0]  # the stored photo's grid differs
    assert (tiles.float() - levels(theirs.pixel_values[0])).abs().max() <= 1 + 1e-3
    assert ids.count(cfg.image_token_id) == len(layouts[0][1]) == len(image_layout(cfg, upright.height, upright.width)[1])


@pytest.mark.parametrize("anyres", [False, True])
def test_sample_sees_the_photo_upright(tmp_path, tok, monkeypatch, anyres):
    """sample.py on the phone's file hands the model the pixels the exported processor makes from load_image(path)."""
    from transformers.image_utils import load_image

    import sample

    cfg = anyres_cfg(tok) if anyres else vlm_preset("debug").with_overrides(
        {"image_token_id": tok.vocab_size, "llm": {"vocab_size": -(-(tok.vocab_size + 1) // 64) * 64}})
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "ckpt", tokenizer_dir=tok.path.parent)
    path = rotated_jpeg(tmp_path / "phone.jpg", 90, 33, 6)
    seen = {}
    monkeypatch.setattr(sample, "answer", lambda args, model, template, tok, ids, mask, pixels, extra:
                        seen.update(pixels=pixels))
    sample.main(["--ckpt", str(tmp_path / "ckpt"), "--image", str(path), "--prompt", "What is it?", "--template",
                 "chatml", "--device", "cpu"])
    if anyres:
        reference = anyres_processor(tmp_path / "hf", cfg)
    else:
        reference = image_processor(tmp_path / "hf", processor.image_processor_config(28, "pad"))
    theirs = reference(images=load_image(str(path)), return_tensors="pt").pixel_values
    assert seen["pixels"].shape == theirs.shape
    assert ((seen["pixels"] - theirs) * torch.tensor(images.CLIP_STD).view(3, 1, 1) * 255).abs().max() <= 1 + 1e-3


def test_pack_turns_a_format_it_re_encodes_upright(tmp_path):
    """WebP and TIFF become PNG in the shard (pack.stored_image), which keeps no EXIF: their pixels are turned first,
    so the reader sees what load_image gives for the source file."""
    from transformers.image_utils import load_image

    from images import open_rgb

    exif = Image.Exif()
    exif[0x0112] = 6
    for fmt, kw in [("WEBP", {"lossless": True}), ("TIFF", {})]:
        source = tmp_path / f"phone.{fmt.lower()}"
        photo(45, 27, seed=3).save(source, fmt, exif=exif.tobytes(), **kw)
        img = Image.open(source)
        _, stored = pack.stored_image(source.read_bytes(), img)
        assert Image.open(io.BytesIO(stored)).format == "PNG"
        assert open_rgb(stored).tobytes() == load_image(str(source)).tobytes(), fmt


def png_chunks(raw):
    """[(type, whole chunk bytes)] of a PNG file after its signature."""
    chunks, at = [], 8
    while at < len(raw):
        length = int.from_bytes(raw[at : at + 4], "big")
        chunks.append((raw[at + 4 : at + 8], raw[at : at + 12 + length]))
        at += 12 + length
    return chunks


@pytest.mark.parametrize("exif_after_pixels", [False, True])
def test_a_png_with_an_exif_orientation_is_sized_and_tiled_upright(tmp_path, tok, exif_after_pixels):
    """PNG carries EXIF in an eXIf chunk, before or (as some writers put it) after the pixel data; load_image turns
    it upright either way, and image_hw (the anyres layout) agrees with the tiles without decoding a PNG that has
    no such chunk."""
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    photo(90, 33, seed=5).save(buf, "PNG", exif=exif.tobytes())
    raw = buf.getvalue()
    if exif_after_pixels:
        chunks = png_chunks(raw)
        moved = [c for t, c in chunks if t == b"eXIf"]
        rest = [c for t, c in chunks if t != b"eXIf"]
        raw = raw[:8] + b"".join(rest[:-1] + moved + rest[-1:])  # before IEND
        assert "exif" not in Image.open(io.BytesIO(raw)).info  # PIL finds it only by decoding
    (tmp_path / "phone.png").write_bytes(raw)
    upright = load_image(str(tmp_path / "phone.png"))
    assert upright.size == (33, 90)
    assert images.image_hw(raw) == (90, 33)
    cfg = anyres_cfg(tok)
    theirs = anyres_processor(tmp_path / "hf", cfg)(images=upright, return_tensors="pt").pixel_values[0]
    tiles = images.image_tiles(raw, cfg)
    assert tiles.shape == theirs.shape and (tiles.float() - levels(theirs)).abs().max() <= 1 + 1e-3
