# The report's RL stages at toy size, stage 1 of 4: reasoning RL (GLM-5 report, post-training: GRPO +
# IcePop, the report's Eq. 1, entirely on-policy) on the toy arithmetic from the workshop run's SFT policy.
# Then configs/rl_agentic.py, rl_general.py and rl_distill.py, each from the last one's checkpoint:
#   python rl_async.py configs/rl_reasoning.py
#   python rl_async.py configs/rl_agentic.py
#   python rl_async.py configs/rl_general.py
#   python rl_async.py configs/rl_distill.py      # the final stage: each task from its own stage's teacher
# Every stage evaluates all four tasks, so what a later stage forgets, and what distillation brings back,
# shows in its log (docs/: the dated run).
init_from = "runs/cpu/sft_episodes/ckpt.pt"  # workshop/speedrun.py up to sft_episodes (rl_async.TOY_RECIPE)
out_dir = "out_rl_reasoning"
stage = "reasoning"
mode = "sync"  # on-policy: every batch sampled by the weights it trains (rl_async refuses async here)
tau = 0
push_every = 1
num_replicas = 2
tasks = "math:0:1"
eval_tasks = "general:0,search:0,terminal:0"
task_concurrency = 32
group_size = 8
groups_per_step = 16
max_steps = 30
max_tokens = 48
thinking = True
temperature = 1.0
lr_muon = 1.5e-3  # placeholders (GLM-5 does not publish its RL rates): configs/rl_toy.py's
lr_adamw = 5e-4
eval_every = 10
eval_episodes = 64
ckpt_every = 10
