"""Train on a multi-node Ray cluster simulated on this machine (run by tests/test_multinode.py
in its own process: a test session's Ray is already connected to another head).

Nodes are real raylets (``ray.cluster_utils.Cluster``); ``sim_gpu`` stands for each node's
accelerators, so the pool's per-node placement groups must land on different nodes. The
scenario trains two GRPO iterations with FSDP on N nodes x M ranks (with ``critic-pool``:
PPO with the critic on a pool of its own, on one more node; with ``hf``: HF generate on
the actor's own shards instead of a vLLM engine per rank), checkpoints after the first,
resumes on freshly placed workers, and checks the resumed iteration equals the unbroken
one bit for bit; then asks for a pool the cluster cannot hold. Prints one JSON line of
what it saw.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time

import torch

from rlhf_core.runtime.ray_head import local_ray_env

local_ray_env()


def main(nodes: int, ranks_per_node: int, critic_pool: bool = False, engine: str = "vllm") -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.controller.resource_pool import ResourcePoolError
    from rlhf_core.data.dataset import Cursor, PromptLoader, load_rows
    from rlhf_core.data.tokenizer import PromptTokenizer
    from rlhf_core.testing.stage_store import LastBatch
    from rlhf_core.trainer.ppo import SEQUENCE_KEYS, PPOTrainer
    from rlhf_core.trainer.restore import save_checkpoint
    from rlhf_core.workers import modeling
    from rlhf_core.workers.worker_set import WorkerSet

    world = nodes * ranks_per_node
    # the head's "bystander" resource holds another run's placement group (stopping a session
    # must leave it alone)
    head = {"num_cpus": 0, "resources": {"bystander": 1}, "object_store_memory": 100 * 2**20, "include_dashboard": False,
            "temp_dir": tempfile.mkdtemp(prefix="rlhf-mn-")}
    # Cluster records the head's address in the user's Ray temp folder (/tmp/ray), whatever
    # temp_dir the nodes get; on a machine where no Ray ever ran it is missing
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(nodes + (1 if critic_pool else 0)):
        cluster.add_node(num_cpus=ranks_per_node, resources={"sim_gpu": ranks_per_node},
                         object_store_memory=100 * 2**20)
    from rlhf_core.session.session import namespace_of

    # the run's namespace: the session part places detached workers as the serve job does
    ray.init(address=cluster.address, log_to_driver=False, namespace=namespace_of(SESSION_RUN))
    seen: dict = {}
    try:
        cfg = apply_overrides(RunConfig(), [
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false",
            "actor.use_kl_loss=true", f"actor.world_size={world}", "actor.strategy=fsdp", f"rollout.name={engine}",
            f"resources.nnodes={nodes}", f"resources.gpus_per_node={ranks_per_node}",
            "resources.accelerator_resource=sim_gpu", "trainer.cpus_per_worker=1",
            "algorithm.rollout_correction.bypass_mode=false",  # the actor's own log-probs, compared below
            *(["algorithm.adv_estimator=gae", "critic.world_size=1", "resources.critic_nnodes=1"]
              if critic_pool else [])]).validate()
        path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed)

        def loader(cursor=None):
            return PromptLoader(load_rows(cfg.data.train_files, cfg.trainer.seed), PromptTokenizer(path),
                                cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.trainer.seed,
                                cursor=cursor)

        def where(workers) -> list[str]:
            return [ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                             for w in group.workers]) for group in workers.groups]

        ckpt = "file://" + tempfile.mkdtemp(prefix="rlhf-mn-ckpt-")
        workers = WorkerSet.build(cfg)
        try:
            seen["nodes_of_ranks"], *critic_nodes = where(workers)
            seen["critic_nodes"] = critic_nodes[0] if critic_nodes else None
            seen["process_on_nodes"] = workers.pools[0].process_on_nodes
            trainer = PPOTrainer(cfg, workers, loader(), stage_store=LastBatch())
            trainer.run_iteration()
            digests = save_checkpoint(workers, trainer.state, cfg, ckpt)
            saved_state, saved_cursor = copy.deepcopy(trainer.state), Cursor(**trainer.loader.cursor.to_dict())
            saved_state.cursor = saved_cursor.to_dict()
            trainer.run_iteration()
            straight = trainer.stage_store.batch
            probe = straight.select(SEQUENCE_KEYS, [])
            straight_lp = workers["actor"].compute_log_prob(probe).batch["old_log_probs"]
        finally:
            workers.kill()

        workers = WorkerSet.build(cfg)  # fresh processes, placed again
        try:
            workers.load_checkpoint(ckpt, expected=digests)
            trainer = PPOTrainer(cfg, workers, loader(saved_cursor), state=saved_state, stage_store=LastBatch())
            trainer.run_iteration()
            resumed = trainer.stage_store.batch
            resumed_lp = workers["actor"].compute_log_prob(probe).batch["old_log_probs"]
        finally:
            workers.kill()
        for key in ("responses", "advantages", "old_log_probs", "ref_log_prob") + (("values",) if critic_pool else ()):
            assert torch.equal(straight.batch[key], resumed.batch[key]), key
        seen["resumed_bit_identical"] = bool(torch.equal(straight_lp, resumed_lp))

        too_big = apply_overrides(copy.deepcopy(cfg), [f"actor.world_size={2 * world}",
                                                       f"resources.gpus_per_node={2 * ranks_per_node}"]).validate()
        t0 = time.monotonic()
        try:
            WorkerSet.build(too_big)
            seen["too_big_error"] = None
        except ResourcePoolError as error:
            seen["too_big_error"] = str(error)
        seen["too_big_seconds"] = time.monotonic() - t0
        if critic_pool:
            seen["session_stop"] = stop_session_groups(cfg)
        return seen
    finally:
        ray.shutdown()
        cluster.shutdown()


SESSION_RUN = "mn-session"
BYSTANDER = f"{SESSION_RUN}-other_pool_pg0"  # another run's pool ("mn-session-other")


def stop_session_groups(cfg) -> dict:
    """Place a session's pools (detached, every node, the critic's pool too) the way the
    serve job does, stop the session, and report which of the run's placement groups the
    cluster's table still holds before and after (another run's group is a bystander)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from rlhf_core.session import session

    run_id, namespace = SESSION_RUN, session.namespace_of(SESSION_RUN)
    bystander = placement_group([{"bystander": 1}], name=BYSTANDER, lifetime="detached")
    ray.get(bystander.ready(), timeout=60)

    def groups() -> dict:
        return {entry["name"]: entry["state"] for entry in placement_group_table().values()
                if entry["state"] != "REMOVED" and (entry["name"] or "").startswith(run_id)}

    # the serve job's own placement and record (this driver is in the run's namespace)
    workers = session._place(cfg, run_id)
    record = ray.remote(session.SessionRecord).options(name=session.SESSION_ACTOR, lifetime="detached",
                                                       num_cpus=0).remote({"worker_names": workers.worker_names})
    ray.get(record.get.remote())
    worker_names = workers.worker_names
    before = groups()
    stopped = session.stop(run_id)
    report = {"workers": stopped.workers, "placement_groups": stopped.placement_groups}
    deadline = time.monotonic() + 30
    while set(groups()) - {BYSTANDER} and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = []
    for name in worker_names:
        try:
            ray.get_actor(name, namespace=namespace)
            alive.append(name)
        except ValueError:
            pass
    after = groups()
    ray.util.remove_placement_group(bystander)
    return {"before": before, "after": after, "stopped": bool(stopped), "report": report,
            "workers": len(worker_names), "workers_alive_after": alive}


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]), critic_pool="critic-pool" in sys.argv[3:],
                  engine="hf" if "hf" in sys.argv[3:] else "vllm")
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
