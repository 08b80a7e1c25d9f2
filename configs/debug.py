# A tiny model on the shapes data: seconds on a CPU. Tests and outside checks use it.
out_dir = "out/debug"
data_dir = "data/shapes/shards"
tokenizer = "data/shapes/tokenizer.model"
model = "debug"
model_overrides = {"vision": {"image_size": 28, "patch_size": 14}, "llm": {"vocab_size": 576}, "image_token_id": 512}
template = "llama_3"
seq_len = 48
batch_size = 8
micro_batch_size = 8
max_iters = 20
lr = 1e-3
warmup_iters = 5
log_interval = 5
eval_interval = 10
eval_iters = 2
ckpt_interval = 10
num_workers = 0
