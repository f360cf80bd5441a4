"""Worker of tests/strategies/test_fsdp_params.py (torchrun, gloo, 2 ranks; the reference in one plain process).

argv: OUT.pt. Every scenario under its data-parallel plan on the ranks; rank 0 writes the loss of every step, every
parameter and gradient in full after the last step (train_step scenarios: the gradients of one more backward), and
each parameter's kind (DTensor: sharded; Parameter: replicated) and dtype. `run_reference(name)`: the same model
trained unwrapped in one process on the global batch.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar

STEPS = 3
ROWS = 8  # the global batch: 4 per rank on 2 ranks
DIM, CLASSES, BLOCKS, MODES = 16, 8, 3, 6


class Spectral(nn.Module):
    """A Fourier layer: the first MODES frequencies of the features scaled by complex weights, all but the first
    shifted by complex `shift` (MODES - 1 elements: 2 shards do not divide it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(MODES, dtype=torch.cfloat) * 0.5)
        self.shift = nn.Parameter(torch.randn(MODES - 1, dtype=torch.cfloat) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        freq = torch.fft.rfft(h.float(), dim=-1)
        kept = freq[..., :MODES] * self.weight + torch.cat([self.shift.new_zeros(1), self.shift])
        return torch.fft.irfft(torch.cat([kept, torch.zeros_like(freq[..., MODES:])], dim=-1), n=h.shape[-1])


class FourierBlock(nn.Module):
    """A Fourier neural operator's block: complex spectral weights beside a real Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.spectral = Spectral()
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.spectral(h).to(h.dtype) + self.mix(h))


class Float64Scale(nn.Module):
    """A block holding a float64 Parameter directly beside its float32 Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h) * self.scale.to(h.dtype))


class Float64Linear(nn.Module):
    """A block with a float64 Linear (a module of its own) beside a float32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.precise = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h) + self.precise(h.double()).to(h.dtype))


class Net(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class ListedParams(nn.Module):
    """No blocks: the model reads its weights from a ParameterList and a ParameterDict, which run no forward of
    their own (FSDP2 gathers a unit's parameters when the unit is called: such a container can be no unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5) for _ in range(BLOCKS))
        self.scales = nn.ParameterDict({f"s{i}": nn.Parameter(torch.ones(DIM)) for i in range(BLOCKS)})
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        for i, w in enumerate(self.weights):
            x = x + torch.tanh(x @ w) * self.scales[f"s{i}"]
        return self.head(x)


class ChannelsLast(nn.Module):
    """A conv net moved to channels_last, as CNNs are for speed (weights and inputs): FSDP2 shards only contiguous
    weights ("FSDP does not support non-contiguous parameters yet")."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, CLASSES)
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.convs(x.view(-1, 2, 2, DIM // 4).contiguous(memory_format=torch.channels_last))
        return self.head(h.mean((2, 3)))


WHOLE_MODELS = (ListedParams, ChannelsLast)  # scenarios whose "block" is the whole model


def build(block: type[nn.Module]) -> nn.Module:
    """The model of a scenario: Net over `block`, or `block` itself where it is a whole model (WHOLE_MODELS)."""
    torch.manual_seed(0)
    return block() if block in WHOLE_MODELS else Net(block)


def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, DIM, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out.float(), batch[1])


# name: (block, plan fields, train with autopar.train_step); every plan has 2 data-parallel ranks.
SCENARIOS = {
    "complex_sharded": (FourierBlock, dict(dp_shard=2, micro_batch_size=4), False),
    "complex_replicated": (FourierBlock, dict(dp_replicate=2, micro_batch_size=4), False),
    "float64_param_accum": (Float64Scale, dict(dp_shard=2, micro_batch_size=2, grad_accum=2), True),
    "float64_module_bf16": (Float64Linear, dict(dp_shard=2, micro_batch_size=4, precision="bf16"), False),
    "listed_params_sharded": (ListedParams, dict(dp_shard=2, micro_batch_size=4), False),
    "channels_last_sharded": (ChannelsLast, dict(dp_shard=2, micro_batch_size=4), False),
    # train_step clipping the gradient norm (CLIP): the complex weights' |z|^2 counted, sharded and replicated ones
    "complex_sharded_clipped": (FourierBlock, dict(dp_shard=2, micro_batch_size=2, grad_accum=2), True),
    # a loop of the user's own clipping with autopar.clip_grad_norm_ (torch's refuses the replicated weights' mix)
    "complex_sharded_user_clipped": (FourierBlock, dict(dp_shard=2, micro_batch_size=4), False),
    # a loop written for DDP: two halves of the batch a step, the first backward under model.no_sync()
    "ddp_loop_no_sync_sharded": (Float64Linear, dict(dp_shard=2, micro_batch_size=4), False),
    "ddp_loop_no_sync_replicated": (Float64Linear, dict(dp_replicate=2, micro_batch_size=4), False),
    # AdamW(foreach=True), as a GPU defaults to: the replicated complex weights beside the sharded ones
    "complex_sharded_foreach": (FourierBlock, dict(dp_shard=2, micro_batch_size=4), False),
}
CLIP = 0.05  # below the model's gradient norm: every step is clipped


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _optimizer(model: nn.Module, foreach: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)


def run_ranks(name: str) -> dict:
    block, fields, with_step = SCENARIOS[name]
    plan = autopar.Plan(**fields)
    local = plan.local_batch_size
    x, y = batch_of(0)
    with warnings.catch_warnings(record=True) as at_wrap:  # what autopar says while wrapping
        warnings.simplefilter("always")
        model = autopar.wrap(build(block), sample=(x[:local], y[:local]), plan=plan, loss_fn=loss_fn, verbose=False)
    rank, size = autopar.data_shard(model)
    gathered: dict[str, torch.dtype] = {}  # the dtype each Linear computes with, as the forward sees its weight
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, args, n=n: gathered.__setitem__(n, mod.weight.dtype))
    sync_calls: list[bool] = []  # what model.no_sync() switches (FSDP2's gradient synchronisation)
    if name.startswith("ddp_loop_no_sync"):
        switch = model.set_requires_gradient_sync
        model.set_requires_gradient_sync = lambda on, **kw: sync_calls.append(on) or switch(on, **kw)
    opt = _optimizer(model, foreach=name.endswith("_foreach"))
    step = autopar.train_step(model, opt, loss_fn, max_grad_norm=CLIP if name.endswith("_clipped") else None) \
        if with_step else None
    losses, norms = [], []
    with warnings.catch_warnings(record=True) as said:  # what autopar says while training
        warnings.simplefilter("always")
        for i in range(STEPS):
            x, y = batch_of(i)
            mine = (x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
            if step is not None:
                loss = step(mine).detach()
            elif name.startswith("ddp_loop_no_sync"):  # DDP's accumulation: no reduction until the last backward
                opt.zero_grad(set_to_none=True)
                half = local // 2
                with model.no_sync():
                    first = loss_fn(model(mine[0][:half]), (None, mine[1][:half])) / 2
                    first.backward()
                second = loss_fn(model(mine[0][half:]), (None, mine[1][half:])) / 2
                second.backward()
                opt.step()
                loss = (first + second).detach()
            else:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(mine[0]), mine)
                loss.backward()
                if name.endswith("_clipped"):
                    norms.append(autopar.clip_grad_norm_(model, CLIP).item())
                opt.step()
                loss = loss.detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / size)
    x, y = batch_of(STEPS)  # the gradients of one more backward
    opt.zero_grad(set_to_none=True)
    mine = (x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
    loss_fn(model(mine[0]), mine).backward()
    return {"losses": losses, "norms": norms, "notes": list(autopar.applied(model).notes),
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
            "kinds": {n: type(p).__name__ for n, p in model.named_parameters()},
            "dtypes": {n: p.dtype for n, p in model.named_parameters()}, "gathered": gathered, "sync_calls": sync_calls,
            "said": [str(w.message) for w in [*at_wrap, *said] if str(w.message).startswith("autopar:")]}


def run_reference(name: str, *, autocast: bool = False) -> dict:
    block, _, _ = SCENARIOS[name]
    model = build(block)
    opt = _optimizer(model)
    losses, norms = [], []
    for i in range(STEPS + 1):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(batch_of(i)[0]), batch_of(i))
        loss.backward()
        if i < STEPS:
            if name.endswith("_clipped"):
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
                assert norms[-1] > CLIP  # (it clips)
            opt.step()
            losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def main() -> None:
    from tests.distributed._launch import worker_main

    names = [n for n in (os.environ.get("SCENARIOS") or ",".join(SCENARIOS)).split(",") if n]
    worker_main(run_ranks, names, sys.argv[1])


if __name__ == "__main__":
    main()
