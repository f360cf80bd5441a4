"""What a torch.compile'd step saves for backward, autopar's replay (autopar.profile.remat) against torch's own
partitioner, per zoo family, on the CPU.

For each family the model is built at its size on the meta device and one step traced twice on fake tensors (no
memory, no GPU): by autopar's profile (bf16 autocast as a GPU runs it), and by AOTAutograd with inductor's
decompositions and partitioner (`min_cut_rematerialization_partition`), its joint forward and backward traced under
bf16 autocast as torch.compile traces a step called under it. The partitioner's saved tensors are counted less the
weights and casts of them (autopar counts those apart). What this cannot see: attention masks that only dynamo's
tracing builds (Hugging Face's masking_utils; the profile counts those calls as unfused, `unfused`, beside), and
anything inductor's scheduler does after the partition.

    python -m bench remat-check --families t5,gpt2,segformer --batch 2
    python -m bench remat-check --families all --out bench/results/remat_check_<date>.jsonl

One JSON line per family; exit status 1 where a family is more than --bound apart.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from unittest import mock
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from autopar._util.batch import call_model
from bench._common import stamp
from bench.zoo import ZOO, build_model, family, make_sample


def partitioner_saved_bytes(model: nn.Module, call: Callable[[nn.Module, Any], Any], sample: Any,
                            loss_fn: Callable[[Any, Any], torch.Tensor], precision: str,
                            bf16_weights: tuple[str, ...] = ()) -> int:
    """Bytes torch's partitioner (min-cut, with inductor's decompositions) saves for backward of one step of
    `model` on `sample`, less the weights and casts of them; traced on fake tensors (a meta model works).
    `call(model, sample)` runs the forward; `precision` "bf16" (autocast, CUDA's float32 list) or "fp32";
    `bf16_weights`: parameters the forward reads through bf16 copies, as autopar's bf16 plans give those autocast
    does not reach (ModelProfile.bf16_weights: a mixture of experts' batched weights)."""
    from torch._functorch import aot_autograd as aot
    from torch._functorch import partitioners
    from torch._inductor import decomposition
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from autopar._util.kv_cache import kv_cache_off_while
    from autopar.profile.cuda_autocast import CudaAutocastPolicy
    from autopar.profile.flops import flash_like_sdpa

    names = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers()]
    leaves, spec = tree_flatten(sample)
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    graphs: dict[str, Any] = {}
    bf16 = precision == "bf16"

    def fw(gm, _inputs):
        graphs["fw"] = gm
        return aot.make_boxed_func(gm.forward)

    def bw(gm, _inputs):
        return aot.make_boxed_func(gm.forward)

    def step(*flat):
        state = dict(zip(names + buffers, flat[:len(names) + len(buffers)]))
        for name in bf16_weights if bf16 else ():
            state[name] = state[name].to(torch.bfloat16)
        values = list(leaves)
        for i, t in zip(tensor_at, flat[len(names) + len(buffers):]):
            values[i] = t
        batch = tree_unflatten(values, spec)
        with flash_like_sdpa(), (CudaAutocastPolicy("cpu") if bf16 else contextlib.nullcontext()):
            # the model with `state` in place of its parameters and buffers
            out = call(lambda *args, **kwargs: functional_call(model, state, args, kwargs), batch)
            return loss_fn(out, batch)

    compiled = aot.aot_function(step, fw_compiler=fw, bw_compiler=bw,
                                decompositions=decomposition.select_decomp_table(),
                                partition_fn=functools.partial(partitioners.min_cut_rematerialization_partition,
                                                               compiler="inductor"))
    # torch.compiler.is_compiling() answers True while the step is traced, as under dynamo: a model that checks
    # it takes the path torch.compile traces (transformers' masks skip their data-dependent checks then)
    with FakeTensorMode(allow_non_fake_inputs=True), kv_cache_off_while(model), \
            mock.patch("torch.compiler.is_compiling", lambda: True):
        flat = [torch.empty_like(p, device="cpu").requires_grad_(p.requires_grad) for p in model.parameters()]
        flat += [torch.zeros_like(b, device="cpu") for b in model.buffers()]
        flat += [torch.empty_like(leaves[i], device="cpu") if leaves[i].is_floating_point()
                 else torch.zeros_like(leaves[i], device="cpu") for i in tensor_at]
        # the joint forward and backward is traced at this call: under autocast, as torch.compile traces a step
        # called under it (its backward GEMMs autocast too)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = compiled(*flat)
        loss.backward()
    graph = graphs["fw"].graph
    outputs = next(n for n in graph.nodes if n.op == "output").args[0][1:]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    weights = set(placeholders[:len(names)])

    from_weights = set(weights)  # the weights and what is computed from them alone (casts, transposes), in
    for node in graph.nodes:  # the graph's order (a node's inputs come before it): no recursion on a deep graph
        if node.op == "call_function" and node.all_input_nodes and all(a in from_weights for a in node.all_input_nodes):
            from_weights.add(node)

    total = 0
    for node in outputs:
        val = getattr(node, "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and node not in placeholders and node not in from_weights:
            total += val.numel() * val.element_size()
    return total


def check(name: str, batch: int, precision: str = "bf16") -> dict[str, Any]:
    """One family: autopar's compiled saved bytes against the partitioner's, and the eager ones beside."""
    from autopar.profile import profile_model

    fam = family(name)
    model = build_model(fam, "realistic")
    sample = make_sample(fam, "realistic", batch)
    start = time.perf_counter()
    profile = profile_model(model, sample, loss_fn=fam.loss_fn, precision=precision, warn=False)
    profile_s = time.perf_counter() - start
    if profile.compiled_saved_bytes_outside_blocks is None or \
            any(b.compiled_saved_bytes is None for b in profile.blocks):
        return {"family": name, "batch": batch, "error": "the profile has no compiled partition"}
    ours = sum(b.compiled_saved_bytes for b in profile.blocks) + profile.compiled_saved_bytes_outside_blocks
    unfused = sum(b.compiled_unfused_bytes for b in profile.blocks)
    start = time.perf_counter()
    theirs = partitioner_saved_bytes(model, call_model, sample, fam.loss_fn, precision, tuple(profile.bf16_weights))
    return {"family": name, "batch": batch, "precision": precision, "remat_bytes": ours, "unfused_bytes": unfused,
            "partitioner_bytes": theirs, "eager_bytes": profile.saved_bytes,
            "error_rel": (ours - unfused) / theirs - 1 if theirs else None,
            "profile_s": round(profile_s, 1), "partitioner_s": round(time.perf_counter() - start, 1)}


def report(paths: list[str]) -> str:
    """The Markdown table of one or more JSON-lines files of this suite: one row per family and precision."""
    rows = [json.loads(line) for path in paths for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    stamps = sorted({(r.get("date", "")[:10], r.get("torch", ""), r.get("commit", "")[:7], r.get("command", ""))
                     for r in rows})
    out = ["# What a compiled step saves: autopar's replay (autopar.profile.remat) against torch's partitioner", ""]
    out += [f"{d}, cpu, torch {t}, code {c}: `{cmd}`" for d, t, c, cmd in stamps]
    out += ["", "MiB saved for backward on fake tensors at each family's realistic size, weights and their casts left "
            "out; `unfused`: autopar's count of attention calls whose mask only dynamo builds (left out of the error).",
            "", "| family | precision | batch | autopar MiB | of it unfused | partitioner MiB | eager MiB | error |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r.get("error_rel") is None:
            out.append(f"| {r['family']} | {r.get('precision', '-')} | {r['batch']} | - | - | - | - | "
                       f"{str(r.get('error', ''))[:90]} |")
            continue
        mib = [f"{r[k] / 2**20:.1f}" for k in ("remat_bytes", "unfused_bytes", "partitioner_bytes", "eager_bytes")]
        out.append(f"| {r['family']} | {r['precision']} | {r['batch']} | {' | '.join(mib)} | {r['error_rel']:+.1%} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench remat-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="all", help="comma-separated zoo families, or 'all'")
    ap.add_argument("--batch", type=int, default=2, help="samples per step (saved bytes scale with it)")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--bound", type=float, default=0.15, help="the largest |error| that passes")
    ap.add_argument("--out", help="a JSON-lines file to append each family's line to")
    ap.add_argument("--report", nargs="+", help="print the Markdown table of these JSON-lines files and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report), end="")
        return 0
    names = [f.name for f in ZOO if f.unavailable() is None] if args.families == "all" else args.families.split(",")
    meta = stamp()
    missed = []
    for name in names:
        try:
            rec = check(name, args.batch, args.precision)
        except Exception as exc:  # one family's failure is its line, not the run's end
            rec = {"family": name, "batch": args.batch, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rec.update(date=meta["date"], torch=meta["torch"], commit=meta["commit"], command=meta["command"])
        err = rec.get("error_rel")
        if err is not None and abs(err) > args.bound:
            missed.append(name)
        mib = {k: round(rec[k] / 2**20, 1) for k in ("remat_bytes", "unfused_bytes", "partitioner_bytes",
                                                      "eager_bytes") if isinstance(rec.get(k), int)}
        print(f"{name:14s} {json.dumps(mib)} error {err:+.1%}" if err is not None else f"{name:14s} {rec.get('error')}",
              flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
    print(f"{len(missed)} of {len(names)} beyond {args.bound:.0%}: {', '.join(missed) or 'none'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
