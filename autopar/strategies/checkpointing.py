"""Activation checkpointing of the model's blocks, without changing module names or types.

- "full": a checkpointed block keeps only its inputs; its forward runs again in backward.
- "selective": a checkpointed block keeps the outputs of matmuls, attention kernels and collectives and
  recomputes the cheap rest (norms, activations, dropout, elementwise ops): most of the memory saving of
  full checkpointing for a fraction of its extra compute.
- `every=n` checkpoints blocks 0, n, 2n, ...: memory between none and all.

The block's `forward` is replaced on the instance by a checkpointed call of the original, so parameter
names, `state_dict` keys and module types stay exactly what the user had.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _save_ops() -> set[Any]:
    """Ops whose outputs selective checkpointing keeps: the expensive ones to recompute."""
    aten = torch.ops.aten
    names = [
        (aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "baddbmm"), (aten, "_scaled_mm"),
        (aten, "_scaled_dot_product_flash_attention"), (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"), (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (aten, "_flash_attention_forward"), (aten, "_efficient_attention_forward"),
    ]
    ops = {getattr(ns, name).default for ns, name in names if hasattr(ns, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"):
            if hasattr(functional, name):
                ops.add(getattr(functional, name).default)
    return ops


_SAVE = None


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul / attention / collective outputs, recompute everything else."""
    global _SAVE
    if _SAVE is None:
        _SAVE = _save_ops()
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(selective_policy)


def _checkpointed_forward(forward: Callable[..., Any], context_fn: Callable[[], Any] | None,
                          *args: Any, **kwargs: Any) -> Any:
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def disable_kv_cache(model: nn.Module) -> bool:
    """Turn off a Hugging Face model's key/value cache; returns whether it was on.

    A checkpointed attention layer runs its forward twice; with the cache on, the second run appends its
    keys and values to the cache the first run filled, and the shapes no longer match. Hugging Face turns
    the cache off under its own gradient checkpointing for the same reason. Outputs do not change.
    """
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
        return True
    return False


def apply_checkpointing(blocks: Sequence[tuple[str, nn.Module]], *, mode: str, every: int = 1) -> list[str]:
    """Checkpoint blocks 0, every, 2*every, ... in `mode` ("full" or "selective"); returns their names."""
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"checkpointing mode must be 'none', 'full' or 'selective', got {mode!r}.")
    if every < 1:
        raise ValueError(f"checkpoint every n-th block needs n >= 1, got {every}.")
    context_fn = _selective_context if mode == "selective" else None
    done = []
    for index, (name, block) in enumerate(blocks):
        if index % every:
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward, context_fn)
        done.append(name)
    return done
