"""
Hugging Face config.json <-> llavax's config dataclasses: the LLaMA / Mistral / Qwen2 text configs, the CLIP /
SigLIP vision configs, and the LLaVA / LLaVA-NeXT / OneVision configs around them. Missing fields take
transformers' class defaults, as from_pretrained does; an architecture llavax does not implement is refused with
one sentence.

Split from convert.py (weights and formats) along the seam between reading configs and moving tensors: these are
pure functions of dicts, where every HF config field name lives.
"""

import json
import math
import re
from dataclasses import replace

import storage
from model_config import VIT_ACTIVATIONS, LlamaConfig, ViTConfig, VLMConfig, vlm_preset
from weight_files import ConversionError, say

LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6,
                      max_position_embeddings=2048, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False, hidden_act="silu")
CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     image_size=224, patch_size=32, layer_norm_eps=1e-5, hidden_act="quick_gelu")
SIGLIP_DEFAULTS = CLIP_DEFAULTS | dict(patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
# the LLM families we convert; original LLaVA / LLaVA-NeXT name them llava_llama, llava_mistral, llava_qwen
LLM_TYPES = {None: "llama", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "llava": "llama",
             "llava_llama": "llama", "llava_mistral": "mistral", "llava_qwen": "qwen2"}
VISION_TYPES = {None: "clip", "clip_vision_model": "clip", "clip": "clip", "siglip_vision_model": "siglip",
                "siglip": "siglip", "idefics3_vision": "siglip", "smolvlm_vision": "siglip"}
# Idefics3's and SmolVLM's SigLIP (SmolVLMVisionConfig's defaults: the so400m width, 12 layers, 32 px patches)
IDEFICS3_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                                image_size=224, patch_size=32, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "llama3")  # what model.rope_frequencies implements


def llama_config(hf, where):
    if hf.get("model_type") in FAMILIES:
        return family_config(hf, where)
    family = LLM_TYPES.get(hf.get("model_type"))
    if family is None:
        raise ConversionError(f"{where}: LLM model_type {hf.get('model_type')!r} is not supported; llavax converts "
                              f"{', '.join(sorted(set(LLM_TYPES.values()) | set(FAMILIES)))} decoders")
    c = LLAMA_DEFAULTS | {k: v for k, v in hf.items() if v is not None}
    rope = dict(c.get("rope_parameters") or {})  # transformers 5 folds rope_theta/rope_scaling in here
    theta = rope.pop("rope_theta", c["rope_theta"])
    scaling = rope if rope.get("rope_type", "default") != "default" else c["rope_scaling"]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConversionError(f"{where}: rope scaling type {kind!r} is not implemented (llavax has "
                              f"{', '.join(ROPE_TYPES)}); converting it would give different logits")
    qwen = family == "qwen2"
    if c["hidden_act"] != "silu" or c["mlp_bias"] or (c["attention_bias"] and not qwen):
        raise ConversionError(f"{where}: unsupported LLaMA variant (hidden_act={c['hidden_act']}, "
                              f"mlp_bias={c['mlp_bias']}, attention_bias={c['attention_bias']})")
    window, window_layers = sliding_window(hf, family, c["num_hidden_layers"])
    return LlamaConfig(vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
                       n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                       ffn_dim=c["intermediate_size"], norm_eps=c["rms_norm_eps"], rope_theta=float(theta),
                       rope_scaling=scaling, max_seq_len=c["max_position_embeddings"], qkv_bias=qwen,
                       tie_embeddings=c["tie_word_embeddings"], sliding_window=window, sliding_layers=window_layers)


# the newer families, read through transformers' own config class (its defaults, its legacy fields, its derived
# layer_types and per-layer RoPE), then mapped onto LlamaConfig's switches. Fields that cannot change the numbers:
HARMLESS = {"_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
            "transformers_version", "use_cache", "initializer_range", "attention_dropout", "chunk_size_feed_forward",
            "id2label", "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type",
            "return_dict", "max_window_layers", "use_sliding_window", "no_rope_layer_interval", "_sliding_window_pattern",
            "cache_implementation", "model_type"}
READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
        "tie_word_embeddings", "layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
        "final_logit_softcapping", "no_rope_layers", "hidden_act", "hidden_activation"}
FAMILIES = {"qwen3": "silu", "gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh", "smollm3": "silu"}


def family_config(hf, where):
    """Qwen3, Gemma 2, Gemma 3 (text) and SmolLM3 as transformers reads their config.json; a field llavax does not
    implement that is not at its default (an o_proj bias, bidirectional attention, a RoPE it lacks) is refused."""
    from transformers import AutoConfig

    kind = hf["model_type"]
    given = {k: v for k, v in hf.items() if k != "model_type"}
    try:
        t, default = AutoConfig.for_model(kind, **given).to_dict(), AutoConfig.for_model(kind).to_dict()
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{where}: transformers refuses this {kind} config ({' '.join(str(e).split())[:200]})") \
            from None
    odd = sorted(k for k in t if k not in READ | HARMLESS and t[k] != default.get(k))
    if odd:
        raise ConversionError(f"{where}: {kind} config field(s) {', '.join(f'{k}={t[k]!r}' for k in odd)} change the "
                              f"numbers and llavax does not implement them")
    act = t.get("hidden_activation") or t.get("hidden_act")
    if act != FAMILIES[kind]:
        raise ConversionError(f"{where}: {kind} with hidden activation {act!r} is not implemented (llavax has "
                              f"{FAMILIES[kind]!r} for it)")
    gemma = kind.startswith("gemma")
    rope = t["rope_parameters"]
    full, local = (rope["full_attention"], rope["sliding_attention"]) if "full_attention" in rope else (rope, None)
    for kind_rope in (full, local):
        if kind_rope and kind_rope.get("rope_type", "default") not in ROPE_TYPES:
            raise ConversionError(f"{where}: rope type {kind_rope['rope_type']!r} is not implemented (llavax has "
                                  f"{', '.join(ROPE_TYPES)}); converting it would give different logits")
    if local and local.get("rope_type", "default") != "default":
        raise ConversionError(f"{where}: scaled RoPE in the sliding-window layers is not implemented")
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    scaling = scaling if scaling.get("rope_type", "default") != "default" else None
    # the sliding layers' own tables only where they differ from the global ones
    local_theta = local and (local["rope_theta"] != full["rope_theta"] or scaling) and float(local["rope_theta"])
    windowed = [i for i, kind_of in enumerate(t["layer_types"]) if kind_of == "sliding_attention"]
    window = t["sliding_window"] if windowed and t.get("sliding_window") else None
    unroped = [i for i, has in enumerate(t.get("no_rope_layers") or []) if not has]
    n_layers = t["num_hidden_layers"]
    return LlamaConfig(
        vocab_size=t["vocab_size"], dim=t["hidden_size"], n_layers=n_layers, n_heads=t["num_attention_heads"],
        n_kv_heads=t["num_key_value_heads"], head_dim=t.get("head_dim"), ffn_dim=t["intermediate_size"],
        norm_eps=t["rms_norm_eps"], rope_theta=float(full["rope_theta"]),
        rope_scaling=scaling,
        max_seq_len=t["max_position_embeddings"], tie_embeddings=t["tie_word_embeddings"],
        sliding_window=window, sliding_layers=(windowed if len(windowed) < n_layers else None) if window else None,
        qk_norm=kind in ("qwen3", "gemma3_text"), norm_offset=1.0 if gemma else 0.0, sandwich_norms=gemma,
        mlp_act="gelu_tanh" if gemma else "silu", embed_scale=gemma,
        query_scale=t["query_pre_attn_scalar"] ** -0.5 if gemma else None,
        # transformers' Gemma 3 attention never reads attn_logit_softcapping: neither do we
        attn_softcap=t.get("attn_logit_softcapping") if kind == "gemma2" else None,
        final_softcap=t.get("final_logit_softcapping"),
        local_rope_theta=local_theta or None,
        no_rope_layers=unroped or None)


def family_of(cfg: LlamaConfig):
    """The HF model_type whose decoder cfg is, from its switches."""
    if cfg.norm_offset:
        return "gemma3_text" if cfg.qk_norm else "gemma2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.no_rope_layers:
        return "smollm3"
    return "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window and cfg.sliding_layers is None else "llama"


def family_hf_config(cfg: LlamaConfig, kind):
    """config.json's text fields for a decoder of the newer families (family_config's inverse)."""
    gemma = kind.startswith("gemma")
    types = ["sliding_attention" if cfg.sliding_window and (cfg.sliding_layers is None or i in cfg.sliding_layers)
             else "full_attention" for i in range(cfg.n_layers)]
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    out = dict(model_type=kind, vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len,
               tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, layer_types=types,
               sliding_window=cfg.sliding_window, rope_parameters=full)
    if gemma:
        scalar = round(cfg.query_scale**-2, 6)
        out |= dict(hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=cfg.final_softcap,
                    query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar)
        out["attn_logit_softcapping"] = cfg.attn_softcap if kind == "gemma2" else None
        if kind == "gemma3_text":
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}}
    else:
        out |= dict(hidden_act="silu", use_sliding_window=cfg.sliding_window is not None)
    if kind == "smollm3":  # its class's special ids (128000, 128001, 128004), where the vocabulary holds them
        ids = {"bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004}
        out |= {k: v if v < cfg.vocab_size else None for k, v in ids.items()}
        out |= dict(mlp_bias=False, no_rope_layers=[int(i not in cfg.no_rope_layers) for i in range(cfg.n_layers)])
    return out


def sliding_window(hf, family, n_layers):
    """(window, layers using it) as transformers reads them: Mistral windows every layer (4096 when the field is
    absent); Qwen2 only with use_sliding_window, in the layers that layer_types marks, by default those from
    max_window_layers on. Llama has none."""
    if family == "mistral":
        return hf.get("sliding_window", 4096), None
    if family != "qwen2" or not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None, None
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
                                      for i in range(n_layers)]
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return (hf["sliding_window"], layers) if layers else (None, None)


NAFLEX = ("; SigLIP2's NaFlex tower (siglip2) takes a variable number of patches with its own position interpolation "
          "and attention mask, which no transformers LLaVA class feeds: use a fixed-resolution SigLIP2 (google/siglip2-"
          "*-patchN-R, a SiglipModel), or add a tower input of (patches, mask, shapes) and a NaFlex processor")


def vit_config(hf, where="vision config"):
    c = hf.get("vision_config", hf)  # a CLIPModel / SiglipModel config nests the tower
    kind = VISION_TYPES.get(c.get("model_type"))
    if kind is None:
        raise ConversionError(f"{where}: vision tower model_type {c.get('model_type')!r} is not supported; llavax has "
                              "CLIP and SigLIP towers" + (NAFLEX if c.get("model_type", "").startswith("siglip2") else ""))
    idefics3 = c.get("model_type") in ("idefics3_vision", "smolvlm_vision")
    c = (CLIP_DEFAULTS if kind == "clip" else IDEFICS3_VISION_DEFAULTS if idefics3 else SIGLIP_DEFAULTS) | c
    if c["hidden_act"] not in VIT_ACTIVATIONS:
        raise ConversionError(f"{where}: vision hidden_act {c['hidden_act']!r} is not implemented (llavax has "
                              f"{', '.join(VIT_ACTIVATIONS)})")
    if c.get("num_channels", 3) != 3:
        raise ConversionError(f"{where}: a vision tower of {c['num_channels']} input channels; llavax reads RGB (3)")
    return ViTConfig(image_size=c["image_size"], patch_size=c["patch_size"], dim=c["hidden_size"],
                     n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"], ffn_dim=c["intermediate_size"],
                     norm_eps=c["layer_norm_eps"], act=c["hidden_act"], kind=kind)


def llama_hf_config(cfg: LlamaConfig):
    if (kind := family_of(cfg)) in FAMILIES:
        return family_hf_config(cfg, kind)
    out = dict(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len,
               tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})})
    if cfg.qkv_bias:
        out |= dict(model_type="qwen2", attention_bias=True, use_sliding_window=cfg.sliding_window is not None,
                    sliding_window=cfg.sliding_window)
        if cfg.sliding_window:
            layers = range(cfg.n_layers) if cfg.sliding_layers is None else cfg.sliding_layers
            out["layer_types"] = ["sliding_attention" if i in layers else "full_attention" for i in range(cfg.n_layers)]
    elif cfg.sliding_window:
        if cfg.sliding_layers is not None:
            raise ConversionError("a LLaMA-style LLM with sliding windows in some layers only has no HF config")
        out |= dict(model_type="mistral", sliding_window=cfg.sliding_window)
    return out


def vit_hf_config(v: ViTConfig):
    out = dict(model_type=f"{v.kind}_vision_model", hidden_size=v.dim, intermediate_size=v.ffn_dim,
               num_hidden_layers=v.n_layers, num_attention_heads=v.n_heads, image_size=v.image_size,
               patch_size=v.patch_size, layer_norm_eps=v.norm_eps, hidden_act=v.act, num_channels=3)
    return out | ({"vision_use_head": False} if v.kind == "siglip" else {})


# one view per image (LLaVA-1.5), anyres tiles + newline (LLaVA-NeXT), anyres_max_N + multi-image + video (OneVision);
# the pixel-shuffle connectors: Idefics3 / SmolVLM (SigLIP after its post-LayerNorm, one bias-free Linear) and InternVL
# (InternViT, a LayerNorm-MLP)
HF_ARCHITECTURES = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
                    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
                    "idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration",
                    "internvl": "InternVLForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}
LLAVA_TYPES = ("llava", "llava_next", "llava_onevision")


def hf_model_type(cfg: VLMConfig):
    """The HF model_type that computes what cfg does, or a ConversionError naming the switch no HF class holds."""
    if cfg.vision.kind == "internvit" or cfg.projector.startswith("ln_"):
        return check_family(cfg, "internvl", vision=("internvit", cfg.vision.kind), projector=("ln_mlp2x_gelu",
                            cfg.projector), vision_select=("patch", cfg.vision_select),
                            vision_post_norm=(cfg.vision.post_norm and cfg.vision_layer == -1, cfg.vision_post_norm))
    if cfg.pool > 1 or cfg.projector == "rms_linear_nobias" or cfg.attention_blocks:
        return check_family(cfg, "gemma3", vision=("siglip", cfg.vision.kind), projector=("rms_linear_nobias",
                            cfg.projector), vision_layer=(-1, cfg.vision_layer), vision_select=("cls_patch",
                            cfg.vision_select), vision_post_norm=(True, cfg.vision_post_norm), attention_blocks=(
                            "images", cfg.attention_blocks), decoder=("gemma3_text", family_of(cfg.llm)))
    if cfg.projector == "linear_nobias" or cfg.vision_post_norm or cfg.pixel_shuffle > 1:
        return check_family(cfg, cfg.export_as or "smolvlm", vision=("siglip", cfg.vision.kind),
                            projector=("linear_nobias", cfg.projector), vision_layer=(-1, cfg.vision_layer),
                            vision_select=("cls_patch", cfg.vision_select), vision_post_norm=(True, cfg.vision_post_norm))
    if cfg.anyres.startswith("anyres_max_"):
        if cfg.video_token_id is None:
            raise ConversionError("HF LlavaOnevisionForConditionalGeneration needs a <video> id: set video_token_id")
        return "llava_onevision"
    if cfg.video_token_id is not None:
        raise ConversionError(f"video_token_id is set but anyres is {cfg.anyres!r}: only LLaVA-OneVision "
                              "(anyres_max_N) holds video in transformers")
    return {"": "llava", "anyres": "llava_next"}[cfg.anyres]


def check_family(cfg: VLMConfig, kind, **wanted):
    """kind, if cfg's switches are what HF's class of that kind computes ({switch: (its value, cfg's)}); no LLaVA
    class reads any other tower kind, and none of these three holds a LoRA-free reward head or tiles (yet)."""
    odd = [f"{name}={have!r} (it needs {want!r})" for name, (want, have) in wanted.items() if want != have]
    if cfg.anyres or cfg.video_token_id is not None or cfg.reward_head:
        odd.append("anyres, video or a reward head")
    if odd:
        raise ConversionError(f"no HF class computes this config: {HF_ARCHITECTURES[kind]} differs in "
                              + ", ".join(odd))
    return kind


def llava_hf_config(cfg: VLMConfig):
    kind = hf_model_type(cfg)
    if kind == "internvl":
        return internvl_hf_config(cfg)
    if kind in ("idefics3", "smolvlm"):
        return idefics3_hf_config(cfg, kind)
    if kind == "gemma3":
        return gemma3_hf_config(cfg)
    if cfg.llm.final_softcap:
        say(f"final_softcap={cfg.llm.final_softcap:g}: transformers' {HF_ARCHITECTURES[kind]} does not soft-cap the "
            f"logits, so the export's logits are uncapped (the greedy tokens are the same)")
    out = {"architectures": [HF_ARCHITECTURES[kind]], "model_type": kind, "image_token_index": cfg.image_token_id,
           "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
           "vision_feature_layer": cfg.vision_layer,
           "vision_feature_select_strategy": "default" if cfg.vision_select == "patch" else "full",
           "tie_word_embeddings": cfg.llm.tie_embeddings, "text_config": llama_hf_config(cfg.llm),
           "vision_config": vit_hf_config(cfg.vision)}
    if kind != "llava_onevision":  # tokens of one view; LlavaOnevisionConfig has no such field
        out["image_seq_length"] = cfg.n_image_tokens
    if kind != "llava":
        out["image_grid_pinpoints"] = [list(p) for p in cfg.grid_pinpoints]
    if kind == "llava_onevision":
        out |= {"vision_aspect_ratio": cfg.anyres, "video_token_index": cfg.video_token_id}
    return out


def anyres_from_hf(hf, kind, where):
    """(anyres, grid_pinpoints, video_token_id) of an HF config; absent fields take transformers' class defaults,
    which our presets of the same models hold."""
    if kind == "llava":
        return "", None, None
    default = vlm_preset("llava-next-vicuna-7b" if kind == "llava_next" else "llava-onevision-qwen2-7b")
    pinpoints = hf.get("image_grid_pinpoints", default.grid_pinpoints)  # [] or null is refused, not replaced
    if not (isinstance(pinpoints, list) and pinpoints and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and x > 0 for x in p)
            for p in pinpoints)):
        raise ConversionError(f"{where}: image_grid_pinpoints must be a list of [height, width] pixel pairs, "
                              f"got {pinpoints!r}")
    if kind == "llava_next":
        return "anyres", [list(p) for p in pinpoints], None
    anyres = hf.get("vision_aspect_ratio", default.anyres)
    if not re.fullmatch(r"anyres_max_[1-9]\d*", str(anyres)):
        raise ConversionError(f"{where}: vision_aspect_ratio {anyres!r} is not supported; transformers' OneVision "
                              "reads only 'anyres_max_N' (the tile budget N)")
    video = hf.get("video_token_index", hf.get("video_token_id", default.video_token_id))
    return anyres, [list(p) for p in pinpoints], video


def read_json(path):
    try:
        return json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: malformed JSON ({e})") from None


def llava_config(hf, hf_dir):
    """The VLMConfig of an HF LLaVA / LLaVA-NeXT / OneVision config.json (a dict)."""
    kind = hf.get("model_type", "llava")
    if kind in ("smolvlm", "idefics3"):
        return idefics3_config(hf, hf_dir)
    if kind == "internvl":
        return internvl_config(hf, hf_dir)
    if kind == "gemma3":
        return gemma3_config(hf, hf_dir)
    if kind not in HF_ARCHITECTURES:
        raise ConversionError(f"{hf_dir}: model_type {kind!r} is not supported; llavax converts "
                              + ", ".join(f"{v} ({k!r})" for k, v in HF_ARCHITECTURES.items()) + " directories")
    if hf.get("projector_hidden_act", "gelu") != "gelu" or not hf.get("multimodal_projector_bias", True):
        act, bias = hf.get("projector_hidden_act"), hf.get("multimodal_projector_bias")
        raise ConversionError(f"{hf_dir}: unsupported projector (projector_hidden_act={act}, bias={bias})")
    tied = hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", False))
    llm = llama_config(hf.get("text_config", {}) | {"tie_word_embeddings": tied}, hf_dir)
    if llm.final_softcap:  # read as transformers runs it: its LLaVA classes never soft-cap the logits
        say(f"{hf_dir}: final_logit_softcapping={llm.final_softcap:g} is not applied, as transformers' "
            f"{HF_ARCHITECTURES[kind]} does not apply it")
        llm = replace(llm, final_softcap=None)
    onevision = kind == "llava_onevision"  # its class defaults differ: layer -1, "full", <image> 151646
    select = hf.get("vision_feature_select_strategy", "full" if onevision else "default")
    if select not in ("default", "full"):
        raise ConversionError(f"{hf_dir}: vision_feature_select_strategy {select!r} is not 'default' or 'full'")
    anyres, pinpoints, video = anyres_from_hf(hf, kind, hf_dir)
    vision = vit_config(hf.get("vision_config", {}), f"{hf_dir} vision_config")
    try:
        cfg = VLMConfig(vision=vision, llm=llm, projector="mlp2x_gelu",
                        vision_layer=hf.get("vision_feature_layer", -1 if onevision else -2),
                        vision_select={"default": "patch", "full": "cls_patch"}[select],
                        image_token_id=hf.get("image_token_index", hf.get("image_token_id",
                                                                          151646 if onevision else 32000)),
                        anyres=anyres, grid_pinpoints=pinpoints, video_token_id=video)
    except ValueError as e:
        raise ConversionError(f"{hf_dir}: {e}") from None
    return cfg


# -----------------------------------------------------------------------------
# the pixel-shuffle families, read through transformers' own config classes (their defaults and sub-configs): a field
# not listed as read or harmless that is not at its default changes the numbers and is refused by name

# ... and the published configs' fields their models never read: a top-level vocab_size (the text config's is the
# one used), the training-time drop path and dropout of InternViT's original config
VLM_HARMLESS = HARMLESS | {"vision_config", "text_config", "image_seq_length", "pad_token_id", "_pad_token_id",
                           "output_hidden_states", "return_dict", "tokenizer_class", "prefix", "sep_token_id",
                           "decoder_start_token_id", "task_specific_params", "tf_legacy_loss", "use_bfloat16",
                           "torchscript", "pruned_heads", "tie_encoder_decoder", "chunk_size_feed_forward",
                           "vocab_size", "drop_path_rate", "dropout"}


def transformers_config(hf, kind, where):
    """(config dict with every default filled, the class defaults) of a model_type transformers knows."""
    from transformers import AutoConfig

    given = {k: v for k, v in hf.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(kind, **given).to_dict(), AutoConfig.for_model(kind).to_dict()
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{where}: transformers refuses this {kind} config ({' '.join(str(e).split())[:200]})") \
            from None


def refuse_unread(t, default, read, where, what):
    odd = sorted(k for k in t if k not in read | VLM_HARMLESS and t[k] != default.get(k))
    if odd:
        raise ConversionError(f"{where}: {what} field(s) {', '.join(f'{k}={t[k]!r}' for k in odd)} change the numbers "
                              f"and llavax does not implement them")


def text_of(t, where):
    """The decoder's LlamaConfig: the top level's tie_word_embeddings is the one transformers ties by."""
    text = {k: v for k, v in t["text_config"].items() if v is not None} | {"tie_word_embeddings": t["tie_word_embeddings"]}
    return llama_config(text, f"{where} text_config")


def idefics3_config(hf, where):
    """Idefics3 / SmolVLM (one image, no splitting): SigLIP read after its post-LayerNorm, pixel shuffle by
    scale_factor, one bias-free Linear; the decoder a Llama (SmolLM2, Llama 3)."""
    kind = hf["model_type"]
    t, default = transformers_config(hf, kind, where)
    refuse_unread(t, default, {"scale_factor", "image_token_id", "tie_word_embeddings"}, where, kind)
    vision = vit_config(t["vision_config"], f"{where} vision_config")
    try:
        return VLMConfig(vision=vision, llm=text_of(t, where), projector="linear_nobias", vision_layer=-1,
                         vision_select="cls_patch", vision_post_norm=True, pixel_shuffle=t["scale_factor"],
                         image_token_id=t["image_token_id"], export_as=kind)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None


def idefics3_hf_config(cfg: VLMConfig, kind):
    v = cfg.vision
    vision = dict(model_type=f"{kind}_vision", hidden_size=v.dim, intermediate_size=v.ffn_dim, num_hidden_layers=v.n_layers,
                  num_attention_heads=v.n_heads, image_size=v.image_size, patch_size=v.patch_size,
                  layer_norm_eps=v.norm_eps, hidden_act=v.act, num_channels=3)
    return {"architectures": [HF_ARCHITECTURES[kind]], "model_type": kind, "image_token_id": cfg.image_token_id,
            "scale_factor": cfg.pixel_shuffle, "tie_word_embeddings": cfg.llm.tie_embeddings,
            "text_config": llama_hf_config(cfg.llm), "vision_config": vision}


# InternVLVisionConfig's fields llavax reads; the 6B's RMSNorm and q/k norm, a mask token and relative positions are not
INTERNVIT_READ = {"hidden_size", "num_hidden_layers", "num_attention_heads", "attention_bias", "intermediate_size",
                  "hidden_act", "layer_norm_eps", "image_size", "patch_size", "use_mean_pooling", "num_channels",
                  "hidden_dropout_prob", "attention_dropout", "projection_dropout", "layer_scale_init_value"}


def internvl_config(hf, where):
    """InternVL 3 / 3.5 (one 448 px tile): InternViT-300M, pixel shuffle by 1 / downsample_ratio, LayerNorm -> Linear
    -> GELU -> Linear; the decoder a Qwen2.5 or Qwen3."""
    t, default = transformers_config(hf, "internvl", where)
    refuse_unread(t, default, {"downsample_ratio", "image_token_id", "tie_word_embeddings", "vision_feature_layer",
                               "projector_hidden_act", "vision_feature_select_strategy"}, where, "internvl")
    v, v_default = t["vision_config"], default["vision_config"]
    refuse_unread(v, v_default, INTERNVIT_READ, f"{where} vision_config",
                  "internvl_vision (the 6B's RMSNorm and q/k norm are not implemented)")
    side, patch = ((v[k], v[k]) if isinstance(v[k], int) else tuple(v[k]) for k in ("image_size", "patch_size"))
    ratio = 1 / t["downsample_ratio"]
    fine = {"projector_hidden_act": t["projector_hidden_act"] == "gelu",
            "vision_feature_select_strategy": t["vision_feature_select_strategy"] == "default",
            "vision_feature_layer": isinstance(t["vision_feature_layer"], int),
            "downsample_ratio": abs(ratio - round(ratio)) < 1e-9}
    odd = {k: t[k] for k, ok in fine.items() if not ok}
    fine = {"image_size": side[0] == side[1], "patch_size": patch[0] == patch[1], "hidden_act": v["hidden_act"] in
            VIT_ACTIVATIONS}
    odd |= {k: v[k] for k, ok in fine.items() if not ok}
    if odd:
        raise ConversionError(f"{where}: internvl field(s) {', '.join(f'{k}={x!r}' for k, x in odd.items())} are "
                              f"not implemented (llavax has a GELU projector over the patch tokens, one feature layer, "
                              f"a pixel shuffle by an integer, square tiles)")
    vision = ViTConfig(image_size=side[0], patch_size=patch[0], dim=v["hidden_size"], n_layers=v["num_hidden_layers"],
                       n_heads=v["num_attention_heads"], ffn_dim=v["intermediate_size"], norm_eps=v["layer_norm_eps"],
                       act=v["hidden_act"], kind="internvit", qkv_bias=v["attention_bias"],
                       post_norm=not v["use_mean_pooling"])
    try:
        return VLMConfig(vision=vision, llm=text_of(t, where), projector="ln_mlp2x_gelu",
                         vision_layer=t["vision_feature_layer"], vision_select="patch",
                         vision_post_norm=vision.post_norm and t["vision_feature_layer"] == -1,
                         pixel_shuffle=round(ratio), image_token_id=t["image_token_id"])
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None


def internvl_hf_config(cfg: VLMConfig):
    v = cfg.vision
    vision = dict(model_type="internvl_vision", hidden_size=v.dim, num_hidden_layers=v.n_layers,
                  num_attention_heads=v.n_heads, attention_bias=v.qkv_bias, use_qk_norm=False,
                  intermediate_size=v.ffn_dim, hidden_act=v.act, norm_type="layer_norm", layer_norm_eps=v.norm_eps,
                  image_size=[v.image_size, v.image_size], patch_size=[v.patch_size, v.patch_size],
                  use_mean_pooling=not v.post_norm, use_absolute_position_embeddings=True, use_mask_token=False)
    return {"architectures": [HF_ARCHITECTURES["internvl"]], "model_type": "internvl",
            "image_token_id": cfg.image_token_id, "image_seq_length": cfg.n_image_tokens,
            "downsample_ratio": 1 / cfg.pixel_shuffle, "projector_hidden_act": "gelu",
            "vision_feature_layer": cfg.vision_layer, "vision_feature_select_strategy": "default",
            "tie_word_embeddings": cfg.llm.tie_embeddings, "text_config": llama_hf_config(cfg.llm),
            "vision_config": vision}


def gemma3_config(hf, where):
    """Gemma 3 (one 896 px image a view): SigLIP read after its post-LayerNorm, its square patch map averaged in blocks
    down to mm_tokens_per_image tokens, Gemma's RMSNorm (1 + w) and one bias-free matrix; each image's run of tokens
    sees itself both ways (HF: token_type_ids 1). The <start_of_image> / <end_of_image> ids are the processor's."""
    t, default = transformers_config(hf, "gemma3", where)
    refuse_unread(t, default, {"mm_tokens_per_image", "image_token_index", "tie_word_embeddings", "boi_token_index",
                               "eoi_token_index"}, where, "gemma3")
    vision = vit_config(t["vision_config"], f"{where} vision_config")
    side, per_side = vision.image_size // vision.patch_size, math.isqrt(t["mm_tokens_per_image"])
    if per_side**2 != t["mm_tokens_per_image"] or side % per_side:
        raise ConversionError(f"{where}: mm_tokens_per_image={t['mm_tokens_per_image']} is not a square whose side "
                              f"divides the tower's {side} x {side} patch map (Gemma 3 average-pools it)")
    llm = text_of(t, where)
    if llm.final_softcap:  # transformers' Gemma3ForConditionalGeneration never soft-caps its logits
        say(f"{where}: final_logit_softcapping={llm.final_softcap:g} is not applied, as transformers' "
            f"{HF_ARCHITECTURES['gemma3']} does not apply it")
        llm = replace(llm, final_softcap=None)
    try:
        return VLMConfig(vision=vision, llm=llm, projector="rms_linear_nobias", vision_layer=-1,
                         vision_select="cls_patch", vision_post_norm=True, pool=side // per_side,
                         image_token_id=t["image_token_index"], attention_blocks="images")
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None


def gemma3_hf_config(cfg: VLMConfig):
    return {"architectures": [HF_ARCHITECTURES["gemma3"]], "model_type": "gemma3",
            "image_token_index": cfg.image_token_id, "mm_tokens_per_image": cfg.n_image_tokens,
            "tie_word_embeddings": cfg.llm.tie_embeddings, "text_config": llama_hf_config(cfg.llm),
            "vision_config": vit_hf_config(cfg.vision)}
