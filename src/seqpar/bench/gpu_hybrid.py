"""`python -m seqpar.bench gpu --parts hybrid`: a Gated DeltaNet layer's forward + backward on one GPU through the
kernels the layer resolves to (flash-linear-attention's chunk kernel and causal-conv1d where installed) vs
transformers' torch fallbacks, side by side: each in its own process, the fallback's with those packages hidden
(`SEQPAR_HIDE_MODULES`), on the same Qwen3.5-shaped layer (16 k / 32 v heads of 128, hidden 2048), bf16, B = 1.
Reported: tokens/s (CUDA-event median of `reps` after a warm-up), peak memory, and which module each function
comes from (seqpar.hf.layer_kernels.kernel_origin).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["hybrid_layer_rows", "hybrid_lines"]

HIDE_ENV = "SEQPAR_HIDE_MODULES"
HIDDEN = ("fla", "causal_conv1d")


def _layer_rate(seq: int, reps: int) -> dict[str, Any]:
    import torch

    from ..hf import tiny_model
    from ..hf.layer_kernels import kernel_origin, layer_function
    from ..hf.linear_attention import find_linear_attention
    from .cuda_time import cuda_time_ms
    from .gpu_train import QWEN35_2L

    kw = {k: v for k, v in QWEN35_2L.items() if k not in ("num_heads", "num_kv_heads")}
    model = tiny_model("qwen3_5", QWEN35_2L["num_heads"], QWEN35_2L["num_kv_heads"], dtype=torch.bfloat16, **kw)
    layer = find_linear_attention(model)[0].cuda()
    x = torch.randn(1, seq, layer.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        layer(x).backward(dy)

    ms = cuda_time_ms(step, reps)
    torch.cuda.reset_peak_memory_stats()
    step()
    return {"seq": seq, "ms": ms, "tokens_per_s": seq / (ms / 1e3),
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
            "rule": kernel_origin(layer_function(layer, "torch_chunk_gated_delta_rule")),
            "conv": kernel_origin(layer_function(layer, "causal_conv1d_fn"))}


def hybrid_layer_rows(seq: int = 16384, reps: int = 5, timeout: float = 300.0) -> list[dict[str, Any]]:
    rows = []
    for label, hide in (("installed kernels", ""), ("torch fallback", ",".join(HIDDEN))):
        env = {**os.environ, HIDE_ENV: hide}
        cmd = [sys.executable, "-m", "seqpar.bench.gpu_hybrid", str(seq), str(reps)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(last[-1]) if p.returncode == 0 and last else {"error": (p.stdout + p.stderr)[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"error": f"timed out after {timeout:.0f}s"}
        rows.append({"variant": label, "hidden": hide, **row})
    a, b = rows
    if "tokens_per_s" in a and "tokens_per_s" in b:
        a["speedup_vs_fallback"] = a["tokens_per_s"] / b["tokens_per_s"]
    return rows


def hybrid_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"  hybrid layer ({r['variant']}): FAILED {r['error'][-200:]}")
        else:
            sp = f", {r['speedup_vs_fallback']:.1f}x the fallback" if "speedup_vs_fallback" in r else ""
            out.append(f"  hybrid layer ({r['variant']}: {r['rule']} / {r['conv']}): {r['tokens_per_s']:.0f} tok/s "
                       f"fwd+bwd at {r['seq']} tokens, peak {r['peak_mib']:.0f} MiB{sp}")
    return out


if __name__ == "__main__":
    for name in filter(None, os.environ.get(HIDE_ENV, "").split(",")):
        sys.modules[name] = None  # as if not installed: transformers falls back to its torch functions
    print(json.dumps(_layer_rate(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
