# The toy RL run of rl_async.py on a 2-core CPU: two serve.py replicas of the toy SFT policy and the
# trainer, asynchronous, on a mix of three tasks of envs/'s toy level: the rule-based chat instruction
# (general:0: greet a name or describe a topic within a word limit, ending with "!", the name boxed, or all
# lower / upper case), the multi-turn search task (search:0: call the search tool with the name asked
# about, then answer with the number its hit shows) and the terminal task (terminal:0: one shell command,
# or two, listing a directory and then reading the file found there), with single-digit arithmetic
# evaluated alongside so that forgetting shows (README: the RL section, with the curves).
# python rl_async.py configs/rl_toy.py     (makes the workshop policy first if missing: TOY_RECIPE)
# python rl_async.py configs/rl_toy.py --mode=sync     (the same run, generate-then-train)
# Math's held-out questions are digit pairs SFT never showed, facts no policy can infer, so training on math
# moves only the questions SFT saw (README).
init_from = "runs/cpu/sft_episodes/ckpt.pt"  # workshop/speedrun.py up to sft_episodes
out_dir = "out_rl"
stage = "agentic"
mode = "async"
num_replicas = 2
tasks = "general:0:1,search:0:1,terminal:0:1"
eval_tasks = "math:0"
task_concurrency = 32  # rollouts of one task in flight: the replicas decode them as one batch
group_size = 8  # a task solved 1 time in 8 still gives most groups a reward to compare
groups_per_step = 16  # 128 samples a step: with fewer the step is mostly noise (README)
ahead = 1
tau = 1  # one push behind is kept: in async mode a batch straddles at most one push
push_every = 1
max_steps = 90  # about 13.5 min on 2 cores; 100 took 15 (README)
max_tokens = 48  # toy replies are a short thought and an answer or one command
thinking = True  # the toy episodes were imitated with their thinking
temperature = 1.0
lr_muon = 1.5e-3  # placeholders (GLM-5 does not publish its RL rates), about a thirteenth of the toy SFT's
lr_adamw = 5e-4
eval_every = 10
eval_episodes = 64
ckpt_every = 10
