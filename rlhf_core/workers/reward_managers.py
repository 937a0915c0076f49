"""verl's reward managers: how a reward function's results become each response's
reward (``reward_model.reward_manager``). A manager is a function of the scoring rows
returning one score per row and the extra columns to log; adding one is a function and
an entry in ``MANAGERS``; ``config`` is the run's ``RunConfig``.

- ``naive``: the function per response (verl's default);
- ``dapo``: the function per response, then DAPO's soft overlong punishment (Yu et al.
  2025, eq. 13): a response longer than ``max_resp_len - overlong_buffer_cfg.len`` tokens
  loses ``penalty_factor`` x how far into that buffer it reaches; a function that returns a
  number has it logged as ``acc`` too, as verl's manager does;
- ``batch``: the function once per batch, with lists (``data_sources``, ``solution_strs``,
  ``ground_truths``, ``extra_infos``), returning one result per response;
- ``prime``: naive's calls side by side, one that raises or hangs scoring 0;
- ``rate_limited``: naive's calls side by side within request and token rates a minute,
  one that raises or times out scoring 0 (for reward functions that call outside APIs).

``score_each`` is verl's reward loop (a call per response, side by side): the
``rate_limited`` manager's, and how a served judge's rows are scored
(``workers/reward_loop.py``).

With a reward model in the run, its scores are the rewards under every manager (verl's
rule), unless a custom reward function is set (``workers/reward.py``).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable


class RewardFunctionError(RuntimeError):
    """The reward function raised or returned something that is not a score."""


@dataclass(frozen=True)
class ScoringRows:
    """What a reward function is given about each response, row-aligned."""

    data_sources: list
    solutions: list[str]          # the decoded responses, special tokens skipped
    ground_truths: list
    extra_infos: list             # each row's own copy: a function may change it
    uids: list
    lengths: list[int]            # valid response tokens (EOS included)


def checked_score(result, name: str, uid, row: int, extras: dict[str, list], rows: int) -> float:
    """One result of the function as a score: a finite number, or a dict holding one
    under ``score`` (its other keys become columns of ``extras``)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardFunctionError(f"reward function {name} returned a dict without 'score' for uid "
                                      f"{uid!r}: keys {sorted(result)}")
        for key, value in result.items():
            if key != "score":
                extras.setdefault(key, [None] * rows)[row] = value
        result = result["score"]
    if isinstance(result, bool) or not isinstance(result, numbers.Real) or not math.isfinite(float(result)):
        raise RewardFunctionError(f"reward function {name} returned {result!r} ({type(result).__name__}) "
                                  f"for uid {uid!r}; expected a finite number or a dict with 'score'")
    return float(result)


def naive(fn, name: str, rows: ScoringRows, config) -> tuple[list[float], dict[str, list]]:
    """verl's naive manager: ``fn(data_source, solution_str, ground_truth, extra_info)`` per response."""
    scores, extras = [], {}
    for i, (src, sol, gt, extra, uid) in enumerate(zip(rows.data_sources, rows.solutions, rows.ground_truths,
                                                       rows.extra_infos, rows.uids)):
        try:  # a copy: the n responses of a prompt share one extra_info, and a function may change it
            result = fn(src, sol, gt, copy.deepcopy(extra))
        except Exception as exc:
            raise RewardFunctionError(f"reward function {name} raised on uid {uid!r} (row {i}): "
                                      f"{type(exc).__name__}: {exc}") from exc
        scores.append(checked_score(result, name, uid, i, extras, len(rows.uids)))
    return scores, extras


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens: 0 up to
    ``max_resp_len - buffer_len``, then falling linearly to ``-penalty_factor`` at
    ``max_resp_len``."""
    return min(-(length - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0.0)


def dapo(fn, name: str, rows: ScoringRows, config) -> tuple[list[float], dict[str, list]]:
    """verl's dapo manager: naive's scores, ``acc`` logged for the rows whose function
    returned a number, then the overlong punishment when ``overlong_buffer_cfg.enable``."""
    return dapo_after(*naive(fn, name, rows, config), rows, config)


def dapo_after(scores: list[float], extras: dict[str, list], rows: ScoringRows, config
               ) -> tuple[list[float], dict[str, list]]:
    """What verl's dapo manager adds to per-response scores (``dapo``'s doc)."""
    returned_dicts = set()
    for column in extras.values():
        returned_dicts.update(i for i, value in enumerate(column) if value is not None)
    if len(returned_dicts) < len(scores):
        extras.setdefault("acc", [None] * len(scores))
        for i, score in enumerate(scores):
            if i not in returned_dicts:
                extras["acc"][i] = score
    kwargs = config.reward_model.reward_kwargs
    buffer = kwargs.overlong_buffer_cfg
    if buffer.enable:
        longest = kwargs.max_resp_len or config.rollout.response_length
        penalties = [overlong_penalty(length, longest, buffer.len, buffer.penalty_factor)
                     for length in rows.lengths]
        scores = [s + p for s, p in zip(scores, penalties)]
        if buffer.log:
            extras["overlong_reward"] = penalties
            extras["overlong"] = [float(p < 0) for p in penalties]
    return scores, extras


def batch(fn, name: str, rows: ScoringRows, config) -> tuple[list[float], dict[str, list]]:
    """verl's batch manager: ``fn(data_sources=, solution_strs=, ground_truths=,
    extra_infos=)`` once, one result per response."""
    try:
        results = fn(data_sources=list(rows.data_sources), solution_strs=list(rows.solutions),
                     ground_truths=list(rows.ground_truths), extra_infos=copy.deepcopy(list(rows.extra_infos)))
    except Exception as exc:
        raise RewardFunctionError(f"reward function {name} (reward_model.reward_manager=batch) raised on a batch "
                                  f"of {len(rows.uids)}: {type(exc).__name__}: {exc}") from exc
    try:
        results = list(results)
    except TypeError:
        results = None
    if results is None or len(results) != len(rows.uids):
        raise RewardFunctionError(f"reward function {name} (reward_model.reward_manager=batch): expected "
                                  f"{len(rows.uids)} results, one per response; found "
                                  f"{type(results).__name__ if results is None else len(results)}")
    extras: dict[str, list] = {}
    return [checked_score(r, name, uid, i, extras, len(results))
            for i, (r, uid) in enumerate(zip(results, rows.uids))], extras


#: prime: how long one call may take before it scores 0 (verl's 300 s).
PRIME_TIMEOUT_S = 300.0
#: prime: processes at once (verl's 64), at most four per core here
PRIME_WORKERS = 64


def prime(fn, name: str, rows: ScoringRows, config) -> tuple[list[float], dict[str, list]]:
    """verl's prime manager: naive's calls run side by side, each in a process of its own
    (``workers/reward_functions.py``: sandboxed code a response wrote may hold the GIL or
    never return); a call that raises, returns no score, dies or outlasts
    ``PRIME_TIMEOUT_S`` (its process is killed) scores 0, counted in the ``prime_failed``
    column. No process outlives the call."""
    import os

    from rlhf_core.workers import reward_functions

    calls = list(zip(rows.data_sources, rows.solutions, rows.ground_truths, rows.extra_infos))
    workers = max(1, min(PRIME_WORKERS, 4 * (os.cpu_count() or 1), len(calls)))
    try:
        outcomes = reward_functions.call_all(fn, calls, PRIME_TIMEOUT_S, workers)
    except reward_functions.RecipeError as exc:
        raise RewardFunctionError(f"reward function {name} (reward_model.reward_manager=prime): {exc}") from exc
    scores, extras, failed = [], {}, [0.0] * len(calls)
    for i, (outcome, uid) in enumerate(zip(outcomes, rows.uids)):
        try:
            if outcome.status != "ok":
                raise RewardFunctionError(outcome.status)
            scores.append(checked_score(outcome.value, name, uid, i, extras, len(calls)))
        except RewardFunctionError:  # verl's prime scores it 0
            scores.append(0.0)
            failed[i] = 1.0
    extras["prime_failed"] = failed
    return scores, extras


def rate_limited(fn, name: str, rows: ScoringRows, config) -> tuple[list[float], dict[str, list]]:
    """verl's rate_limited manager: naive's calls side by side, ``max_concurrent`` at once,
    started within ``max_rpm`` / ``max_tpm`` a minute; a call that times out or raises
    scores 0 (``score_each``)."""
    return score_each(fn, name, rows, config)


# ------------------------------------------------------------------ verl's reward loop

class TokenBucket:
    """verl's rate limiter for the reward loop: ``per_minute`` units a minute, a second's
    worth at most in a burst. A take larger than a second's worth waits until the bucket is
    full and leaves it below zero, so the takers after it wait that debt off (verl's waits
    before taking instead; the rate over a minute is the same). Takers queue in order.
    ``clock`` and ``sleep`` are injectable (the tests' clock advances only when someone
    sleeps)."""

    def __init__(self, per_minute: float, clock=time.monotonic, sleep=asyncio.sleep) -> None:
        self.rate = per_minute / 60.0
        self.capacity = self.tokens = self.rate
        self.clock, self.sleep = clock, sleep
        self.last = clock()
        self._lock: asyncio.Lock | None = None

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now

    async def take(self, units: float = 1.0) -> None:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            need = min(units, self.capacity)
            self._refill()
            while self.tokens < need:
                await self.sleep((need - self.tokens) / self.rate)
                self._refill()
            self.tokens -= units


def concurrency(config) -> int:
    """Rows scored at once: ``reward_model.max_concurrent``, or its default (0): verl's 1
    for rate_limited, 64 with a judge."""
    rm = config.reward_model
    return rm.max_concurrent or (1 if rm.reward_manager == "rate_limited" else 64)


def score_each(fn, name: str, rows: ScoringRows, config, router=None, judge_tokenizer=None
               ) -> tuple[list[float], dict[str, list]]:
    """Every row scored by a call of ``fn`` of its own (verl's reward loop: a coroutine
    function is awaited, a plain one runs in a thread), ``concurrency(config)`` at a time,
    each within ``reward_model.timeout`` seconds; with a ``router`` (a served judge) the
    function is given verl's ``reward_router_address`` and ``reward_model_tokenizer``.

    ``rate_limited`` (verl's manager): calls start within ``max_rpm`` a minute and
    ``max_tpm`` estimated tokens a minute; a call that times out or raises scores 0
    (columns ``timeout`` / ``error``; ``acc`` 0). Otherwise any row failing fails the
    batch in one line: nothing is committed half-scored."""
    rm = config.reward_model
    limited = rm.reward_manager == "rate_limited"
    n = len(rows.uids)
    results: list = [None] * n
    extras: dict[str, list] = {}

    def failed(i: int, column: str, value) -> None:
        results[i] = 0.0
        extras.setdefault(column, [None] * n)[i] = value
        extras.setdefault("acc", [None] * n)[i] = 0.0

    async def one(i: int, gate: asyncio.Semaphore, pool: ThreadPoolExecutor, buckets) -> None:
        kwargs = dict(data_source=rows.data_sources[i], solution_str=rows.solutions[i],
                      ground_truth=rows.ground_truths[i], extra_info=copy.deepcopy(rows.extra_infos[i]))
        if router is not None:
            kwargs.update(reward_router_address=router.address(i), reward_model_tokenizer=judge_tokenizer)
            failure = router.recorded_failure(i)
            if failure is not None:  # a replay: the call failed when the iteration ran, and scored 0
                return failed(i, *next(iter(failure.items())))
        for bucket, units in buckets:
            await bucket.take(units)
        async with gate:
            try:
                if inspect.iscoroutinefunction(fn):
                    call = fn(**kwargs)
                else:
                    call = asyncio.get_running_loop().run_in_executor(pool, lambda: fn(**kwargs))
                results[i] = await asyncio.wait_for(call, timeout=rm.timeout)
                if limited:  # verl's manager scores 0 for a result that is not a score, too
                    checked_score(results[i], name, rows.uids[i], i, {}, n)
            except asyncio.TimeoutError:
                if limited:
                    return failed(i, "timeout", True)
                raise RewardFunctionError(f"reward function {name} did not score uid {rows.uids[i]!r} (row {i}) "
                                          f"within reward_model.timeout={rm.timeout:g}s"
                                          + (f" ({router.failures} judge tries failed)" if router else "")) from None
            except Exception as exc:
                if limited:
                    return failed(i, "error", f"{type(exc).__name__}: {exc}")
                raise RewardFunctionError(f"reward function {name} raised on uid {rows.uids[i]!r} (row {i}): "
                                          f"{type(exc).__name__}: {exc}") from exc

    async def every() -> None:
        buckets = [(TokenBucket(rm.max_rpm), 1.0)] if limited and rm.max_rpm else []
        if limited and rm.max_tpm:
            buckets.append((TokenBucket(rm.max_tpm), float(rm.estimated_tokens_per_request)))
        at_once = concurrency(config)
        gate = asyncio.Semaphore(at_once)
        pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="reward-call")
        tasks = [asyncio.ensure_future(one(i, gate, pool, buckets)) for i in range(n)]
        try:
            await asyncio.gather(*tasks)
        finally:  # the first failure cancels the rest: none runs on after the stage failed
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # a plain function past its deadline cannot be stopped: the stage does not wait for it
            pool.shutdown(wait=False, cancel_futures=True)

    asyncio.run(every())
    scores = []
    for i, (result, uid) in enumerate(zip(results, rows.uids)):
        scores.append(checked_score(result, name, uid, i, extras, n))
        if limited and not isinstance(result, dict):  # verl's: a plain number is logged as acc too
            extras.setdefault("acc", [None] * n)[i] = scores[-1]
    return scores, extras


#: reward_model.reward_manager -> manager.
MANAGERS: dict[str, Callable] = {"naive": naive, "dapo": dapo, "batch": batch, "prime": prime,
                                 "rate_limited": rate_limited}
