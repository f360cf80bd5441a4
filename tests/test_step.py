"""Tests of autopar.train_step in one process: `split_batch` (tensors, tuples, dicts, what is not a batch), gradient
accumulation giving the gradients, losses and parameters of one step on the whole batch (the built-in GPT and a
Hugging Face Llama), the batch size check, gradient clipping (as torch.nn.utils.clip_grad_norm_, refusing a
non-finite norm) and the clip's count of a weight tied across pipeline stages.

Pipeline and tensor-parallel steps on several processes are covered by tests/distributed/."""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.models.gpt import lm_loss
from autopar.plans import Plan
from autopar._util.batch import call_model
from autopar.step import clip_grad_norm, split_batch
from tests._training import TORCHRUN_VARS, batch, loss_of, make_model, sample_of

ACCUM = Plan(micro_batch_size=4, grad_accum=2)
LR = 0.1


pytestmark = pytest.mark.usefixtures("one_plain_process")


@pytest.fixture(scope="module")
def wrapped_gpt():
    """The GPT wrapped with the accumulation plan, for the tests that never step it."""
    with pytest.MonkeyPatch.context() as mp:
        for name in TORCHRUN_VARS:
            mp.delenv(name, raising=False)
        model = make_model("gpt")
        autopar.wrap(model, sample=batch(0), plan=ACCUM, loss_fn=lm_loss, verbose=False)
    return model


# ---- split_batch --------------------------------------------------------------------------------------
def test_split_a_tensor():
    x = torch.arange(24).reshape(8, 3)
    parts = split_batch(x, 2)
    assert len(parts) == 2
    assert torch.equal(parts[0], x[:4]) and torch.equal(parts[1], x[4:])
    assert [p.shape[0] for p in split_batch(x, 8)] == [1] * 8
    assert torch.equal(split_batch(x, 1)[0], x)


def test_split_tuples_lists_and_named_tuples():
    x, y = torch.randn(6, 4), torch.arange(6)
    parts = split_batch((x, y), 3)
    assert all(type(p) is tuple for p in parts)
    for i, (px, py) in enumerate(parts):
        assert torch.equal(px, x[2 * i:2 * i + 2]) and torch.equal(py, y[2 * i:2 * i + 2])
    parts = split_batch([x, y], 2)
    assert type(parts[1]) is list and torch.equal(parts[1][1], y[3:])
    Pair = collections.namedtuple("Pair", "inputs targets")
    parts = split_batch(Pair(x, y), 2)
    assert type(parts[0]) is Pair and torch.equal(parts[1].targets, y[3:]) and torch.equal(parts[0].inputs, x[:3])


def test_split_a_hugging_face_dict_and_leave_what_is_not_batched():
    ids = torch.randint(0, 100, (8, 5))
    positions = torch.arange(5)  # (seq,): not batched
    scale = torch.tensor(2.0)  # 0-d
    b = {"input_ids": ids, "attention_mask": torch.ones(8, 5), "labels": ids.clone(), "position_ids": positions,
         "scale": scale, "return_dict": True}
    parts = split_batch(b, 2)
    assert [type(p) for p in parts] == [dict, dict] and list(parts[0]) == list(b)
    for i, part in enumerate(parts):
        assert torch.equal(part["input_ids"], ids[4 * i:4 * i + 4])
        assert torch.equal(part["labels"], ids[4 * i:4 * i + 4])
        assert part["attention_mask"].shape == (4, 5)
        assert part["position_ids"] is positions and part["scale"] is scale and part["return_dict"] is True


def test_split_a_detection_batch_by_its_lists_of_one_target_per_image():
    """Hugging Face's DETR / YOLOS take `labels` as a list of one dict per image, of as many boxes as the image has
    (a count that may equal the batch's): the list is cut, each image's dict kept whole. Split as tensors before, the
    first micro-batch got every image's targets (the matcher's IndexError) and a target of 4 boxes lost half."""
    images = torch.randn(4, 3, 8, 8)
    targets = [{"class_labels": torch.arange(n), "boxes": torch.rand(n, 4)} for n in (2, 4, 1, 3)]
    parts = split_batch({"pixel_values": images, "labels": targets}, 2)
    for i, part in enumerate(parts):
        assert torch.equal(part["pixel_values"], images[2 * i:2 * i + 2])
        assert [t["boxes"] for t in part["labels"]] == [t["boxes"] for t in targets[2 * i:2 * i + 2]]
    assert parts[0]["labels"][1]["boxes"].shape == (4, 4)


def test_a_list_of_images_is_the_batch_and_a_top_level_list_is_the_arguments():
    """torchvision's detection models take (a list of images of their own sizes, a list of target dicts): the
    batch is the lists' length, not the first image's channels."""
    from autopar._util.batch import sample_batch_size

    images = [torch.randn(3, 8 + k, 8) for k in range(4)]
    targets = [{"labels": torch.arange(k + 1)} for k in range(4)]
    assert sample_batch_size((images, targets)) == 4 and sample_batch_size([images, targets]) == 4
    first, second = split_batch((images, targets), 2)
    assert first[0] == images[:2] and second[1] == targets[2:]
    x, y = torch.randn(6, 2), torch.arange(6)
    assert sample_batch_size([x, y]) == 6  # the arguments themselves, not a list of two samples


def test_split_keeps_a_hugging_face_batch_encoding():
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding({"input_ids": torch.arange(16).reshape(4, 4), "attention_mask": torch.ones(4, 4)})
    parts = split_batch(enc, 2)
    assert all(isinstance(p, transformers.BatchEncoding) for p in parts)
    assert torch.equal(parts[1]["input_ids"], enc["input_ids"][2:])


def test_the_step_moves_a_batch_encoding_to_the_device():
    transformers = pytest.importorskip("transformers")
    from autopar._util.batch import to_device

    enc = transformers.BatchEncoding({"input_ids": torch.zeros(4, 3, dtype=torch.long), "attention_mask": torch.ones(4, 3)})
    moved = to_device(enc, torch.device("meta"))
    assert isinstance(moved, transformers.BatchEncoding)
    assert moved["input_ids"].device.type == "meta" and moved["attention_mask"].device.type == "meta"
    assert torch.equal(to_device(enc, torch.device("cpu"))["input_ids"], enc["input_ids"])


def test_a_batch_its_owner_placed_keeps_its_cpu_tensors_where_they_are():
    """A batch with a tensor already on a GPU is taken as placed: pack_padded_sequence's lengths, say, stay on the
    CPU (where torch requires them); a batch all on the CPU moves whole (above); meta tensors stay meta. (A fake
    GPU tensor: the rule, on a machine without one.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar._util.batch import to_device

    with FakeTensorMode():
        x, lengths = torch.zeros(4, 3, device="cuda"), torch.tensor([3, 2, 2, 1])
        for device in (torch.device("cuda"), torch.device("cuda", 0)):
            out = to_device({"x": x, "lengths": lengths}, device)
            assert out["x"] is x and out["lengths"] is lengths and out["lengths"].device.type == "cpu"
    shape_only = torch.empty(2, 3, device="meta")
    moved = to_device((torch.zeros(2), shape_only), torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[1] is shape_only


def test_split_refuses_a_batch_that_does_not_divide():
    with pytest.raises(PlanError, match="a batch of 6 samples does not split into 4 micro-batches"):
        split_batch(torch.zeros(6, 2), 4)
    with pytest.raises(PlanError, match="a batch of 5 samples does not split into 2"):
        split_batch({"input_ids": torch.zeros(5, 2, dtype=torch.long)}, 2)


# ---- train_step: accumulation == one step on the whole batch ------------------------------------------
class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients it stepped with."""

    def __init__(self, model, **kwargs):
        super().__init__(model.parameters(), **kwargs)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append({self.names[id(p)]: p.grad.detach().clone() for g in self.param_groups
                           for p in g["params"] if p.grad is not None})
        return super().step(closure)


def _plain(kind, steps, *, max_norm=None):
    model = make_model(kind)
    opt = _RecordingSGD(model, lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        x = sample_of(kind, batch(step))
        loss = loss_of(kind)(call_model(model, x), x)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt.grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _wrapped(kind, plan=ACCUM, **step_kwargs):
    model = make_model(kind)
    autopar.wrap(model, sample=sample_of(kind, batch(0)), plan=plan, loss_fn=lm_loss if kind == "gpt" else None,
                 verbose=False)
    opt = _RecordingSGD(model, lr=LR, momentum=0.9)
    # the Llama's loss is the default one: output.loss
    step = autopar.train_step(model, opt, loss_of(kind) if kind == "gpt" else None, **step_kwargs)
    return model, opt, step


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return float((a - b).norm()) <= rel * float(b.norm()) + 1e-9


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_accumulation_matches_one_step_on_the_whole_batch(kind):
    steps = 3
    ref_losses, ref_grads, ref_params = _plain(kind, steps)
    model, opt, step = _wrapped(kind)
    losses = [step(sample_of(kind, batch(s))).item() for s in range(steps)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert len(opt.grads) == steps  # one optimizer step per call
    for got, want in zip(opt.grads, ref_grads):
        assert got.keys() == want.keys()
        bad = [n for n in want if not _close(got[n], want[n])]
        assert not bad, f"gradients differ: {bad}"
    params = dict(model.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name].detach(), want, rtol=1e-5, atol=1e-6, msg=name)
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_compute_loss_accumulates_the_callers_own_loss_as_one_step_on_the_whole_batch():
    """compute_loss(micro_batch) calls the model itself (a framework's step): the same steps as loss_fn's."""
    steps = 3
    ref_losses, ref_grads, ref_params = _plain("gpt", steps)
    model = make_model("gpt")
    autopar.wrap(model, sample=sample_of("gpt", batch(0)), plan=ACCUM, loss_fn=lm_loss, verbose=False)
    opt = _RecordingSGD(model, lr=LR, momentum=0.9)
    step = autopar.train_step(model, opt, compute_loss=lambda mb: lm_loss(model(mb), mb))
    losses = [step(sample_of("gpt", batch(s))).item() for s in range(steps)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for got, want in zip(opt.grads, ref_grads):
        assert not [n for n in want if not _close(got[n], want[n])]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compute_loss_is_refused_beside_loss_fn_and_when_it_returns_no_loss(wrapped_gpt):
    from autopar.errors import LossError

    model = wrapped_gpt
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(PlanError, match=r"takes loss_fn\(output, batch\) or compute_loss\(batch\), not both"):
        autopar.train_step(model, opt, lm_loss, compute_loss=lambda mb: lm_loss(model(mb), mb))
    step = autopar.train_step(model, opt, compute_loss=lambda mb: model(mb))  # the logits, not a loss
    with pytest.raises(LossError, match=r"compute_loss must return the micro-batch's mean loss as a one-element "
                                        r"tensor, got Tensor\(4, "):
        step(batch(0))


def test_train_step_refuses_a_batch_of_another_size(wrapped_gpt):
    model = wrapped_gpt
    step = autopar.train_step(model, torch.optim.SGD(model.parameters(), lr=LR), lm_loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"got 4 samples, but this rank's batch under the plan is 8 "
                                        r"\(micro-batch 4 x accumulation 2\)"):
        step(batch(0)[:4])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---- gradient clipping --------------------------------------------------------------------------------
def test_max_grad_norm_clips_as_torch_does():
    max_norm = 0.05
    model, opt, step = _wrapped("gpt", max_grad_norm=max_norm)
    loss = step(batch(0)).item()
    ref_losses, ref_grads, ref_params = _plain("gpt", 1, max_norm=max_norm)
    _, unclipped_grads, unclipped = _plain("gpt", 1)
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in unclipped_grads[0].values()))
    assert total > 10 * max_norm  # the clip is active
    assert loss == pytest.approx(ref_losses[0], rel=1e-5)
    clipped = math.sqrt(sum(float(g.double().pow(2).sum()) for g in opt.grads[0].values()))
    assert clipped == pytest.approx(max_norm, rel=1e-4)
    for name, want in ref_params.items():
        got = dict(model.named_parameters())[name].detach()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.allclose(ref_params[n], unclipped[n], rtol=1e-3, atol=1e-5) for n in ref_params)


def test_a_non_finite_gradient_raises_before_the_step(wrapped_gpt):
    model = wrapped_gpt
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = autopar.train_step(model, opt, lambda out, x: lm_loss(out, x) * float("nan"), max_grad_norm=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with pytest.raises(FloatingPointError, match="gradient norm is nan"):
            step(batch(0))
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # no optimizer step
    finally:
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan")])
def test_max_grad_norm_must_be_positive(wrapped_gpt, bad):
    model = wrapped_gpt
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        autopar.train_step(model, opt, max_grad_norm=bad)


def test_clip_grad_norm_returns_the_norm_and_leaves_small_gradients():
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), 0.1)
    model.bias.grad = torch.full((2,), 0.1)
    norm = clip_grad_norm(model, 10.0, None)
    assert float(norm) == pytest.approx(math.sqrt(8 * 0.01), rel=1e-6)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 0.1))  # below the max: untouched


@pytest.mark.parametrize("plan", [
    Plan(pp=2, pp_schedule="1f1b", micro_batch_size=4, grad_accum=2),
    Plan(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=2, micro_batch_size=4, grad_accum=2),
], ids=["1f1b", "zero-bubble-v"])
def test_pipeline_clip_counts_a_tied_weight_once(plan):
    from autopar.profile import profile_model
    from autopar.strategies.pipeline import apply_pipeline_split

    # The gradients of the whole model (the tied weight's is the sum over its two uses), and their norm.
    original = make_model("gpt")
    x = batch(0)
    lm_loss(original(x), x).backward()
    grads = {n: p.grad for n, p in original.named_parameters(remove_duplicate=False)}
    want = float(torch.nn.utils.clip_grad_norm_(original.parameters(), 1e9))
    profile = profile_model(make_model("gpt"), x, loss_fn=lm_loss, warn=False)
    # Each pipeline rank's model, with those gradients (as sync_tied_grads leaves them: every copy holds the sum).
    # clip_grad_norm all-reduces the ranks' sums of squares; here each rank's is added up by hand.
    squares = 0.0
    for rank in range(plan.pp):
        model = make_model("gpt")
        apply_pipeline_split(model, plan, profile, rank)
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        squares += float(clip_grad_norm(model, 1e9, None, tied=profile.tied_params)) ** 2
    assert math.sqrt(squares) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_the_public_clip_grad_norm_is_torchs_on_one_process(norm_type, monkeypatch):
    """autopar.clip_grad_norm_ (for a loop of the user's own) returns torch's norm and leaves torch's gradients."""
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    torch.manual_seed(0)
    original = make_model("gpt")
    model = autopar.wrap(copy.deepcopy(original), sample=batch(0), loss_fn=lm_loss, verbose=False)
    for m in (original, model):
        lm_loss(m(batch(0)), batch(0)).backward()
    want = torch.nn.utils.clip_grad_norm_(original.parameters(), 0.01, norm_type=norm_type)
    got = autopar.clip_grad_norm_(model, 0.01, norm_type=norm_type)
    assert float(got) == pytest.approx(float(want), rel=1e-5) and float(want) > 0.01
    for (name, p), q in zip(model.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9, msg=name)


def test_the_public_clip_grad_norm_refuses_a_non_finite_norm_when_asked(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_WRAP_CACHE", "1")
    model = autopar.wrap(make_model("gpt"), sample=batch(0), loss_fn=lm_loss, verbose=False)
    lm_loss(model(batch(0)), batch(0)).backward()
    next(model.parameters()).grad[0] = float("inf")
    with pytest.raises(RuntimeError, match="is inf"):
        autopar.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    assert math.isinf(float(autopar.clip_grad_norm_(model, 1.0)))  # as torch: the gradients scaled by 0
    assert all(float(p.grad.nan_to_num(0).abs().max()) == 0 for p in model.parameters())
    with pytest.raises(PlanError, match="not wrapped by autopar"):
        autopar.clip_grad_norm_(make_model("gpt"), 1.0)
