"""Per-component device bytes per local token of one SFT step: python -m seqpar.bench layer-memory.

One process (SP=1; the per-layer working set is the same per local token under ring attention, Ulysses adds
its all-to-all buffers), fp32, LoRA r=8 on every projection, a random-init model with SmolLM2-135M's shape
(hidden 576, 9 q / 3 kv heads, intermediate 1536, 30 layers, vocab 49152: Llama-like ratios), activation
checkpointing + fused loss (64-token chunks) + tiled MLP, without and with the tiled decoder layer
(seqpar.memory.tiled_compute), and with host offload of the checkpointed layer inputs where
seqpar.memory.offload is present.

Measured with seqpar.memory.meter (torch's MemTracker: the exact peak of live tensor bytes) and, in the
same step, a labelling tracker (`ComponentTracker`) that attributes every live storage to the module that
created it: parameters (and buffers: alive before the step), norms, projections (q/k/v/o incl. LoRA),
attention (RoPE, the attention function, layouts), mlp, residual (hidden-wide tensors the layer itself
makes: residual adds, layer outputs = the checkpointed inputs of the next layer; other tensors the layer
makes, e.g. a tiled layer's q / k / v, count as attention), head+loss, gradients (everything backward
creates: activation gradients incl. the residual stream's, parameter gradients), other. Its snapshot is
taken at its own peak; the two peaks agree (the JSON carries both).
Bytes per local token = (value at S2 - value at S1) / (S2 - S1), the slope between two lengths.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["run", "summary_lines", "ComponentTracker"]

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     num_hidden_layers=30, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, max_position_embeddings=8192)
COMPONENTS = ("parameters", "norms", "projections", "attention", "mlp", "residual", "head+loss", "gradients", "other")


def _label(stack: list[torch.nn.Module], names: dict[int, str], backward: bool, width: int = -1,
           hidden: int = 0) -> str:
    if not stack:
        return "gradients" if backward else "other"
    path = [names.get(id(m), "") for m in stack]
    leaf = path[-1]
    if any(p.endswith(".mlp") for p in path):
        return "mlp"
    if leaf.endswith("norm") and ".layers." in leaf:
        return "norms"
    if any(p.endswith(s) for p in path for s in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "projections"
    if leaf.endswith("self_attn"):
        return "attention"
    if type(stack[-1]).__name__.endswith("DecoderLayer"):  # the layer's own ops: residual adds / attention
        return "residual" if width == hidden else "attention"
    if "layers" not in leaf:
        return "head+loss"
    return "other"


class ComponentTracker(TorchDispatchMode):
    """Live bytes of the storages created inside the block, by the component that created them; the split at
    the peak. Module scope from global forward hooks (they fire in checkpoint recomputes too)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        cfg = getattr(model, "config", None)
        self.hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        self.stack: list[torch.nn.Module] = []
        self.live: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
        self.total = self.peak = 0
        self.at_peak: dict[str, int] = dict(self.live)
        self._seen: set[int] = set()
        for t in (*model.parameters(), *model.buffers()):  # alive before the block: counted once, as the meter does
            self._track(t.untyped_storage(), "parameters")

    def __enter__(self) -> ComponentTracker:
        from torch.nn.modules import module as M

        self._hooks = [M.register_module_forward_pre_hook(lambda m, a: self.stack.append(m)),
                       M.register_module_forward_hook(lambda m, a, o: self._pop(m))]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        super().__exit__(*exc)

    def _pop(self, m: torch.nn.Module) -> None:
        if self.stack and self.stack[-1] is m:
            self.stack.pop()

    def _free(self, key: int, label: str, n: int) -> None:
        self._seen.discard(key)
        self.live[label] -= n
        self.total -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        backward = torch._C._current_graph_task_id() != -1
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            self._track(st, _label(self.stack, self.names, backward, t.shape[-1] if t.dim() else -1, self.hidden))
        return out

    def _track(self, st: Any, label: str) -> None:
        key, n = id(st), st.nbytes()
        if key in self._seen:  # a view of a storage already counted
            return
        self._seen.add(key)
        self.live[label] += n
        self.total += n
        weakref.finalize(st, self._free, key, label, n)
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.live)


def _model(shape: dict, tiled_layer: bool, offload: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..memory.checkpointing import enable_activation_checkpointing
    from ..memory.fused_loss import install_fused_head
    from ..memory.tiled_compute import apply_tiled_layer
    from ..memory.tiled_mlp import apply_tiled_mlp

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    m = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    enable_activation_checkpointing(m)
    if offload:
        from ..memory.offload import install_activation_offload

        install_activation_offload(m)
    install_fused_head(m)
    apply_tiled_mlp(m, True)
    if tiled_layer:
        apply_tiled_layer(m, True)
    return m.train()


def _step(model: torch.nn.Module, s: int, vocab: int) -> dict[str, Any]:
    from .. import loss as L
    from ..data import SequenceParallelCollator
    from ..memory.meter import PeakMemoryMeter
    from ..mesh import init_mesh
    from ..steps import StepSpec, micro_batch_loss

    mesh = init_mesh(1)
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(3, vocab, (s,), generator=g)
    batch = SequenceParallelCollator(mesh, pad_token_id=0)([{"input_ids": ids, "labels": ids.clone()}])
    num = L.global_token_count(torch.as_tensor(batch["num_supervised_tokens"]), mesh)
    spec = StepSpec("sft", loss_chunk_tokens=64)
    meter = PeakMemoryMeter(model, None, torch.device("cpu"))
    tracker = ComponentTracker(model)
    t0 = time.perf_counter()
    with meter.measure(), tracker:
        share, _ = micro_batch_loss(model, batch, num, mesh, spec)
        share.backward()
    secs = time.perf_counter() - t0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"seq": s, "loss": float(share.detach()), "peak_bytes": int(meter.last["peak_bytes"]),
            "by_category": {k: int(v) for k, v in meter.last["by_category"].items()},
            "tracker_peak": tracker.peak, "components": tracker.at_peak, "seconds": secs, "_grads": grads}


CONFIGS = {"ckpt+fused+tiled_mlp": (False, False), "+tiled_layer": (True, False),
           "+offload": (False, True), "+tiled_layer+offload": (True, True)}


def run(lengths: tuple[int, int] = (1152, 2304), quick: bool = False, configs: list[str] | None = None) -> dict:
    """Two lengths per configuration; slopes per component; each tiled configuration's loss and gradients vs
    its untiled counterpart (when both run). Lengths: multiples of hidden_size, so the automatic tile count
    keeps the tile at the same size at both lengths (else the slope charges a growing tile to every token)."""
    import importlib.util

    shape = dict(SMOLLM2_SHAPE, num_hidden_layers=2) if quick else dict(SMOLLM2_SHAPE)
    if quick:
        lengths = (128, 256)
    names = configs or list(CONFIGS)
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}: choose from {list(CONFIGS)}")
    if importlib.util.find_spec("seqpar.memory.offload") is None:
        names = [n for n in names if not CONFIGS[n][1]]
    torch.set_num_threads(1)
    out: dict[str, Any] = {"shape": shape, "lengths": list(lengths), "dtype": "float32", "lora_r": 8,
                           "configs": {}}
    results: dict[tuple[str, int], tuple[float, dict]] = {}
    for name in names:
        tiled, offload = CONFIGS[name]
        model = _model(shape, tiled, offload)
        points = [_step(model, s, shape["vocab_size"]) for s in lengths]
        untiled = next((n for n, v in CONFIGS.items() if v == (False, offload)), None) if tiled else None
        for p in points:
            results[(name, p["seq"])] = (p["loss"], p.pop("_grads"))
            if (untiled, p["seq"]) in results:
                (loss0, g0), (loss1, g1) = results[(untiled, p["seq"])], results[(name, p["seq"])]
                p["vs_untiled"] = {"config": untiled, "loss": abs(loss1 - loss0),
                                   "grad": max(float((g1[k] - g0[k]).abs().max()) for k in g0)}
        a, b = points
        ds = b["seq"] - a["seq"]
        out["configs"][name] = {
            "points": points,
            "bytes_per_token": (b["peak_bytes"] - a["peak_bytes"]) / ds,
            "components_per_token": {c: (b["components"][c] - a["components"][c]) / ds for c in COMPONENTS},
        }
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"bytes per local token (SmolLM2-135M shape, {result['dtype']}, LoRA r={result['lora_r']}, "
             f"S_local {result['lengths']}):"]
    head = f"{'component':<12}" + "".join(f"{n:>24}" for n in result["configs"])
    lines.append(head)
    for c in (*COMPONENTS, "TOTAL"):
        vals = [v["bytes_per_token"] if c == "TOTAL" else v["components_per_token"][c]
                for v in result["configs"].values()]
        lines.append(f"{c:<12}" + "".join(f"{x:>24.0f}" for x in vals))
    return lines
