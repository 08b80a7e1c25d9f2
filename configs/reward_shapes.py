# A reward model on the shapes preference pairs (docs/post-training.md, BENCHMARKS.md): the SFT model
# with a scalar head, Bradley-Terry on right (chosen) vs plausible wrong (rejected) answers.
#   python train.py configs/reward_shapes.py
# Its inputs, in folders of its own (docs/post-training.md "Reward model", with each step's time):
prepare = [
    "python data.py shapes --out data/shapes-reward --n 20000 --preference",
    "python train.py configs/shapes.py --data_dir=data/shapes-reward/shards --tokenizer=data/shapes-reward/tokenizer.model "
    "--out_dir=out/shapes-reward-sft-250 --max_iters=250 --eval_interval=250",
]
out_dir = "out/shapes-reward"
init_from = "out/shapes-reward-sft-250/step-000250"
data_dir = "data/shapes-reward/preference"
tokenizer = "data/shapes-reward/tokenizer.model"
objective = "reward"
reward_center_weight = 0.01
batch_size = 32  # pairs: 64 rows
micro_batch_size = 32
max_iters = 100
lr = 3e-4
min_lr = 3e-5
warmup_iters = 20
log_interval = 50
eval_interval = 50
eval_iters = 8
ckpt_interval = 100
