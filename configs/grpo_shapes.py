# The GRPO demo (docs/post-training.md, BENCHMARKS.md): the shapes VLM after only 66 SFT steps (50.8%
# held-out), then GRPO on the training questions: 8 samples a question, reward 1 for the exact answer (58.0%).
#   python train.py configs/grpo_shapes.py
# Its inputs, in folders of its own (docs/post-training.md "GRPO", with each step's time):
prepare = [
    "python data.py shapes --out data/shapes-grpo --n 6000",
    "python train.py configs/shapes.py --data_dir=data/shapes-grpo/shards --tokenizer=data/shapes-grpo/tokenizer.model "
    "--out_dir=out/shapes-grpo-sft-66 --max_iters=66 --lr_decay_iters=250",
]
out_dir = "out/shapes-grpo"
init_from = "out/shapes-grpo-sft-66/step-000066"
data_dir = "data/shapes-grpo/shards"
tokenizer = "data/shapes-grpo/tokenizer.model"
objective = "grpo"
grpo_group = 8
grpo_loss = "dapo"
grpo_reward = "exact_match"  # or a reward model on this tokenizer: out/shapes-ppo-reward/step-000100 (ppo_shapes.py)
grpo_max_new_tokens = 6
grpo_temperature = 1.0
grpo_iterations = 1
grpo_beta = 0.0
batch_size = 16  # questions a step: 128 completions
micro_batch_size = 16
max_iters = 100
lr = 3e-5  # 1e-4 and 3e-4 collapsed the groups (all samples alike) within 20 steps and gained nothing
min_lr = 3e-6
warmup_iters = 5
log_interval = 10
eval_interval = 0
ckpt_interval = 100
