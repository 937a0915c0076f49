"""A served judge in verl's reward loop: each response is scored by a call of the reward
function of its own (``reward_managers.score_each``), which reaches the judge (a generative
reward model) through ``reward_router_address`` (verl's GenRM reward functions run
unchanged).

The address a row's function is given is a recording router in the reward worker's own
process, ``127.0.0.1:{port}/row/{i}``: a call to ``http://{address}/v1/chat/completions``
is forwarded to the judge replica with the least calls in flight, retried on a failed
connection, a timeout or a server error within ``reward_model.timeout``, and kept, request
and answer, for that row (the ``judge/calls`` column of the reward snapshot). A replay
gives the recorded answers again (a judge samples, and may be an outside service) and
calls no judge; a function that asks something the record does not hold fails the replay
in one line.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_core.rollout.openai_server import send_json


#: the column of the reward snapshot holding each row's judge calls (a JSON list)
CALLS_COLUMN = "judge/calls"
#: how much of one judge answer is kept (and forwarded)
MAX_ANSWER_BYTES = 4 << 20
#: pause between tries of a failed judge call (doubling, within the row's deadline)
RETRY_BACKOFF_S = 0.5
#: how much longer than a row's deadline the router keeps trying its call
ROUTER_MARGIN_S = 1.0
#: the judge is on the cluster's network: no proxy the environment names is asked
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class JudgeError(RuntimeError):
    """The judge could not be reached within the deadline, or a replay's function asked
    the judge something its record does not hold."""


class JudgeRouter:
    """The recording router (see the module doc). ``replicas``: the judge replicas'
    ``host:port``; ``recorded``: per row, the record to answer from instead (a replay:
    ``recorded_calls``'s rows)."""

    def __init__(self, replicas: list[str], timeout_s: float, recorded: list[dict] | None = None) -> None:
        self.replicas, self.timeout_s = list(replicas), float(timeout_s)
        self.recorded = recorded
        self.calls: dict[int, list[dict]] = {}  # row -> its calls, each once answered
        self.mismatched: set[int] = set()  # a replay: rows whose function asked what the record does not hold
        self._used: dict[int, set[int]] = {}
        self.failures = 0  # tries that failed and were retried
        self._in_flight = {replica: 0 for replica in self.replicas}
        self._lock = threading.Lock()
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: bytes) -> None:
                send_json(self, status, body)

            def _handle(self, method: str) -> None:
                parts = self.path.split("/", 3)  # "", "row", "<i>", "<rest>"
                if len(parts) < 4 or parts[1] != "row" or not parts[2].isdigit():
                    self._answer(404, _error(f"no endpoint {self.path} (expected /row/<i>/...)"))
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_ANSWER_BYTES:
                    self._answer(400, _error(f"Content-Length: expected 0 to {MAX_ANSWER_BYTES} bytes; found "
                                             f"{self.headers.get('Content-Length')!r}"))
                    return
                body = self.rfile.read(length) if length else b""
                status, answer = router.call(int(parts[2]), method, "/" + parts[3], body)
                self._answer(status, answer)

            def do_POST(self) -> None:
                self._handle("POST")

            def do_GET(self) -> None:
                self._handle("GET")

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="judge-router")
        self._thread.start()

    def address(self, row: int) -> str:
        """What row ``row``'s function is given as ``reward_router_address``."""
        host, port = self._http.server_address[:2]
        return f"{host}:{port}/row/{row}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=30)

    def call(self, row: int, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        request = body.decode("utf-8", errors="replace")
        if self.recorded is not None:
            kept = self.recorded[row]["calls"] if row < len(self.recorded) else []
            with self._lock:  # the first unused recorded call asking the same (calls in flight at once may land
                used = self._used.setdefault(row, set())  # in another order than they were recorded)
                index = next((k for k, c in enumerate(kept) if k not in used and c["path"] == path
                              and c["request"] == request), None)
                if index is not None:
                    used.add(index)
            if index is None:
                message = (f"row {row}: the reward function's judge call ({method} {path}) is not one the record "
                           f"holds: the function changed since the iteration ran, so its recorded judge answers do "
                           f"not apply")
                with self._lock:
                    self.mismatched.add(row)
                return 409, _error(message)
            status, answer = kept[index]["status"], kept[index]["answer"]
        else:
            status, answer = self._forward(method, path, body)
        with self._lock:
            self.calls.setdefault(row, []).append({"path": path, "request": request, "status": status,
                                                   "answer": answer})
        return status, answer.encode()

    def recorded_failure(self, row: int) -> dict | None:
        """A replay: how row ``row``'s call failed when the iteration ran (rate_limited: it
        scored 0), or None."""
        return None if self.recorded is None or row >= len(self.recorded) else self.recorded[row]["failed"]

    def _forward(self, method: str, path: str, body: bytes) -> tuple[int, str]:
        # a little past the row's own deadline: the row's timeout is what a caller sees
        deadline, wait, last = time.monotonic() + self.timeout_s + ROUTER_MARGIN_S, RETRY_BACKOFF_S, "no try"
        while True:
            with self._lock:  # the replica with the least calls in flight
                replica = min(self.replicas, key=lambda r: self._in_flight[r])
                self._in_flight[replica] += 1
            left = deadline - time.monotonic()
            try:
                req = urllib.request.Request(f"http://{replica}{path}", data=body if method == "POST" else None,
                                             method=method, headers={"Content-Type": "application/json"})
                with _DIRECT.open(req, timeout=max(left, 0.01)) as resp:
                    return resp.status, resp.read(MAX_ANSWER_BYTES).decode("utf-8", errors="replace")
            except urllib.error.HTTPError as exc:
                answer = exc.read(MAX_ANSWER_BYTES).decode("utf-8", errors="replace")
                if exc.code < 500:  # the request itself was refused: trying again changes nothing
                    return exc.code, answer
                last = f"HTTP {exc.code} from {replica}: {answer[:200]}"
            except (OSError, TimeoutError) as exc:  # refused, reset, timed out
                last = f"{type(exc).__name__} at {replica}: {exc}"
            finally:
                with self._lock:
                    self._in_flight[replica] -= 1
            self.failures += 1
            if time.monotonic() + wait >= deadline:
                return 504, _error(f"the judge did not answer within reward_model.timeout={self.timeout_s:g}s "
                                   f"({self.failures} failed tries; last: {last})").decode()
            time.sleep(wait)
            wait *= 2


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "judge_error"}}).encode()


def takes_router(fn) -> bool:
    """Whether ``fn`` can be given verl's ``reward_router_address`` and
    ``reward_model_tokenizer`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    names = {p.name for p in params}
    return {"reward_router_address", "reward_model_tokenizer"} <= names or \
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_replayed(router: JudgeRouter) -> None:
    """Refuse a replay whose function asked the judge what the record does not hold (it
    may have raised for the refused call, or scored on)."""
    if router.mismatched:
        raise JudgeError(f"replay: the reward function asked the judge what the record does not hold (rows "
                         f"{sorted(router.mismatched)[:8]}): the function changed since the iteration ran, so its "
                         f"recorded judge answers do not apply")


def calls_column(router: JudgeRouter, rows: int, extras: dict[str, list]) -> list[str]:
    """Each row's judge calls (in the order they were answered) and, under rate_limited,
    how its call failed (it scored 0), as JSON text."""
    out, timeouts, errors = [], extras.get("timeout") or [None] * rows, extras.get("error") or [None] * rows
    for i in range(rows):
        failed = None
        if timeouts[i]:
            failed = {"timeout": True}
        elif errors[i] is not None:
            failed = {"error": str(errors[i])}
        out.append(json.dumps({"calls": router.calls.get(i, []), "failed": failed}, ensure_ascii=False))
    return out


def _valid_call(call) -> bool:
    """A recorded call as the router records one: bodies within what it reads live, and a
    final status (a 1xx is never an answer)."""
    return (isinstance(call, dict) and isinstance(call.get("path"), str) and isinstance(call.get("request"), str)
            and isinstance(call.get("answer"), str) and isinstance(call.get("status"), int)
            and not isinstance(call.get("status"), bool) and 200 <= call["status"] <= 599
            and len(call["answer"]) <= MAX_ANSWER_BYTES and len(call["request"]) <= MAX_ANSWER_BYTES
            and len(call["path"]) <= MAX_ANSWER_BYTES)


def _valid_failure(failed) -> bool:
    return failed is None or failed == {"timeout": True} or (
        isinstance(failed, dict) and set(failed) == {"error"} and isinstance(failed["error"], str))


def recorded_calls(column) -> list[dict]:
    """The ``judge/calls`` column read back (data from the store: parsed and checked,
    nothing in it run)."""
    out = []
    for i, text in enumerate(column):
        try:
            row = json.loads(text) if isinstance(text, str) else None
        except (ValueError, RecursionError):
            row = None
        if not (isinstance(row, dict) and isinstance(row.get("calls"), list)
                and all(_valid_call(c) for c in row["calls"]) and _valid_failure(row.get("failed"))):
            raise JudgeError(f"{CALLS_COLUMN}[{i}]: expected {{calls: [{{path, request, status 200-599, answer: at "
                             f"most {MAX_ANSWER_BYTES} characters}}], "
                             f"failed: null | {{timeout: true}} | {{error: text}}}}; found {text!r:.80}")
        out.append({"calls": row["calls"], "failed": row.get("failed")})
    return out
