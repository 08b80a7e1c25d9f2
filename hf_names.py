"""
The tensor-name tables convert.py converts by: our name -> Hugging Face's (transformers 5 layout, and the older
`language_model.model.*` / `vision_tower.*` keys it still reads) for the ViT, LLaMA and the projector, each tensor's
expected shape, and the remap that consumes every source key or says which did not fit. Split from convert.py (over
its budget), which re-exports every name; hf_config.py is the same for config.json's fields.
"""

import math
import re
from dataclasses import replace

import torch

import storage
from hf_config import HF_ARCHITECTURES, LLAVA_TYPES, hf_model_type, llava_config, read_json
from model import VLM
from model_config import LlamaConfig, ViTConfig, VLMConfig, projector_depth
from weight_files import ConversionError, read_weights, say


def vit_table(cfg: ViTConfig, prefix):
    """CLIPVisionModel names, or SiglipVisionModel's: the same less class token and pre-LayerNorm, plus a conv bias."""
    t = {"vision.conv1.weight": "embeddings.patch_embedding.weight",
         "vision.positional_embedding": "embeddings.position_embedding.weight"}
    if cfg.kind == "clip":
        t |= {"vision.class_embedding": "embeddings.class_embedding"}
        t |= {f"vision.ln_pre.{p}": f"pre_layrnorm.{p}" for p in ("weight", "bias")}
    else:
        t |= {"vision.conv1.bias": "embeddings.patch_embedding.bias"}
    t |= {f"vision.ln_post.{p}": f"post_layernorm.{p}" for p in ("weight", "bias")}
    block = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
             "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.out_proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for i in range(cfg.n_layers):
        for ours, theirs in block.items():
            t |= {f"vision.blocks.{i}.{ours}.{p}": f"encoder.layers.{i}.{theirs}.{p}" for p in ("weight", "bias")}
    return {k: prefix + v for k, v in t.items()}


def llama_table(cfg: LlamaConfig, prefix, head):
    """HF LlamaForCausalLM names under `prefix` (e.g. 'model.'), lm_head at `head`."""
    t = {"llm.tok_embeddings.weight": "embed_tokens.weight", "llm.norm.weight": "norm.weight"}
    block = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
             "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj"}
    if cfg.sandwich_norms:  # Gemma's four: its post_attention_layernorm is the one after attention, not before the MLP
        block |= {"attention_post_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                  "ffn_post_norm": "post_feedforward_layernorm"}
    if cfg.qk_norm:
        block |= {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
    for i in range(cfg.n_layers):
        t |= {f"llm.layers.{i}.{ours}.weight": f"layers.{i}.{theirs}.weight" for ours, theirs in block.items()}
        if cfg.qkv_bias:
            t |= {f"llm.layers.{i}.attention.w{x}.bias": f"layers.{i}.self_attn.{x}_proj.bias" for x in "qkv"}
    t = {k: prefix + v for k, v in t.items()}
    if not cfg.tie_embeddings:
        t["llm.output.weight"] = head
    return t


def llava_table(cfg: VLMConfig):
    """The HF hub layout (llava-hf/*): the one we write and the one other layouts are renamed to. LLaVA-NeXT and
    OneVision add the newline embedding at the top level. Idefics3 / SmolVLM and InternVL: transformers 5's layout
    (idefics3_table, internvl_table)."""
    kind = hf_model_type(cfg)
    if kind in ("idefics3", "smolvlm"):
        return idefics3_table(cfg)
    if kind == "internvl":
        return internvl_table(cfg)
    if kind == "gemma3":
        return gemma3_table(cfg)
    if cfg.projector != "mlp2x_gelu":
        raise ConversionError(f"HF {HF_ARCHITECTURES[hf_model_type(cfg)]} holds only mlp2x_gelu projectors, "
                              f"not {cfg.projector!r}")
    if cfg.reward_head:
        raise ConversionError("a reward model (reward_head): no Hugging Face LLaVA class holds its scalar head; load it "
                              "with model_files.load_model (docs/post-training.md)")
    t = vit_table(cfg.vision, "vision_tower.vision_model.")
    t |= {f"projector.fc.{i}.{p}": f"multi_modal_projector.linear_{i + 1}.{p}" for i in range(2) for p in ("weight", "bias")}
    if "image_newline" in expected_shapes(cfg):
        t["image_newline"] = "image_newline"
    return t | llama_table(cfg.llm, "language_model.model.", "language_model.lm_head.weight")


def idefics3_table(cfg: VLMConfig):
    """Idefics3ForConditionalGeneration's and SmolVLMForConditionalGeneration's names (the hub's and transformers
    5's alike): SigLIP's under model.vision_model, the connector's Linear, the Llama under model.text_model."""
    return vit_table(cfg.vision, "model.vision_model.") | \
        {"projector.fc.0.weight": "model.connector.modality_projection.proj.weight"} | \
        llama_table(cfg.llm, "model.text_model.", "lm_head.weight")


def internvl_table(cfg: VLMConfig):
    """InternVLForConditionalGeneration's names in the hub layout save_pretrained writes (internvl_name renames the
    in-memory model.* one to it): InternViT, the LayerNorm-MLP, the Qwen decoder."""
    v = {"vision.class_embedding": "embeddings.cls_token", "vision.positional_embedding": "embeddings.position_embeddings"}
    v |= {f"vision.conv1.{p}": f"embeddings.patch_embeddings.projection.{p}" for p in ("weight", "bias")}
    if cfg.vision.post_norm:
        v |= {f"vision.ln_post.{p}": f"layernorm.{p}" for p in ("weight", "bias")}
    block = {"ln_1": "layernorm_before", "ln_2": "layernorm_after", "attn.wo": "attention.projection_layer",
             "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for i in range(cfg.vision.n_layers):
        for ours, theirs in block.items():
            v |= {f"vision.blocks.{i}.{ours}.{p}": f"encoder.layer.{i}.{theirs}.{p}" for p in ("weight", "bias")}
        for x in "qkv":
            v |= {f"vision.blocks.{i}.attn.w{x}.{p}": f"encoder.layer.{i}.attention.{x}_proj.{p}"
                  for p in ("weight", "bias") if p == "weight" or cfg.vision.qkv_bias}
        v |= {f"vision.blocks.{i}.ls_{j}": f"encoder.layer.{i}.lambda_{j}" for j in (1, 2)}
    t = {k: "vision_tower." + name for k, name in v.items()}
    t |= {f"projector.norm.{p}": f"multi_modal_projector.layer_norm.{p}" for p in ("weight", "bias")}
    t |= {f"projector.fc.{i}.{p}": f"multi_modal_projector.linear_{i + 1}.{p}" for i in range(2)
          for p in ("weight", "bias")}
    return t | llama_table(cfg.llm, "language_model.model.", "language_model.lm_head.weight")


def gemma3_table(cfg: VLMConfig):
    """Gemma3ForConditionalGeneration's names in the hub layout (google/gemma-3-*; hub_name renames transformers 5's):
    SigLIP under vision_tower.vision_model, the connector's norm and matrix, the Gemma 3 decoder."""
    return vit_table(cfg.vision, "vision_tower.vision_model.") | \
        {"projector.norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
         "projector.fc.0.weight": "multi_modal_projector.mm_input_projection_weight"} | \
        llama_table(cfg.llm, "language_model.model.", "language_model.lm_head.weight")


# InternVL's tensors stored in another shape than ours: (ours -> theirs) reshapes, undone on the way in
HF_SHAPES = {"vision.class_embedding": lambda t: t.reshape(1, 1, -1),  # (1, 1, D)
             "vision.positional_embedding": lambda t: t[None]}  # (1, n_positions, D)
# Gemma 3's projection is a bare matrix that multiplies from the right: (vision dim, llm dim), our Linear's transposed
TRANSPOSED = {"gemma3": ("projector.fc.0.weight",)}


def to_hf_shape(cfg: VLMConfig, ours, tensor):
    kind = hf_model_type(cfg)
    if ours in TRANSPOSED.get(kind, ()):
        return tensor.detach().t().contiguous()
    return HF_SHAPES[ours](tensor) if kind == "internvl" and ours in HF_SHAPES else tensor


def internvl_name(key):
    """Rename the in-memory (model.*) layout to the hub layout save_pretrained writes (language_model.model.*,
    language_model.lm_head, vision_tower.*, multi_modal_projector.*)."""
    if key == "lm_head.weight":
        return "language_model.lm_head.weight"
    key = re.sub(r"^model\.language_model\.(?!model\.|lm_head)", "language_model.model.", key)
    return re.sub(r"^model\.", "", key)


def hub_name(key):
    """Rename the transformers >= 5.6 and in-memory (model.*) layouts to the hub layout; a LLaVA's CLIP or SigLIP
    sits under vision_tower.vision_model."""
    return re.sub(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", internvl_name(key))


def memory_name(key):
    """hub_name's inverse: the transformers-5 in-memory name (model.language_model.*, model.vision_tower.*, lm_head),
    under which peft saves adapters."""
    if key == "language_model.lm_head.weight":
        return "lm_head.weight"
    key = re.sub(r"^language_model\.model\.", "language_model.", key)
    return "model." + re.sub(r"^vision_tower\.vision_model\.", "vision_tower.", key)


def projector_table(cfg: VLMConfig, prefix):
    """Original LLaVA's nn.Sequential projector: Linear at even indices, GELU between; or one Linear."""
    if cfg.projector == "linear":
        return {f"projector.fc.0.{p}": f"{prefix}{p}" for p in ("weight", "bias")}
    n = projector_depth(cfg.projector)
    return {f"projector.fc.{i}.{p}": f"{prefix}{2 * i}.{p}" for i in range(n) for p in ("weight", "bias")}


def expected_shapes(cfg: VLMConfig):
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in VLM(cfg).state_dict().items()
                if not (cfg.llm.tie_embeddings and k == "llm.output.weight")}


# buffers older HF checkpoints carry that hold nothing we need
IGNORED = (r".*\.rotary_emb\.inv_freq$", r".*embeddings\.position_ids$")
SIGLIP_HEAD = r"^(vision_tower\.vision_model\.)?head\."  # SigLIP's attention-pool head: LLaVA reads no pooled output


def drop_siglip_head(state, where):
    head = [k for k in state if re.match(SIGLIP_HEAD, k)]
    if head:
        say(f"{where}: dropping SigLIP's attention-pooling head ({len(head)} tensors); LLaVA models never use it")
    return {k: v for k, v in state.items() if k not in head}


def drop_tied_head(state, cfg: LlamaConfig, embed, head, where):
    """A tied checkpoint may store lm_head too; transformers ties it to the embedding and ignores it, and so do we."""
    if cfg.tie_embeddings and head in state and embed in state:
        if not torch.equal(state[head], state[embed]):
            say(f"{where}: {head} differs from {embed} although the config ties them; "
                f"using {embed} for both, as transformers does")
        state = {k: v for k, v in state.items() if k != head}
    return state


def remap(source, table, shapes, what, ignore=()):
    """Pick our tensors out of `source` by `table`; raise listing every unconsumed, missing or misshapen key."""
    ignore = IGNORED + tuple(ignore)
    missing = sorted(v for v in table.values() if v not in source)
    used = set(table.values())
    unconsumed = sorted(k for k in source if k not in used and not any(re.match(p, k) for p in ignore))
    out = {k: source[v] for k, v in table.items() if v in source}
    wrong = sorted(f"{table[k]}: got {tuple(t.shape)}, expected {shapes.get(k)}" for k, t in out.items()
                   if tuple(t.shape) != shapes.get(k))
    if missing or unconsumed or wrong:
        lines = [f"{what}: the weights do not fit the model config"]
        for title, keys in (("missing", missing), ("unconsumed (no place in the model)", unconsumed),
                            ("shape mismatch", wrong)):
            if keys:
                lines.append(f"  {title} ({len(keys)}): " + ", ".join(keys[:20]) + (" ..." if len(keys) > 20 else ""))
        raise ConversionError("\n".join(lines))
    return out


def check_complete(state, cfg, what):
    missing = sorted(set(expected_shapes(cfg)) - set(state))
    if missing:
        raise ConversionError(f"{what}: no weights for {len(missing)} model tensors: {', '.join(missing[:20])}")
    return state


def processor_resample(directory, vision: ViTConfig):
    """vision with the resize filter of the image processor saved beside the weights (preprocessor_config.json, or
    processor_config.json's image_processor as transformers 5 writes it): SigLIP2's say 2 (bilinear); unchanged where
    none says."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = storage.join(directory, name)
        settings = read_json(path) if storage.exists(path) else {}
        settings = settings.get("image_processor", settings)
        if "resample" in settings:
            if settings["resample"] not in (2, 3):
                raise ConversionError(f"{path}: resample {settings['resample']!r} is a filter llavax does not resize "
                                      "with (2 bilinear, 3 bicubic)")
            return replace(vision, resample=settings["resample"])
    return vision


def llava_from_hf(hf_dir):
    """(state, cfg) of an HF directory of any class in HF_ARCHITECTURES, its tower's resize filter its processor's."""
    cfg = llava_config(read_json(storage.join(hf_dir, "config.json")), hf_dir)
    kind, table, shapes = hf_model_type(cfg), llava_table(cfg), expected_shapes(cfg)
    try:
        cfg = replace(cfg, vision=processor_resample(hf_dir, cfg.vision))
    except ConversionError as e:  # Idefics3's and SmolVLM's Lanczos: their processor is not llavax's (yet) anyway
        if kind in LLAVA_TYPES:
            raise
        say(f"{e}; llavax resizes this {HF_ARCHITECTURES[kind]}'s images bicubic (its processor is not implemented)")
    rename = hub_name if kind in LLAVA_TYPES + ("gemma3",) else internvl_name if kind == "internvl" else (lambda k: k)
    state = drop_siglip_head({rename(k): v for k, v in read_weights(hf_dir).items()}, hf_dir)
    head = "lm_head.weight" if kind in ("idefics3", "smolvlm") else "language_model.lm_head.weight"
    state = drop_tied_head(state, cfg.llm, table["llm.tok_embeddings.weight"], head, hf_dir)
    for ours in HF_SHAPES if kind == "internvl" else ():  # to ours, where the element count agrees (else remap says)
        t = state.get(table[ours])
        if t is not None and t.numel() == math.prod(shapes[ours]):
            state[table[ours]] = t.reshape(shapes[ours])
    for ours in TRANSPOSED.get(kind, ()):  # to ours, where the transpose fits (else remap says)
        t = state.get(table[ours])
        if t is not None and tuple(t.shape) == shapes[ours][::-1]:
            state[table[ours]] = t.t().contiguous()
    return check_complete(remap(state, table, shapes, str(hf_dir)), cfg, hf_dir), cfg
