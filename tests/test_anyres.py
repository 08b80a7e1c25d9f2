"""LLaVA-NeXT anyres and LLaVA-OneVision (anyres_max_9, several images, video) against transformers: the image
token counts of LlavaNextProcessor / LlavaOnevisionProcessor, and the fp32 logits of
LlavaNextForConditionalGeneration / LlavaOnevisionForConditionalGeneration, built tiny and random."""

import pytest
import torch

import hf_config
import hf_names
from anyres import image_layout, place_images
from model_config import VIT_PRESETS, VLMConfig, vlm_preset

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
    from transformers import (
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
    )

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


@pytest.mark.parametrize("change,message", [
    (dict(anyres="anyres"), "needs grid_pinpoints"),
    (dict(anyres="anyres", grid_pinpoints=[[336, 600]]), "multiples of the vision image_size 336"),
    (dict(anyres="anyres_max_x", grid_pinpoints=NEXT_PINPOINTS), "anyres_max_N"),
    (dict(anyres="anyres", grid_pinpoints=NEXT_PINPOINTS, vision_select="cls_patch"), "vision_select='patch'"),
])
def test_bad_anyres_configs_are_refused_with_a_reason(change, message):
    with pytest.raises(ValueError, match=message):
        VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=vlm_preset("debug").llm, **change)
    with pytest.raises(ValueError, match="not a positive whole number"):
        image_layout(real_next_config(), 0, 640)


# -----------------------------------------------------------------------------
# fp32 logits against LlavaNextForConditionalGeneration and LlavaOnevisionForConditionalGeneration

TOL = 1e-4
S = 42  # tiles of 3 x 3 patches: odd sides, so unpadding and OneVision's bilinear resizes have remainders
TINY_NEXT_PINPOINTS = [[p * S // 336 for p in pin] for pin in NEXT_PINPOINTS]  # 1x2, 2x1, 2x2, 3x1, 1x3 tiles
TINY_OV_PINPOINTS = [[S * i, S * j] for i in range(1, 7) for j in range(1, 7)]  # up to 6 x 6 tiles, as OneVision


def tiny_hf(kind, seed=0):
    """A random LlavaNext (CLIP + Llama, HF "default", layer -2) or LlavaOnevision (SigLIP + tied Qwen2, "full",
    layer -1, anyres_max_9) model: 2 layers, width 64, 42 px tiles; norms, biases and image_newline perturbed."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=S,
                 patch_size=14)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if kind == "next":
        cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**shape), text_config=LlamaConfig(**text),
                              image_token_index=511, vision_feature_layer=-2, vision_feature_select_strategy="default",
                              image_grid_pinpoints=TINY_NEXT_PINPOINTS)
        model = LlavaNextForConditionalGeneration(cfg)
    else:
        cfg = LlavaOnevisionConfig(vision_config=SiglipVisionConfig(**shape, vision_use_head=False),
                                   text_config=Qwen2Config(**text, tie_word_embeddings=True, rms_norm_eps=1e-6),
                                   image_token_index=511, video_token_index=510, vision_feature_layer=-1,
                                   vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                                   image_grid_pinpoints=TINY_OV_PINPOINTS, tie_word_embeddings=True)
        model = LlavaOnevisionForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layrnorm" in name or name.endswith("bias") or "image_newline" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def ours_from(hf):
    """Our VLM with the HF model's weights, through convert.py's llava tables (image_newline added by hand)."""
    from model import build_model

    c = hf.config
    ov = c.model_type == "llava_onevision"
    llm = hf_config.llama_config(c.text_config.to_dict() | {"tie_word_embeddings": ov}, "text_config")
    cfg = VLMConfig(vision=hf_config.vit_config(c.vision_config.to_dict()), llm=llm, vision_layer=c.vision_feature_layer,
                    vision_select={"default": "patch", "full": "cls_patch"}[c.vision_feature_select_strategy],
                    image_token_id=c.image_token_index, anyres=c.vision_aspect_ratio if ov else "anyres",
                    grid_pinpoints=c.image_grid_pinpoints, video_token_id=c.video_token_index if ov else None)
    state = hf_names.drop_siglip_head({hf_names.hub_name(k): v for k, v in hf.state_dict().items()}, "hf")
    state = hf_names.drop_tied_head(state, llm, "language_model.model.embed_tokens.weight",
                                   "language_model.lm_head.weight", "hf")
    table = hf_names.llava_table(cfg) | {"image_newline": "image_newline"}
    model = build_model(cfg, init=False)
    model.load_state_dict(hf_names.remap(state, table, hf_names.expected_shapes(cfg), "hf"), strict=not ov)
    return model.eval()


def mixed_batch(cfg, rows, seed=0):
    """Rows of ("image", h, w) / ("multi", h, w) / ("video", n_frames) items between random text, as our batch
    (input_ids, pixel slots, image_index, image_weight), as HF's keyword arguments, and each row's layouts."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, 500, (n,), generator=g)  # noqa: E731
    ids, slots, layouts, images, sizes, videos = [], [], [], [], [], []
    for row in rows:
        parts, tiles, row_layouts = [text(3)], [], []
        for kind, *size in row:
            layout = image_layout(cfg, 0, 0, "video", size[0]) if kind == "video" else image_layout(cfg, *size, kind)
            pixels = torch.randn(layout[0], 3, S, S, generator=g)
            (videos if kind == "video" else images).append(pixels)
            if kind != "video":
                sizes.append(size)
            token = cfg.video_token_id if kind == "video" else cfg.image_token_id
            parts += [torch.full((len(layout[1]),), token), text(2)]
            tiles.append(pixels)
            row_layouts.append(layout)
        ids.append(torch.cat(parts))
        slots.append(torch.cat(tiles) if tiles else torch.zeros(0, 3, S, S))
        layouts.append(row_layouts)
    T, n_slots = max(len(i) for i in ids) + 1, max(len(s) for s in slots)
    ids = torch.stack([torch.cat([i, text(T - len(i))]) for i in ids])  # (B, T)
    pixels = torch.stack([torch.cat([s, torch.zeros(n_slots - len(s), 3, S, S)]) for s in slots])  # (B, n_slots, ...)
    index, weight = (torch.stack(t) for t in zip(*(place_images(i, lay, cfg) for i, lay in zip(ids, layouts))))
    most = max([len(p) for p in images], default=0)
    hf = {"input_ids": ids}
    if images:
        hf |= {"pixel_values": torch.stack([torch.cat([p, torch.zeros(most - len(p), 3, S, S)]) for p in images]),
               "image_sizes": torch.tensor(sizes)}
    if videos:
        hf["pixel_values_videos"] = torch.stack(videos)
    if cfg.video_token_id is not None:
        hf["batch_num_images"] = torch.tensor([sum(kind != "video" for kind, *_ in row) for row in rows])
    return (ids, pixels, index, weight), hf, layouts


def test_llava_next_logits_match_transformers():
    """One image a row at sizes that select each grid shape (1x2, 2x1, 1x3, 3x1, 2x2 with an unpadding remainder
    that keeps a row of padding, a single pixel), and a row with two tiled images."""
    hf = tiny_hf("next")
    ours = ours_from(hf)
    rows = [[("image", 60, 100)], [("image", 33, 50)], [("image", 50, 33)], [("image", 40, 180)],
            [("image", 180, 40)], [("image", 1, 1)], [("image", 100, 60), ("image", 41, 97)]]
    (ids, pixels, index, weight), inputs, _ = mixed_batch(ours.cfg, rows)
    with torch.no_grad():
        theirs = hf(**inputs).logits
        logits, _ = ours(ids, pixels, image_index=index, image_weight=weight)
    assert (logits - theirs).abs().max().item() <= TOL
    # generation reads the same placement
    with torch.no_grad():
        expected = hf.generate(**{k: v[:1] for k, v in inputs.items()}, max_new_tokens=3, do_sample=False)
        got = ours.generate(ids[:1], pixels[:1], max_new_tokens=3, image_index=index[:1], image_weight=weight[:1])
    assert got.tolist() == expected[:, ids.shape[1]:].tolist()


def test_llava_onevision_logits_match_transformers():
    """anyres_max_9 reducing by exactly 2 and by a fraction, not reducing, a 1 x 1 grid, a two-image sample (one view
    + newline each), a three-frame video (27 -> 14 pooling's odd case: 3 -> 2 per side), a text-only row: one batch."""
    hf = tiny_hf("onevision")
    ours = ours_from(hf)
    rows = [[("image", 250, 240)], [("image", 200, 130)], [("image", 90, 80)], [("image", 1, 1)],
            [("multi", 60, 100), ("multi", 100, 60)], [("video", 3)], []]
    (ids, pixels, index, weight), inputs, _ = mixed_batch(ours.cfg, rows)
    with torch.no_grad():
        theirs = hf(**inputs).logits
        logits, _ = ours(ids, pixels, image_index=index, image_weight=weight)
    assert (logits - theirs).abs().max().item() <= TOL


def test_packed_row_scores_each_sample_as_transformers_does_alone():
    """Three samples with different image token counts (a reduced single image, two images, a video) packed into one
    row, their slots in turn, placed by place_images over the whole row: each sample's summed token loss equals
    LlavaOnevisionForConditionalGeneration's on that sample alone."""
    hf = tiny_hf("onevision")
    ours = ours_from(hf)
    samples = [[("image", 200, 130)], [("multi", 60, 100), ("multi", 33, 50)], [("video", 2)]]
    ids, slots, layouts, labels, theirs = [], [], [], [], []
    for i, sample in enumerate(samples):
        (sample_ids, pixels, _, _), inputs, (sample_layouts,) = mixed_batch(ours.cfg, [sample], seed=i)
        sample_labels = torch.where(sample_ids >= 500, -100, sample_ids)  # placeholders unsupervised
        sample_labels[:, :2] = -100
        with torch.no_grad():
            theirs.append(hf(**inputs, labels=sample_labels).loss * (sample_labels[0, 1:] != -100).sum())
        ids.append(sample_ids[0])
        slots.append(pixels[0])
        labels.append(sample_labels[0])
        layouts += sample_layouts
    tail = 5  # padding after the last sample: one more, unsupervised, sample
    ids, slots = torch.cat(ids + [torch.zeros(tail, dtype=torch.long)]), torch.cat(slots)
    positions = torch.cat([torch.arange(len(lab)) for lab in labels] + [torch.arange(tail)])
    labels = torch.cat(labels + [torch.full((tail,), -100)])
    index, weight = place_images(ids, layouts, ours.cfg)
    with torch.no_grad():
        _, per_token = ours(ids[None], slots[None], labels[None], loss_reduction="none", position_ids=positions[None],
                            image_index=index[None], image_weight=weight[None])
    starts = (positions == 0).nonzero().squeeze(1).tolist()
    for start, end, expected in zip(starts, starts[1:], theirs):
        mine = per_token[0, start:end].sum()
        assert abs(mine.item() - expected.item()) <= 1e-4 * max(1.0, abs(expected.item()))
