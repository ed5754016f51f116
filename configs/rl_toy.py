# The toy RL run of rl_async.py on a 2-core CPU: two serve.py replicas of the toy SFT policy and the trainer,
# asynchronous, on toy-level tasks (envs.py difficulty 0): single-digit arithmetic and a rule-based chat
# instruction (README: the RL section, with what this run does and does not show yet).
# python rl_async.py configs/rl_toy.py     (makes out_sft_toy/ckpt.pt first if it is missing: see TOY_RECIPE)
# The multi-turn tool tasks join with --tasks=math:0:1,general:0:1,terminal:0:1,search:0:1; the toy policy
# solves them 0 times in 24 held-out tries, so they give GRPO nothing to compare yet, and are left out here.
init_from = "out_sft_toy/ckpt.pt"
out_dir = "out_rl"
stage = "agentic"
mode = "async"
num_replicas = 2
tasks = "math:0:1,general:0:1"
task_concurrency = 8
group_size = 8  # a task solved 1 time in 8 still gives most groups a reward to compare
groups_per_step = 4
ahead = 1
tau = 1  # one push behind is kept: in async mode a batch straddles at most one push
push_every = 1
max_steps = 60
max_tokens = 48  # toy replies are a short thought and an answer or one command
thinking = True  # the toy episodes were imitated with their thinking
temperature = 1.0
lr_muon = 3e-3  # placeholders (GLM-5 does not publish its RL rates), about a sixth of the toy SFT's
lr_adamw = 6e-4
eval_every = 15
eval_episodes = 48
ckpt_every = 15
