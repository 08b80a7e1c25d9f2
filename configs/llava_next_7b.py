# LLaVA-NeXT-7B (llava-v1.6-vicuna-7b): CLIP ViT-L/14-336 + Vicuna-7B, anyres tiles over the v1.6 pinpoints.
# From the source, LLaVA-VL/LLaVA-NeXT scripts/train/pretrain_clip.sh and finetune_clip.sh: stage 1 trains the
# projector on BLIP-558K (plain template, lr 1e-3, one 336 px view an image); stage 2 trains everything with
# --image_aspect_ratio anyres, the v1.6 pinpoints, spatial_unpad, vision tower lr 2e-6, 1 epoch, cosine, warmup
# 0.03, no weight decay. The LLaVA-NeXT blog (2024-01) gives 760K stage-2 samples, batch 128 and LLM lr 2e-5
# (finetune_clip.sh's 1e-5 is its Qwen2 variant). Our choices: seq_len, pack, max_tiles, FSDP, checkpointing.
#   python convert.py from-hf --llm vicuna-7b-v1.5 --vision clip-vit-large-patch14-336 --out ckpt/next7b
#   python train.py configs/pretrain.py --init_from=ckpt/next7b --out_dir=out/next7b-s1          # stage 1
#   python convert.py anyres --ckpt out/next7b-s1/step-002181 --preset llava-next-vicuna-7b --out ckpt/next7b-s1
#   python data.py pack --json llava_v1_6_760k.json --images images/ --out data/next-760k --workers 16
#   torchrun --nproc_per_node=8 train.py configs/llava_next_7b.py                                  # stage 2
# Mistral: --llm Mistral-7B-Instruct-v0.2, --preset llava-next-mistral-7b, template llama_2 (LLaVA-NeXT's
# mistral_instruct is [INST] without the system prompt: llavax has no such template yet).
out_dir = "out/next7b-s2"
init_from = "ckpt/next7b-s1"
model = "llava-next-vicuna-7b"  # the shapes init_from holds (used only with init_from='scratch')
model_overrides = {}
data_dir = "data/next-760k"
tokenizer = "ckpt/next7b/tokenizer.model"
template = "vicuna_v1"
seq_len = 4096  # vicuna's context; an image takes at most 2928 tokens (base 576 + a 2x2 grid unpadded, newlines)
attention = "bounded"  # bounded memory: splash on a TPU, blockwise elsewhere (resolved at set-up, printed)
pack = 0  # one sample a row: a 640 x 480 image alone takes 2340 tokens, two do not fit 4096
max_tiles = 5  # a base view and at most 4 grid tiles (v1.6: 2x2, 1x3, 3x1)
stage = 0  # everything: LLM, projector, newline and the vision tower
lr_scale = {"vision": 0.1, "projector": 1.0, "llm": 1.0}  # vision tower 2e-6
batch_size = 128  # 128 samples a step, as the blog
micro_batch_size = 4
max_iters = 5938  # 760,000 samples / 128
lr = 2e-5
min_lr = 0.0
warmup_iters = 178  # warmup ratio 0.03
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
