"""What the multi-process parity tests share: launching every world size's scenarios, and the comparison with
one plain process (tests/distributed/test_parallel_parity.py says why these bounds)."""

from __future__ import annotations

import torch

from tests.distributed._launch import run_scenarios


def run_world_sizes(scenarios: dict[int, dict[str, dict]], tmp_path_factory) -> dict[int, dict]:
    """{world size: {scenario name: result}}: one torchrun launch per world size."""
    out = {}
    for world_size, named in scenarios.items():
        specs = [{"name": name, **spec} for name, spec in named.items()]
        out[world_size] = run_scenarios(specs, world_size, tmp_path_factory.mktemp(f"ws{world_size}"))
    return out


def global_rel(params: dict, ref: dict) -> float:
    """||params - ref|| / ||ref|| over all the tensors together."""
    num = sum(((params[n] - ref[n]) ** 2).sum() for n in ref)
    return (num / sum((ref[n] ** 2).sum() for n in ref)).sqrt().item()


def assert_trains_as_one_process(result: dict, ref_losses: list, ref_params: dict, ref_grads: dict) -> None:
    """The first step's gradients (every tensor) and every loss within 1e-5; the final parameters within 1e-5
    together and 1e-3 each (fp32)."""
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert set(result["params"]) == set(ref_params), "parameter names changed under autopar"
    assert set(result["grads"]) == set(ref_grads)
    for n, g_ref in ref_grads.items():
        err = (result["grads"][n] - g_ref).norm().item()
        assert err <= 1e-5 * g_ref.norm().item() + 1e-9, f"gradient of {n}: error {err:.2e} (norm {g_ref.norm():.2e})"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert global_rel(result["params"], ref_params) <= 1e-5
    for n, p_ref in ref_params.items():
        err = ((result["params"][n] - p_ref).norm() / p_ref.norm()).item()
        assert err <= 1e-3, f"{n}: relative error {err:.2e}"
