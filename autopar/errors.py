"""autopar's error types. Every message says what was wrong and what to change."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class PlanError(AutoparError, ValueError):
    """A Plan that is inconsistent in itself, or with the world, batch or model it is applied to."""


class PlanMismatchError(PlanError):
    """A plan (file) made for another model, world size or topology. Pass `force=True` to apply it anyway."""


class ProfileError(AutoparError, ValueError):
    """The model or sample cannot be profiled as given (no parameters, blocks not found, bad sample)."""


class TopologyError(AutoparError, ValueError):
    """A topology spec that cannot be parsed, or hardware that cannot run the plan."""


class InfeasiblePlanError(AutoparError):
    """No plan fits the hardware (memory), or a requested plan cannot fit."""


class TraceError(ProfileError):
    """The model could not run one training step on fake tensors; the structure (blocks, parameters) may still
    be read, so a given plan can be applied. The original exception is the `__cause__`."""
