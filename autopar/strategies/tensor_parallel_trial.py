"""Whether a tensor-parallel plan runs the model, found before the model is touched.

The layout (autopar.strategies.tensor_parallel_layout) refuses what it can see: fused projections of unknown layout,
norms over several heads, per-head tensors the split leaves whole. What it cannot see is the forward's own code: a
reshape to the model's full head count or width kept under a name autopar does not divide (XGLM's, TrOCR's
`embed_dim`), an in-place op on a view of a DTensor's local tensor (Falcon's, CTRL's), an in-place scatter on a
sharded tensor (Llama 4's router), a learned tensor of the hidden width between the split layers (ConvNeXt V2's
GRN). Applied for real, such a plan raised at the first step, after wrap had already split the model
(hf-sweep-dist, 2026-12-06: 17 of 206 runs under tp=2).

`tensor_parallel_trial` applies the plan's tensor parallelism to a meta-device copy of the model over the job's own
tensor-parallel mesh and runs one training step's forward and backward on a one-sample batch on fake tensors:
DTensor's sharding propagation and every shape check run as on the device, while no memory is used and no
collective sends anything (under FakeTensorMode, the functional collectives' fake kernels run). What raises there
raises on the device, and is reported in one line, with the line of the model's code it came from.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .._util.batch import call_model, default_loss, first_rows
from .._util.kv_cache import kv_cache_off_while
from ..plans import Plan
from ..profile import ModelProfile, iter_block_modules
from ..profile.shadow import InputShadows
from ..profile.trace import fake_sample, quiet_fake_kernel_errors
from .apply import last_blocks
from .materialize import materialize
from .mesh import build_mesh
from .pipeline import _PassThrough, _set_child
from .tensor_parallel import apply_tensor_parallel
from .tensor_parallel_reductions import Recorder, divided_reductions, model_line

#: What fake tensors cannot answer (a read of a value the weights computed): the trial concludes nothing.
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes and dtypes (nothing of
    their values is copied: a copy of a 70B model costs its module objects only)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _where(exc: BaseException) -> str:
    """The model's line the error came from ("modeling_xglm.py:123 in forward"), or "" where every frame is torch's."""
    return model_line(traceback.extract_tb(exc.__traceback__))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def tensor_parallel_trial(model: nn.Module, sample: Any, plan: Plan, profile: ModelProfile, tp_mesh: Any, *,
                          device: torch.device,
                          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> str | None:
    """Why `plan`'s tensor parallelism does not run `model`'s training step (one line), or None where it runs.

    A meta copy of `model` (`meta_copy`) is split over `tp_mesh` (`apply_tensor_parallel`, as the plan asks,
    sequence parallelism included), materialised on fake tensors, and one forward (under the plan's autocast) and
    backward of the sample's first row run there. Where that raises, the same step of an unsplit copy is the
    control: a step that fails on fake tensors without tensor parallelism too (a kernel whose fake version is
    stricter than the device's: grouped_mm's in fp32 on a CPU; a read of a value the weights computed) concludes
    nothing, and gives None, as does a model `copy.deepcopy` refuses: its plan is applied and its first step says
    the rest. The model, the sample and the random streams are not touched."""
    first, _ = first_rows(sample, 1)

    def step(split: bool, fewer: bool, recorder: Recorder) -> BaseException | None:
        try:
            trial = meta_copy(model)
        except Exception as exc:  # nothing to conclude: the real first step says it
            return exc
        if fewer:
            _fewer_blocks(trial, profile)
        if split:
            blocks = [(n, m) for n, m in iter_block_modules(trial, profile) if not isinstance(m, _PassThrough)]
            apply_tensor_parallel(trial, tp_mesh, profile=profile, blocks=blocks,
                                  sequence_parallel=plan.sequence_parallel, stage_ends=last_blocks(blocks))
        return _fake_step(trial, first, device=device, bf16=plan.precision.startswith("bf16"), loss_fn=loss_fn,
                          recorder=recorder)

    # A few blocks of each structure first (a deep model's step in seconds); the whole model where the stand-ins
    # for the others keep even the unsplit copy from running. The unsplit copy's step is the control: where the
    # split one raised, and where it ran (a reduction over a divided dimension runs, silently wrong: its calls are
    # compared with the unsplit step's, autopar.strategies.tensor_parallel_reductions).
    for fewer in ((True, False) if profile.block_input is not None else (False,)):
        split_calls, whole_calls = Recorder(), Recorder()
        try:
            error = step(split=True, fewer=fewer, recorder=split_calls)
        except Exception as exc:  # splitting raised (a layout refusal is check_plan's, before this)
            return f"splitting it raised {_one_line(exc)}{_where(exc)}"
        if isinstance(error, _DATA_DEPENDENT):
            return None
        whole_error = step(split=False, fewer=fewer, recorder=whole_calls)
        if error is None:
            return divided_reductions(whole_calls.calls, split_calls.calls) if whole_error is None else None
        if whole_error is None:
            return f"its first forward and backward raised {_one_line(error)}{_where(error)}"
    return None


#: Blocks of one structure the trial keeps in its copy (the others stand in as pass-throughs, `_fewer_blocks`).
KEPT_BLOCKS = 2


def _fewer_blocks(copy_: nn.Module, profile: ModelProfile) -> None:
    """In a meta copy, the blocks after the first KEPT_BLOCKS of their structure (class and parameter shapes: a
    model's dense and MoE layers are two) replaced by the stand-in a pipeline stage puts for another stage's block,
    which returns its input as the block returns its output: every structure is tried, and a 16-block Llama's trial
    takes a few seconds instead of 19 (2 CPU cores)."""
    named = dict(copy_.named_modules())
    seen: dict[tuple, int] = {}
    for block in profile.blocks:
        module = named.get(block.name)
        if module is None:
            continue
        structure = (type(module).__name__, tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))
        seen[structure] = seen.get(structure, 0) + 1
        if seen[structure] > KEPT_BLOCKS:
            parent, _, attr = block.name.rpartition(".")
            _set_child(copy_, parent, attr, _PassThrough(profile.block_output_arity, profile.block_input))


def tp_does_not_run(plan: Plan, profile: ModelProfile, why: str) -> str:
    """The one line of a refusal: which degree, which model, what the trial found."""
    return f"tensor parallelism (tp={plan.tp}) does not run {profile.model_class}: {why}"


def trial_in_fake_group(model: nn.Module, sample: Any, plan: Plan, profile: ModelProfile, *,
                        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> str | None:
    """`tensor_parallel_trial` for planning in one process (autopar.plan): over the tensor-parallel mesh of a fake
    process group of the plan's world size (torch's, as autopar.exact uses: its collectives do nothing), removed
    after. None where it cannot run here: a process group already exists (wrap tries the plan over the job's own),
    or this torch has no fake process group."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return None
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except Exception:  # pragma: no cover - depends on the torch build
        return None
    dist.init_process_group("fake", rank=0, world_size=plan.world_size, store=FakeStore())
    try:
        mesh = build_mesh(plan, "cpu")
        return tensor_parallel_trial(model, sample, plan, profile, mesh["tp"], device=torch.device("cpu"),
                                     loss_fn=loss_fn)
    finally:
        dist.destroy_process_group()


def _fake_step(model: nn.Module, batch: Any, *, device: torch.device, bf16: bool,
               loss_fn: Callable[[Any, Any], torch.Tensor] | None,
               recorder: Recorder | None = None) -> BaseException | None:
    """Run meta-device `model`'s forward (under bf16 autocast where asked) and backward on `batch` on fake tensors
    of `device` (the batch's values kept for the step's reads of them, as the profile's trace has them: its
    `fake_sample`); what it raised, or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng = torch.get_rng_state()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    shadows = InputShadows()
    try:
        fakes = fake_sample(batch, fake, device, None, shadows)  # the batch's values kept for the step's reads
        with fake, shadows, quiet_fake_kernel_errors():
            materialize(model, device, init_fn=lambda _module: None)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), \
                    recorder if recorder is not None else contextlib.nullcontext():
                with kv_cache_off_while(model):  # as wrap runs it (apply.py, step 4)
                    output = call_model(model, fakes)
                loss = loss_fn(output, fakes) if loss_fn is not None else default_loss(output)
            loss.backward()
    except Exception as exc:
        return exc
    finally:
        torch.set_rng_state(rng)
    return None
