"""Reward functions: loaded from a module or a reward file, and called in processes of
their own, each killed at its deadline (the ``prime`` manager's calls: a response's code
may hold the GIL in C or never return, which no thread can be stopped from). Nothing here
imports torch: a worker process starts in a fraction of a second.

A function crosses to a fresh interpreter by its *recipe*, never by pickling it: a module
function by ``module:qualname``, a reward file by path and name, the SandboxFusion router
by the function it wraps and its settings. Workers are started with ``subprocess`` (a new
interpreter, never a fork of a process running Ray's threads), each in a session of its
own so that whatever a call starts dies with it. Arguments go to a worker pickled (they
are this process's own objects); results come back as JSON and are checked as data (a
call may have run model-written code).
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
import pickle
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from rlhf_core.config import NAMED_REWARDS

#: the attribute a function built here carries its recipe under
RECIPE_ATTR = "__rlhf_recipe__"
#: the most a worker may answer for one call (bytes of JSON): a larger answer is a failure
MAX_ANSWER_BYTES = 1 << 20


class RecipeError(ValueError):
    """The function cannot be rebuilt in another process."""


def with_recipe(fn, recipe: dict):
    """``fn``, marked with how a fresh process rebuilds it."""
    setattr(fn, RECIPE_ATTR, recipe)
    return fn


def recipe_of(fn) -> dict:
    """How a fresh interpreter gets ``fn``: its recipe, or its import path when it is a
    module-level function. A closure or lambda has neither and is refused."""
    recipe = getattr(fn, RECIPE_ATTR, None)
    if recipe is not None:
        return recipe
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname and "." not in qualname:
        recipe = {"kind": "module", "spec": f"{module}:{qualname}"}
        file = getattr(sys.modules.get(module), "__file__", None)
        if file:  # the folder it was imported from, which a fresh interpreter may not search
            root = os.path.dirname(os.path.abspath(file))
            for _ in range(module.count(".")):
                root = os.path.dirname(root)
            recipe["root"] = root
        return recipe
    raise RecipeError(f"{qualname or fn!r}: a reward function run in processes of their own must be a module's "
                      f"function or a reward file's (found a closure, a lambda or a method)")


def load_reward_fn(spec: str):
    spec = NAMED_REWARDS.get(spec, spec)
    if ":" not in spec:
        raise ValueError(f"reward.function: expected module:function or one of {sorted(NAMED_REWARDS)}; "
                         f"found {spec!r}")
    module_name, fn_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward.function {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward.function {spec!r}: {module_name} has no callable {fn_name!r}")
    return with_recipe(fn, {"kind": "module", "spec": spec}), spec


def load_reward_file(path: str, name: str):
    """verl's ``custom_reward_function``: the function ``name`` of the Python file ``path``
    (trusted code of the run's owner: the file is executed as a module)."""
    import importlib.util
    import os

    where = f"custom_reward_function.path={path!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: expected a Python file; found none there")
    spec = importlib.util.spec_from_file_location(f"rlhf_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"{where}: importing it raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name: expected a function of {path}; found no callable {name!r}")
    return with_recipe(fn, {"kind": "file", "path": path, "name": name}), f"{path}:{name}"


def build(recipe: dict):
    """The function a recipe names (in the worker)."""
    if recipe["kind"] == "module":
        return load_reward_fn(recipe["spec"])[0]
    if recipe["kind"] == "file":
        return load_reward_file(recipe["path"], recipe["name"])[0]
    if recipe["kind"] == "sandbox_fusion":
        from types import SimpleNamespace

        return routed_to_sandbox(build(recipe["inner"]), SimpleNamespace(**recipe["settings"]))
    raise RecipeError(f"unknown recipe kind {recipe['kind']!r}")


def routed_to_sandbox(fn, settings):
    """``fn`` with code responses scored by SandboxFusion (``sandbox_fusion.routed``),
    marked so that a worker process rebuilds it when ``fn`` itself can be."""
    from rlhf_core.workers import sandbox_fusion

    reward = sandbox_fusion.routed(fn, settings)
    try:
        inner = recipe_of(fn)
    except RecipeError:
        return reward
    return with_recipe(reward, {"kind": "sandbox_fusion", "inner": inner, "settings": {
        "url": settings.url, "memory_limit_mb": settings.memory_limit_mb, "max_concurrent": settings.max_concurrent}})


def _plain(value):
    """A result as JSON can carry it (numpy scalars and arrays as numbers and lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, numbers.Real):
        return float(value)
    return repr(value)


def _serve() -> None:
    """A worker: the recipe on the first line of stdin, then one pickled call per frame;
    one JSON line per answer on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # the function's prints must not corrupt the answers
    stdin = sys.stdin.buffer
    try:
        fn = build(json.loads(stdin.readline()))
    except Exception as exc:
        out.write(json.dumps({"load_error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    while True:
        header = stdin.readline()
        if not header:
            return
        args = pickle.loads(stdin.read(int(header)))
        try:
            answer = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - the call's failure is its answer
            answer = {"raised": f"{type(exc).__name__}: {exc}"[:2000]}
        try:
            line = json.dumps(answer, default=_plain)
        except (TypeError, ValueError) as exc:
            line = json.dumps({"raised": f"the result is not JSON: {exc}"})
        out.write(line + "\n")
        out.flush()


@dataclass
class Outcome:
    status: str           # "ok", "raised", "timed out" or "died"
    value: object = None  # the result (ok) or the reason


class _Worker:
    def __init__(self, recipe: dict) -> None:
        roots, inner = [], recipe
        while inner:
            roots += [inner["root"]] if "root" in inner else []
            inner = inner.get("inner")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rlhf_core.workers.reward_functions import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        self.proc.stdin.write(json.dumps(recipe).encode() + b"\n")
        self.proc.stdin.flush()
        self.ready = False
        self.buffer = b""
        self.task: int | None = None
        self.deadline = 0.0

    def send(self, i: int, args: tuple, timeout_s: float) -> None:
        payload = pickle.dumps(args)
        self.proc.stdin.write(f"{len(payload)}\n".encode() + payload)
        self.proc.stdin.flush()
        self.task, self.deadline = i, time.monotonic() + timeout_s

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session: whatever the call started too
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        _wait_group_dead(self.proc.pid)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


#: how long a killed call's processes may take to die (SIGKILL is delivered asynchronously)
GROUP_DEATH_S = 10.0


def _wait_group_dead(pgid: int, limit_s: float = GROUP_DEATH_S) -> None:
    """Until no process of group ``pgid`` is alive (a zombie waiting for its reaper is
    dead), at most ``limit_s``: a SIGKILLed process that has not been scheduled yet still
    runs for a moment, and "every process is gone" is this module's promise."""
    proc = "/proc"
    if not os.path.isdir(proc):
        return
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        alive = False
        for name in os.listdir(proc):
            if not name.isdigit():
                continue
            try:
                with open(f"{proc}/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):  # state, pgrp after "comm)"
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)


def call_all(fn, calls: list[tuple], timeout_s: float, workers: int) -> list[Outcome]:
    """``fn(*args)`` for each of ``calls`` over up to ``workers`` processes; a call running
    past ``timeout_s`` is killed with its process (a new one takes the calls left). Every
    process is gone when this returns."""
    recipe = recipe_of(fn)
    outcomes: list[Outcome | None] = [None] * len(calls)
    pending = list(range(len(calls)))[::-1]
    pool: list[_Worker] = []
    selector = selectors.DefaultSelector()

    def retire(worker: _Worker, outcome: Outcome | None) -> None:
        if worker.task is not None and outcome is not None:
            outcomes[worker.task] = outcome
        selector.unregister(worker.proc.stdout)
        worker.kill()
        pool.remove(worker)

    try:
        while pending or any(w.task is not None for w in pool):
            while pending and len(pool) < min(workers, len(pending) + sum(w.task is not None for w in pool)):
                worker = _Worker(recipe)
                pool.append(worker)
                selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
            for worker in pool:
                if worker.ready and worker.task is None and pending:
                    i = pending.pop()
                    worker.send(i, calls[i], timeout_s)
            busy = [w.deadline for w in pool if w.task is not None]
            wait = max(0.0, min(busy) - time.monotonic()) if busy else None
            for key, _ in selector.select(wait):
                worker = key.data
                chunk = os.read(worker.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    if not worker.ready:  # it would die again: the function, not a call, is at fault
                        raise RecipeError("a reward worker exited before it had loaded the function")
                    retire(worker, Outcome("died", "the process exited"))
                    continue
                worker.buffer += chunk
                while b"\n" in worker.buffer:
                    line, worker.buffer = worker.buffer.split(b"\n", 1)
                    answer = json.loads(line)
                    if "load_error" in answer:
                        raise RecipeError(f"the reward function could not be loaded in a worker: "
                                          f"{answer['load_error']}")
                    if answer.get("ready"):
                        worker.ready = True
                    elif worker.task is not None:
                        outcomes[worker.task] = (Outcome("ok", answer["ok"]) if "ok" in answer
                                                 else Outcome("raised", answer.get("raised")))
                        worker.task = None
                if len(worker.buffer) > MAX_ANSWER_BYTES and worker in pool:
                    retire(worker, Outcome("raised", f"an answer over {MAX_ANSWER_BYTES} bytes"))
            now = time.monotonic()
            for worker in [w for w in pool if w.task is not None and w.deadline <= now]:
                retire(worker, Outcome("timed out", f"past {timeout_s:g} s"))
    finally:
        for worker in list(pool):
            selector.unregister(worker.proc.stdout)
            worker.kill()
        selector.close()
    return outcomes
