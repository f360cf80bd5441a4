"""One rank of tests/distributed/test_checkpoint_fused.py: a Hugging Face GPT-2 (its c_attn a fused q/k/v layer,
strided-sharded under tensor parallelism) trains 2 steps under tp=2 and is saved; a fresh model is loaded from the
checkpoint under tp=2 and under dp_shard=2. argv: FOLDER OUT.pt; rank 0 writes the full weights of each and the
loss each gives at one more step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import autopar

FOLDER, OUT = Path(sys.argv[1]), sys.argv[2]
IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
BATCH = {"input_ids": IDS, "labels": IDS}


def wrapped(seed: int, plan: autopar.Plan):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    sample = {k: v[: 4 // plan.dp_size] for k, v in BATCH.items()}  # one data-parallel rank's
    model = autopar.wrap(model, sample=sample, plan=plan, verbose=False, global_batch_size=4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def next_loss(model, optimizer) -> float:
    loss = autopar.train_step(model, optimizer)(autopar.local_batch(model, BATCH)).detach().reshape(())
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


out = {}
model, optimizer = wrapped(0, autopar.Plan(tp=2, micro_batch_size=4))
step = autopar.train_step(model, optimizer)
for _ in range(2):
    step(autopar.local_batch(model, BATCH))
autopar.save(model, optimizer, FOLDER)
out["saved"] = {k: v.clone() for k, v in autopar.full_state_dict(model).items()}  # (before the next step)
out["saved_next"] = next_loss(model, optimizer)
for name, plan in (("tp", autopar.Plan(tp=2, micro_batch_size=4)), ("fsdp", autopar.Plan(dp_shard=2, micro_batch_size=2))):
    again, opt = wrapped(7, plan)
    autopar.load(again, opt, FOLDER)
    out[name] = {k: v.clone() for k, v in autopar.full_state_dict(again).items()}
    out[f"{name}_next"] = next_loss(again, opt)
if dist.get_rank() == 0:
    torch.save(out, OUT)
dist.destroy_process_group()
