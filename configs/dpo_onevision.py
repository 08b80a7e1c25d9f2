# DPO on LLaVA-OneVision-Qwen2-7B after its SFT stages (docs/post-training.md "DPO"). From LLaVA-NeXT's
# scripts/train/dpo_ov7b.sh: beta 0.1, lr 5e-7, one epoch, cosine, warmup ratio 0.1, dpo_alpha 1 and gamma 0
# (the DPO loss alone: dpo_sft_weight 0). The reference is the SFT model itself, frozen. Ours: the batch of 32
# pairs, the rows (seq_len, tile slots as in configs/onevision_qwen2_7b.py) and bf16/FSDP2.
#   python data.py pack --json rlaif_v.json --images rlaif_v_images --out data/rlaif-v --val-ratio 0.01 --workers 16
#   python data.py audit data/rlaif-v --config configs/dpo_onevision.py        # counts, lengths, both answers
#   torchrun --nproc_per_node=8 train.py configs/dpo_onevision.py
out_dir = "out/ov7b-dpo"
init_from = "out/ov7b-ov/step-006250"  # the OneVision SFT checkpoint (configs/onevision_qwen2_7b.py)
dpo_reference = "out/ov7b-ov/step-006250"  # named, so that a resumed run (--resume=True) keeps its reference
model = "llava-onevision-qwen2-7b"
model_overrides = {}
data_dir = "data/rlaif-v"
tokenizer = "ckpt/ov7b/tokenizer.json"
template = "chatml"
objective = "dpo"
dpo_beta = 0.1
dpo_loss = "sigmoid"
dpo_sft_weight = 0.0
seq_len = 10240  # the prompt's image (at most ~8.8k tokens after anyres_max_9's reduction) and an answer
attention = "bounded"  # bounded memory: splash on a TPU, blockwise elsewhere (resolved at set-up, printed)
max_tiles = 37  # a 6x6 grid and its base view: one image a pair
stage = 0
lr_scale = {"vision": 1.0, "projector": 1.0, "llm": 1.0}
batch_size = 32  # pairs a step (2 rows each)
micro_batch_size = 1
max_iters = 2600  # one epoch: pairs / batch_size (about 83k pairs for RLAIF-V; audit yours)
lr = 5e-7
min_lr = 0.0
warmup_iters = 260  # warmup ratio 0.1
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"
activation_checkpointing = True
loss_chunk = 4096  # the log-probs through the chunked head: no full fp32 logits
num_workers = 8
log_interval = 10
eval_interval = 200
eval_iters = 8
ckpt_interval = 200
keep_last = 2
final_accuracy_samples = 0
