# LLaVA-1.5-7B stage 1 (haotian-liu/LLaVA scripts/v1_5/pretrain.sh): train the projector only, one epoch of
# blip_laion_cc_sbu_558k with the `plain` template. Start from a converted Vicuna + CLIP:
#   python convert.py from-hf --llm vicuna-7b-v1.5 --vision clip-vit-large-patch14-336 --out ckpt/vicuna7b-clip336 \
#       --projector mlp2x_gelu --vision-layer -2
#   python data.py pack --json blip_laion_cc_sbu_558k.json --images images/ --out data/llava-pretrain --workers 16
# 8 GPUs: torchrun --nproc_per_node=8 train.py configs/pretrain.py
out_dir = "out/llava15-7b-pretrain"
init_from = "ckpt/vicuna7b-clip336"
data_dir = "data/llava-pretrain"
tokenizer = "ckpt/vicuna7b-clip336/tokenizer.model"
template = "plain"
image_mode = "crop"  # stage 1 has no --image_aspect_ratio pad: CLIP's resize + centre crop
seq_len = 2048
stage = 1
batch_size = 256  # global, as LLaVA's 8 x 32
micro_batch_size = 32
max_iters = 2181  # 558,128 samples / 256
lr = 1e-3
min_lr = 0.0
warmup_iters = 65  # warmup ratio 0.03
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"  # the frozen 7B LLM is sharded too
activation_checkpointing = True
loss_chunk = 4096  # the fp32 [rows, 2048, 32064] logits (2.1 GB for 8 rows) never exist at once
num_workers = 8
log_interval = 10
eval_interval = 0
ckpt_interval = 200
keep_last = 2
