# The report's RL stages at toy size, stage 4 of 4, the final one: on-policy cross-stage distillation (GLM-5
# report: the advantage sg[log pi_teacher - log pi_theta] through Eq. 1, group size 1, on-policy), every task
# taught by the final checkpoint of the stage that trained it, from the general stage's checkpoint.
init_from = "out_rl_general/ckpt.pt"
out_dir = "out_rl_distill"
stage = "distill"
mode = "sync"
tau = 0
push_every = 1
teachers = (
    "math:0=out_rl_reasoning/ckpt.pt,search:0=out_rl_agentic/ckpt.pt,terminal:0=out_rl_agentic/ckpt.pt,"
    "general:0=out_rl_general/ckpt.pt"
)
num_replicas = 2
tasks = "math:0:1,search:0:1,terminal:0:1,general:0:1"
task_concurrency = 32
group_size = 1  # one rollout per prompt: the teacher gives each token its advantage
groups_per_step = 64
max_steps = 20
max_tokens = 48
thinking = True
temperature = 1.0
lr_muon = 1.5e-3
lr_adamw = 5e-4
eval_every = 10
eval_episodes = 64
ckpt_every = 10
