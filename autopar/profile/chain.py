"""Whether the traced forward runs its blocks as the chain a pipeline splits, and the first thing that says not.

A pipeline stage runs the model's forward with the blocks of other stages and the modules with parameters that
are not its own replaced (autopar.strategies.pipeline): it receives the hidden states at its first block and
hands on its last block's output. That is the model's own forward only where the blocks are one chain: each
block called once, in order, on the previous block's output, nothing computed between them, no block reading a
value an earlier block or a module with parameters outside the blocks made (on another stage that value is a
placeholder's zeros), no value of a block but the last read after them, and the hidden states of one shape
throughout. A UNet's skips, a timestep embedding fed to every block, an auxiliary loss summed after the blocks,
a layer dropped or a conditional scale between blocks each break it, and trained silently wrong under a pipeline
(found by a helper's battery of users' models, 2026-12-07). `BlockChain.problem` names the first break, or is
empty; the trace fills it in (forward ops only) and `autopar.layout.pipeline_refusal` refuses pipelines with it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._util.batch import tensors_of
from .fusion import storage_key

#: Ops of the trace's own machinery, never the model's (functional_call's swaps, saved-tensor hooks).
_OWN_OPS = ("detach", "alias")


class BlockChain:
    """Follows the top-level block calls (`start`, `end`) and the forward's ops outside the blocks (`op`)."""

    def __init__(self, names: list[str], param_keys: set[Any], made_in: Callable[[torch.Tensor], int | None]) -> None:
        self.names = names  # the blocks' module names, in block order
        self.made_in = made_in  # the scope a forward tensor was made in (a block's index, else negative or None)
        self.outer = set(param_keys)  # parameters' storages, then what ops outside the blocks made from them
        self.calls = 0  # top-level block calls started
        self.finished = 0  # ... and finished
        self.problem = ""
        self._last: int | None = None  # the block that finished last
        self._hidden: torch.Tensor | None = None  # its hidden-states output
        self._last_made: set[Any] = set()  # storages of its outputs
        self._shape: tuple[int, ...] | None = None  # the first call's hidden states

    def _say(self, why: str) -> None:
        if not self.problem:
            self.problem = why

    def start(self, block: int, args: tuple, kwargs: dict[str, Any]) -> None:
        name = self.names[block]
        hidden, where = _hidden(args, kwargs)
        expected = 0 if self._last is None else self._last + 1
        if block != expected:
            self._say(f"block {name} runs where block {self.names[expected] if expected < len(self.names) else '?'}"
                      " was due (a block skipped, repeated or run out of order)")
        if self.calls and hidden is not None and self._hidden is not None and \
                storage_key(hidden) != storage_key(self._hidden):
            self._say(f"block {name} takes hidden states that are not block {self.names[self._last]}'s output")
        if hidden is not None:
            if self._shape is None:
                self._shape = tuple(hidden.shape)
            elif tuple(hidden.shape) != self._shape:
                self._say(f"block {name} takes hidden states of shape {tuple(hidden.shape)}, the first block "
                          f"{self._shape}")
        for key, value in _tensor_arguments(args, kwargs):
            if key == where:
                continue
            for t in tensors_of(value):
                made = self._block(t)
                if made is not None:
                    self._say(f"block {name} takes {key}, made in block {self.names[made]}")
                elif storage_key(t) in self.outer:
                    self._say(f"block {name} takes {key}, computed from parameters outside the blocks")
        self.calls += 1

    def end(self, block: int, output: Any) -> None:
        self.finished += 1
        self._last = block
        out = tensors_of(output)
        self._hidden = out[0] if out else None
        self._last_made = {storage_key(t) for t in out}

    def _block(self, t: torch.Tensor) -> int | None:
        made = self.made_in(t)
        return made if made is not None and 0 <= made < len(self.names) else None

    def op(self, name: str, scope_before: bool, tensors_in: list[torch.Tensor],
           tensors_out: list[torch.Tensor]) -> None:
        """A forward op outside the blocks (`scope_before`: no block has run yet)."""
        if name in _OWN_OPS:
            return
        keys = [storage_key(t) for t in tensors_in]
        if scope_before:
            if any(k in self.outer for k in keys):
                self.outer.update(storage_key(t) for t in tensors_out)
            return
        if self.finished < len(self.names):
            self._say(f"{name} runs between block {self.names[self._last]} and the next block")
            return
        for t, k in zip(tensors_in, keys):
            made = self._block(t)
            if made is not None and k not in self._last_made:
                self._say(f"{name} after the blocks reads a value made in block {self.names[made]}")
                return

    def finish(self) -> None:
        if self.calls and self.calls != len(self.names):
            self._say(f"the forward made {self.calls} block calls for {len(self.names)} blocks")


def _hidden(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, str | None]:
    """The hidden states a block call takes, as the trace reads them (its first positional tensor, else its first
    floating-point keyword tensor), and where: "arg0" or the keyword's name."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], "arg0"
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v, k
    return None, None


def _tensor_arguments(args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
