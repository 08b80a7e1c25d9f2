"""
The model's configs: ViTConfig, LlamaConfig and VLMConfig (the dataclasses a checkpoint's config.json holds, each
checked when built), and the named presets (vlm_preset) that train.py's `model` names. Split from model.py (over its
budget), which builds the modules from them and re-exports every name here.
"""

import difflib
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial

import torch
import torch.nn.functional as F

from lora import LoRAConfig


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


# the ViT MLP's activation by its HF hidden_act name; gelu_new is the same tanh approximation, written out
VIT_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
                   "gelu_new": partial(F.gelu, approximate="tanh")}


# the decoder MLP's gate activation (SwiGLU's, GeGLU's with the tanh approximation as Gemma's gelu_pytorch_tanh)
MLP_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


# per-channel image mean and std of each tower kind's pretraining (CLIP's; SigLIP's are 0.5)
IMAGE_STATS = {"clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
               "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
               "internvit": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}  # InternViT: ImageNet's
VIT_KINDS = tuple(IMAGE_STATS)
ATTENTION_BLOCKS = ("", "images")  # VLMConfig.attention_blocks: what makes a block of tokens that see each other


@dataclass
class ViTConfig:
    image_size: int = 336
    patch_size: int = 14
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    ffn_dim: int = 4096
    norm_eps: float = 1e-5
    act: str = "quick_gelu"  # CLIP's; a key of VIT_ACTIVATIONS ("gelu_pytorch_tanh" for SigLIP)
    # "clip": class token + pre-LayerNorm; "siglip": neither, and a bias on the patch conv; "internvit" (InternVL's
    # InternViT-300M): a class token, no pre-LayerNorm, a conv bias, and each block's two branches scaled per channel
    kind: str = "clip"
    image_mean: tuple | None = None  # the pixel statistics the tower was trained with; None: its kind's (IMAGE_STATS)
    image_std: tuple | None = None
    qkv_bias: bool = True  # a bias on wq, wk, wv (InternViT's attention_bias)
    post_norm: bool = True  # a LayerNorm after the last block (ln_post; InternViT with mean pooling has none)
    # the filter its image processor resizes with (its preprocessor_config.json "resample", PIL's numbers): 3 bicubic
    # (CLIP, SigLIP, LLaVA's processors), 2 bilinear (SigLIP2's published processors)
    resample: int = 3

    def __post_init__(self):
        if self.kind not in VIT_KINDS:
            raise ValueError(f"vision kind must be one of {', '.join(map(repr, VIT_KINDS))}, got {self.kind!r}")
        if self.act not in VIT_ACTIVATIONS:
            raise ValueError(f"vision act {self.act!r} is not one of {sorted(VIT_ACTIVATIONS)}")
        if self.resample not in (2, 3):
            raise ValueError(f"vision resample must be 2 (bilinear) or 3 (bicubic), PIL's numbers, got {self.resample!r}")

    @property
    def image_stats(self):  # (mean, std) the images are normalised with, and the pad colour's mean
        mean, std = IMAGE_STATS[self.kind]
        return tuple(self.image_mean or mean), tuple(self.image_std or std)

    @property
    def n_patches(self):
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_positions(self):  # tokens out of the tower: the patches, plus CLIP's or InternViT's class token
        return self.n_patches + (self.kind != "siglip")


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    head_dim: int | None = None  # None: dim // n_heads
    ffn_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} as Llama 3.1 publishes it
    rope_scaling: dict | None = None
    max_seq_len: int = 4096
    qkv_bias: bool = False  # Qwen2-style bias on wq, wk, wv
    tie_embeddings: bool = False
    # Mistral / Qwen2 sliding-window attention: a query sees the last `sliding_window` keys, itself included,
    # in the layers listed in sliding_layers (None: every layer)
    sliding_window: int | None = None
    sliding_layers: list | None = None
    # the switches of the other families (docs/model.md's table says which family sets which), as litgpt's Config:
    qk_norm: bool = False  # an RMSNorm over each head's q and k, before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (offset + w), in fp32 (Gemma: 1.0, its weights stored as w)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each residual add (Gemma)
    mlp_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: bool = False  # token embeddings times sqrt(dim) (Gemma; image features are not scaled, as in HF)
    query_scale: float | None = None  # scores times this; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the logits likewise (Gemma 2)
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base, unscaled (Gemma 3); None: the global
    no_rope_layers: list | None = None  # layers that apply no RoPE (SmolLM3)

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_act {self.mlp_act!r} is not one of {sorted(MLP_ACTIVATIONS)}")
        for name in ("attn_softcap", "final_softcap", "query_scale", "local_rope_theta"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive or None, got {getattr(self, name)!r}")


@dataclass
class VLMConfig:
    vision: ViTConfig = field(default_factory=ViTConfig)
    llm: LlamaConfig = field(default_factory=LlamaConfig)
    projector: str = "mlp2x_gelu"  # "linear", "linear_nobias", "mlp{N}x_gelu" or "ln_mlp{N}x_gelu" (projector_parts)
    vision_layer: int | list = -2  # hidden state index as in HF (0 = after ln_pre); a list concatenates
    vision_select: str = "patch"  # "patch" drops token 0, CLIP's CLS (HF "default"); "cls_patch" keeps all (HF "full")
    image_token_id: int = 32000
    # "": one view per image (LLaVA-1.5); "anyres": LLaVA-NeXT's base view + grid of tiles; "anyres_max_N":
    # LLaVA-OneVision's, the grid's features bilinearly reduced to about N tiles' worth (see image_layout)
    anyres: str = ""
    grid_pinpoints: list | None = None  # [[height, width], ...] in pixels, multiples of vision.image_size (HF's)
    video_token_id: int | None = None  # OneVision's <video> placeholder; frames are pooled 2x (see image_layout)
    lora: LoRAConfig | None = None  # LoRA adapters (see apply_lora): a checkpoint of a LoRA run rebuilds them
    reward_head: bool = False  # a scalar head beside the LM head, read at each row's last real token (a reward model)
    # the connector's switches (docs/model.md's table says which family sets which): each factor x factor block of a
    # tile's square feature map becomes one token of factor**2 features before the projector (Idefics3/SmolVLM: 2-4,
    # InternVL: 2, its downsample_ratio 0.5); and the tower read after its ln_post (SigLIP's last_hidden_state)
    pixel_shuffle: int = 1
    vision_post_norm: bool = False
    # each pool x pool block of a tile's square feature map averaged into one token before the projector (Gemma 3: 4,
    # its 64 x 64 map to 256 tokens)
    pool: int = 1
    # attention beyond causal, as one block id a token that every attention path reads (Llama.forward's blocks): "" causal
    # everywhere; "images": each run of image placeholders is a block whose tokens see each other both ways (Gemma 3)
    attention_blocks: str = ""
    export_as: str = ""  # to-hf's model_type where two HF classes compute alike ("idefics3" or "smolvlm"); "": smolvlm

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = _from_dict(LoRAConfig, self.lora, "lora") if self.lora else None
        if isinstance(self.vision, dict):
            self.vision = _from_dict(ViTConfig, self.vision, "vision")
        if isinstance(self.llm, dict):
            self.llm = _from_dict(LlamaConfig, self.llm, "llm")
        if self.vision_select not in ("patch", "cls_patch"):
            raise ValueError(f"vision_select must be 'patch' or 'cls_patch', got {self.vision_select!r}")
        projector_parts(self.projector)  # validates the name
        self.check_connector()
        if self.anyres not in ("", "anyres") and not (self.anyres.startswith("anyres_max_")
                                                      and self.anyres[len("anyres_max_"):].isdigit()):
            raise ValueError(f"anyres must be '', 'anyres' or 'anyres_max_N' (N an integer), got {self.anyres!r}")
        size = self.vision.image_size
        if self.anyres:
            pins = self.grid_pinpoints or []
            bad = [p for p in pins if len(p) != 2 or any(int(x) != x or x <= 0 or x % size for x in p)]
            if not pins or bad:
                raise ValueError(f"anyres={self.anyres!r} needs grid_pinpoints, [height, width] pairs that are "
                                 f"multiples of the vision image_size {size}; got {self.grid_pinpoints!r}")
            self.grid_pinpoints = [[int(h), int(w)] for h, w in pins]
        side = size // self.vision.patch_size
        if (self.anyres or self.video_token_id is not None) and self.n_image_tokens != side * side:
            raise ValueError(f"anyres and video need a square map of {side}x{side} features a tile, but the config "
                             f"gives {self.n_image_tokens}: a CLIP tower needs vision_select='patch' (HF 'default')")

    def check_connector(self):
        read = self.vision.n_positions - (self.vision_select == "patch")
        side = int(read**0.5)
        if not (isinstance(self.pixel_shuffle, int) and self.pixel_shuffle >= 1):
            raise ValueError(f"pixel_shuffle must be a positive integer, got {self.pixel_shuffle!r}")
        if self.pixel_shuffle > 1 and (side * side != read or side % self.pixel_shuffle):
            raise ValueError(f"pixel_shuffle={self.pixel_shuffle} needs a square feature map whose side it divides; "
                             f"the tower gives {read} tokens a tile" + (" (drop the class token: vision_select='patch')"
                                                                       if self.vision.kind != "siglip" else ""))
        if not (isinstance(self.pool, int) and self.pool >= 1):
            raise ValueError(f"pool must be a positive integer, got {self.pool!r}")
        if self.pool > 1 and (side * side != read or side % self.pool or self.pixel_shuffle > 1):
            raise ValueError(f"pool={self.pool} needs a square feature map whose side it divides, and no pixel_shuffle; "
                             f"the tower gives {read} tokens a tile, pixel_shuffle={self.pixel_shuffle}")
        if (self.pixel_shuffle > 1 or self.pool > 1) and (self.anyres or self.video_token_id is not None):
            raise ValueError("anyres tiles and video with a pixel_shuffle or pool are not implemented (one view per "
                             "image)")
        if self.vision_post_norm and not self.vision.post_norm:
            raise ValueError("vision_post_norm reads the tower after its ln_post, but vision.post_norm is False")
        if self.attention_blocks not in ATTENTION_BLOCKS:
            raise ValueError(f"attention_blocks must be one of {ATTENTION_BLOCKS}, got {self.attention_blocks!r}")
        if self.export_as not in ("", "smolvlm", "idefics3"):
            raise ValueError(f"export_as must be '', 'smolvlm' or 'idefics3', got {self.export_as!r}")

    @property
    def vision_layers(self):
        return list(self.vision_layer) if isinstance(self.vision_layer, (list, tuple)) else [self.vision_layer]

    @property
    def n_image_tokens(self):
        return (self.vision.n_positions - (self.vision_select == "patch")) // self.pixel_shuffle**2 // self.pool**2

    @property
    def image_taps(self):  # features each placeholder mixes: 4 where a bilinear resize may apply, else 1
        return 4 if self.anyres.startswith("anyres_max") or self.video_token_id is not None else 1

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        return _from_dict(cls, d, "config")

    def with_overrides(self, overrides):
        """This config with `overrides` merged in ({"llm": {"dim": 256}, "image_token_id": 5}). Fields derived from
        others follow their inputs unless the override sets them too: head_dim (dim // n_heads) and, where it was
        n_heads (no GQA), n_kv_heads. The rest (n_patches, n_image_tokens) are computed, never stored."""
        d = self.to_dict()
        for key, value in overrides.items():
            if key == "llm" and isinstance(value, dict):
                llm = d["llm"]
                derived = {"head_dim": llm["head_dim"] == llm["dim"] // llm["n_heads"],
                           "n_kv_heads": llm["n_kv_heads"] == llm["n_heads"]}
                value = llm | {k: None for k, was_derived in derived.items() if was_derived} | value
            elif key == "vision" and isinstance(value, dict):
                value = d["vision"] | value
            d[key] = value
        return VLMConfig.from_dict(d)


def _from_dict(cls, d, where):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        guess = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ValueError(f"{where}: unknown {cls.__name__} keys {unknown}{guess}; known keys are {sorted(known)}")
    return cls(**d)


def projector_parts(name):
    """(the norm first: "", "ln" or "rms", the number of Linears, whether they have biases) of a projector kind:
    "linear", LLaVA's "mlp{N}x_gelu" (Linear, then GELU and Linear N-1 times), InternVL's "ln_mlp{N}x_gelu" (a
    LayerNorm, then the MLP), Idefics3/SmolVLM's "linear_nobias" (one Linear, no bias) and Gemma 3's
    "rms_linear_nobias" (Gemma's RMSNorm, scaled by 1 + w, then one Linear without a bias)."""
    if name in ("linear", "linear_nobias", "rms_linear_nobias"):
        return "rms" if name.startswith("rms_") else "", 1, name == "linear"
    mlp = name.removeprefix("ln_")
    if mlp.startswith("mlp") and mlp.endswith("x_gelu") and mlp[3:-6].isdigit() and int(mlp[3:-6]) > 0:
        return "ln" if name.startswith("ln_") else "", int(mlp[3:-6]), True
    raise ValueError(f"unknown projector {name!r}: expected 'linear', 'linear_nobias', 'rms_linear_nobias', "
                     f"'mlp{{N}}x_gelu' such as 'mlp2x_gelu', or 'ln_mlp{{N}}x_gelu'")


def projector_depth(name):
    return projector_parts(name)[1]


VIT_PRESETS = {
    "debug": ViTConfig(image_size=28, patch_size=14, dim=64, n_layers=2, n_heads=4, ffn_dim=256),
    "clip-vit-l-336": ViTConfig(),  # openai/clip-vit-large-patch14-336
    "clip-vit-l-224": ViTConfig(image_size=224),
    # google/siglip-so400m-patch14-384 (27 layers; LLaVA-OneVision/Interleave keep 26), and the fixed-resolution
    # SigLIP2 of the same shape (google/siglip2-so400m-patch14-384, a SiglipModel in transformers)
    "siglip-so400m-patch14-384": ViTConfig(image_size=384, patch_size=14, dim=1152, n_layers=27, n_heads=16,
                                           ffn_dim=4304, norm_eps=1e-6, act="gelu_pytorch_tanh", kind="siglip"),
    # SigLIP2's processors resize bilinear (their preprocessor_config.json: "resample": 2)
    "siglip2-so400m-patch14-384": ViTConfig(image_size=384, patch_size=14, dim=1152, n_layers=27, n_heads=16,
                                            ffn_dim=4304, norm_eps=1e-6, act="gelu_pytorch_tanh", kind="siglip",
                                            resample=2),
    # google/siglip2-base-patch16-{224,256,384,512}: SiglipModel towers at fixed resolution (not NaFlex's siglip2)
    **{f"siglip2-base-patch16-{side}": ViTConfig(image_size=side, patch_size=16, dim=768, n_layers=12, n_heads=12,
                                                 ffn_dim=3072, norm_eps=1e-6, act="gelu_pytorch_tanh", kind="siglip",
                                                 resample=2)
       for side in (224, 256, 384, 512)},
}


def qwen3(dim, n_layers, n_heads, ffn_dim, tied):
    """Qwen3 dense (Qwen/Qwen3-*'s config.json): head_dim 128, 8 KV heads, q/k norm, no bias, RoPE base 1e6."""
    return LlamaConfig(vocab_size=151936, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                       ffn_dim=ffn_dim, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, qk_norm=True,
                       tie_embeddings=tied)


def qwen25(vocab, dim, n_layers, n_heads, n_kv_heads, ffn_dim, tied):
    """Qwen2.5 (Qwen/Qwen2.5-*): Qwen2's layout, qkv bias, RoPE base 1e6."""
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       ffn_dim=ffn_dim, norm_eps=1e-6, rope_theta=1e6, max_seq_len=32768, qkv_bias=True,
                       tie_embeddings=tied)


def gemma3(vocab, dim, n_layers, n_heads, n_kv_heads, ffn_dim, window, scaled):
    """Gemma 3 text (google/gemma-3-*): five sliding-window layers in six (base 10k), the sixth global (base 1M,
    linear x8 from 4B up), q/k norm, four (1 + w) norms a layer, GeGLU, embeddings x sqrt(dim). RoPE tables for 8k
    positions (the published 32k-128k would hold 0.1-0.5 GB of tables): raise max_seq_len with model_overrides."""
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=256, ffn_dim=ffn_dim, norm_eps=1e-6, rope_theta=1e6, max_seq_len=8192,
                       rope_scaling={"rope_type": "linear", "factor": 8.0} if scaled else None, tie_embeddings=True,
                       sliding_window=window, sliding_layers=[i for i in range(n_layers) if (i + 1) % 6],
                       qk_norm=True, norm_offset=1.0, sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=True,
                       query_scale=256**-0.5, local_rope_theta=1e4)


def smollm2(dim, n_layers, n_heads, n_kv_heads, ffn_dim, rope_theta):
    """SmolLM2 (HuggingFaceTB/SmolLM2-*): Llama, tied, a 49152-token vocabulary."""
    return LlamaConfig(vocab_size=49152, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       ffn_dim=ffn_dim, rope_theta=rope_theta, max_seq_len=8192, tie_embeddings=True)
LLM_PRESETS = {
    "debug": LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=512),
    "vicuna-7b": LlamaConfig(),  # LLaMA-2 7B shapes; vicuna-7b-v1.5
    "vicuna-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    "tinyllama-1.1b": LlamaConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=2048),
    "llama3-8b": LlamaConfig(  # Llama 3.1 8B
        vocab_size=128256, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen2-0.5b": LlamaConfig(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
                              norm_eps=1e-6, rope_theta=1e6, max_seq_len=32768, qkv_bias=True, tie_embeddings=True),
    "qwen2-7b": LlamaConfig(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                            norm_eps=1e-6, rope_theta=1e6, max_seq_len=32768, qkv_bias=True),
    "qwen3-0.6b": qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": qwen3(4096, 36, 32, 12288, tied=False),
    "qwen2.5-0.5b": qwen25(151936, 896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": qwen25(151936, 1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-3b": qwen25(151936, 2048, 36, 16, 2, 11008, tied=True),
    "qwen2.5-7b": qwen25(152064, 3584, 28, 28, 4, 18944, tied=False),
    "gemma-3-1b": gemma3(262144, 1152, 26, 4, 1, 6912, window=512, scaled=False),
    "gemma-3-4b": gemma3(262208, 2560, 34, 8, 4, 10240, window=1024, scaled=True),
    "gemma-3-12b": gemma3(262208, 3840, 48, 16, 8, 15360, window=1024, scaled=True),
    "smollm2-135m": smollm2(576, 30, 9, 3, 1536, rope_theta=1e5),
    "smollm2-360m": smollm2(960, 32, 15, 5, 2560, rope_theta=1e5),
    "smollm2-1.7b": smollm2(2048, 24, 32, 32, 8192, rope_theta=130000.0),
    # HuggingFaceTB/SmolLM3-3B: Llama with GQA 4, tied, and every fourth layer without RoPE (NoPE)
    "smollm3-3b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=36, n_heads=16, n_kv_heads=4, ffn_dim=11008,
                              norm_eps=1e-6, rope_theta=5e6, max_seq_len=65536, tie_embeddings=True,
                              no_rope_layers=[i for i in range(36) if (i + 1) % 4 == 0]),
}


def vlm_preset(name):
    """Named VLM configs. LLaVA-1.5 appends <image> after the 32000 text tokens and pads the vocab to 32064."""
    if name == "debug":
        # copies: a caller that edits its config must not change the shared presets (tests do)
        return VLMConfig(vision=replace(VIT_PRESETS["debug"]), llm=replace(LLM_PRESETS["debug"]), image_token_id=511)
    if name in ("llava-1.5-7b", "llava-1.5-13b"):
        llm = LLM_PRESETS["vicuna-7b" if name.endswith("7b") else "vicuna-13b"]
        llm = LlamaConfig(**{**asdict(llm), "vocab_size": 32064})
        return VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=llm, image_token_id=32000)
    if name == "llava-llama3-8b":
        llm = LlamaConfig(**{**asdict(LLM_PRESETS["llama3-8b"]), "vocab_size": 128320})
        return VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=llm, image_token_id=128256)
    if name == "llava-interleave-qwen-0.5b":  # llava-hf/llava-interleave-qwen-0.5b-hf: Qwen1.5-0.5B + SigLIP
        vision = ViTConfig(**{**asdict(VIT_PRESETS["siglip-so400m-patch14-384"]), "n_layers": 26})
        llm = LlamaConfig(vocab_size=152000, dim=1024, n_layers=24, n_heads=16, ffn_dim=2816, norm_eps=1e-6,
                          rope_theta=1e6, max_seq_len=32768, qkv_bias=True, tie_embeddings=True)
        return VLMConfig(vision=vision, llm=llm, vision_layer=-1, vision_select="cls_patch", image_token_id=151646)
    if name in ("llava-next-vicuna-7b", "llava-next-mistral-7b"):
        # llava-hf/llava-v1.6-{vicuna,mistral}-7b-hf, as transformers' convert_llava_next_weights_to_hf.py builds
        # them: CLIP-336, layer -2, "default" (our "patch"), <image> = 32000, vocab 32000 + 2 padded to 64 = 32064,
        # and LlavaNextConfig's default pinpoints (the v1.6 image processor's). Mistral-7B-Instruct-v0.2: GQA 8,
        # FFN 14336, rope_theta 1e6, 32k positions, no sliding window (its config.json has sliding_window null).
        if name.endswith("vicuna-7b"):
            llm = LlamaConfig(**{**asdict(LLM_PRESETS["vicuna-7b"]), "vocab_size": 32064})
        else:
            llm = LlamaConfig(vocab_size=32064, n_kv_heads=8, ffn_dim=14336, rope_theta=1e6, max_seq_len=32768)
        return VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=llm, image_token_id=32000, anyres="anyres",
                         grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
    if name in ("llava-onevision-qwen2-7b", "llava-onevision-qwen2-0.5b"):
        # llava-hf/llava-onevision-qwen2-{7b,0.5b}-ov-hf (transformers' LlavaOnevisionConfig defaults and
        # convert_llava_onevision_weights_to_hf.py): SigLIP so400m less its last layer (26), layer -1, "full" (our
        # "cls_patch": SigLIP has no CLS, every token kept), anyres_max_9 over the 36 pinpoints 384..2304 step 384,
        # <image> 151646 and <video> 151647; vocab = Qwen2-*-Instruct's + 2 padded to 64 (152064 -> 152128,
        # 151936 -> 152000); 0.5B ties its embeddings, 7B does not.
        vision = ViTConfig(**{**asdict(VIT_PRESETS["siglip-so400m-patch14-384"]), "n_layers": 26})
        llm = LLM_PRESETS["qwen2-7b" if name.endswith("7b") else "qwen2-0.5b"]
        llm = LlamaConfig(**{**asdict(llm), "vocab_size": 152128 if name.endswith("7b") else 152000})
        sides = range(384, 2305, 384)
        return VLMConfig(vision=vision, llm=llm, vision_layer=-1, vision_select="cls_patch", image_token_id=151646,
                         video_token_id=151647, anyres="anyres_max_9",
                         grid_pinpoints=[[h, w] for h in sides for w in sides])
    if name == "nanovlm-460m":
        # nanoVLM's default model (huggingface/nanoVLM models/config.py): SigLIP2-base-512 read after its final
        # LayerNorm, each 4 x 4 block of patches one token (64 a 512 px image), one bias-free Linear(12288, 960), and
        # SmolLM2-360M-Instruct, tied; the image token after the 49152 text tokens (vocab padded to 64). Idefics3's
        # connector, so the export opens as SmolVLMForConditionalGeneration
        llm = LlamaConfig(**{**asdict(LLM_PRESETS["smollm2-360m"]), "vocab_size": 49216})
        return VLMConfig(vision=replace(VIT_PRESETS["siglip2-base-patch16-512"]), llm=llm, projector="linear_nobias",
                         vision_layer=-1, vision_select="cls_patch", vision_post_norm=True, pixel_shuffle=4,
                         image_token_id=49152)
    if name in ("gemma-3-4b-vlm", "gemma-3-12b-vlm"):
        # google/gemma-3-{4b,12b}-it (Gemma3ForConditionalGeneration): SigLIP so400m at 896 px, a 64 x 64 patch map read
        # after its post-LayerNorm, averaged 4 x 4 to 256 tokens, Gemma's RMSNorm and a bias-free matrix; <image_soft_token>
        # 262144 inside the vocabulary, each image's 256 tokens one block that sees itself both ways; bilinear resizing
        # (Gemma3ImageProcessor's). The decoder is the text preset of the same name (RoPE tables for 8k positions)
        vision = ViTConfig(**{**asdict(VIT_PRESETS["siglip-so400m-patch14-384"]), "image_size": 896, "resample": 2})
        return VLMConfig(vision=vision, llm=replace(LLM_PRESETS[name.removesuffix("-vlm")]), projector="rms_linear_nobias",
                         vision_layer=-1, vision_select="cls_patch", vision_post_norm=True, pool=4,
                         image_token_id=262144, attention_blocks="images")
    if name == "onevision-qwen3-8b":
        # LLaVA-OneVision's recipe on Qwen3-8B and SigLIP2-so400m (its last layer dropped, as OneVision's SigLIP):
        # Qwen3's own <|image_pad|> and <|video_pad|> (151655, 151656) as the placeholders, inside its vocabulary
        vision = ViTConfig(**{**asdict(VIT_PRESETS["siglip2-so400m-patch14-384"]), "n_layers": 26})
        sides = range(384, 2305, 384)
        return VLMConfig(vision=vision, llm=replace(LLM_PRESETS["qwen3-8b"]), vision_layer=-1,
                         vision_select="cls_patch", image_token_id=151655, video_token_id=151656,
                         anyres="anyres_max_9", grid_pinpoints=[[h, w] for h in sides for w in sides])
    if name == "bench":  # TinyLlama-shaped LLM + ViT-L/14-336, the target of bench.py
        llm = LlamaConfig(**{**asdict(LLM_PRESETS["tinyllama-1.1b"]), "vocab_size": 32064})
        return VLMConfig(vision=VIT_PRESETS["clip-vit-l-336"], llm=llm, image_token_id=32000)
    raise ValueError(f"unknown VLM preset {name!r}; known: {', '.join(VLM_PRESETS)}")


VLM_PRESETS = ("debug", "llava-1.5-7b", "llava-1.5-13b", "llava-llama3-8b", "llava-interleave-qwen-0.5b",
               "llava-next-vicuna-7b", "llava-next-mistral-7b", "llava-onevision-qwen2-7b", "llava-onevision-qwen2-0.5b",
               "nanovlm-460m", "gemma-3-4b-vlm", "gemma-3-12b-vlm", "onevision-qwen3-8b", "bench")  # vlm_preset's names
