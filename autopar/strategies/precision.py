"""Mixed precision: bf16 compute with fp32 master weights, gradients and optimizer state.

Under FSDP2 the MixedPrecisionPolicy casts the gathered parameters to bf16 for compute and reduces
gradients in fp32 (`fsdp_policy`). Without FSDP, the model's forward runs under `torch.autocast`
(`apply_autocast`). Either way the parameters the optimizer sees stay fp32, and the model's floating
outputs are returned in fp32, so the user's loss is computed as before; under autocast, an output that carries
the loss the model computed (a Hugging Face model given `labels`) is returned as autocast made it, as under the
user's own `torch.autocast` (autopar._util.batch.autocast_outputs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from .._util.batch import autocast_outputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def fsdp_policy(precision: str, *, root: bool) -> Any:
    """The FSDP2 MixedPrecisionPolicy for a unit; the root's outputs are cast back to fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype(precision),
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if root else None,
    )


class AutocastForward:
    """A model's forward run under `torch.autocast`, its floating outputs returned in fp32.

    It keeps the forward's name, docstring and signature (`__wrapped__`, which `inspect.signature` follows):
    frameworks read the forward's parameters, as the Hugging Face Trainer does to keep the dataset's columns
    the model takes (`remove_unused_columns`), and a `functools.partial` would hide them."""

    def __init__(self, forward: Callable[..., Any], *, device_type: str, dtype: torch.dtype) -> None:
        functools.update_wrapper(self, forward)  # __wrapped__, __name__, __doc__, ...
        self.device_type, self.dtype = device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            output = self.__wrapped__(*args, **kwargs)
        return autocast_outputs(output)


def apply_autocast(model: nn.Module, *, precision: str, device_type: str) -> None:
    """Run `model`'s forward under autocast in `precision` (no-op for fp32). The module keeps its type and names,
    and its forward its signature."""
    if precision == "fp32":
        return
    model.forward = AutocastForward(model.forward, device_type=device_type, dtype=compute_dtype(precision))
