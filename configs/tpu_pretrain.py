# LLaVA-1.5-7B stage 1 on a TPU pod (torch_xla SPMD), e.g. a v4-64 (32 chips, 8 hosts) or a v5p-64.
# The recipe is configs/pretrain.py's; only the backend differs. On every worker (scripts/tpu_env.sh sets LIBTPU_INIT_ARGS):
#   source scripts/tpu_env.sh && .venv/bin/python train.py configs/tpu_pretrain.py
# Everything lives in a bucket, the one storage every host of a pod sees (no mount): each host reads its part of the
# shards and writes its own checkpoint shards there; host 0 commits each step; every host resumes from it.
out_dir = "gs://MY-BUCKET/llava15-7b-pretrain"
init_from = "gs://MY-BUCKET/ckpt/vicuna7b-clip336"  # convert.py from-hf --llm ... --vision ... --out gs://... (see README)
data_dir = "gs://MY-BUCKET/data/llava-pretrain"  # shards from data.py pack --out gs://...
tokenizer = "gs://MY-BUCKET/ckpt/vicuna7b-clip336/tokenizer.model"
template = "plain"
image_mode = "crop"
seq_len = 2048
attention = "bounded"  # bounded memory: splash on a TPU, blockwise elsewhere (resolved at set-up, printed)
stage = 1
device = "xla"
mesh = [1, -1, 1]  # every chip in fsdp: the frozen 7B LLM and the projector are sharded 32 ways
dcn_mesh = [1, 1, 1]  # multi-slice: e.g. [2, 1, 1] puts data parallelism across two slices
batch_size = 256  # global
micro_batch_size = 256  # global rows a step under SPMD: 8 a chip on 32 chips, 32 read by each of 8 hosts
max_iters = 2181  # 558,128 samples / 256
lr = 1e-3
min_lr = 0.0
warmup_iters = 65
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"  # bf16 compute on the MXU, fp32 master weights and AdamW moments
activation_checkpointing = True  # torch_xla's checkpoint per ViT and LLM block
loss_chunk = 4096  # the fp32 [rows, 2048, 32064] logits (2.1 GB for 8 rows) never exist at once
num_workers = 8
log_interval = 10
eval_interval = 0
ckpt_interval = 200
keep_last = 2
