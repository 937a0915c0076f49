"""Run config -> KubeRay v1 objects (plain dicts, ready for YAML or the API).

A RayCluster has a head group (the session's driver and the dashboard / Jobs API; no
training) and one worker group per resource pool; the RayJob variant wraps the same
cluster spec with the long-lived session (``rlhf serve``) as its entrypoint, so the
cluster lives exactly as long as the session: it ends when the session idles out or is
stopped (``shutdownAfterJobFinishes``), its logs stay ``ttlSecondsAfterFinished``, and
``activeDeadlineSeconds`` bounds a session that never idles.
"""

from __future__ import annotations

import json
import shlex

from components.kuberay.head_account import head_account_objects
from components.kuberay.names import cluster_name, head_account_name, label_value
from components.kuberay.spec import CLIENT_PORT, DASHBOARD_PORT, GCS_PORT, KubeSpec

API_VERSION = "ray.io/v1"
GIB = 1024 ** 3
TRAINING_GROUP = "train"
CACHE_DIR = "/home/rlhf/.cache"
#: What the object-store secret may hold (manifests/base/secret-object-store.example.yaml).
OBJECT_STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                     "AWS_REGION")
REQUIRED_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
#: The autoscaler sidecar's requests and limits (KubeRay's defaults for it).
AUTOSCALER_RESOURCES = {"cpu": "500m", "memory": "512Mi"}
#: Where a pod's Kubernetes API credentials go (the path Ray's autoscaler reads them from).
KUBE_API_VOLUME, TOKEN_DIR = "kube-api-access", "/var/run/secrets/kubernetes.io/serviceaccount"


class PoolShapeError(ValueError):
    """A resource pool the node type cannot host; the message names the fields."""


def pools(cfg) -> list[dict]:
    """The run's resource pools (``pool_plan``) as worker groups: one node group per pool,
    as many nodes as the pool spans, every node of the configured shape."""
    from rlhf_core.workers.worker_set import TRAIN_POOL, pool_plan

    res = cfg.resources
    return [{"name": TRAINING_GROUP if plan.name == TRAIN_POOL else plan.name.replace("_", "-"),  # a DNS label
             "replicas": len(plan.process_on_nodes),
             "gpus": res.gpus_per_node, "cpus": res.cpus_per_node, "memory_gib": res.memory_gib_per_node,
             "object_store_gib": res.object_store_gib_per_node} for plan in pool_plan(cfg)]


def check_pools(cfg, spec: KubeSpec) -> None:
    for pool in pools(cfg):
        if pool["gpus"] > spec.node_gpus:
            raise PoolShapeError(
                f"resources.gpus_per_node={pool['gpus']} but the node type offers kubernetes.node_gpus="
                f"{spec.node_gpus} GPUs; use nodes with more GPUs or more nodes (resources.nnodes) with fewer each")


def _labels(run_id: str, name: str) -> dict:
    return {"app.kubernetes.io/name": "rlhf-core", "app.kubernetes.io/managed-by": "rlhf",
            "rlhf.io/run-id": label_value(run_id), "rlhf.io/cluster": name}


#: /dev/shm beyond a node's object store (NCCL's and torch's shared-memory segments use it too).
SHM_MARGIN_GIB = 1.0


def _quantity_gib(gib: float) -> str:
    return f"{int(round(gib * 1024))}Mi"


def _container(name: str, spec: KubeSpec, cpus: float, memory_gib: float, gpus: int) -> dict:
    limits = {"cpu": str(cpus), "memory": _quantity_gib(memory_gib)}
    if gpus:
        limits[spec.gpu_resource] = str(gpus)
        limits.update({resource: str(count) for resource, count in spec.rdma_resources.items()})
    env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": spec.object_store_secret, "key": key,
                                                          "optional": key not in REQUIRED_SECRET_KEYS}}}
           for key in OBJECT_STORE_KEYS]
    if gpus:
        env.append({"name": "NCCL_DEBUG", "value": spec.nccl_debug})
    capabilities = {"drop": ["ALL"]}
    if gpus and spec.rdma_resources:
        capabilities["add"] = ["IPC_LOCK"]  # RDMA registers (pins) memory: needs the gpu-rdma overlay's namespace
    return {
        "name": name, "image": spec.image, "imagePullPolicy": "IfNotPresent",
        "env": env + [{"name": "RLHF_CACHE", "value": f"{CACHE_DIR}/rlhf-core"}],
        "resources": {"requests": dict(limits), "limits": limits},
        # restricted Pod Security: nothing but the process itself; the root filesystem is
        # read-only and Ray writes to emptyDirs (its temp dir under /tmp, caches, /dev/shm)
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                            "capabilities": capabilities, "readOnlyRootFilesystem": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": CACHE_DIR}],
    }


def _pod_template(container: dict, spec: KubeSpec, labels: dict, shm_gib: float, workers: bool,
                  ray_node: bool = True) -> dict:
    # no pod mounts a token: only the head's autoscaler sidecar talks to the Kubernetes API,
    # and it gets one of its own (_head_token)
    pod = {"serviceAccountName": spec.service_account, "automountServiceAccountToken": False,
           "containers": [container],
           "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           # Ray puts its store in /dev/shm only if that much is free there: a margin for other users
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": _quantity_gib(shm_gib + SHM_MARGIN_GIB)}},
                       {"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]}
    if ray_node:  # the deployment's shared volumes (models, data): on every Ray node, head included
        pod["volumes"] += [{"name": v["name"], "persistentVolumeClaim": {"claimName": v["claim"],
                                                                          "readOnly": v["read_only"]}}
                           for v in spec.volumes]
        container["volumeMounts"] += [{"name": v["name"], "mountPath": v["mount_path"], "readOnly": v["read_only"]}
                                      for v in spec.volumes]
    if workers and spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if workers and spec.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.tolerations]
    if workers and spec.priority_class:
        pod["priorityClassName"] = spec.priority_class
    return {"metadata": {"labels": dict(labels)}, "spec": pod}


def _head_token(template: dict, cluster: str) -> dict:
    """The head runs as the run's own account (head_account.py), whose token is projected
    into a volume that only the autoscaler container mounts (``autoscalerOptions``): the
    head container, where every Jobs-API job runs, holds no Kubernetes credentials."""
    pod = template["spec"]
    pod["serviceAccountName"] = head_account_name(cluster)
    pod["volumes"].append({"name": KUBE_API_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        # 3607 s: what the kubelet asks for its own token volume, so an API server that extends
        # such tokens does so here too (Ray's autoscaler reads the token once, at start)
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}})
    return template


def _submitter_template(spec: KubeSpec, labels: dict) -> dict:
    container = _container("ray-job-submitter", spec, 0.5, 1.0, 0)
    container["env"] = [e for e in container["env"] if "valueFrom" not in e]  # it needs no store keys
    template = _pod_template(container, spec, labels, 0.0625, workers=False, ray_node=False)
    template["spec"]["restartPolicy"] = "Never"
    return template


def autoscaler_nodes_env(groups: list[dict]) -> dict:
    """The head's RLHF_AUTOSCALER_NODES: the nodes KubeRay's autoscaler may start (each worker
    group's Ray resources at its maxReplicas). The session driver runs on the head; its pool
    capacity check counts them, so a cluster scaled to zero still takes the pool."""
    from rlhf_core.controller.resource_pool import AUTOSCALER_NODES_ENV

    nodes = [{"resources": {"CPU": int(g["rayStartParams"]["num-cpus"]),
                            **({"GPU": int(g["rayStartParams"]["num-gpus"])} if int(g["rayStartParams"]["num-gpus"]) else {})},
              "max": g["maxReplicas"]} for g in groups]
    return {"name": AUTOSCALER_NODES_ENV, "value": json.dumps(nodes, sort_keys=True)}


def cluster_spec(cfg, spec: KubeSpec, run_id: str) -> dict:
    """The ``spec`` of a RayCluster (also a RayJob's ``rayClusterSpec``)."""
    check_pools(cfg, spec)
    name = cluster_name(run_id)
    labels = _labels(run_id, name)
    head = _container("ray-head", spec, spec.head_cpus, spec.head_memory_gib, 0)
    head["ports"] = [{"containerPort": GCS_PORT, "name": "gcs-server"},
                     {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                     {"containerPort": CLIENT_PORT, "name": "client"}]
    groups = []
    for pool in pools(cfg):
        worker = _container("ray-worker", spec, pool["cpus"], pool["memory_gib"], pool["gpus"])
        groups.append({
            # minReplicas 0: once the session ends (idle timeout, stop-session) its workers are
            # idle and KubeRay's autoscaler removes their pods; the next session's placement
            # group brings them back (and the launcher restores the count when it reuses the cluster)
            "groupName": pool["name"], "replicas": pool["replicas"], "minReplicas": 0,
            "maxReplicas": pool["replicas"],
            "rayStartParams": {"num-cpus": str(int(pool["cpus"])), "num-gpus": str(pool["gpus"]),
                               "object-store-memory": str(int(pool["object_store_gib"] * GIB))},
            "template": _pod_template(worker, spec, labels, pool["object_store_gib"], workers=True),
        })
    head["env"].append(autoscaler_nodes_env(groups))
    return {
        "rayVersion": spec.ray_version,
        "authOptions": {"mode": "token", "secretName": spec.ray_token_secret},
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"idleTimeoutSeconds": spec.worker_idle_timeout_s,
                              # KubeRay's defaults, written out so that a quota check sees them
                              "resources": {"requests": dict(AUTOSCALER_RESOURCES),
                                            "limits": dict(AUTOSCALER_RESOURCES)},
                              "volumeMounts": [{"name": KUBE_API_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}],
                              "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                                  "allowPrivilegeEscalation": False,
                                                  "capabilities": {"drop": ["ALL"]},
                                                  "seccompProfile": {"type": "RuntimeDefault"}}},
        "headGroupSpec": {
            # no training on the head: num-cpus 0 keeps worker actors off it
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                               "object-store-memory": str(int(spec.head_object_store_gib * GIB))},
            "template": _head_token(_pod_template(head, spec, labels, spec.head_object_store_gib, workers=False),
                                    name),
        },
        "workerGroupSpecs": groups,
    }


def render_raycluster(cfg, spec: KubeSpec, run_id: str) -> dict:
    name = cluster_name(run_id)
    return {"apiVersion": API_VERSION, "kind": "RayCluster",
            "metadata": {"name": name, "namespace": spec.namespace, "labels": _labels(run_id, name)},
            "spec": cluster_spec(cfg, spec, run_id)}


def render_rayjob(cfg, spec: KubeSpec, run_id: str, store: str) -> dict:
    """The cluster with the run's session as its job: created together, gone together."""
    name = cluster_name(run_id)
    runtime_env = {"env_vars": {"RLHF_SESSION_CONFIG": json.dumps(cfg.to_dict(), sort_keys=True)}}
    return {
        "apiVersion": API_VERSION, "kind": "RayJob",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": _labels(run_id, name)},
        "spec": {
            "entrypoint": shlex.join(["rlhf", "serve", "--foreground", "--run-id", run_id, "--store", store]),
            "runtimeEnvYAML": json.dumps(runtime_env),  # JSON is YAML
            # what the controller (session.find_job) looks for through the Jobs API
            "metadata": {"rlhf_run_id": run_id, "kind": "session", "config_hash": cfg.config_hash()},
            # K8sJobMode: a Kubernetes Job submits and follows the session, retried by
            # Kubernetes, with its logs in a pod of its own (KubeRay's default, widely supported)
            "submissionMode": "K8sJobMode",
            # the submitter pod meets the namespace's restricted Pod Security too (KubeRay
            # fills in its command); our labels let the network policy admit it to the head
            "submitterPodTemplate": _submitter_template(spec, _labels(run_id, name)),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": spec.ttl_after_finished_s,
            "activeDeadlineSeconds": spec.session_max_lifetime_s,
            "rayClusterSpec": cluster_spec(cfg, spec, run_id),
        },
    }


def render_head_account(spec: KubeSpec, run_id: str) -> dict:
    """The head's account, Role and RoleBinding as one List, for `kubectl apply` next to
    raycluster.yaml (the launcher creates them itself, owned by the cluster)."""
    name = cluster_name(run_id)
    return {"apiVersion": "v1", "kind": "List", "items": head_account_objects(name, spec.namespace,
                                                                               _labels(run_id, name))}


def run_network_policy(cluster: str, namespace: str, labels: dict, owner_namespace: str | None = None,
                       owner_uid: str | None = None) -> dict:
    """What may reach a run's pods: its own pods (label ``rlhf.io/cluster``, and
    ``rlhf.io/owner-namespace`` when a profile's pipeline owns it), and the head's Ray
    Client and Jobs API ports from ``owner_namespace``. NetworkPolicies add up, so nothing
    in manifests/base admits one run's pods to another's: this policy, one per run, is
    what admits anything. Owned by the cluster (deleted with it) when ``owner_uid`` is
    given. Without an owner (``rlhf manifests``, kubectl): its own pods only."""
    from components.kuberay.names import ingress_policy_name

    ours = {"matchLabels": {"rlhf.io/cluster": cluster}}
    name = f"{cluster}-ingress"
    if owner_namespace:
        ours["matchLabels"]["rlhf.io/owner-namespace"] = owner_namespace
        name = ingress_policy_name(cluster, owner_namespace)
    meta = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": "RayCluster", "name": cluster,
                                    "uid": owner_uid}]
    ingress = [{"from": [{"podSelector": ours}]}]
    if owner_namespace:
        ingress.append({"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                                            owner_namespace}}}],
                        "ports": [{"port": CLIENT_PORT, "protocol": "TCP"}, {"port": DASHBOARD_PORT, "protocol": "TCP"}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": ours, "policyTypes": ["Ingress"], "ingress": ingress}}


def render_all(cfg, spec: KubeSpec, run_id: str, store: str) -> dict[str, dict]:
    """File name -> object, what `rlhf manifests` writes."""
    name = cluster_name(run_id)
    return {"raycluster.yaml": render_raycluster(cfg, spec, run_id),
            "rayjob.yaml": render_rayjob(cfg, spec, run_id, store),
            "head-account.yaml": render_head_account(spec, run_id),
            "network-policy.yaml": run_network_policy(name, spec.namespace, _labels(run_id, name))}
