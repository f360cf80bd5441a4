"""autopar.cost.time on tiny traced models: the rules of the compute term that the fits do not cover."""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.cost import Calibration, predict_profile
from autopar.cost.time import _group_bandwidth
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.plans import Plan
from autopar.profile import profile_model

# A head that dominates the FLOPs: a vocabulary of about 1000 over hidden 32, two thin blocks.
ALIGNED, MISALIGNED = 1008, 1001  # 1008 = 126 x 8; 1001 is not a multiple of 8 (0.7% fewer FLOPs)


@functools.lru_cache(maxsize=None)
def _traced(vocab: int):
    """The fp32 profile and the bf16 trace a single-GPU bf16 plan reads (autopar.planning.profile_variants
    without its "bf16-pure" trace, which only FSDP plans read: two traces fewer keep the test quick)."""
    cfg = GPTConfig(vocab_size=vocab, seq_len=64, num_layers=2, hidden_dim=32, num_heads=2)
    torch.manual_seed(0)
    model, sample = GPT(cfg), torch.randint(0, vocab, (1, 64))
    return (profile_model(model, sample, loss_fn=lm_loss),
            {"bf16": profile_model(model, sample, loss_fn=lm_loss, precision="bf16")})


def _compute_s(vocab: int, compile: bool, cal: Calibration) -> float:
    profile, variants = _traced(vocab)
    plan = Plan(micro_batch_size=8, precision="bf16", compile=compile)
    return predict_profile(profile, plan, autopar.Topology.from_spec("1xH200"), cal, variants=variants).time.compute_s


def test_eager_bf16_gemm_with_a_dimension_not_a_multiple_of_8_runs_at_the_misaligned_factor_compiled_does_not():
    cal = Calibration()
    assert cal.misaligned_gemm_factor < 0.5
    eager = {v: _compute_s(v, False, cal) for v in (ALIGNED, MISALIGNED)}
    compiled = {v: _compute_s(v, True, cal) for v in (ALIGNED, MISALIGNED)}
    # eager: cuBLAS's unaligned kernels on the head, though the head has fewer FLOPs
    assert eager[MISALIGNED] > 1.2 * eager[ALIGNED]
    # compiled: inductor pads; the head differs by its 0.7% of FLOPs only
    assert compiled[MISALIGNED] == pytest.approx(compiled[ALIGNED], rel=0.02)
    assert compiled[MISALIGNED] < eager[MISALIGNED]
    # with no penalty, eager plans of the two vocabularies cost the same as well
    flat = Calibration(misaligned_gemm_factor=1.0)
    assert _compute_s(MISALIGNED, False, flat) == pytest.approx(_compute_s(ALIGNED, False, flat), rel=0.02)
    assert _compute_s(ALIGNED, False, flat) == pytest.approx(eager[ALIGNED], rel=1e-9)  # aligned: never slowed


def test_a_collective_across_nodes_gets_the_cards_of_its_fewest_members_on_a_node_and_a_send_one():
    """NCCL runs a ring through each member GPU's own network card (NVIDIA/nccl issue 812): a group with 8
    ranks on each node gets 8 cards, a group of one GPU a node one, a group split 8 + 4 over two nodes 4 (the
    node with fewer cards holds the ring back); a pipeline's point-to-point send uses one card."""
    cal = Calibration()
    two = autopar.Topology.from_spec("2x8xH100-SXM", inter_node_gbps=400)  # 50 GB/s a card
    card, nvlink = two.inter_node_bytes_per_s * cal.network_efficiency, two.device.intra_node_bytes_per_s * cal.comm_efficiency
    assert _group_bandwidth(two, 8, 1, cal) == nvlink  # inside a node
    assert _group_bandwidth(two, 16, 1, cal) == pytest.approx(min(nvlink, 8 * card))  # FSDP over both nodes
    assert _group_bandwidth(two, 2, 8, cal) == pytest.approx(card)  # HSDP replicas: one GPU a node
    assert _group_bandwidth(two, 4, 4, cal) == pytest.approx(2 * card)  # 2 members a node
    assert _group_bandwidth(two, 4, 4, cal, rings=False) == pytest.approx(card)  # a pipeline's sends
    three = autopar.Topology.from_spec("3x8xH100-SXM", inter_node_gbps=400)
    assert _group_bandwidth(three, 12, 1, cal) == pytest.approx(4 * card)  # 8 on one node, 4 on the next


def test_frozen_parameters_reduce_no_gradients_and_take_no_optimizer_step():
    """A model with most weights frozen (LoRA-like): the optimizer and the gradient reduce-scatter run over the
    trainable parameters only; the all-gather of the weights still moves all of them."""
    cfg = GPTConfig(vocab_size=256, seq_len=32, num_layers=2, hidden_dim=64, num_heads=2)
    torch.manual_seed(0)
    model, sample = GPT(cfg), torch.randint(0, 256, (1, 32))
    full = profile_model(model, sample, loss_fn=lm_loss, warn=False)
    for name, p in model.named_parameters():
        p.requires_grad_("ln" in name)  # the norms alone train
    frozen = profile_model(model, sample, loss_fn=lm_loss, warn=False)
    assert frozen.num_trainable_params < full.num_params / 20
    topo, cal = autopar.Topology.from_spec("1xH200"), Calibration()
    plan = Plan(micro_batch_size=1, precision="bf16")
    ratio = predict_profile(frozen, plan, topo, cal).time.optimizer_s / predict_profile(full, plan, topo, cal).time.optimizer_s
    assert ratio == pytest.approx(frozen.num_trainable_params / full.num_params, rel=1e-6)
