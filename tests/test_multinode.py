"""Resource pools spanning nodes, on a multi-node Ray cluster simulated on this machine
(several raylets; ``sim_gpu`` stands for accelerators). The scenario runs in its own
process (tests/multinode_scenario.py): this test session's Ray is another cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


# vLLM engines (one per rank, weights synced from FSDP shards on two nodes) in the 2x1
# case; HF generate on the actor's shards in the 2x2 case, which also has the critic on a
# pool of its own (an engine start per rank is most of a scenario's time: the 2x1 case
# covers engines on two nodes with half the starts; one cluster for 2x2 and the critic's
# pool, not two, since every assertion below is a formula in the case's shape)
@pytest.mark.parametrize("nodes,ranks_per_node,critic_pool,engine",
                         [(2, 1, False, "vllm"), (2, 2, True, "hf")],
                         ids=["2x1-vllm", "2x2+critic-pool-hf"])
def test_fsdp_pool_over_nodes_trains_resumes_and_refuses_what_cannot_fit(tmp_path, nodes, ranks_per_node,
                                                                        critic_pool, engine):
    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache")),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, str(HERE / "multinode_scenario.py"), str(nodes), str(ranks_per_node)]
    run = subprocess.run(argv + (["critic-pool"] if critic_pool else []) + [engine], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    # one placement group per node, each on a different raylet, ranks numbered node by node
    assert seen["process_on_nodes"] == [ranks_per_node] * nodes
    ranks = seen["nodes_of_ranks"]
    assert len(set(ranks)) == nodes
    assert all(ranks[i] == ranks[i - i % ranks_per_node] for i in range(len(ranks)))
    if critic_pool:  # the critic's own pool: one more node, none of the actor's
        assert len(seen["critic_nodes"]) == 1 and seen["critic_nodes"][0] not in ranks
        # a session placed on it (every node of the train pool, and the critic's pool) is
        # stopped: none of its placement groups stays, its workers are gone, and another
        # run's group is untouched
        stop = seen["session_stop"]
        bystander = "mn-session-other_pool_pg0"
        assert stop["stopped"] is True and stop["report"] == {"workers": nodes * ranks_per_node + 1,
                                                              "placement_groups": 3}, stop
        assert set(stop["before"]) == {"mn-session_pool_pg0", "mn-session_pool_pg1", "mn-session_pool_critic_pg0",
                                       bystander}, stop
        assert set(stop["after"]) == {bystander}, stop
        assert stop["workers"] == nodes * ranks_per_node + 1 and stop["workers_alive_after"] == [], stop
    else:
        assert seen["critic_nodes"] is None
    # the resumed iteration (fresh workers, loaded checkpoint) equals the unbroken one
    assert seen["resumed_bit_identical"] is True
    # twice the accelerators per node: refused by the capacity check with the numbers (the
    # placement timeout's message says "not placed after"), not after a timeout
    assert seen["too_big_error"] is not None and "not placed after" not in seen["too_big_error"]
    assert (f"needs {nodes} node(s) holding {[2 * ranks_per_node] * nodes} slots" in seen["too_big_error"]
            and f"hold {[ranks_per_node] * (nodes + critic_pool) + [0]} such slots" in seen["too_big_error"])
