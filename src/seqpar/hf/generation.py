"""Sampling completions for RL (GRPO) from a model that trains sequence-parallel.

Generation is short-prompt, token-by-token work with a KV cache: sharding it over SP ranks would
buy nothing and the SP attention refuses caches. So each SP group generates ONCE, on its first rank
(sp_rank 0), with the model's ORIGINAL attention (`sequence_parallel_paused`), and broadcasts the
completions over the SP group: every rank of a group then trains on identical rows, while dp groups
sample their own prompts. Sampling is reproducible from (seed, step, dp rank) alone.

Not for FSDP-sharded models: a sharded forward needs every rank, while only one rank per SP group
generates here (the trainer refuses `stage: grpo` with FSDP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from ..unwrap import base_model as _base_model

__all__ = ["sequence_parallel_paused", "generate_for_group", "sampling_seed", "group_source_rank"]


@contextlib.contextmanager
def sequence_parallel_paused(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model` on full sequences (its original attention implementation) inside the block.

    Undoes what `apply_sequence_parallel` changed for the forward (the module configs naming the SP
    attention, the backbone's pre-hook) and puts back exactly the same objects afterwards, also when
    the block raises. The labels-loss guard stays (generation passes no labels).
    A model without SP passes through unchanged.
    """
    base = _base_model(model)
    state = getattr(base, "_seqpar_state", None)
    if state is None:
        yield model
        return
    # Every hook dict an SP handle lives in (the decoder's plan hook; a Qwen-VL model's input guard on its
    # outer model) is restored wholesale (same OrderedDict contents and order), not re-registered; the
    # Gated DeltaNet layers' instance forwards are lifted so the class forward runs, and put back.
    dicts: list = []
    for h in state.handles:
        for ref in (h.hooks_dict_ref, *getattr(h, "extra_dict_ref", ())):
            d = ref()
            if d is not None and all(d is not x for x, _ in dicts):
                dicts.append((d, d.copy()))
    owners = [(m, m.config) for m in (ref() for ref in state.restore["owners"]) if m is not None]
    linear = [m for m in (ref() for ref in state.restore.get("linear", [])) if m is not None]
    forwards = [(m, m.__dict__["forward"]) for m in linear if "forward" in m.__dict__]
    try:
        for m, _ in owners:
            m.config = state.restore["config"]
        for d, _ in dicts:
            for h in state.handles:
                d.pop(h.id, None)
        for m, _ in forwards:
            del m.__dict__["forward"]
        yield model
    finally:
        for m, cfg in owners:
            m.config = cfg
        for d, hooks in dicts:
            d.clear()
            d.update(hooks)
        for m, fwd in forwards:
            m.__dict__["forward"] = fwd


def sampling_seed(seed: int, step: int, dp_rank: int) -> int:
    """A seed for one (run seed, step, dp rank): distinct per dp group and step, the same for a group's ranks."""
    return (int(seed) * 1_000_003 + int(step) * 7_919 + int(dp_rank) * 104_729) % (2**63 - 1)


def group_source_rank(mesh: SequenceParallelMesh) -> int:
    """Global rank of this SP group's first rank (seqpar.init_mesh numbers ranks dp-major)."""
    return mesh.dp_rank * mesh.sp_size


@torch.no_grad()
def _sample(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], *, num_generations: int,
            max_new_tokens: int, temperature: float, top_p: float, eos_token_id: int,
            pad_token_id: int) -> list[list[int]]:
    """num_generations completions per prompt, prompt by prompt (no padding: a completion does not
    depend on which other prompts share the step). Each completion ends at its first EOS (kept)."""
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for ids in prompt_ids:
        x = torch.tensor([list(ids)], dtype=torch.long, device=device)
        gen = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=temperature, top_p=top_p,
            top_k=0, max_new_tokens=max_new_tokens, num_return_sequences=num_generations,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )
        for row in gen[:, x.shape[1]:].tolist():
            out.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return out


def generate_for_group(
    model: torch.nn.Module,
    mesh: SequenceParallelMesh,
    prompt_ids: Sequence[Sequence[int]],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    step: int = 0,
    eos_token_id: int,
    pad_token_id: int,
) -> list[list[int]]:
    """Completions (token ids, up to and including the first EOS) for this SP group's prompts.

    Returns len(prompt_ids) * num_generations lists, prompt-major ([p0 g0, p0 g1, ..., p1 g0, ...]),
    identical on every rank of the SP group. Only the group's first rank runs the model (in eval
    mode, SP paused); the others wait for the broadcast. An error there reaches every rank of the
    group as the same SeqParError.
    """
    if num_generations < 1 or max_new_tokens < 1:
        raise SeqParError(f"num_generations={num_generations} and max_new_tokens={max_new_tokens} must be >= 1")
    if temperature <= 0:
        raise SeqParError(f"temperature={temperature} must be > 0 (sampling)")
    result: Any = None
    if mesh.sp_rank == 0:
        was_training = model.training
        device = next(model.parameters()).device
        devices = [device] if device.type != "cpu" else []
        try:
            with torch.random.fork_rng(devices=devices, device_type=device.type):
                torch.manual_seed(sampling_seed(seed, step, mesh.dp_rank))
                model.eval()
                with sequence_parallel_paused(model):
                    result = _sample(model, prompt_ids, num_generations=num_generations,
                                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        except Exception as e:  # travels to the group's other ranks, which would otherwise wait forever
            result = SeqParError(f"generation failed on rank {group_source_rank(mesh)}: {type(e).__name__}: {e}")
        finally:
            model.train(was_training)
    if mesh.sp_size > 1:
        result = comm.broadcast_object(result, group_source_rank(mesh), mesh.comm_device, group=mesh.sp_group)
    if isinstance(result, Exception):
        raise result
    return result
