"""Tests of autopar.strategies.pipeline in one process (no process group): how the blocks are split into stages
(contiguous, non-empty, covering every block once, minimising the costliest stage), which stages a rank runs
(single, loop, V), the refusals of `check_pipeline`, and `apply_pipeline_split` itself: what a rank keeps, what
becomes a pass-through or a placeholder, names kept, a tied weight copied per stage.

Running the schedules on several processes is covered by tests/distributed/test_parallel_parity.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn as nn

from autopar.errors import PlanError
from autopar.models.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from autopar.plans import Plan
from autopar.profile import profile_model
from autopar.strategies.pipeline import (_PassThrough, _Placeholder, _placeholder_for, _PlaceholderAfter,
                                         apply_pipeline_split, block_costs, check_pipeline, split_stages, stage_ids)
from tests._training import CFG, batch, make_model

TIED = ("tok_emb.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def gpt_profile():
    return profile_model(make_model("gpt"), batch(0), loss_fn=lm_loss, warn=False)


@pytest.fixture(scope="module")
def big_head_profile():
    """A GPT whose output head (vocab 8192 x hidden 32, untied) costs more than all its blocks together."""
    cfg = GPTConfig(vocab_size=8192, seq_len=16, num_layers=4, hidden_dim=32, num_heads=4, tie_embeddings=False)
    torch.manual_seed(0)
    return profile_model(GPT(cfg), synthetic_tokens(2, cfg), loss_fn=lm_loss, warn=False)


def _with_blocks(profile, scale):
    """The profile with len(scale) blocks, block i costing scale[i] times the GPT block's FLOPs and activations."""
    b0 = profile.blocks[0]
    blocks = tuple(dataclasses.replace(b0, name=f"blocks.{i}", flops=b0.flops * s, forward_flops=b0.forward_flops * s,
                                       saved_bytes=int(b0.saved_bytes * s)) for i, s in enumerate(scale))
    outside_flops = profile.flops - sum(b.flops for b in profile.blocks)
    outside_params = profile.param_bytes - sum(b.param_bytes for b in profile.blocks)
    return dataclasses.replace(profile, blocks=blocks, flops=sum(b.flops for b in blocks) + outside_flops,
                               param_bytes=outside_params + sum(b.param_bytes for b in blocks))


@pytest.fixture(scope="module")
def uneven_profile(gpt_profile):
    """Six blocks of unequal cost (FLOPs and bytes), on the GPT's profile."""
    return _with_blocks(gpt_profile, [1.0, 3.0, 0.5, 2.0, 2.0, 0.25])


def _max_cost(profile, stages) -> float:
    costs, first, last = block_costs(profile)
    n = len(stages)
    return max(sum(costs[i] for i in s) + (first if k == 0 else 0.0) + (last if k == n - 1 else 0.0)
               for k, s in enumerate(stages))


def _brute_force_best(profile, n: int) -> float:
    blocks = len(profile.blocks)
    best = float("inf")
    for cuts in itertools.combinations(range(1, blocks), n - 1):
        bounds = (0, *cuts, blocks)
        stages = [tuple(range(bounds[k], bounds[k + 1])) for k in range(n)]
        best = min(best, _max_cost(profile, stages))
    return best


# ---- split_stages -------------------------------------------------------------------------------------
def test_equal_blocks_split_evenly(gpt_profile):
    assert len(set(block_costs(gpt_profile)[0])) == 1  # the GPT's blocks cost the same
    assert split_stages(gpt_profile, 1) == ((0, 1, 2, 3),)
    assert split_stages(gpt_profile, 2) == ((0, 1), (2, 3))
    assert split_stages(gpt_profile, 4) == ((0,), (1,), (2,), (3,))


def test_a_costly_head_leaves_the_last_stage_fewer_blocks(big_head_profile):
    costs, first, last = block_costs(big_head_profile)
    assert last > costs[0]  # the head and loss weigh more than a block
    split = split_stages(big_head_profile, 2)
    assert split == ((0, 1, 2), (3,))
    assert len(split[-1]) < len(split[0])


@pytest.mark.parametrize("which", ["gpt_profile", "big_head_profile", "uneven_profile"])
def test_stages_are_contiguous_cover_every_block_once_and_are_optimal(which, request):
    profile = request.getfixturevalue(which)
    n_blocks = len(profile.blocks)
    for n in range(1, n_blocks + 1):
        stages = split_stages(profile, n)
        assert len(stages) == n
        assert all(len(s) > 0 for s in stages)
        assert all(s == tuple(range(s[0], s[-1] + 1)) for s in stages)  # contiguous
        assert [i for s in stages for i in s] == list(range(n_blocks))  # every block once, in order
        assert _max_cost(profile, stages) == pytest.approx(_brute_force_best(profile, n), rel=1e-12)


def test_a_costly_block_gets_a_stage_of_its_own(gpt_profile):
    assert split_stages(_with_blocks(gpt_profile, [20, 1, 1, 1, 1, 1]), 2) == ((0,), (1, 2, 3, 4, 5))
    assert split_stages(_with_blocks(gpt_profile, [1, 1, 1, 1, 1, 20]), 2) == ((0, 1, 2, 3, 4), (5,))
    assert split_stages(_with_blocks(gpt_profile, [1, 1, 20, 1, 1, 1]), 3) == ((0, 1), (2,), (3, 4, 5))


def test_more_stages_than_blocks(gpt_profile):
    with pytest.raises(PlanError, match="5 pipeline stages but GPT has 4 blocks") as info:
        split_stages(gpt_profile, 5)
    assert "<= 4" in str(info.value)


def test_block_costs(gpt_profile, big_head_profile):
    for profile in (gpt_profile, big_head_profile):
        costs, first, last = block_costs(profile)
        # shares of FLOPs plus shares of memory: each sums to one over the blocks, the first and the last stage
        assert sum(costs) + first + last == pytest.approx(2.0, rel=1e-9)
        blocks_mem = sum(b.param_bytes + b.saved_bytes for b in profile.blocks)
        outside_mem = (profile.param_bytes - sum(b.param_bytes for b in profile.blocks)
                       + profile.saved_bytes_outside_blocks)
        total_mem = blocks_mem + outside_mem
        assert first == pytest.approx(0.5 * outside_mem / total_mem)
        outside_flops = profile.flops - sum(b.flops for b in profile.blocks)
        assert outside_flops > 0
        assert last == pytest.approx(outside_flops / profile.flops + first)
        b = profile.blocks[0]
        assert costs[0] == pytest.approx(b.flops / profile.flops + (b.param_bytes + b.saved_bytes) / total_mem)


# ---- stage_ids ----------------------------------------------------------------------------------------
def _all_stages(plan: Plan) -> list[int]:
    return sorted(s for r in range(plan.pp) for s in stage_ids(plan, r))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_per_rank(schedule):
    plan = Plan(pp=4, pp_schedule=schedule, grad_accum=4)
    assert [stage_ids(plan, r) for r in range(4)] == [(0,), (1,), (2,), (3,)]


def test_interleaved_loop():
    plan = Plan(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, grad_accum=2)
    assert [stage_ids(plan, r) for r in range(2)] == [(0, 2), (1, 3)]
    plan = Plan(pp=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=3, grad_accum=4)
    assert [stage_ids(plan, r) for r in range(4)] == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]
    assert _all_stages(plan) == list(range(12))


@pytest.mark.parametrize("pp", [2, 4])
def test_zero_bubble_v(pp):
    plan = Plan(pp=pp, pp_schedule="zero_bubble", pp_stages_per_rank=2, grad_accum=pp)
    assert [stage_ids(plan, r) for r in range(pp)] == [(r, 2 * pp - 1 - r) for r in range(pp)]
    assert _all_stages(plan) == list(range(2 * pp))
    assert stage_ids(plan, 0) == (0, 2 * pp - 1)  # rank 0 holds the first and the last stage


def test_zero_bubble_with_more_stages_loops():
    plan = Plan(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=3, grad_accum=2)
    assert [stage_ids(plan, r) for r in range(2)] == [(0, 2, 4), (1, 3, 5)]


# ---- check_pipeline -----------------------------------------------------------------------------------
def test_1f1b_needs_as_many_micro_batches_as_ranks(gpt_profile):
    with pytest.raises(PlanError, match=r"grad_accum=1 < pp=2") as info:
        check_pipeline(Plan(pp=2, pp_schedule="1f1b", grad_accum=1), gpt_profile)
    assert "1f1b" in str(info.value) and "gpipe" in str(info.value)
    check_pipeline(Plan(pp=2, pp_schedule="1f1b", grad_accum=2), gpt_profile)
    check_pipeline(Plan(pp=2, pp_schedule="1f1b", grad_accum=3), gpt_profile)


def test_interleaved_needs_micro_batches_divisible_by_pp(gpt_profile):
    plan = Plan(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, grad_accum=3)
    with pytest.raises(PlanError, match=r"divisible by pp=2; grad_accum=3 is not"):
        check_pipeline(plan, gpt_profile)
    check_pipeline(plan.replace(grad_accum=4), gpt_profile)
    with pytest.raises(PlanError, match=r"grad_accum=1 < pp=2"):
        check_pipeline(plan.replace(grad_accum=1), gpt_profile)


@pytest.mark.parametrize("accum", [1, 2, 3, 5])
def test_gpipe_takes_any_number_of_micro_batches(gpt_profile, accum):
    assert check_pipeline(Plan(pp=2, pp_schedule="gpipe", grad_accum=accum), gpt_profile) is None


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"dp_replicate": 2}, {"tp": 2}])
def test_check_pipeline_refuses_zero_bubble_beside_data_or_tensor_parallelism(gpt_profile, parallel):
    """torch's pipelining loses FSDP2's parameters between the two halves of a zero-bubble backward (a KeyError
    in stage_backward_weight on every rank: bench/multigpu.py on 4 gloo ranks), so autopar refuses it in one line,
    before anything changes; pipeline parallelism alone runs it (test_zero_bubble_v)."""
    zb = Plan(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=2, grad_accum=2)
    with pytest.raises(PlanError, match="interleaved_1f1b") as err:
        check_pipeline(zb.replace(**parallel), gpt_profile)
    assert "\n" not in str(err.value)
    check_pipeline(zb, gpt_profile)
    check_pipeline(zb.replace(pp_schedule="interleaved_1f1b", **parallel), gpt_profile)


def test_check_pipeline_refuses_too_many_stages_and_untraced_profiles(gpt_profile):
    with pytest.raises(PlanError, match="8 pipeline stages but GPT has 4 blocks"):
        check_pipeline(Plan(pp=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, grad_accum=4), gpt_profile)
    untraced = profile_model(make_model("gpt"), batch(0), warn=False, trace=False)
    with pytest.raises(PlanError, match="needs a traced profile"):
        check_pipeline(Plan(pp=2, pp_schedule="gpipe"), untraced)
    check_pipeline(Plan(), untraced)  # pp=1: nothing to check


# ---- apply_pipeline_split -----------------------------------------------------------------------------
def _split(plan: Plan, profile, rank: int):
    original = make_model("gpt")
    model = make_model("gpt")
    runtime = apply_pipeline_split(model, plan, profile, rank)
    return original, model, runtime


PLAN_1F1B = Plan(pp=2, pp_schedule="1f1b", micro_batch_size=4, grad_accum=2)


def test_first_rank_keeps_its_blocks_and_the_embeddings(gpt_profile):
    original, model, rt = _split(PLAN_1F1B, gpt_profile, 0)
    assert (rt.num_stages, rt.stage_blocks) == (2, {0: (0, 1)})
    assert rt.block_names == tuple(f"blocks.{i}" for i in range(4))
    assert [type(b) for b in model.blocks] == [type(original.blocks[0])] * 2 + [_PassThrough] * 2
    assert isinstance(model.tok_emb, nn.Embedding) and isinstance(model.pos_emb, nn.Embedding)
    assert isinstance(model.ln_f, _PlaceholderAfter) and isinstance(model.lm_head, _PlaceholderAfter)
    names = {n for n, _ in model.named_parameters()}
    assert names == {n for n, _ in original.named_parameters()
                     if n.startswith(("blocks.0.", "blocks.1.", "tok_emb.", "pos_emb."))}
    before = dict(original.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert rt.tied_groups == [TIED]
    with pytest.raises(RuntimeError, match="ran past its last block"):  # the stage would have exited after block 1
        model(batch(0)[:2])


def test_last_rank_keeps_its_blocks_and_the_head(gpt_profile):
    original, model, rt = _split(PLAN_1F1B, gpt_profile, 1)
    assert rt.stage_blocks == {1: (2, 3)}
    assert [type(b) for b in model.blocks] == [_PassThrough] * 2 + [type(original.blocks[0])] * 2
    assert isinstance(model.tok_emb, _Placeholder) and isinstance(model.pos_emb, _Placeholder)
    assert isinstance(model.ln_f, nn.LayerNorm) and isinstance(model.lm_head, nn.Linear)
    names = {n for n, _ in model.named_parameters()}
    assert names == {n for n, _ in original.named_parameters(remove_duplicate=False)
                     if n.startswith(("blocks.2.", "blocks.3.", "ln_f.", "lm_head."))}
    before = dict(original.named_parameters(remove_duplicate=False))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert rt.tied_groups == [TIED]
    # Its forward: placeholders give zeros, blocks 0-1 pass them through, blocks 2-3 and the head compute.
    x = batch(0)[:2]
    with torch.no_grad():
        h = torch.zeros(2, CFG.seq_len, CFG.hidden_dim)
        expected = original.lm_head(original.ln_f(original.blocks[3](original.blocks[2](h))))
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_tied_weight_gets_a_copy_per_stage(gpt_profile):
    # 1F1B: the embedding lives on rank 0, the head on rank 1, each with the weight's value.
    _, first, _ = _split(PLAN_1F1B, gpt_profile, 0)
    _, last, _ = _split(PLAN_1F1B, gpt_profile, 1)
    assert torch.equal(first.tok_emb.weight, last.lm_head.weight)
    # V schedule: rank 0 runs the first and the last stage, so it holds both modules: two separate Parameters.
    plan = Plan(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=2, micro_batch_size=4, grad_accum=2)
    original, model, rt = _split(plan, gpt_profile, 0)
    assert rt.stage_blocks == {0: (0,), 3: (3,)}
    assert [type(b).__name__ for b in model.blocks] == ["Block", "_PassThrough", "_PassThrough", "Block"]
    assert rt.tied_groups == [TIED]
    emb, head = model.tok_emb.weight, model.lm_head.weight
    assert isinstance(emb, nn.Parameter) and isinstance(head, nn.Parameter)
    assert emb is not head and emb.data_ptr() != head.data_ptr()
    assert torch.equal(emb, head) and torch.equal(emb, original.tok_emb.weight)
    assert emb.requires_grad and head.requires_grad
    assert {n for n, _ in model.named_parameters()} >= set(TIED)
    # rank 1 of the V runs the middle stages: nothing before or after the blocks
    _, middle, rt1 = _split(plan, gpt_profile, 1)
    assert rt1.stage_blocks == {1: (1,), 2: (2,)}
    assert isinstance(middle.tok_emb, _Placeholder) and isinstance(middle.lm_head, _PlaceholderAfter)


class _RootParamNet(nn.Module):
    """A ViT-like model: a parameter held by the root module itself (a learned position embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4, 8))
        self.inp = nn.Linear(3, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def test_a_parameter_on_the_root_module_is_not_replaced_by_a_child_named_empty():
    model = _RootParamNet()
    profile = profile_model(model, torch.randn(2, 4, 3), warn=False)
    apply_pipeline_split(model, Plan(pp=2, pp_schedule="gpipe"), profile, 1)
    assert "" not in dict(model.named_children())
    assert dict(model.named_modules())[""] is model


# ---- the stand-ins ------------------------------------------------------------------------------------
def test_pass_through_returns_its_input():
    x, mask = torch.randn(2, 3, 4), torch.ones(2, 3)
    assert _PassThrough(0, "arg0")(x, mask) is x
    out = _PassThrough(3, "arg0")(x, attention_mask=mask)
    assert isinstance(out, tuple) and len(out) == 3 and out[0] is x and out[1:] == (None, None)
    assert _PassThrough(0, "kwarg:hidden_states")(None, hidden_states=x) is x
    out = _PassThrough(1, "kwarg:hidden_states")(hidden_states=x)
    assert isinstance(out, tuple) and len(out) == 1 and out[0] is x
    assert list(_PassThrough(0, "arg0").parameters()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placeholder_for_an_embedding_gives_zeros_of_its_output_shape(dtype):
    emb = nn.Embedding(10, 6).to(dtype)
    placeholder = _placeholder_for(emb)
    assert isinstance(placeholder, _Placeholder) and list(placeholder.parameters()) == []
    ids = torch.randint(0, 10, (2, 5))
    out = placeholder(ids)
    assert out.shape == emb(ids).shape == (2, 5, 6) and out.dtype == dtype
    assert torch.count_nonzero(out) == 0
    assert placeholder(torch.arange(7)).shape == (7, 6)  # positions: 1-D ids


def test_a_stand_in_read_outside_its_call_says_in_one_line_that_the_model_does_not_split():
    """A forward that reads a weight of a module before the blocks after them (`h @ self.tok.weight.t()`), or calls
    a child of it directly (`self.embed.patch(x)`), reads a stand-in on the other stages: one line saying so, and
    what to change, not "'_Placeholder' object has no attribute 'weight'"."""
    import copy

    from autopar.strategies.pipeline import _PlaceholderAfter

    stand_in = _placeholder_for(nn.Embedding(10, 6), "tok")
    with pytest.raises(AttributeError) as info:
        stand_in.weight
    text = str(info.value)
    assert "does not hold tok (it runs before the blocks, on the first stage)" in text and "'weight'" in text
    assert text.endswith("pass a plan with pp=1") and "\n" not in text
    with pytest.raises(AttributeError, match=r"does not hold head \(it runs after the blocks, on the last stage\)"):
        _PlaceholderAfter("head").proj
    assert copy.deepcopy(stand_in).stands_for == "tok" and not hasattr(stand_in, "__something__")


def test_placeholder_for_other_modules():
    x = torch.randn(2, 5, 3)
    out = _placeholder_for(nn.Linear(3, 7))(x)
    assert out.shape == (2, 5, 7) and torch.count_nonzero(out) == 0
    assert _placeholder_for(nn.LayerNorm(3))(x) is x
