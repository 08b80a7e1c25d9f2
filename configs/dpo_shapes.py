# The DPO demo (docs/post-training.md "DPO", BENCHMARKS.md): the shapes VLM after only 250 SFT steps
# (configs/shapes.py, 66.2% on the 2,000 held-out questions), then one round of on-policy DPO, as OneVision-Chat's
# iterative DPO does: the SFT model answers the training questions (greedy and 3 samples), its own wrong answers
# are rejected and the right ones chosen; the SFT checkpoint is the frozen reference. With the SFT term (RPO,
# LLaVA-NeXT's gamma) and lr 3e-4: 71.0%; but SFT alone on the same chosen answers reaches 71.1%, and pure DPO
# lowered accuracy here, on-policy (60.7%) or not: the gain is the choice of questions (BENCHMARKS.md).
#   python train.py configs/dpo_shapes.py
# Its inputs, in folders of its own (docs/post-training.md "DPO", with each step's time):
prepare = [
    "python data.py shapes --out data/shapes-dpo --n 20000 --preference",  # shards/ and preference/
    "python train.py configs/shapes.py --data_dir=data/shapes-dpo/shards --tokenizer=data/shapes-dpo/tokenizer.model "
    "--out_dir=out/shapes-dpo-sft-250 --max_iters=250 --eval_interval=250",
    "python dpo.py pairs --ckpt out/shapes-dpo-sft-250/step-000250 --data data/shapes-dpo/preference "
    "--out data/shapes-dpo/onpolicy",
]
out_dir = "out/shapes-dpo"
init_from = "out/shapes-dpo-sft-250/step-000250"
data_dir = "data/shapes-dpo/onpolicy"  # data/shapes-dpo/preference: off-policy pairs (a random wrong answer of the kind)
tokenizer = "data/shapes-dpo/tokenizer.model"
objective = "dpo"
dpo_beta = 0.1
dpo_loss = "sigmoid"
dpo_sft_weight = 1.0  # + the chosen answers' mean NLL
batch_size = 32  # pairs: 64 rows
micro_batch_size = 32
max_iters = 200
lr = 3e-4
min_lr = 3e-5
warmup_iters = 20
log_interval = 20
eval_interval = 100
eval_iters = 4
ckpt_interval = 200
