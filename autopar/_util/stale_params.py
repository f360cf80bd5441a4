"""An optimizer built before `autopar.wrap` holds the parameters wrap replaced (FSDP2 and tensor parallelism
make new DTensor parameters; materialising a meta model new ones too): its steps would change tensors the model
no longer uses, and it would train nothing, silently (issue 11: 0 of 34 parameters changed on 2 ranks).

`forget_replaced(before, model)` remembers the parameters of `before` that the wrapped `model` no longer holds;
a global optimizer step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook, torch's own
mechanism for every optimizer) refuses the first step of an optimizer that holds one, saying what to change.
Identity is checked by weak reference: a forgotten parameter that nothing else holds is let go."""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import StaleOptimizerError


class _Replaced:
    """The parameters wraps have replaced in this process, and the one hook that checks optimizers for them."""

    def __init__(self) -> None:
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._handle = None

    def add(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self._params[id(p)] = p
        if len(self._params) and self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def holds_replaced(self, optimizer: torch.optim.Optimizer) -> int:
        """How many of the optimizer's parameters a wrap replaced."""
        return sum(1 for group in optimizer.param_groups for p in group["params"] if self._params.get(id(p)) is p)

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stale = self.holds_replaced(optimizer)
        if stale:
            raise StaleOptimizerError(
                f"{type(optimizer).__name__} was built before autopar.wrap: {stale} of its parameters are no longer "
                "the model's (the plan replaced them), so its steps would train nothing; build the optimizer after "
                "wrap, from the wrapped model: torch.optim.AdamW(model.parameters(), ...).")


REPLACED = _Replaced()


def forget_replaced(before: list[torch.Tensor], model: nn.Module) -> int:
    """Remember the parameters of `before` that `model` no longer holds (returns how many)."""
    now = {id(p) for p in model.parameters()}
    replaced = [p for p in before if id(p) not in now]
    REPLACED.add(replaced)
    return len(replaced)
