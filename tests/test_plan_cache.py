"""The plan cache (autopar/plan_cache.py): round trip, keys, and refusal of tampered files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from autopar.errors import AutoparError
from autopar.plans import Loop, Plan
from autopar.topology import Topology
from autopar import plan_cache as cache
from autopar.plan_cache import CacheError, CacheKey, cache_key, cached_plan_for, entries, lookup, store

MODEL = "0123456789abcdef"
OTHER_MODEL = "fedcba9876543210"


@pytest.fixture
def topo() -> Topology:
    return Topology.from_spec("8xH200")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    return d


def _plan(**kw) -> Plan:
    base = dict(dp_shard=8, micro_batch_size=4, precision="bf16", checkpointing="selective")
    base.update(kw)
    return Plan(**base)


def _key(topo, **kw) -> CacheKey:
    args = dict(global_batch_size=32, loop=Loop.PLAIN, torch_version="2.13.0")
    args.update(kw)
    return cache_key(MODEL, topo, **args)


def test_round_trip(root, topo):
    key = _key(topo)
    assert lookup(key, directory=root) is None  # nothing yet (and no folder created by a lookup)
    assert not (root / "plans").exists()
    plan = _plan()
    path = store(plan, key, measurement={"tokens_per_s": 123456.0, "step_s": 0.5}, directory=root)
    assert path == root / "plans" / f"{key.digest()}.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    got = lookup(key, directory=root)
    assert got == plan.replace(model_fingerprint=MODEL, topology_fingerprint=topo.fingerprint())
    assert got.measurement == {"tokens_per_s": 123456.0, "step_s": 0.5}
    assert [k for k, _ in entries(root)] == [key]
    # atomic write: only the entry, no temporary file left, also after replacing it
    store(plan.replace(checkpointing="full"), key, directory=root)
    assert sorted(p.name for p in (root / "plans").iterdir()) == [path.name]
    assert lookup(key, directory=root).checkpointing == "full"


def test_key_digest_is_stable_and_distinguishes_fields(topo):
    key = _key(topo)
    assert key.digest() == _key(topo).digest() and len(key.digest()) == 32
    assert cache_key(MODEL, topo.fingerprint(), global_batch_size=32, loop=Loop.PLAIN,
                     torch_version="2.13.0") == key
    others = [_key(topo, global_batch_size=64), _key(topo, loop=Loop.TRAIN_STEP), _key(topo, torch_version="2.14.0"),
              cache_key(OTHER_MODEL, topo, global_batch_size=32, loop=Loop.PLAIN, torch_version="2.13.0"),
              _key(Topology.from_spec("4xH200"))]
    assert len({key.digest(), *(k.digest() for k in others)}) == 1 + len(others)
    assert "+" not in cache.current_torch_version()


def test_other_torch_version_misses(root, topo):
    store(_plan(), _key(topo), directory=root)
    assert lookup(_key(topo, torch_version="2.14.0"), directory=root) is None


def test_other_models_file_copied_over_is_refused(root, topo):
    theirs = cache_key(OTHER_MODEL, topo, global_batch_size=32, loop=Loop.PLAIN, torch_version="2.13.0")
    src = store(_plan(), theirs, directory=root)
    mine = _key(topo)
    os.replace(src, root / "plans" / f"{mine.digest()}.yaml")
    with pytest.raises(CacheError, match=f"written for model {OTHER_MODEL}, not {MODEL}"):
        lookup(mine, directory=root)
    with pytest.warns(cache.CacheWarning, match="written for|another name"):
        assert entries(root) == []


def test_python_tag_refused_without_running_code(root, topo, tmp_path):
    key = _key(topo)
    path = store(_plan(), key, directory=root)
    marker = tmp_path / "pwned"
    text = path.read_text() + f"evil: !!python/object/apply:os.system ['touch {marker}']\n"
    path.write_text(text)
    with pytest.raises(CacheError, match=r"YAML tag .*python/object/apply") as info:
        lookup(key, directory=root)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_world_writable_file_refused(root, topo):
    key = _key(topo)
    path = store(_plan(), key, directory=root)
    os.chmod(path, 0o666)
    with pytest.raises(CacheError, match="can be written by others.*chmod 600"):
        lookup(key, directory=root)
    os.chmod(path, 0o620)
    with pytest.raises(CacheError, match="can be written by the group"):
        lookup(key, directory=root)


def test_world_writable_directory_refused(root, topo):
    key = _key(topo)
    store(_plan(), key, directory=root)
    os.chmod(root / "plans", 0o777)
    try:
        with pytest.raises(CacheError, match="plans can be written by others.*chmod 700"):
            lookup(key, directory=root)
        with pytest.raises(CacheError):
            store(_plan(), key, directory=root)
        with pytest.warns(cache.CacheWarning):
            assert entries(root) == []
    finally:
        os.chmod(root / "plans", 0o700)
    os.chmod(root, 0o757)
    with pytest.raises(CacheError, match="can be written by others"):
        lookup(key, directory=root)


def test_symlink_refused(root, topo, tmp_path):
    key = _key(topo)
    real = store(_plan(), key, directory=root)
    elsewhere = tmp_path / "elsewhere.yaml"
    os.replace(real, elsewhere)
    os.symlink(elsewhere, real)
    with pytest.raises(CacheError, match="is a symlink"):
        lookup(key, directory=root)
    # a symlinked plans folder too
    os.unlink(real)
    os.replace(elsewhere, real)
    moved = tmp_path / "moved_plans"
    os.replace(root / "plans", moved)
    os.symlink(moved, root / "plans")
    with pytest.raises(CacheError, match="is a symlink"):
        lookup(key, directory=root)


def test_not_ours_refused(root, topo, monkeypatch):
    key = _key(topo)
    store(_plan(), key, directory=root)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(CacheError, match="belongs to another user"):
        lookup(key, directory=root)


def test_not_ours_file_refused(root, topo, monkeypatch):
    key = _key(topo)
    path = store(_plan(), key, directory=root)
    real_fstat = os.fstat

    def fstat(fd):  # the file (checked on its open descriptor) has another owner; the folders are ours
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1, *st[5:10]))

    monkeypatch.setattr(os, "fstat", fstat)
    with pytest.raises(CacheError, match=f"{path.name} belongs to another user"):
        lookup(key, directory=root)


def test_invalid_plan_and_junk_refused(root, topo):
    key = _key(topo)
    path = store(_plan(), key, directory=root)
    data = yaml.safe_load(path.read_text())
    data["plan"]["pp"] = 2  # pp > 1 without a schedule: not a valid plan
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CacheError, match="invalid plan"):
        lookup(key, directory=root)
    path.write_text("just: [a, list")
    with pytest.raises(CacheError, match="not plain YAML"):
        lookup(key, directory=root)


def test_store_checks_plan_against_key(root, topo):
    with pytest.raises(CacheError, match="global batch"):
        store(_plan(micro_batch_size=2), _key(topo), directory=root)
    with pytest.raises(CacheError, match="loop='plain'"):
        store(_plan(micro_batch_size=2, grad_accum=2), _key(topo), directory=root)
    store(_plan(micro_batch_size=2, grad_accum=2), _key(topo, loop=Loop.TRAIN_STEP), directory=root)


def test_cached_plan_for(root, topo):
    assert cached_plan_for(MODEL, topo, world_size=8, global_batch_size=32, loop=Loop.PLAIN,
                           directory=root) == (None, None)
    key = cache_key(MODEL, topo, global_batch_size=32, loop=Loop.PLAIN)  # this torch
    store(_plan(), key, measurement={"tokens_per_s": 123456.0}, directory=root)
    plan, msg = cached_plan_for(MODEL, topo, world_size=8, global_batch_size=32, loop=Loop.PLAIN,
                                directory=root)
    assert plan is not None and plan.dp_shard == 8
    assert msg.startswith("using the plan cached at ") and "measured 123,456 tokens/s on 20" in msg
    # a world-size mismatch: ignored with the reason, never a crash
    plan, msg = cached_plan_for(MODEL, topo, world_size=4, global_batch_size=32, loop=Loop.PLAIN,
                                directory=root)
    assert plan is None and "ignoring the plan cached at" in msg and "made for 8 processes and this job has 4" in msg
    # cached for another loop only (autotune's default is train_step): said, not found silently
    plan, msg = cached_plan_for(MODEL, topo, world_size=8, global_batch_size=32, loop=Loop.TRAIN_STEP,
                                directory=root)
    assert plan is None and msg.startswith("no plan is cached for this job's loop (train_step), but one is for "
                                           "loop='plain' at ") and "wrap(..., loop='plain') uses it" in msg


def test_cache_dir_env(monkeypatch, tmp_path, topo):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "envcache"))
    key = _key(topo)
    path = store(_plan(), key)
    assert path.parent == tmp_path / "envcache" / "plans"
    assert lookup(key) is not None


def test_write_plan_out(tmp_path):
    plan = _plan()
    out = tmp_path / "sub" / "plan.yaml"
    assert cache.write_plan_out(plan, out) == out and Plan.load(out) == plan
    cache.write_plan_out(plan.replace(checkpointing="full"), out)  # a plan file: replaced
    assert Plan.load(out).checkpointing == "full"
    empty = tmp_path / "empty.yaml"
    empty.touch()
    cache.write_plan_out(plan, empty)
    other = tmp_path / "train.py"
    other.write_text("print('hello')\n")
    with pytest.raises(AutoparError, match="not an autopar plan file"):
        cache.write_plan_out(plan, other)
    assert other.read_text() == "print('hello')\n"
    with pytest.raises(AutoparError, match="is a folder"):
        cache.write_plan_out(plan, tmp_path)


def test_a_plan_cached_at_one_sequence_length_is_not_used_at_another(root, topo):
    """A plan tuned at 16 tokens a sample was used at 2048, with its stale prediction (issue 11, item 7)."""
    import torch

    from autopar.models.gpt import GPT, GPTConfig
    from autopar.profile import profile_model

    cfg = GPTConfig(vocab_size=128, seq_len=64, num_layers=2, hidden_dim=32, num_heads=4)
    with torch.device("meta"):
        model = GPT(cfg)
    short, long = (profile_model(model, torch.zeros(4, n, dtype=torch.long, device="meta"), warn=False)
                   for n in (16, 64))
    assert short.fingerprint == long.fingerprint  # the same model: only the sample's size tells them apart
    k_short = cache_key(short, topo, global_batch_size=32, loop=Loop.PLAIN)
    k_long = cache_key(long, topo, global_batch_size=32, loop=Loop.PLAIN)
    assert "tokens=16" in k_short.sample_signature and "tokens=64" in k_long.sample_signature
    assert k_short.digest() != k_long.digest()
    assert cache_key(short.fingerprint, topo, global_batch_size=32, loop=Loop.PLAIN,
                     profile=short) == k_short  # a fingerprint with its profile: the same key
    store(_plan(), k_short, directory=root)
    assert cached_plan_for(long, topo, world_size=8, global_batch_size=32, loop=Loop.PLAIN,
                           directory=root) == (None, None)
    hit = cached_plan_for(short, topo, world_size=8, global_batch_size=32, loop=Loop.PLAIN, directory=root)[0]
    assert hit is not None and hit.replace(model_fingerprint=None, topology_fingerprint=None) == _plan()
