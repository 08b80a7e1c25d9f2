"""
Images for llavax: bytes -> uint8 tiles the vision tower sees, exactly as the transformers image processors make them.

    load_image      one view (LLaVA-1.5): crop, pad to square (expand2square) or squash to size x size
    image_tiles     one image's tiles for a VLMConfig: that view, LLaVA-NeXT/OneVision anyres (base view + grid),
                    OneVision's multi-image view (pad to square) or a video frame (squash)
    normalize_images  uint8 -> float with the tower's mean/std, on the accelerator

Moved out of data.py (over its line budget) when anyres tiling arrived; data.py re-exports these names.
The pixels are uint8 until normalize_images, so batches cross the DataLoader and the host link 4x smaller.
"""

import io
import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TORCH_MODES = {Image.BILINEAR: "bilinear", Image.BICUBIC: "bicubic"}  # fast=True's stand-ins for PIL's filters


ORIENTATION = 0x0112  # the EXIF tag a phone writes instead of rotating the pixels


def orientation(img):
    """The EXIF orientation of a PIL image: 1 upright, 2-8 mirrored and/or rotated (5-8 swap width and height)."""
    value = img.getexif().get(ORIENTATION, 1)
    return value if value in range(1, 9) else 1


def open_rgb(data):
    """transformers' load_image: Image.open, turned upright by its EXIF orientation (as photo viewers show a phone's
    picture; LLaVA's loader did not), then .convert("RGB"): any mode PIL reads, alpha dropped."""
    img = Image.open(io.BytesIO(data)) if isinstance(data, (bytes, bytearray)) else data
    if orientation(img) != 1:
        img = ImageOps.exif_transpose(img)
    return img if img.mode == "RGB" else img.convert("RGB")


def pad_to_square(img, mean):
    """expand2square: the image centred on a square of its long side, in the tower's mean colour (int(m * 255))."""
    w, h = img.size
    square = Image.new("RGB", (max(w, h), max(w, h)), tuple(int(m * 255) for m in mean))
    square.paste(img, ((max(w, h) - w) // 2, (max(w, h) - h) // 2))
    return square


def as_tensor(img):
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)  # (3, H, W) uint8


def load_image(data, size, mode="pad", fast=False, mean=CLIP_MEAN, resample=Image.BICUBIC):
    """Image bytes (any mode PIL reads, upright by EXIF: open_rgb) -> (3, size, size) uint8, equal to what
    transformers' PIL-backend processors compute from load_image(path) before rescaling (tests). 'crop':
    CLIPImageProcessor: short side to `size`, long side int(size * long / short) (truncated, as
    get_resize_output_image_size does), centre crop. 'pad': LLaVA's expand2square in the tower's mean colour (CLIP's
    by default), then the same (LlavaImageProcessor(do_pad=True)). 'resize': squash. resample: the tower's filter (PIL's
    number, ViTConfig.resample: bicubic, or SigLIP2's bilinear).
    fast=True trades exactness for speed (README, BENCHMARKS.md): a big JPEG decodes at 1/2, 1/4 or 1/8 scale
    (to at least twice the resized size; the draft acts on the stored, unrotated pixels), and torch's uint8
    antialiased bicubic (or bilinear) replaces PIL's."""
    img = Image.open(io.BytesIO(data))
    if fast and img.format == "JPEG":
        w, h = img.size
        scale = 2 * size / (min(w, h) if mode == "crop" else max(w, h))
        img.draft("RGB", (2 * size, 2 * size) if mode == "resize" else (math.ceil(w * scale), math.ceil(h * scale)))
    img = open_rgb(img)
    if mode == "pad":
        img = pad_to_square(img, mean)
    w, h = img.size
    if mode == "resize":
        nw, nh = size, size
    else:
        nw, nh = (int(size * w / h), size) if h <= w else (size, int(size * h / w))
    if fast:
        x = as_tensor(img)[None]  # (1, 3, h, w)
        x = F.interpolate(x, size=(nh, nw), mode=TORCH_MODES[resample], antialias=True)[0]  # (3, nh, nw)
    else:  # PIL's, as the reference
        x = as_tensor(img.resize((nw, nh), resample))  # (3, nh, nw)
    top, left = (nh - size) // 2, (nw - size) // 2
    return x[:, top : top + size, left : left + size].contiguous()


def anyres_tiles(img, size, best_resolution, resample=Image.BICUBIC):
    """LLaVA-NeXT's tiling of a PIL RGB image into (1 + rows * cols, 3, size, size): the base view (the whole
    image squashed to size x size, aspect lost) first, then the grid row-major. The grid is the image resized
    into best_resolution (height, width) keeping its aspect (the short side rounded up, as HF's
    get_patch_output_size does) and centred on zeros (black: HF pads tiles with 0, not the mean)."""
    w, h = img.size
    best_h, best_w = best_resolution
    if best_w / w < best_h / h:
        nw, nh = best_w, min(math.ceil(h * best_w / w), best_h)
    else:
        nw, nh = min(math.ceil(w * best_h / h), best_w), best_h
    canvas = torch.zeros((3, best_h, best_w), dtype=torch.uint8)
    top, left = (best_h - nh) // 2, (best_w - nw) // 2
    canvas[:, top : top + nh, left : left + nw] = as_tensor(img.resize((nw, nh), resample))
    rows, cols = best_h // size, best_w // size
    grid = canvas.view(3, rows, size, cols, size).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, size, size)
    base = as_tensor(img.resize((size, size), resample))[None]  # (1, 3, size, size)
    return torch.cat([base, grid])  # (1 + rows * cols, 3, size, size)


def image_tiles(data, vlm, kind="image", image_mode="pad", mean=None):
    """(n_tiles, 3, S, S) uint8 tiles of one image for VLMConfig `vlm`, in the order anyres.image_layout counts them.
    kind "image": one image a sample: LLaVA-NeXT/OneVision anyres tiling (LlavaNextImageProcessor,
    LlavaOnevisionImageProcessor), or load_image's single view (`image_mode`) when vlm.anyres is "". kind "multi":
    one of several images: OneVision (anyres_max_N) pads it to a square in the mean colour and takes that one view
    (its processor's batch_num_images > 1 rule); LLaVA-NeXT tiles it as a single image. kind "video": a frame
    squashed to S x S (OneVision's video preprocessing). Every resize uses the tower's filter (vlm.vision.resample)."""
    from anyres import select_best_resolution

    size, mean, resample = vlm.vision.image_size, mean or vlm.vision.image_stats[0], vlm.vision.resample
    if not vlm.anyres and kind != "video":
        return load_image(data, size, image_mode, mean=mean, resample=resample)[None]
    img = open_rgb(data)
    if kind == "video":
        return as_tensor(img.resize((size, size), resample))[None]
    if kind == "multi" and vlm.anyres.startswith("anyres_max"):
        return as_tensor(pad_to_square(img, mean).resize((size, size), resample))[None]
    w, h = img.size
    return anyres_tiles(img, size, select_best_resolution(h, w, vlm.grid_pinpoints), resample)


def png_chunk_types(data):
    """The chunk types of PNG bytes, read from the chunk headers alone."""
    types, at = [], 8  # after the signature
    while at + 8 <= len(data) and (not types or types[-1] != b"IEND"):
        types.append(bytes(data[at + 4 : at + 8]))
        at += 12 + int.from_bytes(data[at : at + 4], "big")  # length, type, data, CRC
    return types


def image_hw(data):
    """(height, width) of image bytes as open_rgb turns them upright, from the header alone (what
    anyres.image_layout needs)."""
    img = Image.open(io.BytesIO(data))
    w, h = img.size
    # a PNG's EXIF may follow its pixels, which PIL would decode to reach it: only when the chunk is there
    if img.format == "PNG" and "exif" not in img.info and b"eXIf" not in png_chunk_types(data):
        return h, w
    return (w, h) if orientation(img) >= 5 else (h, w)


def normalize_images(images, mean=CLIP_MEAN, std=CLIP_STD):
    """(..., 3, H, W) uint8 -> float32 with the tower's mean/std (model.ViTConfig.image_stats), as one multiply-add
    per pixel, on the images' device (train.py runs it on the accelerator: batches cross the DataLoader and the
    host link as uint8, 4x smaller). Any leading dims: (B, 3, S, S) or the tile slots' (B, n_slots, 3, S, S)."""
    scale = torch.tensor([1 / (255 * s) for s in std], device=images.device).view(3, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], device=images.device).view(3, 1, 1)
    return images.float().mul_(scale).add_(shift)  # (x/255 - mean)/std = x*scale + shift
