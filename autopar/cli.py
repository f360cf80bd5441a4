"""The `autopar` command: `autopar demo | topology | plan`."""

from __future__ import annotations

import argparse
import sys


def _topology(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="autopar topology",
                                description="Print the hardware autopar plans for: detected, or a spec.")
    p.add_argument("--cluster", default=None, help="a spec like 4x8xH100-SXM instead of detecting")
    p.add_argument("--yaml", action="store_true", help="print as YAML")
    args = p.parse_args(argv)
    from .topology import Topology

    topo = Topology.from_spec(args.cluster) if args.cluster else Topology.detect()
    if args.yaml:
        import yaml

        print(yaml.safe_dump(topo.to_dict(), sort_keys=False), end="")
    else:
        print(topo.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": None, "topology": _topology}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: autopar {demo,topology} [options]\n\n"
              "  demo       train a built-in GPT under the plan autopar chooses (2 CPU processes, or the GPUs here)\n"
              "  topology   print the hardware autopar sees (or --cluster SPEC)\n\n"
              "autopar COMMAND --help describes a command's options.", file=sys.stderr if argv else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    from .errors import AutoparError

    try:
        if argv[0] == "demo":
            from .demo import main as demo_main

            return demo_main(argv[1:])
        return commands[argv[0]](argv[1:])
    except AutoparError as exc:
        print(f"autopar {argv[0]}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
