"""The zoo's measured steps against their traced FLOPs at peak and their roofline time (issue 10): why the
CPU test of the realistic plans bounds a prediction by 10x the roofline, not by 10x the FLOPs at peak.

    python -m bench.zoo_roofline bench/results/zoo_h200_wrap_DATE.jsonl [more.jsonl ...] [--families a,b]

For every family with a measured wrap step in the records (the latest one, as bench/zoo_h200's report picks
it), the family is traced on this machine at its realistic size under the plan's precision, and the table
gives the measured step over the step's FLOPs at the device's bf16 peak and over its roofline time
(bench.zoo.roofline_s: per op, FLOPs at its dtype's peak or bytes at the HBM bandwidth, whichever is larger),
with the prediction's ratios beside them. The device is the one the records name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import autopar
from autopar.topology import lookup_device
from bench.zoo import build_model, family, make_sample, roofline_s
from bench.zoo_h200_report import latest_wraps, read_records


def row(name: str, rec: dict) -> str:
    f = family(name)
    why = f.unavailable()
    if why is not None:  # timm and torchvision on a CPU-only torch
        return f"| {name} | {rec['batch']} | {rec['plan_short']} | {rec['step_s'] * 1e3:.1f} | not traced here: {why} |"
    device = lookup_device(rec["device"])
    assert device is not None, f"no spec for the records' device {rec['device']!r}"
    precision = "fp32" if rec["plan"]["precision"] == "fp32" else "bf16"
    profile = autopar.profile_model(build_model(f, "realistic"), make_sample(f, "realistic", rec["batch"]),
                                    loss_fn=f.loss_fn, precision=precision, warn=False, graphs=False)
    peak_s = profile.flops / device.peak_flops("bf16" if device.supports("bf16") else "fp32")
    roof_s = roofline_s(profile, device)
    measured, predicted = rec["step_s"], rec["predicted_step_s"]
    return (f"| {name} | {rec['batch']} | {rec['plan_short']} | {measured * 1e3:.1f} | {peak_s * 1e3:.2f} | "
            f"{roof_s * 1e3:.2f} | {measured / peak_s:.1f} | {measured / roof_s:.2f} | {predicted / peak_s:.1f} | "
            f"{predicted / roof_s:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.zoo_roofline", description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="bench/zoo_h200 records (JSON lines)")
    parser.add_argument("--families", default="", help="comma-separated families (default: every measured one)")
    args = parser.parse_args(argv)
    chosen = set(filter(None, args.families.split(",")))
    print("| family | batch | wrap plan | step ms | FLOPs at peak ms | roofline ms | step / peak | step / roofline "
          "| predicted / peak | predicted / roofline |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rec in latest_wraps(read_records(args.records)):
        if not chosen or rec["family"] in chosen:
            print(row(rec["family"], rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
