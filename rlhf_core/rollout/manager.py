"""Rollout replicas behind one manager (``rollout.mode=async``).

A replica is a server: the actor ranks that hold one engine (one rank, or a
tensor-parallel group), taking lists of requests and answering them with completions.
The manager turns a batch of prompt rows into requests and balances them over the
replicas as they free up (least outstanding requests first), instead of one static
shard per rank that the iteration waits on at its slowest.

What decides a sample is fixed before any replica is asked: the requests are cut into
chunks (whole prompt groups, so the n samples of a prompt share one replica and its
prefix cache) by the number of replicas configured, never by timing. Which replica
serves a chunk is the only thing left to timing, and replicas hold the same weights and
engine, so the rows do not depend on it: a replica that dies mid-iteration has its chunks
served by the others, with the rows a run without the death gives.

Every weight version has a number (the trainer step whose weights the replica holds); a
call pinned to a version a replica does not hold is refused there (``WeightVersionError``)
and nothing is generated with other weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from rlhf_core.rollout.engine import Completion, GenerationRequest, Sampling

#: chunks per replica when there are several (more: finer balance, more calls per iteration)
CHUNKS_PER_REPLICA = 4
#: calls outstanding on one replica at once: one, so a replica takes its next chunk when it
#: has finished the last (a queued chunk on a slow replica would be the iteration's tail)
MAX_IN_FLIGHT = 1


class WeightVersionError(RuntimeError):
    """A request pinned to a weight version the replica does not hold."""


class ReplicasLostError(RuntimeError):
    """Every replica died before the requests were served."""


@dataclass
class Replica:
    """One server: the actor ranks that generate together, and its load."""

    index: int
    ranks: list[int]
    #: the ranks split a call's requests and generate together (HF on a sharded policy);
    #: else each takes all of them and the first answers (one tensor-parallel engine)
    splits: bool = False
    alive: bool = True
    outstanding: int = 0        # requests sent and not answered
    served: int = 0             # requests answered this call
    calls: int = 0


@dataclass
class Answer:
    """What a replica returns for one chunk."""

    completions: list[Completion]
    version: int
    seconds: float = 0.0
    pad_id: int = 0


class ReplicaTransport(Protocol):
    """How the manager reaches replicas (Ray actors in a run; anything in a test)."""

    def submit(self, replica: Replica, requests: list[GenerationRequest], sampling: Sampling,
               version: int | None): ...

    def wait_any(self, pending: list) -> list:
        """Some finished handles of ``pending`` (at least one; blocks until then)."""

    def result(self, handle) -> Answer:
        """The handle's answer; raises ``ReplicaDiedError`` when its replica died."""


class ReplicaDiedError(RuntimeError):
    """The replica's process is gone (its chunk is served by another)."""


def prompt_groups(requests: list[GenerationRequest]) -> list[list[int]]:
    """Indices of consecutive requests with the same prompt (the n samples of one prompt)."""
    groups: list[list[int]] = []
    for i, request in enumerate(requests):
        if groups and requests[groups[-1][0]].prompt_ids == request.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plan_chunks(requests: list[GenerationRequest], chunks: int) -> list[list[int]]:
    """At most ``chunks`` runs of whole prompt groups, in order, of about equal requests."""
    groups = prompt_groups(requests)
    chunks = max(1, min(chunks, len(groups)))
    out: list[list[int]] = [[] for _ in range(chunks)]
    for g, group in enumerate(groups):
        out[g * chunks // len(groups)].extend(group)
    return [c for c in out if c]


@dataclass
class GenerationStats:
    """What one ``generate`` call measured (verl-style metric names in ``metrics``)."""

    per_replica: dict[int, int] = field(default_factory=dict)
    queue_wait_s: list[float] = field(default_factory=list)
    replicas_lost: int = 0
    seconds: float = 0.0
    pad_id: int = 0             # the engines' padding token (what the responses are padded with)

    def metrics(self) -> dict[str, float]:
        load = list(self.per_replica.values())
        mean = sum(load) / len(load) if load else 0.0
        out = {f"rollout/replica_{i}/requests": float(n) for i, n in sorted(self.per_replica.items())}
        out.update({"rollout/load_imbalance": max(load) / mean if mean else 0.0,
                    "rollout/queue_wait_s/mean": sum(self.queue_wait_s) / max(1, len(self.queue_wait_s)),
                    "rollout/queue_wait_s/max": max(self.queue_wait_s, default=0.0),
                    "rollout/replicas_lost": float(self.replicas_lost),
                    "timing_s/gen": self.seconds})
        return out


class RolloutManager:
    """Balances requests over ``replicas`` through ``transport``."""

    def __init__(self, replicas: list[Replica], transport: ReplicaTransport,
                 chunks_per_replica: int = CHUNKS_PER_REPLICA, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        if not replicas:
            raise ValueError("RolloutManager: expected at least one replica; found none")
        self.replicas, self.transport = replicas, transport
        self.chunks_per_replica, self.max_in_flight = chunks_per_replica, max_in_flight

    def generate(self, requests: list[GenerationRequest], sampling: Sampling,
                 version: int | None = None) -> tuple[list[Completion], list[int], GenerationStats]:
        """Every request's completion (in request order), the weight version of each, and
        the call's statistics. ``version``: the weights every answer must come from."""
        t0 = time.perf_counter()
        stats = GenerationStats(per_replica={r.index: 0 for r in self.replicas})
        # fixed by the configured replicas alone: the rows never depend on timing or deaths
        count = 1 if len(self.replicas) == 1 else len(self.replicas) * self.chunks_per_replica
        queue = list(enumerate(plan_chunks(requests, count)))
        done: dict[int, Answer] = {}
        pending: dict = {}  # handle -> (chunk index, replica, sent at)
        planned = time.perf_counter()
        for replica in self.replicas:
            replica.outstanding = replica.served = replica.calls = 0
        while queue or pending:
            while queue:
                free = [r for r in self.replicas if r.alive and r.calls < self.max_in_flight]
                if not free:
                    break
                replica = min(free, key=lambda r: (r.outstanding, r.index))
                index, chunk = queue.pop(0)
                handle = self.transport.submit(replica, [requests[i] for i in chunk], sampling, version)
                stats.queue_wait_s.append(time.perf_counter() - planned)
                replica.outstanding += len(chunk)
                replica.calls += 1
                pending[handle] = (index, chunk, replica)
            if not pending:
                raise ReplicasLostError(f"rollout: every one of {len(self.replicas)} replicas died with "
                                        f"{sum(len(c) for _, c in queue)} requests unserved")
            for handle in self.transport.wait_any(list(pending)):
                index, chunk, replica = pending.pop(handle)
                replica.outstanding -= len(chunk)
                replica.calls -= 1
                try:
                    answer = self.transport.result(handle)
                except ReplicaDiedError:
                    if replica.alive:
                        replica.alive = False
                        stats.replicas_lost += 1
                    queue.insert(0, (index, chunk))  # first in line for the replicas left
                    continue
                if version is not None and answer.version != version:
                    raise WeightVersionError(f"rollout: replica {replica.index} answered with weight version "
                                             f"{answer.version}; expected {version}")
                done[index] = answer
                stats.pad_id = answer.pad_id
                replica.served += len(chunk)
                stats.per_replica[replica.index] += len(chunk)
        by_request: dict[str, tuple[Completion, int]] = {}
        for answer in done.values():
            for completion in answer.completions:
                by_request[completion.request_id] = (completion, answer.version)
        ordered = [by_request[r.request_id] for r in requests]
        stats.seconds = time.perf_counter() - t0
        return [c for c, _ in ordered], [v for _, v in ordered], stats


class RayReplicaTransport:
    """Replicas that are ranks of a Ray worker group (the actor's: colocated replicas).
    Every rank of a replica is called: with its part of the requests when the ranks split
    them (a rank without a part gets a filler request, answered and dropped: all of them
    must step together), else with all of them (the first rank answers)."""

    FILLER = "__filler__"

    def __init__(self, group, method: str = "generate_requests") -> None:
        self.group, self.method = group, method
        self._calls: dict = {}  # first ref -> (every rank's ref, whether their answers are parts)

    def submit(self, replica: Replica, requests, sampling, version):
        payload = [(r.request_id, list(r.prompt_ids), r.seed, r.max_tokens) for r in requests]
        if replica.splits:
            size = -(-len(payload) // len(replica.ranks))
            parts = [payload[k * size:(k + 1) * size] or [(self.FILLER, *payload[0][1:])]
                     for k in range(len(replica.ranks))]
        else:
            parts = [payload] * len(replica.ranks)
        refs = [self.group.submit_to_rank(rank, self.method, part, sampling, version)
                for rank, part in zip(replica.ranks, parts)]
        self._calls[refs[0]] = (refs, replica.splits)
        return refs[0]

    def wait_any(self, pending: list) -> list:
        import ray

        ready, _ = ray.wait(pending, num_returns=1)
        return ready

    def result(self, handle) -> Answer:
        import ray
        from ray.exceptions import RayActorError

        refs, parts = self._calls.pop(handle)
        try:
            answers = ray.get(refs)
        except RayActorError as exc:
            raise ReplicaDiedError(str(exc).splitlines()[0]) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, WeightVersionError):
                raise WeightVersionError(str(cause)) from None
            raise
        versions = {a["version"] for a in answers}
        if len(versions) != 1:
            raise WeightVersionError(f"rollout: the ranks of one replica answered with weight versions "
                                     f"{sorted(versions)}")
        first = answers[0]
        completions = [Completion(*c) for a in (answers if parts else answers[:1]) for c in a["completions"]
                       if c[0] != self.FILLER]
        return Answer(completions, first["version"], max(a["seconds"] for a in answers), first["pad_id"])


def serve(engine, requests: list, sampling: Sampling, version: int | None, held: int, name: str) -> dict:
    """A replica's answer to one call (``requests``: (id, prompt ids, seed, own token limit
    or None)): refused when it is pinned to a ``version`` other than the ``held`` one."""
    if version is not None and version != held:
        raise WeightVersionError(f"rollout replica ({name}): expected weight version {version}; found {held} (the "
                                 f"manager pinned the requests to weights this replica does not hold)")
    t0 = time.perf_counter()
    completions = engine.generate([GenerationRequest(i, tuple(ids), seed, limit) for i, ids, seed, limit in requests],
                                  sampling)
    return {"completions": [(c.request_id, c.token_ids, c.log_probs) for c in completions], "version": held,
            "seconds": time.perf_counter() - t0, "pad_id": engine.pad_id}


def replicas_of(world_size: int, ranks_per_replica: int = 1, splits: bool = False) -> list[Replica]:
    """The actor's ranks as replicas of consecutive ranks (an engine's ``replica_shape``)."""
    return [Replica(i, list(range(i * ranks_per_replica, (i + 1) * ranks_per_replica)), splits)
            for i in range(world_size // ranks_per_replica)]
