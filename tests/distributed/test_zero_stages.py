"""ZeRO stages 2 and 1 under FSDP2 (and HSDP's once-a-step all-reduce) (Plan.zero_stage; autopar.train_step runs them) against one process, on 2 and
4 gloo processes: 10 AdamW steps of the built-in GPT and of a tiny Hugging Face Llama, compared as
tests/distributed/test_parallel_parity.py compares (the first step's gradients and every loss within 1e-5,
fp32; the final parameters within 1e-5 together, 1e-3 each). And the schedule itself: a block's parameters are
gathered once a step and stay whole across its micro-batches (stages 2 and 1), where stage 3 gathers them
again for every micro-batch."""

from __future__ import annotations

import pytest

from tests._training import reference
from tests.distributed._parity import assert_trains_as_one_process, run_world_sizes

pytestmark = pytest.mark.slow

NOT_RESHARDED = {"reshard_after_forward": False}


def _zero(stage: int, **degrees) -> dict:
    return {"train_step": True, "watch_gathers": "blocks.0", "count_reduce_scatters": True,
            "plan": {**degrees, **NOT_RESHARDED, "zero_stage": stage}}


SCENARIOS = {
    2: {
        "gpt-zero2": _zero(2, dp_shard=2, micro_batch_size=2, grad_accum=2),
        "gpt-zero1": _zero(1, dp_shard=2, micro_batch_size=1, grad_accum=4),
        "llama-zero1": {**_zero(1, dp_shard=2, micro_batch_size=2, grad_accum=2), "model": "llama",
                        "watch_gathers": "model.layers.0"},
        "gpt-zero3-watched": _zero(3, dp_shard=2, micro_batch_size=2, grad_accum=2),  # the schedule it replaces
    },
    4: {
        "gpt-zero2-ws4": _zero(2, dp_shard=4, micro_batch_size=1, grad_accum=2),
        "gpt-hsdp-zero1": _zero(1, dp_replicate=2, dp_shard=2, micro_batch_size=1, grad_accum=2),
        # HSDP all-reduces across replicas after the last micro-batch only (set_requires_all_reduce), every stage
        "gpt-hsdp-zero2": _zero(2, dp_replicate=2, dp_shard=2, micro_batch_size=1, grad_accum=2),
        "gpt-hsdp-zero3": _zero(3, dp_replicate=2, dp_shard=2, micro_batch_size=1, grad_accum=2),
        "llama-zero2-x-tp": {**_zero(2, dp_shard=2, tp=2, micro_batch_size=2, grad_accum=2), "model": "llama",
                             "watch_gathers": "model.layers.0"},
    },
}
CASES = [(ws, name) for ws, scenarios in SCENARIOS.items() for name in scenarios]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world_sizes(SCENARIOS, tmp_path_factory)


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind=kind, grads=True) for kind in ("gpt", "llama")}


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


@pytest.mark.parametrize("world_size,name", CASES, ids=[f"ws{w}-{n}" for w, n in CASES])
def test_zero_stages_train_as_one_process(results, references, world_size, name):
    assert_trains_as_one_process(results[world_size][name], *references[SCENARIOS[world_size][name].get("model", "gpt")])


@pytest.mark.parametrize("world_size,name", CASES, ids=[f"ws{w}-{n}" for w, n in CASES])
def test_parameters_are_gathered_once_a_step_under_stages_2_and_1(results, world_size, name):
    spec = SCENARIOS[world_size][name]
    plan = spec["plan"]
    seen = _ok(results[world_size][name])["gathered_at_start"]
    accum = plan["grad_accum"]
    assert len(seen) == 10 * accum  # one forward per micro-batch, 10 steps
    for step in range(10):
        micro = seen[step * accum:(step + 1) * accum]
        assert micro[0] is False, f"step {step}: the first micro-batch starts from the shards"
        # stage 3 reshards after every backward; stages 2 and 1 keep the parameters whole until the last one
        assert micro[1:] == [plan["zero_stage"] < 3] * (accum - 1), (step, micro)


def test_stage_1_reduces_gradients_once_a_step_the_others_every_micro_batch(results):
    # the GPT scenarios on 2 ranks share a model, so the same FSDP units: reduce-scatters a step / (1 under stage 1,
    # else the micro-batches) is that number of units in each
    units = set()
    for name in ("gpt-zero2", "gpt-zero1", "gpt-zero3-watched"):
        plan = SCENARIOS[2][name]["plan"]
        calls = _ok(results[2][name])["reduce_scatters"]
        per_step, rest = divmod(calls, 10)
        assert rest == 0, (name, calls)
        units.add(per_step / (1 if plan["zero_stage"] == 1 else plan["grad_accum"]))
    assert len(units) == 1 and units.pop() >= 1, units
