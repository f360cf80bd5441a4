"""Batches as autopar sees them: their batch size, their tensors, and how a sample is passed to the model."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..errors import ProfileError


def sample_batch_size(sample: Any) -> int:
    """The batch size of a sample: dim 0 of its first tensor (`input_ids` first for a dict)."""
    first = first_tensor(sample)
    if first is None or first.dim() == 0:
        raise ProfileError(
            "sample must hold a batched tensor (a tensor, a tuple/list of tensors, or a dict of them with the "
            f"batch in dim 0); got {type(sample).__name__}."
        )
    return int(first.shape[0])


def first_tensor(sample: Any) -> torch.Tensor | None:
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(sample, Mapping):
        if isinstance(sample.get("input_ids"), torch.Tensor):
            return sample["input_ids"]
        values = list(sample.values())
    elif isinstance(sample, (tuple, list)):
        values = list(sample)
    else:
        return None
    for v in values:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with `fn` applied to every tensor in it: tensors, tuples, lists, namedtuples and any Mapping
    (dicts and dict-likes such as Hugging Face's BatchEncoding, rebuilt as their own type)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(fn, v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


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
