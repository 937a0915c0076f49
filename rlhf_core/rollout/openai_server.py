"""An OpenAI-compatible chat-completions endpoint over a rollout engine: how a served judge
(a generative reward model) is reached by verl's GenRM reward functions, which post to
``http://{reward_router_address}/v1/chat/completions``.

The server batches what it holds: requests that arrive while the engine generates wait and
go to the engine together in its next call (grouped by sampling settings). A request is
data: its messages are rendered by the judge's own chat template and tokenized, nothing in
it is executed or fetched. Standard-library HTTP, a thread per connection; one engine call
at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_core.rollout.engine import GenerationRequest, Sampling

#: the largest request body read (a judge prompt is a problem and a solution)
MAX_BODY_BYTES = 4 << 20
#: connections served at once (each holds a thread), and how long a socket may sit idle
#: or half-sent: a slow client (or many) cannot pin the server's threads or memory
MAX_CONNECTIONS = 256
SOCKET_TIMEOUT_S = 30.0
ROLES = ("system", "user", "assistant")


class ChatRequestError(ValueError):
    """A request the endpoint refuses (HTTP 400, one line naming the field)."""


class JudgeAsleep(RuntimeError):
    """A request that reached the engine while it sleeps (HTTP 503): a call left over from a
    reward stage that ended (its row timed out, or another row failed the stage)."""


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple
    sampling: Sampling
    seed: int


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (low_open and value == low):
        raise ChatRequestError(f"{key}: expected a number in {'(' if low_open else '['}{low}, {high}]; found {value!r}")
    return float(value)


def parse_chat_request(body: bytes, max_new_tokens: int) -> ChatRequest:
    """A request body as the engine's settings. ``max_tokens`` above the server's
    ``max_new_tokens`` is cut to it (as a served model's context bounds a request); no
    ``seed`` seeds by the body's hash (the same request alone samples the same answer; an HF
    engine seeds a batch by its first request, so a batched answer depends on its batch)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ChatRequestError(f"body: expected a JSON object; found unparsable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ChatRequestError(f"body: expected a JSON object; found {type(data).__name__}")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError(f"messages: expected a non-empty list of {{role, content}}; found {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ChatRequestError(f"messages[{i}]: expected {{role: one of {', '.join(ROLES)}, content: a string}}; "
                                   f"found {message!r:.80}")
    if data.get("n", 1) != 1:
        raise ChatRequestError(f"n: expected 1 (one choice per request); found {data.get('n')!r}")
    if data.get("stream"):
        raise ChatRequestError("stream: expected false (whole answers only); found true")
    limit = data.get("max_tokens", data.get("max_completion_tokens", max_new_tokens))
    if limit is None:
        limit = max_new_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ChatRequestError(f"max_tokens: expected a positive integer; found {limit!r}")
    seed = data.get("seed")
    if seed is None:
        seed = int.from_bytes(hashlib.sha256(body).digest()[:4], "little")
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise ChatRequestError(f"seed: expected an integer; found {seed!r}")
    temperature = _number(data, "temperature", 1.0, 0.0, 2.0)
    top_k = data.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ChatRequestError(f"top_k: expected an integer (-1 or 0: off); found {top_k!r}")
    sampling = Sampling(temperature=temperature, top_p=_number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
                        top_k=max(top_k, 0), max_tokens=min(limit, max_new_tokens), greedy=temperature == 0)
    return ChatRequest(tuple((m["role"], m["content"]) for m in messages), sampling, int(seed) % (1 << 63))


def send_json(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    """Answer a request with a JSON ``body``; a caller that already hung up (its deadline
    passed, or its call was cancelled) is no error."""
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    except (BrokenPipeError, ConnectionResetError):
        pass


class _Pending:
    def __init__(self, ids: tuple[int, ...], request: ChatRequest) -> None:
        self.ids, self.request = ids, request
        self.done = threading.Event()
        self.tokens: list[int] | None = None
        self.error: BaseException | None = None


def special_spellings(tokenizer) -> list[str]:
    """The texts a tokenizer reads as one added (special or control) token."""
    return [token for token in tokenizer.get_added_vocab() if token]


def prompt_ids(tokenizer, messages, spelled: list[str] | None = None) -> list[int]:
    """The templated prompt's ids, each message's content read as text: a special token's
    spelling inside it (a policy's solution that writes ``<|im_end|>``) stays text, so no
    content forges a turn of the judge's prompt. Content that spells none is templated and
    tokenized as the template does it (its filters, a SentencePiece word start); content
    that does is placed between markers in the rendered template, and each content is
    tokenized apart with no special token. Not thread-safe: a fast tokenizer keeps
    ``split_special_tokens`` as state of its own (the server holds a lock). ``spelled``:
    ``special_spellings(tokenizer)``, which a server asks once."""
    spelled = special_spellings(tokenizer) if spelled is None else spelled
    chat = [{"role": role, "content": content} for role, content in messages]
    try:
        if not any(token in content for _, content in messages for token in spelled):
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding
        marks = [f"\u2063{uuid.uuid4().hex}\u2063" for _ in messages]
        text = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(chat, marks)],
                                             add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template refused these messages: asking again changes nothing
        raise ChatRequestError(f"messages: expected messages the judge's chat template renders; it raised "
                               f"{type(exc).__name__}: {exc}") from None
    ids, rest = [], text
    for i, ((_, content), mark) in enumerate(zip(messages, marks)):
        if text.count(mark) != 1 or mark not in rest:
            raise ChatRequestError(f"messages[{i}]: expected the judge's chat template to show its content once, "
                                   f"in order; it shows it {text.count(mark)} times")
        before, _, rest = rest.partition(mark)
        ids += tokenizer.encode(before, add_special_tokens=False)
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
    return ids + tokenizer.encode(rest, add_special_tokens=False)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """At most ``MAX_CONNECTIONS`` connections served at once; one more is closed at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0  # connections closed for want of a slot

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class ChatCompletionServer:
    """``/v1/chat/completions`` (and ``/v1/models``, ``/health``) over ``engine``.
    ``max_prompt_tokens``: a rendered prompt longer than this is refused (400)."""

    def __init__(self, engine, tokenizer, model_name: str, max_prompt_tokens: int, max_new_tokens: int,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.requests_served = self.engine_calls = 0
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._open = threading.Event()  # cleared by ``hold``: requests queue up, none is generated
        self._open.set()
        self._at_gate = False  # a request taken from the queue, held by ``hold``
        self._engine_lock = threading.Lock()  # an engine call, or a sleep / wake, at a time
        self._tokenizer_lock = threading.Lock()  # prompt_ids flips a fast tokenizer's own state
        self._spelled = special_spellings(tokenizer)
        self.asleep = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = SOCKET_TIMEOUT_S

            def log_message(self, *args) -> None:  # a request per row: no line each
                pass

            def _send(self, status: int, payload: dict) -> None:
                send_json(self, status, json.dumps(payload).encode())

            def do_GET(self) -> None:
                if self.path in ("/health", "/v1/health"):
                    self._send(200, {"status": "ok"})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                                 "owned_by": "rlhf"}]})
                else:
                    self._send(404, _error(f"no endpoint {self.path}"))

            def do_POST(self) -> None:
                if self.path != "/v1/chat/completions":
                    self._send(404, _error(f"no endpoint {self.path} (this server answers /v1/chat/completions)"))
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0:
                    self._send(400, _error(f"Content-Length: expected a whole number of bytes; found "
                                           f"{self.headers.get('Content-Length')!r}"))
                    return
                if length > MAX_BODY_BYTES:
                    self._send(413, _error(f"body: expected at most {MAX_BODY_BYTES} bytes; found {length}"))
                    return
                try:
                    self._send(200, server.complete(self.rfile.read(length)))
                except ChatRequestError as exc:
                    self._send(400, _error(str(exc)))
                except JudgeAsleep as exc:
                    self._send(503, _error(str(exc), "server_error"))
                except Exception as exc:  # the engine failed: the caller retries or fails its stage
                    self._send(500, _error(f"{type(exc).__name__}: {exc}", "server_error"))

        self._http = _BoundedHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        host, port = self._http.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> str:
        """Serve in background threads; returns ``host:port``."""
        for target in (self._http.serve_forever, self._generate_loop):
            thread = threading.Thread(target=target, daemon=True, name=f"judge-{target.__name__}")
            thread.start()
            self._threads.append(thread)
        return self.address

    def stop(self) -> None:
        self.release()
        self._http.shutdown()
        self._http.server_close()
        self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=30)

    def complete(self, body: bytes) -> dict:
        """One request's answer as an OpenAI ``chat.completion`` object."""
        request = parse_chat_request(body, self.max_new_tokens)
        with self._tokenizer_lock:
            ids = prompt_ids(self.tokenizer, request.messages, self._spelled)
        if len(ids) > self.max_prompt_tokens:
            raise ChatRequestError(f"messages: expected at most {self.max_prompt_tokens} prompt tokens once "
                                   f"templated (reward_model.rollout.prompt_length); found {len(ids)}")
        pending = _Pending(tuple(int(t) for t in ids), request)
        self._queue.put(pending)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        tokens = pending.tokens
        eos = getattr(self.engine, "eos_id", None)
        finished = eos is not None and bool(tokens) and tokens[-1] == eos
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "finish_reason": "stop" if finished else "length", "logprobs": None,
                             "message": {"role": "assistant",
                                         "content": self.tokenizer.decode(tokens, skip_special_tokens=True)}}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                          "total_tokens": len(ids) + len(tokens)}}

    def sleep(self) -> None:
        """Free the engine's memory (after any call in progress); calls that arrive before
        ``wake`` are answered 503."""
        with self._engine_lock:
            self.engine.sleep()
            self.asleep = True

    def wake(self) -> None:
        with self._engine_lock:
            self.engine.wake_up()
            self.asleep = False

    def hold(self) -> None:
        """Generate nothing until ``release``: what arrives meanwhile goes in one call."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def pending(self) -> int:
        """Requests waiting for the engine."""
        return self._queue.qsize() + int(self._at_gate)

    def _generate_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            self._at_gate = True
            self._open.wait()
            self._at_gate = False
            held = [first]
            while True:  # everything that arrived while the engine was busy goes in this call
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                held.append(item)
            groups: dict[Sampling, list[_Pending]] = {}
            for item in held:
                groups.setdefault(item.request.sampling, []).append(item)
            for sampling, items in groups.items():
                try:
                    with self._engine_lock:
                        if self.asleep:
                            raise JudgeAsleep("the judge is asleep: no reward stage is running")
                        self.engine_calls += 1
                        done = self.engine.generate([GenerationRequest(str(i), item.ids, item.request.seed)
                                                     for i, item in enumerate(items)], sampling)
                    for item, completion in zip(items, done):
                        item.tokens = list(completion.token_ids)
                    self.requests_served += len(items)
                except BaseException as exc:  # every waiter hears of it
                    for item in items:
                        item.error = exc
                for item in items:
                    item.done.set()


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}
