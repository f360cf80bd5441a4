"""Batches as autopar sees them: their batch size, their tensors, and how a sample is passed to the model."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from ..errors import LossError, PeerBatchError, ProfileError, SampleError


def sample_batch_size(sample: Any) -> int:
    """The batch size of a sample: dim 0 of its first tensor (`input_ids` first for a dict), or the length of a list
    of one item per sample met before any tensor (a detection model's images and targets, `per_sample_list`)."""
    found = _first_batched(sample, top=True)
    if isinstance(found, int):
        return found
    if found is None or found.dim() == 0:
        raise ProfileError(
            "sample must hold a batched tensor (a tensor, a tuple/list of tensors, or a dict of them with the "
            f"batch in dim 0); got {type(sample).__name__}."
        )
    return int(found.shape[0])


def per_sample_list(x: Any, *, top: bool) -> bool:
    """Whether `x` is a list of one item per sample: a list (not a tuple) of tensors or dicts that is not the sample
    itself (a top-level list is the model's positional arguments), as collators give a detection model's per-image
    targets (Hugging Face's DETR, YOLOS: `labels=[{"class_labels": ..., "boxes": ...}, ...]`) or torchvision's
    images of different sizes."""
    return isinstance(x, list) and not top and len(x) > 0 and \
        all(isinstance(v, (torch.Tensor, Mapping)) for v in x)


def _first_batched(sample: Any, *, top: bool, lists: bool = True) -> torch.Tensor | int | None:
    """The first tensor of `sample` (`input_ids` first in a mapping), or the length of a list of one item per sample
    met before it (`lists`), or None."""
    if isinstance(sample, torch.Tensor):
        return sample
    if lists and per_sample_list(sample, top=top):
        return len(sample)
    if isinstance(sample, Mapping):
        if isinstance(sample.get("input_ids"), torch.Tensor):
            return sample["input_ids"]
        values = list(sample.values())
    elif isinstance(sample, (tuple, list)):
        values = list(sample)
    else:
        return None
    for v in values:
        found = _first_batched(v, top=False, lists=lists)
        if found is not None:
            return found
    return None


def sample_rows(batch: Any, lo: int, hi: int, size: int) -> Any:
    """Samples lo:hi of `batch`, which holds `size`: tensors cut along dim 0 where it holds the samples, lists of one
    item per sample (`per_sample_list`) of that length cut as lists (their items are whole samples'), and the rest
    as it is (a tensor shared by all samples, a flag); containers rebuilt as their own types."""
    def cut(x: Any, top: bool) -> Any:
        if isinstance(x, torch.Tensor):
            return x[lo:hi] if x.dim() > 0 and x.shape[0] == size else x
        if per_sample_list(x, top=top) and len(x) == size:
            return x[lo:hi]
        return _rebuilt(x, lambda v: cut(v, False))

    return cut(batch, True)


def _rebuilt(x: Any, each: Callable[[Any], Any]) -> Any:
    """`x` with `each` applied to its values where it is a container (any Mapping, rebuilt as its own type where
    it can be from a dict, such as Hugging Face's BatchEncoding; a namedtuple, tuple or list), else `x`."""
    if isinstance(x, Mapping):
        items = {k: each(v) for k, v in x.items()}
        try:
            return type(x)(items)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return items
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(each(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(each(v) for v in x)
    return x


def first_tensor(sample: Any) -> torch.Tensor | None:
    found = _first_batched(sample, top=True, lists=False)
    return found if isinstance(found, torch.Tensor) else None


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors in `tree` (a tensor, or tuples, lists and dicts of them: what an aten op takes and returns), in
    order, walked without pytree's general flatten (the trace's dispatch modes call this for every op: pytree's was
    a tenth of a trace's time)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, (tuple, list)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
    return out


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with `fn` applied to every tensor in it: tensors, tuples, lists, namedtuples and any Mapping
    (dicts and dict-likes such as Hugging Face's BatchEncoding, rebuilt as their own type)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    return _rebuilt(batch, lambda v: map_tensors(fn, v))


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` on `device`, as autopar runs a step on it: a batch all on the CPU moves whole; one whose owner
    already put any tensor on another device (a GPU) is taken as placed - its CPU tensors stay where they are
    (pack_padded_sequence's lengths must be on the CPU, say), and only those on another accelerator move. Meta
    tensors (shapes without values) stay meta."""
    kinds: set[str] = set()
    map_tensors(lambda t: kinds.add(t.device.type), batch)
    kinds.discard("meta")
    placed = not kinds <= {"cpu"} and device.type != "cpu"

    def one(t: torch.Tensor) -> torch.Tensor:
        there = t.device.type == device.type and device.index in (None, t.device.index)
        return t if there or t.is_meta or (placed and t.device.type == "cpu") else t.to(device)

    return map_tensors(one, batch)


def first_rows(sample: Any, rows: int | None) -> tuple[Any, int | None]:
    """The first `rows` samples of `sample` (its tensors cut along dim 0 where they hold the sample's count), or
    `sample` itself where rows is None or not fewer than it holds; and how many samples that is (None: the sample
    has no tensor with a batch dimension, and runs as it is)."""
    try:
        size = sample_batch_size(sample)
    except Exception:  # no tensor with a batch dimension: run it as it is
        return sample, None
    if rows is None or rows >= size:
        return sample, size
    return sample_rows(sample, 0, rows, size), rows


def split_sample(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of a sample as autopar passes it: model(x), model(*tuple) or model(**dict)."""
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    return (sample,), {}


def call_model(model: Callable[..., Any], sample: Any) -> Any:
    """Call the model with a sample the way autopar does everywhere (see `split_sample`)."""
    args, kwargs = split_sample(sample)
    return model(*args, **kwargs)


def check_sample_fits(model: Any, sample: Any, *, what: str = "sample=", remedy: str | None = None) -> None:
    """A SampleError where `sample`, passed as autopar passes it (`split_sample`), cannot bind to the model's
    forward: a keyword it does not take (and no **kwargs), a required argument the sample lacks, too many
    positional values. A forward whose signature cannot be read is not checked. `what` names the sample in the
    message (where it came from), `remedy` says what to change (default: give a sample that fits)."""
    forward = getattr(model, "forward", model)
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return
    args, kwargs = split_sample(sample)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        given = f"has keys {list(kwargs)}" if isinstance(sample, Mapping) else \
            f"is {len(args)} positional value(s)" if isinstance(sample, (tuple, list)) else "is one tensor"
        params = [n for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        name = f"{type(model).__name__}.forward({', '.join(params)})"
        raise SampleError(f"{what} does not fit {name} ({exc}): it {given}, forward takes {params}; " + (
            remedy or "give a sample the model is called with as model(x), model(*sample) or model(**sample).")) from None


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model returned, for autopar.train_step without loss_fn: `output.loss` or `output["loss"]`
    (Hugging Face given labels), or the output itself where it is a scalar tensor; else a LossError (a step
    must not train on some stand-in such as the sum of the logits)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, torch.Tensor):
        what = f"a tensor of shape {tuple(output.shape)}"
    elif isinstance(output, (Mapping, tuple, list)):
        what = f"a {type(output).__name__} of {len(output)} value(s)" + (
            " whose loss is None (no labels in the batch?)" if isinstance(output, Mapping) and "loss" in output else "")
    else:
        what = f"a {type(output).__name__}"
    raise LossError(f"the model's output is {what} with no .loss: pass loss_fn=lambda output, batch: ... (the batch's "
                    "mean loss) to autopar.train_step.")


def batch_fingerprint(batch: Any) -> list[float]:
    """A few numbers that differ, in practice, between two different batches: the number of tensors, of their
    elements, their sums and sums of squares (float64), and the same sums weighted by each tensor's position
    and shape. Its size does not depend on the batch (so that ranks can gather it)."""
    tensors: list[torch.Tensor] = []
    map_tensors(tensors.append, batch)
    acc = torch.zeros(7, dtype=torch.float64, device=tensors[0].device if tensors else "cpu")
    for i, t in enumerate(tensors):
        x = t.detach().to(acc.device, torch.float64)
        s, q = x.sum(), x.pow(2).sum()
        shape = float(sum((j + 1) * d for j, d in enumerate(t.shape)))
        acc += torch.stack([torch.ones_like(s), torch.full_like(s, float(t.numel())), s, q, (i + 1) * s,
                            (i + 1) * q, torch.full_like(s, (i + 1) * shape)])
    return acc.tolist()


def _holds_fake(batch: Any) -> bool:
    """Whether the batch holds fake or meta tensors (no values)."""
    tensors: list[torch.Tensor] = []
    map_tensors(tensors.append, batch)
    return any(is_fake(t) or t.is_meta for t in tensors)


def check_peer_batches(batch: Any, *, data_rank: int, device: torch.device, degrees: str) -> None:
    """Collective over every rank: a PeerBatchError on every rank where two ranks of one data-parallel index
    (the tensor- / pipeline-parallel peers that must read the same samples) hold different batches. One
    all_gather of a few numbers a rank; nothing without a process group of several."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if _holds_fake(batch):  # a step on fake tensors (the exact memory check) has no values to compare
        return
    if dist.get_backend() != "nccl":
        device = torch.device("cpu")
    mine = torch.tensor([float(data_rank), *batch_fingerprint(batch)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    first: dict[float, tuple[int, torch.Tensor]] = {}
    for rank, row in enumerate(every):
        seen = first.setdefault(float(row[0]), (rank, row))
        if not torch.allclose(seen[1][1:], row[1:], rtol=1e-9, atol=1e-9):
            raise PeerBatchError(
                f"the ranks of a {degrees} group were given different batches (ranks {seen[0]} and {rank}): give every "
                "rank of a group the same batch (autopar.dataloader(model, dataset) or autopar.data_shard(model), "
                "which shard by data-parallel rank only, not a DistributedSampler over every rank).")


def check_peers_on_first_forward(model: torch.nn.Module, *, data_rank: int, device: torch.device,
                                 degrees: str) -> None:
    """Before the model's first forward (then never again): `check_peer_batches` on what it is called with."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        check_peer_batches((args, kwargs), data_rank=data_rank, device=device, degrees=degrees)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def default_loss(output: Any) -> torch.Tensor:
    """The loss used to drive backward when none is given: `output.loss` if present, else a sum of the output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    t = output if isinstance(output, torch.Tensor) else None
    if t is None:
        if isinstance(output, Mapping):
            t = output.get("logits")
            t = t if isinstance(t, torch.Tensor) else first_tensor(list(output.values()))
        elif isinstance(output, (tuple, list)):
            t = first_tensor(list(output))
    if t is None or not t.is_floating_point():
        raise ProfileError(
            f"cannot make a loss from the model's output ({type(output).__name__}): pass loss_fn=, a function "
            "from the model's output to a scalar loss."
        )
    return t.float().sum()


def to_fp32_outputs(output: Any) -> Any:
    """Cast the bf16/fp16 tensors of a model output (tensor, tuple, list, dict, HF ModelOutput) to fp32."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.bfloat16, torch.float16) else output
    if isinstance(output, dict):  # includes Hugging Face ModelOutput (an OrderedDict): update in place
        for key in list(output.keys()):
            output[key] = to_fp32_outputs(output[key])
        return output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # namedtuple
        return type(output)(*(to_fp32_outputs(o) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(to_fp32_outputs(o) for o in output)
    return output


def has_loss(output: Any) -> bool:
    """Whether a model output carries the loss the model computed (a Hugging Face output given `labels`)."""
    return isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor)


def autocast_outputs(output: Any) -> Any:
    """What an autocast forward returns: its floating outputs in fp32 (so that the user's own loss is computed
    as before), except where the model computed its loss itself: then as autocast made them (the loss in fp32,
    logits in bf16, as under the user's own `with torch.autocast(...)`); casting a large vocabulary's logits that
    no loss reads cost GPT-2 2.8 ms a step of 50 on the H200 (bench/results/zoo_h200_profile_2026-12-01c.jsonl)."""
    return output if has_loss(output) else to_fp32_outputs(output)
