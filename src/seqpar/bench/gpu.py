"""`python -m seqpar.bench gpu`: what one CUDA GPU says about seqpar, in one short run (docs/gpu.md).

Parts (all by default; `--parts` picks):
- `attention`: fwd+bwd time and peak memory of seqpar.attention (world of 1; every CUDA kernel) vs torch SDPA
  (flash backend, enable_gqa; and its cuDNN backend) on the same inputs, bf16, B=1, 32 q / 8 kv heads, d=128,
  causal, at 8K and 32K tokens. Ratios are side by side in one process.
- `packed`: a 128K row packed from 2K-token documents: seqpar.attention with cu_seqlens vs ONE direct varlen
  flash call (torch.nn.attention.varlen.varlen_attn) on the same row.
- `sp`: one Ulysses-4 and one ring-4 attention step on this one GPU (the ranks are threads, seqpar.threaded), and
  the GPU time in attention kernels vs copies / layout and merges (bench.gpu_sp).
- `hybrid`: a Gated DeltaNet layer through flash-linear-attention's / causal-conv1d's kernels vs the torch
  fallbacks (bench.gpu_hybrid).
- `train`: `seqpar train` runs (bench.gpu_train): tokens/s, MFU and peak memory vs `seqpar plan`, activation and
  FSDP2 CPU offload, a Qwen3.5-shaped hybrid at ring 4 on one GPU vs SP 1, and the fp32 exactness of the memory
  features on CUDA.
Timing: CUDA events, the median of `reps` after warm-up. Peak: torch.cuda.max_memory_allocated during one
fwd+bwd, minus what was allocated before it (the inputs). MFU's denominator is the bf16 matmul rate measured
in the same run (8192^3 products), not a datasheet figure.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from typing import Any

import torch

from .cuda_time import cuda_time_ms

__all__ = ["run", "summary_lines", "device_info", "attention_flops"]

HQ, HKV, D = 32, 8, 128


def device_info() -> dict[str, Any]:
    from ..attention.kernel_choice import flash_implementation

    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": list(p.major_minor)
            if hasattr(p, "major_minor") else [p.major, p.minor], "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
            "flash_implementation": flash_implementation()}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        info["driver"] = r.stdout.strip()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, reps, warmup=3)
    return 2 * n**3 / (ms / 1e3) / 1e12


def attention_flops(s: int, hq: int = HQ, d: int = D, docs: int = 1) -> float:
    """Causal fwd+bwd matmul FLOPs: forward 2 matmuls of half the [S, S] scores per head (4*S^2/2*H*D per
    document of S/docs tokens), backward 2.5x the forward (FlashAttention's count)."""
    n = s // docs
    return docs * 4 * n * n / 2 * hq * d * 3.5


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _fwd_bwd(fn, q, k, v, do):
    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(do)

    return step


def _candidates(mesh, cu=None) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import seqpar

    def sdpa(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True).transpose(1, 2)
        return f

    out = {f"seqpar_{k}": (lambda q, k_, v, kn=k: seqpar.attention(q, k_, v, mesh, kernel=kn, cu_seqlens=cu))
           for k in ("flash", "cudnn", "efficient")}
    if cu is None:
        out["torch_sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        out["torch_sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return out


def attention_rows(lengths=(8192, 32768), reps: int = 10) -> list[dict[str, Any]]:
    import seqpar

    mesh = seqpar.init_mesh(1)
    rows = []
    for s in lengths:
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(1, s, h, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                   for h in (HQ, HKV, HKV))
        do = torch.randn_like(q)
        row: dict[str, Any] = {"S": s, "hq": HQ, "hkv": HKV, "d": D, "dtype": "bf16", "flops": attention_flops(s)}
        for name, fn in _candidates(mesh).items():
            try:
                step = _fwd_bwd(fn, q, k, v, do)
                row[f"{name}_ms"] = cuda_time_ms(step, reps)
                row[f"{name}_peak_mib"] = _peak_mib(step)
            except Exception as e:  # noqa: BLE001 - a kernel this GPU or torch lacks is reported, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for name in ("seqpar_flash", "seqpar_cudnn", "seqpar_efficient", "torch_sdpa_cudnn"):
            if f"{name}_ms" in row and "torch_sdpa_flash_ms" in row:
                row[f"{name}_time_ratio"] = row[f"{name}_ms"] / row["torch_sdpa_flash_ms"]
                row[f"{name}_peak_ratio"] = row[f"{name}_peak_mib"] / row["torch_sdpa_flash_peak_mib"]
        for name in [n for n in row if n.endswith("_ms")]:
            row[name.replace("_ms", "_tflops")] = row["flops"] / (row[name] / 1e3) / 1e12
        rows.append(row)
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


def packed_row(s: int = 131072, doc: int = 2048, reps: int = 5) -> dict[str, Any]:
    """seqpar on a packed row vs one direct varlen flash call (torch's public varlen_attn) on the same row."""
    import seqpar

    mesh = seqpar.init_mesh(1)
    cu = list(range(0, s + 1, doc))
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, s, h, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (HQ, HKV, HKV))
    do = torch.randn_like(q)
    row: dict[str, Any] = {"S": s, "doc_len": doc, "docs": len(cu) - 1, "flops": attention_flops(s, docs=len(cu) - 1)}
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")

    def direct(q_, k_, v_):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q_[0], k_[0], v_[0], cu_t, cu_t, doc, doc, window_size=(-1, 0))[None]

    fns = {"seqpar": _candidates(mesh, cu)["seqpar_flash"], "direct_varlen": direct}
    for name, fn in fns.items():
        try:
            step = _fwd_bwd(fn, q, k, v, do)
            row[f"{name}_ms"] = cuda_time_ms(step, reps)
            row[f"{name}_peak_mib"] = _peak_mib(step)
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if "seqpar_ms" in row and "direct_varlen_ms" in row:
        row["time_ratio"] = row["seqpar_ms"] / row["direct_varlen_ms"]
        row["peak_ratio"] = row["seqpar_peak_mib"] / row["direct_varlen_peak_mib"]
    return row


PARTS = ("attention", "packed", "sp", "hybrid", "train")


def run(parts: tuple[str, ...] = PARTS, quick: bool = False, runs: list[str] | None = None,
        work: str | None = None, timeout: float = 300.0, trace: str | None = None,
        out: str | None = None) -> dict[str, Any]:
    """The parts in the order given; with `out`, the JSON is rewritten after each part and train run (a run cut
    short keeps what it measured)."""
    if not torch.cuda.is_available():
        raise SystemExit("seqpar.bench gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown --parts {unknown}: use some of {', '.join(PARTS)}")
    result: dict[str, Any] = {"device": device_info(), "matmul_bf16_tflops": matmul_tflops()}

    def save() -> None:
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as fh:
                json.dump(result, fh, indent=1)

    def train() -> dict[str, Any]:
        from .gpu_train import train_part

        where = work or os.path.join(os.environ.get("TMPDIR", "/tmp"), "seqpar_bench_gpu")
        return train_part(runs, where, timeout, result["matmul_bf16_tflops"], quick, trace, save_partial=(
            lambda t: (result.__setitem__("train", t), save())))

    def sp() -> list[dict[str, Any]]:
        from .gpu_sp import sp_rows

        return sp_rows(8192 if quick else 32768, reps=2 if quick else 3)

    def hybrid() -> list[dict[str, Any]]:
        from .gpu_hybrid import hybrid_layer_rows

        return hybrid_layer_rows(4096 if quick else 16384, reps=3 if quick else 5)

    steps = {"attention": ("attention", lambda: attention_rows((2048, 4096) if quick else (8192, 32768),
                                                               reps=3 if quick else 10)),
             "packed": ("packed", lambda: packed_row(16384 if quick else 131072, reps=3 if quick else 5)),
             "sp": ("sp", sp), "hybrid": ("hybrid_layer", hybrid), "train": ("train", train)}
    for part in parts:
        key, fn = steps[part]
        result[key] = fn()
        save()
    return result


def summary_lines(r: dict[str, Any]) -> list[str]:
    dev = r["device"]
    lines = [f"{dev['gpu']} (sm{''.join(map(str, dev['capability']))}), torch {dev['torch']}, CUDA {dev['cuda']}, "
             f"driver {dev.get('driver', '?')}; flash = {dev['flash_implementation']}; bf16 matmul "
             f"{r['matmul_bf16_tflops']:.0f} TFLOP/s"]
    for row in r.get("attention", []):
        parts = [f"S={row['S']}:"]
        for name in ("torch_sdpa_flash", "torch_sdpa_cudnn", "seqpar_flash", "seqpar_cudnn", "seqpar_efficient"):
            if f"{name}_ms" in row:
                ratio = f" ({row[name + '_time_ratio']:.2f}x t, {row[name + '_peak_ratio']:.2f}x mem)" \
                    if name + "_time_ratio" in row else ""
                parts.append(f"{name} {row[name + '_ms']:.2f} ms {row[name + '_peak_mib']:.0f} MiB{ratio}")
            elif f"{name}_error" in row:
                parts.append(f"{name} FAILED {row[name + '_error'][:80]}")
        lines.append("  attention " + " | ".join(parts))
    p = r.get("packed")
    if p:
        lines.append(f"  packed {p['S']} tokens, {p['docs']} docs: " + (
            f"seqpar {p['seqpar_ms']:.2f} ms vs one varlen call {p['direct_varlen_ms']:.2f} ms = "
            f"{p['time_ratio']:.2f}x time, {p['peak_ratio']:.2f}x peak" if "time_ratio" in p else str(p)))
    if "sp" in r:
        from .gpu_sp import sp_lines

        lines += sp_lines(r["sp"])
    if "hybrid_layer" in r:
        from .gpu_hybrid import hybrid_lines

        lines += hybrid_lines(r["hybrid_layer"])
    if "train" in r:
        from .gpu_train import train_lines

        lines += train_lines(r["train"])
    return lines
