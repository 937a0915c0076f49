"""KubeRay objects rendered from run configs: their structure, names, resources and pod
security everywhere; validated against the real KubeRay v1.7.0 CRD schemas where
``$RLHF_KUBERAY_CRDS`` names them (CI sets it; conftest's ``kuberay_crds``): the example
configs, a property-based sweep of pool shapes and run ids, and bad input refused before
anything is written or sent."""

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]

from components.kuberay import crd
from components.kuberay.names import KubeNameError, cluster_name, is_dns1035_label
from components.kuberay.render import PoolShapeError, render_all, render_rayjob
from components.kuberay.spec import DeploySpecError, KubeSpec, load_deployment
from rlhf_core.cli import main
from rlhf_core.config import RunConfig, apply_overrides

CONFIGS = sorted((ROOT / "manifests" / "configs").glob("*.yaml"))
VOLUME = {"name": "models", "claim": "team-models", "mount_path": "/models"}


def render_example(path: Path) -> dict:
    return render_all(*load_deployment(path), "nightly-ppo", "s3://bucket/runs")


def render_own_pools() -> dict:
    """A critic and a reward model each on a pool of its own."""
    cfg = apply_overrides(RunConfig(), ["algorithm.adv_estimator=gae", "actor.world_size=16", "resources.nnodes=2",
                                        "resources.gpus_per_node=8", "critic.world_size=8",
                                        "resources.critic_nnodes=1", "reward_model.enable=true",
                                        "reward_model.model.path=/models/rm", "reward_model.enable_resource_pool=true",
                                        "reward_model.n_gpus_per_node=4", "reward_model.nnodes=1"]).validate()
    return render_all(cfg, KubeSpec(node_gpus=8).validate(), "ppo-7b", "s3://b/runs")


def render_with_volumes() -> dict:
    spec = KubeSpec(node_gpus=8, volumes=[VOLUME, {"name": "scratch", "claim": "team-scratch",
                                                   "mount_path": "/scratch", "read_only": False}]).validate()
    cfg = apply_overrides(RunConfig(), ["actor.world_size=16", "resources.nnodes=2", "resources.gpus_per_node=8"])
    return render_all(cfg.validate(), spec, "ppo-7b", "s3://b/runs")


#: Every fixed set of objects the tests below render, for the one test that checks them
#: against KubeRay's schemas.
RENDERED = {**{f"example-{p.stem}": (lambda p=p: render_example(p)) for p in CONFIGS},
            "own-pools": render_own_pools, "volumes": render_with_volumes}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_example_configs_render_valid_objects(path):
    cfg, spec = load_deployment(path)
    objects = render_example(path)
    validate_core_kinds(objects)
    cluster, job = objects["raycluster.yaml"], objects["rayjob.yaml"]
    group = cluster["spec"]["workerGroupSpecs"][0]
    assert group["replicas"] == cfg.resources.nnodes
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu", "0") == str(cfg.resources.gpus_per_node)
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["metadata"]["kind"] == "session"
    assert job["spec"]["entrypoint"].startswith("rlhf serve --foreground --run-id nightly-ppo")


def validate_core_kinds(objects: dict) -> None:
    """The head's account and RBAC against Kubernetes' own schema (shipped with
    kubernetes-validate: no CRD needed)."""
    import kubernetes_validate

    lists = [obj for obj in objects.values() if obj["kind"] == "List"]
    assert len(lists) == 1
    assert [o["kind"] for o in lists[0]["items"]] == ["Role", "RoleBinding", "ServiceAccount"]
    policies = [obj for obj in objects.values() if obj["kind"] == "NetworkPolicy"]  # the run's own ingress
    assert len(policies) == 1
    for item in [*lists[0]["items"], *policies]:
        kubernetes_validate.validate(item, kubernetes_validate.latest_version(), strict=True)


#: What `rlhf manifests` renders that Kubernetes' own schema checks (validate_core_kinds), not KubeRay's.
CORE_KINDS = ("List", "NetworkPolicy")


def validate_kuberay_kinds(objects: dict, crds: Path) -> None:
    kinds = [obj["kind"] for obj in objects.values() if obj["kind"] not in CORE_KINDS]
    assert sorted(kinds) == ["RayCluster", "RayJob"], kinds
    for obj in objects.values():
        if obj["kind"] not in CORE_KINDS:
            crd.validate(obj, crds)


@pytest.mark.parametrize("name", RENDERED)
def test_rendered_objects_fit_kuberays_crds(name, kuberay_crds):
    validate_kuberay_kinds(RENDERED[name](), kuberay_crds)


def test_the_validator_is_strict(kuberay_crds):
    cfg, spec = load_deployment(None)
    good = render_all(cfg, spec, "demo", "s3://b/r")["raycluster.yaml"]
    crd.validate(good, kuberay_crds)
    typo = copy.deepcopy(good)
    typo["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(crd.SchemaViolation, match=r"spec.workerGroupSpecs.0: .*'replica' was unexpected"):
        crd.validate(typo, kuberay_crds)
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "2"
    with pytest.raises(crd.SchemaViolation, match=r"spec.workerGroupSpecs.0.replicas: '2' is not of type 'integer'"):
        crd.validate(wrong_type, kuberay_crds)
    start_params = copy.deepcopy(good)
    start_params["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    with pytest.raises(crd.SchemaViolation, match="rayStartParams.num-cpus"):
        crd.validate(start_params, kuberay_crds)


run_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True)


def render_pool_shape(nnodes, gpus, cpus, memory, store_fraction, run_id) -> dict:
    cfg = apply_overrides(RunConfig(), [f"resources.nnodes={nnodes}", f"resources.gpus_per_node={gpus}",
                                        f"resources.cpus_per_node={cpus}", f"resources.memory_gib_per_node={memory}",
                                        f"resources.object_store_gib_per_node={memory * store_fraction}",
                                        "trainer.cpus_per_worker=1", f"actor.world_size={nnodes}"]).validate()
    spec = KubeSpec(node_gpus=8, node_selector={"pool": "train"},
                    tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]).validate()
    return render_all(cfg, spec, run_id, "s3://b/runs")


pool_shapes = dict(nnodes=st.integers(1, 64), gpus=st.integers(0, 8), cpus=st.integers(1, 256),
                   memory=st.integers(2, 2048), store_fraction=st.floats(0.05, 0.9),
                   run_id=run_ids.filter(lambda s: any(c.isalnum() for c in s)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**pool_shapes)
def test_every_pool_shape_and_run_id_renders_valid_objects(nnodes, gpus, cpus, memory, store_fraction, run_id):
    objects = render_pool_shape(nnodes, gpus, cpus, memory, store_fraction, run_id)
    validate_core_kinds(objects)
    for obj in (objects["raycluster.yaml"], objects["rayjob.yaml"]):
        assert is_dns1035_label(obj["metadata"]["name"], limit=40)
    for item in objects["head-account.yaml"]["items"]:
        assert is_dns1035_label(item["metadata"]["name"], limit=45)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**pool_shapes)
def test_every_pool_shape_and_run_id_fits_kuberays_crds(kuberay_crds, nnodes, gpus, cpus, memory, store_fraction,
                                                         run_id):
    validate_kuberay_kinds(render_pool_shape(nnodes, gpus, cpus, memory, store_fraction, run_id), kuberay_crds)


@given(a=run_ids, b=run_ids)
@settings(max_examples=200, deadline=None)
def test_different_run_ids_never_share_a_cluster(a, b):
    if a != b:
        assert cluster_name(a) != cluster_name(b)


def test_cluster_names_are_decided_at_run_time_and_stay_readable():
    assert cluster_name("nightly") == "rlhf-nightly"  # valid ids are kept as they are
    assert cluster_name("Qwen_7B.ppo").startswith("rlhf-qwen-7b-ppo-")
    assert cluster_name("A_b") != cluster_name("a-b")
    assert len(cluster_name("x" * 128)) <= 40
    for bad in ("///", "dev run", "../x", "x" * 300, "é"):  # not run ids at all: refused, one line
        with pytest.raises(KubeNameError, match="run id: expected 1-128 ASCII letters"):
            cluster_name(bad)


def test_bad_deployments_are_refused_with_the_field(tmp_path):
    cfg = apply_overrides(RunConfig(), ["resources.gpus_per_node=8", "actor.world_size=8"]).validate()
    with pytest.raises(PoolShapeError, match="resources.gpus_per_node=8 but the node type offers kubernetes.node_gpus=4"):
        render_rayjob(cfg, KubeSpec(node_gpus=4), "r", "s3://b/r")
    with pytest.raises(DeploySpecError, match="kubernetes.object_store_secret: expected a Kubernetes object name .*, "
                                              "found ''"):
        KubeSpec(object_store_secret="").validate()
    bad = tmp_path / "deploy.yaml"
    bad.write_text(yaml.safe_dump({"kubernetes": {"node_gpu": 8}}))
    with pytest.raises(DeploySpecError, match="unknown setting kubernetes.node_gpu; did you mean kubernetes.node_gpus"):
        load_deployment(bad)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="node type offers"):
        main(["manifests", "--config", str(ROOT / "manifests/configs/gpu.yaml"), "--out", str(out),
              "resources.gpus_per_node=16", "actor.world_size=16"])
    assert not out.exists()  # nothing written


def test_rlhf_manifests_writes_validated_yaml_when_given_the_crds(tmp_path, kuberay_crds):
    assert main(["manifests", "--config", str(ROOT / "manifests/configs/cpu-dev.yaml"), "--run-id", "Dev_Run",
                 "--out", str(tmp_path), "--crds", str(kuberay_crds)]) == 0
    assert yaml.safe_load((tmp_path / "raycluster.yaml").read_text())["kind"] == "RayCluster"
    bad = tmp_path / "crds"  # a RayCluster schema that wants a field we never set: the command refuses
    bad.mkdir()
    for name in crd.CRD_FILES.values():
        schema = yaml.safe_load((kuberay_crds / name).read_text())
        if name == crd.CRD_FILES["RayCluster"]:
            for version in schema["spec"]["versions"]:
                version["schema"]["openAPIV3Schema"]["properties"]["spec"].setdefault("required", []).append(
                    "noSuchField")
        (bad / name).write_text(yaml.safe_dump(schema))
    with pytest.raises(SystemExit, match="noSuchField"):
        main(["manifests", "--config", str(ROOT / "manifests/configs/cpu-dev.yaml"), "--out", str(tmp_path / "o"),
              "--crds", str(bad)])
    assert not (tmp_path / "o").exists()  # nothing written


def test_rlhf_manifests_writes_the_yaml(tmp_path, capsys):
    assert main(["manifests", "--config", str(ROOT / "manifests/configs/cpu-dev.yaml"), "--run-id", "Dev_Run",
                 "--out", str(tmp_path)]) == 0
    account = yaml.safe_load((tmp_path / "head-account.yaml").read_text())
    assert account["items"][2] == {"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": False,
                                   "metadata": {**account["items"][2]["metadata"], "name": cluster_name("Dev_Run")
                                                + "-head"}}
    cluster = yaml.safe_load((tmp_path / "raycluster.yaml").read_text())
    job = yaml.safe_load((tmp_path / "rayjob.yaml").read_text())
    assert cluster["metadata"]["name"] == job["metadata"]["name"] == cluster_name("Dev_Run")
    assert cluster["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    assert "RayCluster rlhf-dev/" in capsys.readouterr().out  # the cpu-dev overlay's namespace


def _pod_templates(obj):
    spec = obj["spec"].get("rayClusterSpec", obj["spec"])
    yield spec["headGroupSpec"]["template"]
    for group in spec["workerGroupSpecs"]:
        yield group["template"]
    if "submitterPodTemplate" in obj["spec"]:
        yield obj["spec"]["submitterPodTemplate"]


def test_every_ray_pod_meets_restricted_pod_security():
    """Non-root, no capabilities, RuntimeDefault seccomp, read-only root filesystem with
    writable emptyDirs where Ray writes, no service-account token mounted."""
    cfg, kube = load_deployment(ROOT / "manifests/configs/gpu.yaml")
    for obj in render_all(cfg, kube, "hardened", "s3://b/runs").values():
        if obj["kind"] in ("List", "NetworkPolicy"):
            continue
        templates = list(_pod_templates(obj))
        assert len(templates) == (3 if obj["kind"] == "RayJob" else 2)
        for template in templates:
            pod = template["spec"]
            assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == \
                {"type": "RuntimeDefault"}
            assert pod["automountServiceAccountToken"] is False
            for container in pod["containers"]:
                sc = container["securityContext"]
                assert sc["capabilities"] == {"drop": ["ALL"]} and sc["readOnlyRootFilesystem"] is True
                assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert {"/tmp", "/dev/shm", "/home/rlhf/.cache"} <= mounts
                volumes = {v["name"]: v for v in pod["volumes"]}
                # writable: emptyDirs only; the deployment's shared volumes are mounted read-only
                assert all("emptyDir" in volumes[m["name"]] or (m["readOnly"] and volumes[m["name"]][
                    "persistentVolumeClaim"]["readOnly"]) for m in container["volumeMounts"])


def test_each_run_head_has_its_own_account_and_only_the_autoscaler_holds_its_token():
    """The container that runs every Jobs-API job holds no Kubernetes credentials; the
    autoscaler sidecar (which KubeRay adds from autoscalerOptions) mounts the head's token;
    two runs' heads never share an account; workers keep the deployment's account."""
    cfg, kube = load_deployment(ROOT / "manifests/configs/gpu.yaml")
    heads = {}
    for run_id in ("run-a", "run-b"):
        spec = render_all(cfg, kube, run_id, "s3://b/runs")["raycluster.yaml"]["spec"]
        head = spec["headGroupSpec"]["template"]["spec"]
        heads[run_id] = head["serviceAccountName"]
        assert head["serviceAccountName"] == cluster_name(run_id) + "-head"
        assert head["automountServiceAccountToken"] is False
        (token,) = [v for v in head["volumes"] if "projected" in v]
        assert [s for s in token["projected"]["sources"] if "serviceAccountToken" in s]
        assert spec["autoscalerOptions"]["volumeMounts"] == [
            {"name": token["name"], "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}]
        assert all(m["name"] != token["name"] for c in head["containers"] for m in c["volumeMounts"])
        for group in spec["workerGroupSpecs"]:
            assert group["template"]["spec"]["serviceAccountName"] == kube.service_account
    assert heads["run-a"] != heads["run-b"]


def test_the_policy_decides_every_choice_that_reaches_past_the_run():
    from components.kuberay.policy import DeploymentPolicy

    policy = DeploymentPolicy.from_yaml(yaml.safe_dump({
        "images": ["registry.example.com/rlhf-core:*", "ghcr.io/rlhf-core/rlhf-core:0.1.0"],
        "node_selectors": ["pool=train", "nvidia.com/gpu.product=*"], "priority_classes": ["rlhf-training"],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "dedicated", "value": "rlhf", "effect": "NoSchedule"}]}), namespace="rlhf")
    policy.check(KubeSpec(image="registry.example.com/rlhf-core:0.2.0-cuda"))
    policy.check(KubeSpec(node_selector={"pool": "train", "nvidia.com/gpu.product": "H100"},
                          priority_class="rlhf-training",
                          tolerations=[{"key": "dedicated", "operator": "Equal", "value": "rlhf",
                                        "effect": "NoSchedule"}]))
    refused = [
        (KubeSpec(image="registry.example.com/rlhf-core:0.2/../../x"), "kubernetes.image"),
        (KubeSpec(image="registry.example.com/rlhf-core-evil:1"), "kubernetes.image"),
        (KubeSpec(image="registry.example.com/rlhf-core@sha256:abc"), "kubernetes.image"),
        (KubeSpec(namespace="kube-system"), "kubernetes.namespace: expected one of .* \\['rlhf'\\]"),
        (KubeSpec(object_store_secret="team-b-s3-creds"), "kubernetes.object_store_secret"),
        (KubeSpec(ray_token_secret="other-run-token"), "kubernetes.ray_token_secret"),
        (KubeSpec(priority_class="system-node-critical"), "kubernetes.priority_class"),
        (KubeSpec(node_selector={"pool": "other"}), "kubernetes.node_selector: .* found 'pool=other'"),
        (KubeSpec(node_selector={"node-role.kubernetes.io/control-plane": ""}), "kubernetes.node_selector"),
        (KubeSpec(tolerations=[{"operator": "Exists"}]), "kubernetes.tolerations"),
        (KubeSpec(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]), "kubernetes.tolerations"),
        (KubeSpec(service_account="default"), "kubernetes.service_account")]
    for spec, field in refused:
        with pytest.raises(DeploySpecError, match=field):
            policy.check(spec)
    with pytest.raises(DeploySpecError, match=r"policy.yaml: unknown key\(s\) \['image'\]"):
        DeploymentPolicy.from_yaml("image: [x]", namespace="rlhf")


def test_the_cluster_pipeline_takes_no_policy_from_the_profile_namespace_and_sets_pod_identity():
    doc = list(yaml.safe_load_all((ROOT / "pipelines/ppo_iteration_kuberay.yaml").read_text()))
    executors = doc[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    # a ConfigMap of the pipeline's own (profile) namespace is one its users can edit
    assert not any("configMapAsEnv" in executor for executor in executors.values())
    for name, executor in executors.items():
        assert executor["securityContext"] == {"runAsUser": "1000", "runAsGroup": "1000", "runAsNonRoot": True} \
            or executor["securityContext"] == {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True}, name


def test_a_critic_or_reward_model_pool_of_its_own_renders_a_worker_group_of_its_own():
    objects = render_own_pools()
    validate_core_kinds(objects)
    groups = {g["groupName"]: g for g in objects["raycluster.yaml"]["spec"]["workerGroupSpecs"]}
    assert {name: g["replicas"] for name, g in groups.items()} == {"train": 2, "critic": 1, "reward-model": 1}
    assert groups["critic"]["rayStartParams"]["num-gpus"] == groups["reward-model"]["rayStartParams"]["num-gpus"] \
        == "8"  # the training pool's node shape
    cfg = apply_overrides(RunConfig(), ["algorithm.adv_estimator=gae", "actor.world_size=16", "resources.nnodes=2",
                                        "resources.gpus_per_node=8", "critic.world_size=8", "resources.critic_nnodes=1"])
    with pytest.raises(Exception, match=r"critic.world_size=3 must split evenly over resources.critic_nnodes=2"):
        apply_overrides(cfg, ["critic.world_size=3", "resources.critic_nnodes=2"]).validate()


def test_volumes_are_mounted_into_every_ray_node_and_not_the_submitter():
    objects = render_with_volumes()
    validate_core_kinds(objects)
    job = objects["rayjob.yaml"]
    pods = list(_pod_templates(job))
    for template in pods[:-1]:  # head, workers
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "team-models", "readOnly": True}
        assert volumes["scratch"]["persistentVolumeClaim"] == {"claimName": "team-scratch", "readOnly": False}
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
        assert mounts["/scratch"]["readOnly"] is False
    submitter = pods[-1]["spec"]
    assert not [v for v in submitter["volumes"] if "persistentVolumeClaim" in v]


def test_the_policy_decides_which_claims_a_run_may_mount_and_how():
    from components.kuberay.policy import DeploymentPolicy

    policy = DeploymentPolicy.from_yaml("volume_claims: [team-models]\nwritable_volume_claims: [team-scratch]",
                                        namespace="rlhf")
    policy.check(KubeSpec(volumes=[VOLUME]).validate())
    policy.check(KubeSpec(volumes=[{"name": "s", "claim": "team-scratch", "mount_path": "/s", "read_only": False},
                                   {"name": "t", "claim": "team-scratch", "mount_path": "/t"}]).validate())
    for volume, match in (({**VOLUME, "claim": "other-team-models"}, r"kubernetes.volumes: expected one of the "
                           r"deployment's allowed claims \['team-models', 'team-scratch'\]; found 'other-team-models'"),
                          ({**VOLUME, "read_only": False}, r"kubernetes.volumes: .*writable claims.*'team-models'")):
        with pytest.raises(DeploySpecError, match=match):
            policy.check(KubeSpec(volumes=[volume]).validate())
    with pytest.raises(DeploySpecError, match="kubernetes.volumes: .*claims \\[\\]; found 'team-models'"):
        DeploymentPolicy(namespace="rlhf").check(KubeSpec(volumes=[VOLUME]).validate())


@pytest.mark.parametrize("volume, field", [
    ({**VOLUME, "mount_path": "models"}, r"volumes\[0\].mount_path: expected an absolute"),
    ({**VOLUME, "mount_path": "/tmp/models"}, r"volumes\[0\].mount_path: .* overlapping /tmp"),
    ({**VOLUME, "mount_path": "/home"}, r"volumes\[0\].mount_path: .* overlapping /home/rlhf"),
    ({**VOLUME, "mount_path": "/opt/rlhf/lib/python3.11/site-packages"},
     r"volumes\[0\].mount_path: .* overlapping /opt/rlhf$"),
    ({**VOLUME, "mount_path": "/opt"}, r"volumes\[0\].mount_path: .* overlapping /opt/rlhf$"),
    ({**VOLUME, "mount_path": "/usr/lib"}, r"volumes\[0\].mount_path: .* overlapping /usr$"),
    ({**VOLUME, "mount_path": "/a/../tmp"}, r"volumes\[0\].mount_path: expected an absolute, normalized"),
    ({**VOLUME, "name": "cache"}, r"volumes\[0\].name: expected a DNS label unused"),
    ({**VOLUME, "name": "Models"}, r"volumes\[0\].name"),
    ({**VOLUME, "claim": ""}, r"volumes\[0\].claim"),
    ({**VOLUME, "read_only": "yes"}, r"volumes\[0\].read_only: expected true or false"),
    ({"name": "models", "claim": "x", "mountPath": "/m"}, r"volumes\[0\]: expected \{name, claim, mount_path"),
])
def test_bad_volumes_are_refused_with_the_field(volume, field):
    with pytest.raises(DeploySpecError, match="kubernetes." + field):
        KubeSpec(volumes=[volume]).validate()
    with pytest.raises(DeploySpecError, match=r"volumes\[1\].(name|mount_path)"):
        KubeSpec(volumes=[VOLUME, VOLUME]).validate()


@pytest.mark.parametrize("setting, refusal", [
    ({"gpu_resource": "cpu"}, r"kubernetes.gpu_resource: expected an extended resource name .* found 'cpu'"),
    ({"gpu_resource": "memory"}, r"kubernetes.gpu_resource: .* found 'memory'"),
    ({"gpu_resource": "kubernetes.io/batteries"}, r"kubernetes.gpu_resource"),
    ({"head_cpus": -3}, r"kubernetes.head_cpus: expected a number in \(0, 256\], found -3"),
    ({"head_cpus": True}, r"kubernetes.head_cpus: .* found True"),
    ({"head_memory_gib": "lots"}, r"kubernetes.head_memory_gib: expected a number in .* found 'lots'"),
    ({"head_object_store_gib": float("inf")}, r"kubernetes.head_object_store_gib: .* found inf"),
    ({"session_max_lifetime_s": 10 ** 12}, r"kubernetes.session_max_lifetime_s: expected an integer in \[1, 2592000\]"),
    ({"session_max_lifetime_s": 0}, r"kubernetes.session_max_lifetime_s"),
    ({"ttl_after_finished_s": -1}, r"kubernetes.ttl_after_finished_s"),
    ({"node_gpus": 1000}, r"kubernetes.node_gpus: expected an integer in \[0, 64\], found 1000"),
    ({"image": "ghcr.io/x/y:1 --privileged"}, r"kubernetes.image: expected an image reference"),
    ({"image": ""}, r"kubernetes.image"),
    ({"namespace": "Kube_System"}, r"kubernetes.namespace: expected a namespace name"),
    ({"service_account": "a/b"}, r"kubernetes.service_account: expected a Kubernetes object name"),
    ({"priority_class": 3}, r"kubernetes.priority_class"),
    ({"node_selector": {"pool": "a b"}}, r"kubernetes.node_selector: expected a map of label keys to label values"),
    ({"node_selector": {"/x": "a"}}, r"kubernetes.node_selector"),
    ({"tolerations": [{"key": "k", "operator": "Maybe"}]}, r"kubernetes.tolerations\[0\].operator: expected Equal"),
    ({"tolerations": [{"key": "k", "effect": "Sometimes"}]}, r"kubernetes.tolerations\[0\].effect"),
    ({"tolerations": [{"key": "k", "tolerationSeconds": "1"}]}, r"kubernetes.tolerations\[0\].tolerationSeconds"),
    ({"tolerations": [{"key": "k", "nodeName": "n"}]}, r"kubernetes.tolerations\[0\]: expected a map of"),
    ({"ray_version": "latest"}, r"kubernetes.ray_version: expected a Ray release"),
    ({"rdma_resources": {"nvidia.com/gpu": 1}}, r"kubernetes.rdma_resources: expected resources other than"),
])
def test_every_kube_spec_field_is_typed_and_bounded(setting, refusal):
    """Issue 39 item 13: a value of the wrong type or out of range is refused in one line
    naming the field, before anything renders (never a traceback at render time)."""
    from components.kuberay.spec import spec_from_dict

    with pytest.raises(DeploySpecError, match=refusal) as err:
        spec_from_dict(setting)
    assert "\n" not in str(err.value)


def test_what_a_gpu_resource_may_name_is_the_policys():
    from components.kuberay.policy import DeploymentPolicy

    spec = KubeSpec(gpu_resource="amd.com/gpu", node_gpus=8).validate()
    with pytest.raises(DeploySpecError, match=r"kubernetes.gpu_resource: .* \['nvidia.com/gpu'\]; found 'amd.com/gpu'"):
        DeploymentPolicy(namespace="rlhf").check(spec)
    DeploymentPolicy(namespace="rlhf", gpu_resources=("amd.com/gpu",)).check(spec)
    for good in ("localhost:5000/rlhf-core:dev", "registry.example.com/team/rlhf-core:0.1.0-cuda",
                 "ghcr.io/rlhf-core/rlhf-core@sha256:" + "0" * 64):
        KubeSpec(image=good).validate()


def test_the_reserved_mounts_are_the_ones_the_pods_use():
    from components.kuberay.spec import RESERVED_MOUNTS, RESERVED_VOLUMES

    cluster = render_all(*load_deployment(None), "r", "s3://b/runs")["raycluster.yaml"]["spec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert {v["name"] for v in head["volumes"]} == set(RESERVED_VOLUMES)
    used = {m["mountPath"] for m in head["containers"][0]["volumeMounts"] + cluster["autoscalerOptions"]["volumeMounts"]}
    assert all(any(path == r or path.startswith(r + "/") for r in RESERVED_MOUNTS) for path in used)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_example_reaches_its_model_and_data(path):
    """What a pod reads: built-in, an object-store URI (fetched by each node) or a path
    under a volume the pods mount; never a path only some laptop has."""
    from rlhf_core.data.fetch import is_remote

    cfg, spec = load_deployment(path)
    mounts = [v["mount_path"] for v in spec.volumes]
    for field, value in (("model.path", cfg.model.path), ("data.train_files", cfg.data.train_files)):
        assert value.startswith("builtin:") or is_remote(value) or any(
            value.startswith(m + "/") for m in mounts), f"{path.name}: {field}={value} is not reachable from the pods"
    claims = {v["claim"] for v in spec.volumes}
    example = yaml.safe_load((ROOT / "manifests/base/pvc-models.example.yaml").read_text())
    assert claims <= {example["metadata"]["name"]}, "every claim an example mounts has an example PVC"


def test_the_heads_object_store_is_its_shm_and_fits_its_memory():
    """The controller's batches pass through the head's object store: Ray's store size and
    the /dev/shm it lives in are one setting, and the pod's memory must hold it."""
    from components.kuberay.render import cluster_spec
    from components.kuberay.spec import DeploySpecError, KubeSpec, load_deployment

    cfg, spec = load_deployment(ROOT / "manifests" / "configs" / "qwen2.5-7b-2x8.yaml")
    head = cluster_spec(cfg, spec, "q")["headGroupSpec"]
    assert head["rayStartParams"]["object-store-memory"] == str(8 * 2 ** 30)
    (shm,) = [v for v in head["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "9216Mi"}  # store + 1 GiB margin
    with pytest.raises(DeploySpecError, match=r"^kubernetes.head_memory_gib: expected at least "
                                              r"head_object_store_gib \+ 6 .*found 8 with head_object_store_gib 4$"):
        KubeSpec(head_memory_gib=8, head_object_store_gib=4).validate()
    with pytest.raises(DeploySpecError,
                       match=r"^kubernetes.head_object_store_gib: expected a number in \(0, 2048\], found 0$"):
        KubeSpec(head_object_store_gib=0).validate()


def test_rlhf_manifests_admits_a_runs_own_pods_to_each_other_and_no_one_else():
    """manifests/base admits no pod of one run to another's: each run's own policy does
    (the launcher makes it; `rlhf manifests` writes it for kubectl). Every pod it renders,
    the RayJob's submitter included, carries the label it admits."""
    cfg, kube = load_deployment(ROOT / "manifests/configs/gpu.yaml")
    objects = render_all(cfg, kube, "hardened", "s3://b/runs")
    policy = objects["network-policy.yaml"]
    ours = {"matchLabels": {"rlhf.io/cluster": "rlhf-hardened"}}  # no owner: kubectl's, not a profile's pipeline
    assert policy["spec"] == {"podSelector": ours, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": ours}]}]}
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for template in _pod_templates(objects[name]):
            assert template["metadata"]["labels"]["rlhf.io/cluster"] == "rlhf-hardened"
