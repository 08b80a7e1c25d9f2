"""The language models researchers start from now, against transformers' own models with tiny random weights built
offline: Qwen3, Qwen2.5, Gemma 2, Gemma 3 (text), SmolLM2 and SmolLM3, each converted from its published layout
(config.json as transformers writes it, safetensors), logits within 1e-5 in fp32 past a sliding window, with
soft-caps, per-layer RoPE, no-RoPE layers and tied embeddings exercised; the same decoders inside a LLaVA, from-hf
and to-hf, the export loading in transformers with the same logits."""

import json

import pytest
import torch
from conftest import image_batch

import convert
import hf_names
import model_config
import model_files
from model import VLM, build_model
from model_config import vlm_preset
from weight_files import ConversionError

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
# each family as its published configs set it, shrunk: windows of 8 tokens (the tests run 60), caps that bite on
# tiny random logits, an explicit head_dim other than hidden / heads
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=3, head_dim=24, tie_word_embeddings=True,
                                                      use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True,
                                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
                                                         sliding_window=8, attn_logit_softcapping=2.0,
                                                         final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=None,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 1e5})),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                           tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                                           eos_token_id=2)),
}


def perturbed(model, seed=0):
    """Norms (Gemma's start at 0) and biases moved off their init, so that a mixed-up key cannot hide."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def tiny_causal_lm(family, path, **extra):
    import transformers

    cfg_cls, cls, settings = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**TINY | settings | extra)
    model = perturbed(getattr(transformers, cls)(cfg))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_converts_with_transformers_logits(family, tmp_path):
    hf = tiny_causal_lm(family, tmp_path)
    state, cfg = convert.llm_from_hf(tmp_path)
    model = build_model(model_config.VLMConfig(vision=vlm_preset("debug").vision, llm=cfg), init=False).eval()
    model.load_state_dict(state, strict=False)
    assert not {k for k in hf_names.expected_shapes(model.cfg) if k.startswith("llm.")} - set(state)
    ids = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5, (ours - theirs).abs().max().item()
    with torch.no_grad():  # bf16 weights on both sides: ours no further from the fp32 logits than transformers'
        hf.to(torch.bfloat16), model.to(torch.bfloat16), model.llm.init_buffers()
        ours16, theirs16 = model(ids)[0].float(), hf(ids).logits.float()
    assert (ours16 - theirs).abs().max() <= 1.5 * (theirs16 - theirs).abs().max() + 1e-3
    # the switches each family must set: a converter that dropped one would still load
    switches = {"qwen3": dict(qk_norm=True, head_dim=24, sliding_layers=[1, 2], tie_embeddings=True),
                "gemma2": dict(norm_offset=1.0, sandwich_norms=True, attn_softcap=2.0, final_softcap=3.0,
                               sliding_layers=[0, 2], embed_scale=True),
                "gemma3": dict(qk_norm=True, norm_offset=1.0, local_rope_theta=10000.0, sliding_layers=[0, 1],
                               rope_scaling={"rope_type": "linear", "factor": 8.0}),
                "smollm3": dict(no_rope_layers=[1, 3], tie_embeddings=True)}.get(family, {})
    assert {k: getattr(cfg, k) for k in switches} == switches


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "smollm3"])
def test_generation_with_a_cache_equals_transformers_greedy(family, tmp_path):
    """The KV-cache path (per-layer windows, soft-caps and tables in the decode step): greedy tokens as HF's past the
    window, from left-padded prompts."""
    hf = tiny_causal_lm(family, tmp_path)
    state, cfg = convert.llm_from_hf(tmp_path)
    model = build_model(model_config.VLMConfig(vision=vlm_preset("debug").vision, llm=cfg), init=False).eval()
    model.load_state_dict(state, strict=False)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=10)
    hf.generation_config.eos_token_id = None  # ten tokens whatever they are, as ours without eos_id
    theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, 12:]
    assert torch.equal(ours, theirs), (ours, theirs)


def tiny_llava(family, image_size=42, seed=0, **extra):
    """A LlavaForConditionalGeneration whose text_config is the family's (a SigLIP tower, 42 px: 9 image tokens)."""
    import transformers
    from transformers import LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    cfg_cls, _, settings = FAMILIES[family]
    torch.manual_seed(seed)
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                image_size=image_size, patch_size=14, vision_use_head=False)
    text = getattr(transformers, cfg_cls)(**TINY | {"vocab_size": 512} | settings | extra)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=511,
                      image_seq_length=(image_size // 14) ** 2,
                      vision_feature_layer=-1, vision_feature_select_strategy="full",
                      tie_word_embeddings=text.tie_word_embeddings)
    return perturbed(LlavaForConditionalGeneration(cfg), seed)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", pytest.param("gemma2", marks=pytest.mark.full),
                                    pytest.param("smollm3", marks=pytest.mark.full)])
def test_a_llava_of_each_family_converts_both_ways(family, tmp_path, capsys):
    from transformers import LlavaForConditionalGeneration

    hf = tiny_llava(family)
    hf.save_pretrained(tmp_path / "src")
    convert.main(["from-hf", "--llava", str(tmp_path / "src"), "--out", str(tmp_path / "ours")])
    if family == "gemma2":  # transformers' LLaVA classes never apply final_logit_softcapping: read as they run it
        assert "final_logit_softcapping=3 is not applied" in capsys.readouterr().err
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    text = json.loads((tmp_path / "back/config.json").read_text())["text_config"]
    assert text["model_type"] == hf.config.text_config.model_type
    assert back.config.text_config.layer_types == hf.config.text_config.layer_types
    ours = model_files.load_model(tmp_path / "ours").eval()
    ids, pixels, _ = image_batch(9, 511, 512, seq=40, image_size=42)  # past the 8-token window
    with torch.no_grad():
        expect = hf(input_ids=ids, pixel_values=pixels).logits
        assert (back.eval()(input_ids=ids, pixel_values=pixels).logits - expect).abs().max() == 0.0
        assert (ours(ids, pixels)[0] - expect).abs().max() <= 1e-5
    src, out = hf.state_dict(), back.state_dict()
    assert set(src) == set(out) and all(torch.equal(src[k], out[k]) for k in src)


def test_a_field_that_changes_the_numbers_is_refused_in_one_sentence(tmp_path):
    """What transformers would compute and llavax does not implement: refused, naming the field, never ignored."""
    cases = [("qwen3", dict(attention_bias=True), "attention_bias=True"),
             ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
             ("gemma2", dict(hidden_activation="gelu"), "hidden activation 'gelu'"),
             ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                             "original_max_position_embeddings": 64}), "rope type 'yarn'")]
    for family, change, said in cases:
        folder = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        tiny_causal_lm(family, folder, **change)
        with pytest.raises(ConversionError, match=f"{folder}: .*{said}") as e:
            convert.llm_from_hf(folder)
        assert "\n" not in str(e.value)


# published sizes (the model cards: 1.7B for Qwen3-1.7B, 1.4B of it outside the tied embeddings; and so on)
PUBLISHED = {"qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.72e9, "qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9,
             "qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-3b": 3.09e9, "qwen2.5-7b": 7.62e9,
             "gemma-3-1b": 1.0e9, "gemma-3-4b": 3.88e9, "gemma-3-12b": 11.77e9, "smollm2-135m": 134.5e6,
             "smollm2-360m": 361.8e6, "smollm2-1.7b": 1.71e9, "smollm3-3b": 3.08e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_shapes(name):
    """Each preset, exported as config.json and built by transformers (on the meta device), has our parameters one
    for one, and the published total within 2%."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_config
    from model_config import LLM_PRESETS

    cfg = LLM_PRESETS[name]
    text = hf_config.llama_hf_config(cfg)
    with torch.device("meta"):
        ours = VLM(model_config.VLMConfig(vision=vlm_preset("debug").vision, llm=cfg)).llm
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text))
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in theirs.parameters()), name
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.02, (name, n)
    assert hf_config.llama_config(text, name) == cfg  # and read back


@pytest.mark.slow
@pytest.mark.full
def test_xla_gradients_equal_cpu_eager_for_qwen3_and_gemma(tmp_path):
    """tests/xla_families.py: one micro-step of tiny Qwen3-, Gemma 2- and Gemma 3-shaped VLMs (packed rows, windows,
    soft-caps, per-layer RoPE) on a 2 x 2 x 2 mesh of 8 CPU devices, SDPA and blockwise attention (torch_xla's scan):
    the loss and every parameter's gradient equal CPU eager's (43 s on this 2-core VM)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from shapes import make_shapes

    make_shapes(tmp_path / "shapes", n=40, seed=1, val_fraction=0.1)
    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "OMP_NUM_THREADS": "1",
                        "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    subprocess.run([sys.executable, ROOT / "tests/xla_families.py", tmp_path / "shapes", tmp_path / "grads.pt"],
                   env=env, check=True, capture_output=True, timeout=900)
    results = torch.load(tmp_path / "grads.pt")
    assert {family for family, _ in results} == {"qwen3", "gemma2", "gemma3"}
    for key, sides in results.items():
        (loss_cpu, cpu), (loss_xla, xla) = sides["cpu"], sides["xla"]
        assert abs(loss_xla - loss_cpu) <= 2e-4 * abs(loss_cpu), key
        trained = [n for n, g in cpu.items() if g is not None]
        assert [n for n, g in xla.items() if g is not None] == trained, key
        scale = torch.cat([cpu[n].flatten() for n in trained]).norm()
        for n in trained:
            assert (xla[n] - cpu[n]).norm() <= 2e-4 * cpu[n].norm() + 1e-6 * scale, (key, n)


# the debug model's LLM with a family's switches (--model_overrides merges them into configs/debug.py's)
OVERRIDES = {
    "qwen3": {"qk_norm": True, "head_dim": 24, "sliding_window": 8, "sliding_layers": [1], "tie_embeddings": True},
    "gemma3": {"qk_norm": True, "norm_offset": 1.0, "sandwich_norms": True, "mlp_act": "gelu_tanh",
               "embed_scale": True, "query_scale": 24**-0.5, "sliding_window": 8, "sliding_layers": [0],
               "rope_theta": 1e6, "local_rope_theta": 1e4, "tie_embeddings": True},
    "gemma2": {"norm_offset": 1.0, "sandwich_norms": True, "mlp_act": "gelu_tanh", "embed_scale": True,
               "query_scale": 24**-0.5, "sliding_window": 8, "sliding_layers": [0], "attn_softcap": 2.0,
               "final_softcap": 3.0, "tie_embeddings": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", pytest.param("qwen3", marks=pytest.mark.full)])
def test_fsdp2_stop_and_resume_is_exact_for_the_family(family, shapes_data, tmp_path):
    """Two FSDP2 ranks (gloo, real torchrun processes): 10 steps straight, and 5 then a resume to 10, give the same
    weights and moments bit for bit."""
    from conftest import checkpoint_bytes
    from test_train import args, run

    shapes = shapes_data(n=200, seed=3, val_fraction=0.1)
    llm = {"vocab_size": 576} | OVERRIDES[family]
    common = ["--parallel=fsdp", "--micro_batch_size=4", "--ckpt_interval=5", "--eval_interval=0",
              f"--model_overrides={{'vision': {{'image_size': 28, 'patch_size': 14}}, 'llm': {llm!r}, "
              f"'image_token_id': 512}}"]
    run(args(shapes, tmp_path / "a", "--max_iters=10", *common), nproc=2)
    run(args(shapes, tmp_path / "b", "--max_iters=5", *common), nproc=2)
    run(args(shapes, tmp_path / "b", "--max_iters=10", "--init_from=resume", *common), nproc=2)
    saved = json.loads((tmp_path / "a/step-000010/config.json").read_text())["llm"]
    assert {k: saved[k] for k in OVERRIDES[family]} == OVERRIDES[family]
    for prefix in ("model.", "optim."):
        assert checkpoint_bytes(tmp_path / "b/step-000010", prefix) == checkpoint_bytes(tmp_path / "a/step-000010", prefix)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3"])
def test_blockwise_attention_equals_dense_on_packed_rows(family, tmp_path):
    """Packed rows (document masks) through attention.blockwise_attention, as attention='blockwise' runs them: per-layer
    windows, soft-capped scores and each layer's own RoPE tables inside the kernel; the loss and every gradient equal
    the dense path's."""
    from functools import partial

    from attention import blockwise_attention

    tiny_causal_lm(family, tmp_path)
    state, cfg = convert.llm_from_hf(tmp_path)
    position_ids = torch.cat([torch.arange(23), torch.arange(17), torch.arange(20)])[None].repeat(2, 1)  # 3 samples
    ids = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(2))
    results = []
    for kernel in (None, partial(blockwise_attention, block=16)):
        model = build_model(model_config.VLMConfig(vision=vlm_preset("debug").vision, llm=cfg), init=False)
        model.load_state_dict(state, strict=False)
        model.llm.attention_kernel = kernel
        _, loss = model(ids, labels=ids, position_ids=position_ids)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (dense, grads), (blockwise, their_grads) = results
    assert abs(dense - blockwise) <= 1e-5 * abs(dense) and grads.keys() == their_grads.keys()
    assert all((grads[n] - their_grads[n]).abs().max() <= 1e-5 * (1 + grads[n].abs().max()) for n in grads)


@pytest.mark.parametrize("family", ["qwen3", pytest.param("gemma3", marks=pytest.mark.full)])
def test_a_onevision_of_the_family_converts_with_transformers_logits(family, tmp_path):
    """LlavaOnevisionForConditionalGeneration whose text_config is the family's: from-hf, then an image that selects a
    reduced grid and a video, as transformers computes them; to-hf loads back with every weight."""
    import transformers as tf
    from test_convert import TINY_PINPOINTS, anyres_logits

    cfg_cls, _, settings = FAMILIES[family]
    torch.manual_seed(0)
    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=28, patch_size=14, vision_use_head=False)
    text = getattr(tf, cfg_cls)(**TINY | {"vocab_size": 512} | settings)
    hf = perturbed(tf.LlavaOnevisionForConditionalGeneration(tf.LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=509, video_token_index=510,
        image_grid_pinpoints=TINY_PINPOINTS, vision_aspect_ratio="anyres_max_2", tie_word_embeddings=True)))
    hf.save_pretrained(tmp_path / "src")
    convert.main(["from-hf", "--llava", str(tmp_path / "src"), "--out", str(tmp_path / "ours")])
    ours = model_files.load_model(tmp_path / "ours").eval()
    for size, frames in (((56, 56), 0), ((28, 84), 0), ((28, 28), 3)):
        theirs, mine = anyres_logits(hf, ours, size, video_frames=frames)
        assert (theirs - mine).abs().max() <= 1e-5, (size, frames)
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    back, info = tf.LlavaOnevisionForConditionalGeneration.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    src, out = hf.state_dict(), back.state_dict()
    assert all(torch.equal(src[k], out[k]) for k in src)
