"""What a study has decided about each plan: measured (with its step and throughput), failed, or pruned.

The engine (autopar.tune.engine) reads it from the study's trials when it starts and adds to it as trials
end; a plan decided once is never run again (docs/tuning.md, "How a study runs", point 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .schema import FAILED


@dataclass(frozen=True)
class Measured:
    """A plan measured ok: the trial that measured it, its step and its throughput (tokens/s or samples/s)."""

    key: str
    number: int
    step_s: float
    throughput: float


@dataclass(frozen=True)
class Decision:
    """How a plan was decided: "ok", "failed" or "pruned", by trial `number`."""

    kind: str
    number: int


@dataclass
class Ledger:
    """The decided plans of a study, by plan key."""

    ok: dict[str, Measured] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)  # key -> the trial number
    pruned: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_trials(cls, trials: Iterable[Any], key_of: Callable[[Any], str | None]) -> "Ledger":
        """The decisions of an Optuna study's trials (repeats, which decide nothing, are skipped)."""
        from optuna.trial import TrialState  # lazy: optuna loads when a study runs, not on `import autopar`

        ledger = cls()
        for t in trials:
            ua = t.user_attrs
            key = key_of(t)
            if ua.get("repeat_of") is not None or key is None:
                continue
            if t.state == TrialState.COMPLETE:
                ledger.ok.setdefault(key, Measured(key, t.number, float(ua["measured"]["step_s"]), float(t.value)))
            elif t.state == TrialState.FAIL and ua.get("status") in FAILED:
                ledger.failed.setdefault(key, t.number)
            elif t.state == TrialState.PRUNED:
                ledger.pruned.setdefault(key, t.number)
        return ledger

    @property
    def measured(self) -> int:
        """Plans measured (ok or failed): what the trial budget counts."""
        return len(self.ok) + len(self.failed)

    def decided(self, key: str) -> Decision | None:
        if key in self.ok:
            return Decision("ok", self.ok[key].number)
        if key in self.failed:
            return Decision("failed", self.failed[key])
        if key in self.pruned:
            return Decision("pruned", self.pruned[key])
        return None

    def best(self) -> Measured | None:
        """The plan measured fastest so far."""
        return max(self.ok.values(), key=lambda r: r.throughput) if self.ok else None
