"""LoRA on the actor (``model.lora_rank``): which modules get adapters, what trains, the
reference as the base with the adapter off, adapter-only checkpoints, FSDP2 over a frozen
base on two ranks, and a direct run that trains, checkpoints and resumes an adapter."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlhf_core.config import ModelConfig

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
LORA = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8)


def _model(seed=0, tied=False):
    from rlhf_core.models.qwen2 import qwen2_from_config

    return qwen2_from_config(seed, **{**SHAPE, "tie_word_embeddings": tied})


def _ids(step: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(100 + step))


def _train_step(model, optimizer, step: int) -> None:
    ids = _ids(step)
    loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].reshape(-1, 64),
                                             ids[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def checkpointed_tensor_bytes(folder: Path, role: str = "actor") -> dict:
    """Bytes of the tensors a checkpoint's DCP metadata lists, model and optimizer
    (beyond one element: the optimizer's step counters are left out)."""
    import math
    import pickle

    metadata = pickle.loads((folder / role / ".metadata").read_bytes())  # written by this test
    sizes = {"model": 0, "optim": 0}
    for key, item in metadata.state_dict_metadata.items():
        if hasattr(item, "size") and math.prod(item.size) > 1:
            sizes[key.split(".", 1)[0]] += math.prod(item.size) * item.properties.dtype.itemsize
    return sizes


def test_adapters_go_where_target_modules_say_and_only_they_train():
    from rlhf_core.workers import lora

    base = _model()
    expected = base(input_ids=_ids()).logits.detach()
    model = lora.apply_lora(base, LORA, "tiny")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # not lm_head
    assert torch.equal(model(input_ids=_ids()).logits, expected)  # lora_B starts at zero: the base model
    torch.rand(100)  # the global generator moved on: the same seed draws the same adapters
    again = {n: p for n, p in lora.apply_lora(_model(), LORA, "tiny").named_parameters() if p.requires_grad}
    assert all(torch.equal(p, again[n]) for n, p in model.named_parameters() if p.requires_grad)

    for text in ("q_proj,v_proj", "[q_proj, v_proj]", "['q_proj','v_proj']"):
        picked = lora.apply_lora(_model(), replace(LORA, target_modules=text), "tiny")
        assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in picked.named_parameters()
                if p.requires_grad} == {"q_proj", "v_proj"}, text
    excluded = lora.apply_lora(_model(), replace(LORA, exclude_modules="down_proj,up_proj"), "tiny")
    assert not any("down_proj" in n or "up_proj" in n for n, p in excluded.named_parameters() if p.requires_grad)

    with pytest.raises(lora.LoraError, match=r"^model.target_modules: expected names of modules in tiny \(its "
                                             r"Linear modules: down_proj, gate_proj, k_proj, lm_head, o_proj, "
                                             r"q_proj, up_proj, v_proj\); found 'query,value', which matches none$"):
        lora.apply_lora(_model(), replace(LORA, target_modules="query,value"), "tiny")


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "head-tied-to-embeddings"])
def test_the_reference_is_the_base_with_the_adapter_off_and_checkpoints_hold_the_adapter_only(tmp_path, tied):
    from rlhf_core.checkpoint.reader import load_sharded
    from rlhf_core.checkpoint.writer import finish_sharded, start_sharded
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import lora

    expected = _model(tied=tied)(input_ids=_ids()).logits.detach()
    model = lora.apply_lora(_model(tied=tied), LORA, "tiny")
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in model.parameters() if p.requires_grad}
    for step in range(3):
        _train_step(model, optimizer, step)
    trained = model(input_ids=_ids()).logits.detach()
    assert (trained - expected).abs().max() > 1e-3  # the adapter moved the policy
    with torch.no_grad(), lora.reference_forward(model) as reference:
        assert reference is model  # no copy: the same parameters
        assert torch.allclose(reference(input_ids=_ids()).logits, expected, atol=1e-6)
    assert torch.equal(model(input_ids=_ids()).logits, trained)  # the adapter is back on after the block
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if not p.requires_grad)

    # the checkpoint: adapter weights and their AdamW moments only
    state = sharding.sharded_state(model, optimizer)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    written = finish_sharded(start_sharded(f"file://{tmp_path}/ckpt", "actor", model, optimizer, scheduler))
    assert checkpointed_tensor_bytes(tmp_path / "ckpt") == {
        "model": sum(p.numel() * 4 for p in model.parameters() if p.requires_grad),  # the adapter, no base
        "optim": 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)}  # its two AdamW moments
    # loaded onto a fresh base with fresh adapters: the trained policy again, and the same optimizer state
    fresh = lora.apply_lora(_model(tied=tied), LORA, "tiny")
    fresh_optimizer = torch.optim.AdamW(lora.trainable_parameters(fresh), lr=1e-2)
    load_sharded(f"file://{tmp_path}/ckpt", "actor", fresh, fresh_optimizer,
                 torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: 1.0), expected=written)
    assert torch.equal(fresh(input_ids=_ids()).logits, trained)
    _train_step(model, optimizer, 3)
    _train_step(fresh, fresh_optimizer, 3)
    assert torch.equal(fresh(input_ids=_ids()).logits, model(input_ids=_ids()).logits)


def test_an_adapter_to_start_from_is_loaded_trainable_and_one_of_another_base_is_refused(tmp_path):
    from rlhf_core.workers import lora

    model = lora.apply_lora(_model(), LORA, "tiny")
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    _train_step(model, optimizer, 0)
    model.peft_config["default"].base_model_name_or_path = "/models/tiny"
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == "/models/tiny"

    started = lora.apply_lora(_model(), ModelConfig(path="/models/tiny", lora_adapter_path=str(tmp_path / "adapter")),
                              "/cache/tiny")
    assert torch.equal(started(input_ids=_ids()).logits, model(input_ids=_ids()).logits)
    assert any(p.requires_grad for p in started.parameters())  # trainable, not frozen for inference
    # a hub id of the same name is the same base (a folder downloaded from it)
    lora.apply_lora(_model(), ModelConfig(path="/other/place/tiny", lora_adapter_path=str(tmp_path / "adapter")),
                    "/cache/tiny")
    with pytest.raises(lora.LoraError, match=r"^model.lora_adapter_path: expected an adapter of "
                                             r"model.path=/models/other; found one of /models/tiny in "):
        lora.apply_lora(_model(), ModelConfig(path="/models/other", lora_adapter_path=str(tmp_path / "adapter")),
                        "/cache/other")
    with pytest.raises(lora.LoraError, match=r"^model.lora_adapter_path: expected a PEFT adapter folder"):
        lora.apply_lora(_model(), ModelConfig(path="/models/tiny", lora_adapter_path=str(tmp_path)), "/cache/tiny")


def _fsdp_main(rank: int, world: int, rdzv: str, out: str) -> None:
    """Rank 0 reads the base, the others build it on the meta device; adapters on every
    rank, filled from rank 0's; three steps under FSDP2 (one rank: the plain module)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.models.qwen2 import qwen2_from_config
    from rlhf_core.workers import lora, modeling

    reads = sharding.reads_checkpoint("fsdp", rank, world)
    if reads:
        model = qwen2_from_config(0, **SHAPE)
    else:
        with torch.device("meta"):
            model = qwen2_from_config(None, **SHAPE)
    torch.manual_seed(rank)  # what ran before: the adapters' draw does not depend on it
    model = lora.apply_lora(model, LORA, "tiny", seed=1)
    weights = sharding.FullWeights.of(model) if reads else None
    model = modeling.init_distributed_model(Worker(), model, sharding.ShardingSpec(strategy="fsdp"),
                                            source=weights if world > 1 else None)
    # SGD, not AdamW: the comparison is of gradients reduced over ranks. One rank averages
    # 4 rows, two ranks average two means of 2: the same up to float rounding (~1e-7
    # relative), but AdamW divides each gradient element by its own magnitude, so where an
    # element nearly cancels (|g| ~ eps) that rounding moved the weights by ~2e-5 on some
    # installs and not on others (3 failures in 4 on a fresh venv). SGD keeps the rounding
    # at its size (~2e-8 here), and unlike AdamW it is not blind to a gradient off by a
    # factor of the world size.
    optimizer = torch.optim.SGD(lora.trainable_parameters(model), lr=1.0)
    share = 4 // world
    for step in range(3):
        ids = _ids(step)[rank * share:(rank + 1) * share]
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].reshape(-1, 64),
                                                 ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        (loss * share / 4 * world).backward()
        optimizer.step()
    state, _ = sharding.full_state(model, optimizer)
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
        with lora.reference_forward(model):
            reference = model(input_ids=_ids()).logits
    torch.save({"state": {k: v.clone() for k, v in state.items()}, "logits": logits, "reference": reference,
                "sharded": sharding.is_sharded(model)}, f"{out}.rank{rank}")


def test_two_fsdp_ranks_train_the_adapter_one_rank_trains_over_a_frozen_base(tmp_path):
    runs = {}
    for world in (1, 2):
        out = str(tmp_path / f"w{world}")
        mp.start_processes(_fsdp_main, args=(world, uuid.uuid4().hex[:8], out), nprocs=world, start_method="spawn")
        runs[world] = [torch.load(f"{out}.rank{r}") for r in range(world)]
    one, two = runs[1][0], runs[2]
    assert two[0]["sharded"] and not one["sharded"]
    base = _model()(input_ids=_ids()).logits.detach()
    for seen in two:
        assert (seen["logits"] - one["logits"]).abs().max() < 1e-5
        assert torch.allclose(seen["reference"], base, atol=1e-5)  # the frozen base, on every rank
    for name, value in one["state"].items():
        assert torch.allclose(two[0]["state"][name], value, atol=1e-6), name
    # the adapter trained: its B matrices moved away from their zero start
    assert max(v.abs().max() for k, v in one["state"].items() if ".lora_B" in k) > 0.05
    base_state = _model().state_dict()
    frozen = {k: v for k, v in one["state"].items() if ".lora_" not in k}
    assert frozen and all(torch.equal(v, base_state[k.replace("base_model.model.", "").replace(".base_layer", "")])
                          for k, v in frozen.items())


@pytest.mark.slow
def test_a_lora_run_checkpoints_the_adapter_and_resumes_as_if_never_stopped(tmp_path, ray_local):
    """Actor and critic (GAE) both train adapters: the checkpoints hold those (and the
    critic's value head), resuming gives the metrics of a run never stopped."""
    from rlhf_core.cli import main

    # two optimizer steps an iteration: the old_log_prob stage records the policy's log-probs
    common = ["model.lora_rank=8", "model.lora_alpha=16", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
              "algorithm.adv_estimator=gae", "critic.lora_rank=4", "critic.lora_alpha=8",
              "actor.use_kl_loss=true", "algorithm.rollout_correction.bypass_mode=false", "rollout.n=4",
              "trainer.progress=false",
              f"trainer.output_dir={tmp_path / 'out'}"]
    store = f"file://{tmp_path / 'store'}"
    assert main(["run", "--direct", "--iterations", "2", "--run-id", "whole", "--store", store, *common]) == 0
    assert main(["run", "--direct", "--iterations", "1", "--run-id", "resumed", "--store", store, *common]) == 0
    assert main(["run", "--direct", "--iterations", "2", "--run-id", "resumed", "--store", store, *common]) == 0

    def rows(run):
        return [json.loads(line) for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]

    keys = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss")
    assert [[r[k] for k in keys] for r in rows("resumed")] == [[r[k] for k in keys] for r in rows("whole")]

    # every stage of iteration 1 replays exactly, the updates from the adapter checkpoints
    from rlhf_core.trainer.replay import replay

    results = replay(f"{store}/whole/iter-000001", log=lambda *a: None)
    assert {"update_actor", "update_critic", "ref_log_prob"} <= {r.stage for r in results}
    for r in results:
        assert r.ok and r.diffs and all(d.max_abs == 0 for d in r.diffs), (r.stage, r.diffs)

    # the export: a PEFT adapter folder over the base, and the merged model, both giving the
    # log-probs the run's policy computed with those weights (iteration 1's, from step 1's checkpoint)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_core.models.builtin import builtin_model_path
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.workers import modeling

    istore = IterationStore(RunRef(store, "whole"))
    # the reference is the base: the policy's log-probs before its first update, and not after
    first = istore.load(0, "ref_log_prob")
    assert torch.equal(first.batch["ref_log_prob"], first.batch["old_log_probs"])
    later = istore.load(1, "ref_log_prob")
    assert not torch.equal(later.batch["ref_log_prob"], later.batch["old_log_probs"])
    checkpoint = istore.read_manifest(0)["checkpoint"]
    assert main(["export", checkpoint, "--out", str(tmp_path / "adapter")]) == 0
    assert main(["export", checkpoint, "--out", str(tmp_path / "merged"), "--merged"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    # every committed checkpoint holds the adapter (what the export holds) and its two moments, nothing of the base
    from safetensors.torch import load_file

    adapter_bytes = sum(t.numel() * t.element_size()
                        for t in load_file(tmp_path / "adapter" / "adapter_model.safetensors").values())
    model_bytes = sum(f.stat().st_size for f in Path(builtin_model_path(seed=0)).glob("*.safetensors"))
    steps = list((tmp_path / "store" / "whole" / "checkpoints").glob("step-*"))
    assert len(steps) == 3 and adapter_bytes < 0.15 * model_bytes
    for step in steps:
        assert checkpointed_tensor_bytes(step) == {"model": adapter_bytes, "optim": 2 * adapter_bytes}
        critic = checkpointed_tensor_bytes(step, "critic")
        # rank-4 adapters on the backbone's Linears (about half the actor's rank-8 ones) and the value head
        assert 0.4 * adapter_bytes < critic["model"] < 0.6 * adapter_bytes and critic["optim"] == 2 * critic["model"]
    batch = istore.load(1, "old_log_prob")
    args = (batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"],
            batch.batch["responses"].shape[1], istore.read_manifest(1)["config"]["rollout"]["temperature"])
    base = AutoModelForCausalLM.from_pretrained(builtin_model_path(seed=0)).eval()
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        by_adapter, _ = modeling.response_log_probs(adapted, *args)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        by_merged, _ = modeling.response_log_probs(merged, *args)
    mask = batch.batch["response_mask"].bool()
    recorded = batch.batch["old_log_probs"]
    assert (by_adapter - recorded)[mask].abs().max() < 1e-4
    assert (by_merged - recorded)[mask].abs().max() < 1e-4


@pytest.mark.slow
def test_vllm_serves_the_adapter_the_actor_sends_with_the_actors_log_probs(tmp_path):
    """verl's LoRA request path on the real CPU engine: the engine keeps its base weights
    and takes the policy's adapter, gathered and renamed as the actor sends it; its
    sampled tokens' log-probs are the peft model's, after each new adapter (reloaded in
    place under one id) and after the base weights are replaced (vLLM then drops its
    adapter and asks for it again)."""
    from rlhf_core.config import RolloutConfig
    from rlhf_core.distributed import sharding
    from rlhf_core.protocol import DataProto
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers import lora, modeling
    from rlhf_core.rollout.engines.vllm import VLLMEngine as VLLMRollout

    folder = str(build_model_folder(tmp_path / "tiny"))
    policy = lora.apply_lora(modeling.load_causal_lm(folder, "float32"), ModelConfig(path=folder, lora_rank=4,
                                                                                        lora_alpha=8), folder)
    engine = VLLMRollout(folder, RolloutConfig(response_length=10, temperature=1.0), seed=0, max_model_len=64,
                         lora_rank=lora.settings(policy).r)
    assert engine.needs_weights and not engine.needs_base_weights  # the CPU engine read the base; no adapter yet
    ids = torch.tensor([[0, 0, 7, 8, 9], [0, 5, 6, 7, 8], [3, 4, 5, 6, 7], [0, 0, 17, 18, 19]])
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": (ids != 0).long(),
                                   "sample_seed": torch.arange(4)})

    def send_adapter():
        engine.update_adapter(((lora.saved_name(n), t) for n, t in sharding.stream_full_parameters(
            policy, keep=lora.is_adapter)), lora.settings(policy))

    def engine_matches_policy() -> torch.Tensor:
        out = engine.generate_batch(prompts)
        with torch.no_grad():
            expected, _ = modeling.response_log_probs(policy, out.batch["input_ids"], out.batch["attention_mask"],
                                                      out.batch["position_ids"], 10)
        mask = out.batch["response_mask"].bool()
        assert mask.sum() > 10
        torch.testing.assert_close(out.batch["rollout_log_probs"][mask], expected[mask], atol=2e-4, rtol=0)
        return out.batch["responses"]

    responses = []
    for step in range(2):  # two "updates" of the adapter: each one is what the engine samples from
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.3)
        send_adapter()
        assert not engine.needs_weights
        responses.append(engine_matches_policy())
    assert not torch.equal(responses[0], responses[1])
    # new base weights (what a GPU engine gets after a sleep): the engine drops the adapter
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name.endswith("base_layer.weight") and "down_proj" in name:
                p.mul_(1.5)
    engine.update_weights((lora.base_name(n), t) for n, t in sharding.stream_full_parameters(
        policy, keep=lora.is_base))
    assert engine.needs_weights and not engine.needs_base_weights
    send_adapter()
    engine_matches_policy()


#: verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, its arguments as written there.
QWEN2_5_3B_GRPO_LORA = [
    "algorithm.adv_estimator=grpo", "trainer.val_before_train=False",
    "data.train_files=$HOME/data/gsm8k/train.parquet", "data.val_files=$HOME/data/gsm8k/test.parquet",
    "data.train_batch_size=16", "data.max_prompt_length=512", "data.max_response_length=1024",
    "data.filter_overlong_prompts=True", "data.truncation='error'", "data.shuffle=False",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct", "actor_rollout_ref.model.lora_rank=64",
    "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.actor.optim.lr=3e-6",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.layered_summon=True",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", "trainer.logger=['console','wandb']",
    "trainer.project_name='verl_grpo_example_gsm8k'", "trainer.experiment_name='qwen2.5_3b_grpo_lora'",
    "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


@pytest.mark.slow
def test_verls_lora_script_scaled_to_a_tiny_model_trains_the_adapter_through_vllm(tmp_path, ray_local):
    """The script's keys, every one, values scaled to a tiny model on one CPU rank (the
    learning rate raised so that one update moves the policy measurably), and a reward
    file: vLLM samples with the policy the actor sends after each update (on CPU, by
    default, its weights with the adapter merged in; the adapter request path is tested
    above), so in bypass mode the update's first ratio is 1 (the engine's log-probs are the
    actor's); the adapter moves away from
    the base (the reference); the checkpoints hold the adapter and its AdamW moments, not
    the base's weights (nor the output head tied to its embeddings)."""
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.testing.model_folders import build_model_folder, write_verl_parquet

    model = build_model_folder(tmp_path / "qwen2-tiny")
    scaled = {"data.train_files": str(write_verl_parquet(tmp_path / "train.parquet", count=12)),
              "data.val_files": str(write_verl_parquet(tmp_path / "test.parquet", count=4)),
              "data.train_batch_size": "4", "data.max_prompt_length": "64", "data.max_response_length": "8",
              "actor_rollout_ref.model.path": str(model), "actor_rollout_ref.actor.optim.lr": "1e-2",
              "actor_rollout_ref.model.lora_rank": "8",  # 64 of 3B's 2048 wide layers is 4 of these 128
              "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
              "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
              "trainer.save_freq": "1", "trainer.test_freq": "2", "trainer.total_epochs": "1"}
    reward = tmp_path / "reward.py"  # scores that differ within a group, so that GRPO's advantages do
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2)\n")
    argv = [f"{key}={scaled[key]}" if key in scaled else item
            for item in QWEN2_5_3B_GRPO_LORA if (key := item.split("=", 1)[0]) != "trainer.n_gpus_per_node"]
    argv += [f"custom_reward_function.path={reward}", "custom_reward_function.name=score"]
    store, out = f"file://{tmp_path / 'store'}", tmp_path / "out"
    assert main(["run", "--direct", "--run-id", "lora", "--store", store, *argv, f"trainer.output_dir={out}",
                 "trainer.progress=false"]) == 0
    rows = [json.loads(line) for line in (out / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    # one mini-batch an iteration: the first ratio compares the engine's log-probs with the actor's
    assert all(abs(r["actor/ppo_kl"]) < 1e-5 and r["actor/pg_clipfrac"] == 0 for r in rows), rows
    assert ["val-core/openai/gsm8k/reward/mean@1" in r for r in rows] == [False, False, True]
    istore = IterationStore(RunRef(store, "lora"))
    first, last = istore.load(0, "ref_log_prob"), istore.load(2, "ref_log_prob")
    mask = first.batch["response_mask"].bool()
    # before the first update the adapter adds nothing: the engine samples from the base
    assert (first.batch["rollout_log_probs"] - first.batch["ref_log_prob"])[mask].abs().max() < 1e-4
    mask = last.batch["response_mask"].bool()
    assert (last.batch["rollout_log_probs"] - last.batch["ref_log_prob"])[mask].abs().max() > 1e-2
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for step in (tmp_path / "store" / "lora" / "checkpoints").glob("step-*"):
        sizes = checkpointed_tensor_bytes(step)
        assert 0 < sizes["model"] < 0.2 * model_bytes and sizes["optim"] == 2 * sizes["model"], sizes


def test_vllm_is_started_for_the_next_rank_it_serves_and_refused_above_its_largest():
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides
    from rlhf_core.workers import lora

    assert [lora.engine_max_rank(r) for r in (1, 4, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(lora.LoraError, match=r"^model.lora_adapter_path: expected an adapter of rank at most 512"):
        lora.engine_max_rank(600)
    apply_overrides(RunConfig(), ["rollout.name=vllm", "model.lora_rank=64"]).validate()
    with pytest.raises(ConfigError, match=r"^model.lora_rank: expected an adapter of rank at most 512 with rollout.name=vllm .*found rank 600$"):
        apply_overrides(RunConfig(), ["rollout.name=vllm", "model.lora_rank=600"]).validate()
    apply_overrides(RunConfig(), ["rollout.name=hf", "model.lora_rank=600"]).validate()  # peft takes any rank


def test_the_names_the_actor_sends_are_the_base_checkpoints_and_a_peft_adapter_files(tmp_path):
    """What the engine is sent: base tensors under the model's own names (what its
    checkpoint calls them) and adapter tensors under a PEFT file's names: the folder
    written from them loads in peft as the same adapter."""
    from peft import PeftModel

    from rlhf_core.distributed import sharding
    from rlhf_core.workers import lora

    model = lora.apply_lora(_model(), LORA, "tiny")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    base = {lora.base_name(n): t for n, t in sharding.stream_full_parameters(model, keep=lora.is_base)}
    assert base.keys() == _model().state_dict().keys()
    assert all(torch.equal(t, _model().state_dict()[n]) for n, t in base.items())
    adapter = {lora.saved_name(n): t for n, t in sharding.stream_full_parameters(model, keep=lora.is_adapter)}
    lora.write_adapter_folder(str(tmp_path / "adapter"), adapter, lora.settings(model))
    loaded = PeftModel.from_pretrained(_model(), str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_ids()).logits, model(input_ids=_ids()).logits)


def test_hydra_quoted_values_are_the_text_inside_the_quotes():
    from rlhf_core.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), ["data.truncation='left'", 'actor_rollout_ref.rollout.name="vllm"',
                                        "trainer.project_name='p'"], notes=[])
    assert (cfg.data.truncation, cfg.rollout.name) == ("left", "vllm")


def test_the_vllm_lora_calls_the_rollout_makes_exist_in_the_pinned_version():
    """The GPU engine's LoRA path, against the installed vLLM's own definitions (the CPU
    build shares them): the ranks it can be started for, in-place adapter reloads, the
    engine's add_lora and generate's lora_request, and the engine arguments."""
    import inspect
    import typing

    from vllm import LLM
    from vllm.config.lora import MaxLoRARanks
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine

    from rlhf_core.rollout.engines.vllm import LORA_RANKS as VLLM_LORA_RANKS

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS
    request = LoRARequest("policy", 1, "/dev/shm/x", load_inplace=True)
    assert request.load_inplace and request.lora_int_id == 1
    assert "lora_request" in inspect.signature(LLM.generate).parameters
    assert "lora_request" in inspect.signature(LLMEngine.add_lora).parameters
    assert {"enable_lora", "max_loras", "max_lora_rank"} <= set(inspect.signature(EngineArgs).parameters)


def test_a_lora_checkpoint_goes_only_onto_the_base_it_was_trained_on(tmp_path):
    """Its rank-0 file records the base's path and content hash; a load onto a base of
    other content is refused in one line naming both, before anything is loaded, and so
    is an export over a base folder whose content changed."""
    from types import SimpleNamespace

    from rlhf_core.checkpoint.reader import CheckpointRefusedError, load_sharded
    from rlhf_core.checkpoint.writer import _rank_file, finish_sharded, start_sharded
    from rlhf_core.export import ExportError, _check_base
    from rlhf_core.workers import lora, modeling

    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    trained_on = {"path": "s3://models/tiny", "sha256": modeling.content_sha256(str(folder))}
    model = lora.apply_lora(_model(), LORA, "tiny")
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    _train_step(model, optimizer, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    written = finish_sharded(start_sharded(f"file://{tmp_path}/ckpt", "actor", model, optimizer, scheduler,
                                           base=trained_on))

    def load(base):
        fresh = lora.apply_lora(_model(), LORA, "tiny")
        fresh_optimizer = torch.optim.AdamW(lora.trainable_parameters(fresh), lr=1e-2)
        load_sharded(f"file://{tmp_path}/ckpt", "actor", fresh, fresh_optimizer,
                     torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: 1.0), expected=written, base=base)
        return fresh

    assert torch.equal(load(dict(trained_on))(input_ids=_ids()).logits, model(input_ids=_ids()).logits)
    other = {"path": "/models/tiny-v2", "sha256": "b" * 64}
    with pytest.raises(CheckpointRefusedError, match=(
            rf"^model.path: expected the base model the adapter in file://.*/ckpt/actor was trained on "
            rf"\(s3://models/tiny, content sha256 {trained_on['sha256'][:16]}\.\.\.\); found /models/tiny-v2 "
            rf"\(content sha256 b{{16}}\.\.\.\)$")):
        load(other)

    files = SimpleNamespace(get=lambda name: {"actor/rank-00000.pt": _rank_file(scheduler, trained_on)}[name])
    _check_base(files, "s3://ckpt", folder)  # the same bytes: exported
    (folder / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ExportError, match=r"^model.path: expected the base model the adapter in s3://ckpt was "
                                          r"trained on \(s3://models/tiny, .*\); found .*/base \(content sha256"):
        _check_base(files, "s3://ckpt", folder)


def test_the_critics_lora_adapts_its_backbone_and_trains_its_value_head_whole(tmp_path):
    """critic.lora_rank (verl's critic.model.lora_rank): adapters on the value model's
    backbone, its own weights frozen, the value head (new to this model) trained whole;
    its checkpoint state is those; target modules that match nothing are refused."""
    from rlhf_core.config import CriticConfig
    from rlhf_core.distributed import sharding
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers import lora, modeling

    folder = str(build_model_folder(tmp_path / "tiny"))
    critic = lora.apply_critic_lora(modeling.ValueModel(folder), CriticConfig(lora_rank=4, lora_alpha=8), folder)
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} < trained
    assert all(".lora_" in n for n in trained - {"value_head.weight", "value_head.bias"})
    optimizer = torch.optim.AdamW(lora.trainable_parameters(critic), lr=1e-2)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    before = critic(ids, mask, mask.cumsum(1) - 1).detach()
    for _ in range(2):
        loss = (critic(ids, mask, mask.cumsum(1) - 1) - 1.0).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert (critic(ids, mask, mask.cumsum(1) - 1) - before).abs().max() > 1e-3
    assert set(sharding.sharded_state(critic, optimizer)["model"]) == trained
    with pytest.raises(lora.LoraError, match=r"^critic.target_modules: expected names of modules in .*tiny \(its "
                                             r"Linear modules: .*q_proj.*\); found 'query', which matches none$"):
        lora.apply_critic_lora(modeling.ValueModel(folder), CriticConfig(lora_rank=4, target_modules="query"), folder)


def test_the_merged_stream_is_peft_merge_and_unload_one_module_at_a_time():
    """rollout.lora_merge: the weights the engine is sent are the base's own names with
    each adapter folded in, as peft's merge_and_unload gives them."""
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import lora

    model = lora.apply_lora(_model(), replace(LORA, target_modules="q_proj,down_proj"), "tiny")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    sent = dict(lora.merged_stream(model, sharding.stream_full_parameters(model)))
    expected = lora.apply_lora(_model(), replace(LORA, target_modules="q_proj,down_proj"), "tiny")
    expected.load_state_dict(model.state_dict())
    expected = expected.merge_and_unload().state_dict()
    assert sorted(sent) == sorted(expected)  # (a module's bias comes before its merged weight)
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5)
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           _model().state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_an_adapter_on_the_output_head_is_refused_for_vllms_lora_requests_and_merged_instead():
    """vLLM 0.32 refuses LoRA requests that adapt lm_head (tried on the CPU engine: "expected
    target modules in {q_proj, ...} but received ['lm_head']"): refused in one line before an
    engine starts, pointing at rollout.lora_merge=true, whose merged stream folds it in."""
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import lora

    lora.check_engine_serves(lora.apply_lora(_model(), LORA, "tiny"))  # all-linear: the head left out
    with_head = lora.apply_lora(_model(), replace(LORA, target_modules="q_proj,lm_head"), "tiny")
    with pytest.raises(lora.LoraError, match=r"^model.target_modules: expected modules vLLM serves as a LoRA "
                                             r"request \(not lm_head, embed_tokens\) with rollout.lora_merge=false; "
                                             r"found lm_head adapted: set rollout.lora_merge=true"):
        lora.check_engine_serves(with_head)
    merged = dict(lora.merged_stream(with_head, sharding.stream_full_parameters(with_head)))
    assert "lm_head.weight" in merged and not any(".lora_" in n or "base_layer" in n for n in merged)
