# LLaVA-1.5-7B stage 1 on one GPU (frozen Vicuna-7B + CLIP-L/336, the projector trained), random
# weights, every speed-up of today on; scripts/gpu_speed.sh adds the levers as bench.py --variant phases:
#   python bench.py train --config configs/bench_7b_stage1.py --variant bf16:frozen_dtype=bfloat16
# A train.py config too, for an end-to-end run on real shards (add --data_dir, --tokenizer and init_from).
out_dir = "out/bench-7b-stage1"
model = "llava-1.5-7b"
model_overrides = {}
template = "plain"
seq_len = 2048
pack = 3  # LLaVA's ~600-700-token stage-1 samples: three a 2048-token row
stage = 1
batch_size = 8
micro_batch_size = 8
dtype = "bfloat16"
compile = True
activation_checkpointing = True  # without it, 8 rows ran out of memory on an H100
loss_chunk = 4096
num_workers = 8
max_iters = 100
log_interval = 10
eval_interval = 0
final_accuracy_samples = 0
