"""Activation checkpointing of the model's blocks, without changing module names or types.

- "full": a checkpointed block keeps only its inputs; its forward runs again in backward.
- "selective": a checkpointed block keeps the outputs of matmuls, attention kernels, convolutions, grouped GEMMs
  and collectives and recomputes the cheap rest (norms, activations, dropout, elementwise ops): most of the memory saving of
  full checkpointing for a fraction of its extra compute.
- "alternate": as selective, but of the block's GEMMs (mm, addmm, bmm, baddbmm, _scaled_mm) it keeps every
  other output, the first, third, ..., and recomputes the rest: between selective and full in memory and in
  recomputation (torchtitan's op-level selective checkpointing, its default for Llama 3 8B).
- "gemms": keeps only the outputs of attention kernels, convolutions, grouped GEMMs and collectives, and
  recomputes every dense GEMM (mm, addmm, bmm, baddbmm, _scaled_mm) and the cheap rest: near full's memory (the
  block's input and its attention outputs) without running attention again, whose share of the forward grows with
  the sequence (what torchtitan's op-level policy does under Float8, whose _scaled_mm it does not save).
- `every=n` checkpoints blocks 0, n, 2n, ...: memory between none and all.

The block's `forward` is replaced on the instance by a checkpointed call of the original, so parameter
names, `state_dict` keys and module types stay exactly what the user had.

The recomputation in backward runs the block's forward again in training mode: BatchNorm (and any norm
tracking running statistics) would update its running mean, variance and batch count a second time. The
recomputation restores them (`_KeepRunningStats`), so a checkpointed model's statistics after N
steps are the unwrapped model's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..profile.flops import gemm_ops, matmul_ops


@functools.lru_cache(maxsize=None)
def _save_ops() -> frozenset[Any]:
    """Ops whose outputs selective checkpointing keeps: the expensive ones to recompute, the very ops the trace's
    selective tally counts as kept (autopar.profile.flops.matmul_ops: GEMMs, attention kernels, convolutions, an
    MoE's grouped GEMMs), and the collectives."""
    ops = {packet.default for packet in matmul_ops()}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"):
            if hasattr(functional, name):
                ops.add(getattr(functional, name).default)
    return frozenset(ops)


@functools.lru_cache(maxsize=None)
def _gemm_ops() -> frozenset[Any]:
    """The GEMMs (autopar.profile.flops.GEMMS) whose outputs "alternate" keeps every other one of, in the order a
    block runs them."""
    return frozenset(packet.default for packet in gemm_ops())


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul / attention / collective outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in _save_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(selective_policy)


def _alternate_context() -> Any:
    """Selective checkpointing that keeps the first, third, ... GEMM output of one checkpointed call and recomputes
    the second, fourth, ...; a fresh count for each call, one for its forward and one for its recomputation (which
    runs the same ops in the same order, so each GEMM gets the same decision both times)."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _gemm_ops():
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return selective_policy(ctx, op)

    return create_selective_checkpoint_contexts(policy)


def _gemms_context() -> Any:
    """Selective checkpointing that recomputes every dense GEMM (and the cheap ops), keeping the other matmul-like
    outputs (attention kernels, convolutions, grouped GEMMs) and the collectives."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _gemm_ops():
            return CheckpointPolicy.PREFER_RECOMPUTE
        return selective_policy(ctx, op)

    return create_selective_checkpoint_contexts(policy)


_CONTEXTS = {"selective": _selective_context, "alternate": _alternate_context, "gemms": _gemms_context}


def _running_stat_norms(block: nn.Module) -> list[nn.Module]:
    """The block's norm layers that update running statistics in training mode (BatchNorm, InstanceNorm
    with track_running_stats)."""
    return [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


class _KeepRunningStats:
    """The context the recomputation runs in: on leaving it (also when torch stops the recomputation early)
    the norms' running statistics are what they were on entering it. It wraps the recomputation's own
    context (selective checkpointing's), outside it: the copies are no ops of the recomputed region, whose
    ops selective checkpointing matches one by one with the forward's."""

    def __init__(self, norms: Sequence[nn.Module], inner: Any) -> None:
        self.norms, self.inner = norms, inner
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its value on entering)

    def __enter__(self) -> None:
        with torch.no_grad():
            self.saved = [(buf, buf.clone()) for m in self.norms for buf in
                          (m.running_mean, m.running_var, m.num_batches_tracked) if buf is not None]
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for buf, value in self.saved:
                    buf.copy_(value)
            self.saved = []


def _contexts(norms: Sequence[nn.Module], mode: str) -> tuple[Any, Any]:
    """checkpoint's context_fn for a block with running statistics: (forward context, recomputation context)."""
    forward, recompute = _CONTEXTS[mode]() if mode in _CONTEXTS else (contextlib.nullcontext(),
                                                                       contextlib.nullcontext())
    return forward, _KeepRunningStats(norms, recompute)


def _checkpointed_forward(forward: Callable[..., Any], context_fn: Callable[[], Any] | None,
                          *args: Any, **kwargs: Any) -> Any:
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_checkpointing(blocks: Sequence[tuple[str, nn.Module]], *, mode: str, every: int = 1) -> list[str]:
    """Checkpoint blocks 0, every, 2*every, ... in `mode` ("full", "gemms", "alternate" or "selective"); returns
    their names."""
    if mode == "none":
        return []
    if mode not in ("full", "gemms", "alternate", "selective"):
        raise ValueError(f"checkpointing mode must be 'none', 'full', 'gemms', 'alternate' or 'selective', got "
                         f"{mode!r}.")
    if every < 1:
        raise ValueError(f"checkpoint every n-th block needs n >= 1, got {every}.")
    context_fn = _CONTEXTS.get(mode)
    done = []
    for index, (name, block) in enumerate(blocks):
        if index % every:
            continue
        norms = _running_stat_norms(block)  # their statistics must not be updated again by the recomputation
        block_context = functools.partial(_contexts, norms, mode) if norms else context_fn
        block.forward = functools.partial(_checkpointed_forward, block.forward, block_context)
        done.append(name)
    return done
