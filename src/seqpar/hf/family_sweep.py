"""The family sweep: every decoder-only causal-LM family of the installed transformers (seqpar.hf.family_configs),
built tiny, is either exact under SP 2 (ring and Ulysses: loss, every real-token logit and every parameter
gradient against the unsharded model) or refused before any rank runs a forward, with one line naming the feature
and the fix. Anything else is a FAIL: silently wrong (a mismatch), a crash, or a refusal only inside the forward.

    python tools/family_sweep.py [TYPES...]                 # every family's result on stdout
    python tools/family_sweep.py --write-docs docs/hf.md    # regenerate docs/hf.md's support table

The reference is the unmodified model with its own default attention (sdpa / eager), run on every document
alone, unpadded; the SP side is seqpar's collator, apply_sequence_parallel and seqpar.loss on 2 ranks that are
threads of this process (seqpar.threaded), one world per family. Batches: one packed row of two documents
(position_ids restart) and a padded B=2 batch, all tokens supervised; fp32, train mode, dropout 0.
Tolerance: |SP - reference| <= ATOL + RTOL * max|reference| for the loss, the logits and each gradient tensor.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .. import loss as L
from ..data import SequenceParallelCollator
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, init_mesh
from ..threaded import run_threaded, serial
from .attention import apply_sequence_parallel, check_config
from .equivalence import sp_sft_step
from .family_configs import families, tiny_family_config

__all__ = ["FamilyResult", "sweep", "sweep_family", "BATCHES", "MODES", "ATOL", "RTOL", "STATUSES"]

ATOL = 1e-5
RTOL = 1e-5
VOCAB = 128  # the tiny configs' vocabulary (family_configs)
STATUSES = ("exact", "refused", "excluded", "not buildable", "FAIL")
MODES = {"ring": (1, 2), "ulysses": (2, 1)}  # SP 2: (ulysses degree, ring degree)
# document lengths per row: one packed row of two documents, and a padded batch of two rows
BATCHES = {"packed": [[37, 23]], "batch": [[44], [29]]}

# A plant (tests only): called on each rank's SP model after apply_sequence_parallel, to inject a known error.
Plant = Callable[[torch.nn.Module, SequenceParallelMesh], None]


@dataclass
class FamilyResult:
    """One family's outcome: status (one of STATUSES), the reason / refusal / failure, the worst errors."""

    model_type: str
    model_class: str
    status: str
    detail: str = ""
    errors: dict[str, float] = field(default_factory=dict)


def _rows(kind: str) -> list[list[torch.Tensor]]:
    """Per row, its documents' token ids (fixed generator)."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(3, VOCAB, (n,), generator=g) for n in row] for row in BATCHES[kind]]


def _first_line(text: str) -> str:
    """The first line of a message (and the next one where the first ends in ':', as validators' do)."""
    lines = [x.strip() for x in str(text).strip().splitlines() if x.strip()]
    line = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return line[:300]


def build(model_type: str) -> torch.nn.Module:
    """The family's tiny model: fp32, random init with seed 0, train mode."""
    from transformers import AutoModelForCausalLM

    with serial():
        cfg = tiny_family_config(model_type)
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        finally:
            torch.random.set_rng_state(state)
    return model.train()


# ----------------------------------------------------------------------------- the unsharded reference
@dataclass
class Reference:
    loss: float
    logits: list[torch.Tensor]  # per document, in batch order
    grads: dict[str, torch.Tensor]


def reference(model: torch.nn.Module, kind: str) -> Reference:
    """The token-mean NLL over every document of the batch, each run alone and unpadded on the unmodified
    model; its logits and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    total, count, logits = 0.0, 0, []
    for row in _rows(kind):
        for ids in row:
            lo = model(input_ids=ids[None]).logits[0]
            total = total + F.cross_entropy(lo[:-1].double(), ids[1:], reduction="sum")
            count += ids.numel() - 1
            logits.append(lo.detach())
    loss = total / count
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return Reference(float(loss.detach()), logits, grads)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| in units of the tolerance (> 1: outside it)."""
    diff = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    return diff / (ATOL + RTOL * scale)


# ----------------------------------------------------------------------------- one rank of the SP world
def _sp_errors(model: torch.nn.Module, mesh: SequenceParallelMesh, kind: str, ref: Reference) -> dict[str, float]:
    """Errors (in tolerance units) of one batch through the SP model against the reference."""
    rows = _rows(kind)
    packed = len(rows) == 1 and len(rows[0]) > 1  # documents of one row: position_ids restart at each
    examples = [{"input_ids": d} for d in rows[0]] if packed else [{"input_ids": r[0]} for r in rows]
    batch = SequenceParallelCollator(mesh, pad_token_id=0, packing=packed)(examples)
    model.zero_grad(set_to_none=True)
    share, full, _ = sp_sft_step(model, batch, mesh)
    logit_err, doc = 0.0, 0
    for i, row in enumerate(rows):
        off = 0
        for d in row:
            got = full[0 if packed else i, off:off + d.numel()]
            logit_err = max(logit_err, _err(got, ref.logits[doc]))
            off, doc = off + d.numel(), doc + 1
    grads = dict(model.named_parameters())
    grad_err = max((_err(grads[n].grad if grads[n].grad is not None else torch.zeros_like(g), g)
                    for n, g in ref.grads.items()), default=0.0)
    loss = float(L.global_loss(share, mesh))
    return {"loss": _err(torch.tensor(loss), torch.tensor(ref.loss)), "logits": logit_err, "grad": grad_err}


def _copy(model: torch.nn.Module, model_type: str) -> torch.nn.Module:
    """This rank's copy of the family's model (built again, with the same seed, where it cannot be copied)."""
    with serial():
        try:
            return copy.deepcopy(model)
        except RuntimeError:  # e.g. weight-normed layers: their weights are not graph leaves
            return build(model_type).train(model.training)


def _rank(model: torch.nn.Module, refs: dict[str, Reference], plant: Plant | None,
          model_type: str) -> dict[str, Any]:
    """Per mode: ("refused", message) when apply_sequence_parallel refuses, else ("ran", worst errors)."""
    out: dict[str, Any] = {}
    for mode, (u, r) in MODES.items():
        mesh = init_mesh(2, ulysses_degree=u, ring_degree=r)
        sp = _copy(model, model_type)
        try:
            apply_sequence_parallel(sp, mesh)
        except SeqParError as e:  # config-only checks: every rank refuses alike, before any collective
            out[mode] = ("refused", str(e))
            continue
        if plant is not None:
            plant(sp, mesh)
        worst: dict[str, float] = {}
        for kind in BATCHES:
            for k, v in _sp_errors(sp, mesh, kind, refs[kind]).items():
                worst[f"{kind}.{k}"] = v
        out[mode] = ("ran", worst)
    return out


# ----------------------------------------------------------------------------- classification
def _refusal_line(message: str) -> str | None:
    """Why a refusal message is not one line naming the feature and the fix (None: it is)."""
    if "\n" in message.strip():
        return "the refusal is more than one line"
    if ":" not in message:
        return "the refusal names no fix (no 'problem: what to change')"
    return None


def _failure(text: str) -> str:
    """A failed world's first error, classified: a late refusal (SeqParError in the forward) or a crash."""
    head = next((x for x in text.splitlines() if x.startswith("rank ")), _first_line(text))
    body = head.split(": ", 1)[1] if ": " in head else head
    if body.startswith("SeqParError"):
        return f"refused only in the forward (after launch): {body.split(': ', 1)[-1][:300]}"
    return f"crash: {body[:300]}"


def _classify(ft: Any, per_rank: list[dict[str, Any]]) -> FamilyResult:
    """The family's status from every rank's per-mode outcomes (the worst rank counts)."""
    refused, errors, bad = {}, {}, []
    for out in per_rank:
        for mode, (what, val) in out.items():
            if what == "refused":
                refused[mode] = val
                continue
            for k, v in val.items():
                errors[f"{mode}.{k}"] = max(errors.get(f"{mode}.{k}", 0.0), v)
    wrong = {k: v for k, v in errors.items() if not v <= 1.0}  # NaN counts as wrong
    if wrong:
        worst = max(wrong, key=lambda k: wrong[k] if wrong[k] == wrong[k] else float("inf"))
        bad.append(f"silently wrong: {len(wrong)} checks outside tolerance, worst {worst} = "
                   f"{wrong[worst]:.3g} x tolerance")
    for mode, msg in sorted(refused.items()):
        why = _refusal_line(msg)
        if why:
            bad.append(f"{mode}: {why}: {_first_line(msg)}")
    if bad:
        return FamilyResult(ft.model_type, ft.model_class, "FAIL", "; ".join(bad), errors)
    if refused:
        modes = "both modes" if len(refused) == len(MODES) else ", ".join(sorted(refused))
        msg = _first_line(next(iter(refused.values())))
        return FamilyResult(ft.model_type, ft.model_class, "refused", f"{modes}: {msg}", errors)
    return FamilyResult(ft.model_type, ft.model_class, "exact", "", errors)


def _references(model: torch.nn.Module) -> dict[str, Reference] | None:
    """The references of every batch, or None when a second run of the first batch differs (a random forward,
    e.g. sampled MoE routing in train mode: no exact reference then)."""
    refs = {kind: reference(model, kind) for kind in BATCHES}
    kind = next(iter(BATCHES))
    again = reference(model, kind)
    same = all(torch.equal(x, y) for x, y in zip(refs[kind].logits, again.logits))
    return refs if same else None


def _prepare(ft: Any, prelaunch: Callable[[Any], None]) -> tuple[torch.nn.Module, dict, str] | FamilyResult:
    """(the family's tiny model, its references, a note), train mode or, where train mode is random, eval mode;
    or the family's final result."""
    try:
        model = build(ft.model_type)
    except Exception as e:  # noqa: BLE001 - any failure to build is the family's reason
        return FamilyResult(ft.model_type, ft.model_class, "not buildable", f"{type(e).__name__}: "
                            f"{_first_line(str(e))}")
    try:  # what is checked before any rank starts, from the config alone
        prelaunch(model.config)
    except SeqParError as e:
        res = _classify(ft, [{m: ("refused", str(e)) for m in MODES}])
        res.detail = res.detail.replace("both modes: ", "before launch: ")
        return res
    try:
        refs = _references(model)
        if refs is not None:
            return model, refs, ""
        refs = _references(model.eval())
        if refs is not None:
            return model, refs, "compared in eval mode (its train mode is random)"
        why = "its forward is random in eval mode too"
    except Exception as e:  # noqa: BLE001 - the unmodified model cannot run the sweep's batches
        why = f"the unsharded tiny model fails: {type(e).__name__}: {_first_line(str(e))}"
    return FamilyResult(ft.model_type, ft.model_class, "not buildable", why)


def sweep_family(ft: Any, plant: Plant | None = None, timeout: float = 120.0,
                 prelaunch: Callable[[Any], None] = check_config) -> FamilyResult:
    """One family (a family_configs.Family) through the whole check. prelaunch(config): the checks run before
    any rank starts (default seqpar.hf.check_config; `seqpar train` runs its model checks, tools/ passes them)."""
    from ..spawn import DistributedFailure

    if ft.excluded:
        return FamilyResult(ft.model_type, ft.model_class, "excluded", ft.excluded)
    prepared = _prepare(ft, prelaunch)
    if isinstance(prepared, FamilyResult):
        return prepared
    model, refs, note = prepared
    try:
        per_rank = run_threaded(_rank, 2, model, refs, plant, ft.model_type, timeout=timeout)
    except DistributedFailure as e:
        return FamilyResult(ft.model_type, ft.model_class, "FAIL", _failure(str(e)))
    res = _classify(ft, per_rank)
    if note:
        res.detail = f"{res.detail}; {note}" if res.detail else note
    return res


@contextlib.contextmanager
def _quiet_one_thread() -> Iterator[None]:
    """One intra-op thread (ranks are threads on a shared machine) and transformers' warnings off."""
    from transformers.utils import logging as hf_logging

    n, level = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        torch.set_num_threads(n)
        hf_logging.set_verbosity(level)


def sweep(model_types: Sequence[str] | None = None, plant: Plant | None = None,
          prelaunch: Callable[[Any], None] = check_config) -> list[FamilyResult]:
    """Every family (or the named model types) of the installed transformers, in model-type order."""
    with _quiet_one_thread():
        known = {f.model_type: f for f in families()}
        unknown = sorted(set(model_types or ()) - set(known))
        if unknown:
            raise SeqParError(f"unknown model types {unknown}: use entries of transformers' causal-LM mapping")
        chosen = [known[t] for t in model_types] if model_types else list(known.values())
        return [sweep_family(f, plant, prelaunch=prelaunch) for f in chosen]
