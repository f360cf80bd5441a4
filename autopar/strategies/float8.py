"""Float8 linears for training (Plan.float8): torchao's Float8Linear in place of the blocks' large nn.Linear layers,
tensorwise dynamic scaling (each tensor's scale from its absolute maximum, every step), so that their forward GEMM
and both backward GEMMs run on float8 tensor cores while the weights, the optimizer and everything else stay as the
plan has them (bf16 autocast over fp32 weights, or FSDP2's mixed precision). Which layers: autopar.layout's
float8_layers (large enough for the float8 GEMM to pay for its casts).

torchao is an optional dependency (the extra `fp8`: `pip install -e ".[fp8]"` in autopar's clone, or `pip install
torchao`); a float8 plan without it, or on a GPU without float8 tensor cores, is refused before anything changes.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
import torch.nn as nn

from ..errors import PlanError

#: CUDA compute capability from which GPUs have float8 tensor cores (Ada, Hopper and later)
FLOAT8_CAPABILITY = (8, 9)


def float8_refusal(device: torch.device) -> str | None:
    """Why a float8 plan cannot run on `device` (one line saying what to change), or None. A CPU runs torchao's
    float8 GEMMs (slowly: for tests); a GPU needs float8 tensor cores."""
    if importlib.util.find_spec("torchao") is None:
        return ("float8=True needs torchao (pip install torchao, or pip install -e \".[fp8]\" in autopar's clone), "
                "or set float8=False.")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < FLOAT8_CAPABILITY:
        return (f"float8=True needs float8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}: set float8=False.")
    return None


def apply_float8(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """Swap the named nn.Linear layers of `model` for torchao's Float8Linear (tensorwise scaling), in place; returns
    the names swapped. Their weights stay the same Parameters' values, their names and state_dict keys too."""
    from torchao.float8 import convert_to_float8_training

    wanted, modules = set(layers), dict(model.named_modules())
    missing = sorted(n for n in wanted if not isinstance(modules.get(n), nn.Linear))
    if missing:
        raise PlanError(f"float8: {', '.join(missing[:3])} {'is' if len(missing) == 1 else 'are'} not nn.Linear "
                        "layers of this model (a plan made for another model?): plan again, or set float8=False.")
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in wanted)
    return sorted(wanted)
