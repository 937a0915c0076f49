"""RayWorkerGroup: N Ray actors of one worker class, driven as if they were one object.

Every ``@register``-ed method of the worker class becomes a plain method of the group::

    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorWorker, config))
    out = wg.compute_log_prob(batch)     # dispatch -> .remote() on each rank -> collect

Calls block by default; ``blocking=False`` methods return futures (a DataProtoFuture for
DataProto modes) that the next group call accepts without the controller touching data.
A failure in any rank raises one :class:`WorkerError` naming the role, method and rank,
with the worker's traceback; a dead actor raises :class:`WorkerDiedError`.
"""

from __future__ import annotations

import inspect
import uuid

from rlhf_core.controller.dispatch import (
    FENCE_KWARG, MAGIC_ATTR, PADDING_KWARG, Execute, get_dispatch_mode,
)
from rlhf_core.controller.resource_pool import RayResourcePool
from rlhf_core.controller.worker import RENDEZVOUS_ENV, rendezvous_file
from rlhf_core.protocol import DataProto, DataProtoFuture, unpad_dataproto


class WorkerError(RuntimeError):
    """A worker method raised; the message names role, method and rank."""

    def __init__(self, message: str, role: str, method: str, rank: int):
        super().__init__(message)
        self.role, self.method, self.rank = role, method, rank


class WorkerDiedError(WorkerError):
    """The actor process of a rank is gone (killed, crashed, OOM)."""


def _plain_class(cls):
    """The user's class behind a ``ray.remote`` ActorClass (or the class itself)."""
    meta = getattr(cls, "__ray_metadata__", None)
    if meta is not None:
        return meta.modified_class
    return cls


class RayClassWithInitArgs:
    """A worker class plus the arguments to construct it on every rank (verl's name)."""

    def __init__(self, cls, *args, **kwargs) -> None:
        self.cls = _plain_class(cls)
        self.args = args
        self.kwargs = kwargs
        self._options: dict = {}

    def update_options(self, options: dict) -> None:
        """Extra ``ray.remote`` options for every actor (e.g. ``runtime_env``)."""
        self._options.update(options)

    def registered_methods(self) -> dict[str, dict]:
        out = {}
        for name, member in inspect.getmembers(self.cls):
            attrs = getattr(member, MAGIC_ATTR, None)
            if attrs is not None:
                out[name] = attrs
        return out


def ray_get_ranked(refs: list, role: str, method: str, ranks: list[int] | None = None) -> list:
    """``ray.get`` that fails fast and says which rank failed.

    Waits for results one at a time, so the first failing rank raises at once even when
    the other ranks are blocked (e.g. in a collective with the failed rank).
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    ranks = list(range(len(refs))) if ranks is None else ranks
    rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
    pending = list(refs)
    while pending:
        if len(pending) == 1:  # nothing to race against: skip the extra wait round trip
            done, pending = pending, []
        else:
            done, pending = ray.wait(pending, num_returns=1)
        ref = done[0]
        try:
            if not pending and len(refs) == 1:
                return [ray.get(ref)]
            ray.get(ref)
        except RayActorError as exc:
            rank = rank_of[ref]
            raise WorkerDiedError(
                f"{role}.{method}: the actor of rank {rank} died ({type(exc).__name__}): "
                f"{_first_lines(str(exc), 25)}", role, method, rank) from None
        except RayTaskError as exc:
            rank = rank_of[ref]
            raise WorkerError(
                f"{role}.{method} failed on rank {rank}: {type(exc.cause).__name__}: {exc.cause}\n"
                f"--- worker traceback (rank {rank}) ---\n{_worker_traceback(exc)}", role, method, rank
            ) from exc.cause
    return ray.get(list(refs))


def _worker_traceback(exc) -> str:
    # Ray's RayTaskError carries the remote traceback; its subclassed form (an instance
    # of both RayTaskError and the user's exception type) only shows it in str().
    try:
        return exc.traceback_str
    except AttributeError:
        return str(exc)


def _first_lines(text: str, n: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[:n]) + (f"\n... ({len(lines) - n} more lines)" if len(lines) > n else "")


class RayWorkerGroup:
    """The actors of one role (or of several colocated roles) on a resource pool.

    ``detached=True`` names the actors ``{name_prefix}_{rank}`` with a detached lifetime
    so another driver can attach later with :meth:`from_detached`.
    """

    def __init__(self, resource_pool: RayResourcePool | None = None,
                 ray_cls_with_init: RayClassWithInitArgs | None = None,
                 name_prefix: str | None = None, detached: bool = False,
                 worker_names: list[str] | None = None, namespace: str | None = None,
                 role: str | None = None) -> None:
        if ray_cls_with_init is None:
            raise ValueError("ray_cls_with_init is required")
        self.ray_cls_with_init = ray_cls_with_init
        self.role = role or name_prefix or ray_cls_with_init.cls.__name__
        self.name_prefix = name_prefix or ray_cls_with_init.cls.__name__
        self._workers: list = []
        self._worker_names: list[str] = []
        self._dispatch_cache: dict[str, list[int]] = {}
        self._collect_cache: dict[str, list[bool]] = {}
        # the claim every registered call of this handle carries (``set_fence``); None: unfenced
        self.fence_claim: int | None = None
        self._method_prefix = ""  # a colocated role's view calls "{role}__{method}"
        self._rendezvous: str | None = None  # the file store of ranks on this machine (Worker.init_process_group)
        if worker_names is not None:
            self._attach(worker_names, namespace)
        else:
            if resource_pool is None:
                raise ValueError("resource_pool is required unless attaching by worker_names")
            self._spawn(resource_pool, detached)
        self._bind_methods(ray_cls_with_init.registered_methods(), prefix="")

    # ---------------------------------------------------------------- actors

    def _spawn(self, pool: RayResourcePool, detached: bool) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pgs = pool.get_placement_groups()
        world_size = pool.world_size
        remote_cls = ray.remote(self.ray_cls_with_init.cls)
        slots = [(pg, b, count) for pg, count in zip(pgs, pool.process_on_nodes) for b in range(count)]
        master_addr = master_port = None
        rendezvous = self._rendezvous = uuid.uuid4().hex
        for rank, (pg, bundle, on_node) in enumerate(slots):
            # LOCAL_WORLD_SIZE as torchrun sets it: this node's ranks (FSDP shards within them)
            env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), RENDEZVOUS_ENV: rendezvous,
                   "LOCAL_WORLD_SIZE": str(on_node)}
            if not (pool.use_gpu and pool.accelerator_resource == "GPU"):
                # a GPU worker sets LOCAL_RANK itself, from the GPU Ray gave it (Worker._bind_gpu):
                # the bundle index is no device index once Ray narrows CUDA_VISIBLE_DEVICES
                env["LOCAL_RANK"] = str(bundle)
            if master_addr is not None:
                env.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            options = {
                "num_cpus": pool.cpus_per_process / pool.max_colocate_count,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle),
                "runtime_env": {"env_vars": env},
            }
            if pool.use_gpu and pool.accelerator_resource == "GPU":
                options["num_gpus"] = 1 / pool.max_colocate_count
            elif pool.use_gpu:  # a custom accelerator resource (other hardware, or a simulated cluster)
                options["resources"] = {pool.accelerator_resource: 1 / pool.max_colocate_count}
            if detached:
                name = f"{self.name_prefix}_{rank}"
                options.update(name=name, lifetime="detached")
                self._worker_names.append(name)
            user_options = dict(self.ray_cls_with_init._options)
            if "runtime_env" in user_options:
                merged = dict(user_options.pop("runtime_env"))
                merged["env_vars"] = {**merged.get("env_vars", {}), **env}
                options["runtime_env"] = merged
            options.update(user_options)
            actor = remote_cls.options(**options).remote(*self.ray_cls_with_init.args,
                                                         **self.ray_cls_with_init.kwargs)
            self._workers.append(actor)
            if rank == 0:
                # rank 0 decides the rendezvous address; later ranks get it in their env.
                # Rank 0's own env is completed before any init_process_group call.
                master_addr, master_port = ray_get_ranked(
                    [actor._get_master_addr_port.remote()], self.role, "__init__", [0])[0]
                ray_get_ranked([actor.__ray_call__.remote(_set_master_env, master_addr, master_port)],
                               self.role, "__init__", [0])
        # Constructors run asynchronously; surface their failures now, per rank.
        ray_get_ranked([w.__ray_ready__.remote() for w in self._workers], self.role, "__init__")

    def _attach(self, names: list[str], namespace: str | None) -> None:
        import ray

        self._worker_names = list(names)
        self._workers = [ray.get_actor(n, namespace=namespace) for n in names]

    @classmethod
    def from_detached(cls, worker_names: list[str], ray_cls_with_init: RayClassWithInitArgs,
                      namespace: str | None = None, role: str | None = None) -> "RayWorkerGroup":
        """Attach to actors another driver spawned with ``detached=True``."""
        return cls(ray_cls_with_init=ray_cls_with_init, worker_names=worker_names,
                   namespace=namespace, role=role)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list:
        return list(self._workers)

    @property
    def worker_names(self) -> list[str]:
        return list(self._worker_names)

    # ---------------------------------------------------------------- binding

    def _bind_methods(self, methods: dict[str, dict], prefix: str) -> None:
        for name, attrs in methods.items():
            if prefix and not name.startswith(prefix):
                continue
            public = name[len(prefix):]
            if hasattr(type(self), public):
                raise ValueError(f"worker method {public!r} would shadow RayWorkerGroup.{public}")
            setattr(self, public, self._make_group_method(name, attrs))

    def _make_group_method(self, remote_name: str, attrs: dict):
        mode = get_dispatch_mode(attrs["dispatch_mode"])
        execute_mode = attrs["execute_mode"]
        blocking = attrs["blocking"]
        public = remote_name.split("__", 1)[-1]

        def call(*args, **kwargs):
            args, kwargs = mode.dispatch_fn(self, *args, **kwargs)
            padding = kwargs.pop(PADDING_KWARG, 0)
            if self.fence_claim is not None:
                kwargs = {**kwargs, FENCE_KWARG: [self.fence_claim] * self.world_size}
            refs, ranks = self._execute(remote_name, execute_mode, args, kwargs)
            if blocking:
                outputs = ray_get_ranked(refs, self.role, remote_name, ranks)
            else:
                outputs = refs
            result = mode.collect_fn(self, outputs)
            if padding:
                if isinstance(result, DataProto):
                    result = unpad_dataproto(result, padding)
                elif isinstance(result, DataProtoFuture):
                    result.dispatch_fn = lambda data, pad=padding: unpad_dataproto(data, pad)
            return result

        call.__name__ = public
        call.__doc__ = f"{remote_name} on every rank ({mode.name}, {execute_mode.value})"
        return call

    def _execute(self, method: str, execute_mode: Execute, args: tuple, kwargs: dict):
        if execute_mode == Execute.RANK_ZERO:
            first = [a[0] for a in args]
            return [getattr(self._workers[0], method).remote(*first, **{k: v[0] for k, v in kwargs.items()})], [0]
        n = self.world_size
        for i, value in enumerate(list(args) + list(kwargs.values())):
            if len(value) != n:
                raise ValueError(f"{self.role}.{method}: dispatch produced {len(value)} values for "
                                 f"argument {i}, but the group has {n} ranks")
        refs = [getattr(w, method).remote(*[a[r] for a in args], **{k: v[r] for k, v in kwargs.items()})
                for r, w in enumerate(self._workers)]
        return refs, list(range(n))

    def submit_to_rank(self, rank: int, method: str, *args, **kwargs):
        """Call the registered ``method`` on one rank with these arguments as they are (no
        dispatch); returns its ObjectRef. What a manager of servers among the ranks uses."""
        if self.fence_claim is not None:
            kwargs = {**kwargs, FENCE_KWARG: self.fence_claim}
        return getattr(self._workers[rank], f"{self._method_prefix}{method}").remote(*args, **kwargs)

    def execute_all(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` on every rank with the same arguments; blocking, ranked errors."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self._workers]
        return ray_get_ranked(refs, self.role, method)

    # ---------------------------------------------------------------- nd mesh info

    def _query_dispatch_info(self, mesh_name: str) -> list[int]:
        if mesh_name not in self._dispatch_cache:
            self._dispatch_cache[mesh_name] = self.execute_all("_query_dispatch_info", mesh_name)
        return self._dispatch_cache[mesh_name]

    def _query_collect_info(self, mesh_name: str) -> list[bool]:
        if mesh_name not in self._collect_cache:
            self._collect_cache[mesh_name] = self.execute_all("_query_collect_info", mesh_name)
        return self._collect_cache[mesh_name]

    # ---------------------------------------------------------------- colocation

    def spawn(self, prefix_set) -> dict[str, "RayWorkerGroup"]:
        """Per-role views of a colocated group: ``{role: group}`` sharing the same actors."""
        views = {}
        methods = self.ray_cls_with_init.registered_methods()
        for role in prefix_set:
            view = object.__new__(type(self))
            view.__dict__.update({k: v for k, v in self.__dict__.items()
                                  if not callable(v) or k.startswith("_")})
            view.role = role
            view._method_prefix = f"{role}__"
            view._dispatch_cache, view._collect_cache = {}, {}
            view._bind_methods(methods, prefix=f"{role}__")
            views[role] = view
        return views

    def kill(self) -> None:
        """Kill every actor of the group (detached ones included), and remove the file its
        ranks met through on this machine (a killed rank never removes it)."""
        import ray

        for w in self._workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if getattr(self, "_rendezvous", None):
            rendezvous_file(self._rendezvous).unlink(missing_ok=True)


def _set_master_env(worker, addr: str, port: int) -> None:
    import os

    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class that hosts several roles in the same process.

    Each role's registered methods appear as ``{role}__{method}``; ``RayWorkerGroup.spawn``
    turns them back into per-role groups. Roles share the process (and its GPU), which is
    how actor, rollout and reference share memory in the HybridFlow design.
    """
    from rlhf_core.controller.worker import Worker

    roles = {role: (c.cls, c.args, c.kwargs) for role, c in class_dict.items()}

    class ColocatedWorker(Worker):
        def __init__(self):
            super().__init__()
            self.roles = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in roles.items()}

        def _mesh_holder(self, mesh_name: str) -> Worker:
            # a role registers its mesh on itself (e.g. the actor's rollout mesh in init_model)
            return next((r for r in self.roles.values() if mesh_name in getattr(r, "_dispatch_info", {})), self)

        def _query_dispatch_info(self, mesh_name: str) -> int:
            return Worker._query_dispatch_info(self._mesh_holder(mesh_name), mesh_name)

        def _query_collect_info(self, mesh_name: str) -> bool:
            return Worker._query_collect_info(self._mesh_holder(mesh_name), mesh_name)

    def delegate(role: str, name: str, attrs: dict):
        def method(self, *args, **kwargs):
            return getattr(self.roles[role], name)(*args, **kwargs)

        method.__name__ = f"{role}__{name}"
        setattr(method, MAGIC_ATTR, attrs)
        return method

    for role, c in class_dict.items():
        for name, attrs in c.registered_methods().items():
            setattr(ColocatedWorker, f"{role}__{name}", delegate(role, name, attrs))
    ColocatedWorker.__name__ = "Colocated_" + "_".join(class_dict)
    ColocatedWorker.__qualname__ = ColocatedWorker.__name__
    return RayClassWithInitArgs(ColocatedWorker)
