"""The loop that drives the step (`autopar.plans.Loop`, wrap's `loop=`): its values, what the search chooses
under each, the given plans each refuses, the deprecated `uses_train_step=`, and the records written before
the loop had three values (plan cache keys, probe files, study metadata), which stay readable."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.models.gpt import GPT, GPTConfig, lm_loss
from autopar.plan_cache import CACHE_SCHEMA_VERSION, CacheKey, cache_key, cached_plan_for, store
from autopar.plans import SCHEMA_VERSION, Loop, Plan
from autopar.tune.engine import _upgraded_meta
from autopar.tune.launcher import _probe_loop
from tests._training import batch, make_model

pytestmark = pytest.mark.usefixtures("one_plain_process")

BIG = GPTConfig(vocab_size=32000, seq_len=2048, num_layers=4, hidden_dim=4096, num_heads=32)


def _meta_gpt(cfg: GPTConfig, n: int):
    with torch.device("meta"):
        model = GPT(cfg)
    return model, torch.empty(n, cfg.seq_len, dtype=torch.long, device="meta")


def test_loop_values_and_what_each_runs():
    assert autopar.Loop is Loop
    assert [m.value for m in Loop] == ["plain", "accumulates", "train_step"]
    assert Loop.parse("accumulates") is Loop.ACCUMULATES and Loop("plain") == "plain"
    with pytest.raises(PlanError, match="loop must be one of 'plain', 'accumulates', 'train_step', got 'trainer'"):
        Loop.parse("trainer")
    pipeline = Plan(pp=2, pp_schedule="gpipe", micro_batch_size=1, grad_accum=2)
    accum, tp = Plan(micro_batch_size=2, grad_accum=2), Plan(tp=2, micro_batch_size=2)
    assert "pp=2" in Loop.ACCUMULATES.refusal(pipeline) and "pp=2" in Loop.PLAIN.refusal(pipeline)
    assert "grad_accum=2" in Loop.PLAIN.refusal(accum) and Loop.ACCUMULATES.refusal(accum) is None
    assert all(Loop.TRAIN_STEP.refusal(p) is None for p in (pipeline, accum, tp))
    assert Loop.PLAIN.refusal(tp) is None  # a given TP plan runs in a plain loop that feeds its peers alike


def test_uses_train_step_is_deprecated_and_cannot_be_combined_with_loop():
    with pytest.warns(DeprecationWarning, match="uses_train_step= is deprecated; pass loop='train_step'"):
        assert Loop.resolve(None, True) is Loop.TRAIN_STEP
    with pytest.warns(DeprecationWarning):
        assert Loop.resolve(None, False) is None  # as if left out: given plans applied as they are
    with pytest.raises(PlanError, match="pass loop= only"):
        Loop.resolve("plain", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Loop.resolve(None, None) is None and Loop.resolve("plain", None) is Loop.PLAIN


def test_plan_under_each_loop():
    model, x = _meta_gpt(BIG, 1)
    plain = autopar.plan(model, sample=x, topology="4xH100-SXM", loop="plain")
    assert plain.dp_size == 4 and plain.grad_accum == 1 and plain.tp == 1
    with pytest.warns(DeprecationWarning):
        old = autopar.plan(model, sample=x, topology="4xH100-SXM", uses_train_step=True)
    assert old.strategy() == autopar.plan(model, sample=x, topology="4xH100-SXM", loop="train_step").strategy()
    ranked = autopar.candidates(model, sample=x, topology="4xH100-SXM", loop="accumulates")
    assert not any(c.plan.pp > 1 for c in ranked)
    assert any(c.plan.tp > 1 for c in ranked) and any(c.plan.grad_accum > 1 for c in ranked)
    everything = autopar.candidates(model, sample=x, topology="4xH100-SXM", loop="train_step")
    assert any(c.plan.pp > 1 for c in everything)
    chosen = autopar.plan(model, sample=x, topology="4xH100-SXM", loop="accumulates")
    assert chosen.pp == 1
    with pytest.raises(PlanError, match="pass loop= only"):
        autopar.plan(model, sample=x, topology="4xH100-SXM", loop="plain", uses_train_step=True)
    with pytest.warns(DeprecationWarning, match="allow_train_step= is deprecated"):
        autopar.candidates(model, sample=x, topology="4xH100-SXM", allow_train_step=False)


@pytest.mark.parametrize("loop, plan, message", [
    ("plain", Plan(micro_batch_size=2, grad_accum=2), "grad_accum=2"),
    ("accumulates", Plan(pp=2, pp_schedule="gpipe", micro_batch_size=2, grad_accum=2), "pp=2"),
    ("accumulates", Plan(micro_batch_size=2, grad_accum=2), None),
])
def test_wrap_checks_a_given_plan_against_the_declared_loop(loop, plan, message):
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if message is None:  # the loop runs it: applied
        autopar.wrap(model, sample=batch(0)[:4], plan=plan, loss_fn=lm_loss, verbose=False, loop=loop)
        assert autopar.plan_of(model).grad_accum == 2
        return
    with pytest.raises(PlanError, match=message):
        autopar.wrap(model, sample=batch(0)[:4], plan=plan, loss_fn=lm_loss, verbose=False, loop=loop)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert getattr(model, "_autopar_applied", None) is None  # refused before the model was touched
    if plan.pp == 1:  # left out, a given plan is applied as it is (the loop is the user's business)
        autopar.wrap(model, sample=batch(0)[:4], plan=plan, loss_fn=lm_loss, verbose=False)
        assert autopar.plan_of(model).grad_accum == 2


def test_wrap_refuses_both_spellings_of_the_loop():
    with pytest.raises(PlanError, match="pass loop= only"):
        autopar.wrap(make_model(), sample=batch(0), loss_fn=lm_loss, verbose=False, loop="train_step",
                     uses_train_step=True)
    with pytest.raises(PlanError, match="loop must be one of"):
        autopar.wrap(make_model(), sample=batch(0), loss_fn=lm_loss, verbose=False, loop="lightning")


def _legacy_digest(key: CacheKey, allow_train_step: bool) -> str:
    """The file name a key had before the loop had three values (plan_cache.CacheKey.digest, then)."""
    fields = {"model_fingerprint": key.model_fingerprint, "topology_fingerprint": key.topology_fingerprint,
              "global_batch_size": key.global_batch_size, "torch_version": key.torch_version,
              "allow_train_step": allow_train_step, "sample_signature": key.sample_signature}
    blob = json.dumps({"cache_schema": CACHE_SCHEMA_VERSION, "plan_schema": SCHEMA_VERSION, **fields},
                      sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def test_plan_cache_keys_of_the_two_old_loops_keep_their_files_and_read_back(tmp_path):
    args = dict(global_batch_size=8, torch_version="2.13.0")
    plain = cache_key("model-fp", "topo-fp", loop="plain", **args)
    train = cache_key("model-fp", "topo-fp", loop=Loop.TRAIN_STEP, **args)
    accum = cache_key("model-fp", "topo-fp", loop="accumulates", **args)
    assert plain.digest() == _legacy_digest(plain, False) and train.digest() == _legacy_digest(train, True)
    assert len({plain.digest(), train.digest(), accum.digest()}) == 3  # three loops, three files
    old = {k: v for k, v in train.to_dict().items() if k != "loop"} | {"allow_train_step": True}
    assert CacheKey.from_dict(old) == train and CacheKey.from_dict(train.to_dict()) == train
    # a file written then (key: allow_train_step: false) is found and read by wrap's lookup
    path = store(Plan(dp_shard=2, micro_batch_size=4), plain, directory=tmp_path)
    text = path.read_text().replace("loop: plain", "allow_train_step: false")
    assert "allow_train_step: false" in text
    path.write_text(text)
    hit, note = cached_plan_for("model-fp", "topo-fp", world_size=2, global_batch_size=8, loop="plain",
                                directory=tmp_path)
    assert hit is not None and hit.dp_shard == 2 and "using the plan cached at" in note
    # a framework that accumulates may use an accumulating plan, a plain loop may not
    store(Plan(micro_batch_size=4, grad_accum=2), accum, directory=tmp_path)
    with pytest.raises(Exception, match="loop='plain'"):
        store(Plan(micro_batch_size=4, grad_accum=2), plain, directory=tmp_path)


def test_older_probe_files_and_studies_read_as_loops():
    assert _probe_loop({"loop": "accumulates"}) is Loop.ACCUMULATES
    assert _probe_loop({"uses_train_step": True}) is Loop.TRAIN_STEP
    assert _probe_loop({"uses_train_step": False}) is Loop.PLAIN and _probe_loop({}) is None
    assert _upgraded_meta({"allow_train_step": False, "eager": True}) == {"loop": "plain", "eager": True}
    assert _upgraded_meta({"loop": "accumulates"}) == {"loop": "accumulates"}
