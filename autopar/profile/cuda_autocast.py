"""CUDA autocast's float32 casts for a bf16 trace run on another device (CudaAutocastPolicy), so that the
trace saves and moves the bytes a GPU run does."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# CUDA autocast's float32 ops (torch.amp documentation, "CUDA Ops that can autocast to float32"), by the
# __name__ of the torch function, method or operator that reaches them.
_CUDA_FP32_OPS = frozenset((
    "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss"))


class NoCudaBf16KernelError(RuntimeError):
    """The step calls an op with a bf16 input that CUDA has no bf16 kernel for: its bf16 step cannot run on a GPU."""


def _no_cuda_bf16_kernel(name: str) -> bool:
    """Ops CUDA runs in no bf16 kernel and CUDA autocast leaves alone (so a bf16 input reaches them and raises
    "Unsupported dtype BFloat16" / "cuFFT doesn't support tensor of type: BFloat16"): the FFTs (cuFFT takes float32,
    float64, and float16 of power-of-2 sizes; pytorch/pytorch#117844) and the STFTs built on them. CPU autocast casts
    their inputs to float32, which would hide it from a trace run on a CPU."""
    return name.startswith("fft_") or name in ("stft", "istft")


def _to_float32(t: Any) -> Any:
    """A bf16/fp16 tensor as float32; anything else as it is."""
    if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16):
        return t.float()
    return t


class CudaAutocastPolicy(TorchFunctionMode):
    """CUDA autocast's casts for a bf16 trace run elsewhere (CPU or meta, under that device's autocast, whose
    float32 list differs: CPU autocast runs e.g. `pow` in bf16). The floating-point bf16/fp16 inputs of
    CUDA's float32 ops are cast to float32 first, above autograd as autocast casts, so the trace saves and
    moves the bytes a GPU run does (GPT-2's tanh GELU runs in float32 on a GPU: x ** 3 promotes the chain).
    Measured on an H200 (bench/profile_kernels.py): GPT-2-355M's elementwise kernels are mostly float32."""

    def __init__(self, device_type: str, *, cast: bool = True) -> None:
        super().__init__()
        self.device_type = device_type
        self.cast = cast  # False on a CUDA device (its own autocast casts): the check of bf16 kernels alone

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _no_cuda_bf16_kernel(name) and any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                                              for t in torch.utils._pytree.tree_leaves((tuple(args), kwargs))):
            raise NoCudaBf16KernelError(f"torch.{name.replace('fft_', 'fft.')} gets a bf16 input, and CUDA has no bf16 "
                                        "kernel for it (cuFFT: float32, float64, float16)")
        if self.cast and name in _CUDA_FP32_OPS and "out" not in kwargs \
                and torch.is_autocast_enabled(self.device_type):  # autocast leaves out= calls alone
            args, kwargs = torch.utils._pytree.tree_map(_to_float32, (tuple(args), kwargs))
        return func(*args, **kwargs)
