"""Idefics3 / SmolVLM against transformers: SigLIP read after its post-LayerNorm, a pixel shuffle, one bias-free Linear
(model.py's connector switches); convert.py from-hf and to-hf, one image a sample."""

import json
import math

import pytest
import torch
from conftest import ROOT, checkpoint_tensors, load_cleanly
from safetensors.torch import load_file

import convert
import hf_config
import hf_names
import model_files
from model import build_model, pixel_shuffle
from model_config import vlm_preset
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
    loaded = load_cleanly(cls, back, caplog)
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


def test_nanovlm_preset_is_nanovlms_model_and_opens_as_smolvlm():
    """nanovlm-460m is nanoVLM's default model (460.1M parameters, 64 tokens a 512 px image), and its export is a
    SmolVLMForConditionalGeneration with the same tensors (built on the meta device: no 460M weights made)."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    cfg = vlm_preset("nanovlm-460m")
    shapes = hf_names.expected_shapes(cfg)
    assert cfg.n_image_tokens == 64 and shapes["projector.fc.0.weight"] == (960, 12288)
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e6, 1) == 460.1
    exported = hf_config.llava_hf_config(cfg)
    assert exported["architectures"] == ["SmolVLMForConditionalGeneration"] and exported["scale_factor"] == 4
    with torch.device("meta"):
        hf = SmolVLMForConditionalGeneration(SmolVLMConfig(**{k: v for k, v in exported.items() if k != "model_type"}))
    assert hf.lm_head.weight is hf.model.text_model.embed_tokens.weight  # tied, as nanoVLM's
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    table = hf_names.llava_table(cfg)
    assert {table[k]: s for k, s in shapes.items()} == theirs
    assert hf.model.image_seq_len == 64


def test_a_tiny_nanovlm_exports_to_what_transformers_computes(tmp_path):
    """The preset's switches at 2 layers, width 64 (factor 4 on an 8 x 8 map, tied): our logits are the export's."""
    from transformers import SmolVLMForConditionalGeneration

    cfg = vlm_preset("nanovlm-460m").with_overrides({
        "vision": {"image_size": 64, "patch_size": 8, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 128},
        "llm": {"vocab_size": VOCAB, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
                "max_seq_len": 256}, "image_token_id": IMAGE_ID})
    ours = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model_files.save_model(ours, tmp_path / "ours")
    convert.llava_to_hf(tmp_path / "ours", tmp_path / "hf")
    hf = SmolVLMForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ids, pixels = batch(cfg.n_image_tokens, 64)
    with torch.no_grad():
        assert (ours(ids, pixels)[0] - hf(input_ids=ids, pixel_values=pixels[:, None]).logits).abs().max() <= 1e-5


def test_the_nanovlm_recipes_from_hf_command_assembles_nanovlms_connector(tmp_path):
    """configs/nanovlm.py's from-hf --llm --vision with --pixel-shuffle 4 --vision-post-norm --projector linear_nobias:
    a fresh bias-free Linear over 16 patches' features, and the result exports as SmolVLM."""
    from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path / "llm")
    SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         image_size=64, patch_size=8)).save_pretrained(tmp_path / "siglip")
    convert.main(["from-hf", "--llm", str(tmp_path / "llm"), "--vision", str(tmp_path / "siglip"), "--vision-layer", "-1",
                  "--vision-select", "cls_patch", "--vision-post-norm", "--pixel-shuffle", "4", "--projector",
                  "linear_nobias", "--out", str(tmp_path / "ours")])
    state, cfg = model_files.read_checkpoint(tmp_path / "ours")
    assert cfg.n_image_tokens == 4 and state["projector.fc.0.weight"].shape == (64, 32 * 16)
    assert "projector.fc.0.bias" not in state
    convert.llava_to_hf(tmp_path / "ours", tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["model_type"] == "smolvlm"
    with pytest.raises(SystemExit, match="pixel_shuffle=3 needs a square feature map whose side it divides"):
        convert.main(["from-hf", "--llm", str(tmp_path / "llm"), "--vision", str(tmp_path / "siglip"),
                      "--vision-select", "cls_patch", "--pixel-shuffle", "3", "--out", str(tmp_path / "bad")])


def test_a_hub_shaped_config_reads_as_the_plain_one(converted, tmp_path):
    """SmolVLM-256M's published config.json keeps fields its model never reads (a top-level vocab_size, the processor's
    sizes in vision_config, whose model_type is 'idefics3'): read as the same model, not refused."""
    _, src, _, _ = converted["idefics3"]
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = config["text_config"]["vocab_size"] + 64
    config["vision_config"] |= {"model_type": "idefics3", "max_image_size": {"longest_edge": 64},
                                "size": {"longest_edge": 256}, "use_base_siglip": True}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    (tmp_path / "hf/model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    assert hf_names.llava_from_hf(tmp_path / "hf")[1] == hf_names.llava_from_hf(src)[1]


def test_a_pixel_shuffle_model_trains_every_part_it_reads(shapes_data, tmp_path):
    """train.py at stage 0 on the shapes demo with Idefics3's connector (SigLIP read after its ln_post, pixel shuffle
    2, a bias-free Linear): every parameter moves, ln_post too (freeze had it as never reaching the loss)."""
    import train

    shapes = shapes_data(n=400, seed=0, val_fraction=0.1)
    cfg = vlm_preset("debug").with_overrides({
        "vision": {"image_size": 56, "patch_size": 14, "kind": "siglip", "act": "gelu_pytorch_tanh"},
        "llm": {"vocab_size": 576}, "image_token_id": 512, "projector": "linear_nobias", "pixel_shuffle": 2,
        "vision_post_norm": True, "vision_select": "cls_patch", "vision_layer": -1})
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "init")
    train.main([str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}", "--eval_interval=0",
                f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={tmp_path / 'out'}", "--stage=0",
                f"--init_from={tmp_path / 'init'}", "--max_iters=3", "--lr_decay_iters=20"])
    before = load_file(tmp_path / "init/model.safetensors")
    after = {k[len("model."):]: v for k, v in checkpoint_tensors(tmp_path / "out/step-000003", "model.").items()}
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_smolvlms_lanczos_processor_does_not_refuse_its_weights(converted, tmp_path, capsys):
    """SmolVLM's and Idefics3's image processors resize with Lanczos (resample 1), a filter llavax lacks: the weights
    convert (images resized bicubic, said), and the processor file travels through to-hf unchanged."""
    _, src, _, _ = converted["smolvlm"]
    (tmp_path / "hf").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "hf" / name).write_bytes((src / name).read_bytes())
    processor = {"image_processor_type": "SmolVLMImageProcessor", "resample": 1, "do_image_splitting": True}
    (tmp_path / "hf/preprocessor_config.json").write_text(json.dumps(processor))
    convert.main(["from-hf", "--llava", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    assert "resizes this SmolVLMForConditionalGeneration's images bicubic" in capsys.readouterr().err
    assert model_files.read_checkpoint(tmp_path / "ours")[1].vision.resample == 3
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    assert json.loads((tmp_path / "back/preprocessor_config.json").read_text()) == processor
