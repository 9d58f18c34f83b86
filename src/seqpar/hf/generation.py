"""Sampling completions for RL (GRPO) from a model that trains sequence-parallel.

Generation is short-prompt, token-by-token work with a KV cache: sharding the SEQUENCE over SP ranks
would buy nothing and the SP attention refuses caches. So the PROMPTS are shared out instead: every
rank of an SP group samples a contiguous share of the group's prompts (all their `num_generations`
rows in one batched `generate`, left-padded, KV cache), with the model's ORIGINAL attention
(`sequence_parallel_paused`), and the completions are all-gathered over the SP group: every rank then
trains on identical rows, while dp groups sample their own prompts.

Sampling. seqpar builds the whole GenerationConfig (`sampling_config`: max_new_tokens, pad / eos, every
logits processor and warper of generate() explicitly neutral) and puts it in place of the model's own
`generation_config` for the call, so a checkpoint's extras (repetition_penalty, min_p, ...) are not
applied: tokens are drawn from softmax(logits / T) restricted by top_k / top_p, the distribution the
GRPO loss assumes. Temperature, top_k, top_p and the draw are `_RowSampler`'s (a logits processor, after
generate()'s neutral ones; transformers' own warpers), which never draws a vision-language model's image / video
placeholder ids (`placeholder_ids`: a placeholder in a completion has no media to embed, so the row could not be
trained; stock TRL suppresses the image id the same way) and samples from one
torch.Generator per completion row seeded from (seed, step, dp rank, prompt index, generation index), or,
given `prompt_index` (the prompts' positions in the step's global batch, as `seqpar train` passes), from
(seed, step, that position, generation index): a completion does not depend on which SP rank drew it, on
the batch it shared, on SP size -- nor, with `prompt_index`, on the dp size (a resume on another layout
samples what the uninterrupted run would). What
can differ: batching changes the logits by float rounding (another batch shape, left padding), which
flips a draw only when a uniform lands within that rounding of a CDF boundary.

FSDP2-sharded models: every forward all-gathers parameters over the whole world, so every rank must run
the same number of forwards. Each rank makes exactly one `generate` call per rollout (a rank without
prompts decodes one dummy row) with `synced_gpus=True`, which keeps every rank decoding until all are done.
DeepSpeed ZeRO-3 (TRL drop-in) the same way: one `generate` per rank per rollout, inside which TRL gathers
the full weights once (`ds3_gather_for_generation=True`, its default: one GatheredParameters over all
parameters, then generate without per-module fetches) or, with it False, ZeRO-3 fetches each module's
weights at each call; transformers turns synced_gpus on under ZeRO-3 itself, so in both cases every rank
issues the same gathers in the same order until the last rank's last token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .. import comm
from ..errors import SeqParError
from ..memory.checkpointing import drop_input_require_grads
from ..mesh import SequenceParallelMesh
from ..unwrap import base_model as _base_model
from .rollout_media import media_encoded_in_forward

__all__ = ["sequence_parallel_paused", "generate_for_group", "media_generate_kwargs", "sampling_seed", "row_seed",
           "group_source_rank", "placeholder_ids",
           "sampling_config", "prompt_share", "is_sharded", "sample_rows", "checkpointing_kept", "fsdp_synced",
           "local_rows", "gather_shares"]


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
    # recurrent layers' instance forwards (Gated DeltaNet, Mamba2) are lifted so the class forward runs, and put back.
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


def row_seed(seed: int, step: int, dp_rank: int, prompt: int, generation: int) -> int:
    """The seed of one completion row: generation `generation` of prompt `prompt` (index in the dp group's list)."""
    return (sampling_seed(seed, step, dp_rank) * 1_000_033 + int(prompt) * 65_537 + int(generation)) % (2**63 - 1)


def group_source_rank(mesh: SequenceParallelMesh) -> int:
    """Global rank of this SP group's first rank (seqpar.init_mesh numbers ranks dp-major)."""
    return mesh.dp_rank * mesh.sp_size


def prompt_share(n: int, sp_size: int, sp_rank: int) -> range:
    """The contiguous prompt indices SP rank `sp_rank` samples (shares differ by at most one prompt)."""
    return range(n * sp_rank // sp_size, n * (sp_rank + 1) // sp_size)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` is FSDP2-sharded or DeepSpeed ZeRO-3-partitioned: its forwards (FSDP2, ZeRO-3 per-module
    fetches) or its generation-time gathers (TRL's GatheredParameters) are collectives over the shard group,
    so every rank must generate, the same number of times."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(hasattr(p, "ds_id")
                                                                          for p in model.parameters())


def sampling_config(*, max_new_tokens: int, eos_token_id: int | None, pad_token_id: int) -> GenerationConfig:
    """The complete GenerationConfig of a rollout: sampling with every logits processor and warper of
    generate() explicitly neutral (none is filled in from a model's generation_config, which generate()
    does for fields left None). Temperature, top_k and top_p are applied by `_RowSampler`, which draws.
    eos_token_id None: no stop token, every row decodes max_new_tokens (the engines benchmark)."""
    return GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=None, top_h=None,
        typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
        length_penalty=1.0, no_repeat_ngram_size=0, bad_words_ids=None, min_length=0, min_new_tokens=None,
        suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
        sequence_bias=None, guidance_scale=None, renormalize_logits=False, num_beams=1, num_return_sequences=1,
        max_new_tokens=int(max_new_tokens), max_length=None,
        eos_token_id=None if eos_token_id is None else int(eos_token_id),
        pad_token_id=int(pad_token_id), bos_token_id=None, use_cache=True, watermarking_config=None,
    )


def placeholder_ids(model: torch.nn.Module) -> list[int]:
    """The ids a completion must never hold: a vision-language model's image / video placeholders (their count
    must match the media's patches, and a completion brings no media). Empty for a text-only model."""
    cfg = _base_model(model).config
    if getattr(cfg, "vision_config", None) is None:
        return []
    return sorted({int(v) for v in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
                   if v is not None})


class _RowSampler(LogitsProcessor):
    """The draw: softmax(logits / temperature) after top_k / top_p (transformers' own warpers), over every id but
    `banned` (placeholder_ids), sampled from one generator per row. Runs after generate()'s (neutral) processors;
    the scores it returns put all mass on the drawn token, so generate()'s own multinomial can only return it."""

    def __init__(self, generators: list[torch.Generator], temperature: float, top_k: int, top_p: float,
                 banned: Sequence[int] = ()) -> None:
        self.generators = generators
        self.banned = list(banned)
        self.logprobs: list[torch.Tensor] = []  # per decoding step: [rows]
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(float(temperature))])
        if top_k:
            self.warpers.append(TopKLogitsWarper(int(top_k)))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(float(top_p)))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float()
        if self.banned:  # before top_k / top_p: they then choose among the ids that may be drawn
            scores = scores.index_fill(1, torch.tensor(self.banned, device=scores.device), float("-inf"))
        warped = self.warpers(input_ids, scores)
        probs = torch.softmax(warped, dim=-1).cpu()
        drawn = torch.stack([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        # each drawn token's log-prob under softmax(logits / T) (after top_k / top_p), for rollouts.jsonl
        self.logprobs.append(torch.log_softmax(warped, dim=-1).gather(1, drawn.to(warped.device))[:, 0].cpu())
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, drawn.to(scores.device), 0.0)


@contextlib.contextmanager
def _generation_config(model: torch.nn.Module, cfg: GenerationConfig) -> Iterator[None]:
    """The model's own generation_config replaced by `cfg` for the block (generate() fills unset fields from it)."""
    base = _base_model(model)
    saved = getattr(base, "generation_config", None)
    base.generation_config = cfg
    try:
        yield
    finally:
        base.generation_config = saved


def media_generate_kwargs(model: torch.nn.Module, x: torch.Tensor, media: Sequence[dict] | None) -> dict[str, Any]:
    """generate() keyword arguments for rows `x` of a vision-language model whose row i carries media[i] (the
    VisionCollator keys): the media concatenated in row order, and the token types multimodal RoPE reads."""
    if not media or not any(media):
        return {}
    cfg = _base_model(model).config
    device = next(model.parameters()).device
    kw: dict[str, Any] = {"mm_token_type_ids": (x == cfg.image_token_id).int() + 2 * (x == cfg.video_token_id).int()}
    for pix, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        have = [m for m in media if m.get(grid) is not None]
        if have:
            kw[pix] = torch.cat([torch.as_tensor(m[pix]) for m in have]).to(device)
            kw[grid] = torch.cat([torch.as_tensor(m[grid]).reshape(-1, 3) for m in have]).to(device)
    ts = [float(t) for m in media for t in (m.get("second_per_grid_ts") or [])]
    if ts and cfg.model_type == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.tensor(ts)
    return kw


@torch.no_grad()
def sample_rows(model: torch.nn.Module, rows: Sequence[Sequence[int]], seeds: Sequence[int], cfg: GenerationConfig,
                *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                synced: bool = False, media: Sequence[dict] | None = None,
                logprobs: list[list[float]] | None = None) -> list[list[int]]:
    """One batched generate() over `rows` (left-padded, KV cache) with `cfg` (`sampling_config`), row i drawn
    with a generator seeded seeds[i], never a media placeholder (`placeholder_ids`); each completion ends at its
    first EOS (kept). `synced`: synced_gpus. media: per row, a vision-language prompt's images / videos
    (`media_generate_kwargs`). logprobs: filled with each completion's tokens' log-probs under the warped
    softmax(logits / temperature)."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    pad = cfg.pad_token_id
    x = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    sampler = _RowSampler(gens, temperature, top_k, top_p, banned=placeholder_ids(model))
    with _generation_config(model, cfg), media_encoded_in_forward(model, synced and bool(media)):
        out = model.generate(input_ids=x, attention_mask=mask, generation_config=cfg, synced_gpus=synced,
                             logits_processor=LogitsProcessorList([sampler]), **media_generate_kwargs(model, x, media))
    eos = cfg.eos_token_id
    done = [row[: row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]
    if logprobs is not None:
        steps = torch.stack(sampler.logprobs, dim=1) if sampler.logprobs else torch.zeros(len(rows), 0)
        logprobs.extend(steps[i, : len(c)].tolist() for i, c in enumerate(done))
    return done


def local_rows(prompt_ids: Sequence[Sequence[int]], share: range, num_generations: int, seed: int, step: int,
                dp_rank: int, prompt_index: Sequence[int] | None) -> tuple[list[list[int]], list[int]]:
    rows = [list(prompt_ids[i]) for i in share for _ in range(num_generations)]
    if prompt_index is None:
        seeds = [row_seed(seed, step, dp_rank, i, k) for i in share for k in range(num_generations)]
    else:  # positions in the step's global batch: the same seeds at any dp size
        seeds = [row_seed(seed, step, 0, prompt_index[i], k) for i in share for k in range(num_generations)]
    return rows, seeds


def generate_for_group(
    model: torch.nn.Module,
    mesh: SequenceParallelMesh,
    prompt_ids: Sequence[Sequence[int]],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    step: int = 0,
    eos_token_id: int | None,
    pad_token_id: int,
    prompt_index: Sequence[int] | None = None,
    media: Sequence[dict] | None = None,
    return_logprobs: bool = False,
) -> Any:
    """Completions (token ids, up to and including the first EOS) for this SP group's prompts; with
    return_logprobs, (completions, their tokens' log-probs as the sampler drew them: `sample_rows`).
    media: per prompt, a vision-language prompt's images / videos (seqpar.data.VisionCollator keys; {} for none):
    the rows of a prompt generate with them.

    Returns len(prompt_ids) * num_generations lists, prompt-major ([p0 g0, p0 g1, ..., p1 g0, ...]),
    identical on every rank of the SP group. Every SP rank samples its `prompt_share` (in eval mode,
    SP paused) and the shares are all-gathered; an error on any rank reaches every rank of the group
    as the same SeqParError (a sharded model: after its generate(), see the module docstring).
    """
    if num_generations < 1 or max_new_tokens < 1:
        raise SeqParError(f"num_generations={num_generations} and max_new_tokens={max_new_tokens} must be >= 1")
    if temperature <= 0:
        raise SeqParError(f"temperature={temperature} must be > 0 (sampling)")
    cfg = sampling_config(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    warp = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    share = prompt_share(len(prompt_ids), mesh.sp_size, mesh.sp_rank)
    if prompt_index is not None and len(prompt_index) != len(prompt_ids):
        raise SeqParError(f"prompt_index has {len(prompt_index)} positions for {len(prompt_ids)} prompts")
    rows, seeds = local_rows(prompt_ids, share, num_generations, seed, step, mesh.dp_rank, prompt_index)
    row_media = [media[i] for i in share for _ in range(num_generations)] if media is not None else None
    synced = is_sharded(model) and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    result: Any = []
    was_training = model.training
    try:
        model.eval()
        with sequence_parallel_paused(model):
            if rows:
                lps: list[list[float]] = []
                result = sample_rows(model, rows, seeds, cfg, synced=synced, media=row_media, logprobs=lps, **warp)
                result = list(zip(result, lps))
            elif synced:  # every rank of the shard group runs the same forwards: decode one dummy row
                dummy = [list(prompt_ids[0]) if prompt_ids else [pad_token_id]]
                sample_rows(model, dummy, [0], cfg, synced=True, media=media[:1] if media and prompt_ids else None,
                            **warp)
    except Exception as e:  # travels to the group's other ranks, which would otherwise wait forever
        result = SeqParError(f"generation failed on rank {group_source_rank(mesh) + mesh.sp_rank}: "
                             f"{type(e).__name__}: {e}")
    finally:
        model.train(was_training)
    ids, lps = gather_shares(result, mesh)
    return (ids, lps) if return_logprobs else ids


def gather_shares(result: Any, mesh: SequenceParallelMesh) -> tuple[list[list[int]], list[list[float]]]:
    """Every SP rank's share ([(completion, log-probs)] or the SeqParError it met), all-gathered in rank order:
    (completions, log-probs), or the first error raised on every rank of the group."""
    parts = comm.all_gather_object(result, group=mesh.sp_group) if mesh.sp_size > 1 else [result]
    for p in parts:
        if isinstance(p, Exception):
            raise SeqParError(str(p))
    got = [c for p in parts for c in p]
    return [c for c, _ in got], [lp for _, lp in got]


# ----------------------------------------------------------------------------- TRL GRPO drop-in helpers
@contextlib.contextmanager
def checkpointing_kept(model: torch.nn.Module) -> Iterator[None]:
    """Every module's layer-checkpointing state (flag and checkpoint function) put back after the block, and
    transformers' input-grad hooks dropped again: TRL disables checkpointing for generation and re-enables it
    with `gradient_checkpointing_kwargs`, which checkpoints EVERY layer (every_n_layers / offload are not
    checkpoint-function kwargs), so each rank's backward would recompute other layers than configured."""
    saved = [(m, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
             for m in _base_model(model).modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    try:
        yield
    finally:
        for m, flag, fn in saved:
            m.gradient_checkpointing = flag
            if fn is not None:
                m._gradient_checkpointing_func = fn
        if any(flag for _, flag, _ in saved):
            drop_input_require_grads(model)


@contextlib.contextmanager
def fsdp_synced(model: torch.nn.Module) -> Iterator[None]:
    """An FSDP2-sharded (or ZeRO-3-partitioned) model: transformers' generate() then keeps every rank decoding
    until all are done (synced_gpus, which it turns on for a model marked `_is_fsdp_managed_module`; under
    ZeRO-3 also when the TrainingArguments' DeepSpeed config is alive), so every rank runs the same forwards,
    each an all-gather over the shard group (ZeRO-3 with TRL's one-off gather: the same flag all-reduces)."""
    base = _base_model(model)
    if not is_sharded(model) or getattr(base, "_is_fsdp_managed_module", False):
        yield
        return
    base._is_fsdp_managed_module = True
    try:
        yield
    finally:
        del base._is_fsdp_managed_module
