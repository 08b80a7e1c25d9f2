"""convert.py against transformers: every layout in and out, original LLaVA, and bad input."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, image_batch, tiny_hf_llava
from safetensors.torch import load_file, save_file

import convert
from model import build_model, vlm_preset


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
        state = {convert.hub_name(k): v for k, v in state.items()}
        assert any(k.startswith("vision_tower.vision_model.") for k in state)
    else:
        assert layout == "in-memory" and all(k.startswith(("model.", "lm_head.")) for k in state)
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("layout", ["hub", "transformers5", "in-memory"])
def test_round_trip_hf_ours_hf(tmp_path, layout):
    from transformers import LlavaForConditionalGeneration

    hf = tiny_hf_llava()
    write_layout(hf, tmp_path / "src", layout)
    cmd = [sys.executable, str(ROOT / "convert.py")]
    subprocess.run(cmd + ["from-hf", "--llava", str(tmp_path / "src"), "--out", str(tmp_path / "ours")], check=True)
    subprocess.run(cmd + ["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")], check=True)
    assert any(k.startswith("vision_tower.vision_model.") for k in load_file(tmp_path / "back/model.safetensors"))
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, pixels, _ = image_batch(4, 511, 512)
    assert torch.equal(hf_logits(back.eval(), ids, pixels), hf_logits(hf, ids, pixels))
    ours = convert.load_model(tmp_path / "ours").eval()
    assert (ours(ids, pixels)[0] - hf_logits(hf, ids, pixels)).abs().max() <= 1e-4


def test_to_hf_config_loads_without_warnings(tmp_path, caplog):
    from transformers import LlavaForConditionalGeneration

    cfg = vlm_preset("debug")
    cfg.llm.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}
    model = build_model(cfg, seed=0).eval()
    convert.save_model(model, tmp_path / "ours")
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
    convert.save_model(model, tmp_path / "ckpt", shard_bytes=100_000)
    index = json.loads((tmp_path / "ckpt/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = convert.load_model(tmp_path / "ckpt")
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
    ours = convert.load_model(tmp_path / "ours").eval()
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
    ours = convert.load_model(tmp_path / "ours").eval()
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
    convert.save_model(model, tmp_path / "ckpt")
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
    with pytest.raises(convert.ConversionError, match=expect):
        convert.load_model(our_ckpt)


def test_hf_checkpoint_that_does_not_fit_lists_every_problem(tmp_path, hf_llava_dir):
    _, src = hf_llava_dir
    state = load_file(src / "model.safetensors")
    state.pop("language_model.model.norm.weight")
    state["vision_tower.unknown"] = torch.zeros(1)
    state["multi_modal_projector.linear_2.weight"] = torch.zeros(5, 5)
    save_file(state, src / "model.safetensors")
    with pytest.raises(convert.ConversionError) as e:
        convert.llava_from_hf(src)
    msg = str(e.value)
    assert "language_model.model.norm.weight" in msg and "vision_tower.vision_model.unknown" in msg
    assert "multi_modal_projector.linear_2.weight: got (5, 5)" in msg


def test_truncated_safetensors_is_a_clear_error(our_ckpt):
    path = our_ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    result = subprocess.run([sys.executable, str(ROOT / "convert.py"), "to-hf", "--ckpt", str(our_ckpt),
                             "--out", str(our_ckpt.parent / "hf")], capture_output=True, text=True)
    assert result.returncode != 0
    assert "model.safetensors: not a readable safetensors file" in result.stderr and "truncated" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (our_ckpt.parent / "hf").exists()


def test_failed_write_leaves_nothing_behind(tmp_path, our_ckpt):
    def boom(tmp):
        (tmp / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        convert.write_dir(tmp_path / "out", boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(convert.ConversionError, match="already exists"):
        convert.save_model(build_model(vlm_preset("debug"), seed=0), our_ckpt)


def test_to_hf_refuses_projectors_hf_cannot_hold(tmp_path):
    cfg = vlm_preset("debug")
    cfg.projector = "linear"
    convert.save_model(build_model(cfg, seed=0), tmp_path / "ckpt")
    with pytest.raises(convert.ConversionError, match="only mlp2x_gelu"):
        convert.llava_to_hf(tmp_path / "ckpt", tmp_path / "hf")


def test_streamed_safetensors_read_back_with_the_safetensors_library(tmp_path):
    """Our one-tensor-at-a-time writer against the safetensors package's reader: every dtype we write."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
               "step": torch.tensor([12.0]), "ids": torch.arange(6).view(2, 3), "flags": torch.tensor([True, False]),
               "t": torch.randn(4, 6, generator=g).t()}  # not contiguous
    convert.write_safetensors(tensors, tmp_path / "a.safetensors")
    back = load_file(tmp_path / "a.safetensors")
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
