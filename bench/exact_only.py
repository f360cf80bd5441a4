"""Exact checks only, for configurations of bench/validate_h200.py (their real runs are recorded there)."""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autopar
from validate_h200 import CONFIGS, build, sample
from autopar.exact import exact_memory
for i in [int(a) for a in sys.argv[1:]]:
    name, kw = CONFIGS[i]
    t = time.perf_counter()
    try:
        ex = exact_memory(lambda: build(name), sample(name, 1, "cpu"), autopar.Plan(**{"precision": "bf16", **kw}), device="cuda")
        rec = dict(model=name, **kw, exact_alloc=ex.peak_bytes, exact_parts=ex.by_category, exact_s=time.perf_counter() - t)
    except Exception as exc:
        rec = dict(model=name, **kw, exact_error=repr(exc)[:300])
    print(json.dumps(rec), flush=True)
    open(os.path.join(os.environ.get("OUT", "/tmp"), "exact.jsonl"), "a").write(json.dumps(rec) + "\n")
