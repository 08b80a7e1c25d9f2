"""Idefics3 / SmolVLM against transformers: SigLIP read after its post-LayerNorm, a pixel shuffle, one bias-free Linear
(model.py's connector switches); convert.py from-hf and to-hf, one image a sample."""

import json

import pytest
import torch
from safetensors.torch import load_file

import convert
import hf_config
import model_files
from model import pixel_shuffle
from weight_files import ConversionError

# (scale_factor, image side, patch) per class: SmolVLM-2.2B's factor 3 on a 9 x 9 map, and 2 on 8 x 8; SmolVLM tied
CASES = {"smolvlm": (3, 72, 8, True), "idefics3": (2, 64, 8, False)}
VOCAB, IMAGE_ID = 300, 299


def tiny_hf(kind):
    """A random, tiny transformers SmolVLM / Idefics3: 2 layers, width 64, norms and biases perturbed off their init."""
    import transformers

    scale, side, patch, tied = CASES[kind]
    torch.manual_seed(0)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=side,
                  patch_size=patch)
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                tie_word_embeddings=tied)
    prefix = {"smolvlm": "SmolVLM", "idefics3": "Idefics3"}[kind]
    cfg = getattr(transformers, f"{prefix}Config")(vision_config=vision, text_config=text, scale_factor=scale,
                                                   image_token_id=IMAGE_ID, tie_word_embeddings=tied)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{kind: (HF model, its directory, ours, the to-hf export)}: each converted once, through the command line."""
    out = {}
    for kind in CASES:
        root = tmp_path_factory.mktemp(kind)
        hf = tiny_hf(kind)
        hf.save_pretrained(root / "hf")
        convert.main(["from-hf", "--llava", str(root / "hf"), "--out", str(root / "ours")])
        convert.main(["to-hf", "--ckpt", str(root / "ours"), "--out", str(root / "back")])
        out[kind] = hf, root / "hf", root / "ours", root / "back"
    return out


def batch(n_image_tokens, side, seq=40, at=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, IMAGE_ID, (2, seq), generator=g)
    ids[:, at:at + n_image_tokens] = IMAGE_ID
    return ids, torch.randn(2, 3, side, side, generator=g)


@pytest.mark.parametrize("kind", CASES)
def test_logits_match_transformers(converted, kind):
    hf, _, ours_dir, _ = converted[kind]
    ours = model_files.load_model(ours_dir).eval()
    scale, side, patch, tied = CASES[kind]
    assert ours.cfg.n_image_tokens == (side // patch // scale) ** 2 and ours.cfg.pixel_shuffle == scale
    assert ours.cfg.llm.tie_embeddings == tied
    ids, pixels = batch(ours.cfg.n_image_tokens, side)
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=pixels[:, None]).logits  # (B, n_images, 3, H, W)
        mine = ours(ids, pixels)[0]
    assert (mine - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", CASES)
def test_round_trip_is_exact_and_loads_without_warnings(converted, kind, caplog):
    import transformers

    hf, src, _, back = converted[kind]
    before, after = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    old, new = json.loads((src / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("model_type", "architectures", "scale_factor", "image_token_id", "tie_word_embeddings"):
        assert new[key] == old[key], key
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size", "layer_norm_eps", "hidden_act", "model_type"):
        assert new["vision_config"][key] == old["vision_config"][key], key
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert new["text_config"][key] == old["text_config"][key], key
    cls = getattr(transformers, hf_config.HF_ARCHITECTURES[kind])
    transformers.logging.enable_propagation()  # transformers' logger does not reach caplog otherwise
    try:
        with caplog.at_level("WARNING"):
            loaded, info = cls.from_pretrained(back, output_loading_info=True)
    finally:
        transformers.logging.disable_propagation()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    ids, pixels = batch(loaded.model.image_seq_len, CASES[kind][1])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids, pixel_values=pixels[:, None]).logits,
                           hf(input_ids=ids, pixel_values=pixels[:, None]).logits)


@pytest.mark.parametrize("factor, side", [(2, 8), (3, 9), (4, 8)])
def test_pixel_shuffle_is_idefics3s(factor, side):
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector

    x = torch.randn(3, side * side, 5)
    assert torch.equal(pixel_shuffle(x, factor), SmolVLMConnector.pixel_shuffle(None, x, factor))


def test_export_refuses_a_connector_no_class_computes(converted, tmp_path):
    state, cfg = model_files.read_checkpoint(converted["smolvlm"][2])
    model_files.save_checkpoint(state | {"projector.fc.0.bias": torch.zeros(64)},
                                cfg.with_overrides({"projector": "linear"}), tmp_path / "ours")
    with pytest.raises(ConversionError, match=r"SmolVLMForConditionalGeneration differs in projector='linear'"):
        convert.llava_to_hf(tmp_path / "ours", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_from_hf_refuses_a_vision_field_it_does_not_read(converted, tmp_path):
    _, src, _, _ = converted["idefics3"]
    (tmp_path / "hf").mkdir()
    config = json.loads((src / "config.json").read_text())
    config["vision_config"]["hidden_act"] = "relu"
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    (tmp_path / "hf/model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(SystemExit, match="vision hidden_act 'relu' is not implemented"):
        convert.main(["from-hf", "--llava", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    assert not (tmp_path / "ours").exists()
