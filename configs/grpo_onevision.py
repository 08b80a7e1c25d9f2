# GRPO on LLaVA-OneVision-Qwen2-7B after its SFT stages (docs/post-training.md): TRL 1.16's GRPOConfig
# defaults, loss_type "dapo", beta 0 (no reference), num_generations 8, temperature 1.0, top_p 1.0, epsilon 0.2,
# num_iterations 1, learning_rate 1e-6, weight decay 0, max_grad_norm 1.0, Adam beta2 0.999, no warmup (then a linear
# decay to 0; ours is cosine to 0), gradient checkpointing, max_completion_length 512, and its VLM path (the image
# token suppressed in sampling). TRL's VLM example (examples/scripts/grpo_vlm.py) adds LoRA at lr 1e-5 (below),
# 1024 new tokens through vLLM, and its data: lmms-lab/multimodal-open-r1-8k-verified (7.69k problems with an image,
# 100 held out, images under 512 px), packed here as SFT records whose answer is the reference the reward reads.
#   python data.py pack --json mm-r1-8k.json --images mm-r1-8k-images --out data/mm-r1-8k --val-ratio 0.013
#   torchrun --nproc_per_node=8 train.py configs/grpo_onevision.py
# LoRA (grpo_vlm.py: q_proj and v_proj at lr 1e-5; TRL's ModelConfig r 16, alpha 32, dropout 0.05):
#   ... --lora="{'r': 16, 'alpha': 32, 'dropout': 0.05, 'targets': ['llm.attention.wq', 'llm.attention.wv']}" --lr=1e-5
out_dir = "out/ov7b-grpo"
init_from = "out/ov7b-ov/step-006250"  # the OneVision SFT checkpoint (configs/onevision_qwen2_7b.py)
model = "llava-onevision-qwen2-7b"
model_overrides = {}
data_dir = "data/mm-r1-8k"
tokenizer = "ckpt/ov7b/tokenizer.json"
template = "chatml"
objective = "grpo"
grpo_loss = "dapo"
grpo_beta = 0.0
grpo_group = 8
grpo_temperature = 1.0
grpo_top_p = 1.0
grpo_epsilon = 0.2
grpo_iterations = 1
grpo_max_new_tokens = 512
grpo_reward = "exact_match"  # grpo_vlm.py's math answers: a 'module:function' running math-verify (its accuracy_reward)
grpo_gather_for_generation = True  # TRL's ds3_gather_for_generation default: the 8B whole (16 GB bf16) while sampling
seq_len = 10240  # a prompt's image (at most ~8.8k tokens after anyres_max_9's reduction), question and answer
attention = "bounded"  # bounded memory: splash on a TPU, blockwise elsewhere (resolved at set-up, printed)
max_tiles = 37  # a 6x6 grid and its base view
stage = 0
lr_scale = {"vision": 1.0, "projector": 1.0, "llm": 1.0}
batch_size = 8  # prompts a step: 64 completions, TRL's 8 a device on 8 GPUs
micro_batch_size = 1  # a prompt (8 completions) a rank at a time
max_iters = 2850  # TRL's 3 epochs (num_train_epochs) of ~7.6k prompts at 8 a step
lr = 1e-6
min_lr = 0.0
warmup_iters = 0
beta2 = 0.999
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
parallel = "fsdp"
activation_checkpointing = True
num_workers = 8
log_interval = 10
eval_interval = 0
ckpt_interval = 100
keep_last = 2
final_accuracy_samples = 100
