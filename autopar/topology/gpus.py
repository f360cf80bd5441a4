"""The table of known GPUs, as data: each GPU's datasheet figures with the datasheet named beside every
number, and the names NVML, torch and people use for it. No logic lives here (lookup is in spec.py)."""

from __future__ import annotations

from .device import DeviceSpec

# ---- the table of known GPUs ----------------------------------------------------------------------
# Dense (no sparsity) datasheet peaks. Where a datasheet gives only the 2:4-sparse tensor-core figure,
# the dense figure is half of it. Memory sizes are the datasheets' decimal GB (10^9 bytes), a little
# under what the GPU has (NVIDIA's "80 GB" is 80 GiB less reserved space); detection replaces them with
# what NVML reports. Compute capabilities are from NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus).
# Link bandwidths are one direction per GPU: NVLink figures are NVIDIA's bidirectional totals / 2;
# PCIe x16 is 32e9 (Gen4) or 64e9 (Gen5) nominal per direction.
_TABLE: dict[str, DeviceSpec] = {
    "A100-SXM-40GB": DeviceSpec(
        name="A100-SXM-40GB",
        # memory: 40 GB HBM2, bytes (NVIDIA A100 datasheet)
        memory_bytes=40_000_000_000,
        # compute capability 8.0 (CUDA GPUs list)
        compute_capability=(8, 0),
        # bf16 tensor core, FLOP/s dense: 312 TFLOP/s (NVIDIA A100 datasheet)
        bf16_flops=312e12,
        # fp8: none, Ampere has no fp8 tensor cores (NVIDIA A100 datasheet)
        fp8_flops=None,
        # fp32 non-tensor, FLOP/s: 19.5 TFLOP/s (NVIDIA A100 datasheet)
        fp32_flops=19.5e12,
        # tf32 tensor core, FLOP/s dense: 156 TFLOP/s (NVIDIA A100 datasheet)
        tf32_flops=156e12,
        # memory bandwidth, bytes/s: 1,555 GB/s (NVIDIA A100 datasheet, 40GB SXM)
        hbm_bytes_per_s=1555e9,
        intra_node_link="nvlink",
        # NVLink 3, bytes/s one direction: 600 GB/s bidirectional / 2 (NVIDIA A100 datasheet)
        intra_node_bytes_per_s=300e9,
        source="NVIDIA A100 datasheet",
    ),
    "A100-SXM-80GB": DeviceSpec(
        name="A100-SXM-80GB",
        # memory: 80 GB HBM2e, bytes (NVIDIA A100 datasheet)
        memory_bytes=80_000_000_000,
        # compute capability 8.0 (CUDA GPUs list)
        compute_capability=(8, 0),
        # bf16 tensor core, FLOP/s dense: 312 TFLOP/s (NVIDIA A100 datasheet)
        bf16_flops=312e12,
        # fp8: none, Ampere has no fp8 tensor cores (NVIDIA A100 datasheet)
        fp8_flops=None,
        # fp32 non-tensor, FLOP/s: 19.5 TFLOP/s (NVIDIA A100 datasheet)
        fp32_flops=19.5e12,
        # tf32 tensor core, FLOP/s dense: 156 TFLOP/s (NVIDIA A100 datasheet)
        tf32_flops=156e12,
        # memory bandwidth, bytes/s: 2,039 GB/s (NVIDIA A100 datasheet, 80GB SXM)
        hbm_bytes_per_s=2039e9,
        intra_node_link="nvlink",
        # NVLink 3, bytes/s one direction: 600 GB/s bidirectional / 2 (NVIDIA A100 datasheet)
        intra_node_bytes_per_s=300e9,
        source="NVIDIA A100 datasheet",
    ),
    "A100-PCIe-80GB": DeviceSpec(
        name="A100-PCIe-80GB",
        # memory: 80 GB HBM2e, bytes (NVIDIA A100 datasheet)
        memory_bytes=80_000_000_000,
        # compute capability 8.0 (CUDA GPUs list)
        compute_capability=(8, 0),
        # bf16 tensor core, FLOP/s dense: 312 TFLOP/s (NVIDIA A100 datasheet)
        bf16_flops=312e12,
        # fp8: none, Ampere has no fp8 tensor cores (NVIDIA A100 datasheet)
        fp8_flops=None,
        # fp32 non-tensor, FLOP/s: 19.5 TFLOP/s (NVIDIA A100 datasheet)
        fp32_flops=19.5e12,
        # tf32 tensor core, FLOP/s dense: 156 TFLOP/s (NVIDIA A100 datasheet)
        tf32_flops=156e12,
        # memory bandwidth, bytes/s: 1,935 GB/s (NVIDIA A100 datasheet, 80GB PCIe)
        hbm_bytes_per_s=1935e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: 64 GB/s bidirectional / 2 (NVIDIA A100 datasheet);
        # an optional 2-GPU NVLink bridge (600 GB/s) is found by Topology.detect()
        intra_node_bytes_per_s=32e9,
        source="NVIDIA A100 datasheet",
    ),
    "H100-SXM": DeviceSpec(
        name="H100-SXM",
        # memory: 80 GB HBM3, bytes (NVIDIA H100 datasheet, SXM)
        memory_bytes=80_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,979 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, SXM)
        bf16_flops=989e12,
        # fp8 tensor core, FLOP/s dense: 3,958 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, SXM)
        fp8_flops=1979e12,
        # fp32 non-tensor, FLOP/s: 67 TFLOP/s (NVIDIA H100 datasheet, SXM)
        fp32_flops=67e12,
        # tf32 tensor core, FLOP/s dense: 989 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, SXM)
        tf32_flops=494e12,
        # memory bandwidth, bytes/s: 3.35 TB/s (NVIDIA H100 datasheet, SXM)
        hbm_bytes_per_s=3.35e12,
        intra_node_link="nvlink",
        # NVLink 4, bytes/s one direction: 900 GB/s bidirectional / 2 (NVIDIA H100 datasheet, SXM)
        intra_node_bytes_per_s=450e9,
        source="NVIDIA H100 datasheet",
    ),
    "H100-PCIe": DeviceSpec(
        name="H100-PCIe",
        # memory: 80 GB HBM2e, bytes (NVIDIA H100 datasheet, PCIe)
        memory_bytes=80_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,513 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, PCIe)
        bf16_flops=756e12,
        # fp8 tensor core, FLOP/s dense: 3,026 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, PCIe)
        fp8_flops=1513e12,
        # fp32 non-tensor, FLOP/s: 51 TFLOP/s (NVIDIA H100 datasheet, PCIe)
        fp32_flops=51e12,
        # tf32 tensor core, FLOP/s dense: 756 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, PCIe)
        tf32_flops=378e12,
        # memory bandwidth, bytes/s: 2 TB/s (NVIDIA H100 datasheet, PCIe)
        hbm_bytes_per_s=2.0e12,
        intra_node_link="pcie",
        # PCIe Gen5 x16, bytes/s one direction: 128 GB/s bidirectional / 2 (NVIDIA H100 datasheet);
        # an optional NVLink bridge (600 GB/s) is found by Topology.detect()
        intra_node_bytes_per_s=64e9,
        source="NVIDIA H100 datasheet",
    ),
    "H100-NVL": DeviceSpec(
        name="H100-NVL",
        # memory: 94 GB HBM3, bytes (NVIDIA H100 datasheet, NVL)
        memory_bytes=94_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,671 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, NVL)
        bf16_flops=835e12,
        # fp8 tensor core, FLOP/s dense: 3,341 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, NVL)
        fp8_flops=1670e12,
        # fp32 non-tensor, FLOP/s: 60 TFLOP/s (NVIDIA H100 datasheet, NVL)
        fp32_flops=60e12,
        # tf32 tensor core, FLOP/s dense: 835 TFLOP/s sparse / 2 (NVIDIA H100 datasheet, NVL)
        tf32_flops=417e12,
        # memory bandwidth, bytes/s: 3.9 TB/s (NVIDIA H100 datasheet, NVL)
        hbm_bytes_per_s=3.9e12,
        intra_node_link="pcie",
        # PCIe Gen5 x16, bytes/s one direction: 128 GB/s bidirectional / 2 (NVIDIA H100 datasheet, NVL);
        # the NVLink bridge between a pair (600 GB/s) is found by Topology.detect()
        intra_node_bytes_per_s=64e9,
        source="NVIDIA H100 datasheet",
    ),
    "H200": DeviceSpec(
        name="H200",
        # memory: 141 GB HBM3e, bytes (NVIDIA H200 datasheet, SXM; nvidia-smi reports 143,771 MiB)
        memory_bytes=141_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,979 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, SXM)
        bf16_flops=989e12,
        # fp8 tensor core, FLOP/s dense: 3,958 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, SXM)
        fp8_flops=1979e12,
        # fp32 non-tensor, FLOP/s: 67 TFLOP/s (NVIDIA H200 datasheet, SXM)
        fp32_flops=67e12,
        # tf32 tensor core, FLOP/s dense: 989 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, SXM)
        tf32_flops=494e12,
        # memory bandwidth, bytes/s: 4.8 TB/s (NVIDIA H200 datasheet, SXM)
        hbm_bytes_per_s=4.8e12,
        intra_node_link="nvlink",
        # NVLink 4, bytes/s one direction: 900 GB/s bidirectional / 2 (NVIDIA H200 datasheet, SXM)
        intra_node_bytes_per_s=450e9,
        source="NVIDIA H200 datasheet",
    ),
    "H200-NVL": DeviceSpec(
        name="H200-NVL",
        # memory: 141 GB HBM3e, bytes (NVIDIA H200 datasheet, NVL)
        memory_bytes=141_000_000_000,
        # compute capability 9.0 (CUDA GPUs list)
        compute_capability=(9, 0),
        # bf16 tensor core, FLOP/s dense: 1,671 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, NVL)
        bf16_flops=835e12,
        # fp8 tensor core, FLOP/s dense: 3,341 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, NVL)
        fp8_flops=1670e12,
        # fp32 non-tensor, FLOP/s: 60 TFLOP/s (NVIDIA H200 datasheet, NVL)
        fp32_flops=60e12,
        # tf32 tensor core, FLOP/s dense: 835 TFLOP/s sparse / 2 (NVIDIA H200 datasheet, NVL)
        tf32_flops=417e12,
        # memory bandwidth, bytes/s: 4.8 TB/s (NVIDIA H200 datasheet, NVL)
        hbm_bytes_per_s=4.8e12,
        intra_node_link="pcie",
        # PCIe Gen5 x16, bytes/s one direction: 128 GB/s bidirectional / 2 (NVIDIA H200 datasheet, NVL);
        # 2- or 4-way NVLink bridges (900 GB/s) are found by Topology.detect()
        intra_node_bytes_per_s=64e9,
        source="NVIDIA H200 datasheet",
    ),
    "B200": DeviceSpec(
        name="B200",
        # memory: 180 GB HBM3e per GPU, bytes (NVIDIA HGX B200 / DGX B200 specifications, 1,440 GB / 8)
        memory_bytes=180_000_000_000,
        # compute capability 10.0 (CUDA GPUs list)
        compute_capability=(10, 0),
        # bf16 tensor core, FLOP/s dense: 4.5 PFLOP/s sparse / 2 (NVIDIA HGX B200 specifications, per GPU)
        bf16_flops=2.25e15,
        # fp8 tensor core, FLOP/s dense: 9 PFLOP/s sparse / 2 (NVIDIA HGX B200 specifications, per GPU)
        fp8_flops=4.5e15,
        # fp32 non-tensor, FLOP/s: 75 TFLOP/s (NVIDIA HGX B200 specifications, per GPU)
        fp32_flops=75e12,
        # tf32 tensor core, FLOP/s dense: 2.2 PFLOP/s sparse / 2 (NVIDIA HGX B200 specifications, per GPU)
        tf32_flops=1.1e15,
        # memory bandwidth, bytes/s: 7.7 TB/s (NVIDIA HGX B200 specifications, per GPU; "8 TB/s" is the chip's max)
        hbm_bytes_per_s=7.7e12,
        intra_node_link="nvlink",
        # NVLink 5, bytes/s one direction: 1.8 TB/s bidirectional / 2 (NVIDIA HGX B200 specifications)
        intra_node_bytes_per_s=900e9,
        source="NVIDIA HGX B200 specifications",
    ),
    "L4": DeviceSpec(
        name="L4",
        # memory: 24 GB GDDR6, bytes (NVIDIA L4 datasheet)
        memory_bytes=24_000_000_000,
        # compute capability 8.9 (CUDA GPUs list)
        compute_capability=(8, 9),
        # bf16 tensor core, FLOP/s dense: 242 TFLOP/s sparse / 2 (NVIDIA L4 datasheet)
        bf16_flops=121e12,
        # fp8 tensor core, FLOP/s dense: 485 TFLOP/s sparse / 2 (NVIDIA L4 datasheet)
        fp8_flops=242e12,
        # fp32 non-tensor, FLOP/s: 30.3 TFLOP/s (NVIDIA L4 datasheet)
        fp32_flops=30.3e12,
        # tf32 tensor core, FLOP/s dense: 120 TFLOP/s sparse / 2 (NVIDIA L4 datasheet)
        tf32_flops=60e12,
        # memory bandwidth, bytes/s: 300 GB/s (NVIDIA L4 datasheet)
        hbm_bytes_per_s=300e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: 64 GB/s bidirectional / 2 (NVIDIA L4 datasheet)
        intra_node_bytes_per_s=32e9,
        source="NVIDIA L4 datasheet",
    ),
    "L40S": DeviceSpec(
        name="L40S",
        # memory: 48 GB GDDR6, bytes (NVIDIA L40S datasheet)
        memory_bytes=48_000_000_000,
        # compute capability 8.9 (CUDA GPUs list)
        compute_capability=(8, 9),
        # bf16 tensor core, FLOP/s dense: 362.05 TFLOP/s (NVIDIA L40S datasheet)
        bf16_flops=362e12,
        # fp8 tensor core, FLOP/s dense: 733 TFLOP/s (NVIDIA L40S datasheet)
        fp8_flops=733e12,
        # fp32 non-tensor, FLOP/s: 91.6 TFLOP/s (NVIDIA L40S datasheet)
        fp32_flops=91.6e12,
        # tf32 tensor core, FLOP/s dense: 183 TFLOP/s (NVIDIA L40S datasheet)
        tf32_flops=183e12,
        # memory bandwidth, bytes/s: 864 GB/s (NVIDIA L40S datasheet)
        hbm_bytes_per_s=864e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: 64 GB/s bidirectional / 2 (NVIDIA L40S datasheet)
        intra_node_bytes_per_s=32e9,
        source="NVIDIA L40S datasheet",
    ),
    "RTX-4090": DeviceSpec(
        name="RTX-4090",
        # memory: 24 GB GDDR6X, bytes (NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090)
        memory_bytes=24_000_000_000,
        # compute capability 8.9 (CUDA GPUs list)
        compute_capability=(8, 9),
        # bf16 tensor core with fp32 accumulate, FLOP/s dense: 165.2 TFLOP/s (Ada whitepaper, RTX 4090)
        bf16_flops=165e12,
        # fp8 tensor core with fp32 accumulate, FLOP/s dense: 330.3 TFLOP/s (Ada whitepaper, RTX 4090)
        fp8_flops=330e12,
        # fp32 non-tensor, FLOP/s: 82.6 TFLOP/s (Ada whitepaper, RTX 4090)
        fp32_flops=82.6e12,
        # tf32 tensor core, FLOP/s dense: 82.6 TFLOP/s (Ada whitepaper, RTX 4090)
        tf32_flops=82.6e12,
        # memory bandwidth, bytes/s: 1,008 GB/s (Ada whitepaper, RTX 4090)
        hbm_bytes_per_s=1008e9,
        intra_node_link="pcie",
        # PCIe Gen4 x16, bytes/s one direction: nominal 32 GB/s (PCIe 4.0 specification; no NVLink on this card)
        intra_node_bytes_per_s=32e9,
        source="NVIDIA Ada Lovelace architecture whitepaper",
    ),
}

# ---- host memory of the node each GPU comes in -----------------------------------------------------
# System memory (host RAM) per node of NVIDIA's DGX server for the GPU, bytes. DIMMs come in binary sizes, so a
# datasheet's "2 TB" is 2 TiB (DGX H100: 32 x 64 GB DIMMs). Topology.from_spec plans with these unless told
# otherwise (host_memory_bytes); GPUs sold in many kinds of servers (the PCIe and NVL cards, L4, L40S, RTX 4090)
# have no default, and their specs' CPU-offload plans are not checked against host memory until one is given.
_NODE_HOST_MEMORY_BYTES: dict[str, int] = {
    # DGX A100 320GB: 1 TB system memory (NVIDIA DGX A100 datasheet)
    "A100-SXM-40GB": 1 * 2**40,
    # DGX A100 640GB: 2 TB system memory (NVIDIA DGX A100 datasheet)
    "A100-SXM-80GB": 2 * 2**40,
    # DGX H100: 2 TB system memory (NVIDIA DGX H100 datasheet)
    "H100-SXM": 2 * 2**40,
    # DGX H200: 2 TB system memory (NVIDIA DGX H200 datasheet)
    "H200": 2 * 2**40,
    # DGX B200: 2 TB system memory, up to 4 TB (NVIDIA DGX B200 datasheet)
    "B200": 2 * 2**40,
}

# Names NVML and torch report (`nvidia-smi --query-gpu=name`, listed first) and aliases accepted in spec
# strings, besides the canonical name. Matching ignores case and everything but letters and digits, and
# drops a leading "NVIDIA" / "GeForce": "NVIDIA A100-SXM4-80GB" matches "a100 sxm4 80gb".
_NAMES: dict[str, tuple[str, ...]] = {
    "A100-SXM-40GB": ("NVIDIA A100-SXM4-40GB", "A100-40GB", "A100-SXM4-40GB"),
    "A100-SXM-80GB": ("NVIDIA A100-SXM4-80GB", "A100-80GB", "A100-SXM4-80GB", "A100", "A100-SXM", "A100-SXM4"),
    "A100-PCIe-80GB": ("NVIDIA A100 80GB PCIe", "A100-PCIe"),
    "H100-SXM": ("NVIDIA H100 80GB HBM3", "H100", "H100-SXM5", "H100-80GB"),
    "H100-PCIe": ("NVIDIA H100 PCIe",),
    "H100-NVL": ("NVIDIA H100 NVL",),
    "H200": ("NVIDIA H200", "H200-SXM", "H200-SXM5", "H200-141GB"),
    "H200-NVL": ("NVIDIA H200 NVL",),
    "B200": ("NVIDIA B200", "B200-SXM", "HGX-B200", "DGX-B200"),
    "L4": ("NVIDIA L4",),
    "L40S": ("NVIDIA L40S",),
    "RTX-4090": ("NVIDIA GeForce RTX 4090", "RTX4090", "4090"),
}
