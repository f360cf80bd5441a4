"""One rank of tests/distributed/test_checkpoint_fused.py's tp x dp_shard test, on 4 gloo processes: a model with a
fused q/k/v nn.Linear and a fused gate/up one (each weight split twice along dim 0: tensor parallelism's strided
shard, then FSDP's chunk of it). argv: FOLDER OUT.pt. Rank 0 writes: the full weights right after wrap and the
model's own; after 2 steps, the full weights saved; the full weights loaded under tp x dp_shard and dp_shard=4."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar

FOLDER, OUT = Path(sys.argv[1]), sys.argv[2]
IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(d, 8 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), GatedMLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Net(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, vocab: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def wrapped(seed: int, plan: autopar.Plan) -> tuple[nn.Module, dict, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = autopar.wrap(model, sample=IDS[: 4 // plan.dp_size], plan=plan, loss_fn=loss_fn, verbose=False,
                         global_batch_size=4)
    return model, own, torch.optim.AdamW(model.parameters(), lr=1e-2)


TWO_D = autopar.Plan(tp=2, dp_shard=2, micro_batch_size=2)
out: dict = {}
model, own, optimizer = wrapped(0, TWO_D)
out["own"], out["after_wrap"] = own, autopar.full_state_dict(model)
out["placements"] = {n: str(p.placements) for n, p in model.named_parameters() if "qkv.weight" in n}
step = autopar.train_step(model, optimizer, loss_fn=loss_fn)
for _ in range(2):
    step(autopar.local_batch(model, IDS))
autopar.save(model, optimizer, FOLDER)
out["saved"] = autopar.full_state_dict(model)
for name, plan in (("two_d", TWO_D), ("fsdp", autopar.Plan(dp_shard=4, micro_batch_size=1))):
    again, _, opt = wrapped(7, plan)
    autopar.load(again, opt, FOLDER)
    out[name] = autopar.full_state_dict(again)
if dist.get_rank() == 0:
    torch.save(out, OUT)
dist.destroy_process_group()
