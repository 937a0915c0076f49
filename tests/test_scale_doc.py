"""docs/scale.md's 7B memory arithmetic against the example it describes and the code it
counts: shards are 1/8 (FSDP within each node of the 2 x 8 pool, replicated across the two),
and the reference is built in the dtype its forward computes in (bf16 under mixed precision
on GPUs), not the policy's fp32."""

import re
from pathlib import Path

import pytest
import torch

from components.kuberay.spec import load_deployment
from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.controller.worker import Worker
from rlhf_core.distributed import sharding

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "scale.md").read_text()
GIB = 2 ** 30
NAMES = {"float32": ("fp32", 4), "bfloat16": ("bf16", 2), "float16": ("fp16", 2)}


def test_the_7b_table_counts_shards_of_a_node_and_a_bf16_reference(monkeypatch):
    cfg, _ = load_deployment(ROOT / "manifests" / "configs" / "qwen2.5-7b-2x8.yaml")
    params = float(re.search(r"\(([0-9.]+) B parameters", DOC).group(1)) * 1e9
    per_node = cfg.actor.world_size // cfg.resources.nnodes
    group = sharding.shard_group_size(cfg.actor.fsdp_config.fsdp_size, cfg.actor.world_size, per_node, on_gpu=True)
    assert group == per_node
    (row,) = [line for line in DOC.splitlines() if line.startswith("| fp32 parameters")]
    assert row == f"| fp32 parameters, 7.62e9 x 4 B / {group} | {params * 4 / group / GIB:.2f} |"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the pool's GPUs
    spec = sharding.ShardingSpec.from_config(cfg, param_offload=cfg.actor.fsdp_config.ref_param_offload)
    name, size = NAMES["bfloat16" if sharding.computes_in_bf16(spec) else cfg.model.dtype]
    shard = f"{params * size / group / GIB:.2f}"
    (row,) = [line for line in DOC.splitlines() if line.startswith("| reference model")]
    assert f"{name} shards" in row and f"{shard} if kept on the GPU" in row, row
    # vLLM sleeps at level 2 (its weights are discarded, reloaded from the trainer): the
    # host holds the offloaded reference shards only
    host = re.search(rf"while vLLM sleeps: no engine weights \(level 2 discards them\), {per_node} x ([0-9.]+)\s+"
                     rf"GiB of (\w+) reference shards, about (\d+) GiB", DOC)
    assert host and host.group(1) == shard and host.group(2) == name, "the host-memory sentence"
    assert int(host.group(3)) == round(per_node * float(shard))


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    folder = build_model_folder(tmp_path_factory.mktemp("model") / "tiny")
    cfg = apply_overrides(RunConfig(), [f"model.path={folder}", "model.dtype=float32", "actor.use_kl_loss=true"])
    mp = pytest.MonkeyPatch()
    mp.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    worker = ActorRolloutRefWorker(cfg)
    worker.init_model()
    mp.undo()
    return worker


def test_the_reference_is_the_policys_weights_in_the_dtype_it_computes_in(actor):
    """What the table's reference row stands on: on this CPU the forward computes in fp32,
    so the reference is fp32 (on GPUs, under mixed precision, bf16: tests/test_fsdp.py)."""
    assert actor.reference is not None
    assert {p.dtype for p in actor.reference.parameters()} == {torch.float32}
    assert sum(p.numel() for p in actor.reference.parameters()) == sum(p.numel() for p in actor.policy.parameters())
    for (name, ref), (_, pol) in zip(actor.reference.named_parameters(), actor.policy.named_parameters()):
        assert torch.equal(ref, pol), name
