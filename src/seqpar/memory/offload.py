"""Host offload of the checkpointed decoder-layer inputs: the only activations layer checkpointing keeps.

    store = install_activation_offload(model)   # after enable_activation_checkpointing(model)
    store.stats()   # {"current_bytes", "peak_bytes", "packed_bytes", "packed_tensors"}

How: each checkpointed layer call runs inside `torch.autograd.graph.saved_tensors_hooks(store.pack,
store.unpack)`. Non-reentrant `torch.utils.checkpoint` saves the call's tensor inputs BEFORE it installs
its own hooks (which turn every tensor saved inside the layer into a recompute placeholder), so our hooks
see exactly the layer's positional tensor inputs (the hidden states; transformers binds the keyword
arguments, position embeddings and masks included, into the checkpointed function, where the model holds
them anyway). In backward, the recompute of a layer unpacks its input once, then frees it with the layer's
graph. Bytes are copied bit for bit, so the loss and every gradient are those of plain checkpointing.

Where the bytes go:
- CPU (the compute device is the host; tested here): into a numpy buffer. numpy's allocation is no torch
  tensor, so the exact meter (seqpar.memory.meter, torch's MemTracker) does not count it as device bytes;
  the store counts it as offloaded bytes, and the meter reports both. Unpacking allocates a fresh tensor
  with a torch op (counted again while the layer is recomputed). On a CPU-only machine this saves no RAM:
  it moves the layer inputs out of what the device budget is measured on, as the GPU path moves them off
  the GPU, and it exercises the very same hooks, recompute order and accounting.
- CUDA / other accelerators (NOT tested here: no GPU in CI): a pinned host buffer per layer input, filled
  on a side stream (the compute stream does not wait for the copy); in backward the unpack of layer i's
  input starts the host-to-device copy of layer i-1's input on the side stream, so it overlaps layer i's
  recompute and backward. At most two layer inputs are on the device at a time: the one being recomputed
  and the one prefetched.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["ActivationOffload", "install_activation_offload", "offload_store", "remove_activation_offload"]

_ATTR = "_seqpar_activation_offload"


class _Block:
    """One offloaded tensor: its host bytes and what rebuilds it. Frees its share of the store's count."""

    __slots__ = ("store", "host", "nbytes", "dtype", "shape", "device", "ready", "fetched", "prev", "__weakref__")

    def __init__(self, store: ActivationOffload, host: Any, t: torch.Tensor) -> None:
        self.store, self.host, self.nbytes = store, host, t.numel() * t.element_size()
        self.dtype, self.shape, self.device = t.dtype, t.shape, t.device
        self.ready: Any = None  # accelerator: event after the device-to-host copy
        self.fetched: tuple[torch.Tensor, Any] | None = None  # accelerator: prefetched (tensor, event)
        self.prev: weakref.ref | None = None
        store._add(self.nbytes)

    def __del__(self) -> None:
        self.store._add(-self.nbytes)


class ActivationOffload:
    """The host store of one model's checkpointed layer inputs, with its byte counts."""

    def __init__(self) -> None:
        self.current_bytes = self.peak_bytes = self.packed_bytes = self.packed_tensors = 0
        self._last: weakref.ref | None = None
        self._stream: Any = None

    def _add(self, n: int) -> None:
        self.current_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def stats(self) -> dict[str, int]:
        return {"current_bytes": self.current_bytes, "peak_bytes": self.peak_bytes,
                "packed_bytes": self.packed_bytes, "packed_tensors": self.packed_tensors}

    # ---------------------------------------------------------------- saved-tensor hooks
    def pack(self, t: torch.Tensor) -> Any:
        if t.numel() == 0 or isinstance(t, torch.nn.Parameter) or type(t) is not torch.Tensor:
            return t  # checkpoint's empty dummy, parameters, tensor subclasses (DTensor): kept as they are
        block = _pack_host(self, t) if t.device.type == "cpu" else self._pack_accelerator(t)
        self.packed_bytes += block.nbytes
        self.packed_tensors += 1
        block.prev, self._last = self._last, weakref.ref(block)
        return block

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Block):
            return packed
        if packed.device.type == "cpu":
            return _unpack_host(packed)
        return self._unpack_accelerator(packed)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    # ---------------------------------------------------------------- accelerator path (not CI-tested)
    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.Stream(device=device)
        return self._stream

    def _pack_accelerator(self, t: torch.Tensor) -> _Block:
        side, compute = self._side_stream(t.device), torch.accelerator.current_stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        side.wait_stream(compute)  # t is complete on the compute stream
        with side:
            host.copy_(t, non_blocking=True)
            t.record_stream(side)  # the caching allocator keeps t's block until the copy is done
        block = _Block(self, host, t)
        block.ready = side.record_event()
        return block

    def _fetch(self, block: _Block) -> None:
        """Start the host-to-device copy of `block` on the side stream (a prefetch, or the fetch itself)."""
        if block.fetched is not None:
            return
        side = self._side_stream(block.device)
        with side:
            side.wait_event(block.ready)
            dev = torch.empty(block.shape, dtype=block.dtype, device=block.device)
            dev.copy_(block.host, non_blocking=True)
            block.fetched = (dev, side.record_event())

    def _unpack_accelerator(self, block: _Block) -> torch.Tensor:
        self._fetch(block)
        dev, done = block.fetched  # type: ignore[misc]
        block.fetched = None
        compute = torch.accelerator.current_stream(block.device)
        compute.wait_event(done)
        dev.record_stream(compute)  # allocated on the side stream, used on the compute stream
        prev = block.prev() if block.prev is not None else None
        if prev is not None:  # the layer before: recomputed next in backward
            self._fetch(prev)
        return dev


def _pack_host(store: ActivationOffload, t: torch.Tensor) -> _Block:
    """Bytes of a CPU tensor into a numpy buffer (no torch allocation: invisible to the tensor meter)."""
    src = t.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    host = src.reshape(-1).view(torch.uint8).numpy().copy()
    return _Block(store, host, t)


def _unpack_host(block: _Block) -> torch.Tensor:
    out = torch.empty(block.nbytes, dtype=torch.uint8, device=block.device)  # a torch op: counted by the meter
    out.copy_(torch.from_numpy(block.host))
    return out.view(block.dtype).view(block.shape)


def _offloaded(checkpoint_func: Callable[..., Any], store: ActivationOffload) -> Callable[..., Any]:
    @functools.wraps(checkpoint_func)
    def call(*args: Any, **kwargs: Any) -> Any:
        with store.hooks():
            return checkpoint_func(*args, **kwargs)

    call._seqpar_offload_inner = checkpoint_func  # type: ignore[attr-defined]
    return call


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True
            and callable(getattr(m, "_gradient_checkpointing_func", None))]


def install_activation_offload(model: torch.nn.Module) -> ActivationOffload:
    """Offload the inputs of every checkpointed layer of `model` (checkpointing must be on); idempotent.

    The store is kept on `model` (see offload_store). Call again after re-enabling checkpointing.
    """
    store = offload_store(model) or ActivationOffload()
    layers = _checkpointed_layers(model)
    if not layers:
        from ..errors import SeqParError

        raise SeqParError("activation offload needs activation checkpointing: enable it first "
                          "(memory.activation_checkpointing: true / gradient_checkpointing=True)")
    for m in layers:
        func = m._gradient_checkpointing_func
        if getattr(func, "_seqpar_offload_inner", None) is None:
            m._gradient_checkpointing_func = _offloaded(func, store)
    setattr(model, _ATTR, store)
    return store


def remove_activation_offload(model: torch.nn.Module) -> None:
    for m in _checkpointed_layers(model):
        inner = getattr(m._gradient_checkpointing_func, "_seqpar_offload_inner", None)
        if inner is not None:
            m._gradient_checkpointing_func = inner
    if hasattr(model, _ATTR):
        delattr(model, _ATTR)


def offload_store(model: torch.nn.Module | None) -> ActivationOffload | None:
    """The store install_activation_offload put on `model` or on any module inside it (PEFT / FSDP wrappers)."""
    if model is None:
        return None
    for m in model.modules():
        store = getattr(m, _ATTR, None)
        if store is not None:
            return store
    return None
