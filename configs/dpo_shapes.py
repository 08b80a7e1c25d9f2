# The DPO demo (README "Preference training (DPO)", BENCHMARKS.md): the shapes VLM after only 250 SFT steps
# (configs/shapes.py, ~65% held-out), then DPO on the same training questions as pairs, the right answer chosen
# and a plausible wrong one (another colour, number, shape) rejected; the SFT checkpoint is the frozen reference.
#   python data.py shapes --out data/shapes --n 20000 --preference      # shards/ and preference/
#   python train.py configs/shapes.py --out_dir=out/shapes-sft-250 --max_iters=250 --eval_interval=250
#   python train.py configs/dpo_shapes.py
out_dir = "out/shapes-dpo"
init_from = "out/shapes-sft-250/step-000250"
data_dir = "data/shapes/preference"
objective = "dpo"
dpo_beta = 0.1
dpo_loss = "sigmoid"
batch_size = 32  # pairs: 64 rows
micro_batch_size = 32
max_iters = 200
lr = 1e-4
min_lr = 1e-5
warmup_iters = 20
log_interval = 20
eval_interval = 100
eval_iters = 4
ckpt_interval = 200
