# bench.py's target (BENCHMARKS.md): a TinyLlama-1.1B-shaped LLM (dim 2048, 22 layers, 32 heads, 4 KV heads,
# FFN 5632, vocab 32064) + CLIP ViT-L/14-336 + mlp2x_gelu, random weights, stage 2, with every speed-up on:
#   python bench.py train --config configs/bench.py --peer hf        # ours vs transformers, synthetic batches
# It is a train.py config too, for an end-to-end run on real shards (add --data_dir and --tokenizer).
out_dir = "out/bench"
model = "bench"
model_overrides = {}
template = "plain"
seq_len = 2048
pack = 3  # stage-1/2 LLaVA samples of ~600-700 tokens: three a 2048-token row
stage = 2
batch_size = 8
micro_batch_size = 8
dtype = "bfloat16"
compile = True  # per block; FlexAttention for the packed rows
loss_chunk = 4096
num_workers = 8
max_iters = 100
log_interval = 10
eval_interval = 0
final_accuracy_samples = 0
