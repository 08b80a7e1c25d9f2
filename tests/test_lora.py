"""LoRA against peft 0.21: the same base weights and adapter values give peft's logits and adapter gradients; the
exports (merged weights, a peft adapter directory) load in transformers and peft; a peft adapter reads back; the
vision tower is adapted only when named; and training with lora on changes the adapters and the projector only."""

import json
import re
import shutil

import pytest
import torch
from conftest import ROOT, checkpoint_tensors, image_batch, tiny_hf_llava
from safetensors.torch import load_file, save_file
from test_convert import anyres_logits, tiny_hf_anyres
from test_train import args, losses, run, weights

import config
import convert
import hf_config
import hf_names
import model_files
import train
from lora import LoRAConfig, LoRALinear, apply_lora, merge_lora
from model import build_model
from model_config import vlm_preset

# our layer -> transformers-5's module, written out here (not taken from convert.py)
HF_NAMES = [(r"llm\.layers\.(\d+)\.attention\.w([qkvo])", r"model.language_model.layers.\1.self_attn.\2_proj"),
            (r"llm\.layers\.(\d+)\.feed_forward\.w1", r"model.language_model.layers.\1.mlp.gate_proj"),
            (r"llm\.layers\.(\d+)\.feed_forward\.w2", r"model.language_model.layers.\1.mlp.down_proj"),
            (r"llm\.layers\.(\d+)\.feed_forward\.w3", r"model.language_model.layers.\1.mlp.up_proj"),
            (r"vision\.blocks\.(\d+)\.attn\.w([qkv])", r"model.vision_tower.encoder.layers.\1.self_attn.\2_proj"),
            (r"vision\.blocks\.(\d+)\.attn\.wo", r"model.vision_tower.encoder.layers.\1.self_attn.out_proj"),
            (r"vision\.blocks\.(\d+)\.mlp\.c_fc", r"model.vision_tower.encoder.layers.\1.mlp.fc1"),
            (r"vision\.blocks\.(\d+)\.mlp\.c_proj", r"model.vision_tower.encoder.layers.\1.mlp.fc2")]
LLM_REGEX = r"model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"


def hf_name(ours):
    for pattern, theirs in HF_NAMES:
        if re.fullmatch(pattern, ours):
            return re.sub(pattern, theirs, ours)
    raise KeyError(ours)


def adapted(peft_model):
    """transformers module names peft put an adapter on."""
    return {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")
            and "default" in getattr(m, "lora_A", {})}


def ours_from_hf(hf, path):
    hf.save_pretrained(path)
    return model_files.load_model(path)


def randomize_adapters(model, seed=0, std=0.3):
    """Non-zero B (peft's init leaves it zero, which would hide a wrong B, scaling or name)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * std)
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


def peft_twin(hf, ours, peft_targets, dropout=0.0):
    """get_peft_model on the HF model with ours's rank, alpha and rslora, and ours's adapter values copied in."""
    from peft import LoraConfig, get_peft_model

    lora = ours.cfg.lora
    twin = get_peft_model(hf, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=dropout, use_rslora=lora.rslora,
                                         target_modules=peft_targets))
    mine = {name: m for name, m in ours.named_modules() if isinstance(m, LoRALinear)}
    assert adapted(twin) == {hf_name(n) for n in mine}  # both adapt the same layers
    with torch.no_grad():
        for name, m in mine.items():
            theirs = twin.base_model.model.get_submodule(hf_name(name))
            theirs.lora_A["default"].weight.copy_(m.lora_A.weight)
            theirs.lora_B["default"].weight.copy_(m.lora_B.weight)
    return twin


# -----------------------------------------------------------------------------
# the layer against peft


CASES = {  # ours, peft's target_modules, r, alpha, rslora
    "llm-all": (["llm"], LLM_REGEX, 4, 8, False),
    "some-llm-and-vit-rslora": (["llm.attention.wq", "llm.attention.wv", "llm.feed_forward.w2", "vision"],
                                r"model\.language_model\.layers\.\d+\.(self_attn\.[qv]_proj|mlp\.down_proj)|"
                                r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])",
                                3, 5, True),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_adapter_gradients_match_peft(tmp_path, case):
    targets, peft_targets, r, alpha, rslora = CASES[case]
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path / "hf")
    ids, pixels, labels = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    before = ours(ids, pixels)[0].detach()
    apply_lora(ours, LoRAConfig(r=r, alpha=alpha, targets=targets, rslora=rslora), seed=0)
    # peft's init: B zero (the model is unchanged), A kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    assert torch.equal(ours(ids, pixels)[0], before)
    layer = ours.llm.layers[0].attention.wq if "llm" in targets else ours.llm.layers[1].attention.wv
    bound = layer.in_features**-0.5
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > 0.8 * bound / 3**0.5
    randomize_adapters(ours)
    twin = peft_twin(hf, ours, peft_targets).eval()
    ours.eval()
    assert all(p.requires_grad == ("lora_" in n) for n, p in twin.named_parameters())  # peft trains adapters only
    for name, p in ours.named_parameters():
        p.requires_grad_(".lora_" in name)
    logits, loss = ours(ids, pixels, labels)
    out = twin(input_ids=ids, pixel_values=pixels, labels=labels)
    assert (logits - out.logits).abs().max() <= 1e-5
    assert abs(loss.item() - out.loss.item()) <= 1e-6
    loss.backward()
    out.loss.backward()
    n = 0
    for name, m in ours.named_modules():
        if isinstance(m, LoRALinear):
            theirs = twin.base_model.model.get_submodule(hf_name(name))
            for ab in ("lora_A", "lora_B"):
                mine, ref = getattr(m, ab).weight.grad, getattr(theirs, ab)["default"].weight.grad
                if ref is None:  # the ViT block above the selected layer reaches no loss, in both
                    assert mine is None and name.startswith("vision.blocks.1."), name
                    continue
                assert (mine - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), (name, ab)
                n += 1
    assert n >= 2 * len([t for t in adapted(twin) if "encoder.layers.1." not in t]) and n >= 8


def test_adapters_off_is_peft_disable_adapter_and_is_restored_after_an_exception(tmp_path):
    from lora import adapters_off

    targets, peft_targets, r, alpha, rslora = CASES["some-llm-and-vit-rslora"]
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path / "hf").eval()
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    base = ours(ids, pixels)[0].detach()
    apply_lora(ours, LoRAConfig(r=r, alpha=alpha, targets=targets, rslora=rslora), seed=0)
    randomize_adapters(ours)
    twin = peft_twin(hf, ours, peft_targets).eval()
    adapted = ours(ids, pixels)[0].detach()
    assert (adapted - base).abs().max() > 1e-2
    with twin.disable_adapter():
        theirs = twin(input_ids=ids, pixel_values=pixels).logits
    with adapters_off(ours), adapters_off(ours):  # nested: the inner exit leaves them off
        off = ours(ids, pixels)[0]
        assert torch.equal(ours(ids, pixels)[0], off)
    assert (off - theirs).abs().max() <= 1e-5 and torch.equal(off, base)  # exactly the model before its adapters
    assert torch.equal(ours(ids, pixels)[0], adapted)
    with pytest.raises(RuntimeError, match="mid-forward"), adapters_off(ours):
        raise RuntimeError("mid-forward")
    assert torch.equal(ours(ids, pixels)[0], adapted)


@pytest.mark.parametrize("mode", ["bf16-weights", "autocast"])
def test_bf16_logits_agree_with_peft_to_bf16_rounding(tmp_path, mode):
    """In bf16 (weights cast, or fp32 weights under autocast as train.py runs) ours and peft round differently;
    they must stay as close to each other as peft's bf16 logits are to the fp32 ones."""
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path / "hf")
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=["llm", "vision.attn"]), seed=0)
    randomize_adapters(ours, std=0.1)
    twin = peft_twin(hf, ours, LLM_REGEX + r"|model\.vision_tower\.encoder\.layers\.\d+\.self_attn\.(q|k|v|out)_proj")
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    ours.eval(), twin.eval()
    with torch.no_grad():
        exact = ours(ids, pixels)[0]
        if mode == "bf16-weights":
            ours.to(torch.bfloat16), twin.to(torch.bfloat16)
            pixels = pixels.bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            mine, theirs = ours(ids, pixels)[0].float(), twin(input_ids=ids, pixel_values=pixels).logits.float()
    rounding = (theirs - exact).abs().max()
    assert 1e-4 < rounding < 0.05 and (mine - theirs).abs().max() <= 2 * rounding, (mine - theirs).abs().max()


def test_dropout_acts_in_training_only_and_draws_as_peft(tmp_path):
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path / "hf")
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    apply_lora(ours, LoRAConfig(r=4, alpha=8, dropout=0.3, targets=["llm"]), seed=0)
    randomize_adapters(ours)
    twin = peft_twin(hf, ours, LLM_REGEX, dropout=0.3)
    with torch.no_grad():
        ours.eval()
        plain = ours(ids, pixels)[0]
        ours.train()
        torch.manual_seed(7)
        dropped = ours(ids, pixels)[0]
        twin.train()  # get_peft_model leaves it so
        torch.manual_seed(7)
        theirs = twin(input_ids=ids, pixel_values=pixels).logits
        twin.eval()
        theirs_plain = twin(input_ids=ids, pixel_values=pixels).logits
    assert (plain - theirs_plain).abs().max() <= 1e-5
    assert (dropped - plain).abs().max() > 1e-2  # dropout acted
    # the same draws in the same order: the layers run in peft's order (q, k, v, o, gate, up, down)
    assert (dropped - theirs).abs().max() <= 1e-5


def test_merge_equals_unmerged_and_peft_merge_and_unload(tmp_path):
    hf = tiny_hf_llava()
    ours = ours_from_hf(hf, tmp_path / "hf")
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=["llm", "vision.mlp"], rslora=True), seed=0)
    randomize_adapters(ours)
    twin = peft_twin(hf, ours, LLM_REGEX + r"|model\.vision_tower\.encoder\.layers\.\d+\.mlp\.fc[12]").eval()
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    with torch.no_grad():
        unmerged = ours.eval()(ids, pixels)[0]
        merged = merge_lora(ours)(ids, pixels)[0]
        theirs = twin.merge_and_unload()
    assert ours.cfg.lora is None and not any(isinstance(m, LoRALinear) for m in ours.modules())
    assert (merged - unmerged).abs().max() <= 1e-5
    for name, m in ours.named_modules():
        if type(m) is torch.nn.Linear and ("llm.layers" in name or "vision.blocks" in name):
            assert (m.weight - theirs.get_submodule(hf_name(name)).weight).abs().max() <= 1e-6, name


# -----------------------------------------------------------------------------
# the vision tower: adapted only when a target names it


def test_vit_is_untouched_unless_asked(tmp_path):
    """peft's leaf names (q_proj, ...) hit CLIP's layers too (LLaVA's finetune_lora.sh, LLaVA#1380); our targets name
    the part, and the exported target_modules adapts exactly our layers."""
    from peft import LoraConfig, get_peft_model

    leaf = get_peft_model(tiny_hf_llava(), LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    assert any(".vision_tower." in n for n in adapted(leaf))  # the bug our explicit targets avoid
    ours = build_model(vlm_preset("debug"), seed=0)
    apply_lora(ours, LoRAConfig(targets=["llm"]))
    assert not any(isinstance(m, LoRALinear) for m in ours.vision.modules())
    assert len([m for m in ours.llm.modules() if isinstance(m, LoRALinear)]) == 7 * ours.cfg.llm.n_layers
    assert not isinstance(ours.llm.output, LoRALinear) and not isinstance(ours.projector.fc[0], LoRALinear)
    asked = apply_lora(build_model(vlm_preset("debug"), seed=0), LoRAConfig(targets=["vision.attn.wq", "llm.attention"]))
    assert {n for n, m in asked.named_modules() if isinstance(m, LoRALinear) and n.startswith("vision")} == \
        {f"vision.blocks.{i}.attn.wq" for i in range(asked.cfg.vision.n_layers)}
    # a config with lora builds the adapters itself (a checkpoint of a LoRA run loads into it), initialised as peft's
    cfg = vlm_preset("debug").with_overrides({"lora": {"r": 2, "targets": ["llm.feed_forward"]}})
    built = build_model(cfg, seed=0)
    layers = [m for m in built.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 3 * cfg.llm.n_layers and all(not m.lora_B.weight.any() for m in layers)
    assert all(m.lora_A.weight.abs().max() <= m.in_features**-0.5 for m in layers)
    for bad in (["q_proj"], ["llm.attn"], ["projector"], []):
        with pytest.raises(ValueError, match="lora: unknown targets"):
            LoRAConfig(targets=bad)


# -----------------------------------------------------------------------------
# exports and imports


def lora_checkpoint(hf, tmp_path, targets, seed=0):
    """Our checkpoint of `hf` with random adapters on `targets` and a projector moved off the base (as if trained)."""
    ours = ours_from_hf(hf, tmp_path / "src")
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=targets), seed=seed)
    randomize_adapters(ours, seed, std=0.1)  # as trained ones: larger ones blow up activations past fp32's 1e-5
    with torch.no_grad():
        for p in ours.projector.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    model_files.save_model(ours, tmp_path / "ours")
    return ours.eval()


@pytest.mark.parametrize("family", ["llama", "gemma3", pytest.param("qwen3", marks=pytest.mark.full)])
def test_llava_exports_load_in_transformers_and_peft_with_equal_logits(tmp_path, family):
    """Llama, or tests/test_families.py's Qwen3 and Gemma 3 decoders (q/k norms, Gemma's sandwich norms: in the
    merged export, never adapted) behind a SigLIP tower."""
    from peft import PeftModel
    from test_families import tiny_llava
    from transformers import LlavaForConditionalGeneration

    ours = lora_checkpoint(tiny_hf_llava() if family == "llama" else tiny_llava(family, image_size=28), tmp_path, ["llm"])
    with pytest.raises(SystemExit, match="holds LoRA adapters.*--merge-lora.*--lora-only"):
        convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "plain")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--merge-lora", "--out", str(tmp_path / "merged")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--lora-only", "--out", str(tmp_path / "adapter")])
    merged, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not any("lora" in k for k in load_file(tmp_path / "merged/model.safetensors"))
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["modules_to_save"] == ["multi_modal_projector"] and (config["r"], config["lora_alpha"]) == (4, 8)
    keys = load_file(tmp_path / "adapter/adapter_model.safetensors")
    assert "base_model.model.model.language_model.layers.1.mlp.down_proj.lora_B.weight" in keys  # transformers 5
    assert "base_model.model.model.multi_modal_projector.linear_2.bias" in keys
    base = LlavaForConditionalGeneration.from_pretrained(tmp_path / "src")
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert adapted(peft) == {hf_name(n) for n, m in ours.named_modules() if isinstance(m, LoRALinear)}
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    with torch.no_grad():
        mine = ours(ids, pixels)[0]
        for hf in (merged.eval(), peft):
            assert (hf(input_ids=ids, pixel_values=pixels).logits - mine).abs().max() <= 1e-5
    # a stage-0 run trained the ViT in full beside the LLM's adapters: a peft directory here cannot hold it
    (tmp_path / "ours/state.json").write_text(json.dumps({"config": {"stage": 0}}))
    with pytest.raises(SystemExit, match="stage 0 trained the vision tower in full.*--merge-lora"):
        convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--lora-only", "--out", str(tmp_path / "adapter0")])


@pytest.mark.parametrize("kind", ["llava_next", "llava_onevision"])
def test_anyres_exports_load_in_transformers_and_peft(tmp_path, kind):
    """LLaVA-NeXT (CLIP + Llama) and OneVision (SigLIP + Qwen2, with q/k/v biases), adapters on the ViT too."""
    import transformers as tf
    from peft import PeftModel

    ours = lora_checkpoint(tiny_hf_anyres(kind), tmp_path, ["llm", "vision.attn"])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--merge-lora", "--out", str(tmp_path / "merged")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--lora-only", "--out", str(tmp_path / "adapter")])
    cls = getattr(tf, hf_config.HF_ARCHITECTURES[kind])
    merged, info = cls.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    peft = PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "src"), tmp_path / "adapter").eval()
    assert adapted(peft) == {hf_name(n) for n, m in ours.named_modules() if isinstance(m, LoRALinear)}
    for size in [(50, 33), (33, 90)]:  # a 2x2 grid (reduced by OneVision's anyres_max_2) and a 1x3 one
        for hf in (merged.eval(), peft):
            theirs, mine = anyres_logits(hf, ours, size)
            assert (theirs - mine).abs().max() <= 1e-4, size


def test_from_hf_reads_a_peft_adapter_back(tmp_path):
    """An adapter peft trained (random values, the projector under modules_to_save) -> our checkpoint with the same
    logits; exported again, it is peft's file, key for key."""
    from peft import LoraConfig, PeftModel, get_peft_model

    hf = tiny_hf_llava()
    hf.save_pretrained(tmp_path / "base")
    twin = get_peft_model(hf, LoraConfig(r=3, lora_alpha=7, use_rslora=True, target_modules=LLM_REGEX,
                                         modules_to_save=["multi_modal_projector"]))
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.2 * torch.randn_like(p))
    twin.save_pretrained(tmp_path / "adapter")
    convert.main(["from-hf", "--llava", str(tmp_path / "base"), "--lora", str(tmp_path / "adapter"),
                  "--out", str(tmp_path / "ours")])
    ours = model_files.load_model(tmp_path / "ours").eval()
    assert ours.cfg.lora == LoRAConfig(r=3, alpha=7, targets=["llm.attention.wq", "llm.attention.wk", "llm.attention.wv",
                                                              "llm.attention.wo", "llm.feed_forward.w1",
                                                              "llm.feed_forward.w2", "llm.feed_forward.w3"], rslora=True)
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 511, 512, seq=20)
    from transformers import LlavaForConditionalGeneration

    loaded = PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(tmp_path / "base"),
                                       tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (ours(ids, pixels)[0] - loaded(input_ids=ids, pixel_values=pixels).logits).abs().max() <= 1e-5
    # the same adapter as peft saves it from a transformers-4 model (language_model.model.*, no leading model.)
    (tmp_path / "tf4").mkdir()
    shutil.copy(tmp_path / "adapter/adapter_config.json", tmp_path / "tf4")
    tf4 = {re.sub(r"^base_model\.model\.model\.language_model\.", "base_model.model.language_model.model.",
                  k).replace("base_model.model.model.multi_modal_projector.", "base_model.model.multi_modal_projector."): v
           for k, v in load_file(tmp_path / "adapter/adapter_model.safetensors").items()}
    assert not any(k.startswith("base_model.model.model.") for k in tf4)
    save_file(tf4, tmp_path / "tf4/adapter_model.safetensors")
    convert.main(["from-hf", "--llava", str(tmp_path / "base"), "--lora", str(tmp_path / "tf4"),
                  "--out", str(tmp_path / "o4")])
    assert all(torch.equal(a, b) for a, b in zip(model_files.load_model(tmp_path / "o4").state_dict().values(),
                                                  ours.state_dict().values()))
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--lora-only", "--out", str(tmp_path / "again")])
    theirs, again = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("adapter", "again"))
    assert theirs.keys() == again.keys() and all(torch.equal(theirs[k], again[k]) for k in theirs)


def test_bad_peft_adapters_are_clear_errors(tmp_path):
    from peft import LoraConfig, get_peft_model

    hf = tiny_hf_llava()
    hf.save_pretrained(tmp_path / "base")
    get_peft_model(hf, LoraConfig(r=2, target_modules=LLM_REGEX, use_dora=True)).save_pretrained(tmp_path / "dora")

    def from_hf(adapter):
        convert.main(["from-hf", "--llava", str(tmp_path / "base"), "--lora", str(tmp_path / adapter),
                      "--out", str(tmp_path / f"out-{adapter}")])

    with pytest.raises(SystemExit, match="does not compute.*use_dora"):
        from_hf("dora")
    # adapters on one layer only: ours adapt every block of a kind alike
    get_peft_model(tiny_hf_llava(), LoraConfig(r=2, target_modules=r"model\.language_model\.layers\.0\.self_attn\.q_proj")
                   ).save_pretrained(tmp_path / "one")
    with pytest.raises(SystemExit, match="missing.*layers.1.attention.wq.lora_A"):
        from_hf("one")
    # lm_head: not a layer llavax adapts
    get_peft_model(tiny_hf_llava(), LoraConfig(r=2, target_modules=["lm_head"])).save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit, match="does not adapt \\['llm.output'\\]"):
        from_hf("head")


def test_memory_names_are_transformers_own():
    """memory_name inverts hub_name on every tensor name of the three transformers classes."""
    hf = [tiny_hf_llava(), tiny_hf_anyres("llava_next"), tiny_hf_anyres("llava_onevision")]
    for model in hf:
        for key in model.state_dict():
            assert hf_names.memory_name(hf_names.hub_name(key)) == key


# -----------------------------------------------------------------------------
# training with lora on: python train.py, torchrun


LORA = "--lora={'r': 4, 'alpha': 8, 'dropout': %s, 'targets': ['llm']}"
LR_SCALE = "--lr_scale={'vision': 1.0, 'projector': 0.1, 'llm': 1.0}"  # LLaVA's: the projector at a tenth of lr


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=400, seed=0, val_fraction=0.1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random debug model as a convert.py checkpoint: the base that LoRA runs start from (init_from)."""
    cfg = vlm_preset("debug")
    cfg.vision.image_size, cfg.llm.vocab_size, cfg.image_token_id = 28, 576, 512
    out = tmp_path_factory.mktemp("lora-base")
    model_files.save_model(build_model(cfg, seed=0), out / "init")
    return out / "init"


def step_weights(step):
    """A training step's weights by our names (its DCP shards, read whole)."""
    return {k[len("model."):]: v for k, v in checkpoint_tensors(step, "model.").items()}


def lora_args(shapes, out, base, dropout, *extra):
    return args(shapes, out, f"--init_from={base}", "--stage=2", LORA % dropout, LR_SCALE, *extra)


def test_lora_run_trains_adapters_and_projector_only_and_resumes_exactly(shapes, base, tmp_path):
    run(lora_args(shapes, tmp_path / "a", base, 0.1, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5"))
    before, after = load_file(base / "model.safetensors"), step_weights(tmp_path / "a/step-000006")
    assert {k for k in before if not torch.equal(before[k], after[k])} == {k for k in before if k.startswith("projector.")}
    new = sorted(set(after) - set(before))
    assert len(new) == 2 * 7 * 2 and all(re.fullmatch(r"llm\.layers\.\d\.(attention|feed_forward)\.w\d?[qkvo]?\."
                                                       r"lora_[AB]\.weight", k) for k in new), new
    assert all(after[k].abs().max() > 0 for k in new)  # B moved off zero
    assert json.loads((tmp_path / "a/step-000006/config.json").read_text())["lora"]["r"] == 4
    # the stream, the dropout masks (the RNG state) and the optimizer state all come back
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a/step-000003", tmp_path / "b/step-000003")
    run(lora_args(shapes, tmp_path / "b", base, 0.1, "--max_iters=6", "--init_from=resume"))
    assert weights(tmp_path / "b/step-000006") == weights(tmp_path / "a/step-000006")
    # resume with other adapters is refused; init_from a LoRA run with lora={} merges its adapters
    with pytest.raises(SystemExit, match="resume: the checkpoint has lora=.*r=4.*the config lora=.*r=8"):
        train.main(args(shapes, tmp_path / "b", "--init_from=resume", "--stage=2", "--max_iters=7",
                        "--lora={'r': 8, 'targets': ['llm']}"))
    r = run(args(shapes, tmp_path / "c", f"--init_from={tmp_path / 'a/step-000006'}", "--stage=1", "--max_iters=1"))
    assert "merging its LoRA adapters" in r.stdout
    assert not any("lora" in k for k in step_weights(tmp_path / "c/step-000001"))


@pytest.fixture(scope="module")
def lora_run(shapes, base, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    run(lora_args(shapes, out, base, 0.0, "--max_iters=4"))
    return out


def test_lora_packed_with_activation_checkpointing_or_tiled_gives_the_same_losses(shapes, base, lora_run, tmp_path):
    packed = ["--pack=2", "--batch_size=4", "--micro_batch_size=4", "--seq_len=96", "--loss_chunk=40"]
    run(lora_args(shapes, tmp_path / "packed", base, 0.0, "--max_iters=4", "--activation_checkpointing=True", *packed))
    run(lora_args(shapes, tmp_path / "tiled", base, 0.0, "--max_iters=4", "--max_tiles=1"))  # the tile path
    a = losses(lora_run)
    for b in (losses(tmp_path / "packed"), losses(tmp_path / "tiled")):
        assert sorted(a) == sorted(b) == [1, 2, 3, 4] and all(abs(a[s] - b[s]) <= 1e-5 * a[s] for s in a), (a, b)


@pytest.mark.full
def test_lora_under_torchrun_fsdp_matches_the_single_process_run_and_resumes_exactly(shapes, base, lora_run, tmp_path):
    fsdp = ["--parallel=fsdp", "--micro_batch_size=4", "--ckpt_interval=2", "--keep_last=5"]
    run(lora_args(shapes, tmp_path / "a", base, 0.0, "--max_iters=4", *fsdp), nproc=2)
    a, b = losses(lora_run), losses(tmp_path / "a")
    assert all(abs(a[s] - b[s]) <= 1e-5 * a[s] for s in a), (a, b)
    before, after = load_file(base / "model.safetensors"), step_weights(tmp_path / "a/step-000004")
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("projector."))
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a/step-000002", tmp_path / "b/step-000002")
    run(lora_args(shapes, tmp_path / "b", base, 0.0, "--max_iters=4", "--init_from=resume", *fsdp), nproc=2)
    assert weights(tmp_path / "b/step-000004") == weights(tmp_path / "a/step-000004")


def test_lora_config_errors_name_the_field(shapes, base, tmp_path):
    for bad, message in [("{'rank': 4}", "lora=.*: no field 'rank' \\(its fields: r, alpha"),
                         ("{'r': 4, 'targets': ['q_proj']}", "lora=.*unknown targets \\['q_proj'\\]"),
                         ("{'r': 0}", "lora=.*r must be a positive integer")]:
        with pytest.raises(SystemExit, match=message):
            config.load_config([f"--lora={bad}"])
    with pytest.raises(SystemExit, match="adapt \\['llm'\\], which stage 1 does not train"):
        train.main(lora_args(shapes, tmp_path, base, 0.0, "--stage=1"))


def test_llava_lora_recipe_config():
    cfg = config.load_config([str(ROOT / "configs/finetune_lora.py")])
    lora = config.lora_config(cfg)
    assert (lora.r, lora.alpha, lora.dropout, lora.scaling, cfg["stage"]) == (128, 256, 0.05, 2.0, 2)
    assert cfg["lr"] == 2e-4 and cfg["lr"] * cfg["lr_scale"]["projector"] == pytest.approx(2e-5)
    assert lora.sites() == ["llm.attention.wq", "llm.attention.wk", "llm.attention.wv", "llm.attention.wo",
                            "llm.feed_forward.w1", "llm.feed_forward.w2", "llm.feed_forward.w3"]
