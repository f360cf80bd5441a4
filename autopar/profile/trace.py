"""The fake-tensor trace: one forward and backward of the model on fake copies of its parameters and sample
(StepTrace), and what it measured (Trace): FLOPs per block, bytes saved for backward per block, the largest
tensor, Linear-like calls, how blocks are called and which modules run around them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from .._util.batch import (autocast_outputs, default_loss, first_tensor, map_tensors, sample_batch_size, split_sample,
                           to_fp32_outputs)
from .._util.kv_cache import kv_cache_off_while
from ..errors import ProfileError, TraceError
from .allocator import ReplayedSteps, replay_steps
from .chain import BlockChain
from .blocks import is_matmul_layer, is_norm_layer
from .cuda_autocast import CudaAutocastPolicy
from .flops import flash_like_sdpa
from .hf_masks import CompileMasks
from .live import Frontier
from .model_profile import MatmulCall, NormCall, OpGroup
from .shadow import InputShadows
from .watch import BEFORE, LOSS, StepWatcher, storage_key

Units = list[tuple[str, nn.Module]]


@dataclass(frozen=True)
class Trace:
    """What one traced step measured (zeros when the step is not traced). Per-block tuples follow the units."""

    forward_flops: float
    flops: float
    block_flops: tuple[float, ...]
    saved_bytes: tuple[int, ...]  # per block, for backward
    saved_outside_bytes: int  # saved for backward outside the blocks (embeddings, head, loss)
    largest_bytes: int
    largest_op: str
    saved_hidden_bytes: tuple[int, ...]  # per block, of saved_bytes: tensors shaped like the hidden states
    selective_bytes: tuple[int, ...]  # per block: matmul and attention outputs in the forward
    alternate_bytes: tuple[int, ...] = ()  # per block: of those, what "alternate" checkpointing keeps
    alternate_recompute_flops: tuple[float, ...] = ()  # per block: forward FLOPs of the GEMMs it recomputes
    gemm_bytes: tuple[int, ...] = ()  # per block: of selective_bytes, the dense GEMMs' outputs ("gemms" recomputes)
    gemm_flops: tuple[float, ...] = ()  # per block: those GEMMs' forward FLOPs
    matmul_calls: tuple[MatmulCall, ...] = ()
    norm_calls: tuple[NormCall, ...] = ()
    block_input: str | None = None
    block_input_shape: tuple[int, ...] | None = None
    block_num_args: int = 1
    block_input_bytes: int = 0
    block_output_arity: int = 0
    pipeline_chain: str = ""  # where the forward's blocks are not the chain a pipeline splits (BlockChain.problem)
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    num_ops: int = 0
    traffic_bytes: int = 0
    weight_traffic_bytes: int = 0
    op_groups: tuple[OpGroup, ...] = ()  # every op by kind and shape (autopar.cost.ops prices them)
    value_reads: int = 0  # the model's forward's reads of tensor values (InputShadows.reads)
    live_frontier: Frontier = ()  # (other, gradient, weight-cast) bytes alive at the moments that can peak (LiveMemory)
    allocator_reserve_bytes: int | None = None  # the caching allocator's reserve over the allocated peak in a loop
    # of this step (autopar.profile.allocator.replay_steps); None: not replayed
    allocator_replay_on_cuda: bool = False  # whether that step dispatched as CUDA does (a fake CUDA device)
    largest_where: str = ""  # where the largest tensor was made: "the forward of block NAME", "the loss's backward"
    differentiated_where: str = ""  # where the forward took a gradient (torch.autograd.grad in it): "the forward of
    # block NAME"; empty: it took none
    buffers_written: tuple[str, ...] = ()  # the buffers the forward writes (running statistics, an EMA codebook)
    params_written: tuple[str, ...] = ()  # the parameters the forward writes in place (Embedding(max_norm=)'s renorm)
    params_unused: tuple[str, ...] = ()  # the trainable parameters the step gave no gradient (unused by this sample)
    sequence_first: str = ""  # a batch_first=False module called with the sample's dim 0 as its sequence: "NAME
    # (CLASS, batch_first=False, called with SHAPE)"; empty: none
    # under autocast: the trainable weights a forward matmul read in float32 (autocast did not reach it), and those
    # this trace gave the step in bf16 (`StepTrace(bf16_weights=...)`), as autopar's autocast gives them
    fp32_matmul_weights: tuple[str, ...] = ()
    bf16_weights: tuple[str, ...] = ()
    matmul_weights: tuple[str, ...] = ()  # the trainable weights a forward matmul read (bf16 traces), in any dtype

    @classmethod
    def untraced(cls, num_blocks: int) -> "Trace":
        zeros = (0,) * num_blocks
        return cls(forward_flops=0.0, flops=0.0, block_flops=(0.0,) * num_blocks, saved_bytes=zeros,
                   saved_outside_bytes=0, largest_bytes=0, largest_op="not traced", saved_hidden_bytes=zeros,
                   selective_bytes=zeros, alternate_bytes=zeros, alternate_recompute_flops=(0.0,) * num_blocks,
                   gemm_bytes=zeros, gemm_flops=(0.0,) * num_blocks)


@dataclass(frozen=True)
class _BlockCall:
    """How the first block was called: where the hidden states came in, their shape, numel and bytes."""

    input: str | None  # "arg0", "kwarg:NAME", or None (no floating tensor argument)
    shape: tuple[int, ...] | None
    numel: int | None
    nbytes: int
    num_args: int

    @classmethod
    def of(cls, args: tuple, kwargs: dict[str, Any]) -> "_BlockCall":
        if args and isinstance(args[0], torch.Tensor):
            hidden, where = args[0], "arg0"
        else:
            names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
            if not names:
                return cls(input=None, shape=None, numel=None, nbytes=0, num_args=len(args))
            hidden, where = kwargs[names[0]], f"kwarg:{names[0]}"
        return cls(input=where, shape=tuple(hidden.shape), numel=hidden.numel(),
                   nbytes=hidden.numel() * hidden.element_size(), num_args=len(args))


class Fp32WeightsFound(Exception):
    """A bf16 trace stopped after the first block whose forward read trainable weights in fp32 in a matmul
    (StepTrace(stop_at_fp32_weights=True)): their names, and the block's index."""

    def __init__(self, names: tuple[str, ...], block: int) -> None:
        super().__init__(f"matmuls read {', '.join(names)} in float32 under autocast")
        self.names, self.block = names, block


class StepTrace:
    """One forward and backward of `model` on fake tensors, and what its hooks count.

    The model's own tensors are never touched: the step runs through functional_call on fake copies of its
    parameters and buffers (tied ones stay tied). Module hooks record the block stack, Linear-like calls,
    how the first block is called and the modules around the blocks; a saved-tensor hook counts the bytes
    each block saves for backward; a StepWatcher watches the ops (and counts their FLOPs). `run()` once."""

    def __init__(self, model: nn.Module, sample: Any, units: Units, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, precision: str, real_weights: bool = False,
                 bf16_weights: tuple[str, ...] = (), stop_at_fp32_weights: bool = False, flash_like: bool = True) -> None:
        self.model, self.units, self.loss_fn, self.precision = model, units, loss_fn, precision
        self.value_reads = 0  # the model's forward's reads of tensor values, once it has returned
        device = _profile_device(model, sample)
        self.on_cuda = device.type == "cuda"  # a fake CUDA step: CUDA's own dispatch, allocation for allocation
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        pure = torch.bfloat16 if precision == "bf16-pure" else None  # FSDP mixed precision: bf16 weights and inputs
        self.state = _fake_state(model, self.fake_mode, device, pure)
        # Tensors a module keeps as plain attributes (neither parameters nor buffers: VideoMAE's sinusoidal
        # position table) are swapped for fake copies too, on the device they are on, as the real step reads them.
        self.attributes, attribute_reals = _fake_attributes(model, self.fake_mode, device)
        self.shadows = InputShadows()  # the sample's values, for the step's reads of them (labels.max())
        self.sample = fake_sample(sample, self.fake_mode, device, pure, self.shadows)
        if real_weights:  # the weights' values too: a step whose control flow reads what they compute (build.py)
            for name, real in list(model.named_parameters(remove_duplicate=False)) + list(
                    model.named_buffers(remove_duplicate=False)):
                self.shadows.add(self.state[name], real)
            for key, fake in self.attributes.items():
                self.shadows.add(fake, attribute_reals[key])
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
        # A bf16 profile is for GPU plans: where the trace runs on another device, CUDA autocast's float32 ops
        # are cast as a GPU run casts them.
        # (On a CUDA device only its check of ops CUDA has no bf16 kernel for, which a bf16 input reaches: typed.)
        self.cuda_policy = CudaAutocastPolicy(device.type, cast=device.type != "cuda") if precision == "bf16" \
            else contextlib.nullcontext()
        self.sdpa = flash_like_sdpa() if device.type == "cpu" and flash_like else contextlib.nullcontext()
        self.watcher = StepWatcher({storage_key(t) for t in self.state.values()},
                                   {tuple(t.shape) for t in self.state.values() if t.dim() >= 2},
                                   len(units), self.running_block, compile_masks=CompileMasks(self.shadows))
        if precision == "bf16":  # which trainable weights a matmul reads in fp32 under autocast (StepWatcher)
            self.watcher.autocast_weights = {storage_key(t): name for name, t in self.state.items()
                                             if isinstance(t, torch.Tensor) and t.requires_grad}
        self.bf16_weights = tuple(bf16_weights) if precision == "bf16" else ()
        # Stop at the end of the first block whose forward read a trainable weight in fp32 in a matmul (autocast does
        # not reach it): such a step is traced again with those weights in bf16 (build.py), so the rest of this one
        # would be for nothing (Fp32WeightsFound says which weights the block read so)
        self.stop_at_fp32_weights = stop_at_fp32_weights and precision == "bf16"
        self._block_of = {id(m): i for i, (_, m) in enumerate(units)}
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self.watcher.chain = self.chain = BlockChain([n for n, _ in units], {
            storage_key(v) for n, v in self.state.items() if n in params}, self.watcher.made_in)
        self._stack: list[int] = []  # blocks whose forward is running, innermost last
        self._finished = 0  # blocks whose forward has finished (outermost calls)
        self._counted: set[Any] = set()  # storages already counted as saved
        self._input_ids: dict[Any, int] = {}  # storage of a Linear-like call's input -> its input_id
        self._matmul_names: dict[int, str] = {}
        self._norm_names: dict[int, str] = {}
        self._outer_names: dict[int, str] = {}
        self.saved_bytes = [0] * len(units)
        self.saved_hidden_bytes = [0] * len(units)
        self.saved_outside_bytes = 0
        self.matmul_calls: list[MatmulCall] = []
        self.norm_calls: list[NormCall] = []
        self.first_call: _BlockCall | None = None
        self.output_arity: int | None = None
        self.before: list[str] = []
        self.after: list[str] = []
        self.sequence_first = ""

    # ---- running the step ------------------------------------------------------------------------
    def run(self) -> Trace:
        """The step, and what it measured; TraceError where the model cannot run it on fake tensors."""
        try:
            with self._hooked(), quiet_fake_kernel_errors():
                forward_flops = self._step()
        except (ProfileError, Fp32WeightsFound):
            raise
        except Exception as exc:  # a model that cannot run on fake tensors, or a sample that does not fit it
            raise TraceError(_cannot_trace(self.model, exc)) from exc
        return self._result(forward_flops)

    def _step(self) -> float:
        """Forward (with the loss) and backward; the forward's FLOPs."""
        with self.fake_mode, self.watcher, self.shadows, self.sdpa, \
                self.watcher.compile_masks.installed(), conversions_without_swaps():
            # The model's tensors stay swapped for their fake copies through backward as well: a forward that
            # checkpoints (torch.utils.checkpoint) runs its modules again there, and must find the fake ones.
            tensors = {**_per_slot(self.model, self.state), **self.attributes}
            for name in self.bf16_weights:  # as autopar's autocast gives them to the forward (strategies.precision)
                if name in tensors:
                    tensors[name] = tensors[name].to(torch.bfloat16)
                    self.watcher.autocast_weights[storage_key(tensors[name])] = name  # its matmuls' reads noted
            return functional_call(_Swapped(self.model, self._forward_backward),
                                   {f"model.{name}": t for name, t in tensors.items()}, (), {},
                                   tie_weights=False, strict=False)

    def _forward_backward(self) -> float:
        """The step itself, with the model's tensors swapped (_step); the forward's FLOPs."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            with self.autocast, self.cuda_policy:
                args, kwargs = split_sample(self.sample)
                with kv_cache_off_while(self.model):  # as wrap runs it (strategies/apply.py, step 4)
                    output = self.model(*args, **kwargs)
                self.watcher.in_loss = True
                self.chain.finish()
                self.value_reads = self.shadows.reads  # the model's forward's (not the loss's)
                output = _as_returned(output, self.precision)  # in the loss's scope
                loss = self.loss_fn(output, self.sample) if self.loss_fn is not None else default_loss(output)
                # The loop `loss = loss_fn(model(x), y)` drops the model's output once the loss is made: what
                # backward needs of it is saved; the rest (the logits) is freed before backward runs.
                del output
        forward_flops = float(self.watcher.flops.total)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ProfileError("loss_fn must return a scalar tensor.")
        self.watcher.label_loss(loss)
        self.watcher.forward = False
        loss.backward()
        return forward_flops

    @contextlib.contextmanager
    def _hooked(self) -> Iterator[None]:
        """The module hooks, registered for the step and removed after it (also when it fails)."""
        handles = []
        for _, m in self.units:
            handles.append(m.register_forward_pre_hook(self.on_block_start, with_kwargs=True))
            handles.append(m.register_forward_hook(self.on_block_end))
        for name, m in self.model.named_modules():
            if is_matmul_layer(m):
                self._matmul_names[id(m)] = name
                handles.append(m.register_forward_pre_hook(self.on_matmul))
                handles.append(m.register_forward_hook(self.on_matmul_output))
            elif is_norm_layer(m):
                self._norm_names[id(m)] = name
                handles.append(m.register_forward_pre_hook(self.on_norm))
            if getattr(m, "batch_first", True) is False and isinstance(m, _SEQUENCE_FIRST):
                handles.append(m.register_forward_pre_hook(self._on_sequence_first(name), with_kwargs=True))
            if name and list(m.parameters(recurse=False)) and \
                    not any(name.startswith(u + ".") or name == u for u, _ in self.units):
                self._outer_names[id(m)] = name
                handles.append(m.register_forward_pre_hook(self.on_outer_module))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _result(self, forward_flops: float) -> Trace:
        call, w = self.first_call, self.watcher
        gradients = [t.grad for t in self.state.values() if t.grad is not None]
        return Trace(
            forward_flops=forward_flops, flops=float(w.flops.total),
            block_flops=tuple(float(w.flops.by_scope.get(i, 0)) for i in range(len(self.units))),
            saved_bytes=tuple(self.saved_bytes), saved_outside_bytes=self.saved_outside_bytes,
            largest_bytes=w.largest_bytes, largest_op=w.largest_op,
            saved_hidden_bytes=tuple(self.saved_hidden_bytes), selective_bytes=tuple(w.selective_bytes),
            alternate_bytes=tuple(w.alternate_bytes), alternate_recompute_flops=tuple(w.alternate_recompute_flops),
            gemm_bytes=tuple(w.gemm_bytes), gemm_flops=tuple(w.gemm_flops),
            num_ops=w.num_ops, traffic_bytes=w.traffic_bytes, weight_traffic_bytes=w.weight_traffic_bytes,
            matmul_calls=tuple(dataclasses.replace(c, consumer=w.consumers.get(i, "")) for i, c in enumerate(
                self.matmul_calls)), norm_calls=tuple(self.norm_calls), op_groups=w.op_groups(),
            block_input=call.input if call else None, block_input_shape=call.shape if call else None,
            block_num_args=call.num_args if call else 1, block_input_bytes=call.nbytes if call else 0,
            block_output_arity=self.output_arity or 0, before=tuple(self.before), after=tuple(self.after),
            pipeline_chain=self.chain.problem,
            value_reads=self.value_reads,
            live_frontier=w.live.frontier(gradients),
            allocator_reserve_bytes=self._allocator_replay(gradients).reserve_bytes,
            allocator_replay_on_cuda=self.on_cuda,
            largest_where=self._where(w.largest_scope, w.largest_backward) if w.largest_bytes else "",
            differentiated_where="" if w.differentiated_in is None else self._where(w.differentiated_in, False),
            sequence_first=self.sequence_first,
            buffers_written=tuple(name for name, _ in self.model.named_buffers()
                                  if name in self.state and storage_key(self.state[name]) in w.written),
            params_written=tuple(name for name, _ in self.model.named_parameters()
                                 if name in self.state and storage_key(self.state[name]) in w.written),
            params_unused=tuple(name for name, p in self.model.named_parameters()
                                if p.requires_grad and name in self.state and self.state[name].grad is None),
            fp32_matmul_weights=tuple(sorted(w.fp32_matmul_weights)), bf16_weights=self.bf16_weights,
            matmul_weights=tuple(sorted(w.matmul_weights)))

    def _where(self, scope: int, backward: bool) -> str:
        """Words for a scope of the watcher (a block's index, or BEFORE, AFTER, LOSS) and a pass."""
        passed = "backward" if backward else "forward"
        if scope >= 0:
            return f"the {passed} of block {self.units[scope][0]}"
        if scope == LOSS:
            return f"the loss's {passed}"
        return f"the {passed} of the modules {'before' if scope == BEFORE else 'after'} the blocks"

    def _allocator_replay(self, gradients: list[torch.Tensor]) -> ReplayedSteps:
        """A training loop of this step through the caching allocator's model: the weights and buffers (once
        each, tied ones once), the batch, and fused AdamW's state (a 4-byte step count and two tensors like the
        parameter, per trainable parameter, as torch.optim.AdamW(fused=True) makes them at its first step)."""
        unique = list({id(t): t for t in self.state.values()}.values())  # tied weights: one tensor
        trainable = [t for t in unique if t.requires_grad]
        state = [n for t in trainable for n in (4, _nbytes(t), _nbytes(t))]
        batch: list[int] = []
        map_tensors(lambda t: batch.append(_nbytes(t)), self.sample)
        return replay_steps(self.watcher.live.step_events(gradients),
                            weight_bytes=[_nbytes(t) for t in unique], state_bytes=state, batch_bytes=batch)

    # ---- the hooks -------------------------------------------------------------------------------
    def running_block(self) -> int | None:
        """The innermost block whose forward is running, or None outside the blocks."""
        return self._stack[-1] if self._stack else None

    def on_block_start(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._stack:
            self.chain.start(self._block_of[id(module)], args, kwargs)
        self._stack.append(self._block_of[id(module)])
        if self.first_call is None:
            self.first_call = _BlockCall.of(args, kwargs)

    def on_block_end(self, module: nn.Module, _args: Any, out: Any) -> None:
        block = self._stack.pop()
        if not self._stack:
            self._finished += 1
            self.chain.end(block, out)
            if self.stop_at_fp32_weights and self.watcher.fp32_matmul_weights:
                raise Fp32WeightsFound(tuple(sorted(self.watcher.fp32_matmul_weights)), block)
        if self.output_arity is None:
            self.output_arity = len(out) if isinstance(out, (tuple, list)) else 0

    def on_matmul(self, module: nn.Module, args: Any) -> None:
        """Records a Linear-like call: the layer, its kind, which input it read, its features."""
        if not args or not isinstance(args[0], torch.Tensor):
            return
        kind = is_matmul_layer(module)
        in_f, out_f = ((module.in_features, module.out_features) if kind == "linear"
                       else (module.weight.shape[0], module.weight.shape[1]))
        input_id = self._input_ids.setdefault(storage_key(args[0]), len(self._input_ids))
        self.matmul_calls.append(MatmulCall(name=self._matmul_names[id(module)], kind=kind, input_id=input_id,
                                            in_features=int(in_f), out_features=int(out_f)))

    def on_matmul_output(self, module: nn.Module, _args: Any, output: Any) -> None:
        """The id a later call reading this Linear-like call's output (or a view of it) has (MatmulCall.output_id)."""
        last = self.matmul_calls[-1] if self.matmul_calls else None
        if isinstance(output, torch.Tensor) and last is not None and last.name == self._matmul_names[id(module)]:
            output_id = self._input_ids.setdefault(storage_key(output), len(self._input_ids))
            self.matmul_calls[-1] = dataclasses.replace(last, output_id=output_id)
            self.watcher.watch_consumers[storage_key(output)] = len(self.matmul_calls) - 1

    def on_norm(self, module: nn.Module, args: Any) -> None:
        """Records a norm's call inside the blocks: which tensor it read (tensor parallelism splits a norm that reads
        a split projection's output whole), its weight's width."""
        if not self._stack or not args or not isinstance(args[0], torch.Tensor):
            return
        weight = getattr(module, "weight", None)
        width = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() >= 1 else 0
        input_id = self._input_ids.setdefault(storage_key(args[0]), len(self._input_ids))
        self.norm_calls.append(NormCall(name=self._norm_names[id(module)], input_id=input_id, width=width))

    def _on_sequence_first(self, name: str) -> Callable[..., None]:
        """A hook on a batch_first=False module (an RNN, attention, a transformer layer): notes it where its input's
        dim 0 is the sample's batch size and dim 1 is not (the sample's dim 0 is then its sequence)."""
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else next((kwargs[k] for k in ("input", "src", "query", "tgt") if k in kwargs), None)
            if self.sequence_first or not isinstance(x, torch.Tensor) or x.dim() < 3:
                return
            try:
                batch = sample_batch_size(self.sample)
            except Exception:  # a sample with no batch dimension: nothing to compare
                return
            if x.shape[0] == batch and x.shape[1] != batch:
                self.sequence_first = (f"{name} ({type(module).__name__}, batch_first=False, called with "
                                       f"{tuple(x.shape)})")
        return hook

    def on_outer_module(self, module: nn.Module, _args: Any) -> None:
        """A module with parameters of its own outside the blocks: before the first block or after the last."""
        if self._stack:
            return
        name = self._outer_names[id(module)]
        if self._finished == 0 and name not in self.before:
            self.before.append(name)
        elif self._finished == len(self.units) and name not in self.after:
            self.after.append(name)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensor hook: counts each saved storage once (never the weights), for the running block."""
        key = storage_key(t)
        if key in self.watcher.weight_storages or key in self._counted:
            return t
        self._counted.add(key)
        nbytes = t.untyped_storage().nbytes()
        block = self.running_block()
        if block is None:
            self.saved_outside_bytes += nbytes
            return t
        self.saved_bytes[block] += nbytes
        if self.first_call is not None and self.first_call.numel and t.numel() == self.first_call.numel:
            self.saved_hidden_bytes[block] += nbytes
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _DropErrors(logging.Filter):
    """Drops the ERROR records (with a traceback) FakeTensorMode logs when a meta kernel refuses an op: the
    exception itself reaches run(), which reports it as a TraceError (or profile_model tries another precision)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def quiet_fake_kernel_errors() -> Iterator[None]:
    log, drop = logging.getLogger(FakeTensorMode.__module__), _DropErrors()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


@contextlib.contextmanager
def conversions_without_swaps() -> Iterator[None]:
    """nn.Module._apply (what a forward's `module.to(dtype)`, `.float()`, `.half()` run) as the traced step can run
    it. torch converts a FakeTensor parameter by swapping it in place (torch.utils.swap_tensors, even where the
    conversion returns the same tensor), which refuses a tensor with weak references, and the trace holds some to
    every tensor it sees: NLLB-MoE's router runs `self.classifier = self.classifier.to(dtype)` in its forward. Inside
    the trace, a module holding fake tensors gets the converted ones set in their slots instead (a new Parameter
    where the conversion made a new tensor, nothing where it returned the same one), as torch's own path for plain
    tensors does without the future flag; the model's real tensors are restored after the step as always
    (functional_call puts them back by name)."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = nn.Module._apply

    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        params = [p for p in self._parameters.values() if p is not None]
        if not any(isinstance(t, FakeTensor) for t in (*params, *self._buffers.values())) \
                or any(p.grad is not None for p in params):
            return original(self, fn, recurse)
        if recurse:
            for child in self.children():
                child._apply(fn)
        with torch.no_grad():
            for key, p in self._parameters.items():
                if p is not None and (applied := fn(p)) is not p:
                    self._parameters[key] = nn.Parameter(applied, requires_grad=p.requires_grad)
            for key, b in self._buffers.items():
                if b is not None:
                    self._buffers[key] = fn(b)
        return self

    nn.Module._apply = _apply
    try:
        yield
    finally:
        nn.Module._apply = original


def _cannot_trace(model: nn.Module, exc: Exception) -> str:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return (f"could not run one step of {type(model).__name__} on the sample without real memory "
            f"({type(exc).__name__}: {first_line}). Check that the sample is "
            "what the model takes (model(x), model(*tuple) or model(**dict)). A forward that reads values its "
            "weights compute (data-dependent Python control flow) is traced with the weights' own values where they "
            "are real and at most 4 GiB; a model on the meta device or larger cannot be, so no plan can be chosen "
            "by the cost model: wrap then applies a safe plan from the model's structure (profile_model(..., "
            "trace=False)), or pass it a plan.")


class _Swapped(nn.Module):
    """The module functional_call swaps the tensors of: `model` as its child, `run()` its forward, so the swap
    lasts for all of `run` (the step's forward and its backward)."""

    def __init__(self, model: nn.Module, run: Callable[[], Any]) -> None:
        super().__init__()
        self.model = model
        self._run = run

    def forward(self) -> Any:
        return self._run()


def _per_slot(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under one name per (module, attribute) slot: a module held under several names (one object in
    every block) swapped by each of its names would be restored from the fake tensor its first swap put there
    (functional_call records each name's tensor as it swaps it), and keep that fake tensor after the step."""
    slots = {}
    for prefix, module in model.named_modules():  # each module object once
        for name in list(module._parameters) + list(module._buffers):
            key = f"{prefix}.{name}" if prefix else name
            if key in state:
                slots[key] = state[key]
    return slots


def _fake_attributes(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fake copies of the tensors modules keep as plain attributes (one name per module object; a meta one on the
    step's device, any other on its own), for functional_call to swap in: a real tensor in the fake step would
    stop the trace (FakeTensorMode refuses real inputs); and the real tensors under the same names."""
    out: dict[str, torch.Tensor] = {}
    reals: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                    and name not in module._parameters and name not in module._buffers:
                where = device if value.is_meta else value.device
                with fake_mode:
                    fake = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                               device=where)
                key = f"{prefix}.{name}" if prefix else name
                out[key], reals[key] = fake.requires_grad_(value.requires_grad), value
    return out, reals


# modules with a batch_first switch whose default (False) reads dim 0 as the sequence
_SEQUENCE_FIRST = (nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                   nn.Transformer)


def _fake_state(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device, dtype: torch.dtype | None = None
                ) -> dict[str, torch.Tensor]:
    """Fake copies of every parameter and buffer (tied ones stay one tensor), on `device`; floating
    parameters in `dtype` when given (FSDP's mixed precision computes with bf16 weights)."""
    out: dict[str, torch.Tensor] = {}
    memo: dict[int, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if id(t) not in memo:
            cast = dtype if dtype is not None and isinstance(t, nn.Parameter) and t.is_floating_point() else t.dtype
            with fake_mode:
                fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=cast, device=device)
            if isinstance(t, nn.Parameter):
                fake.requires_grad_(t.requires_grad)
            memo[id(t)] = fake
        out[name] = memo[id(t)]
    return out


def _as_returned(output: Any, precision: str) -> Any:
    """The model's output as a plan in `precision` returns it: under FSDP's mixed precision ("bf16-pure") every
    floating output in fp32 (its output dtype), under autocast ("bf16") as autopar's autocast wrapper returns it
    (autocast_outputs), in fp32 as it is."""
    if precision == "fp32":
        return output
    return to_fp32_outputs(output) if precision == "bf16-pure" else autocast_outputs(output)


def fake_sample(sample: Any, fake_mode: FakeTensorMode, device: torch.device, dtype: torch.dtype | None,
                 shadows: InputShadows) -> Any:
    """The sample with every tensor a fake one on `device` (floating ones in `dtype` when given), its real
    value kept in `shadows`."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        with fake_mode:
            fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=cast, device=device)
        shadows.add(fake, t)
        return fake

    return map_tensors(convert, sample)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _profile_device(model: nn.Module, sample: Any) -> torch.device:
    """The device of the model's first real parameter, else the sample's, else the CPU."""
    for t in list(model.parameters()) + ([first_tensor(sample)] if first_tensor(sample) is not None else []):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")
