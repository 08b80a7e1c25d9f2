# LLaVA-1.5-7B stage 2 (haotian-liu/LLaVA scripts/v1_5/finetune.sh): projector + LLM, one epoch of
# llava_v1_5_mix665k with the `vicuna_v1` template and images padded to square with the CLIP mean colour.
#   python data.py pack --json llava_v1_5_mix665k.json --images images/ --out data/llava-665k --val-ratio 0.002 --workers 16
# 8 GPUs: torchrun --nproc_per_node=8 train.py configs/finetune.py
out_dir = "out/llava15-7b-finetune"
init_from = "out/llava15-7b-pretrain/step-002181"
data_dir = "data/llava-665k"
tokenizer = "ckpt/vicuna7b-clip336/tokenizer.model"
template = "vicuna_v1"
image_mode = "pad"
seq_len = 2048
stage = 2
batch_size = 128  # global, as LLaVA's 8 x 16
micro_batch_size = 16
max_iters = 5198  # 665,298 samples / 128
lr = 2e-5
min_lr = 0.0
warmup_iters = 156  # warmup ratio 0.03
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"
activation_checkpointing = True
loss_chunk = 4096  # the fp32 [rows, 2048, 32064] logits (2.1 GB for 8 rows) never exist at once
num_workers = 8
log_interval = 10
eval_interval = 500
eval_iters = 20
ckpt_interval = 500
keep_last = 2
