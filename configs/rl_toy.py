# The toy RL run of rl_async.py on a 2-core CPU: two serve.py replicas of the toy SFT policy and the trainer,
# asynchronous, agentic RL on a mix of toy-level tasks (envs.py difficulty 0): single-digit arithmetic, a
# multi-turn shell task (a tool call, its result, then the reply) and a rule-based chat instruction.
# python rl_async.py configs/rl_toy.py     (makes out_sft_toy/ckpt.pt first if it is missing: see TOY_RECIPE)
init_from = "out_sft_toy/ckpt.pt"
out_dir = "out_rl"
stage = "agentic"
mode = "async"
num_replicas = 2
tasks = "math:0:1,terminal:0:1,general:0:1"
task_concurrency = 8
group_size = 8  # a task solved 1 time in 8 still gives most groups a reward to compare
groups_per_step = 2
ahead = 1
tau = 1  # one push behind is kept: in async mode a batch straddles at most one push
push_every = 1
max_steps = 60
max_tokens = 48  # toy replies are a short thought and an answer or one command
thinking = True  # the toy episodes were imitated with their thinking
temperature = 1.0
lr_muon = 5e-3  # placeholders (GLM-5 does not publish its RL rates), a quarter of the toy SFT's
lr_adamw = 1e-3
eval_every = 10
eval_episodes = 32
ckpt_every = 10
