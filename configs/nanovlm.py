# A nanoVLM-size model (huggingface/nanoVLM's models/config.py): SmolLM2-360M-Instruct + SigLIP2-base-patch16-512,
# trained together on one GPU, with nanoVLM's connector (preset nanovlm-460m, 460.1M parameters as nanoVLM's): the
# tower read after its final LayerNorm, each 4 x 4 block of patches one token (64 a 512 px image), one bias-free
# Linear(12288, 960); to-hf exports it as a SmolVLMForConditionalGeneration. Its learning rates are nanoVLM's:
# backbones 5e-5, the projector 100x (nanoVLM's 0.00512 for a fresh projector is 102x), batch 16 x 8.
# Four samples a row: each is 64 image tokens and a Cauldron conversation (a few hundred tokens, some over a thousand).
#   python convert.py from-hf --llm SmolLM2-360M-Instruct --vision siglip2-base-patch16-512 --vision-layer -1 \
#       --vision-select cls_patch --vision-post-norm --pixel-shuffle 4 --projector linear_nobias --out ckpt/nanovlm
#   python data.py pack --json the_cauldron.json --images images/ --out data/cauldron --val-ratio 0.005 --workers 16
#   python train.py configs/nanovlm.py
out_dir = "out/nanovlm"
init_from = "ckpt/nanovlm"
model = "nanovlm-460m"  # the shapes init_from holds (used only with init_from='scratch')
model_overrides = {}
data_dir = "data/cauldron"
tokenizer = "ckpt/nanovlm/tokenizer.json"
template = "smollm2"  # SmolLM2-Instruct's ChatML, its own default system prompt
image_mode = "resize"  # SigLIP's processor squashes to 512 x 512
seq_len = 4096
pack = 4  # six or more drop samples whose long conversations (tables, code) leave the row no room
stage = 0
lr_scale = {"vision": 1.0, "projector": 100.0, "llm": 1.0}
batch_size = 128  # nanoVLM: 2 x 8 accumulation per GPU on 8 GPUs; here 16 rows x 8 micro-steps on one
micro_batch_size = 16
max_iters = 20000
lr = 5e-5
min_lr = 0.0
warmup_iters = 600
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
compile = True
activation_checkpointing = True
loss_chunk = 4096
num_workers = 8
log_interval = 10
eval_interval = 500
eval_iters = 20
ckpt_interval = 1000
keep_last = 2
