"""How a run's resource pool lands on Kubernetes: image, namespace, secrets, node types.

These are deployment settings, not training settings (they never change what is trained,
and rlhf_core knows nothing of them). A deployment file holds both: the run config's
sections plus a ``kubernetes:`` section::

    actor: {world_size: 8}
    resources: {nnodes: 1, gpus_per_node: 8, cpus_per_node: 64, memory_gib_per_node: 512}
    kubernetes:
      image: registry.example.com/rlhf-core:0.1.0-cuda
      node_gpus: 8
      node_selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from components.kuberay.names import is_dns1123_label

#: The image built from this repository's Dockerfile (components and Ray nodes share it).
DEFAULT_IMAGE = "ghcr.io/rlhf-core/rlhf-core:0.1.0"
#: Kubernetes secrets (manifests/base/secret-*.example.yaml).
OBJECT_STORE_SECRET = "rlhf-object-store"
RAY_TOKEN_SECRET = "rlhf-ray-token"
#: Ray head ports on a KubeRay cluster (KubeRay's defaults; the head service exposes them).
GCS_PORT, DASHBOARD_PORT, CLIENT_PORT = 6379, 8265, 10001


class DeploySpecError(ValueError):
    """A bad deployment setting; the message names the field, the expectation and the value."""


#: NCCL's log levels (NCCL_DEBUG).
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
#: Memory the head pod needs beside its object store: GCS, dashboard, the Ray Client server
#: and the session driver (the controller), which holds an iteration's batch while it works.
HEAD_PROCESSES_GIB = 6.0


@dataclass
class KubeSpec:
    image: str = DEFAULT_IMAGE              # one image for components and Ray nodes (Dockerfile)
    namespace: str = "rlhf"
    service_account: str = "rlhf-ray"      # Ray workers' account (no API rights; each head gets its own)
    object_store_secret: str = OBJECT_STORE_SECRET  # AWS_* keys for the s3:// store
    ray_token_secret: str = RAY_TOKEN_SECRET        # Ray token auth, key auth_token (shared with the pipeline)
    node_gpus: int = 0                      # GPUs the worker node type offers (0: CPU nodes)
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict = field(default_factory=dict)   # for the worker (training) pods
    tolerations: list = field(default_factory=list)
    priority_class: str = ""                # for the worker pods (manifests/overlays/gpu defines one)
    head_cpus: float = 2.0                  # the head runs the session driver, not training
    head_memory_gib: float = 8.0
    # the head's Ray object store, in its /dev/shm: every batch the controller sends to the
    # workers or gets back passes through it (docs/kubernetes.md sizes it for the examples)
    head_object_store_gib: float = 2.0
    ray_version: str = "2.60.0"
    session_max_lifetime_s: int = 7 * 24 * 3600   # RayJob activeDeadlineSeconds
    ttl_after_finished_s: int = 600               # RayJob: keep the finished cluster for its logs
    worker_idle_timeout_s: int = 300              # GPU worker pods idle this long (no session) are scaled to zero
    # RDMA for NCCL between nodes (InfiniBand, RoCE, EFA): the device plugin's extended
    # resources each training pod asks for, e.g. {"rdma/rdma_shared_device_a": 1} or
    # {"vpc.amazonaws.com/efa": 32}; with any, the training containers add the IPC_LOCK
    # capability (RDMA pins memory), which needs the namespace of manifests/overlays/gpu-rdma
    rdma_resources: dict = field(default_factory=dict)
    nccl_debug: str = "WARN"                # NCCL_DEBUG on GPU pods; INFO on a first run shows the transport
    # PersistentVolumeClaims mounted into the head and worker pods, for models and data kept
    # on shared volumes: [{name, claim, mount_path, read_only (default true)}]; the
    # deployment policy names the claims a run may mount (policy.py)
    volumes: list = field(default_factory=list)

    def validate(self) -> "KubeSpec":
        """Every field typed and bounded, in one line naming the first that is not. What a
        field may *name* (images, accounts, secrets, nodes, claims) is the deployment
        policy's to allow (policy.py); this is what any value must look like."""
        if not isinstance(self.image, str) or len(self.image) > 512 or not _IMAGE.match(self.image):
            raise DeploySpecError(f"kubernetes.image: expected an image reference (registry/repository[:tag]"
                                  f"[@digest]), found {self.image!r:.80}")
        if not is_dns1123_label(self.namespace):
            raise DeploySpecError(f"kubernetes.namespace: expected a namespace name (a DNS-1123 label), "
                                  f"found {self.namespace!r:.80}")
        for name in ("service_account", "object_store_secret", "ray_token_secret", "priority_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or not (_is_dns1123_subdomain(value) or
                                                  (name == "priority_class" and value == "")):
                raise DeploySpecError(f"kubernetes.{name}: expected a Kubernetes object name (a DNS-1123 "
                                      f"subdomain){' or empty' if name == 'priority_class' else ''}, "
                                      f"found {value!r:.80}")
        if not isinstance(self.gpu_resource, str) or not _is_extended_resource(self.gpu_resource):
            raise DeploySpecError(f"kubernetes.gpu_resource: expected an extended resource name (domain/name, "
                                  f"e.g. nvidia.com/gpu; never cpu or memory), found {self.gpu_resource!r:.80}")
        if not isinstance(self.node_selector, dict) or not all(
                isinstance(k, str) and _is_label_key(k) and isinstance(v, str) and _LABEL_VALUE.match(v)
                for k, v in self.node_selector.items()):
            raise DeploySpecError(f"kubernetes.node_selector: expected a map of label keys to label values, "
                                  f"found {self.node_selector!r:.120}")
        if not isinstance(self.tolerations, list):
            raise DeploySpecError(f"kubernetes.tolerations: expected a list of toleration maps, "
                                  f"found {self.tolerations!r:.120}")
        for i, toleration in enumerate(self.tolerations):
            _check_toleration(f"kubernetes.tolerations[{i}]", toleration)
        for name, top in (("node_gpus", MAX_NODE_GPUS), ("session_max_lifetime_s", MAX_LIFETIME_S),
                          ("ttl_after_finished_s", MAX_LIFETIME_S), ("worker_idle_timeout_s", MAX_LIFETIME_S)):
            value = getattr(self, name)
            least = 1 if name == "session_max_lifetime_s" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= top:
                raise DeploySpecError(f"kubernetes.{name}: expected an integer in [{least}, {top}], found {value!r}")
        if not isinstance(self.ray_version, str) or not re.fullmatch(r"\d+\.\d+\.\d+", self.ray_version):
            raise DeploySpecError(f"kubernetes.ray_version: expected a Ray release (X.Y.Z), found {self.ray_version!r}")
        if not isinstance(self.rdma_resources, dict) or not all(
                isinstance(k, str) and "/" in k and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in self.rdma_resources.items()):
            raise DeploySpecError(f"kubernetes.rdma_resources: expected a map of extended resource names "
                                  f"(domain/name) to counts > 0, found {self.rdma_resources!r}")
        if self.nccl_debug not in NCCL_DEBUG_LEVELS:
            raise DeploySpecError(f"kubernetes.nccl_debug: expected one of {list(NCCL_DEBUG_LEVELS)}, "
                                  f"found {self.nccl_debug!r}")
        if self.rdma_resources and self.gpu_resource in self.rdma_resources:
            raise DeploySpecError(f"kubernetes.rdma_resources: expected resources other than gpu_resource "
                                  f"({self.gpu_resource}), found it among them")
        for name, top in (("head_cpus", MAX_HEAD_CPUS), ("head_memory_gib", MAX_HEAD_MEMORY_GIB),
                          ("head_object_store_gib", MAX_HEAD_MEMORY_GIB)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= top:
                raise DeploySpecError(f"kubernetes.{name}: expected a number in (0, {top}], found {value!r}")
        if self.head_memory_gib < self.head_object_store_gib + HEAD_PROCESSES_GIB:
            raise DeploySpecError(f"kubernetes.head_memory_gib: expected at least head_object_store_gib + "
                                  f"{HEAD_PROCESSES_GIB:g} (the store lives in the pod's memory, beside Ray's head "
                                  f"processes and the session driver), found {self.head_memory_gib!r} with "
                                  f"head_object_store_gib {self.head_object_store_gib!r}")
        if not isinstance(self.volumes, list):
            raise DeploySpecError(f"kubernetes.volumes: expected a list of {{name, claim, mount_path, read_only}}, "
                                  f"found {self.volumes!r}")
        self.volumes = [_volume(i, v, self.volumes[:i]) for i, v in enumerate(self.volumes)]
        return self


#: Bounds on what a deployment may ask for: a node type's GPUs, how long a session or a
#: finished cluster may live (KubeRay's activeDeadlineSeconds and TTL), a head pod's size.
MAX_NODE_GPUS = 64
MAX_LIFETIME_S = 30 * 24 * 3600
MAX_HEAD_CPUS = 256
MAX_HEAD_MEMORY_GIB = 2048

_IMAGE = re.compile(r"^([A-Za-z0-9.-]+(:[0-9]{1,5})?/)?[a-z0-9][a-z0-9._/-]*"
                    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def _is_dns1123_subdomain(name: str) -> bool:
    return 0 < len(name) <= 253 and all(is_dns1123_label(part) for part in name.split("."))


def _is_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_NAME.match(name)) and (prefix == "" and "/" not in key or _is_dns1123_subdomain(prefix))


def _is_extended_resource(name: str) -> bool:
    # domain/name outside kubernetes.io (Kubernetes' own resources: cpu, memory, hugepages-*, ...)
    domain, _, short = name.partition("/")
    return _is_dns1123_subdomain(domain) and not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io")) \
        and bool(_LABEL_NAME.match(short)) and "/" not in short


def _check_toleration(where: str, t) -> None:
    if not isinstance(t, dict) or not set(t) <= set(TOLERATION_KEYS):
        raise DeploySpecError(f"{where}: expected a map of {list(TOLERATION_KEYS)}, found {t!r:.120}")
    if t.get("key") not in (None, "") and not (isinstance(t["key"], str) and _is_label_key(t["key"])):
        raise DeploySpecError(f"{where}.key: expected a label key, found {t['key']!r:.80}")
    if t.get("operator", "Equal") not in ("Equal", "Exists"):
        raise DeploySpecError(f"{where}.operator: expected Equal or Exists, found {t['operator']!r:.80}")
    if t.get("value") not in (None, "") and not (isinstance(t["value"], str) and _LABEL_VALUE.match(t["value"])):
        raise DeploySpecError(f"{where}.value: expected a label value, found {t['value']!r:.80}")
    if t.get("effect", "") not in TOLERATION_EFFECTS:
        raise DeploySpecError(f"{where}.effect: expected one of {list(TOLERATION_EFFECTS)}, found {t['effect']!r:.80}")
    seconds = t.get("tolerationSeconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0):
        raise DeploySpecError(f"{where}.tolerationSeconds: expected an integer >= 0, found {seconds!r}")


#: Volume names and mount paths the rendered pods use themselves (render.py), and the
#: image's code and system folders: a claim mounted over the virtualenv (/opt/rlhf) or the
#: app would replace the code the pod runs.
RESERVED_VOLUMES = ("dshm", "tmp", "cache", "kube-api-access")
RESERVED_MOUNTS = ("/dev/shm", "/tmp", "/home/rlhf", "/var/run/secrets", "/opt/rlhf", "/app",
                   "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", "/run", "/var/run",
                   "/root", "/boot")


def _volume(index: int, v, before: list) -> dict:
    """One ``kubernetes.volumes`` entry, checked and with its default filled in."""
    import posixpath

    where = f"kubernetes.volumes[{index}]"
    if not isinstance(v, dict) or set(v) - {"name", "claim", "mount_path", "read_only"} or \
            not {"name", "claim", "mount_path"} <= set(v):
        raise DeploySpecError(f"{where}: expected {{name, claim, mount_path, read_only}}, found {v!r}")
    from components.kuberay.names import is_dns1035_label

    name, claim, path = v["name"], v["claim"], v["mount_path"]
    if not isinstance(name, str) or not is_dns1035_label(name) or name in RESERVED_VOLUMES \
            or name in [b["name"] for b in before]:
        raise DeploySpecError(f"{where}.name: expected a DNS label unused by the pod (not {list(RESERVED_VOLUMES)} "
                              f"or an earlier volume), found {name!r}")
    if not isinstance(claim, str) or not claim.strip() or len(claim) > 253:
        raise DeploySpecError(f"{where}.claim: expected a PersistentVolumeClaim name, found {claim!r}")
    if not isinstance(path, str) or not path.startswith("/") or posixpath.normpath(path) != path.rstrip("/") \
            or path == "/":
        raise DeploySpecError(f"{where}.mount_path: expected an absolute, normalized path, found {path!r}")
    taken = list(RESERVED_MOUNTS) + [b["mount_path"] for b in before]
    clash = next((t for t in taken if path == t or path.startswith(t + "/") or t.startswith(path + "/")), None)
    if clash:
        raise DeploySpecError(f"{where}.mount_path: expected a path apart from the pod's other mounts, found {path!r} "
                              f"overlapping {clash}")
    read_only = v.get("read_only", True)
    if not isinstance(read_only, bool):
        raise DeploySpecError(f"{where}.read_only: expected true or false, found {read_only!r}")
    return {"name": name, "claim": claim, "mount_path": path.rstrip("/"), "read_only": read_only}


def spec_from_dict(data: dict | None) -> KubeSpec:
    data = dict(data or {})
    known = {f.name for f in dataclasses.fields(KubeSpec)}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=2, cutoff=0.5)
            raise DeploySpecError(f"unknown setting kubernetes.{key}"
                                  + (f"; did you mean {', '.join('kubernetes.' + c for c in close)}?" if close else ""))
    return KubeSpec(**data).validate()


def load_deployment(path: str | Path | None, overrides: list[str] = ()):
    """(RunConfig, KubeSpec) from a deployment file (None: the defaults) and overrides."""
    import yaml

    from rlhf_core.config import RunConfig, apply_overrides, config_from_dict

    data = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise DeploySpecError(f"{path}: expected a mapping of config sections, found {type(data).__name__}")
    spec = spec_from_dict(data.pop("kubernetes", None))
    cfg = apply_overrides(config_from_dict(data, RunConfig()), list(overrides)).validate()
    return cfg, spec
