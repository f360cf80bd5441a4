"""Issue 32 (reliability, second round), plan files and caches: every field of a plan file is type-checked when
it is read (the nested `prediction` too), a deeply nested YAML document is refused as a YAML error (PlanError
through Plan.load), a cache folder that cannot be made is skipped with one warning while an AUTOPAR_CACHE_DIR
that is a file is refused, and a compile backend torch does not register is refused when the plan is made or
read and where AUTOPAR_COMPILE_BACKEND is read."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import yaml

import autopar
from autopar import plan_cache
from autopar._util.io import CacheWarning
from autopar._util.yaml_text import MAX_YAML_DEPTH, load_yaml
from autopar.calibration_cache import load_calibration
from autopar.errors import CacheError, PlanError
from autopar.plans import Loop, Plan
from autopar.strategies.compile import apply_compile, default_backend

JUNK = "AUTOPAR_COMPILE_BACKEND='junk' is not a torch.compile backend"


def _plan_file(tmp_path, name: str, **changes) -> "object":
    """A plan file as Plan.save writes it, with `changes` written over its fields."""
    data = yaml.safe_load(Plan(micro_batch_size=4).to_yaml())
    data.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------------------------------------------
# Item 8: every field type checked when the plan is read
# ---------------------------------------------------------------------------------------------------
def test_a_plan_file_with_a_wrong_type_anywhere_is_refused_by_the_reader_naming_the_field(tmp_path):
    cases = {
        "word.yaml": ({"prediction": {"step_s": "quick"}}, r"Plan\.prediction\.step_s .*seconds.* got 'quick' \(str\)"),
        "list.yaml": ({"prediction": {"memory_bytes": [1, 2]}}, r"Plan\.prediction\.memory_bytes .*bytes.* got \[1, 2\]"),
        "bool.yaml": ({"prediction": {"mfu": True}}, r"Plan\.prediction\.mfu must be a number.* got True \(bool\)"),
        "count.yaml": ({"grad_accum": True}, r"Plan\.grad_accum must be a positive integer, got True"),
        "nested.yaml": ({"measurement": {"step_s": {"a": 1}}}, r"Plan\.measurement\.step_s .*seconds.* got \{'a': 1\}"),
    }
    for name, (changes, message) in cases.items():
        path = _plan_file(tmp_path, name, **changes)
        with pytest.raises(PlanError, match=message) as info:
            Plan.load(path)
        assert "\n" not in str(info.value)
        with pytest.raises(PlanError, match=message):  # what every rank runs on the broadcast text
            Plan.from_yaml(path.read_text())
    good = _plan_file(tmp_path, "good.yaml", prediction={"step_s": 0.25, "memory_bytes": 2**30, "mfu": 0.4,
                                                          "per_block": {"name": "x"}})
    assert Plan.load(good).prediction["step_s"] == 0.25
    assert "250.0 ms/step" in Plan.load(good).describe()


# ---------------------------------------------------------------------------------------------------
# Deep YAML: a YAML error (PlanError through the plan reader), never RecursionError
# ---------------------------------------------------------------------------------------------------
DEEP = {
    "flow lists": "a: " + "[" * 5000 + "]" * 5000,
    "flow mappings": "a: " + "{b: " * 3000 + "1" + "}" * 3000,
    "block mappings": "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "x: 1\n",
}


@pytest.mark.parametrize("kind", sorted(DEEP))
def test_deeply_nested_yaml_is_a_yaml_error_and_a_plan_error(kind, tmp_path):
    with pytest.raises(yaml.YAMLError, match=f"more than {MAX_YAML_DEPTH} lists or mappings deep"):
        load_yaml(DEEP[kind])
    path = tmp_path / "deep.yaml"
    path.write_text(DEEP[kind])
    with pytest.raises(PlanError, match=r"deep\.yaml is not a plain YAML plan file .*nests more than") as info:
        Plan.load(path)
    assert "\n" not in str(info.value)
    value = load_yaml("[" * MAX_YAML_DEPTH + "1" + "]" * MAX_YAML_DEPTH)  # as deep as the bound: read
    for _ in range(MAX_YAML_DEPTH):
        value = value[0]
    assert value == 1


# ---------------------------------------------------------------------------------------------------
# Item 9: a cache folder that cannot be made; AUTOPAR_CACHE_DIR naming a file
# ---------------------------------------------------------------------------------------------------
def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def test_wrap_where_the_default_cache_folder_cannot_be_made_trains_and_warns_once(tmp_path, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("a file where HOME's parent folder should be")  # real as root too: no folder under a file
    monkeypatch.setenv("HOME", str(blocker / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("AUTOPAR_CACHE_DIR", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = autopar.wrap(_tiny(), sample=torch.randn(4, 8))
        autopar.wrap(_tiny(), sample=torch.randn(4, 8))  # a second wrap in the process: no second warning
    about_cache = [w for w in caught if "cache" in str(w.message).lower()]
    assert len(about_cache) == 1, [str(w.message) for w in about_cache]
    assert about_cache[0].category is CacheWarning
    assert str(blocker / "home" / ".cache" / "autopar") in str(about_cache[0].message)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_cache_dir_env_naming_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(afile))
    message = f"AUTOPAR_CACHE_DIR={afile} is a file, not a folder: point it at a folder or unset it"
    key = plan_cache.CacheKey(model_fingerprint="m" * 16, topology_fingerprint="t" * 16, global_batch_size=4,
                              torch_version="2.13.0", loop=Loop.PLAIN)
    for read in (lambda: plan_cache.lookup(key), lambda: load_calibration("t" * 16)):
        with pytest.raises(CacheError) as info:
            read()
        assert str(info.value) == message
    with pytest.raises(CacheError) as info:
        autopar.wrap(_tiny(), sample=torch.randn(4, 8))
    assert str(info.value) == message


# ---------------------------------------------------------------------------------------------------
# A junk compile backend: refused when the plan is made or read, and where AUTOPAR_COMPILE_BACKEND is read
# ---------------------------------------------------------------------------------------------------
def test_a_junk_compile_backend_is_refused_when_a_compiling_plan_is_made_or_read(tmp_path, monkeypatch):
    saved = Plan(micro_batch_size=4, compile=True).save(tmp_path / "compiles.yaml")
    key = plan_cache.CacheKey(model_fingerprint="m" * 16, topology_fingerprint="t" * 16, global_batch_size=4,
                              torch_version="2.13.0", loop=Loop.PLAIN)
    plan_cache.store(Plan(micro_batch_size=4, compile=True), key)
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "junk")
    for make in (lambda: Plan(compile=True), lambda: Plan.load(saved), lambda: plan_cache.lookup(key)):
        with pytest.raises(PlanError, match=JUNK) as info:  # the cached file is fine: not a CacheError
            make()
        assert "'aot_eager'" in str(info.value) and "'inductor'" in str(info.value) and "\n" not in str(info.value)
        assert not isinstance(info.value, CacheError)
    assert Plan(compile=False).compile is False  # a plan that does not compile never uses the backend
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "aot_eager")
    assert Plan.load(saved).compile and plan_cache.lookup(key).compile


def test_a_junk_compile_backend_is_refused_where_it_is_read_before_anything_compiles(monkeypatch):
    monkeypatch.setenv("AUTOPAR_COMPILE_BACKEND", "junk")
    with pytest.raises(PlanError, match=JUNK):
        default_backend()
    model = _tiny()
    forward = model.forward
    with pytest.raises(PlanError, match=r"compile_backend='nope' is not a torch.compile backend: use one of"):
        apply_compile(model, [], per_block=False, backend="nope")
    with pytest.raises(PlanError, match=JUNK):
        apply_compile(model, [], per_block=False)
    assert model.forward == forward  # nothing compiled
    monkeypatch.delenv("AUTOPAR_COMPILE_BACKEND")
    assert default_backend() == "inductor"
