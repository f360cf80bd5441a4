"""A reduction over a dimension tensor parallelism divides: found by comparing the split step with the unsplit one.

Between a column-wise layer and its row-wise partner each rank holds plain local tensors: a slice of the heads,
or of the MLP's inner width. Elementwise code on them is right; a reduction over the dimension the split divides
is not, and runs without an error: a softmax or a normalize over the inner width normalizes each rank's slice
alone, and an attention reshaped with its head count written as a constant (`q.view(b, t, 8, -1)`) keeps every
head and splits each head's width, so its scores are partial dot products. The pipeline-and-TP battery of
2026-12-07 found such models trained under tp=2 with losses 7e-4 to 1.7e-3 off a single process, silently.

`divided_reductions` runs after the trial's step (autopar.strategies.tensor_parallel_trial) has run both ways on
fake tensors: the calls the forward made at the level of torch functions (`Recorder`, a TorchFunctionMode) are
aligned by name between the unsplit and the split step, and where an aligned call reduces or contracts over a
dimension whose size differs between the two (its input's), the plan's result would be wrong there. DTensors
(sequence parallelism's stream, the vocabulary-parallel head) are left out: DTensor computes their ops right.
"""

from __future__ import annotations

import difflib
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .tensor_parallel_layout import HEAD_ATTRS

#: Reductions over a `dim` argument, with its default where it has one (None: none, or the whole tensor, which is
#: not read: a whole-tensor max, any or sum in a forward is a check or an auxiliary loss, not the layer's numerics).
_DIM_REDUCTIONS = {
    "softmax": None, "log_softmax": None, "_softmax": None, "sum": None, "mean": None, "amax": None, "amin": None,
    "logsumexp": None, "norm": None, "vector_norm": None, "var": None, "std": None, "prod": None, "argmax": None,
    "argmin": None, "max": None, "min": None, "cumsum": None, "cumprod": None, "nansum": None, "nanmean": None,
    "median": None, "var_mean": None, "std_mean": None, "normalize": 1, "topk": -1, "sort": -1, "argsort": -1,
    "cosine_similarity": 1,
}
#: Where the `dim` argument sits among the positional arguments (the tensor first), where not second.
_DIM_POSITION = {"topk": 2, "normalize": 2, "cosine_similarity": 2, "norm": 2, "vector_norm": 2}
#: Normalizations over their last len(normalized_shape) dimensions.
_LAST_DIMS = {"layer_norm", "rms_norm"}
#: Matrix products contracting the first operand's last dimension.
_CONTRACTIONS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "linear"}
_RECORDED = set(_DIM_REDUCTIONS) | _LAST_DIMS | _CONTRACTIONS | {"scaled_dot_product_attention", "einsum"}
#: autopar's own source folder: its frames are not the model's code.
_AUTOPAR = str(Path(__file__).parents[1]) + os.sep  # as the frames name it (the import's path, not resolved)
#: The file of autopar's own split forwards: a norm over a split width run with its statistic all-reduced
#: (`_split_norm_forward`, OLMo 2's q_norm), a module reading its per-head parameters' shards, fused and Conv1D
#: layers computing on their local shards. What runs under them is compensated there.
_SPLIT_FORWARDS = str(Path(__file__).with_name("tensor_parallel.py"))


def _in_torch(filename: str) -> bool:
    path = filename.replace("\\", "/")
    return "/torch/" in path or "/functorch/" in path


def model_line(frames: traceback.StackSummary | list[traceback.FrameSummary]) -> str:
    """The model's line among `frames` (the last one outside torch and autopar), as " at modeling_x.py:123 in
    forward", or "" where every frame is the machinery's. The trial's errors name their line with it too."""
    last = next((f for f in reversed(frames) if not f.filename.startswith(_AUTOPAR) and not _in_torch(f.filename)),
                None)
    if last is None:
        return ""
    return f" at {Path(last.filename).name}:{last.lineno} in {last.name}"


def _stack() -> traceback.StackSummary:
    """The call stack, outermost first, as traceback.extract_stack gives it, without reading source lines (the
    trial's forward makes many recorded calls)."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
    stack.reverse()
    return stack


@dataclass(frozen=True)
class Call:
    """One torch-function call of the forward: its name, the shapes of its tensor arguments (None for a DTensor)
    in order, the dims it reduces over per tensor argument (resolved against each shape), and the model's line."""

    name: str
    shapes: tuple[tuple[int, ...] | None, ...]
    reduced: tuple[tuple[int, ...], ...]  # per tensor argument, the dims it reduces or contracts over
    where: str


def _name(func: Any) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _dims(value: Any, ndim: int) -> tuple[int, ...] | None:
    """`value` (an int, a sequence of ints, or None: every dim) as non-negative dims of an `ndim`-d tensor."""
    if value is None:
        return tuple(range(ndim))
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    return tuple(sorted({v % ndim for v in values})) if ndim else ()


def _reduced(name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """The dims of each tensor argument that `name` reduces or contracts over (empty where none, or not known)."""
    none: tuple[int, ...] = ()
    out = [none] * len(tensors)
    if not tensors:
        return tuple(out)
    first = tensors[0]
    if name in _DIM_REDUCTIONS:
        if name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return tuple(out)  # the elementwise max of two tensors
        position = _DIM_POSITION.get(name, 1)
        given = args[position] if len(args) > position else None
        dim = kwargs.get("dim", given if given is not None else _DIM_REDUCTIONS[name])
        if dim is None:  # the whole tensor: not read (above)
            return tuple(out)
        dims = _dims(dim, first.dim()) or none
        if name == "cosine_similarity":  # both operands, over `dim`
            return tuple(dims for _ in tensors)
        out[0] = dims
    elif name in _LAST_DIMS:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
        count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
        out[0] = tuple(range(max(first.dim() - count, 0), first.dim()))
    elif name in _CONTRACTIONS:
        operand = 1 if name in ("baddbmm", "addmm", "addbmm") else 0
        if name == "__rmatmul__":  # b.__rmatmul__(a) is a @ b: a's last dim
            operand = 1 if len(tensors) > 1 else 0
        if operand < len(tensors) and tensors[operand].dim() >= 1:
            out[operand] = (tensors[operand].dim() - 1,)
    elif name == "scaled_dot_product_attention" and len(tensors) >= 2:
        out[0] = (first.dim() - 1,)  # the scores contract the head width
        out[1] = (tensors[1].dim() - 2,) if tensors[1].dim() >= 2 else none  # and run over every key
    elif name == "einsum" and isinstance(args[0] if args else None, str):
        out = list(_einsum_contracted(args[0], tensors))
    return tuple(out)


def _einsum_contracted(equation: str, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    if "->" not in equation or "." in equation:
        return tuple(() for _ in tensors)
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != len(tensors):
        return tuple(() for _ in tensors)
    return tuple(tuple(i for i, letter in enumerate(term) if letter not in output) for term in terms)


def _from_autopar(stack: traceback.StackSummary) -> bool:
    """Whether the call is autopar's own (the innermost caller outside torch is autopar's code: its row-wise
    layers' contractions over the divided width are all-reduced), or runs under one of autopar's split forwards."""
    if any(frame.filename == _SPLIT_FORWARDS for frame in stack):
        return True
    for frame in reversed(stack):
        if frame.filename == __file__ or _in_torch(frame.filename):
            continue
        return frame.filename.startswith(_AUTOPAR)
    return False


class Recorder(TorchFunctionMode):
    """Records the reductions and contractions the model's forward calls (`calls`); autopar's own are left out.
    Backward is not seen (it runs below torch functions)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = _name(func)
        stack = _stack() if name in _RECORDED else None
        if stack is not None and not _from_autopar(stack):
            leaves, _ = tree_flatten((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            try:
                reduced = _reduced(name, args, kwargs, tensors)
            except Exception:  # an argument form this reader does not know: nothing concluded for this call
                reduced = tuple(() for _ in tensors)
            shapes = tuple(None if isinstance(t, DTensor) else tuple(t.shape) for t in tensors)
            self.calls.append(Call(name, shapes, reduced, model_line(stack)))
        return func(*args, **kwargs)


def divided_reductions(unsplit: list[Call], split: list[Call]) -> str | None:
    """The first call of the split step that reduces or contracts over a dimension the split divided (its size
    differs from the unsplit step's, aligned call by call), as one line; None where there is none."""
    matcher = difflib.SequenceMatcher(None, [c.name for c in unsplit], [c.name for c in split], autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            whole, part = unsplit[block.a + i], split[block.b + i]
            for full, local, dims in zip(whole.shapes, part.shapes, part.reduced):
                if full is None or local is None or len(full) != len(local):
                    continue
                divided = [d for d in dims if full[d] != local[d]]
                if divided:
                    d = divided[0]
                    hint = "" if part.name in _DIM_REDUCTIONS or part.name in _LAST_DIMS else (
                        " (a reshape that writes the head count as a number splits each head instead of the heads: "
                        f"keep it in an attribute autopar divides, {', '.join(HEAD_ATTRS)})")
                    return (f"{part.name} runs over dim {d} of a {list(local)} tensor{part.where}, which the split "
                            f"divides ({full[d]} in the model, {local[d]} on each rank): each rank would reduce its "
                            f"slice alone and train silently wrong{hint}")
    return None
