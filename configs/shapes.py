# The shapes demo: a small VLM trained from scratch on CPU (make demo).
out_dir = "out/shapes"
data_dir = "data/shapes/shards"
tokenizer = "data/shapes/tokenizer.model"
model = "debug"
model_overrides = {
    "vision": {"image_size": 48, "patch_size": 16, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 512},
    "llm": {"vocab_size": 448, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 384, "max_seq_len": 64},
    "vision_layer": -1,
    "image_token_id": 397,
}
template = "llama_3"
seq_len = 40
stage = 0
batch_size = 64
micro_batch_size = 64
max_iters = 1500
lr = 7e-4
min_lr = 5e-5
warmup_iters = 100
weight_decay = 0.01
log_interval = 50
eval_interval = 500
eval_iters = 4
ckpt_interval = 500
num_workers = 1
final_accuracy_samples = 500
