"""Each run's head pod gets its own service account and the least rights its autoscaler needs.

KubeRay's in-tree autoscaler (a sidecar of the head pod) scales the worker groups by
patching the RayCluster. The operator binds a Role named after the cluster to the head
group's account, creating one granting pods get/list/watch/patch and rayclusters get/patch
in the whole namespace unless a Role of that name exists already. So the launcher creates,
for each cluster, the account ``<cluster>-head`` and a Role and RoleBinding named after the
cluster: rayclusters get/patch limited to this cluster by name (resourceNames), pods only
read (Ray's KubeRay node provider lists its pods by label and patches only the RayCluster;
a list cannot be limited by name). They carry an ownerReference to the RayCluster, so
Kubernetes' garbage collector deletes them with it. The token is mounted in the autoscaler
container only (render.py), never in the container that runs Jobs-API jobs.
"""

from __future__ import annotations

from components.kuberay.names import head_account_name

def autoscaler_rules(cluster: str) -> list[dict]:
    """What Ray's autoscaler does through the Kubernetes API (ray.autoscaler's KubeRay node
    provider): list and read its cluster's pods, read and patch its own RayCluster."""
    return [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "resourceNames": [cluster],
             "verbs": ["get", "patch"]}]


def head_account_objects(cluster: str, namespace: str, labels: dict, owner_uid: str | None = None) -> list[dict]:
    """Role, RoleBinding and ServiceAccount of the cluster's head, in the order they must be
    created: the account last, because the operator (seeing the head's account) creates its
    own namespace-wide Role only while none of the cluster's name exists, and it waits for
    the account before it does anything."""
    meta = {"name": cluster, "namespace": namespace, "labels": dict(labels)}
    if owner_uid:
        # no blockOwnerDeletion: setting it needs rights on rayclusters/finalizers, and
        # nothing needs the cluster's deletion to wait for these
        meta["ownerReferences"] = [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": cluster,
                                    "uid": owner_uid}]
    account = head_account_name(cluster)
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": autoscaler_rules(cluster)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": cluster},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
        # the pod's automount stays off (render.py): a projected token goes to the autoscaler only
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta, name=account),
         "automountServiceAccountToken": False},
    ]
