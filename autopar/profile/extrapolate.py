"""extrapolate_profile: a deep model's profile from two traces of it at smaller depths (for planning)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from ..errors import ProfileError
from .model_profile import ModelProfile

# The fields that grow linearly with the number of blocks.
_LINEAR_IN_DEPTH = ("num_params", "num_trainable_params", "param_bytes", "forward_flops", "flops", "num_ops",
                    "traffic_bytes", "weight_traffic_bytes", "value_reads")


def extrapolate_profile(shallow: ModelProfile, deeper: ModelProfile, num_blocks: int) -> ModelProfile:
    """The profile of the same model with `num_blocks` blocks, from two traces of it at smaller depths.

    Planning a 70B model needs no 70B trace: trace it with 1 and 2 blocks (say) and extend. Everything
    linear in depth (FLOPs, ops, memory-bound bytes, parameters) grows by the per-block increment
    measured between the two traces, so the result equals a full-depth trace for models whose blocks are
    identical; the blocks are copies of `deeper`'s last one. The result plans; it cannot be applied (its
    matmul calls are the shallow model's), and its fingerprint says it was extrapolated.
    """
    _check_traces(shallow, deeper, num_blocks)
    last = deeper.blocks[-1]
    prefix = last.name.rsplit(".", 1)[0] + "." if "." in last.name else ""
    more = num_blocks - deeper.num_blocks
    blocks = deeper.blocks + tuple(replace(last, name=f"{prefix}{deeper.num_blocks + i}") for i in range(more))
    digest = hashlib.sha256(f"{deeper.fingerprint}:{num_blocks}".encode()).hexdigest()[:16]
    return replace(
        deeper, blocks=blocks, fingerprint=f"x{digest}",
        **{name: _grown(shallow, deeper, name, num_blocks) for name in _LINEAR_IN_DEPTH},
        num_layers=num_blocks if deeper.num_layers is not None else None,
        live_frontier=(),  # the shallow traces' peaks say nothing exact of the deep model's
        allocator_reserve_bytes=None, allocator_replay_on_cuda=False,  # nor their allocator's replay
        notes=deeper.notes + (f"extrapolated from traces with {shallow.num_blocks} and {deeper.num_blocks} "
                              f"blocks to {num_blocks} blocks (for planning only)",),
    )


def _check_traces(shallow: ModelProfile, deeper: ModelProfile, num_blocks: int) -> None:
    if deeper.num_blocks - shallow.num_blocks < 1 or shallow.num_blocks < 1:
        raise ProfileError("extrapolate_profile needs two traces of one model, the second with more blocks "
                           f"(got {shallow.num_blocks} and {deeper.num_blocks}).")
    if len(deeper.block_containers) > 1:
        raise ProfileError(f"extrapolate_profile grows one run of blocks, and {deeper.model_class}'s blocks lie in "
                           f"{len(deeper.block_containers)} containers: profile the model at its full depth instead.")
    if num_blocks < deeper.num_blocks:
        raise ProfileError(f"num_blocks={num_blocks} is fewer than the deeper trace's {deeper.num_blocks} blocks: "
                           "profile the model at that depth instead.")
    if (shallow.sample_batch_size, shallow.tokens_per_sample, shallow.profile_precision) != \
            (deeper.sample_batch_size, deeper.tokens_per_sample, deeper.profile_precision):
        raise ProfileError("extrapolate_profile: the two traces must use the same sample and precision.")


def _grown(shallow: ModelProfile, deeper: ModelProfile, name: str, num_blocks: int) -> int | float:
    """`deeper`'s value of `name` plus the per-block increment between the traces for each extra block
    (rounded where the value is an integer)."""
    a, b = getattr(shallow, name), getattr(deeper, name)
    step = (b - a) / (deeper.num_blocks - shallow.num_blocks)
    value = b + step * (num_blocks - deeper.num_blocks)
    value = max(value, 0)  # a count or size: never below zero (value_reads may fall with depth)
    return type(b)(round(value)) if isinstance(b, int) else value
