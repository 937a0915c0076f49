"""Code rewards from a SandboxFusion server (verl's ``reward_model.sandbox_fusion``).

With ``sandbox_fusion.url`` set and no custom reward function, the responses of coding
data sources (``CODE_SOURCES``, verl's) are scored by running their code on the server
against the prompt's test cases; every other data source keeps ``reward.function``.

A response's code is its last fenced ``python`` block (else its first fenced block; none:
score 0). The ground truth holds ``inputs`` and ``outputs`` (JSON, or a dict). Each of the
first ``MAX_CASES`` cases is one ``POST url`` of the code with the case's input as stdin
(SandboxFusion's ``/run_code`` API: ``code``, ``language``, ``stdin``, ``compile_timeout``,
``run_timeout``, ``memory_limit_MB``); a case passes when the server reports
``status == "Success"``, the run ``Finished`` and its stdout equals the expected output
(trailing newlines aside). The score is the fraction of cases passed; a server error
counts the case failed, a 504 is retried twice (1 s, 2 s), as verl does. At most
``max_concurrent`` requests of one reward process are in flight at once.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

#: The data sources whose responses are programs (verl's list).
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
MAX_CASES = 10
COMPILE_TIMEOUT_S = RUN_TIMEOUT_S = 10
# a block cut off at the response's length limit has no closing fence: it runs to the end
_FENCED = re.compile(r"```(\w*)\n(.*?)(?:```|\Z)", re.S)
_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_LOCK = threading.Lock()


def extract_code(response: str) -> str | None:
    blocks = _FENCED.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[0][1] if blocks else None


def cases_of(ground_truth) -> tuple[list, list]:
    """(inputs, expected outputs) of a coding prompt's ground truth; ValueError when it
    has neither."""
    try:
        cases = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    except ValueError:
        cases = None
    if isinstance(cases, dict) and cases.get("fn_name"):
        raise ValueError(f"sandbox_fusion: call-style test cases (fn_name={cases['fn_name']!r}) are not run here; "
                         f"only stdin/stdout cases")
    if not isinstance(cases, dict) or not isinstance(cases.get("inputs"), list) or \
            not isinstance(cases.get("outputs"), list) or len(cases["inputs"]) != len(cases["outputs"]):
        raise ValueError(f"sandbox_fusion: expected a ground truth with equal-length 'inputs' and 'outputs' "
                         f"lists; found {str(ground_truth)[:120]!r}")
    return cases["inputs"], cases["outputs"]


def run_case(url: str, code: str, stdin, memory_limit_mb: int, opener=urllib.request.urlopen) -> dict | None:
    """The server's answer for one run (None: it could not be reached or answered badly)."""
    body = json.dumps({"code": code, "language": "python", "stdin": None if stdin is None else str(stdin),
                       "compile_timeout": COMPILE_TIMEOUT_S, "run_timeout": RUN_TIMEOUT_S,
                       "memory_limit_MB": memory_limit_mb, "files": {}, "fetch_files": []}).encode()
    for attempt in range(3):
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with opener(request, timeout=COMPILE_TIMEOUT_S + RUN_TIMEOUT_S + 10) as reply:
                return json.loads(bounded_read(reply, time.monotonic() + REPLY_DEADLINE_S))
        except urllib.error.HTTPError as exc:
            if exc.code != 504 or attempt == 2:
                return None
            time.sleep(1 + attempt)  # the gateway timed out: the server is busy
        except (OSError, ValueError):
            return None
    return None


#: a reply's bounds: its size, and the time it may take in all (a server that drips its
#: reply a byte at a time resets every socket timeout, never this one)
MAX_REPLY_BYTES = 4 << 20
REPLY_DEADLINE_S = COMPILE_TIMEOUT_S + RUN_TIMEOUT_S + 20


def bounded_read(reply, deadline: float, who: str = "sandbox_fusion") -> bytes:
    """The reply's body, or ValueError past ``MAX_REPLY_BYTES`` or ``deadline`` (a
    monotonic time); ``who`` names the service in the error."""
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise ValueError(f"{who}: the reply took too long (a deadline of its own, or {REPLY_DEADLINE_S} s)")
        chunk = reply.read1(65536) if hasattr(reply, "read1") else reply.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise ValueError(f"{who}: a reply over {MAX_REPLY_BYTES} bytes")
        chunks.append(chunk)


def passed(answer: dict | None, expected) -> bool:
    if not isinstance(answer, dict) or answer.get("status") != "Success":
        return False
    run = answer.get("run_result") or {}
    return run.get("status") == "Finished" and (
        expected is None or str(run.get("stdout", "")).rstrip("\n") == str(expected).rstrip("\n"))


def score(url: str, response: str, ground_truth, memory_limit_mb: int = 1024, max_concurrent: int = 64) -> float:
    code = extract_code(response)
    if code is None:
        return 0.0
    inputs, outputs = cases_of(ground_truth)
    cases = list(zip(inputs, outputs))[:MAX_CASES]
    if not cases:
        return 0.0
    with _LOCK:
        gate = _SEMAPHORES.setdefault((url, max_concurrent), threading.BoundedSemaphore(max_concurrent))

    def one(case) -> bool:
        with gate:
            return passed(run_case(url, code, case[0], memory_limit_mb), case[1])

    with ThreadPoolExecutor(max_workers=min(len(cases), max_concurrent)) as pool:
        return sum(pool.map(one, cases)) / len(cases)


def routed(fn, settings):
    """``fn`` with the coding data sources scored by the sandbox at ``settings.url``."""

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        if data_source in CODE_SOURCES:
            return score(settings.url, solution_str, ground_truth, settings.memory_limit_mb, settings.max_concurrent)
        return fn(data_source, solution_str, ground_truth, extra_info)

    return reward
