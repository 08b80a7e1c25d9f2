# PPO on LLaVA-OneVision-Qwen2-7B after its SFT stages (docs/post-training.md "PPO"): the seeds' EasyLM run
# (llama_train_ppo, a 13B policy and reward model on a v3-256, mesh 1,64,4) mapped onto OneVision-7B: 512 prompts a
# rollout batch with one completion each (rollouts_per_prompt 1), mini-batches of 64 (8 updates a batch), ppo_epochs 1,
# kl_coef 0.05 (k1), reward_gain 1 and reward_bias 0, max_continuation_len 1024, lr 1e-6 after a linear warmup over
# 10% of the updates then constant (EasyLM's end_lr = lr), AdamW without weight decay, one epoch over the prompts; and
# EasyLM's defaults for the rest: temperature 0.7, gamma 1, lam 0.95, cliprange 0.2 and 0.2 for the value, vf_coef 0.1,
# no reward whitening. The value model starts from the reward model, as EasyLM's does, and trains at the same lr.
# EasyLM sets the reward of a completion that does not end in EOS to -10; here 10 is subtracted from its score (TRL's
# missing_eos_penalty form). Unlike EasyLM, the old log-probs and values stay the rollout's (TRL's PPO).
# The prompts: RLAIF-V's questions packed as SFT records (the answer is not read: the reward model scores). The reward
# model: objective='reward' on RLAIF-V's pairs from the same SFT checkpoint (configs/dpo_onevision.py's data).
#   torchrun --nproc_per_node=8 train.py configs/dpo_onevision.py --objective=reward --out_dir=out/ov7b-rm \
#       --max_iters=2600 --lr=1e-6 --reward_center_weight=0.01
#   torchrun --nproc_per_node=8 train.py configs/ppo_onevision.py
# Memory (FSDP2 over 8 GPUs, fp32 master weights and AdamW moments, bf16 compute): the policy 15.0 GiB a GPU, the value
# model 14.2 (its LM head frozen), the reference and the reward model 3.7 each: 36.6 GiB before activations; the
# policy gathered whole in bf16 for generation (grpo_gather_for_generation) adds 15 GiB while sampling.
out_dir = "out/ov7b-ppo"
init_from = "out/ov7b-ov/step-006250"  # the OneVision SFT checkpoint (configs/onevision_qwen2_7b.py)
grpo_reference = "out/ov7b-ov/step-006250"  # named, so that a resumed run (--resume=True) keeps its reference
model = "llava-onevision-qwen2-7b"
model_overrides = {}
data_dir = "data/rlaif-v-prompts"
tokenizer = "ckpt/ov7b/tokenizer.json"
template = "chatml"
objective = "ppo"
grpo_reward = "out/ov7b-rm/step-002600"  # the reward model, and the value model's start (ppo_value_init '')
grpo_max_new_tokens = 1024
grpo_temperature = 0.7
grpo_top_p = 1.0
grpo_gather_for_generation = True  # the 8B whole (16 GB bf16) while sampling: no all-gather a token
ppo_kl_coef = 0.05
ppo_kl_estimator = "k1"
ppo_reward_gain = 1.0
ppo_reward_bias = 0.0
ppo_missing_end_penalty = 10.0
ppo_gamma = 1.0
ppo_lam = 0.95
ppo_whiten_rewards = False
ppo_epochs = 1
ppo_mini_batch_size = 64
ppo_clip = 0.2
ppo_clip_value = 0.2
ppo_vf_coef = 0.1
ppo_value_lr = 0.0  # the policy's lr
seq_len = 10240  # the prompt's image (at most ~8.8k tokens after anyres_max_9's reduction) and question
attention = "bounded"  # bounded memory: splash on a TPU, blockwise elsewhere (resolved at set-up, printed)
max_tiles = 37  # a 6x6 grid and its base view
stage = 0
lr_scale = {"vision": 1.0, "projector": 1.0, "llm": 1.0}
batch_size = 512  # prompts a rollout batch
micro_batch_size = 1  # a row a rank a micro-step: 8 micro-steps make a mini-batch of 64 on 8 GPUs
max_iters = 1296  # one epoch of ~83k prompts: 162 rollout batches x 8 updates
lr = 1e-6
min_lr = 1e-6  # constant after the warmup
warmup_iters = 130  # 10% of the updates (warmup_epochs 0.1)
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"
activation_checkpointing = True
num_workers = 8
log_interval = 8
eval_interval = 0
ckpt_interval = 64
keep_last = 2
final_accuracy_samples = 0
