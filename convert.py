"""
Weights in and out of llavax: Hugging Face LLaVA / LLaMA / CLIP, original haotian-liu/LLaVA,
and our checkpoint directory (model.safetensors + config.json).

    python convert.py from-hf --llava HF_DIR --out CKPT_DIR    # model_type llava, llava_next or llava_onevision
    python convert.py from-hf --llm LLAMA_DIR --vision CLIP_DIR --out CKPT_DIR [--projector mlp2x_gelu] [--vision-layer -2]
    python convert.py from-llava --llava DIR --vision CLIP_DIR [--llm LLAMA_DIR] --out CKPT_DIR
    python convert.py to-hf --ckpt CKPT_DIR --out HF_DIR [--merge-lora | --lora-only]   # --lora-only: a peft adapter
    python convert.py consolidate --ckpt out/run/step-001000 --out CKPT_DIR   # a sharded training step -> one model
    python convert.py from-hf --llava HF_DIR --lora PEFT_ADAPTER_DIR --out CKPT_DIR           # peft's LoRA read back
    python convert.py anyres --ckpt CKPT_DIR --preset llava-next-vicuna-7b --out CKPT_DIR   # tile images from here on

Every conversion goes through an explicit table (our name -> their name). Every source key
must be consumed and every shape must match, or ConversionError lists what did not.
"""

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch

import storage
from hf_config import HF_ARCHITECTURES, LLAVA_TYPES, hf_model_type, llama_config, llava_hf_config, read_json, vit_config
from hf_names import (check_complete, drop_siglip_head, drop_tied_head, expected_shapes, hub_name, llama_table,
                      llava_from_hf, llava_table, memory_name, processor_resample, projector_table, remap, to_hf_shape,
                      vit_table)
from lora import LORA_SITES, LoRAConfig, is_lora_parameter, merge_lora_state
from model import Projector
from model_config import LlamaConfig, ViTConfig, VLMConfig, vlm_preset
from model_files import copy_tokenizer, read_checkpoint, save_checkpoint
from processor import TEMPLATE_NAMES, ExportError, export_tokenizer, has_processor, write_processor
from weight_files import ConversionError, read_weights, say, write_dir, write_safetensors, write_weights

# -----------------------------------------------------------------------------
# our checkpoint directory (tokenizer files travel with the weights)


# -----------------------------------------------------------------------------
# conversions


def llava_to_hf(ckpt_dir, out, template=None, image_mode=None, merge_lora=False):
    """The hub layout plus what AutoProcessor needs: tokenizer files with <image>, the image processor for the
    image mode and the chat template the model was trained with (from the checkpoint's state.json, else the
    arguments, else processor files carried through from-hf, else vicuna_v1 and pad). LoRA adapters are merged
    into the weights with merge_lora, else refused. A training step's shards are read one tensor at a time."""
    state, cfg = read_checkpoint(ckpt_dir, lazy=True)
    if cfg.lora and not merge_lora:
        raise ConversionError(f"{ckpt_dir}: holds LoRA adapters ({cfg.lora}); export with --merge-lora (plain "
                              f"weights) or --lora-only (a peft adapter directory for the base model)")
    if cfg.lora:
        state = {k: v.detach() for k, v in state.items()}  # merging needs the tensors themselves
        state, cfg = merge_lora_state(state, cfg.lora), replace(cfg, lora=None)
        say(f"{ckpt_dir}: merged the LoRA adapters into the weights")
    table, kind = llava_table(cfg), hf_model_type(cfg)
    hub = {table[k]: to_hf_shape(cfg, k, v) for k, v in state.items()}
    if kind not in LLAVA_TYPES:
        return pixel_shuffle_to_hf(ckpt_dir, out, hub, cfg)
    trained = read_json(storage.join(ckpt_dir, "state.json"))["config"] \
        if storage.exists(storage.join(ckpt_dir, "state.json")) else {}
    template, image_mode = template or trained.get("template"), image_mode or trained.get("image_mode")
    carried = template is None and image_mode is None and has_processor(ckpt_dir)
    if not carried and not (template and image_mode):
        template, image_mode = template or "vicuna_v1", image_mode or "pad"
        say(f"{ckpt_dir}: no training config; the processor assumes template {template!r} and image mode "
            f"{image_mode!r} (set --template / --image-mode)")

    def fill(tmp):
        write_weights(hub, tmp)
        Path(tmp, "config.json").write_text(json.dumps(llava_hf_config(cfg), indent=2))
        copy_tokenizer(ckpt_dir, tmp)
        try:
            tokenizer = export_tokenizer(tmp, cfg.image_token_id, cfg.video_token_id, template)
        except ExportError as e:  # name the checkpoint's tokenizer files, not their copies in the temporary folder
            raise ExportError(str(e).replace(str(tmp), str(ckpt_dir))) from None
        if not carried:
            write_processor(cfg, tmp, template, image_mode, tokenizer)
    return write_dir(out, fill)


def pixel_shuffle_to_hf(ckpt_dir, out, hub, cfg: VLMConfig):
    """Idefics3 / SmolVLM and InternVL: the weights, config.json and the tokenizer and processor files as they came
    through from-hf; llavax writes no processor of these classes (yet)."""
    if not has_processor(ckpt_dir):
        say(f"{ckpt_dir}: no HF processor beside the weights; the {llava_hf_config(cfg)['architectures'][0]} export "
            f"holds the weights, config and tokenizer files only (llavax writes no processor for it)")

    def fill(tmp):
        write_weights(hub, tmp)
        Path(tmp, "config.json").write_text(json.dumps(llava_hf_config(cfg), indent=2))
        copy_tokenizer(ckpt_dir, tmp)
    return write_dir(out, fill)


def llava_family(cfg: VLMConfig, what):
    if (kind := hf_model_type(cfg)) not in LLAVA_TYPES:
        raise ConversionError(f"{what} of a {HF_ARCHITECTURES[kind]} model is not implemented (LLaVA classes only)")


PEFT_PREFIX = "base_model.model."  # peft's name of the wrapped model in an adapter file


def lora_to_peft(ckpt_dir, out):
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors) of a LoRA checkpoint, under
    transformers-5 names, the projector (trained in full beside the adapters) under modules_to_save: what
    PeftModel.from_pretrained(the HF export of the base model, out) loads. target_modules is a regex of exactly
    the adapted layers: peft's leaf names (q_proj) would hit the vision tower too."""
    state, cfg = read_checkpoint(ckpt_dir)
    if not cfg.lora:
        raise ConversionError(f"{ckpt_dir}: no LoRA adapters (its config.json has no lora); use to-hf without "
                              f"--lora-only")
    llava_family(cfg, "a peft adapter directory")
    trained = read_json(storage.join(ckpt_dir, "state.json"))["config"] \
        if storage.exists(storage.join(ckpt_dir, "state.json")) else {}
    if trained.get("stage") == 0 and not any(t.startswith("vision") for t in cfg.lora.targets):
        raise ConversionError(f"{ckpt_dir}: stage 0 trained the vision tower in full beside the adapters; a peft "
                              f"directory here holds adapters and the projector only: use --merge-lora")
    table = llava_table(cfg)
    tensors = {}
    for key, value in state.items():
        if is_lora_parameter(key):
            layer, _, which = key.rpartition(".lora_")  # llm.layers.0.attention.wq, A.weight
            tensors[f"{PEFT_PREFIX}{memory_name(table[layer + '.weight']).removesuffix('.weight')}.lora_{which}"] = value
        elif key.startswith("projector."):
            tensors[PEFT_PREFIX + memory_name(table[key])] = value
    layers = {k.removeprefix(PEFT_PREFIX).rpartition(".lora_")[0] for k in tensors if ".lora_" in k}
    targets = "|".join(sorted({re.escape(re.sub(r"\.\d+\.", ".0.", m)).replace(r"\.0\.", r"\.\d+\.") for m in layers}))
    alpha = int(cfg.lora.alpha) if cfg.lora.alpha == int(cfg.lora.alpha) else cfg.lora.alpha
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "r": cfg.lora.r,
              "lora_alpha": alpha, "lora_dropout": cfg.lora.dropout, "use_rslora": cfg.lora.rslora,
              "target_modules": targets, "modules_to_save": ["multi_modal_projector"], "bias": "none",
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}

    def fill(tmp):
        write_safetensors(tensors, Path(tmp, "adapter_model.safetensors"))
        Path(tmp, "adapter_config.json").write_text(json.dumps(config, indent=2))
    return write_dir(out, fill, commit="adapter_config.json")


# adapter_config.json fields whose other values change what the adapter computes, and the value we read
PEFT_DEFAULTS = {"peft_type": "LORA", "bias": "none", "use_dora": False, "fan_in_fan_out": False, "lora_bias": False,
                 "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "target_parameters": None,
                 "use_bdlora": None, "alora_invocation_tokens": None, "layer_replication": None}


def lora_from_peft(adapter_dir, state, cfg: VLMConfig):
    """state and cfg of the base model plus a peft LoRA adapter directory trained on its HF export: the adapters
    (every block of a kind adapted alike, as ours are) and the modules_to_save it trained in full."""
    peft = read_json(storage.join(adapter_dir, "adapter_config.json"))
    odd = {k: peft[k] for k, v in PEFT_DEFAULTS.items() if k in peft and peft[k] != v and (v or peft[k])}
    if odd:
        raise ConversionError(f"{adapter_dir}: adapter_config.json has settings llavax's LoRA does not compute: {odd}")
    if not storage.exists(storage.join(adapter_dir, "adapter_model.safetensors")):
        raise ConversionError(f"{adapter_dir}: no adapter_model.safetensors (a pickled adapter_model.bin is not read: "
                              f"resave it with safe_serialization)")
    llava_family(cfg, "reading a peft adapter")
    inverse = {theirs: ours for ours, theirs in llava_table(cfg).items()}
    adapters, trained, unknown = {}, {}, []
    for key, value in read_weights(adapter_dir).items():
        name = key.removeprefix(PEFT_PREFIX)
        layer, lora, which = name.partition(".lora_")
        ours = inverse.get(hub_name(layer + ".weight" if lora else name))
        if ours is None or (lora and which not in ("A.weight", "B.weight")):
            unknown.append(key)
        elif lora:
            adapters[f"{ours.removesuffix('.weight')}.lora_{which}"] = value
        else:
            trained[ours] = value
    sites = {re.sub(r"^(llm|vision)\.(layers|blocks)\.\d+\.", r"\1.", k.rpartition(".lora_")[0]) for k in adapters}
    outside = sorted(sites - set(LORA_SITES))
    if unknown or outside or not adapters:
        raise ConversionError(f"{adapter_dir}: no place in the {hf_model_type(cfg)} model for {len(unknown)} tensors "
                              f"{unknown[:10]}, adapters on layers llavax does not adapt {outside}, or no adapters")
    try:
        lora = LoRAConfig(r=peft["r"], alpha=peft["lora_alpha"], dropout=peft.get("lora_dropout", 0.0),
                          targets=[s for s in LORA_SITES if s in sites], rslora=peft.get("use_rslora", False))
    except (KeyError, ValueError) as e:
        raise ConversionError(f"{adapter_dir}/adapter_config.json: {e}") from None
    say(f"{adapter_dir}: LoRA r {lora.r}, alpha {lora.alpha:g} on {', '.join(lora.targets)}; trained in full: "
        f"{sorted({k.split('.')[0] for k in trained}) or 'nothing'}")
    cfg = replace(cfg, lora=lora)
    shapes = expected_shapes(cfg)
    state = state | trained | adapters
    return check_complete(remap(state, {k: k for k in shapes}, shapes, str(adapter_dir)), cfg, adapter_dir), cfg


def image_token(tokenizer_dir):
    """The id of '<image>' if the tokenizer already has one, else None."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        p = storage.join(tokenizer_dir, name)
        if storage.exists(p):
            tok = read_json(p)
            for t in tok.get("added_tokens", []):
                if t.get("content") == "<image>":
                    return t["id"]
            for i, t in tok.get("added_tokens_decoder", {}).items():
                if t.get("content") == "<image>":
                    return int(i)
            if "<image>" in tok.get("model", {}).get("vocab", {}):
                return tok["model"]["vocab"]["<image>"]
    return None


def add_image_token(state, llm: LlamaConfig, tokenizer_dir, pad_to):
    """Use the tokenizer's <image> id, or append one: new embedding/output rows are the mean of the old ones,
    and the vocab is padded to a multiple of pad_to (as llava-hf does: 32000 -> 32064)."""
    found = image_token(tokenizer_dir) if tokenizer_dir else None
    if found is not None and found < llm.vocab_size:
        say(f"the tokenizer in {tokenizer_dir} has <image> as id {found}; using it")
        return found, llm
    old = llm.vocab_size
    new = -(-(old + 1) // pad_to) * pad_to
    for k in ("llm.tok_embeddings.weight", "llm.output.weight"):
        if k in state:
            w = state[k]
            state[k] = torch.cat([w, w.float().mean(0, keepdim=True).to(w.dtype).expand(new - old, -1)])
    say(f"the tokenizer has no <image> token: added id {old} for it and grew the vocab {old} -> {new} "
        f"(rows initialised to the mean embedding). data.py inserts this id directly; the tokenizer files are unchanged.")
    return old, LlamaConfig(**{**llm.__dict__, "vocab_size": new})




def fresh_projector(cfg: VLMConfig, seed):
    projector = Projector(cfg.projector, cfg.vision.dim * len(cfg.vision_layers) * cfg.pixel_shuffle**2, cfg.llm.dim,
                          cfg.vision.norm_eps)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for fc in projector.fc:
            torch.nn.init.normal_(fc.weight, std=0.02, generator=gen)
            if fc.bias is not None:
                torch.nn.init.zeros_(fc.bias)
        if projector.norm is not None:  # a scale of 1: Gemma's RMSNorm stores it as 0 (1 + w)
            torch.nn.init.constant_(projector.norm.weight, 1.0 - getattr(projector.norm, "offset", 0.0))
            if getattr(projector.norm, "bias", None) is not None:
                torch.nn.init.zeros_(projector.norm.bias)
    return {f"projector.{k}": v for k, v in projector.state_dict().items()}


def vision_from_clip(clip_dir, shapes_cfg):
    """A CLIP/SigLIP vision model or a full CLIPModel/SiglipModel directory; the text half, the projections and
    SigLIP's pooling head are dropped on purpose."""
    state = {re.sub(r"^vision_model\.", "", k): v for k, v in read_weights(clip_dir).items()}
    state = drop_siglip_head(state, clip_dir)
    text = (r"^text_model\.", r"^visual_projection\.", r"^text_projection\.", r"^logit_scale$", r"^logit_bias$")
    dropped = [k for k in state if any(re.match(p, k) for p in text)]
    if dropped:
        say(f"{clip_dir}: ignoring {len(dropped)} tensors of the text tower and projections")
    return remap(state, vit_table(shapes_cfg.vision, ""), expected_shapes(shapes_cfg), str(clip_dir), text)


def assemble(llm_state, llm_cfg, vision_dir, vision_state, tokenizer_dir, projector, vision_layer, vision_select,
             projector_state=None, pad_vocab=64, seed=0, connector=None):
    """Join an LLM, a vision tower and a projector (fresh when projector_state is None) into one checkpoint. connector:
    VLMConfig's other connector and attention switches ({"pixel_shuffle": 4, "vision_post_norm": True}, Gemma 3's
    {"pool": 4, "attention_blocks": "images"})."""
    vision_cfg = vit_config(read_json(storage.join(vision_dir, "config.json")), vision_dir) if vision_dir else None
    vision_cfg = processor_resample(vision_dir, vision_cfg) if vision_dir else None  # its processor's filter
    try:
        cfg = VLMConfig(vision=vision_cfg or ViTConfig(), llm=llm_cfg, projector=projector, vision_layer=vision_layer,
                        vision_select=vision_select, image_token_id=0, **(connector or {}))
    except ValueError as e:
        raise ConversionError(f"{vision_dir}: {e}") from None
    if vision_state is None:
        vision_state = vision_from_clip(vision_dir, cfg)
    if projector_state is None:
        projector_state = fresh_projector(cfg, seed)
        say(f"initialised a fresh {projector} projector (normal std 0.02, seed {seed})")
    state = llm_state | vision_state | projector_state
    image_id, llm_cfg = add_image_token(state, llm_cfg, tokenizer_dir, pad_vocab)
    cfg = VLMConfig(**{**cfg.__dict__, "llm": llm_cfg, "image_token_id": image_id})
    shapes = expected_shapes(cfg)
    return check_complete(remap(state, {k: k for k in shapes}, shapes, "assembled model"), cfg, "assembled model"), cfg


def llm_from_hf(llm_dir):
    llm_cfg = llama_config(read_json(storage.join(llm_dir, "config.json")), llm_dir)
    probe = VLMConfig(llm=llm_cfg)
    table = llama_table(llm_cfg, "model.", "lm_head.weight")
    state = drop_tied_head(read_weights(llm_dir), llm_cfg, "model.embed_tokens.weight", "lm_head.weight", llm_dir)
    return remap(state, table, expected_shapes(probe), str(llm_dir)), llm_cfg


def from_hf_parts(llm_dir, vision_dir, projector="mlp2x_gelu", vision_layer=-2, vision_select="patch", pad_vocab=64,
                  seed=0, connector=None):
    llm_state, llm_cfg = llm_from_hf(llm_dir)
    return assemble(llm_state, llm_cfg, vision_dir, None, llm_dir, projector, vision_layer, vision_select,
                    pad_vocab=pad_vocab, seed=seed, connector=connector)


def from_llava(llava_dir, vision_dir, llm_dir=None, pad_vocab=64):
    """Original haotian-liu/LLaVA: a full checkpoint, or a stage-1 directory holding only mm_projector.bin."""
    hf = read_json(storage.join(llava_dir, "config.json"))
    if hf.get("mm_use_im_start_end") or hf.get("mm_use_im_patch_token"):
        raise ConversionError(f"{llava_dir}: mm_use_im_start_end / mm_use_im_patch_token are not supported")
    if str(hf.get("image_aspect_ratio", "")).startswith("anyres"):  # LLaVA-VL/LLaVA-NeXT's own checkpoints
        raise ConversionError(f"{llava_dir}: an original LLaVA-NeXT / OneVision checkpoint (image_aspect_ratio "
                              f"{hf['image_aspect_ratio']!r}) is not read directly; convert it with transformers' "
                              "convert_llava_next / convert_llava_onevision script (or use the llava-hf copy), "
                              "then from-hf --llava")
    projector = hf.get("mm_projector_type", "linear")
    layer = hf.get("mm_vision_select_layer", -1)
    select = hf.get("mm_vision_select_feature", "patch")
    say(f"{llava_dir}: projector {projector}, vision layer {layer}, features {select!r}; "
        f"vision tower was {hf.get('mm_vision_tower')!r}, loading it from {vision_dir}")
    source = read_weights(llava_dir)
    llm_cfg = llama_config({k: v for k, v in hf.items() if not k.startswith("mm_")}, llava_dir)
    shape_cfg = VLMConfig(llm=llm_cfg, projector=projector, vision_layer=layer, vision_select=select,
                          vision=vit_config(read_json(storage.join(vision_dir, "config.json")), vision_dir))
    shapes = expected_shapes(shape_cfg)
    prefix = "model.mm_projector." if any(k.startswith("model.mm_projector.") for k in source) else "mm_projector."
    if all(k.startswith(prefix) for k in source):  # stage-1 output: the projector alone
        if not llm_dir:
            raise ConversionError(f"{llava_dir} holds only the projector (a stage-1 output); pass --llm with the "
                                  f"base LLM it was trained on ({hf.get('_name_or_path', 'see config.json')})")
        llm_state, llm_cfg = llm_from_hf(llm_dir)
        tokenizer_dir = llm_dir
        projector_state = remap(source, projector_table(shape_cfg, prefix), shapes, str(llava_dir))
    else:
        table = llama_table(llm_cfg, "model.", "lm_head.weight") | projector_table(shape_cfg, prefix)
        both = remap(source, table, shapes, str(llava_dir), ignore=(r"^model\.vision_tower\.",))
        llm_state = {k: v for k, v in both.items() if k.startswith("llm.")}
        projector_state = {k: v for k, v in both.items() if k.startswith("projector.")}
        tokenizer_dir = llava_dir if storage.exists(storage.join(llava_dir, "tokenizer.model")) else llm_dir
    return assemble(llm_state, llm_cfg, vision_dir, None, tokenizer_dir, projector, layer, select,
                    projector_state=projector_state, pad_vocab=pad_vocab)


def to_anyres(ckpt_dir, preset, video_token_id=None, seed=0):
    """A checkpoint that tiles images as `preset` does (anyres, grid_pinpoints, <video>) with a fresh image_newline
    (normal, std 1/sqrt(dim), as HF and LLaVA-NeXT initialise it): LLaVA-NeXT and OneVision switch to anyres after
    a stage 1 that saw one view an image."""
    state, cfg = read_checkpoint(ckpt_dir)
    target = vlm_preset(preset)
    if not target.anyres:
        raise ConversionError(f"preset {preset!r} does not tile images (anyres={target.anyres!r})")
    video = target.video_token_id if video_token_id is None else video_token_id
    if video is not None and (video == cfg.image_token_id or not 0 <= video < cfg.llm.vocab_size):
        raise ConversionError(f"<video> id {video} must be a free id below the vocab size {cfg.llm.vocab_size}, not "
                              f"<image>'s {cfg.image_token_id}; pass --video-token-id")
    try:
        cfg = cfg.with_overrides({"anyres": target.anyres, "grid_pinpoints": target.grid_pinpoints,
                                  "video_token_id": video})
    except ValueError as e:
        raise ConversionError(f"{ckpt_dir}: cannot tile as {preset!r}: {e}") from None
    if "image_newline" not in state:
        gen = torch.Generator().manual_seed(seed)
        state["image_newline"] = torch.randn(cfg.llm.dim, generator=gen) * cfg.llm.dim**-0.5
        state["image_newline"] = state["image_newline"].to(state["llm.tok_embeddings.weight"].dtype)
        say(f"initialised a fresh image_newline (normal std {cfg.llm.dim**-0.5:.4f}, seed {seed})")
    shapes = expected_shapes(cfg)
    return check_complete(remap(state, {k: k for k in shapes}, shapes, str(ckpt_dir)), cfg, str(ckpt_dir)), cfg


# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("from-hf", help="an HF VLM (LLaVA, LLaVA-NeXT, OneVision, Idefics3, SmolVLM, InternVL, Gemma 3), "
                                        "or an "
                                        "HF LLM (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, SmolLM3) + a CLIP or "
                                        "SigLIP tower")
    a.add_argument("--llava", help="HF VLM directory: LlavaForConditionalGeneration, LlavaNextForConditionalGeneration, "
                                   "LlavaOnevisionForConditionalGeneration, Idefics3ForConditionalGeneration, "
                                   "SmolVLMForConditionalGeneration, InternVLForConditionalGeneration or "
                                   "Gemma3ForConditionalGeneration (hub, transformers-5 or in-memory key layout)")
    a.add_argument("--llm", help="HF causal LM directory (with --vision), config.json model_type llama (Llama, Vicuna, "
                                 "SmolLM2), mistral, qwen2, qwen3, gemma2, gemma3_text or smollm3")
    a.add_argument("--vision", help="HF vision tower directory (with --llm): CLIP or SigLIP (SigLIP2 at a fixed "
                                    "resolution), a vision model or the whole model (model_type clip_vision_model, "
                                    "clip, siglip_vision_model, siglip), or Idefics3's or SmolVLM's tower "
                                    "(idefics3_vision, smolvlm_vision)")
    a.add_argument("--projector", default="mlp2x_gelu")
    a.add_argument("--vision-layer", type=int, default=-2)
    a.add_argument("--vision-select", default="patch", choices=["patch", "cls_patch"])
    a.add_argument("--pixel-shuffle", type=int, default=1, help="each NxN block of patches one token (nanoVLM: 4)")
    a.add_argument("--vision-post-norm", action="store_true", help="read the tower after its post-LayerNorm")
    a.add_argument("--pool", type=int, default=1, help="each NxN block of patches averaged into one token (Gemma 3: 4)")
    a.add_argument("--attention-blocks", default="", choices=["", "images"],
                   help="'images': each image's tokens see each other both ways (Gemma 3)")
    a.add_argument("--pad-vocab", type=int, default=64, help="pad a grown vocab to a multiple of this")
    a.add_argument("--seed", type=int, default=0, help="seed of the fresh projector")
    a.add_argument("--lora", help="a peft LoRA adapter directory trained on --llava: its adapters come along")
    a.add_argument("--out", required=True)
    b = sub.add_parser("from-llava", help="original haotian-liu/LLaVA checkpoint or stage-1 mm_projector.bin")
    b.add_argument("--llava", required=True)
    b.add_argument("--vision", required=True, help="the CLIP directory its config's mm_vision_tower names")
    b.add_argument("--llm", help="base LLM, needed when --llava holds only mm_projector.bin")
    b.add_argument("--pad-vocab", type=int, default=64)
    b.add_argument("--out", required=True)
    c = sub.add_parser("to-hf", help="our checkpoint -> HF Llava / LlavaNext / LlavaOnevision (hub layout) + processor, "
                                     "or Idefics3 / SmolVLM / InternVL / Gemma 3 + the processor files from-hf read")
    c.add_argument("--ckpt", required=True)
    c.add_argument("--template", choices=TEMPLATE_NAMES, help="default: the training config's")
    c.add_argument("--image-mode", choices=["pad", "crop", "resize"], help="default: the training config's")
    lora = c.add_mutually_exclusive_group()
    lora.add_argument("--merge-lora", action="store_true", help="LoRA adapters merged into plain weights")
    lora.add_argument("--lora-only", action="store_true", help="the LoRA adapters alone, as a peft adapter directory")
    c.add_argument("--out", required=True)
    e = sub.add_parser("consolidate", help="a training step directory (sharded) -> model.safetensors + config.json, "
                                           "one tensor at a time")
    e.add_argument("--ckpt", required=True)
    e.add_argument("--out", required=True)
    d = sub.add_parser("anyres", help="our checkpoint -> the same, tiling images as a LLaVA-NeXT / OneVision preset")
    d.add_argument("--ckpt", required=True)
    d.add_argument("--preset", required=True, choices=["llava-next-vicuna-7b", "llava-next-mistral-7b",
                                                       "llava-onevision-qwen2-7b", "llava-onevision-qwen2-0.5b"])
    d.add_argument("--video-token-id", type=int, help="default: the preset's (OneVision: 151647)")
    d.add_argument("--seed", type=int, default=0, help="seed of the fresh image_newline")
    d.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "from-hf" and args.lora and not args.llava:
        p.error("from-hf --lora needs --llava, the HF model the adapter was trained on")
    try:
        for url in [getattr(args, n, None) for n in ("llava", "llm", "vision", "lora", "ckpt", "out")]:
            if storage.is_url(url or ""):
                storage.check_key(url)  # before anything is read or written
        if args.cmd == "to-hf" and args.lora_only:
            out = lora_to_peft(args.ckpt, args.out)
        elif args.cmd == "to-hf":
            out = llava_to_hf(args.ckpt, args.out, args.template, args.image_mode, args.merge_lora)
        elif args.cmd == "consolidate":
            state, cfg = read_checkpoint(args.ckpt, lazy=True)
            out = save_checkpoint(state, cfg, args.out, args.ckpt)
        else:
            if args.cmd == "anyres":
                state, cfg = to_anyres(args.ckpt, args.preset, args.video_token_id, args.seed)
                tokenizer_dir = args.ckpt
            elif args.cmd == "from-llava":
                state, cfg = from_llava(args.llava, args.vision, args.llm, args.pad_vocab)
                tokenizer_dir = args.llava if storage.exists(storage.join(args.llava, "tokenizer.model")) else args.llm
            elif args.llava:
                state, cfg = llava_from_hf(args.llava)
                if args.lora:
                    state, cfg = lora_from_peft(args.lora, state, cfg)
                tokenizer_dir = args.llava
            elif args.llm and args.vision:
                state, cfg = from_hf_parts(args.llm, args.vision, args.projector, args.vision_layer,
                                           args.vision_select, args.pad_vocab, args.seed,
                                           {"pixel_shuffle": args.pixel_shuffle, "vision_post_norm": args.vision_post_norm,
                                            "pool": args.pool, "attention_blocks": args.attention_blocks})
                tokenizer_dir = args.llm
            else:
                p.error("from-hf needs --llava, or both --llm and --vision")
            out = save_checkpoint(state, cfg, args.out, tokenizer_dir)
    except (ConversionError, ExportError, storage.StorageError) as e:
        sys.exit(f"convert: error: {e}")
    n = sum(t.numel() for t in state.values()) if args.cmd != "to-hf" else None
    say(f"wrote {out}" + (f" ({n / 1e6:.1f}M parameters)" if n else ""))


if __name__ == "__main__":
    main()
