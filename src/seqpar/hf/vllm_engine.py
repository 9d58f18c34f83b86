"""A colocated vLLM engine for GRPO rollouts: built from the policy's config, fed its weights by name.

Each training process holds its engine IN the process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's
"external_launcher" executor): no extra process to spawn, wait for or lose; an engine failure is an exception
in the rank that drives it. vLLM joins the trainer's torch.distributed world (every rank builds its engine at
the same point: the groups it creates are collective); without a world it gets a one-process one.
tensor_parallel > 1: the engines of `tensor_parallel` consecutive ranks form one vLLM engine (its TP group), each
holding its shard of the weights and KV cache; vLLM cuts the world into such groups in rank order (its
"ExternalDP x DP x PP x PCP x TP" layout with DP = PP = PCP = 1), which are seqpar's SP groups when the TP size is
the SP size (ranks dp-major, SP innermost): checked when the engine starts (`expect_group`). Every rank of the group
calls `generate` with the same requests (vLLM's external launcher relies on the same scheduling everywhere) and
gets the same outputs.

The engine starts from the config alone (load_format "dummy": random weights) and gets the policy's weights
before every rollout (`push`), streamed one tensor at a time through the worker's `reload_weights`
(vLLM's layerwise in-place reload, which restores the weight loaders the CPU backend's kernel repacking dropped;
a plain `model.load_weights` fails on CPU after the first load).

Sampling: one request per completion row with SamplingParams(seed=row seed), so a row's tokens depend on its seed
alone, not on which rank or batch drew it; no tokenizer (prompts and completions are token ids); the model's
generation_config is not read (no extra penalties); stop at eos_token_id (kept, as transformers' generate()).
Log-probs are vLLM's "processed_logprobs": log softmax(logits / temperature) of each sampled token (renormalised
over the kept tokens when top_k / top_p cut).

Sleep (`sleep=True`, CUDA only: `sleep_mode_available`): the engine is built with vLLM's sleep mode and, after each
rollout, `sleep()` puts it to sleep at level 2 (weights and KV cache discarded, not offloaded: the weights are pushed
again before the next rollout anyway). The next `push` wakes the weights' memory, writes the weights into it, then
wakes the KV cache (after the push, so the push's transient tensors are gone first), as TRL's colocate mode does.
The first rollout after a build finds the engine awake.

vLLM is imported lazily: the main environment has no vLLM (`make vllm-env` builds one that does).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ..errors import SeqParError
from .vllm_models import config_for_vllm, engine_options, head_dim

__all__ = ["VLLMEngine", "check_process_ranks", "sleep_mode_available"]

# vLLM logs every engine's start on every rank (INFO, and WARNINGs about a tokenizer and chat template the engine
# does not use, thread binding, LD_PRELOAD): errors only, unless VLLM_LOGGING_LEVEL says otherwise (read at import).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def check_process_ranks(option: str) -> None:
    """vLLM keeps one engine's state per process: ranks that are threads (seqpar.threaded) cannot each hold one."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "seqpar_threads":
        raise SeqParError(f"{option}: the vLLM engine needs ranks that are processes (vLLM keeps its state per "
                          "process), not threads (seqpar.threaded): launch with seqpar train / torchrun")


def sleep_mode_available() -> bool:
    """Whether the engine can sleep here: on CUDA (ROCm included) only. vLLM 0.32's CPU platform has no sleep mode:
    Platform.is_sleep_mode_available is true for CUDA / ROCm / XPU only (ModelConfig refuses enable_sleep_mode on
    CPU: "Sleep mode is not supported on current platform"), and its CPU worker's sleep / wake_up only log "sleep
    mode is not supported on CPU, ignore it"."""
    return torch.cuda.is_available()


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
                 gpu_memory_utilization: float, enforce_eager: bool, rank: int = 0, sleep: bool = False,
                 tensor_parallel: int = 1, expect_group: Sequence[int] | None = None,
                 timeout_s: float | None = None) -> None:
        """tensor_parallel > 1: the ranks `expect_group` (global ranks) must be the engine's TP group (a SeqParError
        otherwise); timeout_s: how long vLLM's collectives wait for a rank (default: vLLM's)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process (external_launcher needs it)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads where they are
        self._own_world = _join_world(rank)
        _quiet_rope_reload()
        from vllm import LLM

        self._dir = tempfile.TemporaryDirectory(prefix="seqpar_vllm_")
        config = config_for_vllm(config)
        config.save_pretrained(self._dir.name)  # the config alone: weights come by `push`
        kw: dict[str, Any] = engine_options(config, torch.cuda.is_available())
        self.sleeps = bool(sleep) and sleep_mode_available()  # sleep after every rollout (module docstring)
        self._asleep: set[str] = set()  # the memory tags now discarded ("weights", "kv_cache")
        if self.sleeps:
            kw["enable_sleep_mode"] = True
        if torch.cuda.is_available():
            kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
        else:  # vLLM reads the fraction as one of host memory: size the KV cache for the rollout instead
            kw["kv_cache_memory_bytes"] = _kv_bytes(config, max_model_len, max_num_seqs, dtype)
        if timeout_s is not None:  # an engine that dies mid-collective stops its TP peers after this, not 30 min
            kw["distributed_timeout_seconds"] = kw["cpu_distributed_timeout_seconds"] = max(1, int(timeout_s))
        # CPU TP all-reduce goes through shared memory named per run (_cpu_shm_named); one-rank TP groups use none
        self._shm = None if torch.cuda.is_available() or tensor_parallel == 1 else _shm_ident()
        saved_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
        try:
            with _cpu_shm_named(self._shm):
                self.llm = LLM(model=self._dir.name, load_format="dummy", skip_tokenizer_init=True,
                               dtype=dtype, max_model_len=int(max_model_len), max_num_seqs=int(max_num_seqs),
                               enforce_eager=bool(enforce_eager), distributed_executor_backend="external_launcher",
                               tensor_parallel_size=int(tensor_parallel), seed=0, logprobs_mode="processed_logprobs",
                               generation_config="vllm", enable_prefix_caching=False, **kw)
        except Exception as e:
            raise SeqParError(f"the vLLM engine did not start: {type(e).__name__}: {_first_line(e)}") from None
        finally:
            torch.set_num_threads = saved_threads  # vLLM's CPU worker replaces it for the whole process
            torch.set_num_threads(n_threads)  # and lowers the trainer's thread count "for serving"
        if tensor_parallel > 1:
            _check_group(expect_group)

    def push(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's weights (HF checkpoint names, full tensors) into the engine, in place, one at a time. A
        sleeping engine wakes its weights' memory first (written while unmapped they would be lost) and its KV
        cache after."""
        if "weights" in self._asleep:
            torch.cuda.empty_cache()  # the trainer's cached blocks back to the device, for the engine to map
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named),
                                                          "is_checkpoint_format": True})
        if not torch.cuda.is_available():
            self.llm.collective_rpc(_repack_tied_lm_heads)
        if "kv_cache" in self._asleep:
            awake = self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
            if awake is False:  # its scheduler stays paused: generate would wait forever
                raise SeqParError("the vLLM engine did not wake fully after its weights and KV cache woke")

    def sleep(self) -> None:
        """After a rollout (sleep mode only, else nothing): level 2, the weights and KV cache discarded, so the
        trainer's steps get the memory; the next `push` wakes the engine."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = {"weights", "kv_cache"}

    def generate(self, rows: Sequence[Sequence[int]], seeds: Sequence[int], *, max_new_tokens: int,
                 temperature: float, top_p: float, top_k: int,
                 eos_token_id: int | Sequence[int] | None) -> tuple[list[list[int]], list[list[float]]]:
        """(completions, log-probs): row i sampled with seed seeds[i], up to and including its first EOS (one id, or
        several: TRL's eos_token_ids; None: no stop token, every row decodes max_new_tokens, as
        generate_for_group's)."""
        if self._asleep:  # a sleeping engine's scheduler is paused: its requests would wait forever
            raise SeqParError(f"the vLLM engine sampled while asleep ({', '.join(sorted(self._asleep))}): push first")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stops = [] if eos_token_id is None else [int(eos_token_id)] if isinstance(eos_token_id, int) else \
            [int(t) for t in eos_token_id]
        params = [SamplingParams(n=1, seed=int(s) % (2**63 - 1), temperature=float(temperature), top_p=float(top_p),
                                 top_k=int(top_k), max_tokens=int(max_new_tokens), logprobs=0, ignore_eos=True,
                                 stop_token_ids=stops, detokenize=False) for s in seeds]
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
        if self._shm:  # vLLM leaves its CPU shared-memory segments behind (4 MiB per TP rank)
            for f in glob.glob(f"/dev/shm/{self._shm}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(f)
        self._dir.cleanup()


def _repack_tied_lm_heads(worker: Any) -> None:
    """vLLM's CPU backend computes logits with a packed copy of lm_head's weight, made when the weights load; the
    reload repacks only layers that got weights, and a tied lm_head gets none (its weight is the embeddings'), so
    its logits would stay those of the first weights: repack it after every push."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    modules = list(worker.model_runner.model.modules())
    others = {id(p) for m in modules if not isinstance(m, ParallelLMHead) for p in m.parameters(recurse=False)}
    for m in modules:
        if isinstance(m, ParallelLMHead) and id(m.weight) in others:
            m.quant_method.process_weights_after_loading(m)


def _join_world(rank: int) -> bool:
    """The env:// variables vLLM's external launcher reads; a one-process gloo world when there is none
    (returns whether it was made here)."""
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", str(rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    if dist.is_initialized():
        check_process_ranks("the vLLM engine")
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _shm_ident() -> str:
    """A name for this run's vLLM CPU shared-memory segments, the same on every rank (rank 0's, broadcast)."""
    import secrets

    import torch.distributed as dist

    from .. import comm

    token = f"seqpar{secrets.token_hex(6)}" if dist.get_rank() == 0 else None
    if dist.get_world_size() > 1:
        token = comm.broadcast_object(token, 0, torch.device("cpu"))
    return str(token)


@contextlib.contextmanager
def _cpu_shm_named(ident: str | None) -> Iterator[None]:
    """vLLM's CPU worker names the shared memory of its TP all-reduce after the distributed init method, which is
    always "env://" under the external launcher: every run on a host would open the same segments and the second
    fails ("create shm in SHMManager failed. errno: 17", File exists), as does any run after one whose processes
    were killed. The worker's distributed set-up runs with VLLM_DIST_IDENT set to this run's name instead."""
    if ident is None:
        yield
        return
    import vllm.v1.worker.cpu_worker as cpu_worker

    real = cpu_worker.init_worker_distributed_environment

    def named(*a: Any, **k: Any) -> Any:
        os.environ["VLLM_DIST_IDENT"] = ident  # read by vLLM's CPU SHM communicator for its segments' names
        return real(*a, **k)

    cpu_worker.init_worker_distributed_environment = named
    try:
        yield
    finally:
        cpu_worker.init_worker_distributed_environment = real


def _check_group(expect: Sequence[int] | None) -> None:
    """The TP group vLLM formed is the one the caller samples with (its SP group)."""
    from vllm.distributed import parallel_state as ps

    got = list(ps.get_tp_group().ranks)
    if expect is not None and got != list(expect):
        raise SeqParError(f"the vLLM engine's tensor-parallel group is ranks {got}, not the SP group {list(expect)}: "
                          "set grpo.rollout.tensor_parallel: 1")


def _kv_bytes(config: Any, max_model_len: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """KV cache bytes for `max_num_seqs` sequences of `max_model_len` tokens (x 2 headroom, at least 32 MiB)."""
    c = getattr(config, "text_config", None) or config
    kv = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    per_token = 2 * int(c.num_hidden_layers) * kv * head_dim(c) * torch.tensor([], dtype=dtype).element_size()
    return max(32 << 20, 2 * per_token * int(max_model_len) * int(max_num_seqs))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
