"""Compile only where it pays: the model's own step, eager and compiled, timed on the device (issue 33).

The cost model prices a compiled step from fusion rules; on models it was not fitted to it has been wrong
both ways (a depthwise CNN ran 0.56x of eager under compile). When `wrap` applies a plan that compiles, on a
GPU, `race_compile` times the applied model's forward and backward on the sample, eager and then compiled
(the compiled forward is the very one the plan applied, so its warm-up is the compile the first training
step would have paid; only the few timed steps are extra), and keeps the faster. The plan, the log line and
`autopar.applied(model)` say what was measured.

What a race leaves as it was: the parameters (no optimizer step runs), their gradients (none: set back to
None), the buffers (BatchNorm's running statistics: copied back) and the random streams (CPU and device). What
it changes: CUDA's peak memory statistics, reset before each mode's timed steps (its peaks are theirs).
Every rank runs the same steps (a sharded step's collectives need them all) and the slowest rank's time is
the one compared, so every rank keeps the same mode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ._util.batch import call_model, default_loss, first_rows, map_tensors, to_device
from .plans import Plan
from .strategies.compile import (add_graphs_forwards, compiled_modules, cuda_graphs_refusal, default_backend,
                                 forget_compiled, settle_graphs, use_compiled)

#: A compiled step is kept unless eager runs faster by more than this fraction: compile's memory (what the
#: plan was sized with) and its warm-up are already paid.
EAGER_MARGIN = 0.03
#: Rounds of timed steps, each mode in turn, the order reversed every other round.
ROUNDS = 3
#: Seconds the timed steps may take in all (both modes, every round), judged from eager's warm-up step: fewer steps
#: a round for a long step (at least one of each mode a round). wrap's own time before the first step is to stay
#: under 15 s (issue 33); a 0.8 s step timed 9 times a mode was 17 s of measuring alone (mixtral, H100, 2026-12-05).
TIMED_BUDGET_S = 4.0
#: Seconds a round's steps should last at least, once the first round has shown how long a step is (more steps a
#: round for a short step, within TIMED_BUDGET_S): a round of 3 steps of 18 ms is timed with the queue still filling
#: and the host's launch of its first kernels in it (the zoo's mobilenet-v2 and resnet were measured 14-41% slower
#: by the race than by the training loop on an H100, bench/results/zoo_h100_wrap_2026-12-05.md).
MIN_ROUND_S = 0.25
#: The most steps a round times.
MAX_ROUND_STEPS = 50
#: Steps of the kept mode run after the race from an emptied cache, to read the allocator's reserve over the peak.
RESERVE_STEPS = 3
#: Seconds those steps may take: fewer for a long step (two at least, while two take under RESERVE_MAX_S: a
#: training loop's reserve grows at its second step, the first with the optimizer's state resident).
RESERVE_BUDGET_S = 1.5
RESERVE_MAX_S = 4.0

#: wrap races CUDA graphs (a third contender) where the cost model predicts the replayed step this much faster than
#: the compiled one: their compile and recording are warm-up the hand recipe does not pay
GRAPHS_GAIN = 0.10


@dataclass(frozen=True)
class CompileRace:
    """What a race measured (seconds of forward and backward, the slowest rank's) and what it kept."""

    eager_step_s: float | None  # None: eager did not run (out of memory, or it raised)
    compiled_step_s: float | None  # None: the compiled step did not run (compile failed, out of memory)
    compiled_warmup_s: float  # the first compiled steps, compile included (a compile that failed: its time)
    kept_compiled: bool
    why: str  # one line, for the log
    measuring_s: float = 0.0  # the race's own time, less the compiled warm-up (the slowest rank's)
    rows: int | None = None  # the samples its steps ran (None: the sample's count could not be read)
    # The peak of allocated memory during each mode's timed steps after its warm-up (torch.cuda.max_memory_allocated,
    # the largest rank's): forward, backward and the gradients, without an optimizer's state. None off a GPU.
    eager_peak_bytes: float | None = None
    compiled_peak_bytes: float | None = None
    # What the caching allocator reserved beyond the allocated peak over RESERVE_STEPS steps of the kept mode from an
    # emptied cache (torch.cuda.max_memory_reserved - max_memory_allocated, the largest rank's): the fragmentation
    # of this model's real shapes (a mixture of experts' routed batches differ in size every layer and step, which
    # the trace's replay does not see). None off a GPU, or where those steps did not run.
    kept_reserve_bytes: float | None = None
    # The third contender, where the race was asked to run it (`graphs`): the compiled forward replaying CUDA graphs
    graphs_step_s: float | None = None  # None: not raced, or it did not run
    graphs_peak_bytes: float | None = None
    kept_graphs: bool = False  # kept_compiled too: the kept forward is compiled, replayed as CUDA graphs

    @property
    def kept_step_s(self) -> float | None:
        if self.kept_graphs:
            return self.graphs_step_s
        return self.compiled_step_s if self.kept_compiled else self.eager_step_s

    @property
    def kept_peak_bytes(self) -> float | None:
        if self.kept_graphs:
            return self.graphs_peak_bytes
        return self.compiled_peak_bytes if self.kept_compiled else self.eager_peak_bytes

    @property
    def ran(self) -> bool:
        """Whether any mode ran a step (eager, compiled or CUDA graphs)."""
        return any(t is not None for t in (self.eager_step_s, self.compiled_step_s, self.graphs_step_s))

    def describe(self) -> str:
        def ms(x: float | None) -> str:
            return "did not run" if x is None else f"{x * 1e3:.1f} ms"

        graphs = f", CUDA graphs {ms(self.graphs_step_s)}" if self.graphs_step_s is not None or self.kept_graphs else ""
        return (f"measured on this device, forward + backward: eager {ms(self.eager_step_s)}, compiled "
                f"{ms(self.compiled_step_s)}{graphs} (warm-up {self.compiled_warmup_s:.1f} s): {self.why}")


def races_graphs(plan: Plan, device: torch.device) -> bool:
    """Whether wrap's race runs CUDA graphs beside eager and compiled for `plan`: the whole model compiled in one
    process on a CUDA device with inductor (cuda_graphs_refusal), not already replaying them, and the cost model
    predicting the replayed step GRAPHS_GAIN faster (`graphs_step_s` in the plan's prediction:
    autopar.planning.with_graphs_prediction)."""
    pred = plan.prediction or {}
    graphs_s, step_s = pred.get("graphs_step_s"), pred.get("step_s")
    if plan.cuda_graphs or not plan.compiles_whole_model or not isinstance(graphs_s, (int, float)) \
            or not isinstance(step_s, (int, float)):
        return False
    return cuda_graphs_refusal(device, default_backend()) is None and graphs_s < (1 - GRAPHS_GAIN) * step_s


def real_batch(sample: Any, device: torch.device) -> Any:
    """The sample on `device` as a step takes it (autopar._util.batch.to_device: CPU tensors stay where the sample
    has any on a GPU), with real values where it holds meta tensors (integers zero, a mask's ones, floats
    normal): what a step can run on, of the sample's shapes and dtypes."""
    def one(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    return map_tensors(one, to_device(sample, device))


class _Kept:
    """The buffers and random streams a race must leave as it found them."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.buffers = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
        self.cpu_rng = torch.get_rng_state()
        self.device = device
        self.device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self, model: nn.Module) -> None:
        with torch.no_grad():
            for buf, value in self.buffers:
                buf.copy_(value)
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, self.device)
        for p in model.parameters():
            p.grad = None


def _one_line(exc: BaseException) -> str:
    """The error and its root cause, one line each joined (dynamo wraps a backend's error)."""
    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"

    root, seen = exc, {id(exc)}
    while True:  # dynamo keeps a backend's error as `inner_exception`, or chains it
        inner = getattr(root, "inner_exception", None) or root.__cause__ or root.__context__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            break
        root = inner
        seen.add(id(inner))
    return line(exc) if root is exc else f"{line(exc)} <- {line(root)}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float | None, device: torch.device) -> float | None:
    """The largest of every rank's seconds (None, a rank that could not run, wins: inf)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seconds
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float("inf") if seconds is None else seconds], dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    value = float(t.item())
    return None if value == float("inf") else value


def _time(step: Callable[[], None], device: torch.device, *, warmup: int, steps: int) -> tuple[float, float]:
    """(warm-up seconds, seconds of a step after it): `steps` steps queued back to back and synchronised once,
    as a training loop runs them (the host issues the next step while the device runs this one). A sync after
    each step would add the host's time to the device's on every step: +2 to +41% on the zoo's step
    predictions, most on host-bound models (bench/NOTES.md, 2026-12-05)."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm = time.perf_counter() - start
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return warm, (time.perf_counter() - t0) / steps


def _warm(step: Callable[[], None], device: torch.device) -> float:
    """Seconds of one step run and synchronised (a warm-up step)."""
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _later_round_steps(per_round: int, first_round_s: list[float], modes: int, device: torch.device) -> int:
    """Steps a round after the first: enough for MIN_ROUND_S of the slower mode's step (as the first round timed
    it, the slowest rank's), never more than TIMED_BUDGET_S allows for every round of every mode, nor fewer than
    the first round's unless the budget says so. Every rank computes the same number (a sharded step's collectives
    need every rank to run it)."""
    slowest = _slowest(max(first_round_s) if first_round_s else None, device)
    if not slowest or slowest <= 0:
        return per_round
    afford = max(1, int(TIMED_BUDGET_S / (ROUNDS * modes * slowest)))
    want = max(per_round, -(-MIN_ROUND_S // slowest))
    return int(max(1, min(want, afford, MAX_ROUND_STEPS)))


def _loss_of(output: Any, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    return loss_fn(output, batch) if loss_fn is not None else default_loss(output)


def reserve_steps(step_s: float) -> int:
    """How many steps `_reserve_over_peak` runs for a step of `step_s` seconds."""
    least = 2 if 2 * step_s <= RESERVE_MAX_S else 1
    return min(RESERVE_STEPS, max(least, int(RESERVE_BUDGET_S / step_s)))


@dataclass(frozen=True)
class _ReserveRun:
    """Steps run from an emptied cache with the optimizer's state made after the first backward (_reserve_run)."""

    reserve_bytes: int  # the allocator's reserved peak over its allocated peak, over the steps
    step_s: float  # seconds a step, the steps back to back and synchronised once
    peak_bytes: int  # the allocated peak of the first step's forward and backward, before that state was made


def _reserve_run(step: Callable[..., None], model: nn.Module, device: torch.device, *, steps: int) -> _ReserveRun:
    """`steps` steps from an emptied cache, timed, and the bytes the caching allocator reserves beyond the allocated
    peak over them; raises what a step raised. As in a training loop, the optimizer's state (AdamW's: two tensors of
    each trainable parameter's shape and dtype) is made after the first step's backward, while its gradients are
    alive, and is held through the later steps: the blocks it takes out of the cache are what the next forward's
    activations no longer find there (gemma on an H100: 0.16 GiB reserved over the race's steps without it, 4.04 GiB
    over the training loop's, with 18.7 GiB of state; bench/results/zoo_h100_wrap_2026-12-06e.jsonl)."""
    held: list[torch.Tensor] = []
    before_state: list[int] = []

    def optimizer_state() -> None:
        if not held:
            before_state.append(torch.cuda.max_memory_allocated(device))
            held.extend(torch.zeros_like(p) for p in model.parameters() if p.requires_grad for _ in range(2))

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step(optimizer_state)
        _sync(device)
        step_s = (time.perf_counter() - start) / steps
        allocated = torch.cuda.max_memory_allocated(device)
        return _ReserveRun(reserve_bytes=torch.cuda.max_memory_reserved(device) - allocated, step_s=step_s,
                           peak_bytes=before_state[0] if before_state else allocated)
    finally:
        held.clear()


def _reserve_over_peak(step: Callable[..., None], model: nn.Module, device: torch.device, *, steps: int) -> int | None:
    """Bytes the caching allocator reserves beyond the allocated peak over `steps` steps from an emptied cache
    (_reserve_run), or None where a step raised (out of memory: the reserve stays modelled)."""
    try:
        return _reserve_run(step, model, device, steps=steps).reserve_bytes
    except Exception:  # torch.OutOfMemoryError
        _drop_grads(model, device)
        return None


def _reads_reserve(device: torch.device) -> bool:
    """Whether the race reads the caching allocator's reserve on `device` (CUDA's)."""
    return device.type == "cuda"


def _median(times: list[float]) -> float | None:
    return sorted(times)[len(times) // 2] if times else None


def _choice(has_compiled: bool, eager_s: float | None, compiled_s: float | None,
            errors: dict[Any, str]) -> tuple[bool, str]:
    """Whether to keep the compiled forward, and why (one line): compile unless eager is EAGER_MARGIN faster or
    the compiled step did not run."""
    if not has_compiled:
        return False, ("the plan does not compile: its eager step measured" if eager_s is not None else
                       f"its step did not run ({errors.get(False, 'on another rank')})")
    if compiled_s is None and eager_s is not None:
        return False, f"the compiled step did not run ({errors.get(True, 'on another rank')}): kept eager"
    if eager_s is None or compiled_s is None:
        return True, (f"eager did not run ({errors.get(False, 'on another rank')}): kept compile"
                      if compiled_s is not None else
                      f"neither mode ran here (eager: {errors.get(False, 'on another rank')}; compiled: "
                      f"{errors.get(True, 'on another rank')})")
    if eager_s < compiled_s * (1 - EAGER_MARGIN):
        return False, f"eager is {compiled_s / eager_s:.2f}x faster: kept eager"
    return True, f"compile is {eager_s / compiled_s:.2f}x faster: kept compile"


def _graphs_choice(keep: bool, why: str, eager_s: float | None, compiled_s: float | None, graphs_s: float | None,
                   errors: dict[Any, str]) -> tuple[bool, str]:
    """Whether the CUDA-graphs forward is kept over the choice between eager and compiled (`keep`, `why`): where it
    is EAGER_MARGIN faster than the kept one (its graphs' memory pool and its recording are the price); and why."""
    if graphs_s is None:
        return False, why + (f"; CUDA graphs did not run ({errors['graphs']})" if "graphs" in errors else "")
    best_s, name = (compiled_s, "compiled") if keep else (eager_s, "eager")
    if best_s is None or graphs_s < best_s * (1 - EAGER_MARGIN):
        return True, ("CUDA graphs ran where nothing else did: kept CUDA graphs" if best_s is None else
                      f"CUDA graphs are {best_s / graphs_s:.2f}x faster than {name}: kept CUDA graphs")
    return False, f"{why}; CUDA graphs did not pay ({best_s / graphs_s:.2f}x)"


def _graphs_added(model: nn.Module, errors: dict[Any, str]) -> bool:
    """Whether the CUDA-graphs forwards could be made (add_graphs_forwards); why not in `errors`."""
    try:
        return add_graphs_forwards(model) > 0
    except Exception as exc:  # torch.compile refusing its options: the race goes on with two contenders
        errors["graphs"] = _one_line(exc)
        return False


def _drop_grads(model: nn.Module, device: torch.device) -> None:
    """After a step that raised (out of memory): its gradients and the allocator's cache go."""
    for p in model.parameters():
        p.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()


def race_compile(model: nn.Module, sample: Any, *, device: torch.device,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, warmup: int = 2,
                 steps: int = 9, rows: int | None = None, graphs: bool = False) -> CompileRace:
    """Time the applied, compiled `model`'s forward and backward on `sample`, eager and compiled in interleaved
    rounds (the first of `steps / ROUNDS` steps a mode, fewer where a step is long (TIMED_BUDGET_S); the later ones
    of MIN_ROUND_S at least, within that budget, and none once the timed steps have taken it; each round's steps back
    to back, the median of the rounds), and keep the faster in place (`forget_compiled` when eager wins); on a GPU,
    each mode's peak of allocated memory over its timed steps too, and the allocator's reserve over the kept mode's
    (`_reserve_over_peak`). `rows`: the samples a training step's forward runs (a plan's micro-batch, fewer than
    the sample's where it accumulates): the race runs the sample's first `rows` (all of it where it has fewer).
    Out of memory or an error in one mode keeps the other; both failing keeps the plan's compiled forward and says
    so. `graphs`: a third contender, the compiled forward replaying CUDA graphs (add_graphs_forwards; one warm-up
    step more, its recording), kept where it beats the other two by EAGER_MARGIN; not for a long step (one a round),
    which its launches cannot shorten."""
    start = time.perf_counter()
    batch, ran = first_rows(sample, rows)
    batch = real_batch(batch, device)
    kept = _Kept(model, device)

    def step(after_backward: Callable[[], None] | None = None) -> None:
        # The output goes before backward, as in a training loop that keeps only the loss (Hugging Face's Trainer,
        # Lightning, torchtitan's `del pred`): kept, a language model's logits stayed through backward and the race's
        # peak was theirs above the training loop's (gpt2 +1.5 GiB, +11.8% predicted, H200 2026-12-06).
        loss = _loss_of(call_model(model, batch), batch, loss_fn)
        loss.backward()
        if after_backward is not None:  # where a loop's optimizer step runs, its gradients alive
            after_backward()
        for p in model.parameters():
            p.grad = None

    measured: dict[Any, list[float]] = {}
    peaks: dict[Any, int] = {}
    warm: dict[Any, float] = {}
    errors: dict[Any, str] = {}
    has_compiled = bool(compiled_modules(model))  # a plan without compile: its eager step measured alone
    modes: list[Any] = [False, True] if has_compiled else [False]  # eager, compiled, and "graphs" where raced
    per_round = max(1, -(-steps // ROUNDS))
    timed_s = 0.0  # the timed steps' seconds so far, every mode
    try:
        # Eager's warm-up step first: its time (an upper bound of a step: it also grows the allocator) sets how
        # many steps a round can afford within TIMED_BUDGET_S.
        use_compiled(model, False)
        eager_warm_s: float | None = None
        try:
            eager_warm_s = _warm(step, device)
        except Exception as exc:  # torch.OutOfMemoryError: eager does not run here
            errors[False] = _one_line(exc)
            _drop_grads(model, device)
        eager_warm_s = _slowest(eager_warm_s, device)  # every rank runs the same steps (a sharded step's collectives)
        if eager_warm_s is None:
            errors.setdefault(False, "eager did not run on another rank")
        else:
            per_round = min(per_round, max(1, int(TIMED_BUDGET_S / (ROUNDS * len(modes) * eager_warm_s))))
        # A long step (one a round, and one step all the reserve's reading would run): eager's timed step is that
        # reading too, from an emptied cache with the optimizer's state made after its backward (_reserve_run; its
        # allocations and the state's zeros are a few milliseconds of a step of seconds). Where eager is kept, no
        # step runs after the race: Mamba-2's 4.7 s step on the H200 was timed once and run once more for this.
        long_eager = eager_warm_s is not None and per_round == 1 and _reads_reserve(device) \
            and reserve_steps(eager_warm_s) == 1
        if graphs and has_compiled and per_round > 1 and _graphs_added(model, errors):  # (one process: no peer)
            modes.append("graphs")
            if eager_warm_s is not None:  # the budget shared by three modes
                per_round = min(per_round, max(1, int(TIMED_BUDGET_S / (ROUNDS * len(modes) * eager_warm_s))))
        reserves: dict[bool, int] = {}
        # Interleaved rounds, the order turned each round: the host's speed drifts within seconds (bench/NOTES.md),
        # and a drift then weighs on both modes alike. The first round warms the compiled mode up (compiles).
        for r in range(ROUNDS):
            for compiled in modes if r % 2 == 0 else modes[::-1]:
                if compiled in errors:
                    continue
                use_compiled(model, compiled is not False, graphs=compiled == "graphs")
                first = (warmup + (compiled == "graphs")) if compiled is not False and r == 0 else 0
                attempt = time.perf_counter()
                try:
                    if long_eager and not compiled and r == 0:
                        run = _reserve_run(step, model, device, steps=1)
                        measured.setdefault(compiled, []).append(run.step_s)
                        timed_s += run.step_s
                        peaks[compiled] = max(peaks.get(compiled, 0), run.peak_bytes)
                        reserves[compiled] = run.reserve_bytes
                        continue
                    if first == 0 and device.type == "cuda":  # the peak of timed steps only (not compile's)
                        torch.cuda.reset_peak_memory_stats(device)
                    w, median = _time(step, device, warmup=first, steps=per_round)
                    warm[compiled] = warm.get(compiled, 0.0) + w
                    measured.setdefault(compiled, []).append(median)
                    timed_s += median * per_round
                    if first == 0 and device.type == "cuda":
                        peaks[compiled] = max(peaks.get(compiled, 0), torch.cuda.max_memory_allocated(device))
                except Exception as exc:  # torch.OutOfMemoryError, a compile error: that mode does not run here
                    if first:  # a compile that failed: its time is the compile warm-up hand compile pays too
                        warm[compiled] = warm.get(compiled, 0.0) + time.perf_counter() - attempt
                    measured.pop(compiled, None)
                    peaks.pop(compiled, None)
                    errors[compiled] = _one_line(exc)
                    _drop_grads(model, device)
            if (_slowest(timed_s, device) or 0.0) >= TIMED_BUDGET_S:  # a long step: one round says enough
                break
            if r == 0:  # the first round has timed each mode: the later rounds last MIN_ROUND_S at least
                per_round = _later_round_steps(per_round, [m[0] for m in measured.values()], len(modes), device)
        eager_s, compiled_s = (_slowest(_median(measured.get(mode, [])), device) for mode in (False, True))
        keep, why = _choice(has_compiled, eager_s, compiled_s, errors)
        graphs_s = _slowest(_median(measured.get("graphs", [])), device) if "graphs" in modes else None
        keep_graphs = False
        if "graphs" in modes or "graphs" in errors:
            keep_graphs, why = _graphs_choice(keep, why, eager_s, compiled_s, graphs_s, errors)
            settle_graphs(model, keep_graphs)  # the graphs' forward becomes the compiled one, or goes
            keep = keep or keep_graphs
        if keep:
            use_compiled(model, True)
        elif has_compiled:
            forget_compiled(model)
        kept_s = graphs_s if keep_graphs else compiled_s if keep else eager_s
        reserve = reserves.get(keep) if not keep_graphs else None  # read with a long step's timing (long_eager)
        if reserve is None and _reads_reserve(device) and kept_s is not None:
            reserve = _reserve_over_peak(step, model, device, steps=reserve_steps(kept_s))
    finally:
        kept.restore(model)
        # The caching allocator keeps what both modes' steps used (two layouts of activations: 2x the reserved
        # memory of training on gpt2, bench/NOTES.md 2026-12-05): given back, so the training loop reserves its own.
        batch = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    own_warm_s = warm.get(True, 0.0) + warm.get("graphs", 0.0)
    measuring_s = _slowest(time.perf_counter() - start - own_warm_s, device) or 0.0
    warm_s = _slowest(own_warm_s, device) or 0.0  # the slowest rank's, so every rank's note reads the same
    return CompileRace(eager_step_s=eager_s, compiled_step_s=compiled_s, compiled_warmup_s=warm_s,
                       kept_compiled=keep, why=why, measuring_s=measuring_s,
                       eager_peak_bytes=_slowest(peaks.get(False), device),
                       compiled_peak_bytes=_slowest(peaks.get(True), device) if has_compiled else None, rows=ran,
                       kept_reserve_bytes=_slowest(reserve, device), graphs_step_s=graphs_s,
                       graphs_peak_bytes=_slowest(peaks.get("graphs"), device) if "graphs" in modes else None,
                       kept_graphs=keep_graphs)


def measured_prediction(plan: Plan, race: CompileRace) -> dict[str, Any]:
    """`plan`'s prediction with what `race` measured on this device in place of the modelled figures (the modelled
    ones kept beside them). The step: the kept mode's forward and backward of one micro-batch, times the plan's
    micro-batches (each with the gradient synchronisation the race's step had: an upper bound where a plan defers
    it to the last), plus the optimizer step the race does not run (modelled). The allocated peak, for a plan
    without accumulation: the kept mode's measured peak plus the optimizer state it does not hold (modelled: exact
    for Adam); the reserved peak, that plus the context (modelled) and the allocator's reserve the race measured over
    the kept mode's steps (modelled where it was not). With accumulation the gradients stay between micro-batches,
    which the race's step does not see, so the modelled peaks stay. A race that ran fewer
    samples than a micro-batch (a sample smaller than the plan's micro-batch) is recorded and not used."""
    kept_s = race.kept_step_s
    prediction = {**(plan.prediction or {})}
    if kept_s is not None:
        prediction["measured_forward_backward_s"] = kept_s
    for key, value in (("measured_eager_s", race.eager_step_s), ("measured_compiled_s", race.compiled_step_s),
                       ("measured_graphs_s", race.graphs_step_s), ("measured_peak_allocated_bytes", race.kept_peak_bytes)):
        if value is not None:
            prediction[key] = value
    # wrap's own time measuring: the race less the compiled warm-up (the compile the first step pays anyway)
    prediction["measuring_s"] = round(race.measuring_s, 2)
    prediction["compile_warmup_s"] = round(race.compiled_warmup_s, 2)  # compiling, and the compiled warm-up steps
    if race.rows != plan.micro_batch_size:  # the sample held fewer samples than a micro-batch: recorded, not used
        return prediction

    def number(key: str) -> float | None:
        value = prediction.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    modelled, optimizer_s = number("step_s"), number("optimizer_s")
    if kept_s is not None and modelled and optimizer_s is not None:
        step = plan.grad_accum * kept_s + optimizer_s
        prediction.update(modelled_step_s=modelled, step_s=step)
        for rate in ("samples_per_s", "tokens_per_s", "mfu"):
            if number(rate) is not None:
                prediction[rate] = prediction[rate] * modelled / step
    allocated, peak, state = number("allocated_bytes"), number("memory_bytes"), number("optimizer_state_bytes")
    if race.kept_peak_bytes is not None and plan.grad_accum == 1 and None not in (allocated, peak, state):
        measured = float(race.kept_peak_bytes) + state
        overhead = peak - allocated  # the allocator's reserve and the CUDA context, modelled
        context = number("context_bytes")
        if race.kept_reserve_bytes is not None and context is not None:  # the reserve measured instead
            prediction["measured_reserve_bytes"] = float(race.kept_reserve_bytes)
            overhead = context + float(race.kept_reserve_bytes)
        prediction.update(modelled_allocated_bytes=allocated, allocated_bytes=measured, modelled_memory_bytes=peak,
                          memory_bytes=measured + overhead)
    return prediction
