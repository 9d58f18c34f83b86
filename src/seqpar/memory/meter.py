"""Exact per-rank peak memory of a train step: live tensor bytes, independent of machine load.

    meter = PeakMemoryMeter(model, optimizer, device)
    with meter.measure():
        step()                      # forward, backward, optimizer step (any number of micro-batches)
    meter.last  # {"peak_bytes": int, "by_category": {"Parameter": int, ...}, "source": ..., ...}

How the peak is counted:
- Everywhere: `torch.distributed._tools.mem_tracker.MemTracker` (a TorchDispatchMode) sees every
  tensor an aten op returns and every free (weakref on the storage). Its running total of live
  storage bytes is exact on any device; on CPU it is the only exact measure (RSS counts the
  allocator's caching, libraries and other ranks' noise). It counts the model's parameters, buffers
  and gradients, the optimizer's state (all alive before the step) and every tensor the step
  allocates; tensors allocated before the step and not owned by the model or optimizer (e.g. the
  batch's input_ids) are not counted. Bytes are storage bytes (a view is free).
  `by_category` is the split AT THE MOMENT OF THE TOTAL PEAK (MemTracker's "peak" snapshot is taken
  when the total reaches a new maximum; it is not a set of per-category maxima), so its values sum
  to `tracked_peak_bytes`. Categories: Parameter, Buffer, Gradient, Optstate, Activation (forward
  outputs, incl. recomputation), Temp (backward temporaries, incl. activation gradients; a
  parameter's gradient counts as Temp until it is accumulated into .grad), Other.
- CUDA (untested here: no GPU in CI): `peak_bytes` is `torch.cuda.max_memory_allocated` (reset at
  the start of the measurement), i.e. everything the caching allocator handed out, including
  kernel workspaces the tracker cannot see; the tracker's total stays in `tracked_peak_bytes`.
- Elsewhere `peak_bytes == tracked_peak_bytes`.
- Activation offload (seqpar.memory.offload, found on the model): the offloaded layer inputs are host
  bytes outside the device count. `offloaded_peak_bytes` is the store's peak during the measurement,
  `offloaded_at_peak_bytes` what it held at the moment of the device peak (tracker only), both 0 without
  offload. On CPU the store's bytes are numpy buffers, which the tracker (torch ops only) does not see.

Works with PEFT models, the SP-patched models and FSDP2 (DTensor parameters: the local shards are
counted, plus the all-gathered unsharded parameters while they exist). The tracker costs Python
work per aten op (tens of microseconds), so `seqpar train` makes it switchable (`memory.measure`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from .offload import ActivationOffload, offload_store

__all__ = ["PeakMemoryMeter", "CATEGORIES", "MODEL_STATE_CATEGORIES", "activation_bytes", "host_state_bytes"]

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")
# What exists independently of the sequence length: the rest of the peak is activation memory.
MODEL_STATE_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate")
_TOTAL = "Total"


class _NoHook:
    """Stands in for a gradient-hook handle on a frozen parameter (nothing to remove)."""

    def remove(self) -> None:
        pass


class _StepTracker(MemTracker):
    """MemTracker for one train step: global peak only, a root module may run several times, and
    frozen parameters (LoRA, a DPO reference copy) are allowed.

    Four private MemTracker methods are overridden (torch/distributed/_tools/mem_tracker.py, torch
    2.13); tests/test_memory_meter.py checks exact byte counts, so a changed upstream shows there.
    """

    def _delete_callback(self, winfo: Any, w_st: Any) -> None:
        # A storage created during the step that outlives it (an interrupted step's traceback, Ctrl-C) is
        # freed after the reading is taken, possibly at interpreter shutdown when upstream's bookkeeping
        # fails: once the step is over, frees change nothing we report.
        if self._depth > 0:
            super()._delete_callback(winfo, w_st)

    offload: ActivationOffload | None = None
    offloaded_at_peak: dict[Any, int]

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Upstream also walks every tracked module per aten op (per-module peaks we never read): that
        # walk is most of the tracker's cost on a 30-layer model. Same global peak logic as upstream.
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                self._peak_mem[dev] = snap[_TOTAL]
                self._peak_mem_snap[dev] = dict(snap)
                if self.offload is not None:  # host bytes held at this device peak
                    self.offloaded_at_peak[dev] = self.offload.current_bytes

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # Gradient accumulation calls the root module once per micro-batch; upstream refuses a second
        # root call ("multiple iterative calls"). Only that module's own stats clash, and we do not use
        # them: drop them, and only them. Clearing every module's stats broke backward hooks of modules
        # forwarded outside the root call (a VLM's vision tower runs before the model, seqpar.hf.vision):
        # their stats vanished before their backward (KeyError). Byte accounting is untouched.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        # Upstream registers a gradient hook on every parameter, which raises for a frozen one. A frozen
        # parameter never gets a gradient: mark it as hooked already, so upstream skips it.
        if install_grad_hooks:
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def _device_snapshot(snaps: dict[torch.device, dict[Any, int]], device: torch.device) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    out[_TOTAL] = 0
    for dev, snap in snaps.items():
        if dev.type != device.type or (device.index is not None and dev.index not in (None, device.index)):
            continue
        for key, val in snap.items():
            name = key.value if hasattr(key, "value") else str(key)
            out[name] = out.get(name, 0) + int(val)
    return out


class PeakMemoryMeter:
    """Per-rank peak memory of what runs inside `measure()`; the result of the last one is `last`.

    model / optimizer: their parameters, buffers, gradients and state are alive before the step and
    are counted from the start (a new tracker per measurement, so optimizer state created in a
    previous step is included). extra: further modules or tensors alive throughout the step (e.g. a
    frozen reference model), counted from the start too. categories=False on CUDA skips the tracker
    (allocator peak only, no per-op cost); on other devices the tracker is the measurement and always
    runs.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 device: torch.device | str | None = None, *, extra: tuple[Any, ...] = (),
                 categories: bool = True) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, tuple(x for x in extra if x is not None)
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.categories = categories
        self.last: dict[str, Any] | None = None

    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def measure(self) -> Iterator[PeakMemoryMeter]:
        """Measure the block; fills `self.last` when it exits normally."""
        use_tracker = self.categories or not self._cuda()
        tracker = None
        mods = (x for x in (self.model, *self.extra) if isinstance(x, torch.nn.Module))
        store = next((s for s in map(offload_store, mods) if isinstance(s, ActivationOffload)), None)
        if store is not None:
            store.reset_peak()
        if use_tracker:
            tracker = _StepTracker()
            tracker.offload, tracker.offloaded_at_peak = store, {}
            tracker.track_external(self.model, *(() if self.optimizer is None else (self.optimizer,)), *self.extra)
        if self._cuda():  # GPU-only path (untested in CI)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        with tracker if tracker is not None else contextlib.nullcontext():
            yield self
        result: dict[str, Any] = {"device": str(self.device), "measure_s": time.perf_counter() - t0}
        if tracker is not None:
            snap = _device_snapshot(tracker.get_tracker_snapshot("peak"), self.device)
            result["tracked_peak_bytes"] = snap.pop(_TOTAL)
            result["by_category"] = snap
        else:
            result["tracked_peak_bytes"], result["by_category"] = None, {}
        if self._cuda():  # GPU-only path (untested in CI)
            torch.cuda.synchronize(self.device)
            result["peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            result["source"] = "cuda_allocator"
        else:
            result["peak_bytes"] = result["tracked_peak_bytes"]
            result["source"] = "tensor_tracker"
        result["offloaded_peak_bytes"] = store.peak_bytes if store is not None else 0
        result["host_state_bytes"] = host_state_bytes(self.model, self.optimizer, self.device)
        result["offloaded_at_peak_bytes"] = (sum(v for d, v in tracker.offloaded_at_peak.items()
                                                 if d.type == self.device.type) if tracker is not None else 0)
        self.last = result


def host_state_bytes(model: torch.nn.Module, optimizer: Any, device: torch.device) -> int:
    """Bytes of model state held on the host while the step runs on an accelerator `device`: the parameters (this
    rank's shards), their gradients and the optimizer's state tensors that live on the CPU (FSDP2's CPU offload keeps
    them there); 0 when `device` is the CPU. Read at the end of a step: gradients a step has already cleared are not
    counted."""
    if device.type == "cpu":
        return 0
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
        if t.device.type == "cpu" and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def activation_bytes(reading: dict[str, Any]) -> int:
    """Peak minus the model state (params, buffers, grads, optimizer state) at that peak.

    With the tracker's split this is Activation + Temp + Other at the peak; on CUDA the allocator's
    extra (workspaces, fragmentation inside blocks) is attributed to activations too.
    """
    cats = reading.get("by_category")
    if not cats:
        raise ValueError("this reading has no split by category: measure with PeakMemoryMeter(..., categories=True)")
    return int(reading["peak_bytes"]) - sum(int(cats.get(c, 0)) for c in MODEL_STATE_CATEGORIES)
