# LLaVA-OneVision's recipe (configs/onevision_qwen2_7b.py) on the backbones of LLaVA-OneVision-1.5: Qwen3-8B and
# SigLIP2-so400m-384 less its last layer, anyres_max_9, several images a sample, video frames pooled 2x, the qwen3
# template. Qwen3's own <|image_pad|> / <|video_pad|> are the placeholders (preset onevision-qwen3-8b), so the
# vocabulary needs no new rows. Stages as OneVision's (stage 1 projector only, 1.5, 2, then this file's), on a
# v5p-128: `python bench.py xla` computes 13.4 GiB a chip of its 95 (109.6 with dense attention;
# tests/test_speed_levers.py fails if it does not fit).
#   python convert.py from-hf --llm Qwen3-8B --vision siglip2-so400m-patch14-384 --vision-layer -2 \
#       --vision-select cls_patch --out ckpt/ovq3                # 27 layers, penultimate = OneVision's 26, last
#   python train.py configs/pretrain.py --init_from=ckpt/ovq3 --tokenizer=ckpt/ovq3/tokenizer.json \
#       --template=qwen3 --out_dir=out/ovq3-s1
#   python convert.py anyres --ckpt out/ovq3-s1/step-002181 --preset onevision-qwen3-8b --out ckpt/ovq3-s1
#   then stage 1.5 and 2 as configs/onevision_qwen2_7b.py says, and: python train.py configs/onevision_qwen3_8b.py
out_dir = "out/ovq3-ov"
init_from = "out/ovq3-si/step-012500"
model = "onevision-qwen3-8b"  # the shapes init_from holds (used only with init_from='scratch')
model_overrides = {}
data_dir = "configs/mixtures/onevision.yaml"
tokenizer = "ckpt/ovq3/tokenizer.json"
template = "qwen3"
seq_len = 16384
attention = "bounded"  # splash on a TPU, blockwise elsewhere
pack = 4
group_by_modality_length = True  # finetune_ov.sh: each step all image/video samples, or all text
max_tiles = 48
stage = 0
lr_scale = {"vision": 0.2, "projector": 1.0, "llm": 1.0}  # vision tower 2e-6
batch_size = 64  # rows of four samples: 256 samples a step
micro_batch_size = 1
max_iters = 6250  # 1.6M samples / 256
lr = 1e-5
min_lr = 0.0
warmup_iters = 188
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"
activation_checkpointing = True
loss_chunk = 4096
num_workers = 8
log_interval = 10
eval_interval = 0
ckpt_interval = 500
keep_last = 2
