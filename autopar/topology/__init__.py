"""autopar.topology: the hardware a plan is made for (docs/topology.md).

  device.py      DeviceSpec (one GPU's figures) and the validators the frozen values share
  gpus.py        the table of known GPUs, as data, each figure with its datasheet beside it
  cpu.py         the CPU pseudo-device (nominal figures, this machine's RAM)
  spec.py        names and spec strings: lookup_device("NVIDIA H100 80GB HBM3"), parse_spec("2x8xH100")
  nvml.py        what NVML (or torch) says about this node's GPUs and their links
  microbench.py  measuring a GPU that is not in the table
  detect.py      Topology.detect's reading of this machine (torchrun's environment, the node's GPUs)
  topology.py    Topology: nodes x GPUs per node x DeviceSpec, and the network
  markdown.py    the table as Markdown for docs/topology.md (only tests use it)

Importers use the names below. To replace the measurement of an unknown GPU in detection (tests), patch
`autopar.topology.detect._measure_device`.
"""

from __future__ import annotations

from .device import DeviceSpec
from .gpus import _TABLE as _TABLE  # private names the tests reach into, re-exported explicitly
from .markdown import _markdown_names as _markdown_names
from .markdown import _markdown_table as _markdown_table
from .microbench import _measure_device as _measure_device
from .spec import lookup_device
from .topology import Topology, resolve_topology

__all__ = ["DeviceSpec", "Topology", "lookup_device", "resolve_topology"]
