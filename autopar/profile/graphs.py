"""dynamo_graphs: how many graphs torch.compile's dynamo cuts the model's forward into, found by dynamo itself.

A graph break (a call dynamo cannot trace, a `torch.compiler.disable`d helper, a version of a library that
branches on something dynamo will not guard) splits a compiled step into pieces, each its own graph call forward
and backward with Python between them, and stops fusion at each cut; how often the pieces run is not in the
trace, so the cost model cannot price such a step (on an H200, transformers 5.17's BART ran as 11 graphs compiled
at 0.84-0.94x its eager speed, where transformers 5.24's runs as one: bench/results/zoo_h200_2026-12-01.jsonl
and zoo_h200_profile_2026-12-01c.jsonl). `torch._dynamo.explain` runs dynamo's own capture (no inductor, no
kernels) over the forward: on meta tensors it costs seconds and no memory.

Only models whose parameters and buffers are all on meta or all on a GPU are probed (a real forward on a CPU
can take minutes at a realistic size): elsewhere the answer is None (not known). A real forward leaves the model
and the random streams as it found them: its buffers (BatchNorm's running statistics and count, which a training
forward updates even without grad) are put back, and the CPU's and the device's random states restored (dropout
draws from them). `explain` resets dynamo's caches before and after (torch's own behaviour): functions the user
compiled before planning compile again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from .._util.batch import call_model, map_tensors
from .._util.kv_cache import kv_cache_off_while


@dataclass(frozen=True)
class GraphCount:
    """What dynamo made of the forward: its graphs, and why it broke it where it did (the first few)."""

    num_graphs: int
    break_reasons: tuple[str, ...] = ()
    break_sites: tuple[tuple[tuple[str, int], ...], ...] = ()  # per break, (file, line) of each frame of its user stack

    def in_forward_of(self, modules: Iterable[nn.Module]) -> bool | None:
        """Whether a break lies in the `forward` of one of these modules' classes (or of a class of a module
        inside them): True, False, or None where dynamo gave no sites for a break it made."""
        if not self.num_breaks:
            return False
        spans = _forward_spans(modules)
        if any(lo <= line <= hi for stack in self.break_sites for file, line in stack for lo, hi in spans.get(file, ())):
            return True
        if not self.break_sites or not all(self.break_sites):  # a break whose place dynamo did not give
            return None
        return False

    def __post_init__(self) -> None:
        if self.num_graphs < 0:
            raise ValueError(f"GraphCount.num_graphs must be >= 0, got {self.num_graphs}.")

    @property
    def num_breaks(self) -> int:
        return max(self.num_graphs - 1, 0)


#: A stack of at least this many blocks of one class is counted at depths 1 and 2 and extended (`_shallow_count`)...
SHALLOW_FROM_BLOCKS = 4
#: ... where such stacks hold at least this many blocks in all: each capture costs about a second of dynamo's own
#: whatever the depth, so two or three shallow ones pay only from a few blocks on (2 CPU cores, dynamo warm, full
#: depth against shallow: Mistral's 8 blocks 2.1 and 2.1 s, BART's 6 + 6 2.4 and 2.2 s, BERT's 12 2.1 and 1.1 s,
#: GPT-2's 12 10.4 and 6.2 s, Whisper's 12 + 12 4.9 and 1.9 s, Qwen2's 24 4.4 and 1.8 s; Mamba-2's 24 21 and 2.5 s).
SHALLOW_FROM_TOTAL_BLOCKS = 8


def dynamo_graphs(model: nn.Module, sample: Any, *, max_reasons: int = 3, real_cpu: bool = False,
                  blocks_path: str | Sequence[str] | None = None) -> GraphCount | None:
    """The graphs dynamo captures of `model(sample)`'s forward (no grad), or None where that is not known: the
    model's tensors are on a CPU (unless `real_cpu`: a real forward there) or on several kinds of device, or
    dynamo itself failed (e.g. a value read on meta tensors, which the trace counts as `value_reads` anyway).

    `blocks_path`: the container(s) of the model's repeated blocks (`find_blocks`'s path, or, for blocks in
    several containers, an encoder's and a decoder's, each one's path). Where they hold at least
    SHALLOW_FROM_BLOCKS blocks of one class each, SHALLOW_FROM_TOTAL_BLOCKS in all, dynamo captures the forward
    with the first block of each such container, then with the first two of each (of one container at a time
    where their lengths differ), in the containers' places, and the count is extended to the full depths (each
    block of a container cuts the forward the same number of times; dynamo unrolls the loops over them, so its
    time grows with the depth: mamba2's 24 blocks took 21 s at full depth on 2 cores, T5's 12 + 12 blocks 6.7 s);
    a count that does not fit that (fewer graphs with two blocks than with
    one, or dynamo failing at any depth) is made at full depth."""
    device = _probe_device(model, real_cpu=real_cpu)
    if device is None:
        return None
    paths = (blocks_path,) if isinstance(blocks_path, str) else tuple(blocks_path or ())
    if paths:
        shallow = _shallow_count(model, sample, paths, device, max_reasons)
        if shallow is not None:
            return shallow
    return _explained(model, sample, device, max_reasons)


def _stack_of(model: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module] | None:
    """(its parent, its name there, the container) of a container of blocks that a shallow capture may shorten:
    torch's own containers only (a subclass may have a forward of its own), of at least SHALLOW_FROM_BLOCKS blocks
    of one class; None for any other."""
    parent_path, _, name = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
    except AttributeError:
        return None
    stack = parent._modules.get(name)
    if type(stack) not in (nn.ModuleList, nn.Sequential) or len(stack) < SHALLOW_FROM_BLOCKS \
            or len({type(m) for m in stack}) != 1:
        return None
    return parent, name, stack


def _shallow_count(model: nn.Module, sample: Any, paths: Sequence[str], device: torch.device, max_reasons: int
                   ) -> GraphCount | None:
    """The full-depth count from captures at depth 1 and 2 (see dynamo_graphs), or None where it cannot be made."""
    stacks = [s for s in (_stack_of(model, p) for p in dict.fromkeys(paths)) if s is not None]
    if sum(len(stack) for _, _, stack in stacks) < SHALLOW_FROM_TOTAL_BLOCKS:
        return None

    def captured(depths: list[int]) -> GraphCount | None:
        for (parent, name, stack), depth in zip(stacks, depths):
            first = list(stack)[:depth]  # the same block objects, fewer of them
            parent._modules[name] = nn.ModuleList(first) if type(stack) is nn.ModuleList else nn.Sequential(*first)
        return _explained(model, sample, device, max_reasons)

    # Containers of one length (an encoder's and a decoder's) grow together: their blocks' breaks add up alike at
    # every depth, so two captures say it all (each capture costs seconds of dynamo's own, whatever the depth);
    # of different lengths, each grows alone from the one-block capture.
    added = [len(stack) - 1 for _, _, stack in stacks]  # blocks beyond the first, per container
    together = len(set(added)) == 1
    grown = [[2] * len(stacks)] if together else \
        [[2 if j == i else 1 for j in range(len(stacks))] for i in range(len(stacks))]
    try:
        one = captured([1] * len(stacks))
        twos = [captured(depths) for depths in grown] if one is not None else []
    finally:
        for parent, name, stack in stacks:
            parent._modules[name] = stack
    if one is None or any(two is None or two.num_graphs < one.num_graphs for two in twos):
        return None  # the forward cannot run with fewer blocks (it indexes them, say), or the count does not fit
    # each capture grown by one block (in every container, or in one) adds that many more blocks' graphs
    total = one.num_graphs + sum(n * (two.num_graphs - one.num_graphs) for n, two in zip(added, twos))
    most = max(twos, key=lambda two: two.num_graphs)  # its reasons and sites: a break of every kind the blocks make
    return dataclasses.replace(most, num_graphs=total)


def _explained(model: nn.Module, sample: Any, device: torch.device, max_reasons: int) -> GraphCount | None:
    """dynamo's capture of the forward as the model is now (torch._dynamo.explain), or None where dynamo failed."""
    inputs = map_tensors(lambda t: t.to(device), sample)
    import torch._dynamo  # here, not at the top: importing it costs about a second, which `import autopar` skips

    try:
        # (dynamo's own logging of the breaks is not the user's to read: the profile's note says it once)
        quiet = torch._dynamo.config.patch(verbose=False, suppress_errors=False)
        with torch.no_grad(), warnings.catch_warnings(), quiet, _state_kept(model, device), kv_cache_off_while(model):
            warnings.simplefilter("ignore")
            out = torch._dynamo.explain(lambda s: call_model(model, s))(inputs)
    except Exception:  # dynamo could not run the forward here: unknown, not a verdict on compile
        return None
    reasons = tuple(str(getattr(b, "reason", b)).splitlines()[0][:200] for b in out.break_reasons[:max_reasons])
    sites = tuple(tuple((f.filename, int(f.lineno)) for f in getattr(b, "user_stack", ()) if f.lineno is not None)
                  for b in out.break_reasons)
    return GraphCount(num_graphs=int(out.graph_count), break_reasons=reasons, break_sites=sites)


def _forward_spans(modules: Iterable[nn.Module]) -> dict[str, list[tuple[int, int]]]:
    """file -> (first line, last line) of the `forward` of each class of these modules and their submodules."""
    spans: dict[str, list[tuple[int, int]]] = {}
    classes = {type(sub) for m in modules for sub in m.modules()}
    for cls in classes:
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is None:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        spans.setdefault(code.co_filename, []).append((code.co_firstlineno, max(lines, default=code.co_firstlineno)))
    return spans


def _probe_device(model: nn.Module, *, real_cpu: bool) -> torch.device | None:
    """meta or the GPU where every parameter and buffer lives (or the CPU, with `real_cpu`); None otherwise."""
    kinds = {t.device.type for t in (*model.parameters(), *model.buffers())}
    if kinds == {"meta"}:
        return torch.device("meta")
    if len(kinds) == 1 and (real_cpu or kinds != {"cpu"}):
        return next(iter(model.parameters())).device
    return None


@contextlib.contextmanager
def _state_kept(model: nn.Module, device: torch.device):
    """A real forward's traces removed afterwards: the buffers' values and the random states (CPU and `device`)."""
    if device.type == "meta":
        yield
        return
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    if device.type == "cpu":
        forked = torch.random.fork_rng(devices=[])
    else:
        index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
        forked = torch.random.fork_rng(devices=[index], device_type=device.type)
    with forked:
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

