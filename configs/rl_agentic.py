# The report's RL stages at toy size, stage 2 of 4: agentic RL (GLM-5 report: direct double-sided importance
# sampling, asynchronous, r - mean(r) advantages, the optimizer reset after each push) on the two multi-turn
# tool tasks, from the reasoning stage's checkpoint (configs/rl_reasoning.py says the order).
init_from = "out_rl_reasoning/ckpt.pt"
out_dir = "out_rl_agentic"
stage = "agentic"
mode = "async"
tau = 1
num_replicas = 2
tasks = "search:0:1,terminal:0:1"
eval_tasks = "math:0,general:0"
task_concurrency = 32
group_size = 8
groups_per_step = 16
max_steps = 60
max_tokens = 48
thinking = True
temperature = 1.0
lr_muon = 1.5e-3
lr_adamw = 5e-4
eval_every = 20
eval_episodes = 64
ckpt_every = 20
