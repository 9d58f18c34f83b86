"""A colocated vLLM engine for GRPO rollouts: built from the policy's config, fed its weights by name.

One engine per training process (tensor_parallel 1), IN the process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's
"external_launcher" executor): no extra process to spawn, wait for or lose; an engine failure is an exception
in the rank that drives it. vLLM joins the trainer's torch.distributed world (every rank builds its engine at
the same point: the groups it creates are collective); without a world it gets a one-process one.

The engine starts from the config alone (load_format "dummy": random weights) and gets the policy's weights
before every rollout (`push`), streamed one tensor at a time through the worker's `reload_weights`
(vLLM's layerwise in-place reload, which restores the weight loaders the CPU backend's kernel repacking dropped;
a plain `model.load_weights` fails on CPU after the first load).

Sampling: one request per completion row with SamplingParams(seed=row seed), so a row's tokens depend on its seed
alone, not on which rank or batch drew it; no tokenizer (prompts and completions are token ids); the model's
generation_config is not read (no extra penalties); stop at eos_token_id (kept, as transformers' generate()).
Log-probs are vLLM's "processed_logprobs": log softmax(logits / temperature) of each sampled token (renormalised
over the kept tokens when top_k / top_p cut).

vLLM is imported lazily: the main environment has no vLLM (`make vllm-env` builds one that does).
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import SeqParError

__all__ = ["VLLMEngine", "check_vllm_model", "vllm_available"]

# vLLM logs every engine's start on every rank (INFO, and WARNINGs about a tokenizer and chat template the engine
# does not use, thread binding, LD_PRELOAD): errors only, unless VLLM_LOGGING_LEVEL says otherwise (read at import).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _head_dim(c: Any) -> int:
    hd = getattr(c, "head_dim", None)
    return int(hd) if hd else int(c.hidden_size) // int(c.num_attention_heads)


def architectures(config: Any) -> list[str]:
    """The config's architectures, or the causal-LM class transformers maps its model_type to (tiny configs)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(config, "architectures", None) or [])
    if not archs and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type):
        archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return archs


def check_vllm_model(config: Any, on_cuda: bool) -> None:
    """Refuse (one line, before any rank starts) what the vLLM engine cannot run: no vLLM installed, an
    architecture vLLM does not have, a vision-language model, a head_dim vLLM's CPU attention refuses."""
    if not vllm_available():
        raise SeqParError("grpo.rollout.engine: vllm needs vLLM, which this environment lacks: build its "
                          "environment with `make vllm-env` and run with .venv-vllm/bin/python (or use engine: "
                          "transformers)")
    if config is None:
        raise SeqParError("grpo.rollout.engine: vllm needs the model's HF config (model.name 'smollm2' is a GGUF "
                          "file): use a local HF model directory or tiny:<arch>, or engine: transformers")
    if getattr(config, "vision_config", None) is not None:
        raise SeqParError("grpo.rollout.engine: vllm does not take vision-language models yet: use engine: "
                          "transformers")
    from vllm.model_executor.models import ModelRegistry

    archs = architectures(config)
    known = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in known for a in archs):
        raise SeqParError(f"grpo.rollout.engine: vllm: vLLM has no architecture {archs or config.model_type!r}: use "
                          f"engine: transformers for this model")
    hd = _head_dim(config)
    if not on_cuda:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        ok = CPUAttentionBackend.get_supported_head_sizes()
        if hd not in ok:
            raise SeqParError(f"grpo.rollout.engine: vllm: head_dim={hd} is not one vLLM's CPU attention runs "
                              f"({', '.join(map(str, ok))}): use a model with one of those (a tiny model: "
                              f"model.kwargs.head_dim: 32), or engine: transformers")


def _quiet_rope_reload() -> None:
    """vLLM's layerwise reload warns at every push that RotaryEmbedding got no weights: an HF checkpoint has none
    for it (the cos / sin cache is rebuilt from the config, and vLLM puts its own back). Only that line goes."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(keep)


class VLLMEngine:
    """One in-process vLLM engine for `config` (an HF PretrainedConfig): `push` weights, `generate` rows."""

    def __init__(self, config: Any, *, max_model_len: int, max_num_seqs: int, dtype: torch.dtype,
                 gpu_memory_utilization: float, enforce_eager: bool, rank: int = 0) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process (external_launcher needs it)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads where they are
        self._own_world = _join_world(rank)
        _quiet_rope_reload()
        from vllm import LLM

        self._dir = tempfile.TemporaryDirectory(prefix="seqpar_vllm_")
        config = copy.deepcopy(config)
        config.architectures = architectures(config)
        config.save_pretrained(self._dir.name)  # the config alone: weights come by `push`
        kw: dict[str, Any] = {}
        if torch.cuda.is_available():
            kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
        else:  # vLLM reads the fraction as one of host memory: size the KV cache for the rollout instead
            kw["kv_cache_memory_bytes"] = _kv_bytes(config, max_model_len, max_num_seqs, dtype)
        saved_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = LLM(model=self._dir.name, load_format="dummy", skip_tokenizer_init=True,
                           dtype=dtype, max_model_len=int(max_model_len), max_num_seqs=int(max_num_seqs),
                           enforce_eager=bool(enforce_eager), distributed_executor_backend="external_launcher",
                           tensor_parallel_size=1, seed=0, logprobs_mode="processed_logprobs",
                           generation_config="vllm", enable_prefix_caching=False, **kw)
        except Exception as e:
            raise SeqParError(f"the vLLM engine did not start: {type(e).__name__}: {_first_line(e)}") from None
        finally:
            torch.set_num_threads = saved_threads  # vLLM's CPU worker replaces it for the whole process
            torch.set_num_threads(n_threads)  # and lowers the trainer's thread count "for serving"

    def push(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's weights (HF checkpoint names, full tensors) into the engine, in place, one at a time."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named),
                                                          "is_checkpoint_format": True})

    def generate(self, rows: Sequence[Sequence[int]], seeds: Sequence[int], *, max_new_tokens: int,
                 temperature: float, top_p: float, top_k: int,
                 eos_token_id: int | None) -> tuple[list[list[int]], list[list[float]]]:
        """(completions, log-probs): row i sampled with seed seeds[i], up to and including its first EOS
        (eos_token_id None: no stop token, every row decodes max_new_tokens, as generate_for_group's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stop = [] if eos_token_id is None else [int(eos_token_id)]
        params = [SamplingParams(n=1, seed=int(s) % (2**63 - 1), temperature=float(temperature), top_p=float(top_p),
                                 top_k=int(top_k), max_tokens=int(max_new_tokens), logprobs=0, ignore_eos=True,
                                 stop_token_ids=stop, detokenize=False) for s in seeds]
        prompts = [TokensPrompt(prompt_token_ids=list(r)) for r in rows]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        ids, lps = [], []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            ids.append(toks)
            lps.append([float(step[t].logprob) for step, t in zip(c.logprobs, toks)])
        return ids, lps

    def close(self) -> None:
        """Drop the engine and the process groups vLLM made (the trainer's world stays)."""
        import gc

        import vllm.v1.engine.core as core
        from vllm.distributed import parallel_state as ps

        # vLLM's in-process shutdown ends with cleanup_dist_env_and_memory, which destroys the DEFAULT process
        # group -- the trainer's world. So the shutdown runs without it, and vLLM's groups are forgotten instead.
        cleanup = core.cleanup_dist_env_and_memory
        core.cleanup_dist_env_and_memory = lambda *a, **k: None
        try:
            self.llm.llm_engine.engine_core.shutdown()  # its weakref finalizer: runs once
        finally:
            core.cleanup_dist_env_and_memory = cleanup
        self.llm = None
        gc.collect()
        for name, value in list(vars(ps).items()):
            if isinstance(value, ps.GroupCoordinator):
                setattr(ps, name, None)
        if self._own_world and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._dir.cleanup()


def _join_world(rank: int) -> bool:
    """The env:// variables vLLM's external launcher reads; a one-process gloo world when there is none
    (returns whether it was made here)."""
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", str(rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    if dist.is_initialized():
        if dist.get_backend() == "seqpar_threads":  # seqpar.threaded: vLLM keeps one engine's state per process
            raise SeqParError("the vLLM engine needs ranks that are processes (vLLM keeps its state per process), "
                              "not threads (seqpar.threaded): launch with seqpar train / torchrun")
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _kv_bytes(config: Any, max_model_len: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """KV cache bytes for `max_num_seqs` sequences of `max_model_len` tokens (x 2 headroom, at least 32 MiB)."""
    c = getattr(config, "text_config", None) or config
    kv = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    per_token = 2 * int(c.num_hidden_layers) * kv * _head_dim(c) * torch.tensor([], dtype=dtype).element_size()
    return max(32 << 20, 2 * per_token * int(max_model_len) * int(max_num_seqs))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
