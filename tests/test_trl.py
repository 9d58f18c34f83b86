"""TRL drop-ins under SP: a stock TRL script gains SP by changing the class name.

Reference: the STOCK trl.SFTTrainer / trl.DPOTrainer, one process, no SP, run in the test process on
the same rows. SP run: seqpar.trl's classes in a spawned gloo world (SP = world size). Data order is
matched by train_sampling_strategy="sequential" (stock: SequentialSampler; seqpar: SP sampler with
shuffle off) with the same per-device batch (2; for dp = 2 the stock batch is 4, the rows of both dp
ranks, which seqpar's sampler strides over dp) and grad accumulation (2); TRL's own
shuffle_dataset stays off. Optimiser: SGD lr 0.1 with TRL's default clipping (max_grad_norm 1.0). Compared
per step: the gradient norm before clipping (relative, 1e-5: a scale or weighting error shows here even where
AdamW would hide it), the logged loss, and the final trainable parameters, fp32, at 1e-5 absolute; one case also
compares the SP evaluate() with an independent global token-mean NLL of the stock run's final model.
Tokenizer: the cached SmolLM2 tokenizer (chat template); model: a random tiny 2-layer Llama / Qwen2.
"""

from __future__ import annotations

import pytest
import torch
from procs import run_command

from seqpar.spawn import run_distributed

TOL = 1e-5
WORDS = "the cat sat on a mat while dogs ran far and birds sang songs of long summer days".split()


GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tok():
    from seqpar.hf import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def _text(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def _dataset(kind: str):
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        p, c, r = _text(g, 3, 12), _text(g, 2, 15), _text(g, 2, 15)
        if kind == "prompt_completion":
            rows.append({"prompt": p, "completion": " " + c})
        elif kind == "messages":  # conversational prompt/completion: completion_only_loss applies
            rows.append({"prompt": [{"role": "user", "content": p}],
                         "completion": [{"role": "assistant", "content": c}]})
        elif kind == "conversation":  # multi-turn: assistant_only_loss masks every non-assistant token
            rows.append({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c},
                                      {"role": "user", "content": r}, {"role": "assistant", "content": p}]})
        elif kind == "text":
            rows.append({"text": p + " " + c})
        else:  # preference pairs
            rows.append({"prompt": p, "chosen": " " + c, "rejected": " " + r})
    return datasets.Dataset.from_list(rows)


def _model(arch: str, vocab: int):
    from seqpar.hf import tiny_model

    heads, kv = (4, 2) if arch == "llama" else (3, 1)
    return tiny_model(arch, heads, kv, vocab_size=vocab, seed=0)


def _config(case: dict, out: str, batch: int = 2):
    from trl import DPOConfig, SFTConfig

    common = dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_steps=3,
                  logging_steps=1, report_to=[], save_strategy="no", train_sampling_strategy="sequential",
                  use_cpu=True, seed=0, disable_tqdm=True, bf16=case.get("bf16", False), optim="sgd", learning_rate=0.1,
                  max_grad_norm=1.0)
    if case["stage"] == "dpo":
        moe = {"router_aux_loss_coef": 0.0} if case.get("moe") else {}  # seqpar refuses the router aux loss
        return DPOConfig(**common, max_length=case.get("max_length", 1024), loss_type=[case.get("loss", "sigmoid")],
                         beta=0.5, **moe)
    return SFTConfig(**common, max_length=case.get("max_length", 1024), packing=case.get("packing", False),
                     packing_strategy=case.get("packing_strategy", "bfd"), padding_free=case.get("padding_free", False),
                     completion_only_loss=case.get("completion_only_loss"),
                     assistant_only_loss=case.get("assistant_only_loss", False))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _train(case: dict, out: str, sp: int | None) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Stock TRL when sp is None, else seqpar.trl with sequence_parallel_size=sp: the only difference."""
    import trl

    import seqpar.trl as strl

    tok = _tok()
    if case.get("assistant_only_loss"):  # TRL needs {% generation %} markers to build the assistant mask
        tok.chat_template = GENERATION_TEMPLATE
    model = _model(case["arch"], len(tok))
    kw = {"peft_config": _lora()} if case.get("lora") else {}
    if sp is not None:
        kw["sequence_parallel_size"] = sp
    if case["stage"] == "dpo":
        cls = trl.DPOTrainer if sp is None else strl.SequenceParallelDPOTrainer
        if sp is None and not case.get("lora"):
            kw["ref_model"] = _model(case["arch"], len(tok))  # stock TRL would reload it from the hub by name
    else:
        cls = trl.SFTTrainer if sp is None else strl.SequenceParallelSFTTrainer
    # dp x sp: the stock run's batch holds the rows of all dp ranks (seqpar's sampler strides rows over dp).
    batch = 2 * case.get("dp", 1) if sp is None else 2
    trainer = cls(model=model, args=_config(case, out, batch), train_dataset=_dataset(case["data"]),
                  processing_class=tok, **kw)
    if case.get("packing") and case.get("packing_strategy", "bfd") == "bfd":  # several documents in one row
        assert any(len(n) > 1 for n in trainer.train_dataset["seq_lengths"])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gnorms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    if case.get("eval"):  # SP evaluate() vs an independent global token-mean NLL of the stock final model
        losses.append(_token_mean_nll(trainer.model, trainer.train_dataset) if sp is None
                      else trainer.evaluate(trainer.train_dataset)["eval_loss"])
    return losses, params, gnorms


@torch.no_grad()
def _token_mean_nll(model: torch.nn.Module, rows) -> float:
    tot, cnt = 0.0, 0
    for r in rows:
        logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1].float()
        lab = torch.tensor(r["labels"][1:])
        tot += float(torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum"))
        cnt += int((lab != -100).sum())
    return tot / cnt


def _sp_world(cases: list[dict], refs: str, out: str) -> list[dict]:
    """Each case under SP = world size; compared here with the stock references (gradient norms, losses, parameters)."""
    world = torch.distributed.get_world_size()
    ref = torch.load(refs)
    res = []
    for i, case in enumerate(cases):
        losses, params, gnorms = _train(case, f"{out}/{i}", world // case.get("dp", 1))
        ref_losses, ref_params, ref_gnorms = ref[i]
        dparam = max(float((params[k.replace("module.", "")] - v).abs().max()) for k, v in ref_params.items())
        res.append({"name": case["name"], "losses": losses, "ref_losses": ref_losses,
                    "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "dparam": dparam,
                    "dgnorm": max(abs(a - b) / b for a, b in zip(gnorms, ref_gnorms)),
                    "ngnorms": (len(gnorms), len(ref_gnorms)),
                    "nparams": len(params) == len(ref_params), "tol": case.get("tol", (TOL, TOL, TOL))})
    return res


def _check(results: list[list[dict]]) -> None:
    for rank_res in results[1:]:
        assert [r["losses"] for r in rank_res] == [r["losses"] for r in results[0]]
    for r in results[0]:
        print(f"{r['name']}: max rel dgrad_norm {r['dgnorm']:.2e}  max |dloss| {r['dloss']:.2e}  "
              f"max |dparam| {r['dparam']:.2e}")
        assert len(r["losses"]) == len(r["ref_losses"]) == 3 + ("eval" in r["name"]), r
        assert r["ngnorms"] == (3, 3), r
        assert r["nparams"], r
        assert r["dgnorm"] <= r["tol"][2], r
        assert r["dloss"] <= r["tol"][0], r
        assert r["dparam"] <= r["tol"][1], r


def _run_cases(cases: list[dict], world: int, tmp_path) -> None:
    refs = [_train(c, str(tmp_path / f"ref{i}"), None) for i, c in enumerate(cases)]
    torch.save(refs, tmp_path / "refs.pt")
    _check(run_distributed(_sp_world, world, cases, str(tmp_path / "refs.pt"), str(tmp_path / "sp"),
                           timeout=480))


FAST = [
    {"name": "sft prompt/completion completion_only_loss (+ SP evaluate)", "stage": "sft", "arch": "llama",
     "data": "prompt_completion", "completion_only_loss": True, "eval": True},
    {"name": "sft messages (conversational prompt/completion)", "stage": "sft", "arch": "qwen2", "data": "messages"},
    {"name": "sft packing bfd", "stage": "sft", "arch": "llama", "data": "text", "packing": True, "max_length": 40},
    {"name": "sft multi-turn assistant_only_loss", "stage": "sft", "arch": "llama", "data": "conversation",
     "assistant_only_loss": True},
    {"name": "dpo sigmoid, max_length cut", "stage": "dpo", "arch": "qwen2", "data": "pairs", "max_length": 24},
    # TRL's default bf16=True (autocast over fp32 weights): bf16 attention on both sides, and stock transformers
    # takes another SDPA kernel for a padded batch (tests/test_trl_parity.py), so bf16-level tolerances
    # (loss, parameters, relative gradient norm).
    {"name": "sft bf16 autocast (TRL's default)", "stage": "sft", "arch": "llama", "data": "prompt_completion",
     "bf16": True, "tol": (1e-2, 2e-3, 5e-3)},
    # The fast twins of SLOW's LoRA, padding-free and IPO cases (there at SP 4); dp 2 x sp 2: tests/test_trl_dp2.py.
    {"name": "sft lora", "stage": "sft", "arch": "llama", "data": "messages", "lora": True},
    {"name": "sft padding_free", "stage": "sft", "arch": "qwen2", "data": "prompt_completion", "padding_free": True,
     "max_length": None},
    {"name": "dpo ipo lora (adapter disabled = reference)", "stage": "dpo", "arch": "llama", "data": "pairs",
     "loss": "ipo", "lora": True},
]
SLOW = [
    {"name": "sft prompt/completion", "stage": "sft", "arch": "llama", "data": "prompt_completion"},
    {"name": "sft lora", "stage": "sft", "arch": "llama", "data": "messages", "lora": True},
    # padding_free: stock TRL flattens the batch into one row (transformers derives the document mask from
    # position_ids on CPU); seqpar's packing path does the same with cu_seqlens.
    {"name": "sft padding_free", "stage": "sft", "arch": "qwen2", "data": "prompt_completion", "padding_free": True,
     "max_length": None},
    {"name": "sft packing wrapped", "stage": "sft", "arch": "llama", "data": "text", "packing": True,
     "packing_strategy": "wrapped", "max_length": 32},
    {"name": "sft dp=2 x sp=2", "stage": "sft", "arch": "llama", "data": "prompt_completion", "dp": 2},
    {"name": "dpo ipo", "stage": "dpo", "arch": "llama", "data": "pairs", "loss": "ipo"},
    {"name": "dpo lora (adapter disabled = reference)", "stage": "dpo", "arch": "llama", "data": "pairs",
     "lora": True},
]


# Hybrids: 3 q / 1 kv softmax heads, so the automatic mesh is a ring of 2 and the recurrent layers pass state.
HYBRIDS = [
    {"name": "sft qwen3_5 (Gated DeltaNet) ring 2", "stage": "sft", "arch": "qwen3_5", "data": "prompt_completion"},
    # Not packed: stock TRL's packed rows reach transformers' Mamba2 path, which refuses them without mamba_ssm
    # (a CUDA package); seqpar's packed hybrid rows are checked against the unsharded model in test_hf_hybrid.py.
    {"name": "sft nemotron_h (Mamba2) ring 2", "stage": "sft", "arch": "nemotron_h", "data": "text",
     "max_length": 40},
    {"name": "dpo qwen3_next (Gated DeltaNet, MoE) ring 2", "stage": "dpo", "arch": "qwen3_next", "data": "pairs",
     "moe": True},
    {"name": "sft lfm2 (short conv) ring 2, lora", "stage": "sft", "arch": "lfm2", "data": "prompt_completion",
     "lora": True},
    {"name": "sft falcon_h1 (Mamba2, muP) ring 2", "stage": "sft", "arch": "falcon_h1", "data": "text",
     "max_length": 40},
    {"name": "dpo jamba (Mamba1, MoE) ring 2", "stage": "dpo", "arch": "jamba", "data": "pairs", "moe": True},
]


def test_trl_sp2_matches_stock_trl(tmp_path):
    _run_cases(FAST, 2, tmp_path)


@pytest.mark.slow
def test_trl_sp4_matches_stock_trl(tmp_path):
    _run_cases(SLOW, 4, tmp_path)


@pytest.mark.slow
def test_trl_hybrids_ring_match_stock_trl(tmp_path):
    """Gated DeltaNet, Mamba2 (Nemotron-H, Falcon-H1), short-conv (LFM2, with LoRA) and Mamba1 (Jamba) hybrids
    through the TRL drop-ins under a ring (state passing) vs stock TRL."""
    _run_cases(HYBRIDS, 2, tmp_path)


def _refusal_cases():
    from trl import DPOConfig, SFTConfig

    base = dict(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    sft = [
        (SFTConfig(**base, loss_type="dft"), {}, "loss_type='dft'"),
        (SFTConfig(**base, use_liger_kernel=True), {}, "use_liger_kernel"),
        (SFTConfig(**base, activation_offloading=True), {}, "activation_offloading"),
        (SFTConfig(**base), {"data_collator": lambda rows: rows}, "data_collator"),
        (SFTConfig(**base), {"compute_loss_func": lambda *a, **k: 0}, "compute_loss_func"),
    ]
    dpo = [
        (DPOConfig(**base, loss_type=["hinge"]), {}, "loss_type=['hinge']"),
        (DPOConfig(**base, loss_type=["sigmoid", "ipo"]), {}, "one at a time"),
        (DPOConfig(**base, loss_type=["sigmoid"], loss_weights=[0.5]), {}, "loss_weights=[0.5]"),
        (DPOConfig(**base, precompute_ref_log_probs=True), {}, "precompute_ref_log_probs"),
        (DPOConfig(**base, f_divergence_type="js_divergence"), {}, "f_divergence_type"),
        (DPOConfig(**base, use_weighting=True), {}, "use_weighting"),
        (DPOConfig(**base, ld_alpha=0.5), {}, "ld_alpha"),
        (DPOConfig(**base, sync_ref_model=True), {}, "sync_ref_model"),
    ]
    return sft, dpo


def test_trl_refusals_name_the_alternative():
    """TRL options seqpar cannot run exactly raise SeqParError in the constructor, before any mesh/collective."""
    import seqpar.trl as strl
    from seqpar.errors import SeqParError

    tok = _tok()
    sft, dpo = _refusal_cases()
    for cls, cases, data in ((strl.SequenceParallelSFTTrainer, sft, "prompt_completion"),
                             (strl.SequenceParallelDPOTrainer, dpo, "pairs")):
        for args, kw, needle in cases:
            with pytest.raises(SeqParError, match="not supported under sequence parallelism") as e:
                cls(model=_model("llama", len(tok)), args=args, train_dataset=_dataset(data), processing_class=tok,
                    **kw)
            assert needle in str(e.value), (needle, str(e.value))
            assert str(e.value).split("): ", 1)[1].strip()  # an alternative follows the reason


def test_trl_missing_says_how_to_install():
    import os
    import sys

    code = ("import sys; sys.modules['trl'] = None\n"
            "from seqpar.errors import SeqParError\n"
            "try:\n    import seqpar.trl\nexcept SeqParError as e:\n    print('REFUSED', e)\n")
    out = run_command([sys.executable, "-c", code], timeout=120,
                      env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "REFUSED" in out.stdout and "pip install 'seqpar[trl]'" in out.stdout, out.stdout + out.stderr
