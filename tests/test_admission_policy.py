"""The admission policies the API server enforces (manifests/base/admission-policy.yaml),
evaluated with cel-python against the objects the launcher really creates and against
what a pod running as rlhf-pipeline could send instead. No API server runs here: this
checks the CEL and the policy's logic (matchConstraints, matchConditions, variables,
validations), not the API server's type checks against the KubeRay CRD schema."""

import copy
from pathlib import Path

import celpy
import pytest

import kustomize_lite
from components.kuberay.head_account import head_account_objects
from components.kuberay.launcher import with_owner
from components.kuberay.policy import DeploymentPolicy
from components.kuberay.render import render_raycluster
from components.kuberay.spec import load_deployment

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_A = "system:serviceaccount:team-a:rlhf-pipeline"
PIPELINE_B = "system:serviceaccount:team-b:rlhf-pipeline"
RESOURCES = {"RayCluster": ("ray.io", "rayclusters"), "Role": ("rbac.authorization.k8s.io", "roles"),
             "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"), "ServiceAccount": ("", "serviceaccounts"),
             "Secret": ("", "secrets"), "NetworkPolicy": ("networking.k8s.io", "networkpolicies")}


def _objects(overlay="gpu"):
    return kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay)


def _policies() -> dict:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == "ValidatingAdmissionPolicy"}


_env = celpy.Environment()


def _eval(expression: str, activation: dict):
    return _env.program(_env.compile(expression)).evaluate(activation)


def admit(operation: str, username: str, obj: dict | None, old: dict | None = None) -> list[str]:
    """The messages of every validation that refuses the request, over every policy that
    matches it ([] when admitted), as the API server would evaluate them."""
    kind = (obj or old)["kind"]
    group, resource = RESOURCES[kind]
    request = {"operation": operation, "userInfo": {"username": username},
               "resource": {"group": group, "version": "v1", "resource": resource}}
    refused = []
    for policy in _policies().values():
        spec = policy["spec"]
        if not any(group in rule["apiGroups"] and resource in rule["resources"] and operation in rule["operations"]
                   for rule in spec["matchConstraints"]["resourceRules"]):
            continue
        base = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(obj),
                "oldObject": celpy.json_to_cel(old)}
        if not all(_eval(c["expression"], base) for c in spec.get("matchConditions", [])):
            continue
        variables = {}
        for variable in spec.get("variables", []):
            activation = {**base, "variables": celpy.json_to_cel({})}
            activation["variables"] = celpy.celtypes.MapType(
                {celpy.celtypes.StringType(k): v for k, v in variables.items()})
            variables[variable["name"]] = _eval(variable["expression"], activation)
        activation = {**base, "variables": celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()})}
        for validation in spec["validations"]:
            outcome = _eval(validation["expression"], activation)
            assert isinstance(outcome, celpy.celtypes.BoolType), (validation["expression"], outcome)
            if not outcome:
                refused.append(validation["message"])
    return refused


def cluster(config="gpu.yaml", owner="team-a", run_id="nightly") -> dict:
    cfg, spec = load_deployment(ROOT / "manifests" / "configs" / config)
    return with_owner(render_raycluster(cfg, spec, run_id), owner, "kfp-run-1")


CONFIGS = sorted(p.name for p in (ROOT / "manifests" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS)
def test_what_the_launcher_creates_is_admitted(config):
    body = cluster(config)
    assert admit("CREATE", PIPELINE_A, body) == []
    for obj in head_account_objects(body["metadata"]["name"], "rlhf", body["metadata"]["labels"], owner_uid="u"):
        assert admit("CREATE", PIPELINE_A, obj) == [], obj["kind"]
    scaled = copy.deepcopy(body)  # the launcher scales workers back up; the autoscaler scales them down
    scaled["spec"]["workerGroupSpecs"][0]["replicas"] = 0
    assert admit("UPDATE", PIPELINE_A, scaled, body) == []
    head = f"system:serviceaccount:rlhf:{body['metadata']['name']}-head"
    scaled["spec"]["workerGroupSpecs"][0]["scaleStrategy"] = {"workersToDelete": ["w-1"]}
    assert admit("UPDATE", head, scaled, body) == []
    assert admit("DELETE", PIPELINE_A, None, body) == []


def _pod(body, group=None):
    return (body["spec"]["workerGroupSpecs"][group]["template"]["spec"] if group is not None
            else body["spec"]["headGroupSpec"]["template"]["spec"])


def _template(body, group=None):
    return (body["spec"]["workerGroupSpecs"][group]["template"] if group is not None
            else body["spec"]["headGroupSpec"]["template"])


def _changed(change):
    body = cluster()
    change(body)
    return body


REFUSED_CREATES = {
    "another image": lambda b: _pod(b, 0)["containers"][0].update(image="docker.io/attacker/miner:latest"),
    "an image tag with a path": lambda b: _pod(b)["containers"][0].update(
        image="ghcr.io/rlhf-core/rlhf-core:0.1/../x"),
    "an init container's image": lambda b: _pod(b, 0).update(
        initContainers=[{"name": "x", "image": "docker.io/attacker/x:1"}]),
    "another worker account": lambda b: _pod(b, 0).update(serviceAccountName="default"),
    "another head account": lambda b: _pod(b).update(serviceAccountName="rlhf-other-head"),
    "a mounted token": lambda b: _pod(b, 0).update(automountServiceAccountToken=True),
    "the host network": lambda b: _pod(b, 0).update(hostNetwork=True),
    "another secret": lambda b: _pod(b, 0)["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "team-b-creds", "key": "k"}}}),
    "a secret as envFrom": lambda b: _pod(b, 0)["containers"][0].update(envFrom=[{"secretRef": {"name": "x"}}]),
    "a secret volume": lambda b: _pod(b, 0)["volumes"].append({"name": "s", "secret": {"secretName": "x"}}),
    "a hostPath": lambda b: _pod(b, 0)["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "another claim": lambda b: _pod(b, 0)["volumes"].append(
        {"name": "c", "persistentVolumeClaim": {"claimName": "team-b-data", "readOnly": True}}),
    "a claim writable": lambda b: _pod(b, 0)["volumes"].append(
        {"name": "c", "persistentVolumeClaim": {"claimName": "rlhf-models"}}),
    "another Ray token": lambda b: b["spec"]["authOptions"].update(secretName="other-run-token"),
    "the shared Ray token": lambda b: b["spec"]["authOptions"].update(secretName="rlhf-ray-token"),
    "no Ray token": lambda b: b["spec"].pop("authOptions"),
    "a priority class": lambda b: _pod(b, 0).update(priorityClassName="system-node-critical"),
    "a node selector": lambda b: _pod(b, 0).update(nodeSelector={"node-role.kubernetes.io/control-plane": ""}),
    "a toleration": lambda b: _pod(b, 0)["tolerations"].append({"operator": "Exists"}),
    "a node name": lambda b: _pod(b, 0).update(nodeName="control-plane-1"),
    "another profile's label": lambda b: b.update(cluster(owner="team-b")),  # all of it team-b's, sent by team-a
    "pods labelled as another run's": lambda b: _template(b, 0)["metadata"]["labels"].update(
        {"rlhf.io/cluster": "rlhf-weekly"}),
    "pods labelled as another profile's": lambda b: _template(b)["metadata"]["labels"].update(
        {"rlhf.io/owner-namespace": "team-b"}),
    "no owner label": lambda b: b["metadata"]["labels"].pop("rlhf.io/owner-namespace"),
}


#: The word of the one validation that refuses each case.
REFUSED_BY = {"image": "image", "account": "account", "token": "token", "network": "network", "secret": "secret",
              "hostPath": "volumes", "claim": "volumes", "Ray token": "Ray token", "priority": "priority class",
              "selector": "node selectors", "toleration": "tolerations", "node name": "node, runtime",
              "label": "owner-namespace", "secret volume": "volumes", "labelled as": "whose it is"}


@pytest.mark.parametrize("case", sorted(REFUSED_CREATES))
def test_what_a_pipeline_pod_could_send_instead_is_refused(case):
    refused = admit("CREATE", PIPELINE_A, _changed(REFUSED_CREATES[case]))
    word = next(REFUSED_BY[k] for k in sorted(REFUSED_BY, key=len, reverse=True) if k in case)
    assert len(refused) == 1 and word in refused[0], (case, refused)


#: Fields beyond the pod templates, each valid under KubeRay 1.7's CRD, with the word of the
#: one validation that refuses it: the policy allow-lists what the renderer writes.
_SECRET_ENV = {"name": "T", "valueFrom": {"secretKeyRef": {"name": "rlhf-other.team-b.ray-token", "key": "auth_token"}}}
REFUSED_FIELDS = {
    "autoscaler image": (lambda b: b["spec"]["autoscalerOptions"].update(image="docker.io/attacker/x:1"),
                         "autoscaler runs as KubeRay"),
    "autoscaler env from a secret": (lambda b: b["spec"]["autoscalerOptions"].update(env=[_SECRET_ENV]),
                                     "autoscaler runs as KubeRay"),
    "autoscaler envFrom": (lambda b: b["spec"]["autoscalerOptions"].update(
        envFrom=[{"secretRef": {"name": "rlhf-other.team-b.ray-token"}}]), "autoscaler runs as KubeRay"),
    "autoscaler command": (lambda b: b["spec"]["autoscalerOptions"].update(command=["sh", "-c", "x"]),
                           "autoscaler runs as KubeRay"),
    "autoscaler token writable": (lambda b: b["spec"]["autoscalerOptions"]["volumeMounts"][0].update(readOnly=False),
                                  "autoscaler runs as KubeRay"),
    "autoscaler mounts a claim": (lambda b: b["spec"]["autoscalerOptions"]["volumeMounts"].append(
        {"name": "models", "mountPath": "/m", "readOnly": True}), "autoscaler runs as KubeRay"),
    "redis password from another's token": (lambda b: b["spec"].update(gcsFaultToleranceOptions={
        "redisAddress": "redis:6379", "redisPassword": {"valueFrom": _SECRET_ENV["valueFrom"]}}), "spec holds only"),
    "history server collector": (lambda b: b["spec"].update(historyServerOptions={
        "collectorOptions": {"image": "docker.io/attacker/x:1", "env": [_SECRET_ENV]}}), "spec holds only"),
    "egress to the metadata server": (lambda b: b["spec"].update(networkPolicy={
        "egress": [{"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}]}), "spec holds only"),
    "a load balancer": (lambda b: b["spec"]["headGroupSpec"].update(headService={
        "spec": {"type": "LoadBalancer", "externalIPs": ["203.0.113.9"]}}), "head group, worker groups"),
    "an ingress": (lambda b: b["spec"]["headGroupSpec"].update(enableIngress=True), "head group, worker groups"),
    "a service type": (lambda b: b["spec"]["headGroupSpec"].update(serviceType="NodePort"),
                       "head group, worker groups"),
    "a worker group suspended": (lambda b: b["spec"]["workerGroupSpecs"][0].update(suspend=True),
                                 "head group, worker groups"),
    "a container command": (lambda b: _pod(b, 0)["containers"][0].update(command=["sh", "-c", "curl x | sh"]),
                            "head group, worker groups"),
    "pod annotations": (lambda b: _template(b, 0)["metadata"].update(annotations={"x": "y"}),
                        "head group, worker groups"),
    "a pod's share of the process namespace": (lambda b: _pod(b, 0).update(shareProcessNamespace=True),
                                               "head group, worker groups"),
    "the ray container mounts the head's token": (lambda b: _pod(b)["containers"][0]["volumeMounts"].append(
        {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}),
        "mounts only its pod's"),
    "a mount of no volume": (lambda b: _pod(b, 0)["containers"][0]["volumeMounts"].append(
        {"name": "nothing", "mountPath": "/x"}), "mounts only its pod's"),
    "free-text start params": (lambda b: b["spec"]["workerGroupSpecs"][0]["rayStartParams"].update(
        {"num-cpus": "8 --runtime-env-agent-port=1"}), "rayStartParams"),
    "another start param": (lambda b: b["spec"]["headGroupSpec"]["rayStartParams"].update(
        {"redis-password": "x"}), "rayStartParams"),
    "a dashboard on another host": (lambda b: b["spec"]["headGroupSpec"]["rayStartParams"].update(
        {"dashboard-host": "203.0.113.9"}), "rayStartParams"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_FIELDS))
def test_every_field_beyond_what_the_launcher_writes_is_refused(case):
    change, word = REFUSED_FIELDS[case]
    refused = admit("CREATE", PIPELINE_A, _changed(change))
    assert len(refused) == 1 and word in refused[0], (case, refused)


def test_an_update_adds_no_field():
    body = cluster()
    for change in (lambda b: b["spec"].update(networkPolicy={"egress": [{}]}),
                   lambda b: b["spec"]["workerGroupSpecs"][0].update(suspend=True),
                   lambda b: b["spec"]["workerGroupSpecs"][0].update(scaleStrategy={"x": 1})):
        changed = copy.deepcopy(body)
        change(changed)
        assert admit("UPDATE", PIPELINE_A, changed, body), change


def test_only_the_owning_profile_changes_or_deletes_a_cluster_and_only_its_replica_counts():
    body = cluster()
    assert admit("DELETE", PIPELINE_B, None, body) == [
        "a RayCluster is created, changed or deleted only by the pipeline of the profile its "
        "rlhf.io/owner-namespace label names"]
    scaled = copy.deepcopy(body)
    scaled["spec"]["workerGroupSpecs"][0]["replicas"] = 2
    assert admit("UPDATE", PIPELINE_B, scaled, body)
    for change in (lambda b: _pod(b, 0)["containers"][0].update(image="ghcr.io/rlhf-core/rlhf-core:other"),
                   lambda b: _pod(b).update(serviceAccountName="x"),
                   lambda b: b["metadata"]["labels"].update({"rlhf.io/owner-namespace": "team-b"}),
                   lambda b: b["spec"].update(suspend=True),
                   lambda b: b["spec"]["workerGroupSpecs"][0].update(maxReplicas=64),
                   lambda b: b["spec"]["workerGroupSpecs"].append(copy.deepcopy(b["spec"]["workerGroupSpecs"][0]))):
        changed = copy.deepcopy(body)
        change(changed)
        assert "an update changes worker replica counts only (and which workers to delete)" in \
            admit("UPDATE", PIPELINE_A, changed, body)
    other_head = "system:serviceaccount:rlhf:rlhf-other-head"
    assert "a head's account may update its own RayCluster only" in admit("UPDATE", other_head, scaled, body)
    assert "a cluster's head may only update its RayCluster" in admit(
        "CREATE", f"system:serviceaccount:rlhf:{body['metadata']['name']}-head", body)
    # a person (a platform admin) is not what these policies constrain
    assert admit("UPDATE", "admin@example.com", _changed(lambda b: b["spec"].update(suspend=True)), body) == []


def test_the_pipeline_creates_a_heads_account_objects_and_nothing_broader():
    body = cluster()
    role, binding, account = head_account_objects(body["metadata"]["name"], "rlhf", body["metadata"]["labels"])
    wider = copy.deepcopy(role)
    wider["rules"][1]["resourceNames"] = ["rlhf-someone-else"]
    everything = copy.deepcopy(role)
    everything["rules"].append({"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["delete"]})
    to_me = copy.deepcopy(binding)
    to_me["subjects"] = [{"kind": "ServiceAccount", "name": "rlhf-pipeline", "namespace": "team-a"}]
    pipeline_role = copy.deepcopy(binding)
    pipeline_role["roleRef"]["name"] = "rlhf-pipeline"
    cluster_role = copy.deepcopy(binding)
    cluster_role["roleRef"]["kind"] = "ClusterRole"
    other_account = copy.deepcopy(account)
    other_account["metadata"]["name"] = "rlhf-ray"
    pull_secrets = copy.deepcopy(account)  # an account handed another profile's secret
    pull_secrets["imagePullSecrets"] = [{"name": "rlhf-other.team-b.ray-token"}]
    token_mounted = copy.deepcopy(account)
    token_mounted["automountServiceAccountToken"] = True
    for obj in (wider, everything, to_me, pipeline_role, cluster_role, other_account, pull_secrets, token_mounted):
        assert admit("CREATE", PIPELINE_A, obj), obj
    assert admit("UPDATE", PIPELINE_A, binding, binding)  # created once, never changed


def _token_secret(owner="team-a", cluster_name="rlhf-nightly") -> dict:
    """The Ray token secret the launcher writes (read back from the fake API server)."""
    from fake_kube_api import FakeKubeAPI

    from components.kuberay.launcher import Launcher, kube_apis

    with FakeKubeAPI() as fake:
        custom, core = kube_apis(host=fake.url)
        Launcher(custom, core, "rlhf")._create_secret("rlhf", f"{cluster_name}.{owner}.ray-token", "t" * 64,
                                                      {"rlhf.io/owner-namespace": owner})
        return fake.objects[("secrets", "rlhf", f"{cluster_name}.{owner}.ray-token")]


def test_a_pipeline_creates_and_deletes_its_own_runs_ray_token_secrets_only():
    secret = _token_secret()
    assert admit("CREATE", PIPELINE_A, secret) == [] and admit("DELETE", PIPELINE_A, None, secret) == []
    owner_rule = ("a Ray token secret is created or deleted only by the pipeline of the profile its "
                  "rlhf.io/owner-namespace label names")
    assert admit("CREATE", PIPELINE_B, secret) == [owner_rule]  # squatting another profile's run
    assert admit("DELETE", PIPELINE_B, None, secret) == [owner_rule]  # replacing another profile's token
    owned = copy.deepcopy(secret)  # the launcher's one change: the cluster, once created, owns it
    owned["metadata"]["ownerReferences"] = [{"apiVersion": "ray.io/v1", "kind": "RayCluster",
                                             "name": "rlhf-nightly", "uid": "u"}]
    assert admit("UPDATE", PIPELINE_A, owned, secret) == []
    assert admit("UPDATE", PIPELINE_B, owned, secret) == [owner_rule]
    only_owner = "a pipeline changes a run's Ray token secret only to make it owned by its RayCluster"
    for change in (lambda s: s["data"].update(auth_token="b3RoZXI="),  # another token
                   lambda s: s["metadata"]["ownerReferences"][0].update(name="rlhf-weekly"),
                   lambda s: s["metadata"]["labels"].update({"x": "y"}),
                   lambda s: s["metadata"].pop("ownerReferences")):
        changed = copy.deepcopy(owned)
        change(changed)
        assert admit("UPDATE", PIPELINE_A, changed, secret) == [only_owner]
    refused = {
        "the object-store secret": lambda s: s["metadata"].update(name="rlhf-object-store"),
        "a name of another shape": lambda s: s["metadata"].update(name="team-b-creds-ray-token-x"),
        "another profile's name": lambda s: s["metadata"].update(name="rlhf-nightly.team-b.ray-token"),
        "a second key": lambda s: s["data"].update(AWS_SECRET_ACCESS_KEY="eA=="),
        "stringData": lambda s: s.update(stringData={"x": "y"}),
        "a service-account token": lambda s: s.update(type="kubernetes.io/service-account-token"),
    }
    for case, change in refused.items():
        changed = copy.deepcopy(secret)
        change(changed)
        assert len(admit("CREATE", PIPELINE_A, changed)) == 1, case
    other = copy.deepcopy(secret)  # a platform admin's own secret, no owner label: not the pipeline's to delete
    other["metadata"] = {"name": "rlhf-object-store"}
    assert len(admit("DELETE", PIPELINE_A, None, other)) == 2
    assert admit("DELETE", "admin@example.com", None, other) == []


def test_a_pipeline_creates_its_runs_ingress_policy_in_one_shape_only():
    from components.kuberay.render import run_network_policy

    body = cluster()
    policy = run_network_policy(body["metadata"]["name"], "rlhf", body["metadata"]["labels"],
                                owner_namespace="team-a", owner_uid="u")
    assert admit("CREATE", PIPELINE_A, policy) == []
    assert len(admit("CREATE", PIPELINE_B, policy)) == 1  # another profile's run
    assert len(admit("UPDATE", PIPELINE_A, policy, policy)) == 1 and len(admit("DELETE", PIPELINE_A, None, policy)) == 1
    peer = lambda p, i: p["spec"]["ingress"][i]["from"][0]
    refused = {
        "every pod of the namespace": lambda p: p["spec"].update(podSelector={}),
        "another run's pods admitted": lambda p: peer(p, 0)["podSelector"]["matchLabels"].update(
            {"rlhf.io/cluster": "rlhf-other"}),
        "any pod admitted": lambda p: peer(p, 0).update(podSelector={}),
        "another profile admitted": lambda p: peer(p, 1)["namespaceSelector"]["matchLabels"].update(
            {"kubernetes.io/metadata.name": "team-b"}),
        "every namespace admitted": lambda p: peer(p, 1).update(namespaceSelector={}),
        "an address block": lambda p: p["spec"]["ingress"][1]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "another port": lambda p: p["spec"]["ingress"][1]["ports"].append({"port": 6379, "protocol": "TCP"}),
        "a port range": lambda p: p["spec"]["ingress"][1]["ports"][1].update(endPort=65535),
        "another owner's pods selected": lambda p: p["spec"]["podSelector"]["matchLabels"].update(
            {"rlhf.io/owner-namespace": "team-b"}),
        "pods of the cluster whoever owns them": lambda p: p["spec"]["podSelector"]["matchLabels"].pop(
            "rlhf.io/owner-namespace"),
        "every port": lambda p: p["spec"]["ingress"][1].pop("ports"),
        "an egress rule": lambda p: p["spec"].update(policyTypes=["Ingress", "Egress"], egress=[{}]),
        "another name": lambda p: p["metadata"].update(name="rlhf-default-deny"),
        "no owner": lambda p: p["metadata"].pop("ownerReferences"),
    }
    for case, change in refused.items():
        changed = copy.deepcopy(policy)
        change(changed)
        assert admit("CREATE", PIPELINE_A, changed), case


def test_the_admission_policy_allows_what_the_deployment_policy_allows():
    """The allow-lists are written twice (CEL cannot read the ConfigMap's YAML): they must
    say the same for every overlay's deployment policy the admission policy serves."""
    import re

    variables = {v["name"]: v["expression"] for v in _policies()["rlhf-rayclusters"]["spec"]["variables"]}
    as_list = lambda name: list(_eval(variables[name], {}))  # noqa: E731 - literals only
    for overlay in ("gpu", "cpu-dev", "gpu-rdma"):
        text = next(o for o in _objects(overlay) if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"] == "rlhf-deployment-policy")["data"]["policy.yaml"]
        policy = DeploymentPolicy.from_yaml(text, namespace="rlhf")
        patterns = ["^" + re.escape(r[:-1]).replace(r"\.", "[.]").replace(r"\-", "-").replace(r"\/", "/")
                    + "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$" if r.endswith(":*") else "^" + re.escape(r) + "$"
                    for r in policy.images]
        assert as_list("images") == patterns, overlay
        assert as_list("workerAccounts") == list(policy.service_accounts)
        assert as_list("objectStoreSecrets") == list(policy.object_store_secrets)
        assert as_list("priorityClasses") == list(policy.priority_classes)
        assert as_list("nodeLabels") == list(policy.node_selectors)
        assert [dict(t) for t in as_list("tolerations")] == list(policy.tolerations)
        assert as_list("claims") == list(policy.volume_claims)
        assert as_list("writableClaims") == list(policy.writable_volume_claims)


def test_the_policies_bind_to_every_ray_namespace_and_deny():
    for overlay in ("gpu", "cpu-dev", "gpu-rdma"):
        objects = _objects(overlay)
        namespace = next(o for o in objects if o["kind"] == "Namespace")
        bindings = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
        assert {b["spec"]["policyName"] for b in bindings} == set(_policies())
        for binding in bindings:
            assert binding["spec"]["validationActions"] == ["Deny"]
            assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"].items() <= \
                namespace["metadata"]["labels"].items(), overlay
    assert all(p["spec"]["failurePolicy"] == "Fail" for p in _policies().values())
