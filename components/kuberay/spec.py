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
from dataclasses import dataclass, field
from pathlib import Path

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
        for name in ("image", "namespace", "service_account", "object_store_secret", "ray_token_secret"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise DeploySpecError(f"kubernetes.{name}: expected a non-empty name, found {value!r}")
        if not isinstance(self.node_selector, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.node_selector.items()):
            raise DeploySpecError(f"kubernetes.node_selector: expected a map of strings, found {self.node_selector!r}")
        if not isinstance(self.tolerations, list) or not all(isinstance(t, dict) for t in self.tolerations):
            raise DeploySpecError(f"kubernetes.tolerations: expected a list of toleration maps, "
                                  f"found {self.tolerations!r}")
        for name in ("node_gpus", "session_max_lifetime_s", "ttl_after_finished_s", "worker_idle_timeout_s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise DeploySpecError(f"kubernetes.{name}: expected an integer >= 0, found {getattr(self, name)!r}")
        if not isinstance(self.rdma_resources, dict) or not all(
                isinstance(k, str) and "/" in k and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in self.rdma_resources.items()):
            raise DeploySpecError(f"kubernetes.rdma_resources: expected a map of extended resource names "
                                  f"(domain/name) to counts > 0, found {self.rdma_resources!r}")
        if self.nccl_debug not in NCCL_DEBUG_LEVELS:
            raise DeploySpecError(f"kubernetes.nccl_debug: expected one of {list(NCCL_DEBUG_LEVELS)}, "
                                  f"found {self.nccl_debug!r}")
        for name in ("head_cpus", "head_memory_gib", "head_object_store_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise DeploySpecError(f"kubernetes.{name}: expected a number > 0, found {value!r}")
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


#: Volume names and mount paths the rendered pods use themselves (render.py).
RESERVED_VOLUMES = ("dshm", "tmp", "cache", "kube-api-access")
RESERVED_MOUNTS = ("/dev/shm", "/tmp", "/home/rlhf/.cache", "/var/run/secrets")


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
