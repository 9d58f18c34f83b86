"""GPU presets for the planner: memory, dense bf16 peak, and link bandwidths (GB/s, one direction).

Bandwidths are what one GPU achieves in collectives, not the marketing aggregate:
intra = NVLink/NVSwitch inside a node, inter = the GPU's share of the node's network (one NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import SeqParError

__all__ = ["Cluster", "GPU_PRESETS", "parse_bytes", "make_cluster"]

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    mem_bytes: int
    peak_tflops: float  # dense bf16 (fp32 runs at `fp32_tflops`)
    fp32_tflops: float
    intra_bw: float  # GB/s per GPU, inside a node
    inter_bw: float  # GB/s per GPU, across nodes
    name: str = "custom"

    def bw(self, group: int, stride: int = 1) -> float:
        """Bandwidth of a group of `group` ranks spaced `stride` apart (ranks fill nodes in order)."""
        return self.intra_bw if group * stride <= self.gpus_per_node else self.inter_bw


# A100 SXM 80GB: 312 dense bf16 TFLOP/s, 19.5 fp32 (156 tf32), NVLink3 ~240 GB/s achieved, 200 Gb/s IB per GPU.
# H100 SXM: 989 dense bf16, 67 fp32, NVLink4 ~360 GB/s achieved, 400 Gb/s IB per GPU (~45 GB/s).
# H200 SXM: H100 compute with 141 GB HBM3e.
GPU_PRESETS: dict[str, Cluster] = {
    "a100-80g": Cluster(8, 8, 80 * GiB, 312.0, 19.5, 240.0, 22.0, "a100-80g"),
    "h100": Cluster(8, 8, 80 * GiB, 989.0, 67.0, 360.0, 45.0, "h100"),
    "h200": Cluster(8, 8, 141 * 10**9, 989.0, 67.0, 360.0, 45.0, "h200"),
}


def parse_bytes(text: str | int | float) -> int:
    """'80GiB', '80GB', '141e9', 85899345920 -> bytes."""
    if isinstance(text, (int, float)):
        val = float(text)
    else:
        s = text.strip().lower().replace(" ", "")
        units = {"tib": 2**40, "gib": GiB, "mib": 2**20, "tb": 10**12, "gb": 10**9, "mb": 10**6, "b": 1}
        mult = 1
        for u, m in units.items():
            if s.endswith(u):
                s, mult = s[: -len(u)], m
                break
        try:
            val = float(s) * mult
        except ValueError:
            raise SeqParError(f"--gpu-mem {text!r}: give a size like 80GiB, 80GB or 141e9") from None
    if val <= 0:
        raise SeqParError(f"GPU memory must be positive, got {text!r}: e.g. --gpu-mem 80GiB")
    return int(val)


def make_cluster(gpus: int, gpus_per_node: int | None = None, gpu: str | None = None, gpu_mem: str | None = None,
                 intra_bw: float | None = None, inter_bw: float | None = None,
                 peak_tflops: float | None = None) -> Cluster:
    if gpu is not None and gpu not in GPU_PRESETS:
        raise SeqParError(f"unknown GPU {gpu!r}: use one of {', '.join(GPU_PRESETS)} (or --gpu-mem/--peak-tflops)")
    if not isinstance(gpus, int) or gpus < 1:
        raise SeqParError(f"--gpus must be a positive number of GPUs, got {gpus!r}")
    base = GPU_PRESETS[gpu or "h100"]
    per_node = gpus_per_node or min(gpus, base.gpus_per_node)
    if per_node < 1 or (gpus > per_node and gpus % per_node != 0):
        raise SeqParError(f"--gpus {gpus} is not a whole number of nodes of --gpus-per-node {per_node}")
    for name, v in (("--intra-bw", intra_bw), ("--inter-bw", inter_bw), ("--peak-tflops", peak_tflops)):
        if v is not None and v <= 0:
            raise SeqParError(f"{name} must be positive, got {v}")
    return replace(
        base, gpus=gpus, gpus_per_node=min(per_node, gpus),
        mem_bytes=parse_bytes(gpu_mem) if gpu_mem is not None else base.mem_bytes,
        intra_bw=intra_bw or base.intra_bw, inter_bw=inter_bw or base.inter_bw,
        peak_tflops=peak_tflops or base.peak_tflops,
        fp32_tflops=(peak_tflops / 8 if peak_tflops else base.fp32_tflops),
        name=gpu or ("custom" if gpu_mem else base.name),
    )
