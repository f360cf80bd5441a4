"""autopar._util.yaml_text.load_yaml, the reader of every YAML file autopar reads (issue 11, items 9 and 11):
aliases, duplicate keys and oversized text are refused, through Plan.load too, with the file named."""

from __future__ import annotations

import time

import pytest
import yaml

from autopar._util.yaml_text import MAX_YAML_CHARS, DuplicateKeyError, load_yaml
from autopar.errors import PlanError
from autopar.plans import Plan

# nine levels of nine aliases: 9**9 (387 million) strings if expanded
LAUGHS = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))


def test_plain_values_load_as_yaml_safe_load_gives_them():
    text = "micro_batch_size: 4\nprecision: bf16\nsizes: [1, 2]\nnested: {a: null}\n"
    assert load_yaml(text) == yaml.safe_load(text)


def test_aliases_are_refused_at_once():
    started = time.perf_counter()
    with pytest.raises(yaml.YAMLError, match=r"aliases \(\*a0\) are not accepted"):
        load_yaml(LAUGHS)
    assert time.perf_counter() - started < 1.0  # refused before any expansion (yaml.safe_load: minutes, GBs)


def test_duplicate_keys_and_oversized_text_are_refused():
    with pytest.raises(DuplicateKeyError, match="'precision' appears twice.*line 3"):
        load_yaml("precision: bf16\nmicro_batch_size: 4\nprecision: fp32\n")
    with pytest.raises(yaml.YAMLError, match="more than"):
        load_yaml("#" * (MAX_YAML_CHARS + 1))


def test_plan_load_refuses_each_in_one_line_naming_the_file(tmp_path):
    good = Plan(micro_batch_size=4).save(tmp_path / "good.yaml")
    text = good.read_text()
    cases = {
        "alias.yaml": text.replace("micro_batch_size: 4", "micro_batch_size: &m 4").replace("grad_accum: 1",
                                                                                              "grad_accum: *m"),
        "twice.yaml": text + "micro_batch_size: 8\n",
    }
    assert "grad_accum: *m" in cases["alias.yaml"]  # a valid plan but for the alias
    for name, body in cases.items():
        (tmp_path / name).write_text(body)
        with pytest.raises(PlanError, match=name) as info:
            Plan.load(tmp_path / name)
        assert "\n" not in str(info.value)
    (tmp_path / "latin1.yaml").write_bytes("precision: 'bf16' # \xe9t\xe9\n".encode("latin-1"))
    with pytest.raises(PlanError, match="latin1.yaml is not UTF-8"):
        Plan.load(tmp_path / "latin1.yaml")
    (tmp_path / "big.yaml").write_text("#" * (MAX_YAML_CHARS + 1))
    with pytest.raises(PlanError, match="too large for a plan file"):
        Plan.load(tmp_path / "big.yaml")
    assert Plan.load(good).micro_batch_size == 4
