# The report's RL stages at toy size, stage 3 of 4: general RL (GLM-5 report: rule-based rewards; trained here
# with the agentic objective, the report not spelling out its own) on the toy chat instructions, from the
# agentic stage's checkpoint (configs/rl_reasoning.py says the order).
init_from = "out_rl_agentic/ckpt.pt"
out_dir = "out_rl_general"
stage = "general"
mode = "async"
tau = 1
num_replicas = 2
tasks = "general:0:1"
eval_tasks = "math:0,search:0,terminal:0"
task_concurrency = 32
group_size = 8
groups_per_step = 16
max_steps = 30
max_tokens = 48
thinking = True
temperature = 1.0
lr_muon = 1.5e-3
lr_adamw = 5e-4
eval_every = 10
eval_episodes = 64
ckpt_every = 10
