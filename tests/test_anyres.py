"""LLaVA-NeXT anyres and LLaVA-OneVision (anyres_max_9, several images, video) against transformers: the image
token counts of LlavaNextProcessor / LlavaOnevisionProcessor, and the fp32 logits of
LlavaNextForConditionalGeneration / LlavaOnevisionForConditionalGeneration, built tiny and random."""

import pytest
import torch

from model import VIT_PRESETS, VLMConfig, image_layout, place_images, vlm_preset

NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-hf v1.6
OV_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]  # llava-onevision-qwen2-*-ov-hf

# (height, width): photos both ways, odd sizes, panoramas, slivers and a single pixel
SIZES = [(480, 640), (640, 480), (333, 500), (500, 333), (1080, 1920), (1920, 1080), (720, 1280), (4032, 3024),
         (2000, 3000), (200, 3000), (3000, 200), (1, 3000), (3000, 1), (1, 1), (336, 336), (384, 384), (337, 673),
         (299, 299), (513, 511), (100, 1000)]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1, "<video>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<image>", "<video>"])


def real_next_config():  # llava-v1.6: CLIP ViT-L/14-336, HF "default" features
    return VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=vlm_preset("debug").llm, image_token_id=1,
                     anyres="anyres", grid_pinpoints=NEXT_PINPOINTS)


def real_onevision_config():  # llava-onevision: SigLIP so400m 384, HF "full" features
    return VLMConfig(vision=VIT_PRESETS["siglip-so400m-patch14-384"], llm=vlm_preset("debug").llm, vision_layer=-1,
                     vision_select="cls_patch", image_token_id=1, video_token_id=2, anyres="anyres_max_9",
                     grid_pinpoints=OV_PINPOINTS)


def test_token_counts_equal_the_processors():
    """Every size, the real pinpoints and tile sizes: image_layout gives as many tokens as the HF processors put in
    the prompt, for single images, images of a multi-image sample, and videos."""
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor, LlavaOnevisionImageProcessor
    from transformers import LlavaOnevisionProcessor

    next_processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                                image_grid_pinpoints=NEXT_PINPOINTS),
        tokenizer=tiny_tokenizer(), patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    # LlavaOnevisionProcessor's constructor insists on a video processor, which needs torchvision: its counting
    # reads only these attributes
    ov_processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    ov_processor.image_processor, ov_processor.tokenizer = LlavaOnevisionImageProcessor(), tiny_tokenizer()
    ov_processor.num_image_tokens, ov_processor.vision_feature_select_strategy = 729, "full"
    ov_processor.vision_aspect_ratio = "anyres_max_9"
    assert ov_processor.image_processor.image_grid_pinpoints == OV_PINPOINTS

    next_cfg, ov_cfg = real_next_config(), real_onevision_config()
    theirs = next_processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    ours = [len(image_layout(next_cfg, h, w)[1]) for h, w in SIZES]
    assert ours == theirs
    assert ours[0] == 2340  # 480 x 640, as REFERENCES §3 states
    theirs = ov_processor._get_num_multimodal_tokens(image_sizes=SIZES, video_sizes=[(8, 384, 384), (1, 384, 384)])
    ours = [len(image_layout(ov_cfg, h, w)[1]) for h, w in SIZES]
    assert ours == theirs.num_image_tokens
    assert [ours[0], ours[8]] == [2929, 7329]  # 480 x 640 and 2000 x 3000, REFERENCES §4
    assert [len(image_layout(ov_cfg, 0, 0, "video", n)[1]) for n in (8, 1)] == theirs.num_video_tokens
    # an image among several: OneVision gives one view and a newline (the processor's num_image_tokens + 1)
    assert len(image_layout(ov_cfg, 480, 640, "multi")[1]) == ov_processor.num_image_tokens + 1
    assert len(image_layout(next_cfg, 480, 640, "multi")[1]) == 2340  # LLaVA-NeXT tiles every image


def test_layout_tiles_and_placement_are_consistent():
    """The local indexes stay within the image's tiles, weights of a token sum to 1 (a newline or a bilinear
    mix), and place_images puts consecutive images in consecutive slots, refusing a wrong placeholder count."""
    cfg = real_onevision_config()
    P = cfg.n_image_tokens
    layouts = [image_layout(cfg, 480, 640), image_layout(cfg, 0, 0, "video", 3), image_layout(cfg, 500, 333, "multi")]
    for n_tiles, index, weight in layouts:
        assert index.shape == weight.shape and index.shape[1] == cfg.image_taps == 4
        assert int(index.min()) >= -1 and int(index.max()) < n_tiles * P
        assert torch.allclose(weight.sum(1), torch.ones(len(weight)))
    n = sum(len(i) for _, i, _ in layouts)
    ids = torch.cat([torch.tensor([3, 3]), torch.full((n,), 1), torch.tensor([3])])
    index, weight = place_images(ids, layouts, cfg)
    assert index.shape == (len(ids), 4) and (weight[:2] == 0).all() and (weight[-1] == 0).all()
    first = len(layouts[0][1]) + 2
    assert index[2, 0] == 1 and index[first + len(layouts[1][1]) - 1, 0] == 0  # base starts at slot 0; video's newline
    assert int(index[first:].max()) < 1 + (layouts[0][0] + layouts[1][0] + 1) * P
    with pytest.raises(ValueError, match="placeholders"):
        place_images(ids[:-2], layouts, cfg)
