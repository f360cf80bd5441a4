"""Parameters some ranks' forwards use and others' do not, under FSDP2: task heads trained on some ranks only,
branches or experts the data chooses. What wrap does so that every rank's collectives match and the gradients are
what DDP's `find_unused_parameters=True` gives.

FSDP2 gathers a unit's parameters when the unit is called, and after its backward reduces only the parameters that
got a gradient. Ranks whose forwards call different units, or leave different parameters of one unit without a
gradient, issue collectives of different sizes: gloo aborts ("Received data size doesn't match expected size"), NCCL
hangs, and where the sizes happen to agree the ranks silently gather or add up different parameters (two branches of
one shape chosen per rank by the data, replicated on 2 gloo ranks: the ranks' weights drifted 0.03 apart).

From every rank's traced step (ModelProfile.params_unused; a block is uncalled where its forward did no FLOPs and
none of its parameters got a gradient), counted over the ranks (`find_unused`):
1. a container of blocks of which some ranks' traces left one uncalled and others' called it is *conditional*: none
   of its blocks becomes an FSDP unit, so the unit around them gathers them on every rank whichever the data calls
   (a block no trace called, a multimodal model's audio tower under text, stays a unit: wrap names its parameters
   among those no trace gave a gradient);
2. the units holding those blocks' parameters, or parameters some ranks' traces used and others' did not, reduce a
   zero gradient where a rank's backward gave none (FSDP2's `set_reduce_scatter_unused_params`): every rank reduces
   the same tensors, and the average is DDP's (the ranks that used a parameter, summed over all ranks);
3. at the end of each backward through the model (after FSDP2's reductions), those parameters no rank used since the
   last optimizer step (the module holding it ran no forward with gradients, and the reduced gradient is zero) get
   their gradient back as None, as one process and DDP leave them: AdamW skips them (no decay, no momentum step); a
   used one keeps its zero gradient, as there. `NONE_WHERE_UNUSED` (one optimizer step pre-hook for every model, as
   strategies.fsdp's BESIDE_SHARDS, does it where no backward did and starts the next step's count).

What no rank's traced sample shows (a block every trace called that a later batch skips on one rank) is not seen.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .._util.batch import tensors_of
from .._util.dist import ranks_with, world
from ..profile import ModelProfile
from .fsdp import reduce_unused


@dataclass(frozen=True)
class Unused:
    """What `find_unused` found over the ranks, by the whole model's names (before a pipeline split)."""

    conditional: tuple[str, ...] = ()  # blocks of containers with a block some ranks' traces called and others' not
    reduced: tuple[str, ...] = ()  # the trainable parameters whose units reduce zeros where a rank has no gradient:
    #                               those some ranks' traces used and others' did not, and the conditional blocks'
    nowhere: tuple[str, ...] = ()  # trainable parameters no rank's trace gave a gradient (outside conditional blocks)


def find_unused(model: nn.Module, profile: ModelProfile, blocks: Sequence[tuple[str, nn.Module]]) -> Unused:
    """Collective over every rank (one all-reduce), on the whole model (every rank has every name): see the module
    docstring."""
    unused = set(profile.params_unused)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flops = {b.name: b.forward_flops for b in profile.blocks}
    uncalled = [flops.get(n, 1.0) == 0 and _within(n, b, unused) for n, b in blocks]
    counts = ranks_with([n in unused for n in names] + uncalled)
    size = world().size
    parents = {n.rpartition(".")[0] for (n, _), k in zip(blocks, counts[len(names):]) if 0 < k < size}
    conditional = tuple(n for n, _ in blocks if n.rpartition(".")[0] in parents)
    reduced = [n for n, k in zip(names, counts) if 0 < k < size]
    for block in conditional:
        reduced += [f"{block}.{k}" for k, p in model.get_submodule(block).named_parameters() if p.requires_grad]
    reduced = list(dict.fromkeys(reduced))
    kept = set(reduced)
    nowhere = tuple(n for n, k in zip(names, counts) if k == size and n not in kept)
    return Unused(conditional, tuple(reduced), nowhere)


def _within(name: str, block: nn.Module, names: set[str]) -> bool:
    """Whether every trainable parameter of `block` (at `name` in the model; at least one) is among `names`."""
    trained = [f"{name}.{k}" for k, p in block.named_parameters() if p.requires_grad]
    return bool(trained) and all(n in names for n in trained)


def apply_unused(model: nn.Module, unused: Unused) -> list[str]:
    """Steps 2 and 3 for the parameters of `unused` this rank's `model` holds (a pipeline stage holds its own), once
    FSDP2 has sharded it; returns their names."""
    present = dict(model.named_parameters())
    names = [n for n in unused.reduced if n in present]
    if names:
        reduce_unused(model, names)
        NONE_WHERE_UNUSED.add(model, names)
    return names


class _NoneWhereUnused:
    """The models whose units reduce zeros for ranks without a gradient, with those parameters' names; at the end of
    each backward through the model (after FSDP2's reductions), those no rank used since the last optimizer step get
    their gradient back as None (one all-reduce), as one process leaves them; the optimizer step pre-hook does it
    where no backward through the model's output did, and starts the next step's count.

    Used: the module holding it ran a forward with gradients on this rank (a forward pre-hook marks it), or its
    reduced gradient is not zero (a weight read outside its module). A zero gradient alone does not say unused: the
    layers before a zero-initialised one (zero_init_residual, adaLN-Zero) get exact zeros, and one process and DDP
    step them (AdamW's decay and its step count). Names are looked up each time: materialising a meta model gives
    it new Parameter objects (and keeps its modules)."""

    def __init__(self) -> None:
        self._models: weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()
        self._called: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self._restored: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self._handle = None

    def add(self, model: nn.Module, names: Sequence[str]) -> None:
        self._models[model] = tuple(names)
        self._restored[model] = False
        for owner in {n.rpartition(".")[0] for n in names}:
            module = model.get_submodule(owner)
            if module not in self._called:
                self._called[module] = False
                module.register_forward_pre_hook(self._mark)
        model.register_forward_hook(self._after_forward)
        if self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handle = register_optimizer_step_pre_hook(self._check)

    def _mark(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._called[module] = True

    def _after_forward(self, model: nn.Module, args: Any, output: Any) -> None:
        """The backward of this output ends by restoring the Nones, after FSDP2's own end-of-backward (its callback,
        queued before: ours queues the restore behind every callback queued so far)."""
        tensors = [t for t in tensors_of(output) if t.requires_grad]
        if not tensors:
            return
        engine = torch.autograd.Variable._execution_engine
        ref = weakref.ref(model)

        def restore() -> None:
            if ref() is not None:
                self._restore(ref())

        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads: engine.queue_callback(lambda: engine.queue_callback(restore)), mode="any")

    def _watched(self, model: nn.Module) -> list[tuple[torch.Tensor, nn.Module]]:
        return [(model.get_parameter(n), model.get_submodule(n.rpartition(".")[0])) for n in self._models[model]]

    def _restore(self, model: nn.Module, params: list[tuple[torch.Tensor, nn.Module]] | None = None) -> None:
        """Collective: None back for the parameters (of `model`'s watched ones) no rank used since the last step."""
        params = self._watched(model) if params is None else params
        if not params:
            return
        device = _device([p for p, _ in params])
        used = torch.stack([_nonzero(p.grad, device) | self._called.get(owner, False) for p, owner in params])
        used = used.to(torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
        for (p, _), u in zip(params, used.tolist()):
            if not u:
                p.grad = None
        self._restored[model] = True

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in list(self._models.keys()):
            params = [(p, owner) for p, owner in self._watched(model) if id(p) in stepped]
            if not params:
                continue
            if not self._restored.get(model, False):
                self._restore(model, params)
            for _, owner in params:
                self._called[owner] = False
            self._restored[model] = False


def _nonzero(grad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Whether this rank's part of `grad` has an element that is not zero (a 0-d bool tensor on `device`)."""
    g = grad.to_local() if hasattr(grad, "to_local") else grad
    if g is None or not g.numel():
        return torch.zeros((), dtype=torch.bool, device=device)
    return g.ne(0).any().to(device)


def _device(params: Sequence[torch.Tensor]) -> torch.device:
    p = params[0]
    return (p.to_local() if hasattr(p, "to_local") else p).device


NONE_WHERE_UNUSED = _NoneWhereUnused()
