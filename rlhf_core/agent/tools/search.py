"""verl's search tool (``verl.tools.search_tool.SearchTool``, Search-R1's retrieval): the
model sends ``query_list``; each query's top ``topk`` passages come back as one text,
formatted as verl formats them (``Doc 1 (Title: ...)`` blocks, queries separated by
``---``, the whole as ``{"result": ...}`` JSON).

Where the passages come from:

- ``retrieval_service_url`` (verl's key): verl's retrieval-service protocol, one POST of
  ``{"queries": [...], "topk": k, "return_scores": true}`` answered by
  ``{"result": [[{"document": {"contents": "title\\ntext"}, "score": s}, ...], ...]}``.
  The reply is bounded in size and time like SandboxFusion's; a failure is the tool's
  answer ("Search error: ..."), never a crash.
- ``corpus_path`` (ours): BM25 over a local corpus, a parquet or JSONL file of documents
  with a ``contents`` column (``title\\ntext``, the Search-R1 corpus layout) or ``title``
  and ``text`` columns. No service to run: the index is built in the tool's process on
  first use.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from functools import lru_cache

from rlhf_core.agent.tools.base import BaseTool, ToolResponse
from rlhf_core.workers.sandbox_fusion import bounded_read

#: BM25's parameters (Robertson's; Pyserini's defaults for passage retrieval)
BM25_K1, BM25_B = 0.9, 0.4
_WORD = re.compile(r"\w+", re.UNICODE)


class SearchConfigError(ValueError):
    """A search tool config that cannot work, in one line naming the key."""


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 over documents' words: idf = ln(1 + (N - df + 0.5) / (df + 0.5)),
    each query word's tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / mean length))."""

    def __init__(self, documents: list[str], k1: float = BM25_K1, b: float = BM25_B) -> None:
        self.documents, self.k1, self.b = documents, k1, b
        self.counts = [Counter(words(d)) for d in documents]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = (sum(self.lengths) / len(self.lengths)) if self.lengths else 0.0
        df = Counter(w for c in self.counts for w in c)
        n = len(documents)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}
        self.postings: dict[str, list[int]] = {}
        for i, c in enumerate(self.counts):
            for w in c:
                self.postings.setdefault(w, []).append(i)

    def scores(self, query: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for w in set(words(query)):
            for i in self.postings.get(w, ()):
                tf, norm = self.counts[i][w], self.lengths[i] / (self.mean_length or 1.0)
                out[i] = out.get(i, 0.0) + self.idf[w] * tf * (self.k1 + 1) / (tf + self.k1 * (1 - self.b + self.b * norm))
        return out

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return ranked[:k]


@lru_cache(maxsize=4)
def corpus_index(path: str) -> BM25:
    """The corpus at ``path`` indexed (once per process and file)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        columns = set(table.column_names)
        rows = table.to_pylist()
    else:
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        columns = set(rows[0]) if rows else set()
    if "contents" in columns:
        documents = [str(r["contents"]) for r in rows]
    elif {"title", "text"} <= columns:
        documents = [f"{r['title']}\n{r['text']}" for r in rows]
    else:
        raise SearchConfigError(f"corpus_path: expected documents with a 'contents' column or 'title' and 'text' "
                                f"columns; found {sorted(columns)} in {path}")
    return BM25(documents)


def passages_text(retrieval: list[dict]) -> str:
    """One query's passages as verl shows them: the first line of ``contents`` is the title."""
    blocks = []
    for i, item in enumerate(retrieval):
        contents = str(item["document"]["contents"])
        title, _, text = contents.partition("\n")
        blocks.append(f"Doc {i + 1} (Title: {title})\n{text}")
    return "\n\n".join(blocks)


def retrieve(url: str, queries: list[str], topk: int, timeout_s: float, opener=urllib.request.urlopen) -> dict:
    """One call of verl's retrieval-service protocol; its JSON reply (bounded)."""
    body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                              "Accept": "application/json"})
    with opener(request, timeout=timeout_s) as reply:
        return json.loads(bounded_read(reply, time.monotonic() + timeout_s, "retrieval_service_url"))


class SearchTool(BaseTool):
    def __init__(self, config: dict, tool_schema: dict) -> None:
        super().__init__(config, tool_schema)
        self.url = self.config.get("retrieval_service_url")
        self.corpus = self.config.get("corpus_path")
        self.topk = self.config.get("topk", 3)
        self.timeout = self.config.get("timeout", 30)
        if bool(self.url) == bool(self.corpus):
            raise SearchConfigError(f"tool {self.name!r}: expected one of config.retrieval_service_url (verl's "
                                    f"retrieval service) or config.corpus_path (a local corpus); found "
                                    f"{'both' if self.url else 'neither'}")
        if self.url and not (isinstance(self.url, str) and re.match(r"https?://", self.url)):
            raise SearchConfigError(f"tool {self.name!r}: config.retrieval_service_url: expected an http(s) URL; "
                                    f"found {self.url!r}")
        if not (isinstance(self.topk, int) and 0 < self.topk <= 100):
            raise SearchConfigError(f"tool {self.name!r}: config.topk: expected an integer in [1, 100]; "
                                    f"found {self.topk!r}")

    def _search(self, queries: list[str]) -> tuple[str, dict]:
        if self.corpus:
            index = corpus_index(str(self.corpus))
            results = [[{"document": {"contents": index.documents[i]}, "score": s} for i, s in index.top(q, self.topk)]
                       for q in queries]
        else:
            try:
                reply = retrieve(self.url, queries, self.topk, float(self.timeout))
                results = reply.get("result") if isinstance(reply, dict) else None
                if not isinstance(results, list):
                    raise ValueError(f"expected {{'result': [...]}}; found {str(reply)[:120]}")
            except (OSError, ValueError, urllib.error.URLError) as exc:
                return json.dumps({"result": f"Search error: {exc}"}), {"status": "api_error"}
        total = sum(len(r) for r in results if isinstance(r, list))
        if not total:
            return json.dumps({"result": "No search results found."}), {"status": "no_results", "total_results": 0}
        try:
            text = "\n---\n".join(passages_text(r) for r in results)
        except (KeyError, TypeError) as exc:
            return json.dumps({"result": f"Search error: a malformed result ({exc!r})"}), {"status": "api_error"}
        return json.dumps({"result": text}), {"status": "success", "total_results": total}

    async def execute(self, instance_id, parameters, **kwargs):
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return ToolResponse(text=json.dumps({"result": "Error: 'query_list' is missing, empty, or not a list of "
                                                           "strings in parameters."})), 0.0, {}
        # blocking I/O or CPU work off the event loop: other trajectories keep generating
        text, metrics = await asyncio.to_thread(self._search, queries)
        return ToolResponse(text=text), 0.0, metrics
