"""Inputs a reviewer tried on the tiled (LLaVA-NeXT / OneVision) path that the other tests did not: each a
clear promise (a one-line error naming the input, never a traceback) or a reference."""

import tarfile

import pytest
import torch
from test_multi_image_data import chat_tokenizer, tiny_onevision_config

import model_files
import sample
import weight_files
from model import VLM


@pytest.fixture(scope="module")
def onevision_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ov")
    tok = chat_tokenizer(d / "tok")
    with torch.device("meta"):
        model = VLM(tiny_onevision_config(tok))
    model.to_empty(device="cpu").init_weights(seed=0)
    model_files.save_model(model, d / "ckpt", d / "tok")
    return d / "ckpt"


def test_sample_video_without_frames_is_a_one_line_error(onevision_ckpt):
    """`sample.py --video` with no --image: a video of zero frames (was an IndexError traceback)."""
    with pytest.raises(SystemExit, match="frame"):
        sample.main(["--ckpt", str(onevision_ckpt), "--video", "--prompt", "What happens?", "--template", "chatml",
                     "--max-new-tokens", "1", "--device", "cpu"])


@pytest.mark.parametrize("max_tiles,message", [(-1, "--max-tiles must be >= 0"), (0, "max_tiles=0, but the model tiles"),
                                               (1, "max_tiles=1 is fewer than the 2 tiles")])
def test_audit_refuses_the_max_tiles_train_py_refuses(onevision_ckpt, tmp_path, max_tiles, message):
    """`data.py audit --max-tiles` on an anyres model: a count train.py would refuse was audited anyway (-1 dropped
    even text-only samples as too_many_tiles; 0 audited the one-view loader train.py never runs)."""
    import data

    config = tmp_path / "c.py"
    config.write_text(f"init_from = {str(onevision_ckpt)!r}\ntokenizer = {str(onevision_ckpt / 'tokenizer.json')!r}\n"
                      "template = 'chatml'\nseq_len = 400\n")
    with pytest.raises(SystemExit, match=message):
        data.main(["audit", str(tmp_path), "--config", str(config), f"--max-tiles={max_tiles}", "--show", "0"])


def test_shard_stream_refuses_a_negative_max_tiles(onevision_ckpt, tmp_path):
    from test_multi_image_data import chat_tokenizer as tokenizer

    import loader

    tok = tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match="max_tiles must be an integer >= 0"):
        loader.ShardStream(tmp_path, tok, 2, 100, 28, 1, 4, vlm=tiny_onevision_config(tok), max_tiles=-2)


def test_from_hf_refuses_empty_pinpoints_rather_than_substituting_the_defaults():
    """A llava_next config.json with "image_grid_pinpoints": [] (transformers keeps [] and cannot select a grid):
    was converted silently with LLaVA-v1.6's default pinpoints; absent, the class default applies as in transformers."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    import hf_config

    hf = LlavaNextConfig(vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, image_size=28, patch_size=14),
                         text_config=LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4),
                         image_grid_pinpoints=[[28, 56]]).to_dict()
    assert hf_config.llava_config(hf, "d").grid_pinpoints == [[28, 56]]
    with pytest.raises(weight_files.ConversionError, match=r"image_grid_pinpoints .* got \[\]"):
        hf_config.llava_config(hf | {"image_grid_pinpoints": []}, "d")
    hf.pop("image_grid_pinpoints")
    assert hf_config.llava_config(hf, "d").grid_pinpoints == LlavaNextConfig().image_grid_pinpoints


def test_a_video_prompt_for_a_model_without_video_says_so(tmp_path):
    """sample.py --video on a LLaVA-NeXT model (no <video> id): said 'the prompt has 0 image/video tags for 1 video
    inputs' of a prompt it had just given a <video> tag."""
    from test_images import encode, photo
    from test_multi_image_data import chat_tokenizer as tokenizer

    import loader

    tok = tokenizer(tmp_path / "tok")
    cfg = tiny_onevision_config(tok).with_overrides({"anyres": "anyres", "video_token_id": None})
    with pytest.raises(ValueError, match="no <video> token"):
        loader.tiled_prompt(cfg, "chatml", tok, "What happens?", [encode(photo(40, 30), "PNG")], "video")


def test_onevision_export_with_a_clip_tower_counts_the_tokens_the_model_places(tmp_path):
    """to-hf of an anyres_max_N model on a CLIP tower (HF "default": CLS dropped): processor_config.json held
    num_image_tokens 576, which LlavaOnevisionProcessor reduces by one under "default", so every image, and an image
    among several, got one <image> fewer than the 576-a-view features the model places (transformers then refuses)."""
    import json

    from test_anyres import real_next_config, tiny_tokenizer
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor

    import processor
    from anyres import image_layout

    cfg = real_next_config().with_overrides({"anyres": "anyres_max_9", "video_token_id": 2})
    processor.write_processor(cfg, tmp_path, "chatml", "pad")
    settings = json.loads((tmp_path / "processor_config.json").read_text())
    image = json.loads((tmp_path / "preprocessor_config.json").read_text())
    theirs = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)  # its constructor wants torchvision
    theirs.image_processor = LlavaOnevisionImageProcessor(image_grid_pinpoints=image["image_grid_pinpoints"],
                                                          size=image["size"])
    theirs.tokenizer, theirs.image_token = tiny_tokenizer(), "<image>"
    for key in ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio"):
        setattr(theirs, key, settings[key])
    sizes = [(768, 1024), (1024, 768), (256, 2048), (337, 336), (1, 1)]
    counts = theirs._get_num_multimodal_tokens(image_sizes=sizes, video_sizes=[(8, 336, 336)])
    assert counts.num_image_tokens == [len(image_layout(cfg, h, w)[1]) for h, w in sizes]
    assert counts.num_video_tokens == [len(image_layout(cfg, 0, 0, "video", 8)[1])]
    multi = theirs.replace_image_token({"batch_num_images": [2], "image_sizes": [(480, 640)] * 2}, 0)
    assert multi.count("<image>") == len(image_layout(cfg, 480, 640, "multi")[1])


@pytest.mark.parametrize("max_tiles", [0, 2])
def test_train_refuses_max_tiles_before_building_a_7b_preset(tmp_path, monkeypatch, max_tiles):
    """`train.py --model=llava-next-vicuna-7b --max_tiles=0` (or too few) from scratch: the refusal came after
    building and initialising 7B parameters (minutes of CPU, or out of memory) instead of at once."""
    from test_multi_image_data import chat_tokenizer as tokenizer

    import train

    tokenizer(tmp_path / "tok")
    tarfile.open(tmp_path / "data.tar", "w").close()  # a tar (empty): the data passes train's early look at it
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built the model before checking max_tiles"))
    with pytest.raises(SystemExit, match=f"max_tiles={max_tiles}"):
        train.main(["--model=llava-next-vicuna-7b", "--model_overrides={}", f"--max_tiles={max_tiles}",
                    f"--data_dir={tmp_path / 'data.tar'}", f"--tokenizer={tmp_path / 'tok/tokenizer.json'}",
                    f"--out_dir={tmp_path / 'out'}", "--device=cpu"])
