"""Float8 linears for training (Plan.float8): torchao's Float8Linear in place of the blocks' large nn.Linear layers,
dynamic scaling (scales from absolute maxima, every step), so that their forward GEMM and both backward GEMMs run on
float8 tensor cores while the weights, the optimizer and everything else stay as the plan has them (bf16 autocast
over fp32 weights, or FSDP2's mixed precision). Which layers: autopar.layout's float8_layers (large enough for the
float8 GEMM to pay for its casts). The recipe (Plan.float8_recipe) is torchao's: "tensorwise" (one scale a tensor)
or "rowwise" (a scale a row or column of each GEMM operand: closer to bf16, six casts a layer instead of three).

Under FSDP with tensorwise scaling the weights are all-gathered in float8 (torchao's enable_fsdp_float8_all_gather:
half the bytes of a bf16 gather; each weight's scale from an all-reduced absolute maximum before its gather), where
the process group can send float8: NCCL does, gloo has no float8 type ("Invalid scalar type"), so on gloo (CPU
tests) the weights are gathered in bf16 and the plan's notes say so; the training is the same either way.

torchao is an optional dependency (the extra `fp8`: `pip install -e ".[fp8]"` in autopar's clone, or `pip install
torchao`); a float8 plan without it, or on a GPU without float8 tensor cores, is refused before anything changes.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
import torch.nn as nn

from ..errors import PlanError
from ..plans import FLOAT8_RECIPES

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


def float8_all_gather_refusal(backend: str | None) -> str | None:
    """Why a plan's float8 all-gather (Plan.float8_all_gather) falls back to bf16 gathers on a process group of
    `backend` (torch.distributed's name of it, e.g. "nccl", "gloo", "cpu:gloo,cuda:nccl"), or None where it runs:
    only NCCL sends float8 tensors."""
    if backend is not None and "nccl" in backend:
        return None
    return (f"the {backend or 'missing'} process group has no float8 type, so the float8 linears' weights are gathered "
            "in bf16 (NCCL gathers them in float8)")


def apply_float8(model: nn.Module, layers: Sequence[str], *, recipe: str = "tensorwise",
                 all_gather: bool = False) -> list[str]:
    """Swap the named nn.Linear layers of `model` for torchao's Float8Linear with `recipe`'s scaling ("tensorwise"
    or "rowwise"), in place; returns the names swapped. `all_gather`: FSDP2 will gather their weights in float8
    (tensorwise only; apply FSDP after this). Their weights stay the same Parameters' values, their names and
    state_dict keys too."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in FLOAT8_RECIPES:
        raise PlanError(f"float8: unknown recipe {recipe!r}: use one of {', '.join(map(repr, FLOAT8_RECIPES))}.")
    if all_gather and recipe != "tensorwise":
        raise PlanError("float8: FSDP's float8 all-gather needs tensorwise scaling (torchao's rowwise recipe gathers "
                        "in bf16): set float8_recipe='tensorwise'.")
    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather) if recipe == "tensorwise"
              else Float8LinearConfig.from_recipe_name(recipe))

    wanted, modules = set(layers), dict(model.named_modules())
    missing = sorted(n for n in wanted if not isinstance(modules.get(n), nn.Linear))
    if missing:
        raise PlanError(f"float8: {', '.join(missing[:3])} {'is' if len(missing) == 1 else 'are'} not nn.Linear "
                        "layers of this model (a plan made for another model?): plan again, or set float8=False.")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in wanted)
    return sorted(wanted)
