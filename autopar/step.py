"""`autopar.train_step`: one optimizer step, owned by autopar, for plans a plain loop cannot run.

A plan with gradient accumulation (grad_accum > 1) or pipeline parallelism (pp > 1) splits the step into
micro-batches; `train_step(model, optimizer, loss_fn)` returns `step(batch) -> loss` that does it:

- splits this rank's batch (plan.local_batch_size samples) into plan.grad_accum micro-batches,
- runs them (each micro-batch's loss divided by their number, so gradients are those of the whole
  batch's mean loss), or drives the pipeline schedule,
- synchronises what must be (FSDP's reduce-scatter on the last micro-batch only when parameters are
  replicated, not sharded; the copies of a weight tied across pipeline stages),
- clips the gradient norm if asked (computed over every rank's shards exactly once),
- steps the optimizer, zeroes the gradients, and returns the mean loss of the batch, as the user's loop
  would see it (the same on every rank of a pipeline).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import LossError, PlanError
from .plans import Plan
from ._util.batch import (call_model, check_peer_batches, first_tensor, model_loss, sample_batch_size, sample_rows,
                          to_device)
from ._util.label_items import label_items
from .strategies.tensor_parallel import loss_parallel_scope
from .strategies.pipeline import sync_tied_grads
from .strategies.state import applied


def split_batch(batch: Any, num: int) -> list[Any]:
    """`num` equal micro-batches of `batch` along dim 0 (tensors, or tuples / lists / dicts of them; lists of one item
    per sample, such as a detection model's targets, cut as lists: `sample_rows`)."""
    size = sample_batch_size(batch)
    if size % num:
        raise PlanError(
            f"a batch of {size} samples does not split into {num} micro-batches: feed "
            f"a multiple of {num} samples per step (the plan's local batch), or use a plan with another grad_accum."
        )
    n = size // num
    return [sample_rows(batch, i * n, (i + 1) * n, size) for i in range(num)]


def _loss(loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Callable[[Any, Any], torch.Tensor]:
    if loss_fn is not None:
        return loss_fn
    return lambda output, batch: model_loss(output)


def _replication(grad: torch.Tensor, mesh: Any) -> int:
    """How many ranks hold each element of `grad` (so that a world-wide sum counts it once)."""
    if mesh is None:
        return 1
    world = mesh.size()
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(grad, DTensor):
        return world // _pp_size(mesh)
    distinct = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements):
        if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":
            distinct *= size
    return world // (distinct * _pp_size(mesh))


def _pp_size(mesh: Any) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index("pp")) if "pp" in names else 1


def _tied_weights(model: nn.Module, tied: Sequence[Sequence[str]]) -> dict[int, float]:
    """For a weight tied under several names: the share of the group's norm each parameter object here
    carries (the names it holds / all names), so that copies on several pipeline stages count once."""
    share: dict[int, float] = {}
    for group in tied:
        for name in group:
            try:
                p = model.get_parameter(name)
            except AttributeError:  # on another pipeline stage
                continue
            share[id(p)] = share.get(id(p), 0.0) + 1.0 / len(group)
    return share


def _total_norm(model: nn.Module, mesh: Any, tied: Sequence[Sequence[str]], norm_type: float
                ) -> tuple[torch.Tensor, list[nn.Parameter]]:
    """The `norm_type`-norm of all gradients of `model` over every rank (each element once), and the parameters
    with a gradient here."""
    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    share = _tied_weights(model, tied)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g = g.detach()
        g = (g.abs() if g.is_complex() or norm_type != 2.0 else g).double()  # |z| for a complex element (as torch's)
        if math.isinf(norm_type):
            total = torch.maximum(total, g.max()) if g.numel() else total
        else:
            total += g.pow(norm_type).sum() * share.get(id(p), 1.0) / _replication(p.grad, mesh)
    if mesh is not None and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    return norm.float(), params


def _scale(params: Sequence[nn.Parameter], factor: float) -> None:
    for p in params:
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g.mul_(factor)


def clip_grad_norm(model: nn.Module, max_norm: float, mesh: Any, *, tied: Sequence[Sequence[str]] = ()
                   ) -> torch.Tensor:
    """Clip all gradients of `model` to a total L2 norm of `max_norm`; returns the norm before clipping.

    Sums every element's square once over all ranks (sharded, replicated and pipeline-split parameters,
    and the copies of a weight tied across pipeline stages). A norm that is not finite raises FloatingPointError.
    """
    norm, params = _total_norm(model, mesh, tied, 2.0)
    value = norm.item()  # one device sync
    if not math.isfinite(value):
        raise FloatingPointError(f"the gradient norm is {value}: the loss or a gradient is not finite.")
    scale = max_norm / (value + 1e-6)
    if scale < 1:
        _scale(params, scale)
    return norm


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model wrapped by autopar, for a training loop of the user's own.

    The norm is that of all gradients of the model together over every rank, each element counted once
    (FSDP's shards, replicated and tensor-parallel copies, a weight tied across pipeline stages), so it is the
    norm one process would compute on the whole batch. torch's function refuses a model where autopar keeps a
    parameter replicated beside FSDP's sharded ones ("mixed torch.Tensor and DTensor"); this one takes every
    plan. As torch's: returns the total norm (before clipping) and scales every gradient by
    `max_norm / (norm + 1e-6)` where that is below 1; a norm that is not finite raises RuntimeError with
    `error_if_nonfinite=True`, and otherwise scales the gradients by it as torch does (to NaN or zero).
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}.")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}.")
    state = applied(model)
    norm, params = _total_norm(model, state.mesh, state.profile.tied_params, float(norm_type))
    value = norm.item()
    if not math.isfinite(value):
        if error_if_nonfinite:
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {value}, so they cannot be "
                               "clipped: pass error_if_nonfinite=False to scale them by it anyway.")
        _scale(params, max_norm / (value + 1e-6) if not math.isnan(value) else value)
    elif max_norm / (value + 1e-6) < 1:
        _scale(params, max_norm / (value + 1e-6))
    return norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    max_grad_norm: float | None = None,
    vocab_parallel_loss: bool = True,
    compute_loss: Callable[[Any], torch.Tensor] | None = None,
) -> Callable[[Any], torch.Tensor]:
    """A callable `step(batch) -> loss` that owns one optimizer step of a model wrapped by autopar.

    `batch` is this rank's batch as the plan reads it (`autopar.data_shard`, or `autopar.dataloader`):
    plan.local_batch_size samples, as a tensor, tuple or dict (the model is called as model(x),
    model(*x) or model(**x)). `loss_fn(output, batch)` returns the mean loss of a (micro-)batch;
    without it, `output.loss` (Hugging Face models given labels) or an output that is itself a scalar
    loss; any other output without loss_fn is refused (LossError), never trained on a stand-in. Works
    for every plan, also those without accumulation or pipeline, so a loop written with it runs under any plan.

    The first step of a pipeline-parallel plan checks that the ranks of each pipeline (and tensor-parallel)
    group were given the same batch, and refuses otherwise on every rank (PeerBatchError); a tensor-parallel
    plan without a pipeline checks at the model's first forward (installed by autopar.wrap).

    Under tensor parallelism the loss is vocab-parallel: the head's logits reach `loss_fn` as a DTensor
    split over the vocabulary, and cross-entropy runs on the shards. A loss that needs the full logits as a
    plain tensor: pass `vocab_parallel_loss=False` (the logits are then gathered first).

    `compute_loss(micro_batch)`, instead of `loss_fn`: the micro-batch's mean loss, computed by calling the model
    itself however it is called (a framework's own step, such as a LightningModule's training_step); the logits
    reach it whole. Not with pipeline plans (their stages call the model, not the user) or with `loss_fn`.
    """
    state = applied(model)
    plan, runtime = state.plan, state.pipeline
    vocab_parallel = vocab_parallel_loss and state.tensor_parallel is not None and \
        state.tensor_parallel.head is not None and \
        plan.tp > 1 and state.profile.vocab_size is not None and state.profile.vocab_size % plan.tp == 0
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}.")
    if compute_loss is not None:
        if loss_fn is not None:
            raise PlanError("train_step takes loss_fn(output, batch) or compute_loss(batch), not both: give one.")
        if runtime is not None:
            raise PlanError(f"a pipeline plan (pp={plan.pp}) calls the model stage by stage, so it cannot run "
                            "compute_loss(batch): give loss_fn(output, batch), or a plan with pp=1.")
    loss_of = _loss(loss_fn)
    n = plan.grad_accum
    unchecked = [runtime is not None]  # the pipeline's peers' batches, checked at the first step
    unguarded = [runtime is not None and loss_fn is None]  # the model's own loss, checked on every stage at the first
    counting: list[Any] = [_UNDECIDED]  # LabelItems: the model's loss is weighed by its items (decided at the first step)

    def _finish() -> None:
        if max_grad_norm is not None:
            clip_grad_norm(model, max_grad_norm, state.mesh, tied=state.profile.tied_params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(batch: Any) -> torch.Tensor:
        size = sample_batch_size(batch)
        if size != plan.local_batch_size:
            raise PlanError(
                f"train_step got {size} samples, but this rank's batch under the plan is {plan.local_batch_size} "
                f"(micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum}): feed that many "
                "(autopar.dataloader does)."
            )
        if unchecked[0]:
            check_peer_batches(batch, data_rank=state.data_shard.rank, device=state.device,
                               degrees="pipeline-parallel" if plan.tp == 1 else "pipeline- and tensor-parallel")
            unchecked[0] = False
        micro = split_batch(to_device(batch, state.device), n)
        if runtime is not None:
            held: list[LossError] = []
            guarded = _held(loss_of, held) if unguarded[0] else loss_of
            with loss_parallel_scope(vocab_parallel):
                loss = _pipeline_step(runtime, micro, _local(guarded), state.device, state.mesh)
            if unguarded[0]:  # the first step tells: the model's output has the same kind every step
                _raise_together(held, state.mesh, state.device, optimizer)
                unguarded[0] = False
        elif compute_loss is not None:  # the caller's own loss of each micro-batch: their means' mean
            loss = _accumulated(model, plan, micro, lambda mb: _plain(compute_loss(mb)), vocab_parallel=False)
        else:
            first = counting[0] is _UNDECIDED
            if first:  # can the model's own loss be weighed by its items?
                counting[0] = label_items(model, micro[0]) if loss_fn is None else None
            loss = _item_mean_step(model, plan, micro, counting, first, _local(loss_of), state, vocab_parallel) \
                if counting[0] is not None else None
            if loss is None:  # any other loss: the mean of the micro-batches' means
                local = _local(loss_of)
                loss = _accumulated(model, plan, micro, lambda mb: local(call_model(model, mb), mb),
                                    vocab_parallel=vocab_parallel)
        _finish()
        return loss

    return step


_UNDECIDED = object()


def _accumulated(model: nn.Module, plan: Plan, micro: list[Any], loss_of_batch: Callable[[Any], torch.Tensor], *,
                 vocab_parallel: bool) -> torch.Tensor:
    """Each micro-batch's forward and backward (its loss over their number); returns the mean of their means."""
    n = len(micro)
    total = torch.zeros((), device=applied(model).device)
    for i, mb in enumerate(micro):
        _before_micro_batch(model, plan, last=i == n - 1)
        with loss_parallel_scope(vocab_parallel):
            loss = loss_of_batch(mb)
            (loss / n).backward()
        total += loss.detach() / n
    return total


def _plain(loss: Any) -> torch.Tensor:
    """compute_loss's answer as a plain one-element tensor (a replicated DTensor gathered)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise LossError(f"compute_loss must return the micro-batch's mean loss as a one-element tensor, got "
                        f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.")
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _item_mean_step(model: nn.Module, plan: Plan, micro: list[Any], counting: list[Any], checking: bool,
                    loss_of: Callable[[Any, Any], torch.Tensor], state: Any, vocab_parallel: bool) -> torch.Tensor | None:
    """The micro-batches' forward and backward with the model's own loss as the mean over the whole step's items
    (autopar._util.label_items): every micro-batch is given num_items_in_batch = the valid labels of all of them
    on all data-parallel ranks, so its loss is its items' sum over that count, and the gradient, once FSDP averages
    it over the data-parallel ranks (hence x their number), is the whole global batch's item mean's. A model that
    ignores the count (its loss stays its micro-batch's mean) gets the same sum over the count as that mean times
    its micro-batch's count over the count (LabelItems.weighed). Returns this rank's batch's mean loss.

    The first step (`checking`) decides which, from the first micro-batch's loss as the model computes it without
    the count and without gradients (the same random state and buffers): the count is used where the loss given it
    is that mean times the micro-batch's count over the count; weighed where it is that mean and the mean is the
    cross-entropy of the logits over the counted labels (LabelItems.item_mean); else None: nothing is added to the
    gradients, and the step runs as for any loss (train_step), as do the later ones."""
    how, dp, n = counting[0], state.data_shard.size, len(micro)
    counts = [how.count(mb).to(state.device, torch.float32) for mb in micro]
    local = torch.stack(counts).sum()
    items = local.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(items)
        items = items / (dist.get_world_size() // dp)  # tensor- and pipeline-parallel peers read the same batch
    items = items.clamp_min(1.0)
    total = torch.zeros((), device=state.device)
    for i, mb in enumerate(micro):
        _before_micro_batch(model, plan, last=i == n - 1)
        with loss_parallel_scope(vocab_parallel):
            own = _own_mean(model, mb, loss_of, state.device) if checking and i == 0 else None
            output = call_model(model, mb if how.weighed else {**mb, "num_items_in_batch": items})
            loss = loss_of(output, mb)
            if own is not None and not _agreed(loss.detach(), own * counts[0] / items):
                mean = how.item_mean(output, mb)
                ignored = _agreed(loss.detach(), own)  # (both checks on every rank: each is a collective)
                its_items = _agreed(own, mean if mean is not None else torch.full_like(own, math.nan))
                if not (ignored and its_items):
                    counting[0] = None
                    (loss * 0).backward()  # (FSDP's hooks see the backward they expect; nothing is added)
                    return None
                counting[0] = how = dataclasses.replace(how, weighed=True)
            if how.weighed:
                loss = loss * counts[i] / items
            (loss * dp).backward()
        total += loss.detach()
    return total * items / local.clamp_min(1.0)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _own_mean(model: nn.Module, batch: Any, loss_of: Callable[[Any, Any], torch.Tensor],
              device: torch.device) -> torch.Tensor:
    """The micro-batch's loss as the model computes it without a count, without gradients; the random state and
    the buffers it changed (BatchNorm's running statistics) are put back, so the step runs as it would have."""
    rng, saved = _rng_state(device), [(b, b.detach().clone()) for b in model.buffers()]
    with torch.no_grad():
        own = loss_of(call_model(model, batch), batch).detach()
        for b, before in saved:
            if not torch.equal(b, before):
                b.copy_(before)
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], device)
    return own


def _agreed(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `got` is `want` (to 1e-3) on every rank (the minimum of their answers)."""
    got, want = got.double(), want.double()
    ok = (torch.isfinite(got) & torch.isfinite(want) & ((got - want).abs() <= 1e-3 * want.abs() + 1e-9)).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _before_micro_batch(model: nn.Module, plan: Plan, *, last: bool) -> None:
    """FSDP2's switches for the next micro-batch, as the plan runs a step's micro-batches:
    - replicas only (DDP-like): gradients all-reduced after the last micro-batch only;
    - HSDP (replicas of shards): the shards' all-reduce across replicas after the last micro-batch only (the
      reduce-scatter inside a replica still runs every micro-batch), as the cost model counts it;
    - zero_stage 2 and 1: the parameters, gathered by the first micro-batch's forward, stay whole until the last
      micro-batch's backward reshards them (set_reshard_after_backward); under stage 1 the gradients also stay
      whole, accumulated, and are reduce-scattered (and all-reduced) after the last micro-batch only."""
    if not hasattr(model, "set_requires_gradient_sync"):  # not an FSDP2 module: nothing to switch
        return
    replicate_only = plan.dp_shard == 1 and plan.dp_replicate > 1
    if plan.zero_stage < 3:
        model.set_reshard_after_backward(last)
    if plan.dp_shard > 1 and plan.dp_replicate > 1:
        model.set_requires_all_reduce(last)
    if replicate_only or plan.zero_stage == 1:
        model.set_requires_gradient_sync(last)


def _local(loss_of: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """The loss as a plain tensor (a vocab-parallel loss comes back as a replicated DTensor)."""
    def compute(output: Any, batch: Any) -> torch.Tensor:
        loss = loss_of(output, batch)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    return compute


def _held(loss_of: Callable[[Any, Any], torch.Tensor], held: list[LossError]) -> Callable[[Any, Any], torch.Tensor]:
    """The pipeline's loss: a LossError (no loss_fn, no loss in the output) is held, the schedule finishing on a
    loss of zero, so that `_raise_together` raises it on every stage (raised inside the schedule on the last
    stage, it would leave the other stages waiting for its gradients)."""
    def compute(output: Any, batch: Any) -> torch.Tensor:
        try:
            return loss_of(output, batch)
        except LossError as exc:
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                raise
            held.append(exc)
            return t.float().sum() * 0

    return compute


def _raise_together(held: list[LossError], mesh: Any, device: torch.device, optimizer: torch.optim.Optimizer) -> None:
    """Collective over the pipeline: where a stage held a LossError, every stage drops the step's gradients and
    raises it (the last stage its own; the others one that points to it)."""
    flag = torch.tensor([float(len(held))], device=device)
    dist.all_reduce(flag, group=mesh["pp"].get_group())
    if not flag.item():
        return
    optimizer.zero_grad(set_to_none=True)
    if held:
        raise held[0]
    raise LossError("the model's output carries no loss (the last pipeline stage's error says what it is): pass "
                    "loss_fn=lambda output, batch: ... (the batch's mean loss) to autopar.train_step.")


def _pipeline_step(runtime: Any, micro: list[Any], loss_of: Callable[[Any, Any], torch.Tensor],
                   device: torch.device, mesh: Any) -> torch.Tensor:
    n = len(micro)
    runtime.microbatches = micro
    runtime.loss_fn = loss_of
    index = torch.arange(n, device=device, dtype=torch.float32).reshape(n, 1)
    losses: list[torch.Tensor] = []
    hosts_first = 0 in runtime.stage_blocks
    if hosts_first:
        runtime.schedule.step(index, target=index, losses=losses)
    else:
        runtime.schedule.step(target=index, losses=losses)
    sync_tied_grads(runtime)
    total = torch.zeros((), device=device)
    for loss in losses:
        total += loss.detach().sum()
    # Every rank of the pipeline returns the loss (only the last stage computed it).
    dist.all_reduce(total, group=mesh["pp"].get_group())
    runtime.microbatches = []
    return total
