"""What a run's ``kube_spec`` may choose: the deployment policy.

``kube_spec`` is a run parameter, set by whoever starts a run. Everything in it that reaches
past the run (the image, the account and the secrets its pods use, its namespace, which
nodes it may land on and whom it may preempt) must be among what the platform team allowed.
The policy is the ConfigMap ``rlhf-deployment-policy`` in the Ray namespace itself
(manifests/base/deployment-policy.yaml), read through the Kubernetes API when a cluster is
launched: profile users can edit their own namespace, not that one, and a namespace the
platform did not set up holds no policy the pipeline may read, so it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from components.kuberay.spec import (
    DEFAULT_IMAGE, OBJECT_STORE_SECRET, RAY_TOKEN_SECRET, DeploySpecError, KubeSpec,
)

POLICY_CONFIG_MAP = "rlhf-deployment-policy"
POLICY_KEY = "policy.yaml"


@dataclass(frozen=True)
class DeploymentPolicy:
    """One Ray namespace's allow-lists. Images are exact references or ``repo:*`` (any tag
    of one repository); node selectors are ``key=value`` or ``key=*`` (any value of the
    key); a toleration must equal one listed; a volume's claim must be listed, among the
    writable ones when it is mounted writable. An empty priority class and an empty node
    selector are always allowed: they ask for nothing."""

    namespace: str
    images: tuple = (DEFAULT_IMAGE,)
    service_accounts: tuple = ("rlhf-ray",)
    object_store_secrets: tuple = (OBJECT_STORE_SECRET,)
    ray_token_secrets: tuple = (RAY_TOKEN_SECRET,)
    priority_classes: tuple = ()
    node_selectors: tuple = ()
    tolerations: tuple = field(default=())
    volume_claims: tuple = ()            # PVCs a run may mount read-only (kubernetes.volumes)
    writable_volume_claims: tuple = ()   # PVCs a run may also mount writable
    rdma_resources: tuple = ()           # extended resources a run may ask for RDMA (kubernetes.rdma_resources)
    gpu_resources: tuple = ("nvidia.com/gpu",)  # what kubernetes.gpu_resource may name

    @classmethod
    def from_yaml(cls, text: str, namespace: str, source: str = POLICY_KEY) -> "DeploymentPolicy":
        import yaml

        data = yaml.safe_load(text or "")
        if not isinstance(data, dict):
            raise DeploySpecError(f"{source}: expected a mapping of allow-lists, found {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"namespace"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DeploySpecError(f"{source}: unknown key(s) {unknown}; expected some of {sorted(known)}")
        values = {}
        for key, items in data.items():
            kind = dict if key == "tolerations" else str
            if not isinstance(items, list) or not all(isinstance(i, kind) for i in items):
                raise DeploySpecError(f"{source}: {key}: expected a list of {kind.__name__}s, found {items!r}")
            values[key] = tuple(_toleration(i) if kind is dict else i for i in items)
        return cls(namespace=namespace, **values)

    def image_allowed(self, image: str) -> bool:
        return any(image == rule or (rule.endswith(":*") and image.startswith(rule[:-1])
                                     and "/" not in image[len(rule) - 1:] and "@" not in image[len(rule) - 1:])
                   for rule in self.images)

    def check(self, spec: KubeSpec) -> KubeSpec:
        """The spec unchanged, or DeploySpecError naming the first field the policy refuses."""
        def refuse(name, what, allowed, found):
            raise DeploySpecError(f"kubernetes.{name}: expected one of the deployment's allowed {what} "
                                  f"{list(allowed)}; found {found!r}")

        if spec.namespace != self.namespace:
            refuse("namespace", "namespaces", [self.namespace], spec.namespace)
        if not self.image_allowed(spec.image):
            refuse("image", "images", self.images, spec.image)
        for name, what, allowed in (("service_account", "accounts", self.service_accounts),
                                    ("object_store_secret", "secrets", self.object_store_secrets),
                                    ("ray_token_secret", "secrets", self.ray_token_secrets)):
            if getattr(spec, name) not in allowed:
                refuse(name, what, allowed, getattr(spec, name))
        if spec.priority_class and spec.priority_class not in self.priority_classes:
            refuse("priority_class", "priority classes", self.priority_classes, spec.priority_class)
        for key, value in spec.node_selector.items():
            if f"{key}={value}" not in self.node_selectors and f"{key}=*" not in self.node_selectors:
                refuse("node_selector", "node labels", self.node_selectors, f"{key}={value}")
        for toleration in spec.tolerations:
            if _toleration(toleration) not in self.tolerations:
                refuse("tolerations", "tolerations", self.tolerations, toleration)
        for volume in spec.volumes:
            if volume["read_only"] and volume["claim"] not in self.volume_claims + self.writable_volume_claims:
                refuse("volumes", "claims", self.volume_claims + self.writable_volume_claims, volume["claim"])
            if not volume["read_only"] and volume["claim"] not in self.writable_volume_claims:
                refuse("volumes", "writable claims (read_only: false)", self.writable_volume_claims,
                       volume["claim"])
        if spec.gpu_resource not in self.gpu_resources:
            refuse("gpu_resource", "GPU resources", self.gpu_resources, spec.gpu_resource)
        for resource in spec.rdma_resources:
            if resource not in self.rdma_resources:
                refuse("rdma_resources", "RDMA resources", self.rdma_resources, resource)
        return spec


def _toleration(t: dict) -> dict:
    # the API server's defaults, so that {key: k, effect: e} and the same with
    # operator: Equal are one toleration
    out = {k: v for k, v in t.items() if v not in (None, "")}
    out.setdefault("operator", "Equal")
    return out
