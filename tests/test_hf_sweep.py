"""bench hf-sweep: one architecture measured in-process, and the report's reading of the statuses."""

from __future__ import annotations

import json

from bench import hf_sweep


def test_an_architecture_autopar_handles_is_ok_with_both_plans_and_wrap_s_first_loss_the_models_own():
    rec = hf_sweep.measure("causal-lm", "llama")
    assert rec["status"] == "ok", rec
    assert all(rec[t]["ok"] and rec[t]["plan"] for t in hf_sweep.TOPOLOGIES)
    wrap = rec["wrap"]
    assert wrap["ok"] and wrap["same_first_loss"]
    assert abs(wrap["losses"][0] - wrap["own_loss"]) <= 1e-4 * max(1.0, abs(wrap["own_loss"]))
    assert wrap["losses"][1] < wrap["losses"][0]  # it trained


def test_a_model_whose_own_step_fails_is_not_counted_as_autopars(monkeypatch):
    import torch

    class Broken(torch.nn.Module):
        config = type("Config", (), {"vocab_size": 16})()

        def forward(self, **batch):
            raise RuntimeError("the model's own bug")

    monkeypatch.setattr(hf_sweep, "build", lambda task, arch, size="small": Broken())
    rec = hf_sweep.measure("causal-lm", "broken")
    assert rec["status"] == "model_failed" and "the model's own bug" in rec["error"]


def _report(tmp_path, head: dict, rows: list[dict]) -> str:
    """hf_sweep.report of a results file holding `rows`, each stamped with `head`."""
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps({**r, **head}) + "\n" for r in rows))
    return hf_sweep.report(str(path))


def test_the_report_counts_statuses_per_task_and_lists_what_autopar_did_not_do(tmp_path):
    head = {"date": "2026-12-06T00:00:00", "device": "cpu", "torch": "t", "transformers": "x", "command": "c",
            "commit": "abcdef0"}
    ok = {"ok": True, "s": 0.5, "plan": "1gpu"}
    rows = [
        {"task": "causal-lm", "arch": "a", "status": "ok", "1xH200": ok, "8xH100-SXM": ok,
         "wrap": {"ok": True, "s": 0.1, "own_loss": 1.0, "losses": [1.0, 0.9], "same_first_loss": True}},
        {"task": "causal-lm", "arch": "b", "status": "mismatch", "1xH200": ok, "8xH100-SXM": ok,
         "wrap": {"ok": True, "s": 0.1, "own_loss": 1.0, "losses": [1.5, 0.9], "same_first_loss": False}},
        {"task": "vision", "arch": "c", "status": "autopar_failed", "1xH200": ok,
         "8xH100-SXM": {"ok": False, "s": 0.2, "error": "PlanError: nope"}, "wrap": {"ok": True, "s": 0.1,
                                                                                 "own_loss": 1.0, "losses": [1.0, 1.0]}},
        {"task": "vision", "arch": "d", "status": "model_failed", "error": "x"},
        {"task": "vision", "arch": "e", "status": "timeout", "phase": "plan 1xH200", "error": "killed at 120 s"},
        {"task": "vision", "arch": "f", "status": "crashed", "phase": "build", "rc": -9, "error": "# phase build"},
    ]
    text = _report(tmp_path, head, rows)
    assert "| causal-lm | 2 | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in text
    assert "| vision | 4 | 0 | 0 | 1 | 0 | 1 | 1 | 1 |" in text
    assert "| causal-lm | b | mismatch | own loss 1.000000, wrap's first 1.500000 |" in text
    assert "| vision | c | autopar_failed | 8xH100-SXM: PlanError: nope |" in text
    assert "| vision | e | timeout | phase plan 1xH200: killed at 120 s |" in text
    assert "model_failed" in text and "| vision | d |" not in text  # not autopar's: counted, not listed
    assert "| vision | f |" not in text and "1 timeouts and crashes (killed: out of memory) came before" in text


def test_published_size_plans_the_default_configs_model_on_meta_with_a_batch_of_realistic_shape(monkeypatch):
    import torch
    import transformers

    small = hf_sweep.build

    def tiny_on_meta(task, arch, size="small"):  # a published-size model's path, at a size a test affords
        if size == "small":  # the own-step gate
            return small(task, arch)
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).train()

    monkeypatch.setattr(hf_sweep, "build", tiny_on_meta)
    rec = hf_sweep.measure("causal-lm", "llama", "published")
    assert rec["status"] == "ok", rec
    assert rec["sample"] == {"input_ids": [4, 256], "labels": [4, 256]}  # PUBLISHED_SAMPLE's 2048 tokens, capped
    assert all(rec[t]["ok"] and rec[t]["plan"] and rec[t]["s"] >= 0 for t in hf_sweep.TOPOLOGIES)
    assert "wrap" not in rec  # a meta model is planned, not trained


def test_published_size_says_when_autopar_planned_from_the_structure_and_skips_a_model_that_cannot_train(
        monkeypatch):
    import torch

    import autopar.profile.build

    # a check on what its weights compute, with the weights' values unreadable to the trace (as for a model over
    # MAX_REAL_WEIGHT_BYTES): trains eagerly, cannot be traced (tests/test_api.py's _ChecksItsLabels)
    monkeypatch.setattr(autopar.profile.build, "MAX_REAL_WEIGHT_BYTES", 0)

    class Untraceable(torch.nn.Module):
        config = type("Config", (), {"vocab_size": 16, "max_position_embeddings": 8})()

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, input_ids, labels):
            h = self.lin(torch.nn.functional.one_hot(input_ids % 8, 8).float())
            if not torch.isfinite(h).all():
                raise ValueError("not finite")
            return type("Out", (), {"loss": h.mean()})()

    monkeypatch.setattr(hf_sweep, "build", lambda task, arch, size="small": Untraceable())
    rec = hf_sweep.measure("causal-lm", "x", "published")
    assert rec["status"] == "untraced", rec
    assert all("could not be traced" in rec[t]["untraced"] for t in hf_sweep.TOPOLOGIES)

    class Broken(Untraceable):
        def forward(self, input_ids, labels):
            raise RuntimeError("the model's own bug")

    monkeypatch.setattr(hf_sweep, "build", lambda task, arch, size="small": Broken())
    assert hf_sweep.measure("causal-lm", "x", "published")["status"] == "model_failed"


def test_published_samples_take_the_configs_image_size_and_a_target_length_within_the_positions():
    import transformers

    vit = type("M", (), {"config": transformers.ViTConfig(image_size=384)})()
    sample = hf_sweep.make_sample("vision", vit, size="published")
    assert list(sample["pixel_values"].shape) == [hf_sweep.PUBLISHED_SAMPLE["vision"][0], 3, 384, 384]
    bart = type("M", (), {"config": transformers.BartConfig(max_position_embeddings=100, vocab_size=1000)})()
    sample = hf_sweep.make_sample("seq2seq", bart, size="published")
    assert list(sample["input_ids"].shape) == [8, 100] and list(sample["labels"].shape) == [8, 100]
    assert int(sample["input_ids"].max()) < 1000


def test_the_published_report_lists_what_raised_what_took_over_the_bound_and_what_was_killed_planning(tmp_path):
    head = {"date": "2026-12-07T00:00:00", "device": "cpu", "torch": "t", "transformers": "x", "command": "c",
            "commit": "abcdef0", "size": "published"}
    fast, slow = {"ok": True, "s": 2.0, "plan": "1gpu"}, {"ok": True, "s": 75.0, "plan": "1gpu"}
    rows = [
        {"task": "causal-lm", "arch": "a", "status": "ok", "parameters": 7e9, "1xH200": fast, "8xH100-SXM": fast},
        {"task": "causal-lm", "arch": "b", "status": "ok", "parameters": 7e9, "1xH200": slow, "8xH100-SXM": fast},
        {"task": "causal-lm", "arch": "c", "status": "autopar_failed", "parameters": 1e9, "1xH200": fast,
         "8xH100-SXM": {"ok": False, "s": 0.3, "error": "TraceError: op"}},
        {"task": "causal-lm", "arch": "g", "status": "refused", "parameters": 4e11,
         "1xH200": {"ok": False, "s": 9.0, "error": "InfeasiblePlanError: no plan fits", "refused": True},
         "8xH100-SXM": fast},
        {"task": "vision", "arch": "d", "status": "timeout", "phase": "plan 1xH200", "error": "killed at 180 s"},
        {"task": "vision", "arch": "e", "status": "build_failed", "error": "no"},
    ]
    text = _report(tmp_path, head, rows)
    assert "| causal-lm | 4 | 2 | 0 | 1 | 1 | 0 | 0 | 0 | 0 | 2.0 | 75.0 | 1 |" in text
    assert "| vision | 2 | 0 | 0 | 0 | 0 | 1 | 0 | 1 | 0 | 0.0 | 0.0 | 0 |" in text
    assert "| causal-lm | b | 7.00B | ok | 1xH200: 75.0 s; 8xH100-SXM: 2.0 s |" in text
    assert "| causal-lm | c | 1.00B | autopar_failed | 1xH200: 2.0 s; 8xH100-SXM: 0.3 s TraceError: op |" in text
    assert "| vision | d | 0.00B | timeout | phase plan 1xH200: killed at 180 s |" in text
    assert "| causal-lm | g | 400.00B | refused | 1xH200: 9.0 s InfeasiblePlanError: no plan fits; 8xH100-SXM: 2.0 s |" \
        in text
    assert "| causal-lm | a |" not in text and "| vision | e |" not in text


def test_no_plan_fitting_is_a_refusal_not_a_failure(monkeypatch):
    import torch

    import autopar

    def nothing_fits(model, **kwargs):
        raise autopar.InfeasiblePlanError("no plan fits in 131 GiB per device: use more devices")

    monkeypatch.setattr(autopar, "plan", nothing_fits)
    rec = hf_sweep._plans(torch.nn.Linear(2, 2), {"x": torch.ones(1, 2)})
    assert rec["status"] == "refused"
    assert all(rec[t]["refused"] and "use more devices" in rec[t]["error"] for t in hf_sweep.TOPOLOGIES)
