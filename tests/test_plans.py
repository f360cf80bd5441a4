"""Tests of autopar.plans.Plan: validation of every field, options that do not combine, derived values,
the checks against world / batch / model and their messages, YAML files (round trip, atomic save, safety,
schema versions, unknown keys, mismatched model or world), key() and describe()."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autopar import plans as plans_mod
from autopar._util import io as io_mod
from autopar.errors import PlanError, PlanMismatchError
from autopar.plans import CHECKPOINTING, PP_SCHEDULES, PRECISIONS, SCHEMA_VERSION, Plan

REPO = Path(__file__).resolve().parents[1]

INT_FIELDS = ("pp", "dp_replicate", "dp_shard", "tp", "micro_batch_size", "grad_accum", "pp_stages_per_rank",
              "checkpoint_every")
BOOL_FIELDS = ("reshard_after_forward", "cpu_offload", "sequence_parallel", "compile")


def _full_plan(**overrides) -> Plan:
    """A plan that sets every field away from its default (valid as a whole)."""
    kwargs = dict(
        pp=2, dp_replicate=2, dp_shard=4, tp=2, micro_batch_size=3, grad_accum=4, pp_schedule="interleaved_1f1b",
        pp_stages_per_rank=2, reshard_after_forward=False, cpu_offload=False, sequence_parallel=True,
        checkpointing="selective", checkpoint_every=2, precision="bf16", compile=True,
        model_fingerprint="m" * 16, topology_fingerprint="t" * 16,
        prediction={"memory_bytes": 12.5 * 2**30, "step_s": 0.25, "per_block": {"flops": 1e12, "name": "x"}},
        measurement={"step_s": 0.3, "ok": True, "note": None},
    )
    kwargs.update(overrides)
    return Plan(**kwargs)


# ---- field validation -----------------------------------------------------------------------------
def test_defaults_are_one_plain_process():
    p = Plan()
    assert (p.pp, p.dp_replicate, p.dp_shard, p.tp) == (1, 1, 1, 1)
    assert (p.micro_batch_size, p.grad_accum, p.checkpointing, p.precision, p.compile) == (1, 1, "none", "fp32", False)
    assert p.world_size == 1 and p.global_batch_size == 1 and not p.uses_fsdp and not p.needs_train_step
    assert p.schema_version == SCHEMA_VERSION


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, "2", None])
def test_positive_int_fields_reject_bad_values(name, bad):
    with pytest.raises(PlanError, match=rf"Plan\.{name} must be a positive integer, got {bad!r}"):
        Plan(**{name: bad})


@pytest.mark.parametrize("bad", [0, -3, True, 1.0, "1", None])
def test_schema_version_must_be_a_positive_int(bad):
    with pytest.raises(PlanError, match="schema_version must be a positive integer"):
        Plan(schema_version=bad)


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("bad", [0, 1, "true", "yes", None])
def test_bool_fields_reject_non_bools(name, bad):
    with pytest.raises(PlanError, match=rf"Plan\.{name} must be true or false, got {bad!r}"):
        Plan(**{name: bad})


@pytest.mark.parametrize("name, choices, bad", [
    ("checkpointing", CHECKPOINTING, "partial"),
    ("checkpointing", CHECKPOINTING, "FULL"),
    ("checkpointing", CHECKPOINTING, None),
    ("precision", PRECISIONS, "fp16"),
    ("precision", PRECISIONS, "bfloat16"),
    ("precision", PRECISIONS, None),
])
def test_choice_fields_reject_unknown_values_and_list_the_choices(name, choices, bad):
    with pytest.raises(PlanError, match=rf"Plan\.{name} must be one of") as info:
        Plan(**{name: bad})
    for choice in choices:
        assert repr(choice) in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", ["bogus", "1F1B", 1])
def test_pp_schedule_must_be_a_known_schedule(bad):
    with pytest.raises(PlanError, match=r"Plan\.pp_schedule must be one of"):
        Plan(pp=2, pp_schedule=bad)


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_every_known_schedule_is_accepted_with_pp(schedule):
    assert Plan(pp=4, pp_schedule=schedule).pp_schedule == schedule


@pytest.mark.parametrize("choice", CHECKPOINTING)
def test_every_checkpointing_mode_is_accepted(choice):
    assert Plan(checkpointing=choice).checkpointing == choice


@pytest.mark.parametrize("name", ["model_fingerprint", "topology_fingerprint"])
@pytest.mark.parametrize("bad", [123, b"abc", ["x"]])
def test_fingerprints_must_be_strings(name, bad):
    with pytest.raises(PlanError, match=rf"Plan\.{name} must be a string or None"):
        Plan(**{name: bad})


@pytest.mark.parametrize("name", ["prediction", "measurement"])
@pytest.mark.parametrize("bad, why", [
    ([1, 2], "must be a mapping"),
    ("fast", "must be a mapping"),
    ({1: 2.0}, "keys must be strings"),
    ({"a": [1, 2]}, "must be a number, string or bool"),
    ({"a": {"b": object()}}, "must be a number, string or bool"),
])
def test_prediction_and_measurement_must_be_plain_mappings(name, bad, why):
    with pytest.raises(PlanError, match=why):
        Plan(**{name: bad})


def test_prediction_is_copied_not_aliased():
    pred = {"memory_bytes": 1.0, "nested": {"a": 1}}
    p = Plan(prediction=pred)
    pred["memory_bytes"] = 99.0
    pred["nested"]["a"] = 99
    assert p.prediction == {"memory_bytes": 1.0, "nested": {"a": 1}}


def test_plan_is_frozen_and_replace_validates_again():
    p = Plan(dp_shard=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dp_shard = 4  # type: ignore[misc]
    assert p.replace(dp_shard=4).dp_shard == 4 and p.dp_shard == 2
    with pytest.raises(PlanError, match="dp_shard"):
        p.replace(dp_shard=0)


# ---- options that do not combine ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"pp": 2}, r"pp=2 needs a pipeline schedule: set pp_schedule to one of gpipe, 1f1b"),
    ({"pp_schedule": "1f1b"}, r"pp_schedule='1f1b' only applies with pp > 1; drop it or raise pp"),
    ({"sequence_parallel": True}, r"sequence_parallel .* needs tp > 1"),
    ({"sequence_parallel": True, "pp": 2, "pp_schedule": "gpipe"}, r"needs tp > 1"),
    ({"checkpoint_every": 2}, r"checkpoint_every=2 has no effect with checkpointing='none'.*set checkpoint_every=1"),
    ({"pp_stages_per_rank": 2, "pp": 2, "pp_schedule": "1f1b"},
     r"pp_stages_per_rank=2 needs a multi-stage schedule .*'interleaved_1f1b' or 'zero_bubble'"),
    ({"pp_stages_per_rank": 2, "pp": 2, "pp_schedule": "gpipe"}, r"pp_stages_per_rank=2 needs a multi-stage"),
    ({"pp_stages_per_rank": 3}, r"pp_stages_per_rank=3 needs a multi-stage"),
    ({"cpu_offload": True, "pp": 2, "pp_schedule": "1f1b"}, r"cpu_offload is not combined with pipeline parallelism"),
])
def test_options_that_do_not_combine_are_refused(kwargs, message):
    with pytest.raises(PlanError, match=message):
        Plan(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2},
    {"pp": 2, "pp_schedule": "zero_bubble", "pp_stages_per_rank": 4},
    {"tp": 2, "sequence_parallel": True},
    {"checkpointing": "full", "checkpoint_every": 3},
    {"checkpointing": "selective", "checkpoint_every": 2},
    {"cpu_offload": True, "dp_shard": 8},
])
def test_options_that_do_combine_are_accepted(kwargs):
    p = Plan(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


# ---- derived values -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, world, dp, local, global_, fsdp, train_step", [
    ({}, 1, 1, 1, 1, False, False),
    ({"dp_shard": 8, "micro_batch_size": 4}, 8, 8, 4, 32, True, False),
    ({"dp_replicate": 2, "dp_shard": 8, "micro_batch_size": 2, "grad_accum": 3}, 16, 16, 6, 96, True, True),
    ({"dp_replicate": 4, "micro_batch_size": 5}, 4, 4, 5, 20, True, False),
    ({"tp": 4, "dp_shard": 2, "micro_batch_size": 8}, 8, 2, 8, 16, True, False),
    ({"tp": 8, "micro_batch_size": 8}, 8, 1, 8, 8, True, False),  # TP: FSDP over one rank, all DTensors
    ({"pp": 4, "pp_schedule": "1f1b", "dp_shard": 2, "micro_batch_size": 1, "grad_accum": 8}, 8, 2, 8, 16, True, True),
    ({"pp": 2, "pp_schedule": "gpipe", "tp": 2, "dp_replicate": 3, "dp_shard": 5, "micro_batch_size": 7},
     60, 15, 7, 105, True, True),
    ({"cpu_offload": True, "micro_batch_size": 2}, 1, 1, 2, 2, True, False),
    ({"grad_accum": 4, "micro_batch_size": 2}, 1, 1, 8, 8, False, True),
])
def test_derived_values(kwargs, world, dp, local, global_, fsdp, train_step):
    p = Plan(**kwargs)
    assert p.world_size == world
    assert p.dp_size == dp
    assert p.local_batch_size == local
    assert p.global_batch_size == global_
    assert p.uses_fsdp is fsdp
    assert p.needs_train_step is train_step
    assert p.mesh_shape == {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp}
    assert list(p.mesh_shape) == ["pp", "dp_replicate", "dp_shard", "tp"]


def test_derived_values_are_not_stored_or_written():
    d = Plan(dp_shard=4, micro_batch_size=2).to_dict()
    for derived in ("world_size", "dp_size", "global_batch_size", "local_batch_size", "uses_fsdp"):
        assert derived not in d
    with pytest.raises(TypeError):
        Plan(world_size=4)  # type: ignore[call-arg]


# ---- checks against the world, the batch, the model -----------------------------------------------
def test_check_world_accepts_the_product_and_names_numbers_and_remedy():
    p = Plan(dp_replicate=2, dp_shard=4, micro_batch_size=1)
    p.check_world(8)
    with pytest.raises(PlanMismatchError) as info:
        p.check_world(4)
    msg = str(info.value)
    assert "pp=1 x dp_replicate=2 x dp_shard=4 x tp=1 = 8 processes" in msg
    assert "this job has 4" in msg
    assert "multiply to 4" in msg and "launch 8 processes" in msg
    assert isinstance(info.value, PlanError)  # a PlanMismatchError is a PlanError


def test_check_batch_accepts_the_product_and_names_numbers_and_remedy():
    p = Plan(dp_shard=8, micro_batch_size=4, grad_accum=2)
    p.check_batch(64)
    with pytest.raises(PlanError) as info:
        p.check_batch(32)
    msg = str(info.value)
    assert "micro_batch_size=4" in msg and "grad_accum=2" in msg and "data-parallel degree 8" in msg
    assert "= 64 samples per step" in msg and "global batch is 32" in msg
    assert "never changes the global batch" in msg
    assert "whose product with 8 is 32" in msg


def test_check_model_refuses_another_fingerprint_unless_forced():
    p = Plan(model_fingerprint="aaaa1111")
    p.check_model("aaaa1111")
    p.check_model(None)  # unknown model: nothing to compare
    p.check_model("bbbb2222", force=True)
    with pytest.raises(PlanMismatchError) as info:
        p.check_model("bbbb2222")
    msg = str(info.value)
    assert "aaaa1111" in msg and "bbbb2222" in msg
    assert "autopar.plan" in msg and "force=True" in msg
    Plan().check_model("anything")  # a plan without a fingerprint fits any model


# ---- YAML ------------------------------------------------------------------------------------------
def test_yaml_round_trip_keeps_every_field_including_provenance(tmp_path):
    p = _full_plan()
    q = Plan.from_yaml(p.to_yaml())
    assert q == p
    assert q.prediction == p.prediction and q.measurement == p.measurement
    assert q.to_dict() == p.to_dict()
    path = p.save(tmp_path / "plan.yaml")
    assert path == tmp_path / "plan.yaml"
    r = Plan.load(path)
    assert r == p and r.prediction == p.prediction and r.measurement == p.measurement
    assert r.key() == p.key()


def test_yaml_is_plain_mapping_with_derived_header():
    p = Plan(dp_shard=4, micro_batch_size=2, grad_accum=3)
    text = p.to_yaml()
    assert text.startswith("# autopar plan: world size 4, global batch 24")
    data = yaml.safe_load(text)
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["dp_shard"] == 4 and data["micro_batch_size"] == 2 and data["grad_accum"] == 3
    # unset provenance is left out; derived values are never written
    for absent in ("model_fingerprint", "topology_fingerprint", "prediction", "measurement", "world_size"):
        assert absent not in data
    assert Plan.from_dict(data) == p


def test_missing_keys_take_defaults():
    assert Plan.from_yaml("dp_shard: 2\nmicro_batch_size: 3\n") == Plan(dp_shard=2, micro_batch_size=3)


def test_equality_ignores_prediction_and_measurement_but_not_fingerprints():
    a = Plan(dp_shard=2, prediction={"step_s": 1.0}, measurement={"step_s": 1.1})
    b = Plan(dp_shard=2, prediction={"step_s": 9.0})
    assert a == b and hash(a) == hash(b)
    assert a != Plan(dp_shard=2, model_fingerprint="x")
    assert a != Plan(dp_shard=2, topology_fingerprint="y")
    assert a != Plan(dp_shard=4)


def test_save_is_atomic_and_replaces_an_existing_file(tmp_path):
    path = tmp_path / "sub" / "dir" / "plan.yaml"  # parents are created
    Plan(dp_shard=2).save(path)
    Plan(dp_shard=4).save(path)
    assert Plan.load(path) == Plan(dp_shard=4)
    assert sorted(os.listdir(path.parent)) == ["plan.yaml"]  # no temporary file left behind


def _break_write_halfway(monkeypatch):
    """The atomic write (autopar/_util/io.py) writes half of the text to its file, then the disk is full."""
    real_fdopen = io_mod.os.fdopen

    class HalfThenCrash:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError("disk full")

    monkeypatch.setattr(io_mod.os, "fdopen", lambda fd, *a, **k: HalfThenCrash(real_fdopen(fd, *a, **k)))


def test_a_crash_while_saving_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "plan.yaml"
    old = Plan(dp_shard=2, micro_batch_size=5)
    old.save(path)
    before = path.read_text()
    _break_write_halfway(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        _full_plan().save(path)
    monkeypatch.undo()
    assert path.read_text() == before
    assert Plan.load(path) == old


def test_a_crash_while_saving_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "plan.yaml"
    Plan().save(path)
    _break_write_halfway(monkeypatch)
    with pytest.raises(OSError):
        Plan(dp_shard=2).save(path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["plan.yaml"]


def test_newer_schema_version_is_refused_with_upgrade_advice():
    text = Plan(dp_shard=2).to_yaml().replace(f"schema_version: {SCHEMA_VERSION}", f"schema_version: {SCHEMA_VERSION + 1}")
    assert f"schema_version: {SCHEMA_VERSION + 1}" in text
    with pytest.raises(PlanError, match=rf"schema version {SCHEMA_VERSION + 1}, newer than this autopar reads"
                                        rf" \({SCHEMA_VERSION}\): upgrade autopar"):
        Plan.from_yaml(text)


def test_older_schema_version_is_refused_with_remake_advice(monkeypatch):
    # Pretend this autopar reads version SCHEMA_VERSION + 1: a file of the current version is then older.
    data = Plan(dp_shard=2).to_dict()
    monkeypatch.setattr(plans_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(PlanError, match=rf"schema version {SCHEMA_VERSION}; this autopar reads version "
                                        rf"{SCHEMA_VERSION + 1}\. Make the plan again"):
        Plan.from_dict(data)


def test_version_zero_is_refused():
    with pytest.raises(PlanError, match="schema_version"):
        Plan.from_yaml("schema_version: 0\ndp_shard: 2\n")


def test_unknown_keys_are_refused_with_the_known_list():
    with pytest.raises(PlanError) as info:
        Plan.from_yaml("dp_shard: 2\ndp: 4\nzero_offload: 3\n")
    msg = str(info.value)
    assert "unknown plan option(s) dp, zero_offload" in msg
    known = msg.split("known options are:")[1]
    for f in dataclasses.fields(Plan):
        assert f.name in known


@pytest.mark.parametrize("text, why", [
    ("", "mapping of option names"),
    ("- 1\n- 2\n", "mapping of option names"),
    ("42\n", "mapping of option names"),
    ("dp_shard: [\n", "not a plain YAML plan file"),
    ("micro_batch_size: '4'\n", "micro_batch_size must be a positive integer"),
    ("compile: 1\n", "compile must be true or false"),
])
def test_malformed_yaml_is_refused(text, why):
    with pytest.raises(PlanError, match=why):
        Plan.from_yaml(text)


@pytest.mark.parametrize("template", [
    '!!python/object/apply:os.system ["touch {marker}"]\n',
    'dp_shard: !!python/object/apply:os.system ["touch {marker}"]\n',
    'pp: 1\nprediction: !!python/object/apply:subprocess.check_call [["touch", "{marker}"]]\n',
    '!!python/object/new:os.system ["touch {marker}"]\n',
])
def test_yaml_with_python_tags_is_refused_and_never_executed(tmp_path, template):
    marker = tmp_path / "executed"
    text = template.format(marker=marker)
    with pytest.raises(PlanError, match="not a plain YAML plan file .*no tags, no code"):
        Plan.from_yaml(text)
    path = tmp_path / "evil.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=str(path)):
        Plan.load(path)
    assert not marker.exists()
    # The command would have worked: the marker's folder is writable (so the check above means something).
    subprocess.run(["touch", str(marker)], check=True)
    assert marker.exists()


def test_load_of_a_missing_file_says_what_to_give(tmp_path):
    with pytest.raises(PlanError, match="no plan file at .*written by Plan.save"):
        Plan.load(tmp_path / "nope.yaml")


def test_load_refuses_a_plan_for_another_model_unless_forced(tmp_path):
    path = Plan(dp_shard=2, model_fingerprint="a" * 16).save(tmp_path / "p.yaml")
    assert Plan.load(path, model_fingerprint="a" * 16).model_fingerprint == "a" * 16
    with pytest.raises(PlanMismatchError, match="another model .*aaaa.*bbbb.*force=True"):
        Plan.load(path, model_fingerprint="b" * 16)
    assert Plan.load(path, model_fingerprint="b" * 16, force=True) == Plan(dp_shard=2, model_fingerprint="a" * 16)


def test_load_refuses_a_plan_for_another_world_size_unless_forced(tmp_path):
    path = Plan(dp_replicate=2, dp_shard=4).save(tmp_path / "p.yaml")
    assert Plan.load(path, world_size=8).world_size == 8
    with pytest.raises(PlanMismatchError, match="= 8 processes, but this job has 16"):
        Plan.load(path, world_size=16)
    assert Plan.load(path, world_size=16, force=True).world_size == 8


# ---- key() -----------------------------------------------------------------------------------------
def test_key_is_short_hex_and_ignores_provenance():
    a = _full_plan()
    b = _full_plan(model_fingerprint=None, topology_fingerprint="other", prediction=None, measurement={"x": 1})
    assert len(a.key()) == 16 and int(a.key(), 16) >= 0
    assert a.key() == b.key()
    assert a != b  # fingerprints are part of equality, not of the strategy
    assert Plan.from_yaml(a.to_yaml()).key() == a.key()


@pytest.mark.parametrize("change", [
    {"pp": 4}, {"dp_replicate": 1, "dp_shard": 8}, {"dp_shard": 8}, {"tp": 4}, {"micro_batch_size": 4},
    {"grad_accum": 8}, {"pp_schedule": "zero_bubble"}, {"pp_stages_per_rank": 3}, {"reshard_after_forward": True},
    {"sequence_parallel": False}, {"checkpointing": "full"}, {"checkpoint_every": 1}, {"precision": "fp32"},
    {"compile": False},
])
def test_key_changes_with_every_strategy_field(change):
    base = _full_plan()
    assert base.replace(**change).key() != base.key()


def test_key_changes_with_cpu_offload():
    base = Plan(dp_shard=2)
    assert base.replace(cpu_offload=True).key() != base.key()


def test_key_is_stable_across_processes():
    code = ("from autopar.plans import Plan; "
            "print(Plan(dp_replicate=2, dp_shard=4, micro_batch_size=3, checkpointing='full', precision='bf16').key())")
    keys = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)})
        keys.add(out.stdout.strip())
    here = Plan(dp_replicate=2, dp_shard=4, micro_batch_size=3, checkpointing="full", precision="bf16").key()
    assert keys == {here}


# ---- describe() ------------------------------------------------------------------------------------
def test_describe_mentions_mesh_batch_and_options():
    p = Plan(dp_replicate=2, dp_shard=8, micro_batch_size=4, grad_accum=2, checkpointing="full", precision="bf16",
             prediction={"memory_bytes": 3 * 2**30, "step_s": 0.5, "tokens_per_s": 12345.0, "mfu": 0.42})
    text = p.describe()
    assert str(p) == text
    assert text.splitlines()[0] == f"autopar plan {p.key()}"
    assert "pp=1 x dp_replicate=2 x dp_shard=8 x tp=1" in text and "(16 processes)" in text
    assert "micro-batch 4 x accumulation 2 x data-parallel 16 = global batch 128" in text
    assert "HSDP" in text
    assert "checkpointing full" in text and "bf16" in text
    assert "3.00 GiB per device" in text and "500.0 ms/step" in text and "12,345 tokens/s" in text and "MFU 42.0%" in text


@pytest.mark.parametrize("kwargs, kind", [
    ({"dp_shard": 4}, "FSDP2"),
    ({"dp_replicate": 4}, "replicated (DDP-like)"),
    ({"dp_replicate": 2, "dp_shard": 2}, "HSDP"),
])
def test_describe_names_the_data_parallel_kind(kwargs, kind):
    assert f"data parallel {kind}," in Plan(**kwargs).describe()


def test_describe_single_process_and_parallel_axes():
    one = Plan().describe()
    assert "(1 process)" in one and "data parallel" not in one
    tp = Plan(tp=2, sequence_parallel=True).describe()
    assert "tp=2, sequence parallel: True" in tp
    pp = Plan(pp=2, pp_schedule="1f1b", grad_accum=8).describe()
    assert "pp=2, schedule 1f1b" in pp and "8 micro-batches" in pp


def test_describe_skips_a_nan_mfu():
    text = Plan(prediction={"memory_bytes": 2**30, "mfu": float("nan")}).describe()
    assert "1.00 GiB per device" in text and "MFU" not in text


@pytest.mark.parametrize("every, words", [(2, "every 2nd block"), (3, "every 3rd block")])
def test_describe_checkpoint_every_uses_correct_ordinals(every, words):
    assert words in Plan(checkpointing="full", checkpoint_every=every).describe()


def test_describe_checkpoint_every_names_the_period():
    assert "every 4th block" in Plan(checkpointing="full", checkpoint_every=4).describe()
    assert "every" not in Plan(checkpointing="full").describe()
