"""Fused chunked lm_head + loss (seqpar.memory.fused_loss) in the shared train step.

Each case runs the SAME global batch through
- an independent single-process reference: the plain HF model (no SP, full logits) on every row
  (every packed document) separately, with hand-written shift / CE / DPO (tests/test_hf_equivalence);
- `seqpar.steps.micro_batch_loss` (what `seqpar train` and both HF Trainer drop-ins call) on
  the SP model with fused_loss on (small chunks, so several chunks per rank), and again with it off
  (full logits), gradients SUMMED over dp x sp (seqpar.loss convention; FSDP2 and DDP average, hence
  the factor). DDP runs with find_unused_parameters=True, the HF Trainer's default.
Compared: global loss and every parameter gradient. Tolerances: fp32 fused vs reference 1e-5
absolute; fused vs full-logits path 1e-6 absolute on the loss and 2e-6 on gradients relative to
max(1, largest |gradient|): the fused head multiplies only the supervised rows and scatters their
NLL back, so fp32 sums round differently (worst measured 1.1e-6, Gemma3 DPO embedding gradients
under USP, where the full-logits path is itself 1.3e-6 from the reference); bf16 (pure bf16
weights) fused vs full-logits bf16 path 1e-3 on loss / 1e-2 (relative, as above) on gradients
(bf16 rounding of differently-grouped matmuls), and loss vs the fp32 reference 1e-2.
A dispatch-mode test shows no op output ever has S_local * vocab elements with fused_loss on, and
that the same check catches the full-logits path.
"""

from __future__ import annotations

import pytest
import torch
from reference import AdapterOff
from test_hf_equivalence import MODES, _grads, _max_grad_diff, _ref_dpo, _ref_sft, _rows
from torch.utils._python_dispatch import TorchDispatchMode

import seqpar
from seqpar import loss as L
from seqpar.data import SequenceParallelCollator, SequenceParallelDPOCollator
from seqpar.errors import SeqParError
from seqpar.hf import ARCHS, apply_sequence_parallel, tiny_model
from seqpar.memory.fused_loss import fused_targets, install_fused_head
from seqpar.spawn import run_distributed
from seqpar.steps import ReferenceLogps, StepSpec, count_items, micro_batch_loss
from seqpar.threaded import run_threaded

REF_TOL = 1e-5  # fp32: fused SP vs single-process plain HF model
PATH_TOL = 1e-6  # fp32: fused vs full-logits path of the same SP run (loss, absolute)
PATH_GRAD_TOL = 2e-6  # ... gradients, relative to max(1, largest |gradient|); see the module docstring
BF16_PATH_LOSS, BF16_PATH_GRAD, BF16_REF_LOSS = 1e-3, 1e-2, 1e-2
CHUNK = 7  # supervised tokens per chunk: several chunks per rank


def _make(arch, hq, hkv, seed, opts):
    kw = {}
    if opts.get("tied"):
        kw["tie_word_embeddings"] = True
    if opts.get("softcap"):
        kw["final_logit_softcapping"] = opts["softcap"]
    model = tiny_model(arch, hq, hkv, seed=seed, **kw)
    if opts.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 7)  # identical random A and B in every copy (B != 0: real gradients)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(model, cfg)
    return model


def _reference(arch, hq, hkv, kind, loss_type, rows, opts):
    """(loss, grads) of the plain single-process model; beta/gamma as in _sp_run."""
    policy = _make(arch, hq, hkv, 0, opts).train()
    if kind == "dpo":
        ref = AdapterOff(policy) if opts.get("lora") else _make(arch, hq, hkv, 1, opts).eval()
        want = _ref_dpo(policy, ref, rows, loss_type, 0.5, 0.3)
    else:
        want, _, _ = _ref_sft(policy, rows)
    want.backward()
    return float(want.detach()), _grads(policy)


def _sp_run(mesh, arch, hq, hkv, kind, loss_type, rows, opts, fused):
    """(global loss, grads summed over dp x sp) of micro_batch_loss on this rank's shard."""
    bf16, fsdp = opts.get("bf16", False), opts.get("fsdp", False)
    model = apply_sequence_parallel(_make(arch, hq, hkv, 0, opts), mesh).train()
    if bf16 and not fsdp:  # as `seqpar train`: pure bf16 weights, or FSDP2 mixed precision (fp32 master)
        model.to(torch.bfloat16)
    factor = 1.0
    if fsdp:
        from seqpar.train.model.build import apply_fsdp

        apply_fsdp(model, torch.device("cpu"), mesh.world_size, bf16)
        factor = L.gradient_reduction_factor(mesh)
    if opts.get("ddp"):  # as the HF Trainer wraps it: DDP over dp x sp, find_unused_parameters=True
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        factor = L.gradient_reduction_factor(mesh)
    spec = StepSpec("dpo" if kind == "dpo" else "sft", 0.5, loss_type or "sigmoid", 0.3,
                    fused_loss=fused, loss_chunk_tokens=CHUNK)
    fkw = dict(fused_loss=fused, loss_chunk_tokens=CHUNK)
    reference = None
    if kind == "dpo" and loss_type != "simpo":
        if opts.get("lora"):
            reference = ReferenceLogps(mesh, policy=model, **fkw)
        else:
            ref = apply_sequence_parallel(_make(arch, hq, hkv, 1, opts), mesh).eval().requires_grad_(False)
            reference = ReferenceLogps(mesh, ref_model=ref.to(torch.bfloat16) if bf16 else ref, **fkw)
    if kind == "dpo":
        batch = SequenceParallelDPOCollator(mesh, pad_token_id=0)(rows[mesh.dp_rank])
    else:
        batch = SequenceParallelCollator(mesh, pad_token_id=0, packing=(kind == "packed"))(rows[mesh.dp_rank])
    num = L.global_token_count(count_items([batch], spec.stage), mesh)
    share, _ = micro_batch_loss(model, batch, num, mesh, spec, reference)
    (share * factor).backward()
    if factor == 1.0:
        L.sum_gradients(model.parameters(), mesh)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if hasattr(g, "full_tensor") else g  # FSDP2: DTensor shards
        grads[n.removeprefix("module.")] = g.detach().float().clone()  # DDP: "module." prefix
    return float(L.global_loss(share, mesh)), grads


def run_case(mesh, arch, hq, hkv, kind, loss_type="", **opts):
    rows = _rows(kind, 100, mesh.dp_size)
    want, ref_grads = _reference(arch, hq, hkv, kind, loss_type, rows, opts)
    got, grads = _sp_run(mesh, arch, hq, hkv, kind, loss_type, rows, opts, fused=True)
    full, full_grads = _sp_run(mesh, arch, hq, hkv, kind, loss_type, rows, opts, fused=False)
    return {
        "ref_loss": abs(got - want), "ref_grad": _max_grad_diff(grads, ref_grads),
        "path_loss": abs(got - full), "value": want,
        "path_grad": _max_grad_diff(grads, full_grads) / max(1.0, *(float(g.abs().max()) for g in full_grads.values())),
    }


def world_cases(cases):
    """Run cases [(mode, arch, hq, hkv, kind, loss_type, opts)]; meshes built once per mode."""
    meshes, out = {}, []
    for mode, arch, hq, hkv, kind, loss_type, opts in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append(((mode, arch, kind, loss_type, opts), run_case(meshes[mode], arch, hq, hkv, kind, loss_type,
                                                                  **opts)))
    return out


def _assert_results(per_rank):
    bad = []
    for rank, results in enumerate(per_rank):
        for key, r in results:
            if key[-1].get("bf16"):
                ok = (r["path_loss"] <= BF16_PATH_LOSS and r["path_grad"] <= BF16_PATH_GRAD
                      and r["ref_loss"] <= BF16_REF_LOSS)
            else:
                ok = (r["ref_loss"] <= REF_TOL and r["ref_grad"] <= REF_TOL and r["path_loss"] <= PATH_TOL
                      and r["path_grad"] <= PATH_GRAD_TOL)
            if not ok:
                bad.append((rank, key, r))
    assert not bad, "fused loss != reference:\n" + "\n".join(map(str, bad))
    for results in per_rank[:1]:
        for key, r in results:
            print(key, {k: f"{v:.2e}" for k, v in r.items()})  # shown with pytest -s


FAST_W2 = [
    ("ulysses2", "llama", 9, 3, "pad", "", {}),
    ("ring2", "qwen3", 4, 2, "packed", "", {"tied": True}),
    ("ulysses2", "gemma2", 4, 2, "dpo", "sigmoid", {"softcap": 2.0}),
    ("ring2", "mistral", 4, 2, "dpo", "ipo", {"lora": True}),
    ("ulysses2", "llama", 4, 2, "pad", "", {"fsdp": True}),
    ("ring2", "qwen2", 4, 2, "pad", "", {"ddp": True}),
    ("ring2", "llama", 4, 2, "pad", "", {"bf16": True}),
]
FAST_W4 = [
    ("usp2x2", "gemma3", 4, 2, "pad", "", {}),
    ("dp2xring2", "phi3", 4, 2, "dpo", "simpo", {}),
]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_fused_world2_fast():
    _assert_results(run_distributed(world_cases, 2, FAST_W2, timeout=600))


def test_fused_world4_fast():
    _assert_results(run_threaded(world_cases, 4, FAST_W4, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fused_full_grid(world):
    modes = {2: ["ulysses2", "ring2"], 4: ["usp2x2", "dp2xulysses2"]}[world]
    kinds = [("pad", ""), ("packed", ""), ("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "simpo")]
    cases = [(m, a, 4, 2, kind, lt, {"softcap": 2.0} if a in ("gemma2", "gemma3") else {})
             for m in modes for a in ARCHS for kind, lt in kinds]
    cases += [(modes[0], a, 4, 2, "dpo", "sigmoid", {"lora": True, "tied": True}) for a in ("llama", "qwen2")]
    cases += [(modes[1], "llama", 4, 2, "dpo", "sigmoid", {"fsdp": True}),
              (modes[0], "qwen3", 4, 2, "dpo", "sigmoid", {"fsdp": True, "bf16": True}),
              (modes[1], "gemma2", 4, 2, "pad", "", {"bf16": True, "softcap": 2.0})]
    _assert_results(run_distributed(world_cases, world, cases, timeout=3000))


# ----------------------------------------------------------------------------- no [S_local, V] tensor
class _MaxNumel(TorchDispatchMode):
    """Records the largest numel of any op output (forward, backward and checkpoint recomputation)."""

    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


def _largest_tensor(fused, stage):
    """Largest op output of one SFT or DPO (sigmoid, frozen reference model) step: forward + backward."""
    vocab, s_full = 8192, 256  # S_local = 128 per rank; hidden 32: S_local * V >> V * H (embedding grads)
    mesh = seqpar.init_mesh(2, ulysses_degree=2, ring_degree=1)
    model = apply_sequence_parallel(tiny_model("llama", 4, 2, vocab_size=vocab), mesh).train()
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    spec = StepSpec(stage, fused_loss=fused, loss_chunk_tokens=16)
    reference = None
    if stage == "dpo":
        pair = {"prompt_input_ids": tokens(16), "chosen_input_ids": tokens(s_full - 16),
                "rejected_input_ids": tokens(200)}
        batch = SequenceParallelDPOCollator(mesh, pad_token_id=0)([pair])
        ref = apply_sequence_parallel(tiny_model("llama", 4, 2, vocab_size=vocab, seed=1), mesh).eval()
        reference = ReferenceLogps(mesh, ref_model=ref, fused_loss=fused, loss_chunk_tokens=16)
    else:
        batch = SequenceParallelCollator(mesh, pad_token_id=0)([{"input_ids": tokens(s_full)}])
    num = L.global_token_count(count_items([batch], stage), mesh)
    with _MaxNumel() as rec:
        share, _ = micro_batch_loss(model, batch, num, mesh, spec, reference)
        share.backward()
    return rec.max, batch["input_ids"].shape[1] * vocab, model.get_input_embeddings().weight.numel()


def _numel_world():
    return {(stage, fused): _largest_tensor(fused, stage) for stage in ("sft", "dpo") for fused in (True, False)}


def test_no_full_logits_tensor():
    for res in run_distributed(_numel_world, 2, timeout=600):
        for stage in ("sft", "dpo"):
            fused_max, s_v, weight = res[(stage, True)]
            full_max = res[(stage, False)][0]
            print(f"{stage}: S_local*V={s_v} V*H={weight} largest op output: fused {fused_max}, full {full_max}")
            assert full_max >= s_v  # the check sees the full-logits tensor when it exists
            assert fused_max < s_v  # no [S_local, V] tensor, forward or backward
            assert fused_max <= weight  # nothing larger than the embedding (grad): chunk logits are 16 x V


# ----------------------------------------------------------------------------- scaled heads, bad input
def _nll_both_paths(model, mesh, labels_len=40):
    ids = torch.randint(3, model.config.vocab_size, (2, labels_len), generator=torch.Generator().manual_seed(1))
    batch = SequenceParallelCollator(mesh, pad_token_id=0)([{"input_ids": r} for r in ids])
    num = L.global_token_count(count_items([batch], "sft"), mesh)
    out = {}
    for fused in (True, False):
        model.zero_grad()
        share, _ = micro_batch_loss(model, batch, num, mesh, StepSpec("sft", fused_loss=fused, loss_chunk_tokens=5))
        share.backward()
        out[fused] = (float(share.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
    return abs(out[True][0] - out[False][0]), _max_grad_diff(out[True][1], out[False][1])


@pytest.mark.parametrize("arch", ["cohere", "granite", "falcon_h1", "minicpm3", "recurrent_gemma"])
def test_scaled_logit_heads_match_full_path(arch, one_thread):
    """Cohere (logits * logit_scale), Granite (logits / logits_scaling), Falcon-H1 (lm_head(h) * lm_head_multiplier,
    muP), MiniCPM3 (hidden states / logits_scaling BEFORE lm_head: nothing to do after it) and RecurrentGemma
    (tanh(logits / logits_soft_cap) * cap; a cap of 0.5, so that it changes the NLL: 0.17 nats without it): fused ==
    full logits at SP=1."""
    import transformers as tf

    if arch == "recurrent_gemma":
        torch.manual_seed(0)
        model = tiny_model("recurrent_gemma", logits_soft_cap=0.5)
    elif arch == "falcon_h1":
        model = tiny_model("falcon_h1")  # lm_head_multiplier 0.9 (and every other muP multiplier != 1)
        assert model.model.lm_head_multiplier == 0.9
    else:
        cls, extra = {"cohere": (tf.CohereConfig, {"logit_scale": 0.5}),
                      "granite": (tf.GraniteConfig, {"logits_scaling": 4.0}),
                      "minicpm3": (tf.MiniCPM3Config, {"dim_model_base": 8, "q_lora_rank": 16, "kv_lora_rank": 16,
                                                       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                                                       "v_head_dim": 8})}[arch]
        cfg = cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, **extra)
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    mesh = seqpar.init_mesh(1)
    apply_sequence_parallel(model, mesh)
    dl, dg = _nll_both_paths(model, mesh)
    assert dl <= PATH_TOL and dg <= PATH_GRAD_TOL, (dl, dg)


def test_falcon_h1_multiplier_is_the_models(one_thread):
    """The fused head multiplies by the model's lm_head_multiplier at each forward (upstream reads it from the model,
    not the config): changed after the fused head was installed, it changes both paths' NLL alike."""
    model = tiny_model("falcon_h1")
    mesh = seqpar.init_mesh(1)
    apply_sequence_parallel(model, mesh)
    install_fused_head(model)
    model.model.lm_head_multiplier = 2.5
    dl, dg = _nll_both_paths(model, mesh)
    assert dl <= PATH_TOL and dg <= PATH_GRAD_TOL, (dl, dg)


def test_unknown_logit_transform_is_refused(one_thread):
    model = tiny_model("llama", 4, 2)
    model.config.logits_scaling = 2.0  # a post-lm_head scale this architecture does not apply
    with pytest.raises(SeqParError, match="memory.fused_loss: false.*fused_loss=False"):
        install_fused_head(model)


def test_missing_output_embeddings_is_refused(one_thread, monkeypatch):
    model = tiny_model("llama", 4, 2)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    with pytest.raises(SeqParError, match="no output embeddings.*memory.fused_loss: false"):
        with fused_targets(model, torch.zeros(1, 4, dtype=torch.long)):
            pass


def test_head_not_called_by_forward_is_refused(one_thread, monkeypatch):
    """A model whose forward bypasses get_output_embeddings() gets the error, not silently full logits."""
    model = tiny_model("llama", 4, 2)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: torch.nn.Linear(32, 160))
    ids = torch.randint(3, 160, (1, 12))
    with pytest.raises(SeqParError, match="was not used by this model's forward.*fused_loss=False"):
        with fused_targets(model, ids) as req:
            out = model(input_ids=ids)
        req.result(out)


def test_head_unchanged_without_request_and_state_dict_keys_kept(one_thread):
    model = tiny_model("gemma2", 4, 2, final_logit_softcapping=2.0)
    ids = torch.randint(3, 160, (2, 9))
    before, keys = model(input_ids=ids).logits, list(model.state_dict())
    install_fused_head(model)
    assert list(model.state_dict()) == keys
    assert torch.equal(model(input_ids=ids).logits, before)
    with pytest.raises(SeqParError, match="loss_chunk_tokens must be >= 1"):
        with fused_targets(model, ids, chunk_tokens=0):
            pass


# ----------------------------------------------------------------------------- the real SmolLM2 (tied head)
def _smollm2_world(layers: int | None = None, tokens: int = 201):
    """layers: keep the first `layers` decoder layers of the real model (None: all 30); tokens: the row's length."""
    from test_hf_smollm2 import TRAINABLE, trainable_of, truncated

    from seqpar.hf import load_smollm2, load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    text = "Why is the sky blue? Sunlight scatters off air molecules, and blue light scatters most. " * 12
    ids = torch.as_tensor(tok(text)["input_ids"]).reshape(-1)[:tokens]
    labels = ids.clone()
    labels[:30] = -100
    base = truncated(load_smollm2(), layers)
    trainable = (*trainable_of(TRAINABLE, layers), "model.embed_tokens.weight")  # tied with lm_head: the fused head
    for n, p in base.named_parameters():
        p.requires_grad_(n in trainable)
    logits = base(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits
    want = torch.nn.functional.cross_entropy(logits[0, :-1], labels[1:], ignore_index=-100)
    want.backward()
    ref = {n: p.grad.clone() for n, p in base.named_parameters() if p.requires_grad}
    del logits
    mesh = seqpar.init_mesh(2, ulysses_degree=2, ring_degree=1)
    model = apply_sequence_parallel(base, mesh)
    model.zero_grad(set_to_none=True)
    batch = SequenceParallelCollator(mesh, pad_token_id=int(tok.pad_token_id))([{"input_ids": ids, "labels": labels}])
    num = L.global_token_count(count_items([batch], "sft"), mesh)
    share, _ = micro_batch_loss(model, batch, num, mesh, StepSpec("sft", loss_chunk_tokens=32))
    share.backward()
    L.sum_gradients([p for p in model.parameters() if p.requires_grad], mesh)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": abs(float(L.global_loss(share, mesh)) - float(want.detach())),
            "grad": max(float((g - ref[n]).abs().max()) for n, g in got.items())}


@pytest.mark.slow
def test_smollm2_fused_sp2_matches_no_sp():
    for r in run_distributed(_smollm2_world, 2, timeout=900):
        print(r)
        assert r["loss"] <= REF_TOL and r["grad"] <= REF_TOL, r


def test_trainer_dropins_take_the_switch(tmp_path, one_thread):
    """fused_loss= / loss_chunk_tokens= reach the step spec and the DPO reference; refusal at construction."""
    from transformers import TrainingArguments

    from seqpar.hf.trainer import SequenceParallelDPOTrainer, SequenceParallelTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    t = SequenceParallelTrainer(model=tiny_model("llama", 4, 2), args=args, fused_loss=False, loss_chunk_tokens=5)
    assert (t._sp_spec.fused_loss, t._sp_spec.loss_chunk_tokens) == (False, 5)
    d = SequenceParallelDPOTrainer(model=tiny_model("llama", 4, 2), args=args, loss_chunk_tokens=3)
    assert (d._sp_spec.fused_loss, d._sp_reference.fused_loss, d._sp_reference.loss_chunk_tokens) == (True, True, 3)
    bad = tiny_model("llama", 4, 2)
    bad.config.logits_scaling = 2.0
    with pytest.raises(SeqParError, match="fused_loss=False"):
        SequenceParallelTrainer(model=bad, args=args)
    with pytest.raises(SeqParError, match="loss_chunk_tokens must be >= 1"):
        SequenceParallelTrainer(model=tiny_model("llama", 4, 2), args=args, loss_chunk_tokens=0)


def test_seqpar_train_config_switch(tmp_path, monkeypatch, one_thread):
    """`memory.fused_loss` / `memory.loss_chunk_tokens` reach the step (policy and reference forwards) of
    `seqpar train`; the DPO losses of both settings agree within 1e-6 (SP=1, one process)."""
    import json

    import seqpar.steps.forward as steps
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    with open(tmp_path / "dpo.jsonl", "w") as f:
        for i in range(4):
            row = {"prompt": f"question {i}?", "chosen": "yes " * (i + 2), "rejected": "no " * (5 - i)}
            f.write(json.dumps(row) + "\n")
    calls = []
    real = steps.fused_targets

    def spy(model, labels, chunk_tokens=None, *a, **k):
        calls.append(chunk_tokens)
        return real(model, labels, chunk_tokens, *a, **k)

    monkeypatch.setattr(steps, "fused_targets", spy)
    losses = {}
    for fused in (True, False):
        cfg = config_from_dict({
            "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1}},
            "dataset": {"path": str(tmp_path / "dpo.jsonl"), "max_length": 64}, "stage": "dpo",
            "memory": {"fused_loss": fused, "loss_chunk_tokens": 5}, "micro_batch_size": 2, "max_steps": 2,
            "optimizer": {"lr": 1e-2}, "output_dir": str(tmp_path / f"out{fused}"), "progress": False,
        })
        n = len(calls)
        losses[fused] = train(cfg).losses
        assert (len(calls) > n) == fused and set(calls[n:]) <= {5}
    assert len(losses[True]) == 2
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False])) <= 1e-6, losses
