# A few-million-parameter GLM-5 that trains on a 2-core laptop CPU: every part of the architecture is
# present (MLA with a latent, DSA with index_topk well below the sequence length, 1 dense + 3 MoE layers
# with 16 routed experts and a shared one, an MTP block), only smaller.
vocab_size = 4096
hidden_size = 128
intermediate_size = 384
moe_intermediate_size = 64
num_hidden_layers = 4
first_k_dense_replace = 1
num_attention_heads = 4
num_key_value_heads = 4
q_lora_rank = 64
kv_lora_rank = 32
qk_nope_head_dim = 32
qk_rope_head_dim = 16
v_head_dim = 32
n_routed_experts = 16
n_shared_experts = 1
num_experts_per_tok = 2
routed_scaling_factor = 2.5
rope_theta = 1e4
max_position_embeddings = 4096
index_topk = 64  # a quarter of block_size: sparse attention really drops tokens
index_n_heads = 4
index_head_dim = 32
num_nextn_predict_layers = 1
num_mtp_steps = 3
block_size = 256  # training sequence length (train.py)
# <|endoftext|>, <|user|>, <|observation|> of our 4,096-token BPE (tokenizer.py: 4,079 merged ids, then the
# special tokens), where GLM-5's published config.json has 154820, 154827, 154829 for the same three tokens
eos_token_id = [4079, 4083, 4085]

# The main job's pretraining recipe (python train.py configs/toy.py): the best sample and val loss found for
# about 5 minutes on a 2-core CPU (docs/2026-11-29-first-ten-minutes.md has the runs). The MTP loss is off for
# the first 85% of the steps: on a CPU its block and three extra passes double a step's time here (train.py's
# default is GLM-4.5's 0.3 then 0.1). Later stages and the workshop run pass their own steps and rates.
max_iters = 800
lr_muon = 0.01
lr_adamw = 0.006
mtp_weight_early = 0.0
mtp_switch_frac = 0.85
eval_interval = 100
sample_tokens = 200
