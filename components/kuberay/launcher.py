"""Create (or reuse) a run's RayCluster, wait until it is ready, tear it down by policy.

Talks to the Kubernetes API through the official client (CustomObjectsApi for ray.io
objects; CoreV1Api for the deployment policy, the head's account, and the pods and events
that explain a cluster that does not come up; RbacAuthorizationV1Api for the head's Role);
never shells out to kubectl. The pipeline's service account needs exactly the Role in
manifests/base/role.yaml (tests/test_manifests.py records every call and checks it).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from components.kuberay.head_account import head_account_objects
from components.kuberay.policy import POLICY_CONFIG_MAP, POLICY_KEY, DeploymentPolicy
from components.kuberay.spec import CLIENT_PORT, DASHBOARD_PORT, DeploySpecError

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
POLICIES = ("keep", "delete", "delete-on-success")


class ClusterLaunchError(RuntimeError):
    """The cluster did not come up; the message carries pod phases and events."""


#: Labels that say who created a RayCluster: the namespace of the pipeline pod that created
#: it (the Kubeflow profile, from the downward API, not from any run parameter) and its
#: KFP run. Only a launch from the same profile reuses the cluster, and only its teardown
#: deletes it.
OWNER_NAMESPACE_LABEL = "rlhf.io/owner-namespace"
CREATED_BY_RUN_LABEL = "rlhf.io/created-by-kfp-run"
#: The pipeline sets it from the pod's metadata.namespace (kfp-kubernetes field path).
POD_NAMESPACE_ENV = "RLHF_POD_NAMESPACE"
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def check_cluster_policy(policy) -> str:
    """``policy`` when it is one of POLICIES; else a one-line ValueError. Checked where a
    run starts (submission, the driver, the cluster's launch), not first at teardown."""
    if policy not in POLICIES:
        raise ValueError(f"cluster_policy: expected one of {list(POLICIES)}, found {policy!r}")
    return policy


def pod_namespace() -> str:
    """The namespace this pipeline pod runs in (its Kubeflow profile): the downward API's
    value the pipeline puts in RLHF_POD_NAMESPACE, else the service account's namespace
    file. Refused when neither says: a cluster's owner is never guessed."""
    import os

    from components.kuberay.names import is_dns1123_label

    found = os.environ.get(POD_NAMESPACE_ENV, "").strip()
    if not found:
        try:
            with open(_SERVICE_ACCOUNT_NAMESPACE) as f:
                found = f.read().strip()
        except OSError:
            found = ""
    if not is_dns1123_label(found):
        raise ClusterLaunchError(f"{POD_NAMESPACE_ENV}: expected the namespace this pipeline pod runs in (the "
                                 f"downward API's metadata.namespace); found {found!r}")
    return found


def with_owner(body: dict, owner_namespace: str, kfp_run_id: str) -> dict:
    """``body`` (a rendered RayCluster) labelled with who creates it, and authenticated by
    a Ray token of its own (``ray_token_secret_name``; ``Launcher.ensure`` makes the
    secret): a run's reward function sees its token, and with one token for every run it
    could submit jobs to any other run's cluster."""
    from components.kuberay.names import label_value, ray_token_secret_name

    labels = {**body["metadata"]["labels"], OWNER_NAMESPACE_LABEL: owner_namespace,
              CREATED_BY_RUN_LABEL: label_value(kfp_run_id or "unknown")}
    auth = {"mode": "token", "secretName": ray_token_secret_name(body["metadata"]["name"], owner_namespace)}
    spec = copy.deepcopy(body["spec"])
    # every pod says whose it is: the run's ingress policy admits only pods of its cluster and owner
    for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec.get("workerGroupSpecs", []))]:
        template.setdefault("metadata", {}).setdefault("labels", {})[OWNER_NAMESPACE_LABEL] = owner_namespace
    return {**body, "metadata": {**body["metadata"], "labels": labels}, "spec": {**spec, "authOptions": auth}}


@dataclass
class ClusterAddress:
    name: str
    namespace: str
    ray_address: str      # ray://host:10001 (Ray Client: a controller pod is not a Ray node)
    dashboard_url: str    # the Ray Jobs API
    reused: bool


def kube_apis(host: str | None = None):
    """(CustomObjectsApi, CoreV1Api): in-cluster credentials in a pod, else kubeconfig;
    ``host`` points the client at a given API server (tests use a fake one)."""
    from kubernetes import client, config

    if host is not None:
        configuration = client.Configuration()
        configuration.host = host
        api = client.ApiClient(configuration)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.ApiClient()
    return client.CustomObjectsApi(api), client.CoreV1Api(api)


class Launcher:
    def __init__(self, custom_api, core_api, namespace: str, poll_s: float = 5.0, log=print) -> None:
        from kubernetes import client

        self.custom, self.core, self.namespace = custom_api, core_api, namespace
        self.rbac = client.RbacAuthorizationV1Api(core_api.api_client)
        self.networking = client.NetworkingV1Api(core_api.api_client)
        self.poll_s, self.log = poll_s, log

    def policy(self) -> DeploymentPolicy:
        """The deployment policy of this namespace. Only a namespace set up from manifests/
        holds one the pipeline may read (its Role grants that one ConfigMap, by name), so any
        other namespace a run asks for is refused here, before anything is created."""
        from kubernetes.client.exceptions import ApiException

        try:
            config_map = self.core.read_namespaced_config_map(POLICY_CONFIG_MAP, self.namespace)
        except ApiException as exc:
            if exc.status not in (403, 404):
                raise
            raise DeploySpecError(f"kubernetes.namespace: expected a namespace set up for rlhf runs (one whose "
                                  f"ConfigMap {POLICY_CONFIG_MAP} this pipeline may read); found "
                                  f"{self.namespace!r} ({exc.status} {exc.reason})") from None
        text = (config_map.data or {}).get(POLICY_KEY)
        if text is None:
            raise DeploySpecError(f"ConfigMap {self.namespace}/{POLICY_CONFIG_MAP}: expected the key {POLICY_KEY}, "
                                  f"found {sorted(config_map.data or {})}")
        return DeploymentPolicy.from_yaml(text, self.namespace, f"{self.namespace}/{POLICY_CONFIG_MAP}")

    # ------------------------------------------------------------------ reading

    def get(self, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def address(self, cluster: dict, reused: bool) -> ClusterAddress:
        name = cluster["metadata"]["name"]
        service = ((cluster.get("status") or {}).get("head") or {}).get("serviceName") or f"{name}-head-svc"
        host = f"{service}.{self.namespace}.svc.cluster.local"
        return ClusterAddress(name, self.namespace, f"ray://{host}:{CLIENT_PORT}", f"http://{host}:{DASHBOARD_PORT}",
                              reused)

    # ---------------------------------------------------------------- launching

    def ensure(self, body: dict, timeout_s: float = 900.0) -> ClusterAddress:
        """Reuse the run's cluster when it exists (it hosts the run's long-lived session),
        otherwise create it, after its own Ray token (``ensure_run_token``); then wait until
        KubeRay reports it ready with the worker pods the run's pools need."""
        from kubernetes.client.exceptions import ApiException

        name = body["metadata"]["name"]
        existing = self.get(name)
        if existing is not None:
            problem = self.not_ours(existing, body["metadata"]["labels"])
            if problem:
                raise ClusterLaunchError(f"RayCluster {self.namespace}/{name} exists but {problem}; it is not "
                                         f"reused: choose another run id")
            self.log(f"reusing RayCluster {self.namespace}/{name}")
            self.ensure_run_token(body, reused=True)
            self.restore_workers(existing, body)
            created = existing
        else:
            self.ensure_run_token(body, reused=False)
            try:
                created = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
                self.log(f"created RayCluster {self.namespace}/{name}")
            except ApiException as exc:
                if exc.status != 409:  # 409: a concurrent trigger created it first; reuse it
                    raise ClusterLaunchError(f"creating RayCluster {self.namespace}/{name} failed: "
                                             f"{exc.status} {exc.reason}: {exc.body}") from None
                created = self.get(name)
                problem = self.not_ours(created, body["metadata"]["labels"]) if created is not None else None
                if problem:  # created meanwhile, but not by this run's profile: nothing of ours goes to it
                    raise ClusterLaunchError(f"RayCluster {self.namespace}/{name} was created meanwhile but "
                                             f"{problem}; it is not reused: choose another run id")
        if created is not None:  # (None: deleted meanwhile; wait_ready says so)
            # also when reused: a launch that died between the cluster and its account left none
            self.ensure_head_account(created, body["metadata"]["labels"])
            self.ensure_network_policy(created, body["metadata"]["labels"])
            if existing is None:
                self.own_run_token(created)
        workers = sum(int(g["replicas"]) for g in body["spec"]["workerGroupSpecs"])
        return self.wait_ready(name, timeout_s, reused=existing is not None, workers=workers)

    # --------------------------------------------------------- the run's Ray token

    def ensure_run_token(self, body: dict, reused: bool) -> str | None:
        """The Secret ``body``'s Ray token comes from, in the profile namespace (where the
        pipeline's controllers read it) and, for a new cluster, in the Ray namespace (its
        pods). The profile's copy is the source: made once with a fresh random token, read
        back when it is there (a launch that died half way, or two launching at once, end
        with one token). The Ray copy is written before the cluster exists, so no pod of
        it ever starts with a token someone else chose: one found there is deleted and
        written again, which the admission policy allows only to its own profile (another
        profile's is refused in one line, nothing created). None when ``body`` names no
        run token (the shared secret of ``kube_spec.ray_token_secret``)."""
        import secrets

        from components.kuberay.names import ray_token_secret_name

        name = body["metadata"]["name"]
        owner = body["metadata"]["labels"].get(OWNER_NAMESPACE_LABEL)
        secret = ray_token_secret_name(name, owner) if owner else None
        if secret is None or (body["spec"].get("authOptions") or {}).get("secretName") != secret:
            return None
        token = self._read_token(owner, secret)
        if reused:
            if token is None:
                raise ClusterLaunchError(
                    f"RayCluster {self.namespace}/{name} exists but its Ray token secret {owner}/{secret} is gone, so "
                    f"the controllers cannot connect to it; delete the cluster (cluster_policy=delete, or kubectl "
                    f"delete raycluster {name} -n {self.namespace}) and launch again for a new one")
            return secret
        labels = {k: v for k, v in body["metadata"]["labels"].items()}
        if token is None:
            token = secrets.token_hex(32)
            if not self._create_secret(owner, secret, token, labels):  # another launch of this run was first
                token = self._read_token(owner, secret)
        if not self._create_secret(self.namespace, secret, token, labels):
            # a launch of this run that died half way, or one running now: the name carries the
            # owner, so no other profile can have made it (the admission policy)
            self._delete_secret(self.namespace, secret, name)
            self._create_secret(self.namespace, secret, token, labels)  # (409 again: an equal launch's, same token)
        return secret

    def own_run_token(self, cluster: dict) -> None:
        """The Ray namespace's token secret made owned by its cluster (written before the
        cluster existed, so without an owner), so that it goes when the cluster goes, however
        the cluster goes. Teardown deletes it too; a failure here is logged, not fatal."""
        from kubernetes.client.exceptions import ApiException

        from components.kuberay.names import ray_token_secret_name

        name = cluster["metadata"]["name"]
        owner_namespace = (cluster["metadata"].get("labels") or {}).get(OWNER_NAMESPACE_LABEL)
        secret = ray_token_secret_name(name, owner_namespace) if owner_namespace else None
        if secret is None or (cluster["spec"].get("authOptions") or {}).get("secretName") != secret:
            return
        owner = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": name, "uid": cluster["metadata"]["uid"]}
        try:
            self.core.patch_namespaced_secret(secret, self.namespace, {"metadata": {"ownerReferences": [owner]}})
        except ApiException as exc:
            self.log(f"Secret {self.namespace}/{secret}: not made owned by RayCluster {name} "
                     f"({exc.status} {exc.reason}); teardown deletes it, a cluster deleted by hand leaves it")

    def _read_token(self, namespace: str, secret: str) -> str | None:
        import base64

        from kubernetes.client.exceptions import ApiException

        try:
            found = self.core.read_namespaced_secret(secret, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise ClusterLaunchError(f"reading Secret {namespace}/{secret} failed: {exc.status} {exc.reason}") from None
        value = (found.data or {}).get("auth_token")
        if not value:
            raise ClusterLaunchError(f"Secret {namespace}/{secret}: expected the key auth_token; found "
                                     f"{sorted(found.data or {})}")
        return base64.b64decode(value).decode()

    def _create_secret(self, namespace: str, secret: str, token: str, labels: dict) -> bool:
        """Whether it was created (False: one of that name exists)."""
        import base64

        from kubernetes.client.exceptions import ApiException

        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": secret, "labels": labels},
                "data": {"auth_token": base64.b64encode(token.encode()).decode()}}
        try:
            self.core.create_namespaced_secret(namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise ClusterLaunchError(f"creating Secret {namespace}/{secret} failed: {exc.status} {exc.reason}"
                                     ) from None
        return True

    def _delete_secret(self, namespace: str, secret: str, cluster: str) -> bool:
        """Whether one was deleted; refused (403, the admission policy: another profile's
        secret) in one line."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_secret(secret, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise ClusterLaunchError(
                f"Secret {namespace}/{secret} (the Ray token of RayCluster {cluster}) exists and could not be "
                f"replaced: {exc.status} {exc.reason} (another profile's run of that name?); nothing was created: "
                f"choose another run id") from None
        return True

    @staticmethod
    def not_ours(cluster: dict, labels: dict) -> str | None:
        """Why ``cluster`` is not the one a launch labelled ``labels`` may reuse or tear
        down (another run id, or created from another profile), or None."""
        found = cluster["metadata"].get("labels") or {}
        for key, what in (("rlhf.io/run-id", "run"), (OWNER_NAMESPACE_LABEL, "profile namespace")):
            if key in labels and found.get(key) != labels[key]:
                return f"belongs to {what} {found.get(key)!r}, not {labels[key]!r}"
        return None

    def ensure_head_account(self, cluster: dict, labels: dict) -> None:
        """The head's own account, Role and RoleBinding (head_account.py), owned by the
        cluster so that they go when it goes; those that exist already are left alone."""
        from kubernetes.client.exceptions import ApiException

        name = cluster["metadata"]["name"]
        create = {"Role": self.rbac.create_namespaced_role, "RoleBinding": self.rbac.create_namespaced_role_binding,
                  "ServiceAccount": self.core.create_namespaced_service_account}
        for obj in head_account_objects(name, self.namespace, labels, owner_uid=cluster["metadata"].get("uid")):
            try:
                create[obj["kind"]](self.namespace, obj)
            except ApiException as exc:
                if exc.status != 409:
                    raise ClusterLaunchError(f"creating {obj['kind']} {self.namespace}/{obj['metadata']['name']} "
                                             f"for the head of RayCluster {name} failed: {exc.status} {exc.reason}"
                                             ) from None

    def ensure_network_policy(self, cluster: dict, labels: dict) -> None:
        """The run's own ingress policy (render.run_network_policy: its pods, and the head's
        client ports from the owner's profile namespace), owned by the cluster; kept when it
        exists. Only for a cluster a profile's pipeline owns (labelled with it)."""
        from kubernetes.client.exceptions import ApiException

        from components.kuberay.render import run_network_policy

        owner = labels.get(OWNER_NAMESPACE_LABEL)
        if owner is None:
            return
        name = cluster["metadata"]["name"]
        policy = run_network_policy(name, self.namespace, labels, owner_namespace=owner,
                                    owner_uid=cluster["metadata"].get("uid"))
        try:
            self.networking.create_namespaced_network_policy(self.namespace, policy)
        except ApiException as exc:
            if exc.status != 409:
                raise ClusterLaunchError(f"creating NetworkPolicy {self.namespace}/{policy['metadata']['name']} for "
                                         f"RayCluster {name} failed: {exc.status} {exc.reason}") from None

    def restore_workers(self, existing: dict, body: dict) -> list[str]:
        """Worker groups the autoscaler scaled down while the run had no session (its GPU
        pods released) get their pool's size back, so the session about to start does not
        wait for a scale-up one node at a time. Returns the groups changed."""
        wanted = {g["groupName"]: g["replicas"] for g in body["spec"]["workerGroupSpecs"]}
        groups = [dict(g) for g in existing["spec"].get("workerGroupSpecs", [])]
        changed = []
        for group in groups:
            want = wanted.get(group["groupName"])
            if want is not None and int(group.get("replicas", 0)) < want:
                group["replicas"] = want
                changed.append(group["groupName"])
        if changed:
            self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                       existing["metadata"]["name"],
                                                       {"spec": {"workerGroupSpecs": groups}})
            self.log(f"RayCluster {existing['metadata']['name']}: worker group(s) {changed} scaled back up")
        return changed

    def wait_ready(self, name: str, timeout_s: float, reused: bool = False, workers: int = 0) -> ClusterAddress:
        """Wait for state ``ready`` and ``workers`` ready worker pods. KubeRay's state stays
        ``ready`` once reached, also after the autoscaler removed every worker pod, so a
        reused cluster whose workers were just scaled back up is ready only when
        ``status.readyWorkerReplicas`` (worker pods running and ready, all groups) says so."""
        deadline = time.monotonic() + timeout_s
        last_state, last_workers = None, None
        while True:
            cluster = self.get(name)
            if cluster is None:
                raise ClusterLaunchError(f"RayCluster {self.namespace}/{name} disappeared while waiting for it")
            status = cluster.get("status") or {}
            state = status.get("state")
            if state != last_state:
                self.log(f"RayCluster {name}: {state or 'pending'}")
                last_state = state
            ready_workers = int(status.get("readyWorkerReplicas") or 0)  # omitted when 0
            if state == "ready" and ready_workers >= workers:
                return self.address(cluster, reused)
            if state == "ready" and ready_workers != last_workers:
                self.log(f"RayCluster {name}: {ready_workers}/{workers} worker pods ready")
                last_workers = ready_workers
            if state == "failed":
                raise ClusterLaunchError(f"RayCluster {self.namespace}/{name} failed: {status.get('reason', '')}\n"
                                         + self.explain(name))
            if time.monotonic() >= deadline:
                waiting = f", {ready_workers} of {workers} worker pods ready" if state == "ready" else ""
                raise ClusterLaunchError(f"RayCluster {self.namespace}/{name} not ready after {timeout_s:.0f}s "
                                         f"(state {state or 'pending'}{waiting})\n" + self.explain(name))
            time.sleep(self.poll_s)

    def explain(self, name: str) -> str:
        """Pod phases, waiting reasons and recent events of the cluster's pods."""
        lines = []
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"ray.io/cluster={name}").items
        if not pods:
            lines.append("  no pods yet (is the KubeRay operator running and watching this namespace?)")
        for pod in pods:
            waiting = [f"{c.name}: {c.state.waiting.reason}" for c in (pod.status.container_statuses or [])
                       if c.state and c.state.waiting]
            lines.append(f"  pod {pod.metadata.name}: {pod.status.phase}" + (f" ({'; '.join(waiting)})" if waiting else ""))
        for obj in [name] + [p.metadata.name for p in pods]:
            events = self.core.list_namespaced_event(self.namespace,
                                                     field_selector=f"involvedObject.name={obj}").items
            for event in events[-5:]:
                lines.append(f"  event {obj}: {event.type} {event.reason}: {event.message}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- teardown

    def teardown(self, name: str, policy: str, succeeded: bool, labels: dict) -> str:
        """Apply the run's policy: keep (the session lives on for the next iteration),
        delete, or delete-on-success (keep a failed run's cluster to debug it). Only a
        cluster whose labels match ``labels`` (this run id, this profile) is deleted, and
        only the object that was checked (a precondition on its uid)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        from components.kuberay.names import ray_token_secret_name

        check_cluster_policy(policy)
        if policy == "keep" or (policy == "delete-on-success" and not succeeded):
            return "kept"
        cluster = self.get(name)
        if cluster is None:
            return "already gone"
        problem = self.not_ours(cluster, labels)
        if problem:
            self.log(f"RayCluster {self.namespace}/{name} {problem}: left alone")
            return "not this run's: left alone"
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=cluster["metadata"].get("uid"))))
        except ApiException as exc:
            if exc.status == 404:
                return "already gone"
            if exc.status == 409:  # another cluster of that name replaced the one checked
                return "replaced meanwhile: left alone"
            raise
        secret = ((cluster.get("spec") or {}).get("authOptions") or {}).get("secretName")
        if secret == ray_token_secret_name(name, labels[OWNER_NAMESPACE_LABEL]):  # its own token: no use without it
            for namespace in dict.fromkeys((self.namespace, labels[OWNER_NAMESPACE_LABEL])):
                try:
                    self._delete_secret(namespace, secret, name)
                except ClusterLaunchError as exc:  # the cluster is gone; its token's copy is left, and said so
                    self.log(f"RayCluster {name} deleted; its token secret was not: {exc}")
        return "deleted"
