"""How a test launches several processes without a port collision, so that tests run side by side (`pytest -n 4`).

torchrun's `--standalone` (torch 2.11 to 2.14) starts its rendezvous store on `localhost:0` and the
workers' store (their MASTER_PORT, served by the launcher: TORCHELASTIC_USE_AGENT_STORE) on port 0 too:
the operating system picks each port as it binds it. No port is chosen before it is bound, so two launches
at the same moment cannot take the same one - as `--master-port` with a port found free a moment earlier can,
and as torchrun's default 29500 always does.
"""

from __future__ import annotations

import sys


def torchrun_argv(nproc_per_node: int) -> list[str]:
    """The start of a torchrun command line for `nproc_per_node` processes on this machine, ports chosen by
    the OS: append the script and its arguments."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}"]
