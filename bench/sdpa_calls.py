"""What a zoo family's own attention passes to scaled_dot_product_attention under bf16 autocast, and which
aten attention and softmax ops then run, with their dtypes (issue 10: T5 ran SDPA's math kernel on the H200,
in fp32, where the CPU trace's stand-in assumed the memory-efficient kernel in bf16). One forward and
backward of the family's tiny-batch realistic model on the device; one JSON line per family.

    python -m bench.sdpa_calls --families t5,swin,bert --out $OUT/sdpa_calls.jsonl
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench import zoo

_SDPA = F.scaled_dot_product_attention
_WATCHED = ("attention", "softmax")


def _describe(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return [list(t.shape), str(t.dtype).removeprefix("torch."), bool(t.requires_grad)]
    return t if isinstance(t, (int, float, bool, type(None))) else type(t).__name__


class SdpaArgs(TorchFunctionMode):
    """Records the arguments of every F.scaled_dot_product_attention call (distinct ones, counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            seen = {"args": [_describe(a) for a in args], "kwargs": {k: _describe(v) for k, v in kwargs.items()},
                    "autocast": torch.is_autocast_enabled(args[0].device.type)}
            self.calls[json.dumps(seen)] += 1
        return func(*args, **kwargs)


class AtenOps(TorchDispatchMode):
    """Counts the aten ops named like attention or softmax, with their tensor arguments' dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(w in name for w in _WATCHED):
            dtypes = [str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)]
            self.ops[f"{name} {dtypes}"] += 1
        return func(*args, **(kwargs or {}))


def probe(name: str, batch: int, device: torch.device) -> dict[str, Any]:
    family = zoo.FAMILIES[name]
    torch.manual_seed(0)
    model = family.build("realistic").to(device)
    sample = zoo.make_sample(family, "realistic", batch)
    sample = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
    calls, ops = SdpaArgs(), AtenOps()
    with calls, ops, torch.autocast(device.type, dtype=torch.bfloat16):
        loss = family.loss_fn(zoo.call(model, sample), sample)
    with ops:
        loss.backward()
    return {"family": name, "batch": batch, "device": str(device), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "sdpa_calls": [{"count": n, **json.loads(k)} for k, n in calls.calls.items()],
            "aten_ops": dict(ops.ops)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sdpa_calls", description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="t5")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with open(args.out, "w") as out:
        for name in args.families.split(","):
            try:
                rec = probe(name, args.batch, device)
            except Exception as exc:  # recorded; the next family still runs
                rec = {"family": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            out.write(json.dumps(rec) + "\n")
            print(json.dumps(rec, indent=1)[:3000], flush=True)


if __name__ == "__main__":
    main()
