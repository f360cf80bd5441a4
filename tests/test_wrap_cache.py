"""wrap's own cache (autopar/wrap_cache.py, issue 33: "a second wrap of the same model plans from the cache"): the
second wrap of the same model for the same job takes the first one's plan without tracing or measuring; anything
the plan depends on (shapes, dtypes, frozen weights, mode, the forward's or the loss's code, the batch) misses; a
plan the tuner cached wins; a tampered file is refused; a cache that cannot be written costs a warning only."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import api, planning, wrap_cache
from autopar.errors import CacheError
from autopar.plan_cache import cache_key as plan_cache_key
from autopar.plan_cache import store as store_tuned


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class OtherForward(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # no residual: another step, the same parameters
        return self.head(x)


def _loss(out, sample):
    return out.float().pow(2).mean()


def _other_loss(out, sample):
    return out.float().abs().mean()


class _Calls:
    """Counts wrap's traces (profile_model with trace on) and races."""

    def __init__(self, monkeypatch) -> None:
        self.traces = self.races = 0
        real_profile, real_race = api.profile_model, api.race_compile

        def profile(*args, **kwargs):
            if kwargs.get("trace", True):
                self.traces += 1
            return real_profile(*args, **kwargs)

        def race(*args, **kwargs):
            self.races += 1
            return real_race(*args, **kwargs)

        monkeypatch.setattr(api, "profile_model", profile)
        monkeypatch.setattr(planning, "profile_model", profile)  # wrap's profile (planning.base_profile)
        monkeypatch.setattr(api, "race_compile", race)


def _wrap(model=None, sample=None, **kwargs):
    torch.manual_seed(0)
    model = Net() if model is None else model
    sample = torch.randn(8, 16) if sample is None else sample
    kwargs.setdefault("loss_fn", _loss)
    return autopar.wrap(model, sample=sample, verbose=False, **kwargs)


def _entries() -> list:
    folder = wrap_cache.cache_subdir("wrapped", create=False)
    return [] if folder is None else sorted(folder.glob("*.yaml"))


def test_the_second_wrap_of_a_model_takes_the_first_ones_plan_without_tracing_or_measuring(monkeypatch):
    calls = _Calls(monkeypatch)
    first = autopar.plan_of(_wrap(measure=True))
    assert calls.traces >= 1 and calls.races == 1 and len(_entries()) == 1
    assert "measured_forward_backward_s" in first.prediction
    calls.traces = calls.races = 0
    model = _wrap(measure=True)
    second = autopar.plan_of(model)
    assert calls.traces == 0 and calls.races == 0
    assert second == first  # the same strategy
    assert second.prediction["step_s"] == first.prediction["step_s"]  # as measured the first time
    assert second.prediction["cached_at"] and second.prediction["measuring_s"] == 0.0
    # the first wrap's planning phases are its own: the second wrap traced nothing
    assert "tracing" in first.prediction["planning_phases_s"] and "planning_phases_s" not in second.prediction
    assert "wrap's cache of" in second.describe()
    # the profile keeps the traced FLOPs (MFU is computed from them)
    traced = api.profile_model(Net(), torch.randn(8, 16), loss_fn=_loss, warn=False)
    assert traced.flops > 0 and autopar.applied(model).profile.flops == pytest.approx(traced.flops)


def test_a_cached_wraps_summary_says_where_its_flops_come_from_and_claims_no_activation_bytes():
    """The profile a cached wrap plans from is untraced: its summary gives the FLOPs traced when the plan was stored,
    says so, and shows no activation bytes (it does not say "FLOPs unknown (zero here)" beside the FLOPs it shows)."""
    from autopar.decision import CACHED_NOTE
    from autopar.profile.build import NOT_TRACED_NOTE

    _wrap()
    profile = autopar.applied(_wrap()).profile
    text = profile.describe()
    assert CACHED_NOTE in profile.notes and NOT_TRACED_NOTE not in profile.notes and profile.flops > 0
    assert "activation bytes not traced" in text and "MiB saved for backward" not in text

def test_a_cached_quiet_wrap_warns_the_structures_note_as_the_first_one_did():
    """A model without repeated blocks, wrapped quietly twice: the second wrap, from the cache, warns the same note
    (it traces nothing, but the note is the structure's)."""
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    said = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _wrap(mlp())
        said.append([str(w.message) for w in caught if "no repeated blocks" in str(w.message)])
    assert autopar.plan_of(model).prediction["cached_at"]  # the second came from the cache
    assert len(said[0]) == 1 and said[1] == said[0]


def test_a_model_wrapped_from_the_cache_trains_as_the_first_one():
    def losses(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(3)
        out = []
        for _ in range(3):
            loss = _loss(model(torch.randn(8, 16, generator=gen)), None)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    first = losses(_wrap())
    second = _wrap()
    assert autopar.plan_of(second).prediction.get("cached_at")
    assert losses(second) == first


@pytest.mark.parametrize("change", ["sample shape", "sample dtype", "width", "frozen layer", "eval mode",
                                    "forward code", "loss code", "global batch", "disabled"])
def test_what_the_plan_depends_on_misses_the_cache(change, monkeypatch):
    _wrap()
    calls = _Calls(monkeypatch)
    model, sample, kwargs = Net(), torch.randn(8, 16), {}
    if change == "sample shape":
        sample = torch.randn(8, 3, 16)
    elif change == "sample dtype":
        sample = sample.double()
        model = model.double()
    elif change == "width":
        model, sample = Net(width=32), torch.randn(8, 32)
    elif change == "frozen layer":
        model.layers[0].requires_grad_(False)
    elif change == "eval mode":
        model.eval()
    elif change == "forward code":
        model = OtherForward()
    elif change == "loss code":
        kwargs["loss_fn"] = _other_loss
    elif change == "global batch":
        kwargs["global_batch_size"] = 16
    elif change == "disabled":
        monkeypatch.setenv(wrap_cache.DISABLE_ENV, "1")
    _wrap(model, sample, **kwargs)
    assert calls.traces >= 1, f"a {change} took the cached plan"


def test_a_plan_the_tuner_cached_for_the_same_job_wins_over_wraps_own(monkeypatch):
    model = _wrap()
    state = autopar.applied(model)
    tuned = autopar.plan_of(model).replace(micro_batch_size=4, grad_accum=2, prediction=None)
    # the tuner caches under the traced key (model, topology, batch, loop)
    profile = api.profile_model(Net(), torch.randn(8, 16), loss_fn=_loss, warn=False)
    store_tuned(tuned, plan_cache_key(profile, state.topology, global_batch_size=8, loop="train_step"))
    store_tuned(tuned.replace(grad_accum=1, micro_batch_size=8),
                plan_cache_key(profile, state.topology, global_batch_size=8, loop="plain"))
    calls = _Calls(monkeypatch)
    again = _wrap()
    assert calls.traces >= 1  # planned afresh, so the tuner's plan was found
    assert autopar.plan_of(again).prediction is None or "cached_at" not in (autopar.plan_of(again).prediction or {})


def _only_entry() -> os.PathLike:
    (entry,) = _entries()
    return entry


def test_a_cache_file_writable_by_others_is_refused_with_the_remedy():
    _wrap()
    path = _only_entry()
    os.chmod(path, 0o666)
    with pytest.raises(CacheError, match="can be written by others"):
        _wrap()


def test_a_cache_file_copied_over_another_keys_name_is_refused():
    _wrap()
    first = _only_entry()
    _wrap(Net(width=32), torch.randn(8, 32))
    other = next(p for p in _entries() if p != first)
    other.write_bytes(first.read_bytes())
    with pytest.raises(CacheError, match="another model or job"):
        _wrap(Net(width=32), torch.randn(8, 32))


def test_a_cache_file_with_a_yaml_tag_is_refused_not_run():
    _wrap()
    path = _only_entry()
    path.write_text(path.read_text() + "\nx: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(CacheError):
        _wrap()


def test_a_cache_that_cannot_be_written_costs_one_warning_and_the_model_trains(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wrap_cache, "atomic_write_text", refuse)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _wrap()
    assert [str(w.message) for w in seen if "was not cached" in str(w.message)]
    loss = _loss(model(torch.randn(8, 16)), None)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_key_ignores_the_weights_values_and_sees_the_structure():
    a, b = Net(), Net()
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    x = torch.randn(8, 16)
    assert wrap_cache.structure_digest(a, x) == wrap_cache.structure_digest(b, x)
    assert wrap_cache.structure_digest(a, x) != wrap_cache.structure_digest(Net(depth=3), x)
    assert wrap_cache.structure_digest(a, x) != wrap_cache.structure_digest(a, {"x": x})
