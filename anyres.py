"""
Image layouts for LLaVA-NeXT anyres and LLaVA-OneVision: which tile features, with what weights, each image
placeholder of a row takes. Pure index arithmetic on image sizes (no weights, no I/O): data.py, images.py and
sample.py call it to build a batch; model.VLM.place_features applies the result with one gather per tap.

A row's images run through the ViT as tiles in fixed slots; placeholder t of the row then takes
sum_k weight[t, k] * table[index[t, k]] from the table [image_newline, slot 0's P features, slot 1's, ...].
One gather covers LLaVA-NeXT's base-then-grid order, unpadding and newlines, OneVision's reduction and
video pooling (bilinear: <= 4 weighted neighbours), several images a row, and packing, all at static shapes.
"""

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from model_config import VLMConfig


def select_best_resolution(height, width, pinpoints):
    """HF's rule: the pinpoint keeping most of the image's pixels after an aspect-kept resize into it (never
    counting more than the image has), ties to the one wasting the fewest pixels."""
    best, best_fit = None, (0, -math.inf)
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        if (effective, effective - w * h) > best_fit:
            best, best_fit = (int(h), int(w)), (effective, effective - w * h)
    return best


def anyres_grid(cfg: VLMConfig, height, width):
    """(rows, cols) of vision.image_size tiles that an image of height x width pixels is cut into."""
    best_h, best_w = select_best_resolution(height, width, cfg.grid_pinpoints)
    return best_h // cfg.vision.image_size, best_w // cfg.vision.image_size


@lru_cache
def bilinear_taps(n_in, n_out):
    """Source rows (n_out, <= 2) and weights of F.interpolate(mode="bilinear", align_corners=False) along one axis,
    read off the op itself (it resizes an identity), so they are the weights HF's call uses, to the bit."""
    eye = torch.eye(n_in).view(n_in, 1, n_in, 1)  # (n_in sources, 1, n_in, 1)
    w = F.interpolate(eye, size=(n_out, 1), mode="bilinear", align_corners=False)[:, 0, :, 0].T  # (n_out, n_in)
    weight, index = w.topk(min(2, n_in), dim=1)
    return index, weight


def _resize(grid, height, width):
    """A map of feature indices (h, w) bilinearly resized: index, weight (height, width, <= 4)."""
    (iy, wy), (ix, wx) = bilinear_taps(grid.shape[0], height), bilinear_taps(grid.shape[1], width)
    index = grid[iy[:, None, :, None], ix[None, :, None, :]]  # (height, width, 2, 2)
    return index.flatten(2), (wy[:, None, :, None] * wx[None, :, None, :]).flatten(2)


def _tokens(index, weight, taps, newline_per_row=False, newline_at_end=False):
    """(h, w, k) or (n, k) maps -> (n_tokens, taps), row-major, with image_newline (-1) after each row or at the end."""
    index, weight = F.pad(index, (0, taps - index.shape[-1])), F.pad(weight, (0, taps - weight.shape[-1]))
    newline_index, newline_weight = torch.zeros(taps, dtype=torch.long), torch.zeros(taps)
    newline_index[0], newline_weight[0] = -1, 1.0
    if newline_per_row:
        rows = index.shape[0]
        index = torch.cat([index, newline_index.expand(rows, 1, taps)], dim=1)  # (h, w + 1, taps)
        weight = torch.cat([weight, newline_weight.expand(rows, 1, taps)], dim=1)
    index, weight = index.reshape(-1, taps), weight.reshape(-1, taps)
    if newline_at_end:
        index, weight = torch.cat([index, newline_index[None]]), torch.cat([weight, newline_weight[None]])
    return index, weight


def unpad_crop(height, width, grid_h, grid_w):
    """Rows and columns of a grid_h x grid_w feature map that hold the image, not the centred padding (HF's
    unpad_image: the padding is cut symmetrically, so an odd remainder keeps one row of it)."""
    if width / height > grid_w / grid_h:
        pad = (grid_h - int(round(height * (grid_w / width), 7))) // 2
        return slice(pad, grid_h - pad), slice(0, grid_w)
    pad = (grid_w - int(round(width * (grid_h / height), 7))) // 2
    return slice(0, grid_h), slice(pad, grid_w - pad)


def image_layout(cfg: VLMConfig, height, width, kind="image", n_frames=1):
    """(n_tiles, index (n_tokens, taps), weight (n_tokens, taps)) for one image of height x width pixels, as HF's
    LLaVA-NeXT / OneVision models place it. index is local to the image's tiles (tile * P + p; -1 is
    image_newline); unused taps have index 0, weight 0. kind "image": a single image of its sample; "multi": one
    of several (OneVision: one view and a newline, no tiles); "video": n_frames frames, each pooled 2x, then one
    newline. n_tokens is the count LlavaNextProcessor / LlavaOnevisionProcessor put in the prompt."""
    if kind not in ("image", "multi", "video"):
        raise ValueError(f"image_layout: kind must be 'image', 'multi' or 'video', got {kind!r}")
    P, taps, side = cfg.n_image_tokens, cfg.image_taps, cfg.vision.image_size // cfg.vision.patch_size
    if kind == "video":
        if cfg.video_token_id is None or n_frames < 1:
            raise ValueError(f"image_layout: a video needs video_token_id in the config and >= 1 frame "
                             f"(video_token_id={cfg.video_token_id}, n_frames={n_frames})")
        frames = torch.arange(n_frames * P).view(n_frames * side, side)  # frames stacked along the height
        pooled = [_resize(frames[f * side : (f + 1) * side], -(-side // 2), -(-side // 2)) for f in range(n_frames)]
        index, weight = (torch.cat([p[i] for p in pooled]) for i in (0, 1))
        return (n_frames, *_tokens(index, weight, taps, newline_at_end=True))
    if not (height >= 1 and width >= 1 and int(height) == height and int(width) == width):
        raise ValueError(f"image_layout: image size {height}x{width} is not a positive whole number of pixels")
    one_view = torch.arange(P)[:, None], torch.ones(P, 1)  # (P, 1) each
    if not cfg.anyres:
        return (1, *_tokens(*one_view, taps))
    if kind == "multi" and cfg.anyres != "anyres":  # OneVision's multi-image rule; LLaVA-NeXT tiles every image
        return (1, *_tokens(*one_view, taps, newline_at_end=True))
    rows, cols = anyres_grid(cfg, height, width)
    y, x = torch.arange(rows * side)[:, None], torch.arange(cols * side)[None]
    grid = (1 + (y // side) * cols + x // side) * P + (y % side) * side + x % side  # (rows * side, cols * side)
    grid = grid[unpad_crop(height, width, rows * side, cols * side)]
    h, w = grid.shape
    index, weight = grid[..., None], torch.ones(h, w, 1)
    if cfg.anyres.startswith("anyres_max_"):
        ratio = math.sqrt(h * w / (int(cfg.anyres[len("anyres_max_"):]) * side**2))
        if ratio > 1.1:
            index, weight = _resize(grid, int(h // ratio), int(w // ratio))
    index, weight = _tokens(index, weight, taps, newline_per_row=True)
    base_index, base_weight = _tokens(*one_view, taps)
    return 1 + rows * cols, torch.cat([base_index, index]), torch.cat([base_weight, weight])


def place_images(input_ids_row, layouts, cfg: VLMConfig):
    """A row's image_index, image_weight (T, taps): its images' layouts, in placeholder order, put at its image and
    video placeholders, their tiles in consecutive slots from slot 0 (local index -> 1 + first_slot * P + local,
    image_newline -> 0). Other positions: index 0, weight 0."""
    ids = torch.as_tensor(input_ids_row)
    is_placeholder = ids == cfg.image_token_id
    if cfg.video_token_id is not None:
        is_placeholder = is_placeholder | (ids == cfg.video_token_id)
    at = is_placeholder.nonzero().squeeze(1)
    indexes, weights, first = [], [], 0
    for n_tiles, index, weight in layouts:
        indexes.append(torch.where(index < 0, 0, 1 + first * cfg.n_image_tokens + index))
        weights.append(weight)
        first += n_tiles
    n_tokens = sum(len(i) for i in indexes)
    if n_tokens != len(at):
        raise ValueError(f"place_images: the row has {len(at)} image/video placeholders but its {len(layouts)} "
                         f"images take {n_tokens} tokens")
    index = torch.zeros(len(ids), cfg.image_taps, dtype=torch.long)
    weight = torch.zeros(len(ids), cfg.image_taps)
    if n_tokens:
        index[at], weight[at] = torch.cat(indexes), torch.cat(weights)
    return index, weight
