"""ModelProfile: what the planner knows about a model, measured without a GPU and without real memory.

`profile_model(model, sample)` runs one forward and backward of the model on *fake* tensors
(FakeTensorMode: shapes, dtypes and devices, no data): the model's own parameters are never read,
written or given gradients, and no activation memory is allocated, so a model of any size can be
profiled on a laptop, including one built on the meta device.

It finds the repeated blocks (the transformer layers), counts parameters per block and outside them,
finds tied weights, counts forward and backward FLOPs per block (torch's FLOP formulas, flops.FlopTally), the bytes each block
saves for backward (saved-tensor hooks) and the largest single tensor the step creates.

The package, one job a module: model_profile (the records and their JSON round trip), blocks (structure:
blocks, Linear-like layers, shape facts), trace (the fake-tensor step), watch (the op watcher), flops (SDPA
FLOP formulas and the flash-like SDPA stand-in), cuda_autocast (CUDA autocast's float32 casts), build
(profile_model) and extrapolate (extrapolate_profile). This module re-exports what other modules use.
"""

from __future__ import annotations

from .blocks import find_blocks, is_matmul_layer, is_norm_layer, iter_block_modules
from .build import hooked_parameters, profile_model
from .extrapolate import extrapolate_profile
from .flops import flash_like_attention, flash_like_sdpa
from .model_profile import BlockProfile, MatmulCall, ModelProfile, NormCall, model_fingerprint

__all__ = [
    "BlockProfile",
    "MatmulCall",
    "NormCall",
    "ModelProfile",
    "extrapolate_profile",
    "find_blocks",
    "flash_like_attention",
    "flash_like_sdpa",
    "hooked_parameters",
    "is_matmul_layer",
    "is_norm_layer",
    "iter_block_modules",
    "model_fingerprint",
    "profile_model",
]
