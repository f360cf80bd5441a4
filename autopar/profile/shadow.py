"""InputShadows: real values beside the fake trace for what derives from the sample alone.

A fake tensor has no values, so a step that reads one (`labels.max() >= vocab_size`, `mask.sum(-1).tolist()`,
`labels.masked_select(labels >= 0)` for a CTC loss) cannot be traced. Such reads are almost always of the
sample (labels, lengths, masks), not of what the weights compute, and the sample is small and real. So the
sample's tensors keep a real copy (their shadow), and an op all of whose tensor arguments have shadows is also
run on those shadows, outside every mode: its fake outputs get the real results as shadows. A value read
(`aten._local_scalar_dense`, under `.item()`, `bool()`, `.tolist()`) of a shadowed tensor is answered from its
shadow; an op whose output shape depends on values (masked_select, nonzero) gets a fake output of the shape the
real one has. Tensors made in the step from Python data (`torch.tensor(...)`: `lift_fresh`) and by factories
(arange, zeros) are shadowed too. Anything computed from a weight has no shadow, so a read of it still fails
the trace (a step whose control flow follows the model's values cannot be planned from one trace).

Hand-written over torch's own real-tensor propagation (torch._functorch.config.fake_tensor_propagate_real_tensors)
because that one needs real weights, the memory the fake trace exists to avoid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from .._util.batch import tensors_of

MAX_SHADOW_BYTES = 64 * 2**20  # the largest tensor given a shadow; bytes; a bound on the host memory it costs
_LIFT = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_VALUE_READ = torch.ops.aten._local_scalar_dense.default


class InputShadows(TorchDispatchMode):
    """The dispatch mode that keeps shadows (enter it above the FakeTensorMode); `add(fake, real)` for each
    tensor of the sample before the step."""

    def __init__(self) -> None:
        super().__init__()
        self._shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake tensor -> its real value (on the CPU)
        self.reads = 0  # value reads answered and ops shaped by values: where torch.compile's graph would break

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Give `fake` the value of `real` (not kept where it is on the meta device or too large)."""
        if real.device.type != "meta" and real.numel() * real.element_size() <= MAX_SHADOW_BYTES:
            with _disable_current_modes():  # a real copy, whatever modes are active
                self._shadow[fake] = real.detach().to("cpu", dtype=fake.dtype, copy=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _LIFT:
            out = func(*args, **kwargs)
            self.add(out, args[0])
            return out
        tensors = tensors_of((args, kwargs))
        shadows = [self._shadow.get(t) for t in tensors]
        if not all(s is not None for s in shadows):  # the common case: an op of the weights' work
            self._forget_written(func, args)
            try:
                return func(*args, **kwargs)
            except DynamicOutputShapeException:
                self.reads += 1
                leaves, spec = tree_flatten((args, kwargs))
                return self._shaped_by_the_sample(func, leaves, spec, tensors)
        leaves, spec = tree_flatten((args, kwargs))
        if func is _VALUE_READ:
            self.reads += 1
            with _disable_current_modes():
                return shadows[0].item()
        real_args, real_kwargs = tree_unflatten([self._real(x) for x in leaves], spec)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            self.reads += 1
            real = self._run_real(func, real_args, real_kwargs)
            if real is None:
                raise
            out = tree_map(lambda r: self._fake_like(r, tensors), real)
            self._attach(out, real)
            return out
        if _bytes(out) <= MAX_SHADOW_BYTES:
            self._attach(out, self._run_real(func, real_args, real_kwargs))
        return out

    def _shaped_by_the_sample(self, func: Any, leaves: list, spec: Any, tensors: list[torch.Tensor]) -> Any:
        """Fake outputs for an op without a fake kernel whose output shapes follow the sample's values (a CTC
        loss's `log_alpha`, by the longest target): run on the shadows with zeros and then ones in place of the
        tensors that have none; where both runs agree on every shape, outputs of that shape (no shadows: their
        values are not known), else the op still cannot be traced."""
        if sum(t.numel() * t.element_size() for t in tensors if t not in self._shadow) > MAX_SHADOW_BYTES:
            raise DynamicOutputShapeException(func)
        shapes = []
        for fill in (0, 1):
            real_args, real_kwargs = tree_unflatten([self._real(x, fill) for x in leaves], spec)
            real = self._run_real(func, real_args, real_kwargs)
            if real is None:
                raise DynamicOutputShapeException(func)
            shapes.append([tuple(r.shape) for r in tree_flatten(real)[0] if isinstance(r, torch.Tensor)])
        if shapes[0] != shapes[1]:
            raise DynamicOutputShapeException(func)
        return tree_map(lambda r: self._fake_like(r, tensors), real)

    def _real(self, leaf: Any, fill: int | None = None) -> Any:
        """An argument as the op runs on shadows: a tensor's shadow; every device the CPU (shadows live there)."""
        if isinstance(leaf, torch.Tensor):
            shadow = self._shadow.get(leaf)
            if shadow is None:  # only with `fill`: a stand-in of the tensor's shape
                with _disable_current_modes():
                    return torch.full(tuple(leaf.shape), fill, dtype=leaf.dtype)
            return shadow
        if isinstance(leaf, torch.device):
            return torch.device("cpu")
        return leaf

    def _run_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The op on the shadows, with no mode active (not fake, not counted by the trace's watchers); None
        where it cannot run on the CPU (then its outputs get no shadow)."""
        with _disable_current_modes():
            try:
                return func(*args, **kwargs)
            except Exception:  # an op with no CPU kernel, or one the fake trace runs another way
                return None

    def _attach(self, out: Any, real: Any) -> None:
        if real is None:
            return
        fakes, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        for f, r in zip(fakes, reals):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                self.add(f, r)

    def _fake_like(self, real: Any, tensors: list[torch.Tensor]) -> Any:
        """A fake tensor of `real`'s shape and dtype on the device of the op's fake arguments."""
        if not isinstance(real, torch.Tensor):
            return real
        device = tensors[0].device if tensors else torch.device("cpu")
        return torch.empty_strided(tuple(real.shape), tuple(real.stride()), dtype=real.dtype, device=device)

    def _forget_written(self, func: Any, args: tuple) -> None:
        """An op that is not run on shadows and writes into a shadowed tensor makes that shadow stale."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for arg, value in zip(schema.arguments, args):
            if isinstance(value, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write:
                self._shadow.pop(value, None)


def _bytes(out: Any) -> int:
    leaves, _ = tree_flatten(out)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
