"""Gemma 3 the VLM (Gemma3ForConditionalGeneration) against transformers: SigLIP read after its post-LayerNorm, the patch
map average-pooled, Gemma's RMSNorm and a bias-free matrix; each image's tokens see each other both ways (OR'ed with
causal, AND'ed with the sliding window on the local layers); convert.py from-hf and to-hf."""

import json

import pytest
import torch
from conftest import load_cleanly
from safetensors.torch import load_file

import convert
import model_files
from model import average_pool

VOCAB, BOI, EOI, IMAGE_ID = 300, 297, 298, 299
N_IMAGE = 16  # a 64 px image of 8 px patches: an 8 x 8 map, pooled 2 x 2


def tiny_hf():
    """A random, tiny transformers Gemma3ForConditionalGeneration: a sliding, a global and a sliding layer, width 64, a
    window of 6 (shorter than an image's 16 tokens), local RoPE base apart from the global one; every weight perturbed
    (HF initialises the projection to zeros and the norms to a scale of 1)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=6,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=16,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=N_IMAGE, image_token_index=IMAGE_ID,
                       boi_token_index=BOI, eoi_token_index=EOI)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF model, its directory, ours, the to-hf export), converted once through the command line."""
    root = tmp_path_factory.mktemp("gemma3")
    hf = tiny_hf()
    hf.save_pretrained(root / "hf")
    convert.main(["from-hf", "--llava", str(root / "hf"), "--out", str(root / "ours")])
    convert.main(["to-hf", "--ckpt", str(root / "ours"), "--out", str(root / "back")])
    return hf, root / "hf", root / "ours", root / "back"


def batch(starts=(5, 11), seq=40):
    """Two rows, each <start_of_image> + 16 image tokens + <end_of_image> at its own offset, and their images."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BOI, (len(starts), seq), generator=g)
    for row, at in enumerate(starts):
        ids[row, at] = BOI
        ids[row, at + 1:at + 1 + N_IMAGE] = IMAGE_ID
        ids[row, at + 1 + N_IMAGE] = EOI
    return ids, torch.randn(len(starts), 3, 64, 64, generator=g)


def hf_logits(hf, ids, pixels, **kwargs):
    # token_type_ids as Gemma3Processor makes them: 1 at the image tokens
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE_ID).long(), **kwargs).logits


def test_logits_match_transformers(converted):
    hf, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    cfg = ours.cfg
    assert (cfg.pool, cfg.n_image_tokens, cfg.projector, cfg.attention_blocks) == (2, 16, "rms_linear_nobias", "images")
    assert cfg.llm.sliding_layers == [0, 2] and cfg.llm.sliding_window == 6
    ids, pixels = batch()
    with torch.no_grad():
        mine = ours(ids, pixels)[0]
    assert (mine - hf_logits(hf, ids, pixels)).abs().max() <= 1e-5


def test_the_image_blocks_change_the_logits(converted):
    """Causal attention alone is transformers' Gemma 3 without token_type_ids, and differs from it with them at the image
    tokens and after (not before: nothing there sees an image)."""
    hf, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    ids, pixels = batch()
    with torch.no_grad():
        blocked = ours(ids, pixels)[0]
        ours.cfg.attention_blocks = ""
        causal = ours(ids, pixels)[0]
        theirs_causal = hf(input_ids=ids, pixel_values=pixels).logits
    assert (causal - theirs_causal).abs().max() <= 1e-5
    apart = (blocked - causal).abs().amax(dim=-1)  # (B, T)
    for row, at in enumerate((5, 11)):
        assert apart[row, :at + 1].max() == 0  # up to <start_of_image>
        assert (apart[row, at + 1:at + N_IMAGE] > 1e-4).all()  # the image's tokens but its last, which sees no later one


def test_left_padded_rows_match_transformers(converted):
    """An attention_mask with left padding: the padding is hidden, positions count from each row's first token, the blocks
    still see each other both ways."""
    hf, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    ids, pixels = batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        mine = ours(ids, pixels, attention_mask=mask)[0]
    theirs = hf_logits(hf, ids, pixels, attention_mask=mask)
    assert (mine - theirs)[mask.bool()].abs().max() <= 1e-5


def test_packed_samples_keep_their_blocks_apart(converted):
    """Two samples packed in one row (position_ids restart at 0), the first ending in its image tokens and the second
    starting with its own: each sample's logits are what it gets alone."""
    _, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    ids, pixels = batch()
    first, second = ids[0, :5 + 1 + N_IMAGE], ids[1, 12:]  # the first ends inside its image, the second starts in its own
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
    with torch.no_grad():
        packed = ours(row, pixels, position_ids=positions)[0][0]
        alone = [ours(x[None], p[None])[0][0] for x, p in ((first, pixels[0]), (second, pixels[1]))]
    assert (packed - torch.cat(alone)).abs().max() <= 1e-5


@pytest.mark.parametrize("static", [False, True])
def test_generation_prefills_with_the_blocks_and_decodes_causally(converted, static):
    """Greedy tokens are transformers' generate's (its token_type_ids only in the prefill), left padding included; the
    static decode (XLA's: one graph a step over the whole cache) too."""
    hf, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    ids, pixels = batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        mine = ours.generate(ids, pixels, max_new_tokens=8, attention_mask=mask, static=static)
        theirs = hf.generate(input_ids=ids, pixel_values=pixels, attention_mask=mask,
                             token_type_ids=(ids == IMAGE_ID).long(), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
    assert torch.equal(mine, theirs)


def test_round_trip_is_exact_and_loads_without_warnings(converted, caplog):
    from transformers import Gemma3ForConditionalGeneration

    hf, src, _, back = converted
    before, after = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    rename = {k: k.replace("vision_tower.", "vision_tower.vision_model.") for k in before}  # the hub's layout
    assert sorted(rename.values()) == sorted(after)
    assert all(torch.equal(before[k], after[rename[k]]) for k in before)
    old, new = json.loads((src / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("model_type", "architectures", "image_token_index", "mm_tokens_per_image", "tie_word_embeddings"):
        assert new[key] == old[key], key
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "image_size", "patch_size", "layer_norm_eps", "hidden_act"):
        assert new["vision_config"][key] == old["vision_config"][key], key
    for key in ("model_type", "vocab_size", "hidden_size", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert new["text_config"][key] == old["text_config"][key], key
    loaded = load_cleanly(Gemma3ForConditionalGeneration, back, caplog)
    ids, pixels = batch()
    assert torch.equal(hf_logits(loaded.eval(), ids, pixels), hf_logits(hf, ids, pixels))


@pytest.mark.parametrize("side", [4, 8, 12])
def test_average_pool_is_gemma3s(side):
    x = torch.randn(3, side * side, 5)
    theirs = torch.nn.AvgPool2d(2, 2)(x.transpose(1, 2).reshape(3, 5, side, side)).flatten(2).transpose(1, 2)
    assert torch.allclose(average_pool(x, 2), theirs, atol=1e-6)


@pytest.mark.parametrize("field, value", [("use_bidirectional_attention", True), ("attention_bias", True)])
def test_what_llavax_does_not_compute_is_refused_by_name(tmp_path, field, value):
    config = tiny_hf().config.to_dict()
    config["text_config"][field] = value
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=f"{field}={value!r}.*change the numbers"):
        convert.main(["from-hf", "--llava", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    assert not (tmp_path / "ours").exists()


def test_the_blockwise_kernel_reads_the_blocks(converted):
    """attention='blockwise' (key blocks of 7: no multiple of the rows) gives transformers' logits, on packed rows too."""
    from functools import partial

    from attention import blockwise_attention

    hf, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    ids, pixels = batch()
    with torch.no_grad():
        dense_packed = ours(ids.reshape(1, -1), pixels, position_ids=torch.arange(40).repeat(2)[None])[0]
        ours.llm.attention_kernel = partial(blockwise_attention, block=7)
        mine = ours(ids, pixels)[0]
        packed = ours(ids.reshape(1, -1), pixels, position_ids=torch.arange(40).repeat(2)[None])[0]
    assert (mine - hf_logits(hf, ids, pixels)).abs().max() <= 1e-5
    assert (packed - dense_packed).abs().max() <= 1e-5


@pytest.mark.parametrize("window", [None, 5])
def test_blockwise_attention_with_blocks_equals_sdpa_both_ways(window):
    """Forward and backward against SDPA with the dense mask: (causal or same block) within a sample, the window back."""
    from attention import blockwise_attention

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, hd = 2, 4, 2, 23, 8
    q, k, v = (torch.randn(B, h, T, hd, generator=g, requires_grad=True) for h in (H, Hkv, Hkv))
    segments = torch.tensor([[0] * 14 + [1] * 9, [0] * 23])
    blocks = torch.full((B, T), -1)
    blocks[0, 3:9], blocks[0, 14:20], blocks[1, 10:21] = 0, 1, 0
    at = torch.arange(T)
    seen = (at[:, None] >= at[None, :]) | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
    mask = seen & (segments[:, :, None] == segments[:, None, :]) & (at[:, None] - at[None, :] < (window or T + 1))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             attn_mask=mask[:, None])
    mine = blockwise_attention(q, k, v, segments, window, block=5, blocks=blocks)
    assert (mine - dense).abs().max() <= 1e-5
    grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    for theirs, ours in zip(grads, torch.autograd.grad(mine.square().sum(), (q, k, v))):
        assert (ours - theirs).abs().max() <= 1e-4


def test_pallas_kernels_refuse_image_blocks_at_start():
    """torch_xla's Pallas kernels are causal only: asked for with blocks, one sentence before anything runs; 'bounded'
    takes the blockwise kernel."""
    from types import SimpleNamespace

    import attention
    import parallel

    env = SimpleNamespace(kind="cpu", master=True, rank=0)
    for kind in ("flash", "splash"):
        with pytest.raises(SystemExit, match=rf"attention='{kind}' .* causal only.*attention_blocks='images'"):
            parallel.attention_kernel(kind, 512, env, blocks="images")
    assert parallel.attention_kernel("bounded", 512, env, blocks="images").func is attention.blockwise_attention


@pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention run eagerly (CPU) says it is slow
def test_flex_attention_reads_the_blocks(converted):
    """Packed rows through FlexAttention (CUDA's packed path; eager on the CPU here) equal the dense mask with blocks, and
    differ from causal. FlexAttention has no sliding window (it refuses one), so the layers' windows are taken off."""
    _, _, ours_dir, _ = converted
    ours = model_files.load_model(ours_dir).eval()
    for layer in ours.llm.layers:
        layer.attention.window = None
    ids, pixels = batch(seq=64)
    row, positions = ids.reshape(1, -1), torch.arange(64).repeat(2)[None]
    with torch.no_grad():
        dense = ours(row, pixels, position_ids=positions)[0]
        ours.llm.flex_attention = True
        flex = ours(row, pixels, position_ids=positions)[0]
        ours.cfg.attention_blocks = ""
        causal = ours(row, pixels, position_ids=positions)[0]
    assert (flex - dense).abs().max() <= 1e-5 and (flex - causal).abs().max() > 1e-3


@pytest.mark.parametrize("preset, billions", [("gemma-3-4b-vlm", 4.30), ("gemma-3-12b-vlm", 12.19)])
def test_the_presets_are_gemma3s_models(preset, billions):
    """gemma-3-{4b,12b}-vlm export as Gemma3ForConditionalGeneration configs that transformers builds with the same
    tensors (on the meta device) and the model cards' parameter counts (4.30B, 12.19B); 256 tokens an 896 px image."""
    import math

    import hf_config
    import hf_names
    from model_config import vlm_preset
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = vlm_preset(preset)
    assert cfg.n_image_tokens == 256 and cfg.vision.image_size == 896
    exported = hf_config.llava_hf_config(cfg)
    with torch.device("meta"):
        hf = Gemma3ForConditionalGeneration(Gemma3Config(**{k: v for k, v in exported.items() if k != "model_type"}))
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    theirs = {k.replace("model.language_model.", "language_model.model.").replace("model.vision_tower.", "vision_tower.")
              .replace("model.multi_modal_projector.", "multi_modal_projector."): s for k, s in theirs.items()}
    shapes, table = hf_names.expected_shapes(cfg), hf_names.llava_table(cfg)
    ours = {hf_names.hub_name(table[k]).replace("vision_tower.vision_model.", "vision_tower."):
            s[::-1] if k == "projector.fc.0.weight" else s for k, s in shapes.items()}
    assert ours == theirs
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e9, 2) == billions


@pytest.mark.parametrize("attention", ["dense", pytest.param("blockwise", marks=pytest.mark.full)])
def test_train_py_trains_a_gemma3_shaped_model_on_packed_rows(shapes_data, tmp_path, attention):
    """train.py at stage 0 on the shapes demo, 2 samples a row, with Gemma 3's connector (SigLIP after its ln_post, a
    4 x 4 map pooled 2 x 2, RMSNorm and a bias-free Linear), its decoder switches (a window of 8 < the rows on the first
    layer) and image blocks: every parameter moves, the loss is finite."""
    import math

    import train
    from conftest import ROOT, checkpoint_tensors, run_log
    from model import build_model
    from model_config import vlm_preset

    shapes = shapes_data(n=400, seed=0, val_fraction=0.1)
    cfg = vlm_preset("debug").with_overrides({
        "vision": {"image_size": 56, "patch_size": 14, "kind": "siglip", "act": "gelu_pytorch_tanh"},
        "llm": {"vocab_size": 576, "norm_offset": 1.0, "qk_norm": True, "sandwich_norms": True, "mlp_act": "gelu_tanh",
                "embed_scale": True, "sliding_window": 8, "sliding_layers": [0], "local_rope_theta": 1000.0},
        "image_token_id": 512, "projector": "rms_linear_nobias", "pool": 2, "vision_post_norm": True,
        "vision_select": "cls_patch", "vision_layer": -1, "attention_blocks": "images"})
    assert cfg.n_image_tokens == 4
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "init")
    train.main([str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}", "--eval_interval=0",
                f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={tmp_path / 'out'}", "--stage=0",
                f"--init_from={tmp_path / 'init'}", "--max_iters=3", "--lr_decay_iters=20", "--pack=2",
                "--seq_len=96", f"--attention={attention}", "--attention_block=32", "--log_interval=1"])
    losses = [e["loss"] for e in run_log(tmp_path / "out", "loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    before = load_file(tmp_path / "init/model.safetensors")
    after = {k[len("model."):]: v for k, v in checkpoint_tensors(tmp_path / "out/step-000003", "model.").items()}
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_the_published_4b_config_reads_as_the_preset():
    """google/gemma-3-4b-it's config.json (transformers 4.50's fields: the text config's legacy rope_scaling, the defaults
    of the rest, a list of EOS ids) is the gemma-3-4b-vlm preset but for its 128k positions (the preset's RoPE tables
    hold 8k) and the resize filter, which from-hf takes from the processor beside the weights."""
    import hf_config
    from model_config import vlm_preset

    published = {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}}
    cfg = hf_config.llava_config(published, "gemma-3-4b-it")
    assert cfg.llm.max_seq_len == 131072 and cfg.vision.resample == 3
    preset = vlm_preset("gemma-3-4b-vlm").with_overrides({"llm": {"max_seq_len": 131072}, "vision": {"resample": 3}})
    assert cfg == preset


def test_image_blocks_or_a_pool_on_a_llava_are_not_exported_as_one():
    """A LLaVA-shaped model with image blocks (or a pool) computes what no LLaVA class does: to-hf refuses it, naming
    the switches Gemma 3's class would need, rather than writing a LLaVA that attends causally."""
    import hf_config
    from model_config import vlm_preset
    from weight_files import ConversionError

    for switch in ({"attention_blocks": "images"}, {"pool": 2, "vision": {"image_size": 56}}):
        cfg = vlm_preset("debug").with_overrides(switch)
        with pytest.raises(ConversionError, match=r"Gemma3ForConditionalGeneration differs in .*projector='mlp2x_gelu'"):
            hf_config.llava_hf_config(cfg)


def test_from_hf_parts_assembles_gemma3s_connector(tmp_path):
    """from-hf --llm (a Gemma 3 text model) --vision (SigLIP) with --pool 2 --projector rms_linear_nobias
    --vision-post-norm --attention-blocks images: a fresh RMSNorm (a scale of 1) and bias-free Linear over the pooled
    map, and the export is a Gemma3ForConditionalGeneration that computes our logits."""
    from transformers import (Gemma3ForConditionalGeneration, Gemma3TextConfig, Gemma3ForCausalLM, SiglipVisionConfig,
                              SiglipVisionModel)

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=256)).save_pretrained(tmp_path / "llm")
    SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         image_size=64, patch_size=8)).save_pretrained(tmp_path / "siglip")
    convert.main(["from-hf", "--llm", str(tmp_path / "llm"), "--vision", str(tmp_path / "siglip"), "--vision-layer", "-1",
                  "--vision-select", "cls_patch", "--vision-post-norm", "--pool", "2", "--projector", "rms_linear_nobias",
                  "--attention-blocks", "images", "--out", str(tmp_path / "ours")])
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert ours.cfg.n_image_tokens == N_IMAGE and ours.cfg.image_token_id == VOCAB  # appended: the tokenizer has none
    assert ours.projector.norm.weight.abs().max() == 0 and ours.projector.fc[0].bias is None
    convert.llava_to_hf(tmp_path / "ours", tmp_path / "hf")
    hf = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ids, pixels = batch()
    ids[ids == IMAGE_ID] = VOCAB
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == VOCAB).long()).logits
        assert (ours(ids, pixels)[0] - theirs).abs().max() <= 1e-5


def test_the_in_memory_key_layout_reads_alike(converted, tmp_path):
    """Weights saved under transformers 5's in-memory names (model.language_model.*, model.vision_tower.*, a tied
    lm_head.weight) read as the same tensors as save_pretrained's layout."""
    import shutil

    import hf_names
    from safetensors.torch import save_file

    hf, src, _, _ = converted
    (tmp_path / "hf").mkdir()
    shutil.copy(src / "config.json", tmp_path / "hf/config.json")
    save_file({k: v.clone().contiguous() for k, v in hf.state_dict().items()}, tmp_path / "hf/model.safetensors")
    (mine, cfg), (plain, plain_cfg) = hf_names.llava_from_hf(tmp_path / "hf"), hf_names.llava_from_hf(src)
    assert cfg == plain_cfg and sorted(mine) == sorted(plain)
    assert all(torch.equal(mine[k], plain[k]) for k in mine)
