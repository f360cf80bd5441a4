"""The analytic memory model against the exact check, on CPU, for the plans of tests/cost/test_exact.py
(autopar's GPT: hidden 512, 8 blocks, sequence 512, vocabulary 8192; world sizes 1 to 64 on a fake process
group). The test asserts each is within 10%; this prints the errors.

    python bench/exact_vs_analytic.py [PLAN NAME ...] > bench/results/exact_vs_analytic_cpu_DATE.txt
"""

from __future__ import annotations

import datetime
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import autopar  # noqa: E402
from autopar.cost import Calibration, predict_profile  # noqa: E402
from tests.cost.test_exact import PLANS, _exact, _profile  # noqa: E402


def main() -> int:
    print(f"# analytic (CPU topology, default calibration) vs the exact check; {datetime.date.today()}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores")
    print(f"# python bench/exact_vs_analytic.py {' '.join(sys.argv[1:])}".rstrip())
    for name in sys.argv[1:] or list(PLANS):
        plan = PLANS[name]
        exact = _exact(name)
        predicted = predict_profile(_profile(), plan, autopar.Topology.cpu(plan.world_size), Calibration()).memory
        print(f"{name:50} exact {exact.peak_bytes / 2**20:7.1f} MiB  analytic {predicted.allocated_bytes / 2**20:7.1f} "
              f"MiB  {predicted.allocated_bytes / exact.peak_bytes - 1:+.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
