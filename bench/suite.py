"""Issue 14's suite: autopar's plan against the hand choices and against its own candidate grid, on one GPU.

    python -m bench suite --out $OUT/suite.jsonl [--models ...] [--modes ...] [-- ZOO FLAGS]

Each model is a zoo family (bench/zoo.py: ZOO, and SIZED for GPT-2 355M / 1.5B and Llama 3B) measured by
bench/zoo_h200.py in its modes: "fp32" (by hand, no autocast), "hand" (bf16 autocast + fused AdamW), "hand_compile"
(the same + torch.compile(model)), "wrap" (autopar.wrap with no tuning), "oracle" (every plan of autopar's own
one-GPU candidate space for the batch, each measured; the fastest) and "tune" (autopar.autotune's trials in the
process, then wrap given the study's best plan; not in the default modes: its trials outlast a call's family timeout
on the large models). A launched script's `autopar tune` is bench/tune_h200.py's suite. The zoo's records go to --out (JSON lines, one a mode as it ends: a cut call keeps
what finished); then `suite_<date>.json` (a list of records with keys model, mode, per_s, per_s_unit, step_s,
peak_bytes, plan, status, device, torch, date, command) and `suite_<date>.md` (per model: each mode's rate, wrap
against the best hand column and against the oracle) are written beside it. Flags after `--` go to the zoo script
(e.g. --time-budget-s 480 --family-timeout-s 200, --resume FILE, --device cpu --size tiny for a smoke run).

    python -m bench suite --report FILE.jsonl [FILE.jsonl ...]   # the JSON and Markdown of earlier records
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from bench import zoo_h200
from bench._common import results_path

#: GPT-2 124M, 355M and 1.5B; Llama 1B (Llama-3.2-1B's shape, 8 x 2048 tokens: the issue's 75k tokens/s point) and
#: 3B; an encoder, a vision CNN and a vision transformer; an MoE; and a model the hand recipe cannot fit (Llama 3B
#: at 16 x 2048 tokens: 169 GiB predicted by hand on one H200, autopar's checkpointed plans fit)
MODELS = ("gpt2", "gpt2-355m", "gpt2-1.5b", "llama", "llama-3b", "bert", "resnet", "vit", "qwen2-moe", "llama-3b-b16")
MODES = ("fp32", "hand", "hand_compile", "wrap", "oracle", "tune")
#: without --modes: "tune" runs autotune's trials, a compile warm-up each (about a minute a trial on the large
#: models), more than one call's family timeout; asked for with --modes ...,tune (and a longer --family-timeout-s)
DEFAULT_MODES = MODES[:-1]
HAND = ("hand", "hand_compile")  # the best hand column: issue 14's "at least as fast as" bar


def suite_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A zoo record in the suite's keys: the rate in tokens/s where the sample has tokens, else samples/s."""
    tokens = rec.get("tokens_per_s")
    rate, unit = (tokens, "tokens/s") if tokens else (rec.get("samples_per_s"), "samples/s")
    return {"model": rec["family"], "mode": rec["mode"], "per_s": rate, "per_s_unit": unit,
            "step_s": rec.get("step_s"), "peak_bytes": rec.get("peak_allocated_bytes"), "plan": rec.get("plan_short"),
            "status": rec.get("status"), "error": rec.get("error"), "batch": rec.get("batch"),
            "device": rec.get("device"), "torch": rec.get("torch"), "date": rec.get("date"),
            "command": rec.get("command"), **({"grid": rec["grid"]} if "grid" in rec else {})}


def read(paths: list[Path]) -> list[dict[str, Any]]:
    """The suite records of zoo JSON-lines files, the last record of each (model, mode) kept."""
    kept: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "family" in rec and "mode" in rec:
                    kept[rec["family"], rec["mode"]] = suite_record(rec)
    return list(kept.values())


def _rate(recs: dict[str, dict[str, Any]], mode: str) -> float | None:
    rec = recs.get(mode)
    return rec["per_s"] if rec and rec["status"] == "ok" and rec["per_s"] else None


def ratios(recs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """One model's records by mode -> wrap over the best hand column, over hand_compile, and over the oracle; the
    tuned plan over the oracle."""
    wrap = _rate(recs, "wrap")
    hands = [r for r in (_rate(recs, m) for m in HAND) if r]
    oracle, compiled, tuned = _rate(recs, "oracle"), _rate(recs, "hand_compile"), _rate(recs, "tune")
    return {"wrap_over_best_hand": wrap / max(hands) if wrap and hands else None,
            "wrap_over_hand_compile": wrap / compiled if wrap and compiled else None,
            "wrap_over_oracle": wrap / oracle if wrap and oracle else None,
            "tune_over_oracle": tuned / oracle if tuned and oracle else None}


def markdown(records: list[dict[str, Any]]) -> str:
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        by_model.setdefault(rec["model"], {})[rec["mode"]] = rec
    first = records[0] if records else {}
    lines = [f"# Issue 14's suite: {first.get('device')}, torch {first.get('torch')}, {first.get('date')}", "",
             f"    {first.get('command')}", "",
             "Each mode's rate (tokens/s, or samples/s where the sample has no tokens; a status where it did not run); "
             "the ratios are wrap's rate over the best of hand and hand_compile, over hand_compile, and over the "
             "oracle (the fastest of autopar's own candidate plans, each measured); the last, autotune's plan over the oracle.",
             "",
             "| model | batch | " + " | ".join(MODES) + " | wrap plan | wrap / best hand | wrap / hand_compile | "
             "wrap / oracle | oracle plan | tune / oracle |",
             "| --- | ---: | " + " | ".join("---:" for _ in MODES) + " | --- | ---: | ---: | ---: | --- | ---: |"]

    def cell(rec: dict[str, Any] | None) -> str:
        if rec is None:
            return "-"
        return f"{rec['per_s']:,.0f}" if rec["status"] == "ok" and rec["per_s"] else str(rec["status"])

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for model, recs in by_model.items():
        r = ratios(recs)
        batch = next((rec.get("batch") for rec in recs.values() if rec.get("batch")), "-")
        lines.append(f"| {model} | {batch} | " + " | ".join(cell(recs.get(m)) for m in MODES)
                     + f" | {(recs.get('wrap') or {}).get('plan') or '-'} | {ratio(r['wrap_over_best_hand'])} | "
                     f"{ratio(r['wrap_over_hand_compile'])} | {ratio(r['wrap_over_oracle'])} | "
                     f"{(recs.get('oracle') or {}).get('plan') or '-'} | {ratio(r['tune_over_oracle'])} |")
    return "\n".join(lines) + "\n"


def write(records: list[dict[str, Any]], out_dir: Path) -> tuple[Path, Path]:
    """suite_<date>.json and suite_<date>.md in `out_dir`."""
    stem = out_dir / f"suite_{datetime.date.today().isoformat()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(records, indent=1, default=str) + "\n")
    md_path.write_text(markdown(records))
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    zoo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m bench suite", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated zoo families (default: {', '.join(MODELS)})")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--out", default=None, help="the zoo's JSON-lines file (default: $OUT/suite.jsonl); the JSON "
                                                "and Markdown go beside it")
    ap.add_argument("--report", nargs="+", type=Path, default=None, help="write the JSON and Markdown of these "
                                                                         "JSON-lines files and exit")
    args = ap.parse_args(own)
    if args.report:
        for path in write(read(args.report), args.report[0].parent):
            print(f"wrote {path}")
        return 0
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        raise SystemExit(f"unknown suite mode {', '.join(bad)}; the suite's modes are {', '.join(MODES)}")
    out = results_path(args.out, "suite.jsonl")
    rc = zoo_h200.main(["--families", args.models, "--modes", args.modes, "--out", str(out), *zoo_args])
    if out.exists():
        for path in write(read([out]), out.parent):
            print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
