"""FSDP2: `fully_shard` each block, then the root, over the data-parallel mesh.

A 1-D mesh shards parameters, gradients and optimizer state over all its ranks (ZeRO-3); a 2-D mesh
(dp_replicate, dp_shard) is HSDP: sharded within a group, replicated across groups (with dp_shard = 1,
plain replication, like DDP). CPU offload keeps the sharded parameters, gradients and optimizer state
in host memory and runs the optimizer there.

A parameter FSDP2 cannot shard (a 0-d one, such as CLIP's `logit_scale`: fully_shard refuses scalars) is
left out of every unit (`ignored_params`) and kept replicated instead: moved to the mesh's device, made
the same on every rank (broadcast from the mesh's first rank), and its gradient averaged over the mesh's
ranks after each backward that FSDP would reduce in (`_ReplicatedParams`).

A module that several units reach (one module object held by every block, an ALBERT-like shared layer, or
held both by a block and outside the blocks) would be sharded by each unit that reaches it, which FSDP2
cannot do (a second `fully_shard` of a sharded parameter fails on "Cannot concatenate overlapping meshes"):
it becomes an FSDP unit of its own before the blocks are wrapped, so it is sharded once, gathered at its first
use and kept gathered to the end of the forward, and its gradient reduced from every use (`shared_modules`).
A Parameter object registered on several distinct modules in different units (`block.w = shared_weight` in each
block) has no module to make a unit of: it is replicated as the 0-d ones are.

FSDP2 gathers a unit's parameters as one flat tensor of one dtype, so fully_shard refuses a unit whose parameters
are of several ("FSDP expects uniform original parameter dtype"), such as a Fourier neural operator's block, whose
complex spectral weights sit beside real convolutions. Within such a unit, the outermost modules whose parameters
are all of one dtype other than the unit's main one (most bytes) become units of their own, sharded first; a
parameter of another dtype held directly by a module that also holds the main one is replicated, as the 0-d ones
are (`dtype_units`). Only float32 (and fp16) units are cast to bf16 for compute, as autocast casts only those: a
complex or float64 weight keeps its dtype under every plan (autopar.strategies.precision.fsdp_policy). A complex
parameter whose first dimension the shard count does not divide is replicated too: FSDP2 pads it for the shards, and
with torch 2.13 on gloo such a weight (5 complex elements over 2 ranks) trained wrong, 5.6e-2 relative after 3 steps
(tests/strategies/test_fsdp_params.py), while one the shards divide trained as one process.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import PlanError
from .precision import fsdp_policy


def unshardable_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters of `model` that fully_shard refuses to shard (0-d ones), by name, each once."""
    return [(name, p) for name, p in model.named_parameters() if p.dim() == 0]


def shared_modules(model: nn.Module, units: Sequence[nn.Module]) -> tuple[list[tuple[str, nn.Module]],
                                                                        list[tuple[str, nn.Parameter]]]:
    """What more than one FSDP unit of `model` reaches, as (first name, object) pairs: the outermost modules
    reached from several of `units` or from one of them and from outside them all (the root unit), and the
    Parameters so reached outside those modules (one Parameter registered on distinct modules)."""
    unit_of = {id(m): i for i, m in enumerate(units)}
    reach: dict[int, set[int]] = {}  # id of a module or Parameter -> the units it is reached from (-1: the root)
    names: dict[int, str] = {}
    objects: dict[int, nn.Module | nn.Parameter] = {}

    def walk(module: nn.Module, unit: int, prefix: str) -> None:
        unit = unit_of.get(id(module), unit)
        for key, obj in [(prefix.rstrip("."), module)] + [
                (prefix + n, p) for n, p in module._parameters.items() if p is not None]:
            reach.setdefault(id(obj), set()).add(unit)
            names.setdefault(id(obj), key)
            objects[id(obj)] = obj
        for n, child in module._modules.items():
            if child is not None:
                walk(child, unit, f"{prefix}{n}.")

    walk(model, -1, "")
    shared = {i for i, units_ in reach.items() if len(units_) > 1}
    modules = [i for i in shared if isinstance(objects[i], nn.Module)]
    inner = {id(sub) for i in modules for sub in list(objects[i].modules())[1:]}
    outer = [i for i in modules if i not in inner]
    covered = {id(p) for i in outer for p in objects[i].parameters()}
    params = [i for i in shared if isinstance(objects[i], nn.Parameter) and i not in covered]
    order = {id(p): k for k, (_, p) in enumerate(model.named_parameters())}
    order.update({id(m): k for k, (_, m) in enumerate(model.named_modules())})
    return ([(names[i], objects[i]) for i in sorted(outer, key=order.get)],
            [(names[i], objects[i]) for i in sorted(params, key=order.get)])


def dtype_units(model: nn.Module, units: Sequence[nn.Module], *, skip: Sequence[nn.Parameter] = ()
                ) -> tuple[dict[int, list[tuple[str, nn.Module]]], list[tuple[str, nn.Parameter]]]:
    """For the units of `model` (`units`, then the root) whose parameters are of several dtypes: {id(unit): the
    modules under it to shard first, as (name, module), outermost first}, and the parameters to replicate instead
    (see the module docstring). `skip`: parameters already kept out of every unit."""
    names = {id(m): n for n, m in model.named_modules()}
    param_names = {id(p): n for n, p in model.named_parameters()}
    skipped = {id(p) for p in skip}
    nested = {id(u) for u in units}

    def managed(module: nn.Module) -> list[nn.Parameter]:
        """The parameters `module`'s unit would gather: not those of units nested in it, nor skipped ones."""
        out, todo, seen = [], [module], set()
        while todo:
            m = todo.pop()
            out += [p for p in m._parameters.values()
                    if p is not None and id(p) not in skipped and id(p) not in seen and not seen.add(id(p))]
            todo += [c for c in m._modules.values() if c is not None and id(c) not in nested]
        return out

    extra: dict[int, list[tuple[str, nn.Module]]] = {}
    replicated: list[tuple[str, nn.Parameter]] = []
    for unit in list(units) + [model]:
        params = managed(unit)
        if len({p.dtype for p in params}) < 2:
            continue
        size: dict[torch.dtype, int] = {}
        for p in params:
            size[p.dtype] = size.get(p.dtype, 0) + p.numel() * p.element_size()
        main = max(size, key=size.get)
        todo = [c for c in unit._modules.values() if c is not None and id(c) not in nested]
        while todo:
            module = todo.pop(0)
            kinds = {p.dtype for p in managed(module)}
            if len(kinds) == 1 and main not in kinds:  # all of one other dtype: a unit of its own
                extra.setdefault(id(unit), []).append((names.get(id(module), type(module).__name__), module))
                nested.add(id(module))
            elif len(kinds) > 1:
                todo += [c for c in module._modules.values() if c is not None and id(c) not in nested]
        replicated += [(param_names[id(p)], p) for p in managed(unit) if p.dtype != main]
    return extra, replicated


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Sequence[tuple[str, nn.Module]],
    precision: str,
    reshard_after_forward: bool,
    cpu_offload: bool,
    outer_units: Sequence[nn.Module] | None = None,
) -> list[str]:
    """Shard `model` over `mesh`: one FSDP unit per block, the rest (embeddings, head) in the root unit; returns the
    names of the parameters of more than one element kept replicated beside the shards.

    With `outer_units` (a pipeline stage, whose forward stops after its last block), the modules around
    the blocks are units of their own and no unit wraps the whole model. Parameters FSDP2 cannot shard
    stay out of every unit, replicated over `mesh`; a module several units reach is a unit of its own (see the
    module docstring).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    blocks = list({id(block): (name, block) for name, block in blocks}.values())  # a block listed twice: one unit
    own_units, shared_params = shared_modules(model, [b for _, b in blocks] + list(outer_units or ()))
    # the parameters kept out of every unit and replicated, each once: 0-d, shared by units, then of another dtype
    replicated = {id(p): (n, p) for n, p in [*unshardable_params(model), *shared_params]}
    block_units = [b for _, b in blocks]
    units = [m for _, m in own_units] + block_units + list(outer_units or ())
    by_dtype, mixed = dtype_units(model, units, skip=[p for _, p in replicated.values()])
    shards = mesh.size(mesh.ndim - 1) if mesh is not None else 1  # the dp_shard dimension (an HSDP mesh's last)
    mixed += [(n, p) for n, p in model.named_parameters() if p.is_complex() and p.dim() and p.shape[0] % shards]
    for n, p in mixed:
        replicated.setdefault(id(p), (n, p))
    scalars = list(replicated.values())
    extra: dict = {}
    if scalars:
        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise PlanError(
                f"{type(model).__name__} has parameters FSDP2 cannot shard ({', '.join(n for n, _ in scalars[:3])}: "
                f"0-d, shared by several units or of another dtype), and this torch ({torch.__version__}) has no "
                "fully_shard(ignored_params=) to leave them out: upgrade torch (or make 0-d ones 1-D tensors of one "
                "element)."
            )
        extra["ignored_params"] = {p for _, p in scalars}
    ignored = set(replicated)

    def shard(module: nn.Module, *, reshard: bool, root: bool) -> None:
        # its modules of another dtype first (dtype_units), then the unit itself, each cast as autocast would
        for _, sub in by_dtype.get(id(module), ()):
            shard(sub, reshard=reshard, root=False)
        dtype = next((p.dtype for p in module.parameters() if id(p) not in ignored and not _is_sharded(p)), None)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=fsdp_policy(precision, root=root, dtype=dtype), offload_policy=offload, **extra)

    for _, module in own_units:
        # Used by several blocks: gathered at its first use and kept so until the forward ends.
        shard(module, reshard=False, root=False)
    for index, block in enumerate(block_units):
        # The last block's parameters are needed again at once when backward starts: keep them gathered.
        shard(block, reshard=reshard_after_forward and index < len(blocks) - 1, root=False)
    if outer_units is not None:
        for module in outer_units:
            shard(module, reshard=reshard_after_forward, root=True)
    else:
        shard(model, reshard=reshard_after_forward, root=True)
    if scalars:
        _ReplicatedParams(model, [n for n, _ in scalars], mesh, root_unit=outer_units is None)
    return [n for n, p in scalars if p.dim() > 0]


def contiguous_weights(model: nn.Module) -> list[str]:
    """Make the parameters stored in another memory format (a conv net moved to channels_last) contiguous, which
    FSDP2 needs ("FSDP does not support non-contiguous parameters yet"); returns their names. The values, and the
    activations' format that the inputs set, are unchanged."""
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
                names.append(name)
    return names


def reduce_unused(model: nn.Module, names: Sequence[str]) -> None:
    """Make the FSDP units holding parameters `names` (used by some ranks' forwards and not others') reduce a zero
    gradient for a parameter its rank's backward gave none, so that every rank's reduce-scatter has the same size
    (FSDP2 reduces only the parameters with a gradient: ranks with different ones mismatch their collectives, which
    gloo aborts on and NCCL hangs on); the others keep a None gradient for parameters no rank used."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise PlanError(f"{names[0]} is used by some ranks' samples and not others', which FSDP2 of torch "
                        f"{torch.__version__} cannot reduce (no set_reduce_scatter_unused_params): upgrade torch, or "
                        "make every rank's forward use every parameter (e.g. compute every head and weigh its loss).")
    modules = dict(model.named_modules())
    for name in names:
        path = name.split(".")[:-1]
        while path and not isinstance(modules[".".join(path)], FSDPModule):
            path.pop()
        unit = modules[".".join(path)]
        if isinstance(unit, FSDPModule):
            unit.set_reduce_scatter_unused_params(True, recurse=False)


def give_no_sync(model: nn.Module) -> None:
    """Give the wrapped model DDP's `no_sync()` where it has none, so that a loop written for DDP runs unchanged:
    a context in which backward accumulates gradients without reducing them (FSDP2's
    `set_requires_gradient_sync(False)`, switched back on at its exit, so the next backward reduces the sum); on a
    model FSDP2 does not manage (one process), nothing to hold back."""
    if hasattr(model, "no_sync"):
        return

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        switch = getattr(model, "set_requires_gradient_sync", None)
        if switch is None:
            yield
            return
        switch(False)
        try:
            yield
        finally:
            switch(True)

    model.no_sync = no_sync


def _is_sharded(p: nn.Parameter) -> bool:
    """Already a DTensor: sharded by a unit nested in the one being made."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for `mesh` (the current accelerator, or the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


class _BesideShards:
    """The replicated parameters (of more than one element) in this process, and the one optimizer step pre-hook that
    keeps torch's multi-tensor kernels from a group that mixes them with FSDP's DTensors of their dtype: foreach and
    fused kernels refuse the mix ("got mixed torch.Tensor and DTensor"; a 0-d tensor DTensor takes as a scalar), and
    AdamW defaults to foreach on a GPU. Such a group steps tensor by tensor, said once per optimizer."""

    def __init__(self) -> None:
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._handle = None
        self._told: weakref.WeakSet = weakref.WeakSet()
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its groups when checked

    def add(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            if p.dim() > 0:
                self._params[id(p)] = p
        if len(self._params) and self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handle = register_optimizer_step_pre_hook(self._check)

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        from torch.distributed.tensor import DTensor

        if self._checked.get(optimizer) == len(optimizer.param_groups):  # each step after the first: nothing new
            return
        self._checked[optimizer] = len(optimizer.param_groups)
        for group in optimizer.param_groups:
            if group.get("foreach") is False and not group.get("fused"):  # tensor by tensor already
                continue
            plain = {p.dtype for p in group["params"] if self._params.get(id(p)) is p}
            sharded = {p.dtype for p in group["params"] if isinstance(p, DTensor)}
            if plain & sharded:
                group["foreach"] = False
                if group.get("fused"):
                    group["fused"] = False
                if optimizer not in self._told:
                    self._told.add(optimizer)
                    warnings.warn(f"autopar: {type(optimizer).__name__} steps parameters autopar keeps replicated "
                                  "beside FSDP's sharded ones of the same dtype in one group, which torch's foreach "
                                  "and fused kernels refuse: that group steps tensor by tensor (slower); give those "
                                  "parameters a group of their own to keep them.", stacklevel=2)


BESIDE_SHARDS = _BesideShards()


class _ReplicatedParams:
    """Parameters kept out of FSDP2, replicated over the data-parallel `mesh` (every dimension of it), as DDP
    keeps its parameters: the same on every rank, their gradients averaged over the mesh's ranks.

    The average runs in each parameter's post-accumulate-grad hook, after a backward, so it also holds in a
    training loop of the user's own. Under gradient accumulation it runs where FSDP reduces: after every
    micro-batch when the gradients are reduce-scattered each time, after the last one only when the loop
    turns FSDP's gradient synchronisation off until then (`set_requires_gradient_sync` on the root unit,
    which autopar.train_step does under plain replication and ZeRO stage 1). Either way the result is the average of the
    summed gradients: a gradient averaged earlier is the same on every rank, and averaging it again keeps it.
    """

    def __init__(self, model: nn.Module, names: list[str], mesh: DeviceMesh, *, root_unit: bool):
        self.names = names
        self.params: list[nn.Parameter] = []
        self.groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        self.size = mesh.size()
        self.sync = True
        device = _mesh_device(mesh)
        params = [model.get_parameter(name) for name in names]
        if any(p.is_meta for p in params):
            # Materialising gives the module new Parameter objects (to_empty), on the plan's device: take
            # them, make them equal and hook them at the first forward.
            self._pending = model.register_forward_pre_hook(self._attach_once)
        else:
            with torch.no_grad():
                for p in params:
                    if p.device != device:
                        p.data = p.data.to(device)  # fully_shard does not move ignored parameters
            self._attach(model)
        if root_unit and hasattr(model, "set_requires_gradient_sync"):
            self._wrap_sync_switch(model)

    def _attach(self, model: nn.Module) -> None:
        self.params = [model.get_parameter(name) for name in self.names]
        BESIDE_SHARDS.add(self.params)
        self.broadcast()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._average)

    def _attach_once(self, module: nn.Module, args: tuple) -> None:
        self._pending.remove()
        self._attach(module)

    def broadcast(self) -> None:
        """Give every rank the mesh's first rank's values (along each dimension, from its group's rank 0)."""
        with torch.no_grad():
            for p in self.params:
                for group in self.groups:
                    if dist.get_world_size(group) > 1:
                        dist.broadcast(p.data, group_src=0, group=group)

    def _average(self, p: nn.Parameter) -> None:
        if not self.sync or p.grad is None or self.size == 1:
            return
        with torch.no_grad():
            for group in self.groups:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
            p.grad.div_(self.size)

    def _wrap_sync_switch(self, model: nn.Module) -> None:
        """Follow the root unit's gradient synchronisation switch (FSDP2 has no getter for it)."""
        switch = model.set_requires_gradient_sync

        def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
            self.sync = bool(requires_gradient_sync)
            switch(requires_gradient_sync, recurse=recurse)

        model.set_requires_gradient_sync = set_requires_gradient_sync
