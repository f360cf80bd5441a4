"""The analytic memory model against the exact check, on CPU, for the plans of tests/test_exact.py
(autopar's GPT: hidden 512, 8 blocks, sequence 512, vocabulary 8192; world sizes 1 to 64 on a fake process
group). The test asserts each is within 10%; this prints the errors.

    python -m bench.exact_vs_analytic [PLAN NAME ...] > bench/results/exact_vs_analytic_cpu_DATE.txt
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

import autopar
from autopar.cost import Calibration, predict_profile
from tests.test_exact import PLANS, _exact, _profile  # the test's plans, so that this prints what it asserts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="*", metavar="PLAN", help=f"plan names (default: all): {', '.join(PLANS)}")
    args = ap.parse_args()
    print(f"# analytic (CPU topology, default calibration) vs the exact check; {datetime.date.today()}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores")
    print(f"# python -m bench.exact_vs_analytic {' '.join(args.plans)}".rstrip())
    for name in args.plans or list(PLANS):
        plan = PLANS[name]
        exact = _exact(name)
        predicted = predict_profile(_profile(), plan, autopar.Topology.cpu(plan.world_size), Calibration()).memory
        print(f"{name:50} exact {exact.peak_bytes / 2**20:7.1f} MiB  analytic {predicted.allocated_bytes / 2**20:7.1f} "
              f"MiB  {predicted.allocated_bytes / exact.peak_bytes - 1:+.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
