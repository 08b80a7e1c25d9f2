"""InternVL 3 / 3.5 against transformers: the InternViT kind of ViT (class token, no pre-LayerNorm, layer scale), pixel
shuffle 0.5, the LayerNorm-MLP projector, Qwen2.5 / Qwen3 decoders; convert.py from-hf and to-hf, one 448-style tile."""

import json

import pytest
import torch
from conftest import load_cleanly
from safetensors.torch import load_file

import convert
import model_files
from model import pixel_shuffle

VOCAB, IMAGE_ID = 300, 299
# (decoder, tied, vision_feature_layer, use_mean_pooling): InternVL3-1B's shape (Qwen2.5, tied, last layer, no final
# LayerNorm), and a Qwen3 one read a layer down with InternViT's final LayerNorm present (3.5's decoders)
CASES = {"qwen2": ("qwen2", True, -1, True), "qwen3": ("qwen3", False, -2, False), "qwen2-post-norm": ("qwen2", True, -1,
                                                                                                      False)}


def tiny_hf(case, **vision_extra):
    """A random, tiny transformers InternVLForConditionalGeneration: 2 layers, width 64, 56 px tiles of 14 px patches
    (a 4 x 4 map, 4 tokens after the shuffle); every weight perturbed (layer scales, class token, positions too)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    decoder, tied, layer, pooling = CASES[case]
    torch.manual_seed(0)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                  patch_size=14, attention_bias=True, use_mean_pooling=pooling) | vision_extra
    text = dict(model_type=decoder, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    cfg = InternVLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_ID, vision_feature_layer=layer,
                         image_seq_length=4, tie_word_embeddings=tied)
    model = InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case: (HF model, its directory, ours, the to-hf export)}, each converted once through the command line."""
    out = {}
    for case in CASES:
        root = tmp_path_factory.mktemp(case)
        hf = tiny_hf(case)
        hf.save_pretrained(root / "hf")
        convert.main(["from-hf", "--llava", str(root / "hf"), "--out", str(root / "ours")])
        convert.main(["to-hf", "--ckpt", str(root / "ours"), "--out", str(root / "back")])
        out[case] = hf, root / "hf", root / "ours", root / "back"
    return out


def batch(seq=24, at=5):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, IMAGE_ID, (2, seq), generator=g)
    ids[:, at:at + 4] = IMAGE_ID
    return ids, torch.randn(2, 3, 56, 56, generator=g)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(converted, case):
    hf, _, ours_dir, _ = converted[case]
    ours = model_files.load_model(ours_dir).eval()
    assert ours.cfg.vision.kind == "internvit" and ours.cfg.pixel_shuffle == 2 and ours.cfg.n_image_tokens == 4
    assert ours.cfg.vision_post_norm == (not CASES[case][3] and CASES[case][2] == -1)
    ids, pixels = batch()
    with torch.no_grad():
        assert (ours(ids, pixels)[0] - hf(input_ids=ids, pixel_values=pixels).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_exact_and_loads_without_warnings(converted, case, caplog):
    from transformers import InternVLForConditionalGeneration

    hf, src, _, back = converted[case]
    before, after = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    old, new = json.loads((src / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("model_type", "architectures", "downsample_ratio", "image_token_id", "image_seq_length",
                "tie_word_embeddings", "vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act"):
        assert new[key] == old[key], key
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size", "layer_norm_eps", "hidden_act", "attention_bias", "use_mean_pooling", "norm_type"):
        assert new["vision_config"][key] == old["vision_config"][key], key
    for key in ("model_type", "vocab_size", "hidden_size", "num_key_value_heads", "head_dim", "rms_norm_eps"):
        assert new["text_config"][key] == old["text_config"][key], key
    loaded = load_cleanly(InternVLForConditionalGeneration, back, caplog)
    ids, pixels = batch()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids, pixel_values=pixels).logits,
                           hf(input_ids=ids, pixel_values=pixels).logits)


@pytest.mark.parametrize("side", [4, 6, 16])
def test_pixel_shuffle_is_internvls(side):
    from transformers.models.internvl.modeling_internvl import InternVLModel

    x = torch.randn(3, side * side, 5)
    theirs = InternVLModel.pixel_shuffle(None, x.reshape(3, side, side, 5), 0.5).reshape(3, -1, 20)
    assert torch.equal(pixel_shuffle(x, 2), theirs)


@pytest.mark.parametrize("field, value", [("norm_type", "rms_norm"), ("use_qk_norm", True)])
def test_the_6bs_norms_are_refused_by_name(tmp_path, field, value):
    tiny_hf("qwen2", **{field: value}).save_pretrained(tmp_path / "hf")
    with pytest.raises(SystemExit, match=f"{field}={value!r}.*change the numbers"):
        convert.main(["from-hf", "--llava", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    assert not (tmp_path / "ours").exists()


def test_a_hub_shaped_config_reads_as_the_plain_one(converted, tmp_path):
    """InternVL3's published vision_config keeps its training-time drop_path_rate and dropout: read as the same model."""
    import hf_names

    _, src, _, _ = converted["qwen2"]
    config = json.loads((src / "config.json").read_text())
    config["vision_config"] |= {"drop_path_rate": 0.1, "dropout": 0.0}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    (tmp_path / "hf/model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    assert hf_names.llava_from_hf(tmp_path / "hf")[1] == hf_names.llava_from_hf(src)[1]
