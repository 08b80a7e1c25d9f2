# The GRPO demo (README "Reward models and RL", BENCHMARKS.md): the shapes VLM after only 250 SFT steps
# (configs/shapes.py), then GRPO on the training questions: 8 samples a question, reward 1 for the exact answer.
#   python data.py shapes --out data/shapes --n 20000
#   python train.py configs/shapes.py --out_dir=out/shapes-sft-250 --max_iters=250 --eval_interval=250
#   python train.py configs/grpo_shapes.py
out_dir = "out/shapes-grpo"
init_from = "out/shapes-sft-250/step-000250"
objective = "grpo"
grpo_group = 8
grpo_loss = "dapo"
grpo_reward = "exact_match"  # or a reward model: out/shapes-reward/step-000300 (configs/reward_shapes.py)
grpo_max_new_tokens = 6
grpo_temperature = 1.0
grpo_iterations = 1
grpo_beta = 0.0
batch_size = 16  # questions a step: 128 completions
micro_batch_size = 16
max_iters = 100
lr = 1e-4
min_lr = 1e-5
warmup_iters = 5
log_interval = 10
eval_interval = 0
ckpt_interval = 100
