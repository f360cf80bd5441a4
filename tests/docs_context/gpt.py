"""What a docs fragment's names stand for, at tiny sizes: your model (an autopar GPT), its batch, its loss, a
dataset and a plan. tests/test_docs.py runs this before a block marked `<!-- with: gpt -->`."""
import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

cfg = GPTConfig()
MyModel = GPT
torch.manual_seed(0)
model = GPT(cfg)
sample = batch = synthetic_tokens(8, cfg)
loss_fn = lm_loss
dataset = synthetic_tokens(32, cfg, seed=1)
plan = autopar.Plan(micro_batch_size=8)
