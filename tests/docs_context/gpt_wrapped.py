"""As docs_context/gpt.py, the model then wrapped by autopar, with its optimizer: a fragment that trains or saves
a wrapped model (`<!-- with: gpt_wrapped -->`)."""
import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

cfg = GPTConfig()
torch.manual_seed(0)
sample = batch = synthetic_tokens(8, cfg)
loss_fn = lm_loss
dataset = synthetic_tokens(32, cfg, seed=1)
model = autopar.wrap(GPT(cfg), sample=sample, loss_fn=lm_loss, verbose=False)
optimizer = opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
