"""
Hugging Face config.json <-> llavax's config dataclasses: the LLaMA / Mistral / Qwen2 text configs, the CLIP /
SigLIP vision configs, and the LLaVA / LLaVA-NeXT / OneVision configs around them. Missing fields take
transformers' class defaults, as from_pretrained does; an architecture llavax does not implement is refused with
one sentence.

Split from convert.py (weights and formats) along the seam between reading configs and moving tensors: these are
pure functions of dicts, where every HF config field name lives.
"""

import json
import re

import storage
from model_config import VIT_ACTIVATIONS, LlamaConfig, ViTConfig, VLMConfig, vlm_preset
from weight_files import ConversionError

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
                "siglip": "siglip"}
ROPE_TYPES = ("default", "linear", "llama3")  # what model.rope_frequencies implements


def llama_config(hf, where):
    family = LLM_TYPES.get(hf.get("model_type"))
    if family is None:
        raise ConversionError(f"{where}: LLM model_type {hf.get('model_type')!r} is not supported; llavax converts "
                              "llama, mistral and qwen2 decoders")
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


def vit_config(hf, where="vision config"):
    c = hf.get("vision_config", hf)  # a CLIPModel / SiglipModel config nests the tower
    kind = VISION_TYPES.get(c.get("model_type"))
    if kind is None:
        raise ConversionError(f"{where}: vision tower model_type {c.get('model_type')!r} is not supported; llavax has "
                              "CLIP and SigLIP towers (SigLIP2's NaFlex towers are siglip2_vision_model: not supported)")
    c = (CLIP_DEFAULTS if kind == "clip" else SIGLIP_DEFAULTS) | c
    if c["hidden_act"] not in VIT_ACTIVATIONS:
        raise ConversionError(f"{where}: vision hidden_act {c['hidden_act']!r} is not implemented (llavax has "
                              f"{', '.join(VIT_ACTIVATIONS)})")
    return ViTConfig(image_size=c["image_size"], patch_size=c["patch_size"], dim=c["hidden_size"],
                     n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"], ffn_dim=c["intermediate_size"],
                     norm_eps=c["layer_norm_eps"], act=c["hidden_act"], kind=kind)


def llama_hf_config(cfg: LlamaConfig):
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


# one view per image (LLaVA-1.5), anyres tiles + newline (LLaVA-NeXT), anyres_max_N + multi-image + video (OneVision)
HF_ARCHITECTURES = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
                    "llava_onevision": "LlavaOnevisionForConditionalGeneration"}


def hf_model_type(cfg: VLMConfig):
    if cfg.anyres.startswith("anyres_max_"):
        if cfg.video_token_id is None:
            raise ConversionError("HF LlavaOnevisionForConditionalGeneration needs a <video> id: set video_token_id")
        return "llava_onevision"
    if cfg.video_token_id is not None:
        raise ConversionError(f"video_token_id is set but anyres is {cfg.anyres!r}: only LLaVA-OneVision "
                              "(anyres_max_N) holds video in transformers")
    return {"": "llava", "anyres": "llava_next"}[cfg.anyres]


def llava_hf_config(cfg: VLMConfig):
    kind = hf_model_type(cfg)
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
    if kind not in HF_ARCHITECTURES:
        raise ConversionError(f"{hf_dir}: model_type {kind!r} is not supported; llavax converts "
                              + ", ".join(f"{v} ({k!r})" for k, v in HF_ARCHITECTURES.items()) + " directories")
    if hf.get("projector_hidden_act", "gelu") != "gelu" or not hf.get("multimodal_projector_bias", True):
        act, bias = hf.get("projector_hidden_act"), hf.get("multimodal_projector_bias")
        raise ConversionError(f"{hf_dir}: unsupported projector (projector_hidden_act={act}, bias={bias})")
    tied = hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", False))
    llm = llama_config(hf.get("text_config", {}) | {"tie_word_embeddings": tied}, hf_dir)
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
