"""torch.compile, in place: per block under FSDP (the sharding hooks stay outside the graphs, and the
identical blocks share one compiled graph), the whole model's forward otherwise (the loss and the logits fuse
too).

The module's `forward` is replaced by its compiled self, so the module keeps its type, names and `state_dict`
keys, and its hooks (FSDP's, the pipeline's) and what wraps the forward afterwards (autocast) run outside the
graph.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from ..errors import PlanError
from ..plans import compile_backend_refusal, configured_compile_backend


def default_backend() -> str:
    """The compile backend: `AUTOPAR_COMPILE_BACKEND` if set (tests use "aot_eager"), else inductor; a name torch
    does not register is refused here, where it is read (PlanError naming it and the valid choices)."""
    return configured_compile_backend()


def apply_compile(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], *, per_block: bool,
                  backend: str | None = None) -> list[str]:
    """Compile the blocks (per_block) or the whole model; returns the names of what was compiled."""
    if isinstance(backend, str) and backend:  # refused before anything is compiled, naming the choices
        why = compile_backend_refusal(backend, source="compile_backend")
        if why is not None:
            raise PlanError(why)
    backend = backend or default_backend()
    if per_block and blocks:
        # The block's forward, not its call: module hooks (FSDP's, the pipeline's) stay outside the graph.
        for _, block in blocks:
            block.forward = torch.compile(block.forward, backend=backend)
        return [name for name, _ in blocks]
    # The whole model: its forward, so that what wraps the forward from outside (apply_autocast's autocast and
    # fp32 outputs, applied after this) stays outside the graph, as in the usual `with autocast: compiled(x)`.
    model.forward = torch.compile(model.forward, backend=backend)
    return ["<model>"]
