"""bench zoo-plan-speed: a family's child process gets the parent's flags without --families and its value."""

from __future__ import annotations

from bench.zoo_plan_speed import _without_flag


def test_the_child_s_flags_drop_families_and_its_value_in_either_spelling():
    assert _without_flag(["--families", "mlp,bert", "--out", "x.jsonl"], "--families") == ["--out", "x.jsonl"]
    assert _without_flag(["--families=mlp", "--time-budget-s", "9"], "--families") == ["--time-budget-s", "9"]
    assert _without_flag(["--family-timeout-s", "60"], "--families") == ["--family-timeout-s", "60"]
