"""Tensor parallelism (Megatron-style) over the plan's "tp" mesh axis, and sequence parallelism.

In every block, a group of Linear-like layers that read the same input (q/k/v; gate/up; one fused qkv)
is split column-wise (each rank computes a slice of the heads or of the MLP's inner dim) and the layer
that maps the result back to the hidden size is split row-wise (partial sums, all-reduced). One
all-reduce per pair in forward and one in backward; weights, gradients and optimizer state of those
layers shrink by the TP degree.

Which layers pair up is read from the profile's trace of the model (the order of Linear-like calls and
which ones share an input), from a Hugging Face model's own `base_model_tp_plan` where it ships one, and
from common layer names when the model could not be traced. nn.Linear layers use torch's
ColwiseParallel / RowwiseParallel; Hugging Face's Conv1D (GPT-2, transposed weights) and fused
projections (one layer computing q, k and v) use autopar's own styles, which shard the weight with
DTensor placements (a strided shard for fused layers, so every rank holds its own heads of q, k and v
while the full tensor keeps the model's layout) and compute on the local shard.

Sequence parallelism additionally shards the activations between those pairs (norms, dropouts,
residual adds) along the sequence dim: blocks receive and pass on DTensors sharded on dim 1, the
all-reduces become reduce-scatter + all-gather, and norms run under torch's SequenceParallel. The
hidden states are gathered again after a stage's last block, so the code around the blocks
(embeddings, final norm, head, loss) sees plain tensors.

The input embedding (vocab-parallel, RowwiseParallel) and the output head (ColwiseParallel) are split
too when the vocabulary divides by the degree; a head tied to the embedding stays tied. Inside
`autopar.train_step` the loss is vocab-parallel (torch's loss_parallel: cross-entropy on the vocabulary
shards, the full logits never gathered); a plain loop receives the logits gathered.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..errors import PlanError
from ..layout import TPPair
from ..profile import ModelProfile
# what TP splits and the checks (re-exported: autopar's layers and the tests import them from here)
from .tensor_parallel_layout import (HEAD_ATTRS, _KV_HEAD_ATTRS, _WIDTH_ATTRS, TPLayout, _norms_on_split_heads,
                                     check_tensor_parallel, norms_on_split_outputs, per_head_params,
                                     tensor_parallel_refusal, tp_layout)

__all__ = ["TPLayout", "TPPair", "apply_tensor_parallel", "check_tensor_parallel", "loss_parallel_scope",
           "tensor_parallel_refusal", "tp_layout"]

# ---------------------------------------------------------------------------------------------------
# autopar's own parallel styles: local compute on DTensor-sharded weights
# ---------------------------------------------------------------------------------------------------
def _strided(dim: int, chunks: int) -> Any:
    from torch.distributed.tensor import Shard

    if chunks == 1:
        return Shard(dim)
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - torch without strided sharding
        raise PlanError("fused projections need DTensor's strided sharding, which this torch lacks: set tp=1.") from None
    return _StridedShard(dim, split_factor=chunks)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any) -> None:
    from torch.distributed.tensor import distribute_tensor

    param = getattr(module, name, None)
    if param is None:
        return
    module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]),
                                                 requires_grad=param.requires_grad))


def _col_forward(module: nn.Module, mesh: DeviceMesh, kind: str, x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    # Megatron's f: identity forward, all-reduce of the input's gradient in backward (gathered along the
    # sequence first under sequence parallelism: all-gather forward, reduce-scatter backward).
    if isinstance(x, DTensor):
        x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    else:
        x_local = _summing_grad(x, mesh)
    weight = module.weight.to_local()
    bias = module.bias.to_local() if module.bias is not None else None
    if kind == "linear":
        return F.linear(x_local, weight, bias)
    out = x_local @ weight  # conv1d: weight is (in, out / tp)
    return out + bias if bias is not None else out


def _row_forward(module: nn.Module, mesh: DeviceMesh, kind: str, sequence_parallel: bool, x: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x_local = x.to_local() if isinstance(x, DTensor) else x
    weight = module.weight.to_local()
    partial = F.linear(x_local, weight) if kind == "linear" else x_local @ weight
    # Megatron's g: all-reduce of the partial sums (reduce-scatter along the sequence under SP).
    out = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    out = out.redistribute(mesh, [Shard(1)] if sequence_parallel else [Replicate()])
    if module.bias is not None:
        out = out + module.bias
    return out if sequence_parallel else out.to_local()


def _apply_local_colwise(module: nn.Module, mesh: DeviceMesh, *, kind: str, chunks: int) -> None:
    _distribute(module, "weight", mesh, _strided(0 if kind == "linear" else 1, chunks))
    _distribute(module, "bias", mesh, _strided(0, chunks))
    module.forward = functools.partial(_col_forward, module, mesh, kind)


def _apply_local_rowwise(module: nn.Module, mesh: DeviceMesh, *, kind: str, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard

    _distribute(module, "weight", mesh, Shard(1 if kind == "linear" else 0))
    _distribute(module, "bias", mesh, Replicate())
    module.forward = functools.partial(_row_forward, module, mesh, kind, sequence_parallel)


def _summing_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Megatron's f: `x` as it is in forward; in backward its gradient summed over the TP ranks (each rank's holds its
    own share of the heads' or features' part): a replicated DTensor seen locally with a partial gradient."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _own_params_as(module: nn.Module, read: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A context in which `module`'s forward reads each of its own parameters as `read(parameter)` (the parameters
    FSDP has in place at the call; the state dict's names unchanged)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, {name: read(p) for name, p in module.named_parameters(recurse=False)})


def _summing_forward(module: nn.Module, mesh: DeviceMesh, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, reading its parameters through _summing_grad."""
    with _own_params_as(module, lambda p: _summing_grad(p, mesh)):
        return forward(*args, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_forward(module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, reading its parameters split with the heads (a per-head tensor, a split norm's
    weight: DTensors) as this rank's shards."""
    with _own_params_as(module, _local):
        return forward(*args, **kwargs)


def _split_norm_forward(module: nn.Module, mesh: DeviceMesh, width: int, forward: Any, x: torch.Tensor,
                        *args: Any, **kwargs: Any) -> Any:
    """The norm's own forward on this rank's share `x` of a width-`width` row, with the whole row's mean square: `x`
    scaled by c = sqrt(whole / own mean square) has its own mean square equal to the whole row's, so the norm's
    output over c is the whole norm's share (exactly, for an RMS norm: tensor_parallel_layout.rms_norm_like). The
    sum of squares is all-reduced (its gradient too, in backward); the weight is this rank's shard."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    squares = x.float().pow(2).sum(-1, keepdim=True)
    # all-reduced; in backward each rank's gradient of the sum is its own part, summed over the ranks in turn
    whole = DTensor.from_local(squares, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    own, whole = squares / x.shape[-1], whole.to_local(grad_placements=[Partial()]) / width
    # A share of exact zeros (a padding token's row, zero on every rank) keeps c = 1, its gradient finite: the
    # unselected side of a `where` must be finite too, or its zero gradient times an infinite one is NaN.
    some = own > 0
    c = torch.sqrt(torch.where(some, whole, 1.0) / torch.where(some, own, 1.0))
    out = _local_forward(module, forward, (x.float() * c).to(x.dtype), *args, **kwargs)
    return (out.float() / c).to(out.dtype)


def _apply_split_norm(module: nn.Module, mesh: DeviceMesh, width: int) -> None:
    """Split a norm that reads a column-split projection's whole output (OLMo 2's q_norm, k_norm) with it: its weight
    sharded as the projection's output features are, its statistic summed over the ranks (_split_norm_forward)."""
    from torch.distributed.tensor import Shard

    _distribute(module, "weight", mesh, Shard(0))
    if tuple(getattr(module, "normalized_shape", ())) == (width,):  # nn.RMSNorm's: the width it normalizes here
        module.normalized_shape = (width // mesh.size(),)
    module.forward = functools.partial(_split_norm_forward, module, mesh, width, module.forward)


def _apply_per_head_params(module: nn.Module, names: Sequence[str], mesh: DeviceMesh) -> None:
    """Split `module`'s parameters `names`, one entry per head along their last dim, with the heads (T5's relative
    attention bias): each rank's shard is its own heads' values, which the module's forward reads locally."""
    from torch.distributed.tensor import Shard

    for name in names:
        _distribute(module, name, mesh, Shard(getattr(module, name).dim() - 1))
    module.forward = functools.partial(_local_forward, module, module.forward)


def _sum_grads_over_tp(module: nn.Module, mesh: DeviceMesh) -> None:
    """Complete the gradients of `module`'s own parameters (a q/k norm over one head's width) over the TP ranks."""
    module.forward = functools.partial(_summing_forward, module, mesh, module.forward)


# ---------------------------------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------------------------------
def _divide_attrs(module: nn.Module, tp: int, profile: ModelProfile) -> list[str]:
    """Make an attention module's head counts and head-sized widths local; returns what was changed."""
    changed = []
    hidden = profile.hidden_dim
    for attrs, value in ((HEAD_ATTRS, profile.num_heads), (_KV_HEAD_ATTRS, profile.num_kv_heads),
                         (_WIDTH_ATTRS, hidden)):
        for attr in attrs:
            current = getattr(module, attr, None)
            if isinstance(current, int) and not isinstance(current, bool) and value and current == value \
                    and current % tp == 0:
                setattr(module, attr, current // tp)
                changed.append(attr)
    return changed


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    profile: ModelProfile,
    blocks: Sequence[tuple[str, nn.Module]],
    sequence_parallel: bool,
    stage_ends: Sequence[str] = (),
    split_embeddings: bool = True,
) -> TPLayout:
    """Split `model`'s blocks (those in `blocks`: a pipeline stage's own) over `tp_mesh`; see the module docstring."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    tp = tp_mesh.size()
    layout = check_tensor_parallel(model, profile, tp)
    present = {name for name, _ in blocks}
    named = dict(model.named_modules())

    def in_blocks(name: str) -> bool:
        return any(name.startswith(b + ".") for b in present)

    styles: dict[str, Any] = {}
    for pair in layout.pairs:
        if not in_blocks(pair.rowwise):
            continue
        for name, kind in zip(pair.colwise, pair.kinds):
            if kind == "linear" and pair.chunks == 1:
                sharded_input = sequence_parallel and name not in pair.replicated  # (an encoder's output: whole)
                styles[name] = ColwiseParallel(input_layouts=Shard(1) if sharded_input else Replicate(),
                                               output_layouts=Shard(-1), use_local_output=True)
            else:
                _apply_local_colwise(named[name], tp_mesh, kind=kind, chunks=pair.chunks)
        row_kind = pair.kinds[-1]
        if row_kind == "linear":
            styles[pair.rowwise] = RowwiseParallel(input_layouts=Shard(-1),
                                                   output_layouts=Shard(1) if sequence_parallel else Replicate(),
                                                   use_local_output=not sequence_parallel)
        else:
            _apply_local_rowwise(named[pair.rowwise], tp_mesh, kind=row_kind, sequence_parallel=sequence_parallel)
        if pair.attention:  # the attention module and those inside it (BERT's and BigBird's self-attention under
            # the module that holds the output projection too keeps all_head_size for its reshape)
            for module in named[pair.parent].modules():
                _divide_attrs(module, tp, profile)
            for norm in _norms_on_split_heads(named, pair, profile)[0]:
                _sum_grads_over_tp(norm, tp_mesh)
            owners: dict[int, tuple[nn.Module, list[str]]] = {}
            for owner, name in per_head_params(named, pair, profile):
                owners.setdefault(id(owner), (owner, []))[1].append(name)
            for owner, names in owners.values():
                _apply_per_head_params(owner, names, tp_mesh)
        for norm in norms_on_split_outputs(pair, profile):  # (attention's or the MLP's)
            if norm in named:
                _apply_split_norm(named[norm], tp_mesh, int(named[norm].weight.shape[0]))
    if sequence_parallel:
        for norm in layout.norms:
            if in_blocks(norm):
                styles[norm] = SequenceParallel()
        stage_blocks = [name for name, _ in blocks]
        for index, name in enumerate(stage_blocks):
            if profile.block_input == "arg0" or profile.block_input is None:
                rest = (None,) * (profile.block_num_args - 1)  # other positional inputs stay as they are
                styles[name] = PrepareModuleInput(input_layouts=(Replicate(), *rest),
                                                  desired_input_layouts=(Shard(1), *rest), use_local_output=False)
            else:
                kw = profile.block_input.split(":", 1)[1]
                styles[name] = PrepareModuleInput(input_kwarg_layouts={kw: Replicate()},
                                                  desired_input_kwarg_layouts={kw: Shard(1)}, use_local_output=False)
        arity = profile.block_output_arity
        ends = [n for n in (stage_ends or stage_blocks[-1:]) if n in present]
        out_layouts = Shard(1) if arity == 0 else (Shard(1),) + (None,) * (arity - 1)
        want = Replicate() if arity == 0 else (Replicate(),) + (None,) * (arity - 1)
        parallelize_module(model, tp_mesh, {n: s for n, s in styles.items() if n not in ends})
        # The last block of a stage both prepares its input and gathers its output again, so that the code
        # after the blocks (or the next pipeline stage) receives plain tensors.
        for last in ends:
            parallelize_module(named[last], tp_mesh, styles[last])
            parallelize_module(named[last], tp_mesh, PrepareModuleOutput(output_layouts=out_layouts,
                                                                         desired_output_layouts=want,
                                                                         use_local_output=True))
    elif styles:
        parallelize_module(model, tp_mesh, styles)

    # The vocabulary: embedding rows and head columns split over the TP ranks, logits gathered.
    emb, head = layout.embedding, layout.head
    vocab_ok = profile.vocab_size is not None and profile.vocab_size % tp == 0
    if split_embeddings and vocab_ok:
        if emb is not None and emb in named:
            parallelize_module(named[emb], tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                    output_layouts=Replicate()))
        if head is not None and head in named:
            # Logits stay split over the vocabulary inside autopar.train_step (vocab-parallel loss);
            # a plain loop receives them gathered.
            parallelize_module(named[head], tp_mesh, ColwiseParallel(input_layouts=Replicate(),
                                                                     output_layouts=Shard(-1),
                                                                     use_local_output=False))
            named[head].register_forward_hook(_gather_logits)
    _retie(model, profile)
    return layout


_LOSS_PARALLEL = threading.local()


def _gather_logits(module: nn.Module, args: Any, output: Any) -> Any:
    """The split head's logits, gathered over the vocabulary unless a vocab-parallel loss is running."""
    from torch.distributed.tensor import DTensor, Replicate

    if getattr(_LOSS_PARALLEL, "active", False) or not isinstance(output, DTensor):
        return None
    return output.redistribute(output.device_mesh, [Replicate()]).to_local()


@contextlib.contextmanager
def loss_parallel_scope(enabled: bool):
    """Within it, a split head returns its logits split over the vocabulary and cross-entropy runs on the
    shards (torch's loss_parallel): the full logits tensor never exists. Forward, loss and backward must all
    run inside it."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    previous = getattr(_LOSS_PARALLEL, "active", False)
    _LOSS_PARALLEL.active = True
    try:
        with loss_parallel():
            yield
    finally:
        _LOSS_PARALLEL.active = previous


def _retie(model: nn.Module, profile: ModelProfile) -> None:
    """Parameters the model shared before (tied embedding and head, BERT's decoder bias) share again: the
    styles above give each module its own new (sharded) Parameter."""
    from torch.distributed.tensor import DTensor

    for group in profile.tied_params:
        params = []
        for name in group:
            try:
                params.append(model.get_parameter(name))
            except AttributeError:  # not on this pipeline stage
                continue
        if len({id(p) for p in params}) <= 1:
            continue
        keep = next((p for p in params if isinstance(p, DTensor)), params[0])
        for name in group:
            owner, _, attr = name.rpartition(".")
            try:
                setattr(model.get_submodule(owner), attr, keep)
            except AttributeError:
                continue
