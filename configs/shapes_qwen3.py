# The shapes demo with a Qwen3-shaped decoder (docs/model.md's family table): q/k RMSNorm per head before RoPE,
# head_dim set apart from dim // n_heads (4 x 48 = 192 query features on a 128-wide stream, as Qwen3-0.6B's 16 x 128
# on 1024), GQA, tied embeddings, and Qwen3's RoPE base 1e6 and norm eps 1e-6. The demo's sizes, data, optimizer
# and 1500 steps otherwise (train.py's defaults):
#   python train.py configs/shapes_qwen3.py
prepare = [
    "python data.py shapes --out data/shapes --n 20000",
]
out_dir = "out/shapes_qwen3"
model_overrides = {
    "vision": {"image_size": 48, "patch_size": 16, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 512},
    "llm": {"vocab_size": 576, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 48,
            "ffn_dim": 384, "max_seq_len": 64, "norm_eps": 1e-6, "rope_theta": 1e6,
            "qk_norm": True, "tie_embeddings": True},
    "vision_layer": -1,
    "image_token_id": 512,  # the shapes tokenizer holds at most 512 pieces; the vocab is padded to 576
}
