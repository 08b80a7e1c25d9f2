"""convert.py against transformers: every layout in and out, original LLaVA, and bad input."""

import json
import os
import re
import sys

import forkserver
import pytest
import torch
from conftest import ROOT, image_batch, tiny_hf_llava
from safetensors.torch import load_file, save_file

import chat
import config
import convert
import hf_config
import hf_names
import images
import model_config
import model_files
import weight_files
from model import build_model
from model_config import vlm_preset
from processor import PROCESSOR_FILES


def hf_logits(model, ids, pixels):
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels).logits


def write_layout(hf, path, layout):
    """The same weights under each of the three key layouts REFERENCES.md lists."""
    if layout == "transformers5":
        hf.save_pretrained(path)
        return
    hf.save_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if layout == "hub":
        state = {hf_names.hub_name(k): v for k, v in state.items()}
        assert any(k.startswith("vision_tower.vision_model.") for k in state)
    else:
        assert layout == "in-memory" and all(k.startswith(("model.", "lm_head.")) for k in state)
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("layout", ["hub", "transformers5", "in-memory"])
def test_round_trip_hf_ours_hf(tmp_path, layout):
    from transformers import LlavaForConditionalGeneration

    hf = tiny_hf_llava()
    write_layout(hf, tmp_path / "src", layout)
    cmd, env = [sys.executable, str(ROOT / "convert.py")], os.environ | {"OMP_NUM_THREADS": "1"}
    for r in forkserver.run_many([cmd + ["from-hf", "--llava", str(tmp_path / "src"), "--out", str(tmp_path / "ours")],
                                  cmd + ["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]], env):
        assert r.returncode == 0, r.stderr[-3000:]
    assert any(k.startswith("vision_tower.vision_model.") for k in load_file(tmp_path / "back/model.safetensors"))
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, pixels, _ = image_batch(4, 511, 512)
    assert torch.equal(hf_logits(back.eval(), ids, pixels), hf_logits(hf, ids, pixels))
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert (ours(ids, pixels)[0] - hf_logits(hf, ids, pixels)).abs().max() <= 1e-4


def test_to_hf_config_loads_without_warnings(tmp_path, caplog):
    from transformers import LlavaForConditionalGeneration

    cfg = vlm_preset("debug")
    cfg.llm.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}
    model = build_model(cfg, seed=0).eval()
    model_files.save_model(model, tmp_path / "ours")
    convert.llava_to_hf(tmp_path / "ours", tmp_path / "hf")
    import transformers

    transformers.logging.enable_propagation()  # transformers' logger does not reach caplog otherwise
    try:
        with caplog.at_level("WARNING"):
            hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    finally:
        transformers.logging.disable_propagation()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    ids, pixels, _ = image_batch(cfg.n_image_tokens, cfg.image_token_id, cfg.llm.vocab_size, seq=120)
    with torch.no_grad():
        assert (model(ids, pixels)[0] - hf(input_ids=ids, pixel_values=pixels).logits).abs().max() <= 1e-4


def test_sharded_checkpoint_round_trip(tmp_path):
    model = build_model(vlm_preset("debug"), seed=1)
    model_files.save_model(model, tmp_path / "ckpt", shard_bytes=100_000)
    index = json.loads((tmp_path / "ckpt/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = model_files.load_model(tmp_path / "ckpt")
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_from_hf_llm_plus_clip_adds_image_token(tmp_path, capsys):
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=256)).eval()
    clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=28, patch_size=14))
    llm.save_pretrained(tmp_path / "llm")
    clip.save_pretrained(tmp_path / "clip")
    convert.main(["from-hf", "--llm", str(tmp_path / "llm"), "--vision", str(tmp_path / "clip"),
                  "--out", str(tmp_path / "ours"), "--projector", "mlp2x_gelu", "--vision-layer", "-2"])
    assert "added id 300" in capsys.readouterr().err
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert ours.cfg.image_token_id == 300 and ours.cfg.llm.vocab_size == 320
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert (ours(ids)[0][..., :300] - llm(ids).logits).abs().max() <= 1e-4
    assert torch.equal(ours.vision.conv1.weight, clip.vision_model.embeddings.patch_embedding.weight
                       if hasattr(clip, "vision_model") else clip.embeddings.patch_embedding.weight)


def original_llava_dir(tmp_path, projector_only=False):
    """A synthetic haotian-liu/LLaVA checkpoint: HF LLaMA names plus model.mm_projector.{0,2}, as a pickle."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llm_cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=256)
    llm = LlamaForCausalLM(llm_cfg).eval()
    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                     image_size=28, patch_size=14)).save_pretrained(tmp_path / "clip")
    projector = {"model.mm_projector.0.weight": torch.randn(64, 32), "model.mm_projector.0.bias": torch.randn(64),
                 "model.mm_projector.2.weight": torch.randn(64, 64), "model.mm_projector.2.bias": torch.randn(64)}
    d = tmp_path / "llava"
    d.mkdir()
    config = llm_cfg.to_dict() | {"architectures": ["LlavaLlamaForCausalLM"], "mm_projector_type": "mlp2x_gelu",
                                  "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch",
                                  "mm_vision_tower": "openai/clip-vit-large-patch14-336", "mm_hidden_size": 32,
                                  "mm_use_im_start_end": False, "_name_or_path": "lmsys/vicuna-7b-v1.5"}
    (d / "config.json").write_text(json.dumps(config))
    if projector_only:
        torch.save(projector, d / "mm_projector.bin")
        llm.save_pretrained(tmp_path / "base")
    else:
        torch.save({k: v for k, v in llm.state_dict().items()} | projector, d / "pytorch_model.bin")
    return llm, projector


@pytest.mark.parametrize("projector_only", [False, True])
def test_from_original_llava(tmp_path, capsys, projector_only):
    llm, projector = original_llava_dir(tmp_path, projector_only)
    args = ["from-llava", "--llava", str(tmp_path / "llava"), "--vision", str(tmp_path / "clip"),
            "--out", str(tmp_path / "ours")]
    if projector_only:
        with pytest.raises(SystemExit, match="only the projector.*--llm"):
            convert.main(args)
        args += ["--llm", str(tmp_path / "base")]
    convert.main(args)
    assert "weights_only=True" in capsys.readouterr().err
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert ours.cfg.projector == "mlp2x_gelu" and ours.cfg.vision_layer == -2 and ours.cfg.n_image_tokens == 4
    assert torch.equal(ours.projector.fc[1].weight, projector["model.mm_projector.2.weight"])
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert (ours(ids)[0][..., :300] - llm(ids).logits).abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# bad input


@pytest.fixture
def our_ckpt(tmp_path):
    model = build_model(vlm_preset("debug"), seed=0)
    model_files.save_model(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def tamper(ckpt, fn):
    path = ckpt / "model.safetensors"
    state = load_file(path)
    fn(state)
    save_file(state, path)


@pytest.mark.parametrize("change,expect", [
    (lambda s: s.pop("llm.norm.weight"), r"missing \(1\): llm.norm.weight"),
    (lambda s: s.update({"llm.extra.weight": torch.zeros(2)}), r"unconsumed .*llm.extra.weight"),
    (lambda s: s.update({"projector.fc.0.bias": torch.zeros(3)}), r"shape mismatch .*projector.fc.0.bias: got \(3,\)"),
])
def test_bad_keys_and_shapes_are_named(our_ckpt, change, expect):
    tamper(our_ckpt, change)
    with pytest.raises(weight_files.ConversionError, match=expect):
        model_files.load_model(our_ckpt)


def test_hf_checkpoint_that_does_not_fit_lists_every_problem(tmp_path, hf_llava_dir):
    _, src = hf_llava_dir
    state = load_file(src / "model.safetensors")
    state.pop("language_model.model.norm.weight")
    state["vision_tower.unknown"] = torch.zeros(1)
    state["multi_modal_projector.linear_2.weight"] = torch.zeros(5, 5)
    save_file(state, src / "model.safetensors")
    with pytest.raises(weight_files.ConversionError) as e:
        hf_names.llava_from_hf(src)
    msg = str(e.value)
    assert "language_model.model.norm.weight" in msg and "vision_tower.vision_model.unknown" in msg
    assert "multi_modal_projector.linear_2.weight: got (5, 5)" in msg


def test_truncated_safetensors_is_a_clear_error(our_ckpt):
    path = our_ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    result = forkserver.run([sys.executable, str(ROOT / "convert.py"), "to-hf", "--ckpt", str(our_ckpt),
                             "--out", str(our_ckpt.parent / "hf")], os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "model.safetensors: not a readable safetensors file" in result.stderr and "truncated" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (our_ckpt.parent / "hf").exists()


def test_failed_write_leaves_nothing_behind(tmp_path, our_ckpt):
    def boom(tmp):
        (tmp / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        weight_files.write_dir(tmp_path / "out", boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(weight_files.ConversionError, match="already exists"):
        model_files.save_model(build_model(vlm_preset("debug"), seed=0), our_ckpt)


def test_to_hf_refuses_projectors_hf_cannot_hold(tmp_path):
    cfg = vlm_preset("debug")
    cfg.projector = "linear"
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "ckpt")
    with pytest.raises(weight_files.ConversionError, match="only mlp2x_gelu"):
        convert.llava_to_hf(tmp_path / "ckpt", tmp_path / "hf")


def test_streamed_safetensors_read_back_with_the_safetensors_library(tmp_path):
    """Our one-tensor-at-a-time writer against the safetensors package's reader: every dtype we write."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
               "step": torch.tensor([12.0]), "ids": torch.arange(6).view(2, 3), "flags": torch.tensor([True, False]),
               "t": torch.randn(4, 6, generator=g).t()}  # not contiguous
    weight_files.write_safetensors(tensors, tmp_path / "a.safetensors")
    back = load_file(tmp_path / "a.safetensors")
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


# -----------------------------------------------------------------------------
# conversions that are never silently wrong (issue 14)


def tiny_causal_lm(model_type, tmp_path, seed=0, **extra):
    """A tiny random transformers LLM of the given family, saved; norms perturbed so no key mix-up can hide."""
    import transformers

    cls, cfg_cls = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "mistral": ("MistralForCausalLM", "MistralConfig"),
                    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config")}[model_type]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**dict(vocab_size=300, hidden_size=64, intermediate_size=192,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   max_position_embeddings=256), **extra})
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


def llm_max_diff(hf, tmp_path, seq=60):
    state, cfg = convert.llm_from_hf(tmp_path)
    model = build_model(model_config.VLMConfig(vision=vlm_preset("debug").vision, llm=cfg), init=False).eval()
    model.load_state_dict(state, strict=False)
    assert not {k for k in hf_names.expected_shapes(model.cfg) if k.startswith("llm.")} - set(state)
    ids = torch.randint(0, 300, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (model(ids)[0] - hf(ids).logits).abs().max().item(), cfg


@pytest.mark.parametrize("model_type,extra,window", [
    ("mistral", dict(sliding_window=8), 8),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), 8),  # layer 1 only
    ("qwen2", dict(use_sliding_window=False, sliding_window=8), None),  # a window that is not used
    ("mistral", dict(sliding_window=None), None),
])
def test_sliding_window_llms_match_transformers_past_the_window(tmp_path, model_type, extra, window):
    hf = tiny_causal_lm(model_type, tmp_path, **extra)
    diff, cfg = llm_max_diff(hf, tmp_path)  # 60 tokens: far past an 8-token window
    assert cfg.sliding_window == window
    assert diff <= 1e-4
    if model_type == "qwen2" and window:
        assert cfg.sliding_layers == [1]


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0}])
def test_linear_rope_scaling_matches_transformers(tmp_path, scaling):
    hf = tiny_causal_lm("llama", tmp_path, rope_parameters={"rope_theta": 10000.0, **scaling})
    assert llm_max_diff(hf, tmp_path)[0] <= 1e-4


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_unimplemented_rope_scaling_is_refused_with_a_sentence(tmp_path, scaling):
    tiny_causal_lm("llama", tmp_path / "llm", rope_parameters={"rope_theta": 10000.0, **scaling})
    (tmp_path / "clip").mkdir()
    (tmp_path / "clip/config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:  # main's clean exit: one sentence, no traceback
        convert.main(["from-hf", "--llm", str(tmp_path / "llm"), "--vision", str(tmp_path / "clip"),
                      "--out", str(tmp_path / "out")])
    assert f"rope scaling type '{scaling['rope_type']}' is not implemented" in str(e.value)
    assert not (tmp_path / "out").exists()
    tiny_causal_lm("qwen2", tmp_path / "qwen", rope_parameters={"rope_theta": 1e6, "rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(weight_files.ConversionError, match="rope scaling type 'dynamic' is not implemented"):
        convert.llm_from_hf(tmp_path / "qwen")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "quick_gelu"])
def test_clip_hidden_act_is_honoured(tmp_path, act):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    hf = CLIPVisionModel(CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=28, patch_size=14, hidden_act=act)).eval()
    hf.save_pretrained(tmp_path)
    cfg = model_config.VLMConfig(vision=hf_config.vit_config(hf_config.read_json(tmp_path / "config.json")),
                            llm=vlm_preset("debug").llm)
    model = build_model(cfg, init=False).eval()
    model.load_state_dict(convert.vision_from_clip(tmp_path, cfg), strict=False)
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model.vision(pixels)[0] - hf(pixels, output_hidden_states=True).hidden_states[-1]).abs().max()
    assert cfg.vision.act == act and diff <= 1e-4


def test_clip_hidden_act_we_lack_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip_vision_model", "hidden_act": "relu"}))
    with pytest.raises(weight_files.ConversionError, match="vision hidden_act 'relu' is not implemented"):
        hf_config.vit_config(hf_config.read_json(tmp_path / "config.json"), tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_checkpoint_that_also_stores_lm_head_loads_as_transformers_does(tmp_path, family):
    hf = tiny_causal_lm(family, tmp_path, tie_word_embeddings=True)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # as some exporters write it
    save_file(state, tmp_path / "model.safetensors")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # transformers accepts it
    assert llm_max_diff(again, tmp_path)[0] <= 1e-4
    assert llm_max_diff(hf, tmp_path)[0] <= 1e-4


@pytest.mark.parametrize("where,change,expect", [
    ("llava", {"model_type": "llava_next_video"}, "model_type 'llava_next_video' is not supported"),
    ("llava", {"model_type": "llava_onevision", "vision_aspect_ratio": "anyres"},
     "vision_aspect_ratio 'anyres' is not supported"),
    ("llava", {"model_type": "llava_next", "image_grid_pinpoints": [[28, 56], [30, 60]]}, "multiples of the vision"),
    ("llava", {"model_type": "llava_next", "image_grid_pinpoints": [336, 672]}, "[height, width] pixel pairs"),
    ("vision", {"model_type": "siglip2_vision_model"}, "vision tower model_type 'siglip2_vision_model' is not supported"),
    ("vision", {"model_type": "dinov2"}, "vision tower model_type 'dinov2' is not supported"),
    ("text", {"model_type": "gemma"}, "LLM model_type 'gemma' is not supported"),
])
def test_unsupported_architectures_get_a_sentence(hf_llava_dir, where, change, expect):
    _, src = hf_llava_dir
    config = json.loads((src / "config.json").read_text())
    if where == "llava":
        config |= change
    else:
        config[f"{where}_config"] |= change
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:  # main's clean exit: one sentence, no traceback
        convert.main(["from-hf", "--llava", str(src), "--out", str(src.parent / "out")])
    assert expect in str(e.value) and "missing (" not in str(e.value), str(e.value)


def test_siglip_qwen2_llava_converts_both_ways(tmp_path, caplog):
    import transformers
    from test_model import tiny_hf_siglip_qwen_llava
    from transformers import LlavaForConditionalGeneration

    hf = tiny_hf_siglip_qwen_llava(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    hf.save_pretrained(tmp_path / "src")
    convert.main(["from-hf", "--llava", str(tmp_path / "src"), "--out", str(tmp_path / "ours")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    finally:
        transformers.logging.disable_propagation()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert back.config.vision_config.model_type == "siglip_vision_model" and back.config.text_config.model_type == "qwen2"
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert (ours.cfg.llm.sliding_window, ours.cfg.llm.sliding_layers) == (8, [1])
    assert back.config.text_config.layer_types == hf.config.text_config.layer_types
    n = ours.cfg.n_image_tokens
    ids, pixels, _ = image_batch(n, 511, 512, seq=n + 20, image_size=42)  # past the 8-token window
    ids[:, :2] = torch.tensor([5, 6])
    with torch.no_grad():
        expect = hf_logits(hf, ids, pixels)
        assert (hf_logits(back.eval(), ids, pixels) - expect).abs().max() <= 1e-5
        assert (ours(ids, pixels)[0] - expect).abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# exports the ecosystem opens: AutoProcessor agrees with llavax's preprocessing


def photo(w, h, seed=0):
    """JPEG bytes of a smooth, photo-like image (gradients plus noise), as datasets ship them."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h) + 64], -1) + rng.normal(0, 20, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A debug model at 336 px with a BPE tokenizer.json, trained with chatml; exported per image mode."""
    from test_data import bpe_tokenizer

    root = tmp_path_factory.mktemp("export")
    tok = bpe_tokenizer(root)
    cfg = vlm_preset("debug").to_dict()  # a copy: vlm_preset("debug") shares its tower configs with the presets
    cfg["vision"]["image_size"], cfg["image_token_id"] = 336, tok.vocab_size
    cfg["llm"]["vocab_size"], cfg["llm"]["max_seq_len"] = -(-(tok.vocab_size + 1) // 64) * 64, 1024
    cfg = model_config.VLMConfig.from_dict(cfg)
    model_files.save_model(build_model(cfg, seed=0), root / "ckpt", tokenizer_dir=root)
    return root, tok, cfg


@pytest.mark.parametrize("template", ["vicuna_v1", "llama_2", "llama_3", "chatml", "plain"])
def test_exported_chat_template_renders_llavax_prompts(exported, tmp_path, template):
    from transformers import AutoProcessor

    root, tok, _ = exported  # a tokenizer with no BOS (none prepended): the template is data.py's with its strings
    convert.llava_to_hf(root / "ckpt", tmp_path / "hf", template=template, image_mode="crop")
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "Color?"}, {"role": "assistant", "content": "Black."}]
    asked = processor.apply_chat_template(messages[:1], add_generation_prompt=True)
    assert asked == chat.generation_prompt(template, f"{chat.IMAGE_TAG}\nWhat is it?", tok)
    conv = [{"from": m["role"], "value": chat.IMAGE_TAG + "\nWhat is it?" if i == 0 else m["content"]}
            for i, m in enumerate(messages)]
    assert processor.apply_chat_template(messages) == "".join(t for t, _ in chat.render(template, conv, tok))


@pytest.mark.parametrize("mode,size", [("crop", (640, 480)), ("crop", (500, 375)), ("resize", (640, 480)),
                                       ("resize", (333, 500)), ("pad", (500, 500)), ("pad", (640, 480)),
                                       ("pad", (333, 500)), ("crop", (333, 500)), ("crop", (1920, 1080))])
def test_exported_processor_matches_llavax_preprocessing(exported, tmp_path, caplog, mode, size):
    import transformers
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    root, tok, cfg = exported
    convert.main(["to-hf", "--ckpt", str(root / "ckpt"), "--out", str(tmp_path / "hf"), "--template", "chatml",
                  "--image-mode", mode])
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            processor = AutoProcessor.from_pretrained(tmp_path / "hf")
            model = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf")
    finally:
        transformers.logging.disable_propagation()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    jpeg = photo(*size)
    question = "What is it?"
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": question}]}],
                                           add_generation_prompt=True)
    import io

    theirs = processor(text=prompt, images=Image.open(io.BytesIO(jpeg)), return_tensors="pt")
    ids, _ = chat.tokenize([(chat.generation_prompt("chatml", f"{chat.IMAGE_TAG}\n{question}"), False)], tok,
                           cfg.image_token_id, cfg.n_image_tokens)
    assert theirs.input_ids[0].tolist() == ids
    ours = images.normalize_images(images.load_image(jpeg, 336, mode)[None])
    std = torch.tensor(images.CLIP_STD).view(1, 3, 1, 1)
    assert theirs.pixel_values.shape == ours.shape
    assert ((theirs.pixel_values - ours) * std * 255).abs().max() <= 1.0 + 1e-3  # one uint8 level
    assert model.config.image_token_index == cfg.image_token_id


def test_from_hf_carries_processor_files_through(exported, tmp_path):
    from transformers import AutoProcessor

    root, tok, _ = exported
    convert.llava_to_hf(root / "ckpt", tmp_path / "hf", template="llama_3", image_mode="pad")
    convert.main(["from-hf", "--llava", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    for name in PROCESSOR_FILES + ("tokenizer.json",):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    processor = AutoProcessor.from_pretrained(tmp_path / "back")
    assert processor.image_processor.do_pad
    assert processor.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True) == \
        chat.generation_prompt("llama_3", "Hi", tok)


def test_sample_answers_several_images_in_one_batch(exported, tmp_path, capsys):
    import sample

    root, _, _ = exported
    files = []
    for i, size in enumerate([(640, 480), (333, 500), (500, 500)]):
        files.append(tmp_path / f"{i}.jpg")
        files[-1].write_bytes(photo(*size, seed=i))
    common = ["--ckpt", str(root / "ckpt"), "--template", "chatml", "--max-new-tokens", "6", "--device", "cpu"]
    sample.main(common + ["--image", *map(str, files), "--prompt", "What is it?", "A longer question: what is it?",
                          "Colour?"])
    batched = capsys.readouterr().out
    for f, q in zip(files, ["What is it?", "A longer question: what is it?", "Colour?"]):
        sample.main(common + ["--image", str(f), "--prompt", q])
    assert batched == capsys.readouterr().out
    with pytest.raises(SystemExit, match="do not pair up"):
        sample.main(common + ["--image", *map(str, files[:2]), "--prompt", "a", "b", "c"])


def test_export_refuses_an_image_id_the_tokenizer_already_uses(exported, tmp_path):
    root, tok, _ = exported
    state, cfg = model_files.read_checkpoint(root / "ckpt")
    cfg.image_token_id = tok.specials["<|im_end|>"]
    model_files.save_checkpoint(state, cfg, tmp_path / "ckpt", tokenizer_dir=root)
    with pytest.raises(SystemExit, match=re.escape("is the tokenizer's '<|im_end|>'; cannot add <image>")):
        convert.main(["to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


# -----------------------------------------------------------------------------
# LLaVA-NeXT (anyres) and LLaVA-OneVision (anyres_max_N, video): both ways, and their processors

# 28 px tiles of 2x2 features: the pinpoints give 1x2, 2x1, 2x2 and 1x3 grids
TINY_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84]]


def tiny_hf_anyres(kind, seed=0):
    """A random, tiny LlavaNextForConditionalGeneration (CLIP + Llama) or LlavaOnevisionForConditionalGeneration
    (SigLIP + Qwen2). OneVision gets anyres_max_2, so that a 2x2 grid (16 features > 1.1 x 2 tiles' 8) is reduced
    and a converter that assumes 9 is caught."""
    import transformers as tf

    torch.manual_seed(seed)
    vision = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=14)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llava_next":
        cfg = tf.LlavaNextConfig(vision_config=tf.CLIPVisionConfig(**vision), text_config=tf.LlamaConfig(**text),
                                 image_token_index=511, image_grid_pinpoints=TINY_PINPOINTS)
        model = tf.LlavaNextForConditionalGeneration(cfg)
    else:
        cfg = tf.LlavaOnevisionConfig(vision_config=tf.SiglipVisionConfig(**vision, vision_use_head=False),
                                      text_config=tf.Qwen2Config(**text), image_token_index=509, video_token_index=510,
                                      image_grid_pinpoints=TINY_PINPOINTS, vision_aspect_ratio="anyres_max_2")
        model = tf.LlavaOnevisionForConditionalGeneration(cfg)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0; perturb them so a mixed-up key cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "layrnorm" in name or "image_newline" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def anyres_logits(hf, ours, size, video_frames=0):
    """(HF logits, ours) for one row holding one image of `size` (h, w), or a video of that many frames."""
    from anyres import image_layout, place_images

    cfg = ours.cfg
    video = video_frames > 0
    n_tiles, index, weight = image_layout(cfg, *size, kind="video" if video else "image", n_frames=video_frames)
    placeholder = cfg.video_token_id if video else cfg.image_token_id
    ids = torch.tensor([[5, 6] + [placeholder] * len(index) + [7, 8, 9]])
    tiles = torch.randn(1, n_tiles, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    extra = {"pixel_values_videos": tiles} if video else {"pixel_values": tiles, "image_sizes": torch.tensor([size])}
    with torch.no_grad():
        theirs = hf(input_ids=ids, **extra).logits
        image_index, image_weight = place_images(ids[0], [(n_tiles, index, weight)], cfg)
        mine = ours(ids, tiles, image_index=image_index[None], image_weight=image_weight[None])[0]
    return theirs, mine


@pytest.mark.parametrize("kind,layout", [("llava_next", "transformers5"), ("llava_next", "in-memory"),
                                         ("llava_onevision", "hub")])
def test_anyres_round_trip_hf_ours_hf(tmp_path, kind, layout):
    """save_pretrained -> from-hf -> to-hf -> from_pretrained: the same weights and config, and our converted
    model gives transformers' logits for images whose aspect ratios select different grids (and a video)."""
    import transformers as tf

    hf = tiny_hf_anyres(kind)
    write_layout(hf, tmp_path / "src", layout)
    convert.main(["from-hf", "--llava", str(tmp_path / "src"), "--out", str(tmp_path / "ours")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    cls = getattr(tf, hf_config.HF_ARCHITECTURES[kind])
    back, info = cls.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert "image_newline" in load_file(tmp_path / "back/model.safetensors")  # the hub name
    # image_seq_length: LlavaNextConfig's default 576 is read by neither model nor processor; we write one view's
    assert getattr(back.config, "image_seq_length", 4) == 4
    theirs, again = hf.state_dict(), back.state_dict()
    assert theirs.keys() == again.keys() and all(torch.equal(theirs[k], again[k]) for k in theirs)
    fields = ["model_type", "image_grid_pinpoints", "vision_feature_select_strategy", "vision_feature_layer",
              "image_token_index", "vision_aspect_ratio", "video_token_index"]
    assert {f: getattr(back.config, f, None) for f in fields} == {f: getattr(hf.config, f, None) for f in fields}
    for sub in ("text_config", "vision_config"):
        a, b = getattr(hf.config, sub).to_dict(), getattr(back.config, sub).to_dict()
        assert {k: (a[k], b.get(k)) for k in a if b.get(k) != a[k] and k not in ("projection_dim", "dtype")} \
            == {}, sub  # CLIPVisionConfig's projection_dim: unused by LLaVA
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert ours.cfg.anyres == ("anyres" if kind == "llava_next" else "anyres_max_2")
    assert ours.cfg.grid_pinpoints == TINY_PINPOINTS
    # 50x33 -> 2x2 grid (reduced under anyres_max_2), 33x90 -> 1x3 unpadded, 60x20 -> 2x1
    for size in [(50, 33), (33, 90), (60, 20)]:
        expect, mine = anyres_logits(hf, ours, size)
        assert (mine - expect).abs().max() <= 1e-4, size
    if kind == "llava_onevision":
        assert ours.cfg.video_token_id == 510
        expect, mine = anyres_logits(hf, ours, (28, 28), video_frames=3)
        assert (mine - expect).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def anyres_exports(tmp_path_factory):
    """Tiny LLaVA-NeXT and OneVision checkpoints of ours with a BPE tokenizer.json, exported with chatml."""
    from test_data import bpe_tokenizer

    root = tmp_path_factory.mktemp("anyres-export")
    tok = bpe_tokenizer(root)
    out = {}
    for kind, extra in [("llava_next", {"anyres": "anyres"}),
                        ("llava_onevision", {"anyres": "anyres_max_2", "video_token_id": tok.vocab_size + 1,
                                             "vision_select": "cls_patch", "vision_layer": -1,
                                             "vision": {"kind": "siglip", "act": "gelu_pytorch_tanh"}})]:
        cfg = vlm_preset("debug").with_overrides({"image_token_id": tok.vocab_size, "grid_pinpoints": TINY_PINPOINTS,
                                                  "llm": {"vocab_size": -(-(tok.vocab_size + 2) // 64) * 64}} | extra)
        model_files.save_model(build_model(cfg, seed=0), root / kind, tokenizer_dir=root)
        convert.llava_to_hf(root / kind, root / f"{kind}-hf", template="chatml", image_mode="pad")
        out[kind] = root / f"{kind}-hf", cfg
    return out


def onevision_processor(directory):
    """AutoProcessor, or where transformers' LlavaOnevisionVideoProcessor cannot load (it needs torchvision, which
    this environment lacks on purpose) the same processor assembled from the export's image processor, tokenizer
    and processor_config.json: its constructor insists on the video processor, its image path reads only these."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, LlavaOnevisionProcessor

    try:
        return AutoProcessor.from_pretrained(directory)
    except ImportError as e:
        assert "torchvision" in str(e).lower(), e
    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.image_processor = AutoImageProcessor.from_pretrained(directory)
    processor.tokenizer = AutoTokenizer.from_pretrained(directory)
    settings = json.loads((directory / "processor_config.json").read_text())
    assert settings.pop("processor_class") == "LlavaOnevisionProcessor"
    for k, v in settings.items():
        setattr(processor, k, v)
    return processor


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_anyres_export_processor_counts_and_logits_match_ours(anyres_exports, kind):
    """The export's processor (LlavaNextProcessor via AutoProcessor; OneVision's image processor, tokenizer and
    settings) puts as many placeholders in the prompt as image_layout gives, for images whose aspect ratios pick
    different grids, and the exported HF model on the processor's output gives our logits."""
    import io

    import transformers as tf
    from PIL import Image

    from anyres import image_layout, place_images

    directory, cfg = anyres_exports[kind]
    if kind == "llava_next":
        processor = tf.AutoProcessor.from_pretrained(directory)
        assert type(processor).__name__ == "LlavaNextProcessor"
    else:
        processor = onevision_processor(directory)
        assert processor.tokenizer.convert_tokens_to_ids("<video>") == cfg.video_token_id
    assert type(processor.image_processor).__name__.startswith(type(processor).__name__.replace("Processor", ""))
    assert processor.image_processor.image_grid_pinpoints == TINY_PINPOINTS
    assert tuple(processor.image_processor.image_mean) == cfg.vision.image_stats[0]  # SigLIP's 0.5 for OneVision
    several = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Which?"}]}]
    assert processor.tokenizer.apply_chat_template(several, chat_template=(directory / "chat_template.jinja").read_text(),
                                                   tokenize=False, add_generation_prompt=True) == \
        chat.generation_prompt("chatml", f"{chat.IMAGE_TAG}\n<video>\nWhich?")
    hf = getattr(tf, hf_config.HF_ARCHITECTURES[kind]).from_pretrained(directory).eval()
    ours = model_files.load_model(directory).eval()
    template = (directory / "chat_template.jinja").read_text()
    for size in [(333, 500), (500, 333), (40, 300)]:  # (h, w): 2x2 (reduced under anyres_max_2), 2x1, 1x3
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                         add_generation_prompt=True)
        assert prompt == chat.generation_prompt("chatml", f"{chat.IMAGE_TAG}\nWhat is it?")
        image = Image.open(io.BytesIO(photo(size[1], size[0])))
        inputs = processor(text=prompt, images=image, return_tensors="pt")
        n_tiles, index, weight = image_layout(cfg, *size)
        assert int((inputs.input_ids == cfg.image_token_id).sum()) == len(index), size
        assert inputs.pixel_values.shape[1] == n_tiles, size
        with torch.no_grad():
            expect = hf(**inputs).logits
            image_index, image_weight = place_images(inputs.input_ids[0], [(n_tiles, index, weight)], cfg)
            mine = ours(inputs.input_ids, inputs.pixel_values, image_index=image_index[None],
                        image_weight=image_weight[None])[0]
        assert (mine - expect).abs().max() <= 1e-4, size
    if kind == "llava_onevision":  # two images in one prompt: OneVision's one view and a newline each
        images = [Image.open(io.BytesIO(photo(500, 333))), Image.open(io.BytesIO(photo(40, 300, seed=1)))]
        prompt = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which?"}]}],
            chat_template=template, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=prompt, images=[images], return_tensors="pt")
        layouts = [image_layout(cfg, 333, 500, "multi"), image_layout(cfg, 300, 40, "multi")]
        assert int((inputs.input_ids == cfg.image_token_id).sum()) == sum(len(index) for _, index, _ in layouts)
        assert inputs.pixel_values.shape[:2] == (2, 1)  # (images, views)
        with torch.no_grad():
            expect = hf(**inputs).logits
            image_index, image_weight = place_images(inputs.input_ids[0], layouts, cfg)
            mine = ours(inputs.input_ids, inputs.pixel_values.transpose(0, 1), image_index=image_index[None],
                        image_weight=image_weight[None])[0]
        assert (mine - expect).abs().max() <= 1e-4


def test_anyres_subcommand_adds_tiling_and_a_newline_hf_loads(our_ckpt, tmp_path):
    """A stage-1 checkpoint (one view an image) -> the same weights, tiling as LLaVA-NeXT, with a fresh newline;
    to-hf then writes a LlavaNextForConditionalGeneration that transformers loads without missing keys."""
    from transformers import LlavaNextForConditionalGeneration

    convert.main(["anyres", "--ckpt", str(our_ckpt), "--preset", "llava-next-vicuna-7b", "--out", str(tmp_path / "a")])
    before, after = model_files.load_model(our_ckpt), model_files.load_model(tmp_path / "a")
    assert after.cfg.anyres == "anyres" and after.cfg.grid_pinpoints == vlm_preset("llava-next-vicuna-7b").grid_pinpoints
    old = before.state_dict()
    assert all(torch.equal(v, after.state_dict()[k]) for k, v in old.items())
    assert 0.5 < float(after.image_newline.detach().std()) * after.cfg.llm.dim**0.5 < 2  # HF's normal(0, 1/sqrt(dim))
    convert.main(["to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf")])
    hf, info = LlavaNextForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(hf.model.image_newline, after.image_newline)
    # <video> must be a free id in the vocab; 384 px OneVision tiles do not fit a 28 px tower
    ov = ["anyres", "--ckpt", str(our_ckpt), "--preset", "llava-onevision-qwen2-7b", "--out", str(tmp_path / "b")]
    with pytest.raises(SystemExit, match="<video> id 151647 must be a free id below the vocab size 512"):
        convert.main(ov)
    with pytest.raises(SystemExit, match="cannot tile as 'llava-onevision-qwen2-7b'.*multiples"):
        convert.main(ov + ["--video-token-id", "510"])
    with pytest.raises(SystemExit, match="<video> id 511 must be a free id"):
        convert.main(["anyres", "--ckpt", str(our_ckpt), "--preset", "llava-next-vicuna-7b", "--video-token-id",
                      "511", "--out", str(tmp_path / "c")])


@pytest.mark.parametrize("name", ["llava_next_7b", "onevision_qwen2_7b"])
def test_recipe_configs_parse_and_hold_their_largest_inputs(name):
    """Each recipe config loads through train.py's parser, names a preset train.py accepts with its max_tiles, and its
    static shapes hold the largest image (any aspect ratio) and a 32-frame video, counted by image_layout."""
    from anyres import image_layout

    cfg = config.load_config([str(ROOT / "configs" / f"{name}.py")])
    vlm = config.model_config(cfg)
    config.check_tiles(vlm, cfg["max_tiles"])
    assert cfg["batch_size"] % cfg["micro_batch_size"] == 0 and cfg["seq_len"] <= vlm.llm.max_seq_len
    sizes = [(h, w) for h in (1, 200, 333, 480, 1080, 2000, 4032) for w in (1, 300, 500, 640, 1920, 3000, 4032)]
    layouts = [image_layout(vlm, h, w) for h, w in sizes]
    if vlm.video_token_id is not None:
        layouts.append(image_layout(vlm, 0, 0, "video", 32))
    assert max(n_tiles for n_tiles, _, _ in layouts) <= cfg["max_tiles"]
    assert max(len(index) for _, index, _ in layouts) + 256 <= cfg["seq_len"]  # room for the conversation


def test_original_llava_next_checkpoint_is_refused_with_a_sentence(tmp_path):
    original_llava_dir(tmp_path)
    path = tmp_path / "llava/config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"image_aspect_ratio": "anyres_max_9"}))
    with pytest.raises(SystemExit, match="original LLaVA-NeXT / OneVision checkpoint.*'anyres_max_9'"):
        convert.main(["from-llava", "--llava", str(tmp_path / "llava"), "--vision", str(tmp_path / "clip"), "--out",
                      str(tmp_path / "ours")])


@pytest.mark.parametrize("name", ["llava-next-vicuna-7b", "llava-next-mistral-7b", "llava-onevision-qwen2-7b",
                                  "llava-onevision-qwen2-0.5b"])
def test_presets_equal_what_transformers_configs_convert_to(name):
    """Each preset is the config from-hf makes of transformers' LlavaNextConfig / LlavaOnevisionConfig defaults (the
    vision tower, pinpoints, feature layer and strategy, ids, vision_aspect_ratio) around the published LLM's shapes
    (vicuna-7b-v1.5, Mistral-7B-Instruct-v0.2, Qwen2-{7B,0.5B}-Instruct config.json, vocab grown by 2 to a multiple
    of 64 as transformers' conversion scripts do)."""
    import transformers as tf

    import hf_config

    rope = {"rope_type": "default", "rope_theta": 1e6}
    text = {"llava-next-vicuna-7b": tf.LlamaConfig(vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5),
            "llava-next-mistral-7b": tf.MistralConfig(vocab_size=32064, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                                      rope_parameters=rope, sliding_window=None),
            "llava-onevision-qwen2-7b": tf.Qwen2Config(vocab_size=152128, hidden_size=3584, intermediate_size=18944,
                                                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                                       max_position_embeddings=32768, rope_parameters=rope),
            "llava-onevision-qwen2-0.5b": tf.Qwen2Config(vocab_size=152000, hidden_size=896, intermediate_size=4864,
                                                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                                         max_position_embeddings=32768, rope_parameters=rope,
                                                         tie_word_embeddings=True)}[name]
    config = (tf.LlavaNextConfig if "next" in name else tf.LlavaOnevisionConfig)(text_config=text)
    assert hf_config.llava_config(config.to_dict(), name) == vlm_preset(name)
