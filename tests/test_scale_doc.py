"""docs/scale.md's 7B memory arithmetic against the example it describes and the code it
counts: the reference model is a deep copy of the policy as loaded, so its shards have
the policy's dtype (fp32 in the example), not bf16."""

import re
from pathlib import Path

import pytest
import torch

from components.kuberay.spec import load_deployment
from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.controller.worker import Worker

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "scale.md").read_text()
GIB = 2 ** 30
NAMES = {"float32": ("fp32", 4), "bfloat16": ("bf16", 2), "float16": ("fp16", 2)}


def test_the_7b_table_counts_the_reference_in_the_policys_dtype():
    cfg, _ = load_deployment(ROOT / "manifests" / "configs" / "qwen2.5-7b-2x8.yaml")
    params = float(re.search(r"\(([0-9.]+) B parameters", DOC).group(1)) * 1e9
    name, size = NAMES[cfg.model.dtype]
    shard = f"{params * size / cfg.actor.world_size / GIB:.2f}"
    (row,) = [line for line in DOC.splitlines() if line.startswith("| reference model")]
    assert f"{name} shards" in row and f"{shard} if kept on the GPU" in row, row
    per_node = cfg.actor.world_size // cfg.resources.nnodes
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


def test_the_reference_is_a_copy_of_the_policy_in_its_dtype(actor):
    """What the table's reference row stands on: if this changes (a bf16 reference), the
    row and the host-memory sentence change with it."""
    assert actor.reference is not None
    assert {p.dtype for p in actor.reference.parameters()} == {torch.float32}
    assert sum(p.numel() for p in actor.reference.parameters()) == sum(p.numel() for p in actor.policy.parameters())
