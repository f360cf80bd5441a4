"""The items a Hugging Face model's own loss averages over (its labels other than -100), so that `autopar.train_step`
makes a step's loss the mean over the whole batch's items and not the mean of its micro-batches' means.

A causal LM given `labels` returns the mean cross-entropy over its valid (not -100) shifted labels. When the
micro-batches of a step, or the data-parallel ranks, hold different numbers of valid labels (padding, prompt tokens
masked out in fine-tuning), the mean of their means weighs each item by 1 / (its micro-batch's count): the gradient
is not the whole batch's, and changes with grad_accum and the number of ranks (the "gradient accumulation" bug
transformers' Trainer fixed in 2024). transformers' models take `num_items_in_batch=N` and then return the sum of
their item losses over N; its Trainer counts N as below (labels[..., 1:] for a causal LM's shifting loss, unshifted
for an encoder-decoder's or any other loss) and sums it over the ranks. autopar does the same, for a model that takes
loss keyword arguments, after checking once that the model divides by the N it is given what it counts itself.
A model that takes them but ignores N (transformers' T5, BART and BERT's masked LM in 5.25 return their own mean
whatever N) is weighed instead: each micro-batch's mean times its count over N, which is the same sum over N, where
the first step finds its loss to be the cross-entropy of its logits over the counted labels (`item_mean`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn

IGNORE_INDEX = -100  # the label torch's cross_entropy and transformers' losses skip


@dataclass(frozen=True)
class LabelItems:
    """How to count the items of a batch that a model's own loss averages over."""

    shifted: bool  # a causal LM's loss: labels[..., 1:] (position 0 is never a target)
    weighed: bool = False  # the model ignores num_items_in_batch: its mean is weighed by its count over N instead

    def _labels(self, batch: Mapping[str, Any]) -> torch.Tensor:
        labels = batch.get("shift_labels")
        if not isinstance(labels, torch.Tensor):
            labels = batch["labels"][..., 1:] if self.shifted else batch["labels"]
        return labels

    def count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The batch's valid labels (a 0-d tensor on the labels' device)."""
        return self._labels(batch).ne(IGNORE_INDEX).sum()

    def item_mean(self, output: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The mean cross-entropy of the output's logits over the counted labels (no gradient), or None where the
        output has no plain logits tensor shaped as the labels and a class dimension."""
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, Mapping):
            logits = output.get("logits")
        labels = self._labels(batch)
        if type(logits) is not torch.Tensor or logits.dim() != labels.dim() + 1:  # (a DTensor's: not here)
            return None
        if self.shifted and "shift_labels" not in batch:
            logits = logits[..., :-1, :]
        if logits.shape[:-1] != labels.shape:
            return None
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(logits.detach().flatten(0, -2).float(),
                                                     labels.flatten().to(logits.device), ignore_index=IGNORE_INDEX)


def label_items(model: nn.Module, batch: Any) -> LabelItems | None:
    """How to count what `model`'s own loss averages over in `batch`, or None where autopar cannot know: the batch
    is not a dict with a `labels` tensor, the model is not a transformers model (no `loss_type`), or its forward
    takes no loss keyword arguments (transformers' `accepts_loss_kwargs`, else a **kwargs in its forward)."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), torch.Tensor):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's base
    if not hasattr(inner, "loss_type") or not hasattr(inner, "config"):
        return None
    accepts = getattr(inner, "accepts_loss_kwargs", None)
    if accepts is None:
        try:
            params = inspect.signature(inner.forward).parameters.values()
        except (TypeError, ValueError):
            return None
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    if not accepts:
        return None
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return None
    try:  # the loss the model computes (transformers' loss_function: ForCausalLM's where its loss_type is unknown)
        loss = getattr(inner, "loss_function", None) or LOSS_MAPPING.get(inner.loss_type)
    except Exception:  # a model whose loss_type cannot tell
        return None
    return LabelItems(shifted=loss is ForCausalLMLoss and not getattr(inner.config, "is_encoder_decoder", False))
