"""Mixed precision: bf16 compute with fp32 master weights, gradients and optimizer state.

Under FSDP2 the MixedPrecisionPolicy casts the gathered parameters to bf16 for compute and reduces
gradients in fp32 (`fsdp_policy`). Without FSDP, the model's forward runs under `torch.autocast`
(`apply_autocast`). Either way the parameters the optimizer sees stay fp32, and the model's floating
outputs are returned in fp32, so the user's loss is computed as before; under autocast, an output that carries
the loss the model computed (a Hugging Face model given `labels`) is returned as autocast made it, as under the
user's own `torch.autocast` (autopar._util.batch.autocast_outputs).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .._util.batch import autocast_outputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


# the parameter dtypes a bf16 plan computes in bf16: those autocast casts (not float64, not complex)
CAST_DTYPES = (torch.float32, torch.float16)


def fsdp_policy(precision: str, *, root: bool, dtype: torch.dtype | None = None) -> Any:
    """The FSDP2 MixedPrecisionPolicy for a unit whose parameters are of `dtype` (None: unknown, float32); the root's
    outputs are cast back to fp32. A unit of float64 or complex weights is left as it is, as autocast leaves them
    (a bf16 cast would drop a complex weight's imaginary part)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32" or (dtype is not None and dtype not in CAST_DTYPES):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype(precision),
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if root else None,
    )


class AutocastForward:
    """A model's forward run under `torch.autocast`, its floating outputs returned in fp32; `weights` (names of
    trainable parameters) given to it cast to the compute dtype.

    Autocast casts the weights of the ops on its lists (a Linear's, a convolution's, a matmul's); a matmul it does
    not reach (a custom op's, such as the grouped GEMM of a Mixture of Experts in transformers, or one that reads a
    batched weight) runs in fp32 on the fp32 weights: on an H100 Mixtral's step was 0.81 s under autocast, 88% of it
    in fp32 GEMMs, and 0.13 s with its weights in bf16 (bench/results/zoo_h100_moe_bf16_2026-12-06.jsonl). The
    profile's bf16 trace names those weights (ModelProfile.bf16_weights); each forward reads them through a bf16
    copy, as autocast reads a Linear's, so their gradients still reach the fp32 parameters the optimizer steps and
    the state dict's names and dtypes are unchanged.

    It keeps the forward's name, docstring and signature (`__wrapped__`, which `inspect.signature` follows):
    frameworks read the forward's parameters, as the Hugging Face Trainer does to keep the dataset's columns
    the model takes (`remove_unused_columns`), and a `functools.partial` would hide them."""

    def __init__(self, forward: Callable[..., Any], *, device_type: str, dtype: torch.dtype,
                 model: nn.Module | None = None, weights: Sequence[str] = ()) -> None:
        functools.update_wrapper(self, forward)  # __wrapped__, __name__, __doc__, ...
        self.device_type, self.dtype = device_type, dtype
        self.model = model
        self.weights = tuple(weights) if model is not None else ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype), weights_cast(self.model, self.weights, self.dtype):
            output = self.__wrapped__(*args, **kwargs)
        return autocast_outputs(output)


def weights_cast(model: nn.Module | None, weights: Sequence[str], dtype: torch.dtype) -> Any:
    """A context in which `model`'s forward reads the parameters named in `weights` through copies in `dtype` (their
    gradients reach the parameters); a no-op without weights. AutocastForward's, and a pipeline stage's."""
    if model is None or not weights:
        return contextlib.nullcontext()
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(model, {name: model.get_parameter(name).to(dtype) for name in weights})


def present_weights(model: nn.Module, weights: Sequence[str]) -> list[str]:
    """Those of `weights` that are trainable floating parameters of `model` (a pipeline rank holds its stages')."""
    present = {name for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()}
    return [n for n in weights if n in present]


def apply_autocast(model: nn.Module, *, precision: str, device_type: str, weights: Sequence[str] = ()) -> None:
    """Run `model`'s forward under autocast in `precision` (no-op for fp32), the trainable parameters named in
    `weights` (those autocast does not reach: ModelProfile.bf16_weights) given to it in the compute dtype. The module
    keeps its type and names, and its forward its signature."""
    if precision == "fp32":
        return
    model.forward = AutocastForward(model.forward, device_type=device_type, dtype=compute_dtype(precision),
                                    model=model, weights=present_weights(model, weights))
