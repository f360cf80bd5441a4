"""Which kernel CUDA's scaled_dot_product_attention picks for the masks models pass it, and why the others are
refused (issue 10: T5's attention ran on the math kernel on the H200, where the CPU trace's stand-in assumed
the memory-efficient one). Each case: shapes and dtypes as a family builds them under bf16 autocast; for each
backend, torch's own check (`can_use_*` with debug=True: its warnings name the reason) and whether a forward
and backward run with only that backend enabled. One JSON line per case.

    python -m bench.sdpa_choice --out $OUT/sdpa_choice.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, L, D = 8, 8, 512, 64

# name: (mask shape or None, mask dtype, mask requires grad, dropout, head dim of v)
CASES: dict[str, tuple[tuple[int, ...] | None, torch.dtype | None, bool, float, int]] = {
    "no-mask": (None, None, False, 0.0, D),
    "no-mask-dropout": (None, None, False, 0.1, D),
    "bool-padding": ((B, 1, 1, L), torch.bool, False, 0.0, D),
    "float-padding": ((B, 1, 1, L), torch.bfloat16, False, 0.0, D),
    "float-bias-full-grad": ((B, H, L, L), torch.bfloat16, True, 0.0, D),
    "float-bias-full-grad-dropout": ((B, H, L, L), torch.bfloat16, True, 0.1, D),  # T5 with dropout 0.1
    "float-bias-broadcast-grad": ((1, H, L, L), torch.bfloat16, True, 0.0, D),
    "float-bias-fp32-grad": ((B, H, L, L), torch.float32, True, 0.0, D),
    "float-bias-no-grad-dropout": ((B, H, L, L), torch.bfloat16, False, 0.1, D),
    "mla-v128": (None, None, False, 0.0, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def _inputs(case: tuple) -> tuple[torch.Tensor, ...]:
    shape, dtype, grad, _, dv = case
    q, k = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, L, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if shape is None:
        return q, k, v, None
    if dtype == torch.bool:
        return q, k, v, torch.rand(shape, device="cuda") > 0.1
    return q, k, v, torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad)


def _check(name: str, q, k, v, mask, dropout: float) -> dict[str, Any]:
    """torch's own admission check for one backend, with the reasons it warns."""
    fn = {"flash": torch.backends.cuda.can_use_flash_attention,
          "efficient": torch.backends.cuda.can_use_efficient_attention,
          "cudnn": getattr(torch.backends.cuda, "can_use_cudnn_attention", None)}.get(name)
    if fn is None:
        return {}
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, False, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = bool(fn(params, True))
    return {"admitted": ok, "why_not": [str(w.message)[:300] for w in caught]}


def _runs(backend: SDPBackend, q, k, v, mask, dropout: float) -> dict[str, Any]:
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
            out.sum().backward()
        torch.cuda.synchronize()
        return {"runs": True}
    except Exception as exc:  # a refusal is the finding
        return {"runs": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _default_kernel(q, k, v, mask, dropout: float) -> str:
    """The kernel the default dispatch runs, read from the profiler's kernel names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout).sum().backward()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    for marker, kernel in (("flash", "flash"), ("fmha", "efficient"), ("cudnn", "cudnn"), ("softmax", "math")):
        if any(marker in n.lower() for n in names):
            return kernel
    return "unknown: " + ", ".join(names[:8])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sdpa_choice", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w") as out:
        for name, case in CASES.items():
            rec: dict[str, Any] = {"case": name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                   "device": torch.cuda.get_device_name(), "shape": [B, H, L, D],
                                   "mask": None if case[0] is None else [list(case[0]), str(case[1]), case[2]],
                                   "dropout": case[3], "v_head_dim": case[4]}
            q, k, v, mask = _inputs(case)
            try:
                rec["default_kernel"] = _default_kernel(q, k, v, mask, case[3])
            except Exception as exc:  # the default dispatch refusing the case is the finding
                rec["default_kernel"] = f"refused: {type(exc).__name__}: {str(exc)[:200]}"
            for label, backend in BACKENDS.items():
                rec[label] = {**_check(label, q, k, v, mask, case[3]), **_runs(backend, q, k, v, mask, case[3])}
            out.write(json.dumps(rec) + "\n")
            print(name, rec["default_kernel"], {k: rec[k].get("admitted", rec[k]["runs"]) for k in BACKENDS}, flush=True)


if __name__ == "__main__":
    main()
