"""The kernels torch.compile's fusion leaves of the memory-bound work (autopar.profile.fusion): the reductions an
op runs as (reduction_loops), the kernels a chain of memory-bound ops costs under inductor's reduction
heuristics (FusionModel), the buffer updates that run apart (standalone), and the trace's fp32 outputs in the
loss scope."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.profile import profile_model
from autopar.profile.fusion import FusionModel, reduction_loops

aten = torch.ops.aten
FORWARD = (0, False, False)  # FusionModel.kernels' key: scope 0, forward, not weight traffic


# ---- reduction_loops -------------------------------------------------------------------------
def test_a_reduction_runs_over_its_output_and_softmax_over_its_rows():
    """sum (64, 4096) -> (64,): 64 outputs of 4096 elements; softmax over (8, 16, 32): 128 rows of 32;
    a pointwise op reduces nothing."""
    x = torch.randn(64, 4096)
    assert reduction_loops("sum", [x], [x.sum(-1)]) == [(64, 4096)]
    s = torch.randn(8, 16, 32)
    assert reduction_loops("_softmax", [s], [aten._softmax(s, -1, False)]) == [(8 * 16, 32)]
    assert reduction_loops("relu", [x], [x.relu()]) == []


def test_a_layer_norm_reduces_over_its_rows_and_its_weight_gradient_over_the_columns():
    """native_layer_norm over (12, 48): 12 rows of 48; its backward with weight gradients also 48 columns
    of 12 rows; without them, only the rows."""
    h, w, b = torch.randn(12, 48), torch.randn(48), torch.randn(48)
    out, mean, rstd = aten.native_layer_norm(h, [48], w, b, 1e-5)
    assert reduction_loops("native_layer_norm", [h, w, b], [out, mean, rstd]) == [(12, 48)]
    g = torch.randn(12, 48)
    inputs = [g, h, mean, rstd, w, b]
    grads = aten.native_layer_norm_backward(g, h, [48], mean, rstd, w, b, [True, True, True])
    assert reduction_loops("native_layer_norm_backward", inputs, list(grads)) == [(12, 48), (48, 12)]
    only_input = aten.native_layer_norm_backward(g, h, [48], mean, rstd, w, b, [True, False, False])
    assert reduction_loops("native_layer_norm_backward", inputs,
                           [t for t in only_input if t is not None]) == [(12, 48)]


def test_a_batch_norm_reduces_over_each_channel_in_training_only():
    """(4, 6, 5, 7) in training: 6 channels of 4 * 5 * 7; in eval (running statistics, empty saved ones) and
    as _native_batch_norm_legit_no_training: no reduction."""
    x = torch.randn(4, 6, 5, 7)
    w, b, rm, rv = torch.ones(6), torch.zeros(6), torch.zeros(6), torch.ones(6)
    inputs = [x, w, b, rm, rv]
    train = aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    assert reduction_loops("native_batch_norm", inputs, list(train)) == [(6, 4 * 5 * 7)]
    legit = aten._native_batch_norm_legit(x, w, b, rm, rv, True, 0.1, 1e-5)
    assert reduction_loops("_native_batch_norm_legit", inputs, list(legit)) == [(6, 4 * 5 * 7)]
    evaluated = aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5)
    assert reduction_loops("native_batch_norm", inputs, list(evaluated)) == []
    frozen = aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)
    assert reduction_loops("_native_batch_norm_legit_no_training", inputs, list(frozen)) == []


# ---- FusionModel's kernels -------------------------------------------------------------------
def _meta(*shape: int) -> torch.Tensor:
    """A tensor with a storage of its own and no data (FusionModel reads storages and sizes only)."""
    return torch.empty(*shape, device="meta")


def test_a_persistent_row_reduction_fuses_with_the_ops_around_it():
    """elementwise -> softmax over 512 (16384 rows: many outputs, a short row) -> elementwise: one kernel;
    a second persistent reduction in the same loop adds one."""
    f = FusionModel()
    x, a, b, c = (_meta(16384, 512) for _ in range(4))
    f.memory_op(0, "elementwise", [x], [a])
    f.memory_op(0, "softmax", [a], [b], [(16384, 512)])
    f.memory_op(0, "elementwise", [b], [c])
    assert f.kernels[FORWARD] == 1
    f.memory_op(0, "softmax", [c], [_meta(16384, 512)], [(16384, 512)])
    assert f.kernels[FORWARD] == 2


def test_a_split_reduction_adds_a_kernel_and_the_op_after_it_opens_a_new_one():
    """A bias-gradient-like sum (16384, 768) -> (768,): few outputs over many elements, split in two kernels
    (the partial sums and their combination); what reads its result runs in a kernel after them."""
    f = FusionModel()
    g, h, r, o = _meta(16384, 768), _meta(16384, 768), _meta(768), _meta(768)
    f.memory_op(0, "elementwise", [g], [h])
    assert f.kernels[FORWARD] == 1
    f.memory_op(0, "reduction", [h], [r], [(768, 16384)])
    assert f.kernels[FORWARD] == 2
    f.memory_op(0, "elementwise", [r], [o])
    assert f.kernels[FORWARD] == 3
    f.memory_op(0, "elementwise", [o], [_meta(768)])
    assert f.kernels[FORWARD] == 3  # joins the kernel the op before opened


def test_a_norm_s_pointwise_part_after_a_split_reduction_opens_a_kernel():
    """A training batch norm (64 channels of 32768: split): its statistics' two kernels, then its normalising
    in a third, which the ReLU after it joins. A layer norm over 768-wide rows (persistent): one kernel with
    the ReLU."""
    f = FusionModel()
    x, y, z = _meta(32, 64, 32, 32), _meta(32, 64, 32, 32), _meta(32, 64, 32, 32)
    f.memory_op(0, "norm", [x], [y], [(64, 32 * 32 * 32)])
    assert f.kernels[FORWARD] == 3
    f.memory_op(0, "elementwise", [y], [z])
    assert f.kernels[FORWARD] == 3
    layer = FusionModel()
    h, n, r = _meta(16384, 768), _meta(16384, 768), _meta(16384, 768)
    layer.memory_op(0, "norm", [h], [n], [(16384, 768)])
    layer.memory_op(0, "elementwise", [n], [r])
    assert layer.kernels[FORWARD] == 1


# ---- standalone kernels ----------------------------------------------------------------------
def _conv_bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


def _fused_weight_kernels(model: nn.Module, x: torch.Tensor) -> int:
    """The step's "fused_weight" kernels (a block group's once per block)."""
    profile = profile_model(model, x, warn=False)
    return sum(r.count * (len(g.blocks) if g.where == "blocks" else 1)
               for g in profile.op_groups for r in g.ops if r.kind == "fused_weight")


def test_batch_norm_in_training_updates_its_buffers_in_kernels_of_their_own():
    """Training, each BatchNorm updates its running statistics and its num_batches_tracked: compiled, kernels
    apart from the fused chains; in eval it updates nothing."""
    x = torch.randn(2, 3, 8, 8)
    train = _fused_weight_kernels(_conv_bn().train(), x)
    evaluated = _fused_weight_kernels(_conv_bn().eval(), x)
    batch_norms = 2
    assert train - evaluated >= batch_norms


# ---- the loss's fp32 outputs -----------------------------------------------------------------
def _loss_group(precision: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    # mean is on no autocast list: any cast before it is the trace's fp32 output, not autocast's
    profile = profile_model(model, torch.randn(4, 16), loss_fn=lambda out, sample: out.mean(),
                            precision=precision, warn=False)
    return next(g for g in profile.op_groups if g.where == "loss")


def test_a_bf16_trace_casts_the_model_s_outputs_to_fp32_in_the_loss():
    """Under bf16 autocast the Linear returns bf16; the trace casts it to fp32 as autopar's wrap does, in the
    loss's scope: a forward copy of a bf16 tensor there, and the loss's mean in fp32. fp32: no cast."""
    bf16 = _loss_group("bf16")
    casts = [r for r in bf16.ops if r.kind == "copy" and not r.backward]
    assert casts and all(r.dtype == "bfloat16" for r in casts)
    assert [r.dtype for r in bf16.ops if r.kind == "reduction" and not r.backward] == ["float32"]
    fp32 = _loss_group("fp32")
    assert not [r for r in fp32.ops if r.kind == "copy"]
