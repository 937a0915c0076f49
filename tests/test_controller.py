"""Single controller on a local Ray: dispatch modes, colocation, futures, errors."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from rlhf_core.controller import (
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolError,
    Worker,
    WorkerDiedError,
    WorkerError,
    create_colocated_worker_cls,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from rlhf_core.protocol import DataProto, DataProtoFuture


def batch(n):
    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)},
                               {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)})


# A custom mode: every rank gets the argument; collect sums the results.
register_dispatch_mode(
    "SUM_OVER_RANKS",
    dispatch_fn=lambda wg, *a, **k: (tuple([x] * wg.world_size for x in a),
                                     {key: [v] * wg.world_size for key, v in k.items()}),
    collect_fn=lambda wg, outs: sum(outs),
)


class Doubler(Worker):
    def __init__(self, offset=0.0):
        super().__init__()
        self.offset = offset
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self):
        return {"rank": self.rank, "world": self.world_size, "pid": os.getpid(),
                "master": (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))}

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, value):
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, value):
        return value * value

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        self.calls += 1
        out = DataProto.from_dict({"y": data.batch["x"] * 2 + self.offset},
                                  {"rank": np.full(len(data), self.rank)})
        out.meta_info["metrics"] = {"rows": len(data)}
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto) -> DataProto:
        return self.double(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, func, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": func(data.batch["x"])})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def rows_seen(self, data: DataProto):
        return {"rank": self.rank, "rows": len(data), "uids": data.non_tensor_batch["uid"].tolist()}

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self, value):
        return (self.rank, value)

    @register(dispatch_mode="SUM_OVER_RANKS")
    def rank_plus(self, value):
        return self.rank + value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allreduce_rank(self):
        import torch.distributed as dist

        backend = self.init_process_group()
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return backend, t.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on_rank_one(self):
        if self.rank == 1:
            raise ValueError("rank one refuses")
        return "ok"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class Adder(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_one(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["y"] + 1},
                                   {"rank": np.full(len(data), self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class MeshWorker(Worker):
    """4 ranks as dp=2 x tp=2: ranks (0,1) are dp 0, (2,3) dp 1; tp rank 0 collects."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("actor", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"]}, {"rank": np.full(len(data), self.rank)})


@pytest.fixture(scope="module")
def doublers(ray_local):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="doublers", cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Doubler, offset=0.5), name_prefix="doubler")
    yield wg
    wg.kill()
    pool.release()


def test_ranks_env_and_master_address(doublers):
    info = doublers.whoami()
    assert [i["rank"] for i in info] == [0, 1] and {i["world"] for i in info} == {2}
    assert len({i["pid"] for i in info}) == 2
    masters = {i["master"] for i in info}
    assert len(masters) == 1 and None not in next(iter(masters))


def test_one_to_all_all_to_all_dp_compute(doublers):
    assert doublers.echo(["a", "b"]) == [(0, "a"), (1, "b")]
    assert doublers.square([3, 4]) == [9, 16]
    with pytest.raises(ValueError, match="one entry per rank \\(2\\); argument 0 is int"):
        doublers.square(3)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_dp_compute_proto_pads_uneven_batches_and_unpads_the_result(doublers, n):
    out = doublers.double(batch(n))
    assert len(out) == n
    assert out.batch["y"].tolist() == [2 * i + 0.5 for i in range(n)]
    share = -(-n // 2)
    assert out.non_tensor_batch["rank"].tolist() == [i // share for i in range(n)]
    assert out.meta_info["metrics"]["rows"] == [share, share]


def test_dp_compute_proto_with_func_and_metric(doublers):
    out = doublers.apply(lambda x: x + 100, batch(3))
    assert out.batch["y"].tolist() == [100.0, 101.0, 102.0]
    metrics = doublers.rows_seen(batch(4))
    assert metrics == [{"rank": 0, "rows": 2, "uids": ["u0", "u1"]},
                       {"rank": 1, "rows": 2, "uids": ["u2", "u3"]}]


def test_rank_zero_and_custom_mode(doublers):
    assert doublers.only_rank_zero("hi") == (0, "hi")
    assert doublers.rank_plus(10) == 21  # (0 + 10) + (1 + 10)


def test_futures_chain_into_another_group_without_materializing(ray_local, doublers):
    pool = RayResourcePool([3], use_gpu=False, name_prefix="adders", cpus_per_process=0.5)
    adders = RayWorkerGroup(pool, RayClassWithInitArgs(Adder), name_prefix="adder")
    try:
        future = doublers.double_async(batch(5))
        assert isinstance(future, DataProtoFuture)
        out = adders.add_one(future)  # 5 rows from 2 ranks into 3 ranks: uneven both ways
        assert out.batch["z"].tolist() == [2 * i + 1.5 for i in range(5)]
        assert out.non_tensor_batch["rank"].tolist() == [0, 0, 1, 1, 2]
        assert future.get().batch["y"].tolist() == [2 * i + 0.5 for i in range(5)]
    finally:
        adders.kill()
        pool.release()


def test_gloo_all_reduce_inside_a_group(doublers):
    assert doublers.allreduce_rank() == [("gloo", 3.0), ("gloo", 3.0)]


def test_colocated_roles_share_one_process(ray_local):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="coloc", cpus_per_process=0.5)
    cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Doubler, offset=1.0),
                                       "critic": RayClassWithInitArgs(Adder)})
    group = RayWorkerGroup(pool, cls, name_prefix="coloc")
    try:
        roles = group.spawn(prefix_set={"actor", "critic"})
        doubled = roles["actor"].double(batch(4))
        assert doubled.batch["y"].tolist() == [1.0, 3.0, 5.0, 7.0]
        assert roles["critic"].add_one(doubled).batch["z"].tolist() == [2.0, 4.0, 6.0, 8.0]
        assert roles["actor"].pid() == roles["critic"].pid()
        assert not hasattr(roles["critic"], "double")
    finally:
        group.kill()
        pool.release()


def test_nd_mesh_dispatch_sends_each_dp_chunk_to_its_tp_ranks(ray_local):
    pool = RayResourcePool([4], use_gpu=False, name_prefix="mesh", cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(MeshWorker), name_prefix="mesh")
    try:
        out = wg.tag(batch(5))
        assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]
        assert out.non_tensor_batch["rank"].tolist() == [0, 0, 0, 2, 2]  # collect ranks only
    finally:
        wg.kill()
        pool.release()


def test_fake_gpu_pool_places_and_oversized_pool_fails_fast(ray_local):
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=2, name_prefix="gpu", cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Adder), name_prefix="gpu_adder")
    try:
        assert len(set(wg.pid())) == 2
    finally:
        wg.kill()
        pool.release()
    with pytest.raises(ResourcePoolError, match=r"needs 2 node\(s\) holding \[4, 4\] slots of .*'GPU': 1.*; "
                                                r"the cluster's 1 node\(s\) hold \[4\] such slots"):
        RayResourcePool([4, 4], use_gpu=True, name_prefix="too_big").get_placement_groups()
    # Enough GPUs in total, but another pool holds them: placement times out with numbers.
    holder = RayResourcePool([3], use_gpu=True, name_prefix="holder", cpus_per_process=0.5)
    holder.get_placement_groups()
    try:
        with pytest.raises(ResourcePoolError, match=r"1 of 1 placement groups not placed after 2s"):
            RayResourcePool([2], use_gpu=True, name_prefix="late", cpus_per_process=0.5,
                            ready_timeout_s=2).get_placement_groups()
    finally:
        holder.release()


def test_worker_exception_names_role_method_rank_with_traceback(doublers):
    with pytest.raises(WorkerError) as err:
        doublers.fail_on_rank_one()
    message = str(err.value)
    assert "doubler.fail_on_rank_one failed on rank 1: ValueError: rank one refuses" in message
    assert "worker traceback (rank 1)" in message and "in fail_on_rank_one" in message
    assert err.value.rank == 1 and err.value.role == "doubler"


def test_dead_actor_is_reported_not_hung(ray_local):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="doomed", cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Doubler), name_prefix="doomed")
    try:
        pids = wg.pid()
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(WorkerDiedError, match="doomed.double: the actor of rank 1 died"):
            wg.double(batch(4))
    finally:
        wg.kill()
        pool.release()


def test_constructor_failure_names_the_rank(ray_local):
    class Broken(Worker):
        def __init__(self):
            super().__init__()
            if self.rank == 1:
                raise RuntimeError("no model here")

    pool = RayResourcePool([2], use_gpu=False, name_prefix="broken", cpus_per_process=0.5)
    try:
        with pytest.raises(WorkerError, match=r"broken.__init__"):
            RayWorkerGroup(pool, RayClassWithInitArgs(Broken), name_prefix="broken")
    finally:
        pool.release()


def test_detached_group_can_be_reattached(ray_local):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="det", cpus_per_process=0.5, detached=True)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Doubler), name_prefix="det_doubler", detached=True)
    try:
        again = RayWorkerGroup.from_detached(wg.worker_names, RayClassWithInitArgs(Doubler))
        assert again.pid() == wg.pid()
        assert again.double(batch(3)).batch["y"].tolist() == [0.0, 2.0, 4.0]
    finally:
        wg.kill()
        pool.release()


class Counter(Worker):
    def __init__(self):
        super().__init__()
        self.steps = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self):
        self.steps += 1
        return self.steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def steps_taken(self):
        return self.steps


def test_a_controller_whose_claim_was_replaced_has_every_later_call_refused_on_every_rank(ray_local):
    """Issue 39 item 6: two controllers drive one detached group at the same time. The old
    one keeps calling (as a controller that lost its lease would, its queued updates
    included); the new one fences the workers with a higher claim. Once the fence has
    returned, not one call of the old controller runs on any rank, and it is refused in
    one line naming both claims; the new controller's calls run."""
    import threading

    from rlhf_core.controller import StaleClaimError

    pool = RayResourcePool([2], use_gpu=False, name_prefix="fenced", cpus_per_process=0.5, detached=True)
    old = RayWorkerGroup(pool, RayClassWithInitArgs(Counter), name_prefix="fenced_counter", detached=True)
    try:
        old.fence_claim = 1
        old.fence()
        new = RayWorkerGroup.from_detached(old.worker_names, RayClassWithInitArgs(Counter))
        running, refused = threading.Event(), []

        def old_controller():
            try:
                while True:
                    old.step()
                    running.set()
            except WorkerError as exc:
                refused.append(exc)

        thread = threading.Thread(target=old_controller)
        thread.start()
        assert running.wait(60)
        new.fence_claim = 2
        new.fence()  # returns once every rank has seen claim 2
        fenced_at = new.steps_taken()
        thread.join(60)
        assert not thread.is_alive() and len(refused) == 1
        # nothing of the old controller ran after the fence (the one call in flight while it went
        # out may have reached one rank before the fence and the other after it)
        assert new.steps_taken() == fenced_at and max(fenced_at) - min(fenced_at) <= 1
        assert isinstance(refused[0].__cause__, StaleClaimError), refused[0]
        assert "carries claim 1 and claim 2 drives these workers now" in str(refused[0].__cause__)
        assert new.step() == [n + 1 for n in fenced_at]
        with pytest.raises(WorkerError, match="StaleClaimError"):  # its reads too: it drives nothing now
            old.steps_taken()
    finally:
        old.kill()
        pool.release()


class Rendezvous(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join(self) -> str:
        import os

        self.init_process_group("gloo")
        return os.environ["RLHF_RDZV_ID"]


def test_a_stopped_group_leaves_no_rendezvous_file(ray_local):
    """Ranks on one machine meet through a file; a killed rank never removes it, so the
    group does when it stops."""
    from rlhf_core.controller.worker import rendezvous_file

    pool = RayResourcePool([2], use_gpu=False, name_prefix="rendezvous", cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Rendezvous), name_prefix="rdzv")
    try:
        [rendezvous, _] = wg.join()
        assert rendezvous_file(rendezvous).exists()  # the ranks' file store, while they live
    finally:
        wg.kill()
        pool.release()
    assert not rendezvous_file(rendezvous).exists()
