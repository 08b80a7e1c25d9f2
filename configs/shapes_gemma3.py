# The shapes demo with a Gemma-3-shaped decoder (docs/model.md's family table): q/k norm, (1 + w) norms in fp32, four
# norms a layer, GeGLU (tanh), embeddings x sqrt(dim), scores x query_pre_attn_scalar^-0.5 (head_dim, as 1B-12B),
# tied embeddings, GQA 2 (4B's ratio). Sliding windows on layers 0-2 with RoPE base 1e4, layer 3 global with base
# 1e6 (Gemma 3's five in six, at four layers). The window is 16 tokens, shorter than the 30-34-token samples: in
# layers 0-2 the answer (positions 27-33) sees at most the last of the 9 image tokens (4-12); layer 3 sees them all.
# The demo's sizes, data and optimizer otherwise:
#   python train.py configs/shapes_gemma3.py
prepare = [
    "python data.py shapes --out data/shapes --n 20000",
]
out_dir = "out/shapes_gemma3"
max_iters = 2000  # 97.2% held-out, val loss 0.0236 (0.0308 at the demo's 1500 steps): docs/notes/shapes-demo.md
model_overrides = {
    "vision": {"image_size": 48, "patch_size": 16, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 512},
    "llm": {"vocab_size": 576, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32,
            "ffn_dim": 384, "max_seq_len": 64, "norm_eps": 1e-6, "qk_norm": True, "norm_offset": 1.0,
            "sandwich_norms": True, "mlp_act": "gelu_tanh", "embed_scale": True, "query_scale": 32**-0.5,
            "sliding_window": 16, "sliding_layers": [0, 1, 2], "local_rope_theta": 1e4, "rope_theta": 1e6,
            "tie_embeddings": True},
    "vision_layer": -1,
    "image_token_id": 512,  # the shapes tokenizer holds at most 512 pieces; the vocab is padded to 576
}
