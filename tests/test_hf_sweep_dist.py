"""bench hf-sweep-dist: an architecture wrapped with a multi-rank plan on gloo processes against one plain process,
the comparison's bounds, and the report's reading of the statuses."""

from __future__ import annotations

import json

import torch

from bench import hf_sweep_dist


def test_an_architecture_under_fsdp_on_two_processes_trains_as_one_process():
    rec = hf_sweep_dist.launch("causal-lm", "llama", "fsdp", 2, timeout_s=240)
    assert rec["status"] == "ok", rec
    assert rec["world_size"] == 2 and rec["loss_rel"] <= 1e-5 and rec["params_rel"] <= 1e-5
    assert rec["worst_grad_over_bound"] <= 1.0
    assert len(rec["losses"]) == len(rec["ref_losses"]) == hf_sweep_dist.STEPS


def test_the_comparison_holds_a_run_to_1e_5_or_to_ten_times_the_reordering_s_own_difference():
    """A gradient tensor, the losses and the parameters are within 1e-5 of the reference, or within 10x what one
    process computing the same batch in shares differs by (a noise gradient, as a key bias's, is judged by that, or
    by its elements' share of 1e-5 of the whole gradient)."""
    f64 = torch.float64
    params = {"a": torch.ones(4, dtype=f64), "b": torch.full((2,), 2.0, dtype=f64)}
    grads = {"a": torch.full((4,), 3.0, dtype=f64), "noise": torch.full((2,), 1e-9, dtype=f64)}
    ref = hf_sweep_dist.Run([1.0, 0.9], grads, params)
    reordered = hf_sweep_dist.Run([1.0, 0.9], {**grads, "noise": -grads["noise"]}, params)

    def compare(losses=(1.0, 0.9), g=None, p=None):
        return hf_sweep_dist._compare(hf_sweep_dist.Run(list(losses), {**grads, **(g or {})}, {**params, **(p or {})}),
                                      ref, reordered)

    same = compare()
    assert same["same"] and same["loss_rel"] == 0 and same["worst_grad_over_bound"] == 0
    assert not compare(losses=(1.0, 0.9001))["same"]
    grad_off = compare(g={"a": grads["a"] * 1.001})
    assert not grad_off["same"] and grad_off["worst_grad"] == "a"
    assert compare(g={"noise": grads["noise"] * 5})["same"]  # within 10x the reordering's difference (2e-9 there)
    # and within its 2 of 6 elements' share of 1e-5 of the whole gradient (|whole| 6: 3.5e-5), not beyond
    assert compare(g={"noise": torch.full((2,), 2e-5, dtype=f64)})["same"]
    assert not compare(g={"noise": torch.full((2,), 1e-4, dtype=f64)})["same"]
    assert not compare(p={"b": params["b"] * 1.01})["same"]
    renamed = hf_sweep_dist._compare(hf_sweep_dist.Run([1.0, 0.9], grads, {"a": params["a"]}), ref, reordered)
    assert not renamed["same"] and "differ under autopar" in renamed["why"]


def test_the_report_counts_statuses_per_plan_and_lists_what_is_autopars(tmp_path):
    head = {"date": "2026-12-06T00:00:00", "device": "cpu", "torch": "t", "transformers": "x", "command": "c",
            "commit": "abcdef0", "world_size": 2}
    rows = [
        {"task": "causal-lm", "arch": "a", "plan_kind": "fsdp", "status": "ok"},
        {"task": "causal-lm", "arch": "b", "plan_kind": "fsdp", "status": "mismatch", "loss_rel": 0.01,
         "reordered_loss_rel": 1e-7, "params_rel": 0.02, "reordered_params_rel": 2e-7, "worst_grad": "w",
         "worst_grad_over_bound": 50.0},
        {"task": "causal-lm", "arch": "a", "plan_kind": "tp", "status": "refused", "stage": "wrap",
         "error": "PlanError: 3 heads do not split over 2 ranks"},
        {"task": "vision", "arch": "c", "plan_kind": "tp", "status": "model_failed", "error": "x"},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({**r, **head}) + "\n" for r in rows))
    text = hf_sweep_dist.report(str(path))
    assert "| fsdp | 1 | 0 | 1 | 0 | 0 | 0 | 0 | 0 |" in text
    assert "| tp | 0 | 1 | 0 | 0 | 0 | 0 | 0 | 1 |" in text
    assert ("| causal-lm | b | fsdp | mismatch | loss rel 1.0e-02 (reordered 1.0e-07), params rel 2.0e-02 (reordered "
            "2.0e-07), worst gradient w 50.0x its bound |") in text
    assert "| causal-lm | a | tp | refused | wrap PlanError: 3 heads do not split over 2 ranks |" in text
    assert "| vision | c |" not in text


def test_the_report_shows_the_trials_statuses_where_there_are_some(tmp_path):
    head = {"date": "2026-12-06T00:00:00", "device": "cpu", "torch": "t", "transformers": "x", "command": "c",
            "commit": "abcdef0", "world_size": 2}
    rows = [{"task": "causal-lm", "arch": "a", "plan_kind": "tp", "status": "trial_passed"},
            {"task": "causal-lm", "arch": "b", "plan_kind": "tp", "status": "trial_refused",
             "error": "its first forward and backward raised RuntimeError: shape"}]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({**r, **head}) + "\n" for r in rows))
    text = hf_sweep_dist.report(str(path))
    assert "| trial_passed | trial_refused |" in text and "| tp | 0 | 0 | 0 | 0 | 0 | 0 | 1 | 1 | 0 | 0 |" in text
    assert "| causal-lm | b | tp | trial_refused | its first forward and backward raised RuntimeError: shape |" in text
