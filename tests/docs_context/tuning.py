"""The names docs/tuning.md's plan-cache fragment uses, at tiny sizes: a model's profile, a topology and a plan of
global batch 64 (the key's). tests/test_docs.py runs this before a block marked `<!-- with: tuning -->`."""
import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig, synthetic_tokens
from autopar.planning import resolve_topology

torch.manual_seed(0)
model = GPT(GPTConfig())
profile = autopar.profile_model(model, synthetic_tokens(8, GPTConfig()))
topology = resolve_topology("1xH200")
plan = autopar.Plan(micro_batch_size=64)  # one process: a global batch of 64
