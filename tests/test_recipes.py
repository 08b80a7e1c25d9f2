"""The shipped recipes (configs/*.py) against the data they are written for: a packed recipe's rows hold `pack`
typical samples, placed by the loader's own packing, so none is dropped for want of room."""

import pytest

import config
from conftest import ROOT
from loader import image_layouts, pack_rows

CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py"))

# text tokens of a typical sample of each packed recipe's intended data (its conversation in the recipe's template,
# the image placeholders aside), and a typical image of it (height, width): a COCO photo, 640 x 480, where the data
# is LLaVA's or OneVision's
TYPICAL = {
    "bench.py": (80, (480, 640)),  # LLaVA stage 1 (BLIP-558K): a one-line caption in the plain template
    "bench_7b_stage1.py": (80, (480, 640)),
    "llava_next_7b.py": (300, (480, 640)),  # LLaVA-NeXT's 760K: LLaVA-1.5's conversations and more
    "nanovlm.py": (400, (480, 640)),  # The Cauldron: a few question-answer turns in ChatML
    "onevision_qwen2_7b.py": (400, (480, 640)),  # OneVision's single-image SFT: a question or two and the answers
    "onevision_qwen3_8b.py": (400, (480, 640)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_each_packed_recipe_holds_pack_typical_samples_a_row(name):
    """pack x (a typical sample's image tokens + its text) within seq_len, and its tiles within max_tiles; the rows
    of a micro-batch of such samples filled by loader.pack_rows drop none of them."""
    cfg = config.parse([str(ROOT / "configs" / name)], config.DEFAULTS)  # no inputs read: they are not here
    if not cfg["pack"] and name not in TYPICAL:
        return  # one sample a row, cut at seq_len
    assert name in TYPICAL, f"configs/{name} packs {cfg['pack']} samples a row: add its typical sample to TYPICAL"
    text, (h, w) = TYPICAL[name]
    vlm = config.model_config(cfg)
    n_tiles, n_image_tokens = (1, vlm.n_image_tokens) if not vlm.anyres else \
        (lambda layout: (layout[0], len(layout[1])))(image_layouts(vlm, "image", [(h, w)])[0])
    length, pack = n_image_tokens + text, max(cfg["pack"], 1)
    assert pack * length <= cfg["seq_len"], (name, pack, length, cfg["seq_len"])
    assert not cfg["max_tiles"] or pack * n_tiles <= cfg["max_tiles"], (name, n_tiles, cfg["max_tiles"])
    rows = cfg["micro_batch_size"]
    # one batch a little mixed: as long, 10% longer and 10% shorter texts, as the loader would draw them
    lengths = [n_image_tokens + int(text * (0.9 + 0.1 * (i % 3))) for i in range(rows * pack)]
    where, _ = pack_rows(lengths, rows, cfg["seq_len"], [n_tiles] * len(lengths), cfg["max_tiles"])
    assert None not in where, f"{name}: {where.count(None)} of {len(lengths)} samples find no room in their batch"
