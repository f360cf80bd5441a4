"""torch.compile, in place: per block under FSDP (the sharding hooks stay outside the graphs, and the
identical blocks share one compiled graph), the whole model's forward otherwise (the loss and the logits fuse
too).

The module's `forward` is replaced by its compiled self, so the module keeps its type, names and `state_dict`
keys, and its hooks (FSDP's, the pipeline's) and what wraps the forward afterwards (autocast) run outside the
graph. Each compiled module keeps its eager forward beside the compiled one, so that `use_compiled` can switch
between them in place (autopar.race measures both on the device and keeps the faster).

With CUDA graphs (Plan.cuda_graphs: torch.compile's "reduce-overhead" mode, inductor only, one process on a GPU),
inductor records each graph once and replays it: the host launches a graph, not each kernel. Its outputs live in
the graphs' memory pool and the next replay overwrites them, so a loop that keeps a step's output past the next
step (a list of losses, a metric's logits) would read another step's values or raise; the compiled forward's
tensors are copied out of the pool (`_outputs_copied`), as torch's own error message advises.

With max-autotune (Plan.max_autotune: inductor only), inductor times candidate kernels for each GEMM and
convolution as it compiles and keeps the fastest (its "max-autotune-no-cudagraphs" mode's options, AUTOTUNE_OPTIONS;
with CUDA graphs too, its "max-autotune" mode): a longer compile, which only the tuner chooses to pay.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..errors import PlanError
from .._util.batch import map_tensors
from .._util.compile_backend import DEFAULT_COMPILE_BACKEND, compile_backend_refusal, configured_compile_backend


def default_backend() -> str:
    """The compile backend: `AUTOPAR_COMPILE_BACKEND` if set (tests use "aot_eager"), else inductor; a name torch
    does not register is refused here, where it is read (PlanError naming it and the valid choices)."""
    return configured_compile_backend()


def cuda_graphs_refusal(device: torch.device, backend: str) -> str | None:
    """Why a plan's CUDA graphs cannot run here (one line saying what to change), or None."""
    if device.type != "cuda":
        return (f"cuda_graphs=True replays CUDA graphs, and this model runs on {device.type}: set cuda_graphs=False "
                "(or run on a GPU).")
    if backend != DEFAULT_COMPILE_BACKEND:
        return (f"cuda_graphs=True is torch.compile's 'reduce-overhead' mode of inductor, and the compile backend is "
                f"{backend!r}: unset AUTOPAR_COMPILE_BACKEND (or set it to 'inductor'), or set cuda_graphs=False.")
    return None


def max_autotune_refusal(backend: str) -> str | None:
    """Why a plan's max-autotune cannot run with this compile backend (one line saying what to change), or None."""
    if backend != DEFAULT_COMPILE_BACKEND:
        return (f"max_autotune=True is a mode of inductor, and the compile backend is {backend!r}: unset "
                "AUTOPAR_COMPILE_BACKEND (or set it to 'inductor'), or set max_autotune=False.")
    return None


def apply_compile(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], *, per_block: bool,
                  backend: str | None = None, cuda_graphs: bool = False, max_autotune: bool = False) -> list[str]:
    """Compile the blocks (per_block) or the whole model; returns the names of what was compiled. `cuda_graphs`:
    inductor's "reduce-overhead" mode, the forward's outputs copied out of the graphs' pool (the module docstring);
    `max_autotune`: inductor's max-autotune options (AUTOTUNE_OPTIONS); the caller checks cuda_graphs_refusal and
    max_autotune_refusal first."""
    if isinstance(backend, str) and backend:  # refused before anything is compiled, naming the choices
        why = compile_backend_refusal(backend, source="compile_backend")
        if why is not None:
            raise PlanError(why)
    backend = backend or default_backend()
    if per_block and blocks:
        # The block's forward, not its call: module hooks (FSDP's, the pipeline's) stay outside the graph.
        for _, block in blocks:
            _compile_forward(block, backend, cuda_graphs, max_autotune)
        return [name for name, _ in blocks]
    # The whole model: its forward, so that what wraps the forward from outside (apply_autocast's autocast and
    # fp32 outputs, applied after this) stays outside the graph, as in the usual `with autocast: compiled(x)`.
    _compile_forward(model, backend, cuda_graphs, max_autotune)
    return ["<model>"]


_FORWARDS = "_autopar_forwards"  # on a compiled module: (its eager forward, its compiled forward)
_BACKEND = "_autopar_compile_backend"  # on a compiled module: the backend it was compiled with
_GRAPHS = "_autopar_graphs_forward"  # on a compiled module, during a race: its forward compiled to replay CUDA graphs
_AUTOTUNE = "_autopar_max_autotune"  # on a compiled module: compiled with AUTOTUNE_OPTIONS (its graphs' twin too)


#: inductor's options for CUDA graphs: its "reduce-overhead" mode (`triton.cudagraphs`), with graphs of dynamic shapes
#: left unrecorded: a loop whose shapes vary (batches padded to their longest) recompiles with symbolic sizes, and a
#: graph recorded for each size would hold a memory pool each; those run compiled without graphs instead
GRAPHS_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True}
#: inductor's options for max-autotune: its "max-autotune-no-cudagraphs" mode's (torch._inductor.list_mode_options)
AUTOTUNE_OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True}


def _compiled(eager: Callable[..., Any], backend: Any, graphs: bool, autotune: bool = False) -> Callable[..., Any]:
    """`eager` under torch.compile; `graphs`: replaying CUDA graphs (GRAPHS_OPTIONS), its outputs copied;
    `autotune`: with AUTOTUNE_OPTIONS."""
    options = {**(GRAPHS_OPTIONS if graphs else {}), **(AUTOTUNE_OPTIONS if autotune else {})}
    compiled = torch.compile(eager, backend=backend, options=options) if options else \
        torch.compile(eager, backend=backend)
    return _outputs_copied(compiled) if graphs else compiled


def _compile_forward(module: nn.Module, backend: Any, graphs: bool = False, autotune: bool = False) -> None:
    eager = module.forward
    compiled = _compiled(eager, backend, graphs, autotune)
    object.__setattr__(module, _FORWARDS, (eager, compiled))
    object.__setattr__(module, _BACKEND, backend)
    if autotune:
        object.__setattr__(module, _AUTOTUNE, True)
    module.forward = compiled


def _outputs_copied(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` whose tensors come back as copies (autograd goes through the copy): a CUDA graph's outputs are its
    pool's memory, overwritten by the next replay."""
    @functools.wraps(forward)
    def copied(*args: Any, **kwargs: Any) -> Any:
        return map_tensors(torch.Tensor.clone, forward(*args, **kwargs))

    return copied


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose forward apply_compile compiled."""
    return [m for m in model.modules() if _FORWARDS in vars(m)]


def use_compiled(model: nn.Module, on: bool, *, graphs: bool = False) -> int:
    """Run each module apply_compile compiled through its compiled (`on`), its CUDA-graphs (`graphs`, after
    add_graphs_forwards) or its eager forward, in place; what wraps the forward from outside (autocast's
    AutocastForward, which calls its `__wrapped__`) stays. Returns how many modules were switched."""
    modules = compiled_modules(model)
    for module in modules:
        eager, compiled = vars(module)[_FORWARDS]
        forwards = (eager, compiled, *([vars(module)[_GRAPHS]] if _GRAPHS in vars(module) else []))
        current = vars(module).get("forward")
        target = vars(module)[_GRAPHS] if graphs else compiled if on else eager
        if getattr(current, "__wrapped__", None) in forwards and current not in forwards:
            current.__wrapped__ = target  # an outer wrapper (autocast) around the compiled forward
        else:
            module.forward = target
    return len(modules)


def add_graphs_forwards(model: nn.Module) -> int:
    """Beside each compiled module's forwards, its eager forward compiled again to replay CUDA graphs (inductor's
    "reduce-overhead" mode, the outputs copied; compiled with another backend, a second compile of it as it is:
    the tests' stand-in): the compile race's third contender (autopar.race). Returns how many modules got one."""
    modules = compiled_modules(model)
    for module in modules:
        backend = vars(module).get(_BACKEND, DEFAULT_COMPILE_BACKEND)
        graphs = _compiled(vars(module)[_FORWARDS][0], backend, graphs=backend == DEFAULT_COMPILE_BACKEND,
                           autotune=vars(module).get(_AUTOTUNE, False))
        object.__setattr__(module, _GRAPHS, graphs)
    return len(modules)


def settle_graphs(model: nn.Module, keep: bool) -> None:
    """After a race: the CUDA-graphs forwards become the compiled ones (`keep`, and each module runs them), or go
    (each module on its eager forward then: the caller picks)."""
    use_compiled(model, False)  # off the graphs' forward while it is still known as one of the module's forwards
    dropped = False
    for module in compiled_modules(model):
        graphs = vars(module).pop(_GRAPHS, None)
        if keep and graphs is not None:
            eager, _ = vars(module)[_FORWARDS]
            object.__setattr__(module, _FORWARDS, (eager, graphs))
        dropped = dropped or (graphs is not None and not keep)
    if keep:
        use_compiled(model, True)
    elif dropped and torch.cuda.is_available():
        # The graphs recorded in the race hold a memory pool (a step's activations) in inductor's tree of CUDA
        # graphs, which outlives the forward dropped here: the trees are cleared so that it goes back to the
        # allocator (the kept forwards replay no graph; another module of this process compiled in reduce-overhead
        # mode records its graphs again at its next call)
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()


def forget_compiled(model: nn.Module) -> None:
    """Leave each compiled module on its eager forward for good (the compiled ones are dropped)."""
    use_compiled(model, False)
    for module in compiled_modules(model):
        for name in (_FORWARDS, _BACKEND, _GRAPHS, _AUTOTUNE):
            vars(module).pop(name, None)
