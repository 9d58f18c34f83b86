"""GPU presets for the planner: memory, dense bf16 peak, and link bandwidths (GB/s, one direction).

Bandwidths are what one GPU achieves in collectives, not the marketing aggregate:
intra = NVLink/NVSwitch inside a node, inter = the GPU's share of the node's network (one NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dynamic.cost import Machine
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
    mem_bw: float = 2000.0  # GB/s of device memory: what memory-bound (elementwise, optimizer) work streams at
    latency_s: float = 2e-5  # one collective call's fixed cost (NCCL: ~10-30 us)
    overlap: bool = True  # communication can hide behind compute (separate streams); False: all of it is exposed
    fsdp_param_s: float = 0.0  # FSDP2's fixed cost per parameter tensor and step (GPU: host work runs ahead, hidden)
    host_layer_s: float = 0.0  # host cost per layer and pass (GPU: kernels are enqueued ahead, hidden)
    loss_elem_s: float | None = None  # cross-entropy seconds per logit (fwd + bwd); None: memory-bound at mem_bw
    attn_tflops: float | None = None  # achieved attention-kernel FLOP/s; None: the matmul rate
    attn_by_len: tuple[tuple[int, float], ...] = ()  # measured: (kernel length, TFLOP/s), log-interpolated
    # Measured clusters: (kind, latency s, GB/s) per collective kind, replacing latency_s / the bandwidths.
    per_kind: tuple[tuple[str, float, float], ...] = ()
    host_bw: float = 25.0  # GB/s per GPU between device and pinned host memory (PCIe, one direction)
    host_mem_bw: float = 100.0  # GB/s of host memory per node, shared by its GPUs' CPU optimizer steps
    # host RAM one GPU may fill with offloaded tensors (layer inputs, the CPU optimizer state); None: unlimited.
    # Presets: a DGX node's RAM (2 TiB for H100 / H200, 1 TiB for A100 80 GB) less 10% for the OS and the
    # processes, shared by the GPUs the job uses on the node (make_cluster)
    host_mem_bytes: int | None = None

    @property
    def machine(self) -> Machine:
        """The rates, links and overheads a micro-batch's cost needs (seqpar.dynamic.cost, shared with `seqpar
        train`'s length-aware balancing)."""
        return Machine(self.gpus_per_node, self.intra_bw, self.inter_bw, self.latency_s, self.overlap,
                       self.host_layer_s, self.attn_tflops, self.attn_by_len, self.per_kind)

    def bw(self, group: int, stride: int = 1) -> float:
        """Bandwidth of a group of `group` ranks spaced `stride` apart (ranks fill nodes in order)."""
        return self.machine.bw(group, stride)

    def attention_tflops(self, length: int) -> float | None:
        """The attention kernel's rate at a query length (measured clusters), else `attn_tflops`."""
        return self.machine.attention_tflops(length)

    def collective_s(self, kind: str, calls: int, nbytes: float, group: int, stride: int = 1) -> float:
        """Seconds for `calls` collectives of one kind that send `nbytes` in all: latency + bytes / bandwidth."""
        return self.machine.collective_s(kind, calls, nbytes, group, stride)


# A100 SXM 80GB: 312 dense bf16 TFLOP/s, 19.5 fp32 (156 tf32), NVLink3 ~240 GB/s achieved, 200 Gb/s IB per GPU.
# H100 SXM: 989 dense bf16, 67 fp32, NVLink4 ~360 GB/s achieved, 400 Gb/s IB per GPU (~45 GB/s).
# H200 SXM: H100 compute with 141 GB HBM3e.
# host_bw: PCIe achieved per GPU and direction (Gen4 x16 ~25 GB/s on A100, Gen5 x16 ~50 GB/s on H100/H200);
# host_mem_bw: what a node's CPUs stream in torch's AdamW over host tensors (a model: ~100 GB/s of a dual-socket
# node's DDR bandwidth), shared by the node's ranks.
# mem_bw: HBM peak (A100 2.0, H100 3.35, H200 4.8 TB/s); latency_s: 20 us per NCCL call (a model, inter-node
# calls are slower). Memory-bound work is a small term at long lengths; the latency matters for small messages.
GPU_PRESETS: dict[str, Cluster] = {
    "a100-80g": Cluster(8, 8, 80 * GiB, 312.0, 19.5, 240.0, 22.0, "a100-80g", mem_bw=2039.0, host_bw=25.0,
                        host_mem_bytes=int(0.9 * 2**40)),  # per node here; make_cluster divides by GPUs per node
    "h100": Cluster(8, 8, 80 * GiB, 989.0, 67.0, 360.0, 45.0, "h100", mem_bw=3350.0, host_bw=50.0,
                    host_mem_bytes=int(0.9 * 2**41)),
    "h200": Cluster(8, 8, 141 * 10**9, 989.0, 67.0, 360.0, 45.0, "h200", mem_bw=4800.0, host_bw=50.0,
                    host_mem_bytes=int(0.9 * 2**41)),
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
                 peak_tflops: float | None = None, host_mem: str | None = None) -> Cluster:
    """host_mem: host RAM per GPU for offloaded tensors ('256GiB'; 'none': unlimited; default: the preset's)."""
    if gpu is not None and gpu not in GPU_PRESETS:
        raise SeqParError(f"unknown GPU {gpu!r}: use one of {', '.join(GPU_PRESETS)} (or --gpu-mem/--peak-tflops)")
    if not isinstance(gpus, int) or gpus < 1:
        raise SeqParError(f"--gpus must be a positive number of GPUs, got {gpus!r}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 1):
        raise SeqParError(f"--gpus-per-node must be a positive number of GPUs, got {gpus_per_node!r}")
    base = GPU_PRESETS[gpu or "h100"]
    per_node = gpus_per_node if gpus_per_node is not None else min(gpus, base.gpus_per_node)
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
        host_mem_bytes=(base.host_mem_bytes // min(per_node, gpus) if host_mem is None and base.host_mem_bytes
                        else None if host_mem is None or str(host_mem).lower() == "none" else parse_bytes(host_mem)),
    )
