"""autopar.train_step with a Hugging Face model's own loss over labels masked unevenly (-100: padding, prompts
masked in fine-tuning): the step's loss is the mean over the whole global batch's valid labels, as one process on
that batch computes it, whatever the micro-batches and data-parallel ranks hold (each micro-batch is given
num_items_in_batch, the count over all of them and all ranks, as transformers' Trainer does); the mean of the
micro-batches' means, which weighs a label by 1 / its micro-batch's count, is what it replaced. A model that does
not divide by the count it is given is found at the first step and trained as before."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar._util.label_items import label_items
from tests.distributed import _items_worker as worker
from tests._training import make_model
from tests.distributed._launch import torchrun

pytestmark = pytest.mark.usefixtures("one_plain_process")


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=1e-6, msg=name)


def _trained_as_one_process(model: torch.nn.Module, prefix: str = "") -> torch.nn.Module:
    """`model` wrapped with 4 micro-batches a step and trained by train_step: its losses and the weights under
    `prefix` are the plain Llama's on the whole batch (worker.reference)."""
    want_losses, want = worker.reference()
    autopar.wrap(model, sample=worker.batch(0), plan=autopar.Plan(**worker.PLANS["one"]), loop="train_step",
                 verbose=False)
    opt = torch.optim.SGD(model.parameters(), lr=worker.LR)
    step = autopar.train_step(model, opt)
    losses = [step(worker.batch(s)).item() for s in range(worker.STEPS)]
    assert losses == pytest.approx(want_losses, rel=1e-5)
    _close({n.removeprefix(prefix): p.detach() for n, p in model.named_parameters() if n.startswith(prefix)},
           want, 1e-4)
    return model


def test_a_causal_lm_counts_its_shifted_labels_and_a_plain_module_is_not_counted():
    how = label_items(make_model("llama"), worker.batch(0))
    assert how is not None and how.shifted
    b = worker.batch(0)
    assert how.count(b).item() == (b["labels"][:, 1:] != -100).sum().item()
    assert label_items(torch.nn.Linear(2, 2), b) is None
    assert label_items(make_model("llama"), {"input_ids": b["input_ids"]}) is None


def test_accumulation_trains_as_one_step_on_the_whole_batch_and_the_mean_of_means_would_not():
    _trained_as_one_process(make_model("llama"))
    # the test can tell: the micro-batches' own means average to another loss
    plain = make_model("llama")
    micro = [{k: v[i:i + 2] for k, v in worker.batch(0).items()} for i in range(0, worker.GLOBAL, 2)]
    with torch.no_grad():
        mean_of_means = sum(plain(**mb).loss for mb in micro) / len(micro)
    assert abs(mean_of_means.item() - worker.reference()[0][0]) > 1e-3


class _OwnMean(torch.nn.Module):
    """A transformers model whose forward takes **kwargs but drops num_items_in_batch (its loss stays its own mean,
    as transformers' T5, BART and BERT-MLM do); with `extra`, PaLM's z-loss added to that mean."""

    def __init__(self, extra: float = 0.0) -> None:
        super().__init__()
        self.inner = make_model("llama")
        self.config, self.loss_type, self.extra = self.inner.config, "ForCausalLM", extra

    def forward(self, input_ids, labels, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        out = self.inner(input_ids=input_ids, labels=labels, **kwargs)
        out.loss = out.loss + self.extra * torch.logsumexp(out.logits.float(), -1).square().mean()  # a z-loss
        return out


def test_a_model_that_ignores_the_count_is_weighed_by_its_items_and_trains_as_one_process():
    """Its loss is the cross-entropy of its logits over the counted labels: each micro-batch's mean times its count
    over the step's count, which is the whole batch's item mean."""
    _trained_as_one_process(_OwnMean(), prefix="inner.")


def test_a_loss_that_is_not_its_items_mean_trains_on_the_mean_of_its_micro_batches_means():
    model = _OwnMean(extra=1e-2)
    assert label_items(model, worker.batch(0)) is not None  # it says it takes the count
    plain = _OwnMean(extra=1e-2)
    autopar.wrap(model, sample=worker.batch(0), plan=autopar.Plan(**worker.PLANS["one"]), loop="train_step",
                 verbose=False)
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=worker.LR) for m in (model, plain))
    step = autopar.train_step(model, opt)
    for s in range(2):
        micro = [{k: v[i:i + 2] for k, v in worker.batch(s).items()} for i in range(0, worker.GLOBAL, 2)]
        want = 0.0
        for mb in micro:
            loss = plain(**mb).loss / len(micro)
            loss.backward()
            want += loss.item()
        plain_opt.step()
        plain_opt.zero_grad()
        assert step(worker.batch(s)).item() == pytest.approx(want, rel=1e-5)
    _close({n: p.detach() for n, p in model.named_parameters()},
           {n: p.detach() for n, p in plain.named_parameters()}, 1e-4)


@pytest.mark.parametrize("name", ["fsdp", "ddp", "tp"])
def test_two_ranks_train_as_one_process_on_the_global_batch(tmp_path, name):
    torchrun("tests/distributed/_items_worker.py", 2, [str(tmp_path / "out.pt"), name], cache_dir=tmp_path / "cache",
             timeout_s=600)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    want_losses, want = worker.reference()
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
    _close(got["params"], want, 1e-4)


class _WithNorm(torch.nn.Module):
    """A transformers model that takes the count, beside a BatchNorm whose running statistics its forward updates:
    the first step's extra forward (the check) leaves them and the random state as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model("llama")
        self.config, self.loss_type = self.inner.config, "ForCausalLM"
        self.norm = torch.nn.BatchNorm1d(1)

    def forward(self, input_ids, labels, **kwargs):
        side = self.norm(input_ids[:, :1].float())
        out = self.inner(input_ids=input_ids, labels=labels, **kwargs)
        out.loss = out.loss + 0 * side.sum()
        return out


def test_the_first_steps_check_leaves_the_buffers_as_the_micro_batches_left_them():
    model = _trained_as_one_process(_WithNorm(), prefix="inner.")
    assert model.norm.num_batches_tracked.item() == worker.STEPS * 4  # 4 micro-batches a step; the check's undone

