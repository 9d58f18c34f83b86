"""`grpo.rollout.sleep` / TRL's `vllm_enable_sleep_mode` (seqpar.hf.vllm_engine's sleep mode), without vLLM: the
real VLLMEngine and VLLMRollout drive a recording stand-in for vLLM's LLM (a fake `vllm` module), so the order of
the calls is what is checked.

- CUDA (torch.cuda.is_available patched True), sleep on: build(enable_sleep_mode=True) -> push -> generate ->
  sleep(level=2) -> wake_up(["weights"]) -> push -> wake_up(["kv_cache"]) -> generate -> sleep(level=2) ...; the
  first rollout after a build (a fresh run, a resume, the drop-in's next train()) wakes nothing.
- num_iterations 2 (GRPORollout.reused): one sleep per rollout, not per step.
- CPU with sleep on: never enable_sleep_mode / sleep / wake_up, and the notice printed once over several rollouts;
  sleep off on CUDA: never.
- The TRL drop-in's vllm_enable_sleep_mode reaches the engine.
- 2 threaded SP ranks: rank 1's wake_up fails at the second rollout: both ranks raise the same one-line SeqParError
  (no hang); an engine asked to sample while asleep refuses instead of waiting on its paused scheduler.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from seqpar.errors import SeqParError
from seqpar.hf.models import tiny_model

MESH1 = SimpleNamespace(sp_size=1, sp_rank=0, dp_rank=0, dp_size=1)
SAMPLING = dict(max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=2)


class FakeLLM:
    """Records what the engine asks of vLLM's LLM (one list per engine, in `FakeLLM.logs`)."""

    logs: list[list[tuple]] = []

    def __init__(self, **kw) -> None:
        self.log: list[tuple] = [("build", kw.get("enable_sleep_mode", False))]
        self.fail_wake = False
        FakeLLM.logs.append(self.log)

    def collective_rpc(self, method, kwargs=None):
        if callable(method):  # on CPU, after each push: the tied lm_head's repack (seqpar.hf.vllm_engine)
            assert method.__name__ == "_repack_tied_lm_heads" and kwargs is None
            return
        n = sum(1 for _ in kwargs["weights_iterator"])  # consumed, as vLLM's reload does
        assert method == "reload_weights" and n > 0
        self.log.append(("push",))

    def generate(self, prompts, params, use_tqdm=False):
        self.log.append(("generate", len(prompts)))
        return [SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=[5, 2], logprobs=[{5: SimpleNamespace(logprob=-0.5)}, {2: SimpleNamespace(logprob=-0.25)}])])
            for _ in prompts]

    def sleep(self, level=1, mode="abort"):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        if self.fail_wake:
            raise RuntimeError("CUDA out of memory while mapping the weights")
        self.log.append(("wake_up", list(tags)))
        return tags == ["kv_cache"]  # fully awake once the KV cache is back


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` module with FakeLLM; the engine joins no world; the env variables it sets are put back."""
    from seqpar.hf import vllm_engine

    FakeLLM.logs = []
    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.inputs", "vllm.v1", "vllm.v1.engine",
                                                      "vllm.v1.engine.core", "vllm.distributed",
                                                      "vllm.distributed.parallel_state")}
    mods["vllm"].LLM = FakeLLM
    mods["vllm"].SamplingParams = lambda **kw: kw
    mods["vllm.inputs"].TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    mods["vllm.v1.engine.core"].cleanup_dist_env_and_memory = lambda *a, **k: None
    mods["vllm.distributed.parallel_state"].GroupCoordinator = type("GroupCoordinator", (), {})
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)  # restored (or removed) after the test
    monkeypatch.setattr(vllm_engine, "_join_world", lambda rank: False)
    return FakeLLM


@pytest.fixture
def trl_then_fake_vllm(request):
    """The drop-in's module imported first (TRL looks for a real vllm package at import), then the fake vLLM."""
    import seqpar.trl.grpo_vllm  # noqa: F401

    return request.getfixturevalue("fake_vllm")


def _shutdown(llm):  # what VLLMEngine.close reaches
    llm.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: llm.log.append(("shutdown",))))


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=8).float()


def _rollout(sleep: bool, option: str = "grpo.rollout.sleep"):
    from seqpar.hf.vllm_rollout import VLLMRollout, VLLMSettings

    return VLLMRollout(VLLMSettings(max_model_len=32, max_num_seqs=4, sleep=sleep, sleep_option=option))


def _sample(rollout, model, step: int, mesh=MESH1):
    return rollout.for_prompts(model, mesh, [[1, 3], [1, 4]], num_generations=2, seed=9, step=step, **SAMPLING)


ONE = [("push",), ("generate", 4), ("sleep", 2)]
NEXT = [("wake_up", ["weights"]), ("push",), ("wake_up", ["kv_cache"]), ("generate", 4), ("sleep", 2)]


def test_cuda_sleeps_after_each_rollout_and_wakes_around_the_push(fake_vllm, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, r = _model(), _rollout(sleep=True)
    ids, lps = _sample(r, model, 0)
    assert ids == [[5, 2]] * 4 and lps == [[-0.5, -0.25]] * 4
    for step in (1, 2):
        _sample(r, model, step)
    assert fake_vllm.logs == [[("build", True), *ONE, *NEXT, *NEXT]]
    _shutdown(r.engine.llm)
    r.close()  # a resume, or the drop-in's next train(): a new engine, awake at its first rollout
    _sample(r, model, 3)
    assert fake_vllm.logs[1] == [("build", True), *ONE]
    assert "no-op" not in capsys.readouterr().out


def test_num_iterations_sleeps_once_per_rollout(fake_vllm, monkeypatch):
    from seqpar.train.grpo.rollout import GRPORollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, r = _model(), _rollout(sleep=True)
    holder = SimpleNamespace(g=SimpleNamespace(num_iterations=2), held=None)
    for step in range(4):  # rollouts at steps 0 and 2; steps 1 and 3 reuse them
        GRPORollout.reused(holder, step, lambda s=step: (_sample(r, model, s), {}))
    assert fake_vllm.logs == [[("build", True), *ONE, *NEXT]]


@pytest.mark.parametrize("cuda,sleep", [(False, True), (True, False), (False, False)])
def test_no_sleep_on_cpu_or_when_off(fake_vllm, monkeypatch, capsys, cuda, sleep):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    model, r = _model(), _rollout(sleep=sleep)
    for step in range(3):
        _sample(r, model, step)
    assert fake_vllm.logs == [[("build", False)] + [("push",), ("generate", 4)] * 3]
    said = capsys.readouterr().out.count("grpo.rollout.sleep: a no-op on CPU (vLLM's CPU platform has no sleep mode)")
    assert said == (1 if sleep and not cuda else 0)


def test_trl_drop_in_option_reaches_the_engine(trl_then_fake_vllm, monkeypatch, capsys):
    from seqpar.trl.grpo_vllm import vllm_rollout

    args = SimpleNamespace(vllm_max_model_length=32, per_device_train_batch_size=2, steps_per_generation=2,
                           vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=True)
    model = _model()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = vllm_rollout(args, model)
    for _ in range(2):
        r.for_rows(model, MESH1, [[1, 3]] * 4, [1, 2, 3, 4], unit=2, **SAMPLING)
    assert trl_then_fake_vllm.logs == [[("build", True), *ONE, *NEXT]]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = vllm_rollout(args, model)
    r.for_rows(model, MESH1, [[1, 3]] * 4, [1, 2, 3, 4], unit=2, **SAMPLING)
    assert trl_then_fake_vllm.logs[1] == [("build", False), ("push",), ("generate", 4)]
    assert capsys.readouterr().out.count("vllm_enable_sleep_mode: a no-op on CPU") == 1


def test_sampling_asleep_refused(fake_vllm, monkeypatch):
    from seqpar.hf.vllm_engine import VLLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eng = VLLMEngine(_model().config, max_model_len=32, max_num_seqs=2, dtype=torch.float32,
                     gpu_memory_utilization=0.3, enforce_eager=True, sleep=True)
    eng.sleep()
    eng.sleep()  # already asleep: vLLM is not asked twice
    with pytest.raises(SeqParError, match="sampled while asleep"):
        eng.generate([[1]], [0], **SAMPLING)
    assert fake_vllm.logs == [[("build", True), ("sleep", 2)]]


def _wake_fails_on_rank1(model_state: dict) -> str:
    from seqpar import init_mesh

    model = _model()
    model.load_state_dict(model_state)
    mesh = init_mesh(2)
    r = _rollout(sleep=True)
    _sample(r, model, 0, mesh)
    r.engine.llm.fail_wake = mesh.sp_rank == 1
    try:
        _sample(r, model, 1, mesh)
    except SeqParError as e:
        return str(e)
    return "no error"


def test_a_failed_wake_stops_every_rank(fake_vllm, monkeypatch):
    from seqpar.hf import vllm_engine
    from seqpar.threaded import run_threaded

    monkeypatch.setattr(vllm_engine, "sleep_mode_available", lambda: True)  # CUDA for the engine alone
    got = run_threaded(_wake_fails_on_rank1, 2, _model().state_dict(), timeout=120)
    want = "vLLM rollout failed on rank 1: RuntimeError: CUDA out of memory while mapping the weights"
    assert got == [want, want]
    by_rank = sorted(fake_vllm.logs, key=len)  # rank 1 stopped at its wake; rank 0 finished its rollout
    assert by_rank[0] == [("build", True), ("push",), ("generate", 2), ("sleep", 2)]
    assert by_rank[1] == [("build", True), ("push",), ("generate", 2), ("sleep", 2), ("wake_up", ["weights"]),
                          ("push",), ("wake_up", ["kv_cache"]), ("generate", 2), ("sleep", 2)]
