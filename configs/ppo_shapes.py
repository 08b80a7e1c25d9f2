# The PPO demo (docs/post-training.md "PPO", BENCHMARKS.md): GRPO's start (the shapes VLM after only 66 SFT steps,
# 50.8% held-out) and the shapes reward model (configs/reward_shapes.py, from 250 SFT steps) as the reward and the
# value model's start; one sample a question, 64 questions a rollout batch, 2 epochs of 4 mini-batches of 16 (8
# updates a batch), a k1 KL penalty to the start at the seeds' 0.05: 54.4% after 200 steps (GRPO: 58.0%). The reward
# model must read the run's tokenizer: make its pairs from the same shapes data (--preference).
#   python train.py configs/ppo_shapes.py
# Its inputs, in folders of its own (docs/post-training.md "PPO", with each step's time):
prepare = [
    "python data.py shapes --out data/shapes-ppo --n 6000 --preference",
    "python train.py configs/shapes.py --data_dir=data/shapes-ppo/shards --tokenizer=data/shapes-ppo/tokenizer.model "
    "--out_dir=out/shapes-ppo-sft-66 --max_iters=66 --lr_decay_iters=250",
    "python train.py configs/shapes.py --data_dir=data/shapes-ppo/shards --tokenizer=data/shapes-ppo/tokenizer.model "
    "--out_dir=out/shapes-ppo-sft-250 --max_iters=250 --eval_interval=250",
    "python train.py configs/reward_shapes.py --data_dir=data/shapes-ppo/preference "
    "--tokenizer=data/shapes-ppo/tokenizer.model --init_from=out/shapes-ppo-sft-250/step-000250 "
    "--out_dir=out/shapes-ppo-reward",
]
out_dir = "out/shapes-ppo"
init_from = "out/shapes-ppo-sft-66/step-000066"
data_dir = "data/shapes-ppo/shards"
tokenizer = "data/shapes-ppo/tokenizer.model"
objective = "ppo"
grpo_reward = "out/shapes-ppo-reward/step-000100"  # also the value model's start (ppo_value_init '')
grpo_max_new_tokens = 6
grpo_temperature = 1.0
ppo_kl_coef = 0.05
ppo_epochs = 2
ppo_mini_batch_size = 16
batch_size = 64  # questions a rollout batch: one completion each
micro_batch_size = 16
max_iters = 200  # 25 rollout batches: 1600 questions, GRPO's 100 steps x 16
lr = 3e-5  # GRPO's (configs/grpo_shapes.py)
min_lr = 3e-6
warmup_iters = 10
log_interval = 8
eval_interval = 0
ckpt_interval = 200
