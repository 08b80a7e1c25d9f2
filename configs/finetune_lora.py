# LLaVA-1.5-7B stage 2 with LoRA (haotian-liu/LLaVA scripts/v1_5/finetune_lora.sh): r 128, alpha 256, dropout
# 0.05 on every linear layer of the LLM's blocks (not the vision tower: the script's leaf names also hit CLIP's,
# LLaVA#1380), the projector trained in full at 2e-5 beside the adapters at 2e-4; one epoch of llava_v1_5_mix665k.
# 8 GPUs: torchrun --nproc_per_node=8 train.py configs/finetune_lora.py
# then: python convert.py to-hf --ckpt out/llava15-7b-lora/step-005198 --merge-lora --out llava15-7b-lora-hf
#   or: python convert.py to-hf --ckpt out/llava15-7b-lora/step-005198 --lora-only --out llava15-7b-lora-adapter
out_dir = "out/llava15-7b-lora"
init_from = "out/llava15-7b-pretrain/step-002181"
data_dir = "data/llava-665k"
tokenizer = "ckpt/vicuna7b-clip336/tokenizer.model"
template = "vicuna_v1"
image_mode = "pad"
seq_len = 2048
stage = 2
lora = {"r": 128, "alpha": 256, "dropout": 0.05, "targets": ["llm"], "rslora": False}
batch_size = 128  # global, as LLaVA's 8 x 16
micro_batch_size = 16
max_iters = 5198  # 665,298 samples / 128
lr = 2e-4
lr_scale = {"vision": 1.0, "projector": 0.1, "llm": 1.0}  # mm_projector_lr 2e-5
min_lr = 0.0
warmup_iters = 156  # warmup ratio 0.03
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"
activation_checkpointing = True
loss_chunk = 4096
num_workers = 8
log_interval = 10
eval_interval = 500
eval_iters = 20
ckpt_interval = 500
keep_last = 2
