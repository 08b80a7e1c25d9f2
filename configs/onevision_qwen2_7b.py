# LLaVA-OneVision-Qwen2-7B: SigLIP so400m-384 (26 layers) + Qwen2-7B-Instruct, anyres_max_9 over 1x1..6x6 tiles,
# several images a sample, video frames pooled 2x. From the source (LLaVA-VL/LLaVA-NeXT docs/LLaVA_OneVision.md,
# scripts/train/finetune_ov.sh): stage 1 projector only on LCS-558K (lr 1e-3, plain); then everything, 1 epoch a
# stage, AdamW, LLM and projector 1e-5, vision tower 2e-6, cosine, warmup 0.03, no weight decay, qwen_1_5
# (= our chatml), up to 32 frames a video: 1.5 on 4M captions/OCR/knowledge, 2 on 3.2M single images, then this
# file's OneVision stage on 1.6M image, multi-image and video samples (batch 256: 128 GPUs x 1 x 2 accumulation).
# Our choices: one view an image in stage 1 (then `convert.py anyres`), 256 a step in stages 1.5 and 2, and the
# static shapes: rows of 16384 tokens packed with samples (finetune_ov.sh truncates at 32768), 48 tile slots a row.
#   python convert.py from-hf --llm Qwen2-7B-Instruct --vision siglip-so400m-patch14-384 --vision-layer -2 \
#       --vision-select cls_patch --out ckpt/ov7b           # 27 layers, penultimate = LLaVA-OV's 26, last
#   python train.py configs/pretrain.py --init_from=ckpt/ov7b --tokenizer=ckpt/ov7b/tokenizer.json --out_dir=out/ov7b-s1
#   python convert.py anyres --ckpt out/ov7b-s1/step-002181 --preset llava-onevision-qwen2-7b --out ckpt/ov7b-s1
#   torchrun ... train.py configs/onevision_qwen2_7b.py --init_from=ckpt/ov7b-s1 \
#       --data_dir=configs/mixtures/onevision_mid_stage.yaml \
#       --max_iters=15625 --warmup_iters=469 --out_dir=out/ov7b-s15                        # stage 1.5
#   ... --init_from=out/ov7b-s15/step-015625 --data_dir=configs/mixtures/onevision_single_image.yaml \
#       --max_iters=12500 --warmup_iters=375 \
#       --out_dir=out/ov7b-si                                                               # stage 2, single image
#   torchrun ... train.py configs/onevision_qwen2_7b.py                                     # OneVision stage
out_dir = "out/ov7b-ov"
init_from = "out/ov7b-si/step-012500"
model = "llava-onevision-qwen2-7b"  # the shapes init_from holds (used only with init_from='scratch')
model_overrides = {}
data_dir = "configs/mixtures/onevision.yaml"  # the published sources and sampling rules (point its paths at yours)
tokenizer = "ckpt/ov7b/tokenizer.json"
template = "chatml"
seq_len = 16384  # an image takes at most ~8.8k tokens (729 base + <= 9 tiles' worth after reduction), 32 frames 6273
attention = "bounded"  # bounded memory: splash on a TPU, blockwise elsewhere (resolved at set-up, printed)
pack = 4
group_by_modality_length = True  # finetune_ov.sh: each step all image/video samples, or all text
max_tiles = 48  # a 6x6 grid and its base view (37) with room for smaller images in the row
stage = 0
lr_scale = {"vision": 0.2, "projector": 1.0, "llm": 1.0}  # vision tower 2e-6
batch_size = 64  # rows of four samples: 256 samples a step
micro_batch_size = 1
max_iters = 6250  # 1.6M samples / 256
lr = 1e-5
min_lr = 0.0
warmup_iters = 188  # warmup ratio 0.03
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
