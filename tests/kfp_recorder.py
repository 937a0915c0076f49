"""A stand-in for the Kubeflow Pipelines API server that records requests.

No Kubeflow server can run on a test machine, so `rlhf submit` / `rlhf schedule` are
tested for the shape of the requests they send (method, path, JSON body) against the
responses the KFP v2beta1 REST API documents. It proves what we ask the server to do, not
that a real server does it.
"""

from __future__ import annotations

from json_http import JSONServer


class Recorder:
    def __init__(self) -> None:
        self.experiments: dict[str, dict] = {}
        self._http = JSONServer(self.respond)
        self.requests, self.url = self._http.requests, self._http.url

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self._http.close()

    def find(self, method: str, path: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and r["path"].split("?")[0] == path]

    def respond(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        route = path.split("?")[0].rstrip("/")
        if route == "/apis/v2beta1/healthz":
            return 200, {"multi_user": False, "pipeline_store": "database"}
        if route == "/apis/v2beta1/experiments" and method == "GET":
            query = path.partition("?")[2]
            found = [e for e in self.experiments.values() if e["display_name"] in _unquote(query)]
            return 200, {"experiments": found, "total_size": len(found)} if found else {}
        if route == "/apis/v2beta1/experiments" and method == "POST":
            exp = {"experiment_id": f"exp-{len(self.experiments) + 1}", "display_name": body["display_name"],
                   "namespace": body.get("namespace", "")}
            self.experiments[exp["experiment_id"]] = exp
            return 200, exp
        if route == "/apis/v2beta1/runs" and method == "POST":
            return 200, {**body, "run_id": "run-1", "state": "PENDING"}
        if route == "/apis/v2beta1/recurringruns" and method == "POST":
            return 200, {**body, "recurring_run_id": "rr-1", "status": "ENABLED"}
        return 404, {"error": f"no route {method} {route}", "code": 5}


def _unquote(text: str) -> str:
    from urllib.parse import unquote

    return unquote(unquote(text))
