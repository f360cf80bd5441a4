"""autopar.profile.shadow: a step that reads the sample's values is traced from them; one that reads what the
weights compute still is not."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import TraceError
from autopar.profile.trace import StepTrace

VOCAB, FRAMES, HIDDEN = 12, 10, 16


class _CTCHead(nn.Module):
    """wav2vec2's CTC loss in small: a check of the labels' range, lengths from the attention mask and the
    labels, the targets as a masked_select of the labels (a value-dependent shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= VOCAB:
            raise ValueError("labels out of range")
        log_probs = F.log_softmax(self.head(torch.relu(self.proj(x))), dim=-1).transpose(0, 1)  # (frames, batch, vocab)
        input_lengths = mask.sum(-1)
        valid = labels >= 0
        targets = labels.masked_select(valid)
        return F.ctc_loss(log_probs, targets, input_lengths, valid.sum(-1), blank=0, zero_infinity=True)


def _sample(batch: int = 3) -> dict:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(1, VOCAB, (batch, 4), generator=g)
    labels[0, 3] = -100  # a padded label: the targets' count depends on the values
    mask = torch.ones(batch, FRAMES, dtype=torch.long)
    mask[1, 7:] = 0
    return {"x": torch.randn(batch, FRAMES, HIDDEN, generator=g), "mask": mask, "labels": labels}


def _trace(model: nn.Module, sample: dict):
    units = [("proj", model.proj)]
    return StepTrace(model, sample, units, loss_fn=lambda out, _s: out, precision="fp32").run()


def test_a_step_that_reads_its_samples_values_is_traced_with_the_flops_of_its_matmuls():
    model, sample = _CTCHead(), _sample()
    t = _trace(model, sample)
    tokens = 3 * FRAMES
    proj, head = 2 * tokens * HIDDEN * HIDDEN, 2 * tokens * HIDDEN * VOCAB  # forward FLOPs of each Linear
    assert t.forward_flops == proj + head
    # backward: the head's input and weight gradients, the first Linear's weight gradient only (x needs none)
    assert t.flops == 3 * head + 2 * proj


def test_the_shadowed_values_are_the_samples_the_range_check_still_raises():
    model, sample = _CTCHead(), _sample()
    sample["labels"][2, 0] = VOCAB  # out of range: the real check in forward sees it through the shadow
    with pytest.raises(TraceError, match="labels out of range"):
        _trace(model, sample)


def test_a_read_of_what_the_weights_compute_still_fails_the_trace():
    class ReadsItsLogits(_CTCHead):
        def forward(self, x, mask, labels):
            if self.head(x @ self.proj.weight).max() > 1e9:  # value of weights' output: not knowable here
                raise ValueError("too large")
            return super().forward(x, mask, labels)

    with pytest.raises(TraceError, match="DataDependentOutputException"):
        _trace(ReadsItsLogits(), _sample())


def test_a_meta_sample_has_no_values_to_read():
    sample = {k: torch.empty_like(v, device="meta") for k, v in _sample().items()}
    with pytest.raises(TraceError, match="DataDependentOutputException"):
        _trace(_CTCHead(), sample)
