"""A fake Kubernetes API server, in process, for the cluster launcher's tests.

It is not Kubernetes: it stores ray.io RayClusters in a dict, speaks just the REST paths
the launcher uses (custom objects get/create/patch/delete, pods and events lists, the
deployment policy ConfigMap, creating the head's ServiceAccount / Role / RoleBinding, the
run's Ray token Secrets), and
plays the KubeRay operator by a script: a new cluster turns "ready" after a number of
polls, or never does while its pods sit Pending with a scheduling event. Like KubeRay 1.x,
"ready" is sticky (it stays when the worker pods go) and ``status.readyWorkerReplicas``
(omitted when 0) counts the worker pods: fewer replicas remove them at once, more bring
them up ``scale_up_polls`` polls later (None: never, their pods stay Pending). Namespaces other
than ``namespaces`` (by default the Ray namespace ``rlhf`` and the profiles ``team-a`` and
``team-b``) answer 403, as they do to a pipeline whose Role is bound only there.
It checks no RBAC: tests/test_manifests.py checks each recorded request against the Role.
It proves the launcher's logic (create vs reuse, wait, timeout with a useful report,
teardown policy), not that a real API server or operator behaves this way.
"""

from __future__ import annotations

import threading

import re

from json_http import JSONServer

CLUSTERS = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/rayclusters(?:/([^/?]+))?$")
CORE = re.compile(r"^/api/v1/namespaces/([^/]+)/(pods|events)$")
NAMESPACED = re.compile(r"^/apis?/(?:v1|(?:rbac\.authorization|networking)\.k8s\.io/v1|ray\.io/v1)/namespaces/([^/]+)/")
#: the other objects the launcher creates (POST) or reads (GET by name)
OBJECTS = re.compile(r"^/api(?:s/(?:rbac\.authorization|networking)\.k8s\.io)?/v1/namespaces/([^/]+)/"
                     r"(serviceaccounts|configmaps|roles|rolebindings|secrets|networkpolicies)(?:/([^/?]+))?$")


class FakeKubeAPI:
    def __init__(self, ready_after_polls: int | None = 2, namespaces=("rlhf", "team-a", "team-b"),
                 scale_up_polls: int | None = 2) -> None:
        self.ready_after_polls = ready_after_polls  # None: never ready
        self.namespaces = set(namespaces)
        self.scale_up_polls = scale_up_polls
        self.clusters: dict[tuple[str, str], dict] = {}
        #: (plural, namespace, name) -> object: config maps, accounts, roles, role bindings, secrets
        self.objects: dict[tuple[str, str, str], dict] = {}
        #: (plural, namespace, name) a DELETE of is refused with 403: what the admission
        #: policy (manifests/base/admission-policy.yaml) does to another profile's secret
        self.refused_deletes: set[tuple[str, str, str]] = set()
        self._uids = 0
        self.polls: dict[str, int] = {}
        self.workers: dict[str, int] = {}  # ready worker pods
        self._scaled: dict[str, tuple[int, int]] = {}  # the desired count and the poll that first saw it
        # the API server's writes are atomic (etcd): two creators cannot both get a 201
        self._lock = threading.Lock()
        self._http = JSONServer(self._locked_route)
        self.url = self._http.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def verbs(self, method: str, resource: str = "rayclusters") -> list[str]:
        """Paths of the requests with this method to this resource (None: to any)."""
        return [r["path"] for r in self._http.requests
                if r["method"] == method and (resource is None or f"/{resource}" in r["path"])]

    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request so far, in order."""
        return [(r["method"], r["path"]) for r in self._http.requests]

    def set_policy(self, namespace: str, text: str) -> None:
        """The deployment policy ConfigMap (manifests/base/deployment-policy.yaml) of a namespace."""
        self.objects[("configmaps", namespace, "rlhf-deployment-policy")] = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "rlhf-deployment-policy", "namespace": namespace}, "data": {"policy.yaml": text}}

    # ------------------------------------------------------------ the "operator"

    def _observe(self, name: str, obj: dict) -> dict:
        polls = self.polls[name] = self.polls.get(name, 0) + 1
        if self.ready_after_polls is None or polls <= self.ready_after_polls:
            return obj
        groups = obj["spec"].get("workerGroupSpecs", [])
        desired = sum(int(g.get("replicas", 0)) for g in groups)
        if name not in self.workers:
            self.workers[name] = desired  # KubeRay's first "ready": every pod is running
        if self._scaled.get(name, (None,))[0] != desired:
            self._scaled[name] = (desired, polls)
        if desired < self.workers[name]:
            self.workers[name] = desired
        elif self.scale_up_polls is not None and polls - self._scaled[name][1] >= self.scale_up_polls:
            self.workers[name] = desired
        status = {"state": "ready", "head": {"serviceName": f"{name}-head-svc"},
                  "desiredWorkerReplicas": desired, "maxWorkerReplicas": sum(int(g.get("maxReplicas", 0)) for g in groups)}
        if self.workers[name]:  # KubeRay omits zero counts (omitempty)
            status["readyWorkerReplicas"] = status["availableWorkerReplicas"] = self.workers[name]
        obj["status"] = status
        return obj

    def _pods(self, namespace: str, selector: str) -> list[dict]:
        name = selector.split("=", 1)[1]
        if (namespace, name) not in self.clusters:
            return []
        return [{"metadata": {"name": f"{name}-head-abcde", "namespace": namespace},
                 "status": {"phase": "Running"}},
                {"metadata": {"name": f"{name}-train-worker-xyz12", "namespace": namespace},
                 "status": {"phase": "Pending", "containerStatuses": [
                     {"name": "ray-worker", "ready": False, "restartCount": 0, "image": "img", "imageID": "",
                      "state": {"waiting": {"reason": "ContainerCreating"}}}]}}]

    def _events(self, namespace: str, selector: str) -> list[dict]:
        obj = selector.split("=", 1)[1]
        if "-worker-" not in obj:
            return []
        return [{"metadata": {"name": f"{obj}.1", "namespace": namespace}, "involvedObject": {"name": obj},
                 "type": "Warning", "reason": "FailedScheduling",
                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]

    # ------------------------------------------------------------------- HTTP

    def _locked_route(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        with self._lock:
            return self._route(method, path, body)

    def _route(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        route, _, query = path.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        from urllib.parse import unquote

        params = {k: unquote(v) for k, v in params.items()}
        if (m := NAMESPACED.match(route)) and m.group(1) not in self.namespaces:
            return 403, _status(403, "Forbidden", f"no rights in namespace {m.group(1)}")
        if m := OBJECTS.match(route):
            namespace, plural, name = m.groups()
            if method == "GET" and name:
                if (plural, namespace, name) not in self.objects:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                return 200, self.objects[(plural, namespace, name)]
            if method == "POST" and not name:
                key = (plural, namespace, body["metadata"]["name"])
                if key in self.objects:
                    return 409, _status(409, "AlreadyExists", f'{plural} "{key[2]}" already exists')
                self.objects[key] = dict(body)
                return 201, body
            if method == "PATCH" and name:  # a merge patch
                if (plural, namespace, name) not in self.objects:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                _merge(self.objects[(plural, namespace, name)], body)
                return 200, self.objects[(plural, namespace, name)]
            if method == "DELETE" and name:
                if (plural, namespace, name) in self.refused_deletes:
                    return 403, _status(403, "Forbidden", f"ValidatingAdmissionPolicy denied deleting {name}")
                if self.objects.pop((plural, namespace, name), None) is None:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                return 200, _status(200, "Success", "deleted")
        if m := CLUSTERS.match(route):
            namespace, name = m.groups()
            key = (namespace, name)
            if method == "GET" and name:
                if key not in self.clusters:
                    return 404, _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found')
                return 200, self._observe(name, self.clusters[key])
            if method == "POST":
                name = body["metadata"]["name"]
                if (namespace, name) in self.clusters:
                    return 409, _status(409, "AlreadyExists", f'rayclusters.ray.io "{name}" already exists')
                self._uids += 1
                body = dict(body, metadata=dict(body["metadata"], uid=f"uid-{self._uids}"))
                self.clusters[(namespace, name)] = body
                return 201, body
            if method == "PATCH" and name:  # a JSON merge patch (lists are replaced whole)
                if key not in self.clusters:
                    return 404, _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found')
                _merge(self.clusters[key], body)
                return 200, self.clusters[key]
            if method == "DELETE" and name:
                if key not in self.clusters:
                    return 404, _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found')
                want = ((body or {}).get("preconditions") or {}).get("uid")
                if want is not None and self.clusters[key]["metadata"].get("uid") != want:
                    return 409, _status(409, "Conflict", f"Precondition failed: UID in precondition: {want}")
                del self.clusters[key]
                return 200, _status(200, "Success", "deleted")
        if m := CORE.match(route):
            namespace, kind = m.groups()
            if kind == "pods":
                return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {},
                             "items": self._pods(namespace, params.get("labelSelector", "x="))}
            return 200, {"kind": "EventList", "apiVersion": "v1", "metadata": {},
                         "items": self._events(namespace, params.get("fieldSelector", "x="))}
        return 404, _status(404, "NotFound", f"no route {method} {route}")


def _merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif value is None:
            target.pop(key, None)
        else:
            target[key] = value


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure" if code >= 400 else "Success",
            "reason": reason, "message": message, "code": code}
