"""Model parity against transformers at float32, on tiny random models."""

import pytest
import torch
from conftest import image_batch, tiny_hf_llava

import convert
import hf_config
import model_files
from model import VLM, Llama, ViT, build_model
from model_config import LLM_PRESETS, VIT_PRESETS, VLMConfig, vlm_preset

TOL = 1e-4


def ours_from_hf(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "hf")
    return model_files.load_model(tmp_path / "hf").eval()


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llama_logits_match_transformers(tmp_path, rope, kv_heads):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(HFLlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                                        **({"rope_parameters": rope} if rope else {}))).eval()
    hf.save_pretrained(tmp_path)
    state, cfg = convert.llm_from_hf(tmp_path)
    if rope:
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    llm = Llama(cfg)
    llm.init_buffers()
    llm.load_state_dict({k.removeprefix("llm."): v for k, v in state.items()})
    ids = torch.randint(0, 300, (2, 200))  # long enough for the low-frequency rope bands to matter
    with torch.no_grad():
        ours = llm.output(llm(llm.tok_embeddings(ids)))
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() <= TOL


def test_clip_hidden_states_match_transformers(tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    hf = CLIPVisionModel(CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                                          num_attention_heads=4, image_size=56, patch_size=14)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    cfg = VLMConfig(vision=hf_config.vit_config(hf_config.read_json(tmp_path / "config.json")), llm=vlm_preset("debug").llm)
    vit = ViT(cfg.vision)
    vit.load_state_dict({k.removeprefix("vision."): v for k, v in convert.vision_from_clip(tmp_path, cfg).items()})
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        theirs = hf(pixels, output_hidden_states=True).hidden_states
        ours = vit(pixels, layers=[-2, 0, 1, -1])
    for o, t in zip(ours, (theirs[-2], theirs[0], theirs[1], theirs[-1])):
        assert (o - t).abs().max().item() <= TOL


@pytest.mark.parametrize("vision_layer,strategy", [(-2, "default"), (-1, "full"), ([-2, -1], "default")])
def test_llava_logits_and_loss_match_transformers(tmp_path, vision_layer, strategy):
    hf = tiny_hf_llava(vision_layer=vision_layer, strategy=strategy)
    ours = ours_from_hf(hf, tmp_path)
    ids, pixels, labels = image_batch(ours.cfg.n_image_tokens, 511, 512)
    with torch.no_grad():
        out = hf(input_ids=ids, pixel_values=pixels, labels=labels)
        logits, loss = ours(ids, pixels, labels)
    assert (logits - out.logits).abs().max().item() <= TOL
    assert abs(loss.item() - out.loss.item()) <= TOL


def test_text_only_row_beside_an_image_row(tmp_path):
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path)
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512)
    ids[1] = torch.randint(3, 500, (ids.shape[1],))  # row 1 has no placeholders: its image is a dummy
    with torch.no_grad():
        logits, _ = ours(ids, pixels)
        row0 = hf(input_ids=ids[:1], pixel_values=pixels[:1]).logits
        row1 = hf(input_ids=ids[1:]).logits
        no_pixels, _ = ours(ids[1:])
    assert (logits[0] - row0[0]).abs().max().item() <= TOL
    assert (logits[1] - row1[0]).abs().max().item() <= TOL
    assert (no_pixels[0] - row1[0]).abs().max().item() <= TOL


def test_greedy_generation_matches_transformers(tmp_path):
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path)
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, batch=2, seq=10)
    with torch.no_grad():
        theirs = hf.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=20, min_new_tokens=20,
                             do_sample=False, attention_mask=torch.ones_like(ids))[:, ids.shape[1]:]
        mine = ours.generate(ids, pixels, max_new_tokens=20)
    assert mine.shape == (2, 20)
    assert torch.equal(mine, theirs)


def test_generation_stops_at_eos_and_pads_finished_rows():
    model = build_model(vlm_preset("debug"), seed=0).eval()
    ids = torch.randint(0, 500, (2, 6))
    first = model.generate(ids, max_new_tokens=8)
    eos = int(first[0, 2])  # row 0 emits this at step 2
    out = model.generate(ids, max_new_tokens=8, eos_id=eos)
    assert out[0, 2] == eos and (out[0, 2:] == eos).all()
    assert torch.equal(out[0, :2], first[0, :2])
    sampled = model.generate(ids, max_new_tokens=5, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 5) and (sampled < model.cfg.llm.vocab_size).all()
    out = model.generate(ids, max_new_tokens=8, eos_id=eos)  # static: every step, finished rows repeating eos
    static = model.generate(ids, max_new_tokens=8, eos_id=eos, static=True)
    assert static.shape == (2, 8) and torch.equal(static[:, : out.shape[1]], out)
    assert (static[0, 2:] == eos).all()
    with pytest.raises(ValueError, match="6 prompt \\+ 1000 new tokens exceed max_seq_len"):
        model.generate(ids, max_new_tokens=1000, static=True)


def test_meta_build_then_init_is_deterministic_and_finite():
    a = build_model(vlm_preset("debug"), seed=3)
    b = build_model(vlm_preset("debug"), seed=3)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.isfinite(p).all(), name
        assert torch.equal(p, q), name
    assert torch.allclose(a.llm.rope_cos[0], torch.ones(a.cfg.llm.head_dim))


def test_tied_embeddings_stay_tied_after_meta_build():
    cfg = vlm_preset("debug")
    cfg.llm.tie_embeddings = True
    model = build_model(cfg, seed=0)
    assert model.llm.output.weight is model.llm.tok_embeddings.weight


def test_config_rejects_unknown_keys():
    d = vlm_preset("debug").to_dict()
    d["llm"]["n_layer"] = 3
    with pytest.raises(ValueError, match="n_layer"):
        VLMConfig.from_dict(d)
    with pytest.raises(ValueError, match="projector"):
        VLMConfig(projector="mlp2x_relu")


def test_presets_have_published_shapes():
    with torch.device("meta"):
        llava = VLM(vlm_preset("llava-1.5-7b"))
        llama3 = VLM(vlm_preset("llava-llama3-8b"))
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert abs(n(llava.llm) - 6.74e9) / 6.74e9 < 0.01  # LLaMA-2-7B: 6.74B
    assert abs(n(llava.vision) - 303.5e6) / 303.5e6 < 0.01  # CLIP ViT-L/14-336 vision tower: 303.5M
    assert abs(n(llama3.llm) - 8.03e9) / 8.03e9 < 0.01  # Llama-3-8B: 8.03B
    assert vlm_preset("llava-1.5-7b").n_image_tokens == 576


def packed_and_single(model_cfg, seed=0):
    """Three samples (two with an image, one text-only) packed into two rows, and each alone."""
    from loader import packed_batch

    g = torch.Generator().manual_seed(seed)
    n, image = model_cfg.n_image_tokens, model_cfg.image_token_id
    samples = []
    for length, has_image in ((n + 9, True), (n + 5, True), (7, False)):
        ids = torch.randint(3, 500, (length,), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        if has_image:
            ids[1 : 1 + n] = image
            labels[: 1 + n] = -100
        samples.append((ids, labels, torch.randn(3, 28, 28, generator=g) if has_image else None))
    b = packed_batch([(i, lab) for i, lab, _ in samples], n_rows=2, seq_len=n + 12, pad_id=0)
    assert all(w is not None for w in b["where"])
    images = [samples[i][2] for i in b["order"] if samples[i][2] is not None]
    pixels = torch.stack(images + [torch.zeros(3, 28, 28)])  # placeholder order, one unused image at the end
    return samples, b, pixels


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_rows_give_each_sample_its_own_loss(tmp_path, device):
    """Packed samples (position ids restart, no attention across samples) score exactly as transformers scores
    each sample alone; the chunked loss equals the full one, gradients included. On CUDA: FlexAttention, compiled."""
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path).to(device)
    samples, b, pixels = packed_and_single(ours.cfg)
    if device == "cuda":
        ours.llm.flex_attention = True
        for block in ours.llm.layers:
            block.compile()
    ids, labels, positions, pixels = (t.to(device) for t in (b["input_ids"], b["labels"], b["position_ids"], pixels))
    _, per_token = ours(ids, pixels, labels, loss_reduction="none", position_ids=positions)
    for i, (sample_ids, sample_labels, image) in enumerate(samples):
        row, start = b["where"][i]
        with torch.no_grad():
            theirs = hf(input_ids=sample_ids[None], pixel_values=None if image is None else image[None],
                        labels=sample_labels[None]).loss * (sample_labels[1:] != -100).sum()
        mine = per_token[row, start : start + len(sample_ids)].sum().cpu()
        assert abs(mine.item() - theirs.item()) <= 1e-3 * max(1.0, abs(theirs.item())), i
    # the padding tail and the sample boundaries are never supervised
    assert int((per_token != 0).sum()) == sum(int((lab[1:] != -100).sum()) for _, lab, _ in samples)

    full = ours(ids, pixels, labels, loss_reduction="sum", position_ids=positions)[1]
    grads = torch.autograd.grad(full, [ours.llm.output.weight, ours.projector.fc[0].weight])
    ours.loss_chunk = 5
    logits, chunked = ours(ids, pixels, labels, loss_reduction="sum", position_ids=positions)
    assert logits is None and abs(chunked.item() - full.item()) <= 1e-4 * full.item()
    for g_full, g_chunk in zip(grads, torch.autograd.grad(chunked, [ours.llm.output.weight, ours.projector.fc[0].weight])):
        assert (g_full - g_chunk).abs().max().item() <= 1e-5


# -----------------------------------------------------------------------------
# SigLIP towers and Qwen2 LLMs


def tiny_hf_siglip_qwen_llava(strategy="full", vision_layer=-1, image_size=42, use_head=True, seed=0, **text):
    """A random, tiny LlavaForConditionalGeneration with a SigLIP tower (head on, as SiglipVisionConfig defaults)
    and a Qwen2 LLM with tied embeddings, as llava-interleave-qwen-0.5b."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen2Config, SiglipVisionConfig

    torch.manual_seed(seed)
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                image_size=image_size, patch_size=14, vision_use_head=use_head)
    llm = Qwen2Config(**{**dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                tie_word_embeddings=True, rms_norm_eps=1e-6), **text})
    n_tokens = (image_size // 14) ** 2 - (strategy == "default")
    cfg = LlavaConfig(vision_config=vision, text_config=llm, image_token_index=511, image_seq_length=n_tokens,
                      vision_feature_layer=vision_layer, vision_feature_select_strategy=strategy,
                      tie_word_embeddings=True)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("image_size,patch_size", [(384, 14), (224, 14), (256, 16), (512, 16)])
def test_siglip_hidden_states_match_transformers(tmp_path, image_size, patch_size):
    """SiglipVisionModel at real so400m-style resolutions (27 x 27 and 16 x 16 patches of 14 px) and the fixed-
    resolution SigLIP2-base ones (16 x 16 and 32 x 32 patches of 16 px: a SiglipModel too), narrow and shallow."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    hf = SiglipVisionModel(SiglipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                              num_attention_heads=4, image_size=image_size,
                                              patch_size=patch_size)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    vcfg = hf_config.vit_config(hf_config.read_json(tmp_path / "config.json"))
    assert vcfg.kind == "siglip" and vcfg.act == "gelu_pytorch_tanh" and vcfg.norm_eps == 1e-6
    cfg = VLMConfig(vision=vcfg, llm=vlm_preset("debug").llm)
    vit = ViT(cfg.vision).eval()
    vit.load_state_dict({k.removeprefix("vision."): v for k, v in convert.vision_from_clip(tmp_path, cfg).items()})
    pixels = torch.randn(2, 3, image_size, image_size)
    with torch.no_grad():
        out = hf(pixels, output_hidden_states=True)
        ours = vit(pixels, layers=[0, 1, -1])
        post = vit.ln_post(ours[-1])
    for o, t in zip(ours + [post], (*out.hidden_states[0:2], out.hidden_states[-1], out.last_hidden_state)):
        assert o.shape == t.shape and (o - t).abs().max().item() <= TOL


@pytest.mark.parametrize("vision_layer,strategy", [(-1, "full"), (-2, "default")])
def test_siglip_qwen2_llava_matches_transformers(tmp_path, capsys, vision_layer, strategy):
    hf = tiny_hf_siglip_qwen_llava(strategy, vision_layer)
    ours = ours_from_hf(hf, tmp_path)
    assert "dropping SigLIP's attention-pooling head" in capsys.readouterr().err
    assert ours.cfg.vision.kind == "siglip" and ours.cfg.llm.qkv_bias and ours.cfg.llm.tie_embeddings
    assert ours.cfg.n_image_tokens == hf.config.image_seq_length
    ids, pixels, labels = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=ours.cfg.n_image_tokens + 12,
                                      image_size=42)
    with torch.no_grad():
        out = hf(input_ids=ids, pixel_values=pixels, labels=labels)
        logits, loss = ours(ids, pixels, labels)
    assert (logits - out.logits).abs().max().item() <= TOL
    assert abs(loss.item() - out.loss.item()) <= TOL


def test_qwen_and_siglip_presets_have_published_shapes():
    """Parameter counts against transformers' own classes built with the published hub configs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, SiglipVisionConfig, SiglipVisionModel

    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    qwen = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768)
    with torch.device("meta"):
        ours = {name: VLM(VLMConfig(vision=VIT_PRESETS["debug"], llm=LLM_PRESETS[name])).llm
                for name in ("qwen2-0.5b", "qwen2-7b")}
        theirs = {"qwen2-0.5b": Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                                             num_hidden_layers=24, num_attention_heads=14,
                                                             num_key_value_heads=2, tie_word_embeddings=True, **qwen)),
                  "qwen2-7b": Qwen2ForCausalLM(Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                                           num_hidden_layers=28, num_attention_heads=28,
                                                           num_key_value_heads=4, tie_word_embeddings=False, **qwen))}
        siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                      num_attention_heads=16, image_size=384, patch_size=14,
                                                      vision_use_head=False))
        our_siglip = VLM(VLMConfig(vision=VIT_PRESETS["siglip-so400m-patch14-384"], llm=LLM_PRESETS["debug"])).vision
        interleave = VLM(vlm_preset("llava-interleave-qwen-0.5b"))
    assert abs(n(ours["qwen2-0.5b"]) - 494.0e6) / 494.0e6 < 0.01  # Qwen2-0.5B: 0.49B
    assert abs(n(ours["qwen2-7b"]) - 7.62e9) / 7.62e9 < 0.01  # Qwen2-7B: 7.62B
    for name in ours:
        assert n(ours[name]) == n(theirs[name]), name
    assert n(our_siglip) == n(siglip)  # 27 layers, no head: ~413M
    assert vlm_preset("llava-interleave-qwen-0.5b").n_image_tokens == 729
    assert n(interleave.vision) == n(siglip) - sum(p.numel() for k, p in siglip.named_parameters() if "layers.26." in k)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "siglip-qwen2"])
def test_padded_batch_generation_matches_transformers(tmp_path, family):
    """Prompts of different lengths, left-padded as HF's processors pad for generation: greedy tokens equal HF's."""
    from model import left_pad

    hf = tiny_hf_llava() if family == "llama" else tiny_hf_siglip_qwen_llava(use_sliding_window=True, sliding_window=12,
                                                                              max_window_layers=1)
    ours = ours_from_hf(hf, tmp_path)
    n, size = ours.cfg.n_image_tokens, ours.cfg.vision.image_size
    g = torch.Generator().manual_seed(3)
    prompts = []
    for length, image_at in ((n + 9, 1), (n + 2, 0), (n + 15, 6)):  # long, short (image first), longest
        ids = torch.randint(3, 500, (length,), generator=g).tolist()
        prompts.append(ids[:image_at] + [511] * n + ids[image_at + n:])
    ids, mask = left_pad(prompts, pad_id=0)
    pixels = torch.randn(3, 3, size, size, generator=g)
    with torch.no_grad():
        theirs = hf.generate(input_ids=ids, pixel_values=pixels, attention_mask=mask, max_new_tokens=12,
                             min_new_tokens=12, do_sample=False)[:, ids.shape[1]:]
        mine = ours.generate(ids, pixels, max_new_tokens=12, attention_mask=mask)
        alone = [ours.generate(torch.tensor([p]), pixels[i : i + 1], max_new_tokens=12) for i, p in enumerate(prompts)]
        # static (XLA's rollouts): a bucket longer than every prompt, the decode slot in a tensor, the whole cache read
        bucket, bucket_mask = left_pad(prompts, pad_id=0, length=ids.shape[1] + 5)
        static = ours.generate(bucket, pixels, max_new_tokens=12, attention_mask=bucket_mask, static=True)
    assert torch.equal(mine, theirs)
    assert torch.equal(mine, torch.cat(alone))
    assert torch.equal(static, theirs)
    with pytest.raises(ValueError, match="pad prompts on the left"):
        ours.generate(ids, pixels, attention_mask=mask.flip(1))


@torch.no_grad()
def test_static_generation_stops_when_every_row_has_ended_if_asked_now_and_then():
    """generate(static=True, stop_every=k): the host asks every k tokens whether every row has ended, and the answer
    is the full static generation cut there (eos after each row's end), not max_new_tokens long."""
    model = build_model(vlm_preset("debug"), seed=0).eval()
    size = model.cfg.vision.image_size
    ids = torch.randint(0, 200, (1, 12)).repeat(3, 1)  # three rows that answer alike
    pixels = torch.randn(3, 3, size, size)
    free = model.generate(ids, pixels, max_new_tokens=40, static=True)
    eos = int(free[0, 5])
    full = model.generate(ids, pixels, max_new_tokens=40, eos_id=eos, static=True)
    ended = int((full[0] == eos).nonzero()[0]) + 1  # tokens up to and with the first eos
    cut = model.generate(ids, pixels, max_new_tokens=40, eos_id=eos, static=True, stop_every=4)
    assert cut.shape[1] == -(-ended // 4) * 4 < 40
    assert torch.equal(cut, full[:, : cut.shape[1]]) and (full[:, cut.shape[1]:] == eos).all()
