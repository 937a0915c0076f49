"""The cluster launcher's create / reuse / wait / timeout / teardown logic, against an
in-process FAKE Kubernetes API server (tests/fake_kube_api.py): no real API server or
KubeRay operator can run here."""

import threading
from pathlib import Path

import pytest
import yaml

from fake_kube_api import FakeKubeAPI

from components.kuberay.launcher import ClusterLaunchError, Launcher, kube_apis 
from components.kuberay.render import render_raycluster 
from components.kuberay.spec import KubeSpec 
from rlhf_core.config import RunConfig, handover

PATH = "/apis/ray.io/v1/namespaces/rlhf/rayclusters"


def launcher(fake, logs=None):
    custom, core = kube_apis(host=fake.url)
    return Launcher(custom, core, "rlhf", poll_s=0.01, log=(logs.append if logs is not None else lambda *a: None))


def body(run_id="nightly"):
    return render_raycluster(RunConfig(), KubeSpec(), run_id)


def test_creates_waits_until_ready_then_reuses():
    with FakeKubeAPI(ready_after_polls=3) as fake:
        logs = []
        address = launcher(fake, logs).ensure(body(), timeout_s=30)
        assert not address.reused and address.name == "rlhf-nightly"
        assert address.ray_address == "ray://rlhf-nightly-head-svc.rlhf.svc.cluster.local:10001"
        assert address.dashboard_url == "http://rlhf-nightly-head-svc.rlhf.svc.cluster.local:8265"
        assert fake.verbs("POST") == [PATH] and fake.polls["rlhf-nightly"] >= 4
        assert "created RayCluster rlhf/rlhf-nightly" in logs and "RayCluster rlhf-nightly: ready" in logs
        # the next iteration's launch finds the cluster (and its session) and creates nothing
        again = launcher(fake).ensure(body(), timeout_s=30)
        assert again.reused and fake.verbs("POST") == [PATH]


def test_two_launchers_at_once_create_one_cluster_and_both_use_it():
    """Two iterations' launches run at the same time: both find no cluster, both POST;
    the API server creates it once (the other gets 409 and waits on the winner's), and
    both return the same cluster."""
    with FakeKubeAPI(ready_after_polls=0) as fake:
        both_looked = threading.Barrier(2)
        real_get = Launcher.get
        missed: list[str] = []

        def get_then_wait_for_the_other(self, name):
            found = real_get(self, name)
            if found is None and len(missed) < 2:
                missed.append(name)
                both_looked.wait(timeout=30)  # neither POSTs before both saw no cluster
            return found

        results, logs = {}, {"a": [], "b": []}

        def launch(who: str) -> None:
            results[who] = launcher(fake, logs[who]).ensure(body(), timeout_s=30)

        Launcher.get = get_then_wait_for_the_other
        try:
            threads = [threading.Thread(target=launch, args=(who,)) for who in ("a", "b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            Launcher.get = real_get
        assert not any(t.is_alive() for t in threads) and set(results) == {"a", "b"}, results
        assert len(missed) == 2 and fake.verbs("POST") == [PATH, PATH]  # both tried to create
        assert list(fake.clusters) == [("rlhf", "rlhf-nightly")]
        assert results["a"].ray_address == results["b"].ray_address
        created = [who for who in logs if "created RayCluster rlhf/rlhf-nightly" in logs[who]]
        assert len(created) == 1, logs


def test_timeout_reports_pod_phases_and_events():
    with FakeKubeAPI(ready_after_polls=None) as fake:
        with pytest.raises(ClusterLaunchError) as err:
            launcher(fake).ensure(body(), timeout_s=0.2)
    text = str(err.value)
    assert "RayCluster rlhf/rlhf-nightly not ready after 0s" in text
    assert "pod rlhf-nightly-train-worker-xyz12: Pending (ray-worker: ContainerCreating)" in text
    assert "FailedScheduling: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in text


def test_a_cluster_of_another_run_is_not_reused():
    with FakeKubeAPI() as fake:
        other = body()
        other["metadata"]["labels"]["rlhf.io/run-id"] = "someone-else"
        fake.clusters[("rlhf", "rlhf-nightly")] = other
        with pytest.raises(ClusterLaunchError, match="belongs to run 'someone-else', not 'nightly'; it is not reused"):
            launcher(fake).ensure(body(), timeout_s=5)
        assert not fake.verbs("POST") and not fake.verbs("DELETE")


OURS = {"rlhf.io/run-id": "nightly", "rlhf.io/owner-namespace": "team-a"}


def owned_body(run_id="nightly", profile="team-a"):
    from components.kuberay.launcher import with_owner

    return with_owner(body(run_id), profile, "kfp-run-1")


@pytest.mark.parametrize("policy, succeeded, outcome", [
    ("keep", True, "kept"), ("delete", False, "deleted"), ("delete-on-success", True, "deleted"),
    ("delete-on-success", False, "kept")])
def test_teardown_policy(policy, succeeded, outcome):
    with FakeKubeAPI(ready_after_polls=0) as fake:
        run = launcher(fake)
        run.ensure(owned_body(), timeout_s=5)
        assert run.teardown("rlhf-nightly", policy, succeeded, OURS) == outcome
        assert (("rlhf", "rlhf-nightly") in fake.clusters) == (outcome == "kept")
        if outcome == "deleted":
            assert run.teardown("rlhf-nightly", policy, succeeded, OURS) == "already gone"


def test_unknown_policy_is_refused():
    with FakeKubeAPI() as fake:
        with pytest.raises(ValueError, match="cluster_policy: expected one of .* found 'remove'"):
            launcher(fake).teardown("rlhf-nightly", "remove", True, OURS)


def test_a_cluster_is_reused_and_deleted_only_by_its_own_profile_and_run(monkeypatch):
    """Issue 39 item 3: a pipeline run in another profile that names a victim's run id,
    with cluster_policy=delete and a config that fails validation, neither attaches to the
    victim's cluster nor deletes it in its exit handler; the owner comes from the pod's
    namespace, not from a parameter."""
    from types import SimpleNamespace

    from components import cluster
    from components.kuberay import launcher as module

    with FakeKubeAPI(ready_after_polls=0) as fake:
        fake.set_policy("rlhf", POLICY)
        real = module.kube_apis
        monkeypatch.setattr(module, "kube_apis", lambda: real(host=fake.url))
        monkeypatch.setenv("RLHF_POD_NAMESPACE", "team-a")
        cluster.launch_cluster.python_func(run_id="nightly", **handover(RunConfig()), kube_spec={}, timeout_s=5,
                                           kfp_run_id="run-of-team-a")
        labels = fake.clusters[("rlhf", "rlhf-nightly")]["metadata"]["labels"]
        assert labels["rlhf.io/owner-namespace"] == "team-a" and labels["rlhf.io/created-by-kfp-run"] == "run-of-team-a"

        monkeypatch.setenv("RLHF_POD_NAMESPACE", "team-b")  # the attacker's pipeline, same run id
        with pytest.raises(ClusterLaunchError, match="belongs to profile namespace 'team-a', not 'team-b'"):
            cluster.launch_cluster.python_func(run_id="nightly", **handover(RunConfig()), kube_spec={}, timeout_s=5)
        bad_config = dict(handover(RunConfig()), config_hash="0" * 64)  # fails before any launch
        with pytest.raises(Exception, match="config_hash"):
            cluster.launch_cluster.python_func(run_id="nightly", **bad_config, kube_spec={}, timeout_s=5)
        for policy in ("delete", "delete-on-success"):
            cluster.teardown_cluster.python_func(run_id="nightly", kube_spec={}, policy=policy,
                                                 status=SimpleNamespace(state="SUCCEEDED"))
        assert ("rlhf", "rlhf-nightly") in fake.clusters and not fake.verbs("DELETE")

        monkeypatch.delenv("RLHF_POD_NAMESPACE")  # nobody says which profile: nothing is guessed
        monkeypatch.setattr(module, "_SERVICE_ACCOUNT_NAMESPACE", "/nonexistent/namespace")
        with pytest.raises(ClusterLaunchError, match="RLHF_POD_NAMESPACE: expected the namespace this pipeline pod"):
            cluster.launch_cluster.python_func(run_id="nightly", **handover(RunConfig()), kube_spec={}, timeout_s=5)

        monkeypatch.setenv("RLHF_POD_NAMESPACE", "team-a")  # the owner's teardown deletes it
        cluster.teardown_cluster.python_func(run_id="nightly", kube_spec={}, policy="delete",
                                             status=SimpleNamespace(state="FAILED"))
        assert ("rlhf", "rlhf-nightly") not in fake.clusters


def test_teardown_deletes_only_the_cluster_it_checked():
    """A cluster deleted and created again (another owner) between the check and the
    delete is left alone: the delete carries the checked object's uid as a precondition."""
    with FakeKubeAPI(ready_after_polls=0) as fake:
        run = launcher(fake)
        run.ensure(owned_body(), timeout_s=5)
        real_get = Launcher.get

        def swapped_after_the_check(self, name):
            found = real_get(self, name)
            other = owned_body(profile="team-b")
            fake.clusters[("rlhf", name)] = dict(other, metadata=dict(other["metadata"], uid="uid-other"))
            return found

        Launcher.get = swapped_after_the_check
        try:
            assert run.teardown("rlhf-nightly", "delete", True, OURS) == "replaced meanwhile: left alone"
        finally:
            Launcher.get = real_get
        assert fake.clusters[("rlhf", "rlhf-nightly")]["metadata"]["uid"] == "uid-other"


def test_an_unknown_cluster_policy_is_refused_before_anything_runs(monkeypatch):
    from components import cluster
    from components.kuberay import launcher as module
    from pipelines import remote
    from components.kuberay.spec import KubeSpec as Spec

    with FakeKubeAPI(ready_after_polls=0) as fake:
        real = module.kube_apis
        monkeypatch.setattr(module, "kube_apis", lambda: real(host=fake.url))
        monkeypatch.setenv("RLHF_POD_NAMESPACE", "team-a")
        with pytest.raises(ValueError, match=r"^cluster_policy: expected one of \['keep', 'delete', "
                                             r"'delete-on-success'\], found 'delete-everything'$"):
            cluster.launch_cluster.python_func(run_id="nightly", **handover(RunConfig()), kube_spec={}, timeout_s=5,
                                               cluster_policy="delete-everything")
        assert fake.requests() == []
    with pytest.raises(ValueError, match="cluster_policy: expected one of"):
        remote.pipeline_arguments("nightly", "s3://b/runs", RunConfig(), Spec(), "delete-everything")


def test_gpu_workers_scaled_to_zero_while_idle_come_back_at_the_next_launch():
    """The rendered cluster lets KubeRay's autoscaler remove idle worker pods (minReplicas
    0, an idle timeout): once the session ends no GPU pod stays up. The next iteration's
    launch finds the group at zero and gives it its pool's size back."""
    spec = body()["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] == 300
    assert [(g["minReplicas"], g["replicas"], g["maxReplicas"]) for g in spec["workerGroupSpecs"]] == [(0, 1, 1)]
    with FakeKubeAPI(ready_after_polls=0) as fake:
        launcher(fake).ensure(body(), timeout_s=30)
        # the session idled out; the autoscaler scaled the workers down (what KubeRay does)
        fake.clusters[("rlhf", "rlhf-nightly")]["spec"]["workerGroupSpecs"][0]["replicas"] = 0
        logs = []
        address = launcher(fake, logs).ensure(body(), timeout_s=30)
        assert address.reused and fake.verbs("PATCH") == [f"{PATH}/rlhf-nightly"]
        assert fake.clusters[("rlhf", "rlhf-nightly")]["spec"]["workerGroupSpecs"][0]["replicas"] == 1
        assert "RayCluster rlhf-nightly: worker group(s) ['train'] scaled back up" in logs
        launcher(fake).ensure(body(), timeout_s=30)  # at size: nothing to patch
        assert len(fake.verbs("PATCH")) == 1


def test_each_run_head_gets_its_own_account_owned_by_its_cluster():
    """The launcher creates the head's Role and RoleBinding before its account (KubeRay
    makes a namespace-wide Role of the cluster's name only while none exists, and waits for
    the account), each owned by the RayCluster so that they are deleted with it; a second
    run gets another account, whose Role names only its own cluster."""
    with FakeKubeAPI(ready_after_polls=0) as fake:
        run = launcher(fake)
        run.ensure(body("a"), timeout_s=5)
        assert [p.rsplit("/", 1)[1] for p in fake.verbs("POST", None)] == \
            ["rayclusters", "roles", "rolebindings", "serviceaccounts"]
        run.ensure(body("b"), timeout_s=5)
        for name in ("rlhf-a", "rlhf-b"):
            uid = fake.clusters[("rlhf", name)]["metadata"]["uid"]
            role = fake.objects[("roles", "rlhf", name)]
            binding = fake.objects[("rolebindings", "rlhf", name)]
            account = fake.objects[("serviceaccounts", "rlhf", f"{name}-head")]
            for obj in (role, binding, account):
                assert obj["metadata"]["ownerReferences"] == [
                    {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": name, "uid": uid}]
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{name}-head", "namespace": "rlhf"}]
            assert binding["roleRef"]["name"] == name
            (clusters,) = [r for r in role["rules"] if "rayclusters" in r["resources"]]
            assert clusters["resourceNames"] == [name] and set(clusters["verbs"]) == {"get", "patch"}
            assert not any("patch" in r["verbs"] for r in role["rules"] if r["resources"] == ["pods"])
            head = fake.clusters[("rlhf", name)]["spec"]["headGroupSpec"]["template"]["spec"]
            assert head["serviceAccountName"] == f"{name}-head"
        # a launch that died before the account: the next one (a reuse) creates it
        del fake.objects[("serviceaccounts", "rlhf", "rlhf-a-head")]
        assert run.ensure(body("a"), timeout_s=5).reused
        assert ("serviceaccounts", "rlhf", "rlhf-a-head") in fake.objects


#: The deployment's default policy, as manifests/base ships it.
POLICY = yaml.safe_load((Path(__file__).resolve().parents[1] / "manifests/base/deployment-policy.yaml")
                        .read_text())["data"]["policy.yaml"]


def launch_component(fake, monkeypatch, kube_spec, env=None, run_id="nightly"):
    from components import cluster
    from components.kuberay import launcher as module

    monkeypatch.setattr(module, "kube_apis", lambda real=kube_apis: real(host=fake.url))
    monkeypatch.setenv("RLHF_POD_NAMESPACE", "team-a")
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return cluster.launch_cluster.python_func(run_id=run_id, **handover(RunConfig()), kube_spec=kube_spec,
                                              timeout_s=5)


@pytest.mark.parametrize("choice, refusal", [
    ({"object_store_secret": "team-b-s3-creds"}, "kubernetes.object_store_secret: expected one of the deployment's "
                                                 "allowed secrets \\['rlhf-object-store'\\]; found 'team-b-s3-creds'"),
    ({"ray_token_secret": "other-run-token"}, "kubernetes.ray_token_secret: .* found 'other-run-token'"),
    ({"namespace": "kube-system"}, "kubernetes.namespace: expected a namespace set up for rlhf runs .* found "
                                   "'kube-system' \\(403 Forbidden\\)"),
    ({"namespace": "team-b"}, "kubernetes.namespace: .* found 'team-b' \\(404 Not Found\\)"),
    ({"tolerations": [{"operator": "Exists"}]}, "kubernetes.tolerations: .* found {'operator': 'Exists'}"),
    ({"priority_class": "system-node-critical"}, "kubernetes.priority_class: expected one of the deployment's "
                                                 "allowed priority classes \\['rlhf-training'\\]"),
    ({"node_selector": {"node-role.kubernetes.io/control-plane": ""}},
     "kubernetes.node_selector: .* found 'node-role.kubernetes.io/control-plane='"),
    ({"service_account": "default"}, "kubernetes.service_account: .* found 'default'"),
    ({"image": "docker.io/attacker/miner:latest"}, "kubernetes.image: .* found 'docker.io/attacker/miner:latest'"),
])
def test_launch_refuses_what_the_ray_namespace_policy_does_not_allow(monkeypatch, choice, refusal):
    """What the issue's run parameters chose, each refused in one line naming the field,
    before anything is created. The policy comes from the Ray namespace through the API:
    the old environment allow-lists (which a profile's ConfigMap fed) no longer count."""
    from components.kuberay.spec import DeploySpecError

    with FakeKubeAPI(ready_after_polls=0, namespaces=("rlhf", "team-b")) as fake:
        fake.set_policy("rlhf", POLICY)
        with pytest.raises(DeploySpecError, match=refusal) as err:
            launch_component(fake, monkeypatch, choice, env={"RLHF_ALLOWED_IMAGES": "docker.io/attacker/miner:*",
                                                             "RLHF_ALLOWED_SERVICE_ACCOUNTS": "default"})
        assert "\n" not in str(err.value)
        assert not fake.verbs("POST", None) and not fake.verbs("PATCH", None)


def test_launch_accepts_the_example_deployments_under_the_default_policy(monkeypatch):
    import dataclasses

    from components.kuberay.spec import load_deployment

    _, gpu = load_deployment(Path(__file__).resolve().parents[1] / "manifests/configs/gpu.yaml")
    with FakeKubeAPI(ready_after_polls=0) as fake:
        fake.set_policy("rlhf", POLICY)
        out = launch_component(fake, monkeypatch, dataclasses.asdict(gpu))
        assert out.name == "rlhf-nightly" and fake.verbs("POST") == [PATH]
        pod = fake.clusters[("rlhf", "rlhf-nightly")]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
        assert pod["priorityClassName"] == "rlhf-training" and pod["tolerations"] == gpu.tolerations
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "rlhf-models", "readOnly": True}} \
            in pod["volumes"]


def scale_to_zero(fake, run):
    """What KubeRay's autoscaler does to an idle session's workers; the operator's next
    status drops the worker count but keeps the state "ready" (sticky in KubeRay 1.x)."""
    fake.clusters[("rlhf", "rlhf-nightly")]["spec"]["workerGroupSpecs"][0]["replicas"] = 0
    status = run.get("rlhf-nightly")["status"]
    assert status["state"] == "ready" and "readyWorkerReplicas" not in status


def test_a_reused_cluster_scaled_to_zero_is_ready_only_when_its_workers_are_back():
    with FakeKubeAPI(ready_after_polls=0, scale_up_polls=3) as fake:
        run = launcher(fake)
        run.ensure(body(), timeout_s=30)
        scale_to_zero(fake, run)
        logs = []
        address = launcher(fake, logs).ensure(body(), timeout_s=30)
        assert address.reused
        assert fake.clusters[("rlhf", "rlhf-nightly")]["status"]["readyWorkerReplicas"] == 1
        assert "RayCluster rlhf-nightly: 0/1 worker pods ready" in logs


def test_workers_that_do_not_come_back_time_out_with_the_count_and_the_pods():
    with FakeKubeAPI(ready_after_polls=0, scale_up_polls=None) as fake:
        run = launcher(fake)
        run.ensure(body(), timeout_s=30)
        scale_to_zero(fake, run)
        with pytest.raises(ClusterLaunchError) as err:
            launcher(fake).ensure(body(), timeout_s=0.2)
    text = str(err.value)
    assert "not ready after 0s (state ready, 0 of 1 worker pods ready)" in text
    assert "pod rlhf-nightly-train-worker-xyz12: Pending (ray-worker: ContainerCreating)" in text


def test_the_compiled_pipeline_gives_the_cluster_steps_their_namespace_from_the_api_server():
    """The owner label's value comes from the pod's metadata.namespace (the downward API),
    which the API server sets; and the launch gets the policy and the KFP run id."""
    docs = list(yaml.safe_load_all((Path(__file__).resolve().parents[1] / "pipelines/ppo_iteration_kuberay.yaml")
                                   .read_text()))
    executors = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for step in ("exec-launch-cluster", "exec-teardown-cluster"):
        assert {"fieldPath": "metadata.namespace", "name": "RLHF_POD_NAMESPACE"} in executors[step]["fieldPathAsEnv"]
    launch = docs[0]["root"]["dag"]["tasks"]["exit-handler-1"]["componentRef"]["name"]
    inputs = docs[0]["components"][launch]["dag"]["tasks"]["launch-cluster"]["inputs"]["parameters"]
    assert inputs["kfp_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert inputs["cluster_policy"]["componentInputParameter"] == "pipelinechannel--cluster_policy"


# ------------------------------------------------------------------ each run's Ray token


def _token(fake, namespace, name="rlhf-nightly.team-a.ray-token"):
    import base64

    secret = fake.objects.get(("secrets", namespace, name))
    return None if secret is None else base64.b64decode(secret["data"]["auth_token"]).decode()


def test_each_cluster_gets_its_own_token_written_before_the_cluster_exists(monkeypatch):
    with FakeKubeAPI(ready_after_polls=0) as fake:
        fake.set_policy("rlhf", POLICY)
        out = launch_component(fake, monkeypatch, {})
        token = _token(fake, "rlhf")
        assert len(token) == 64 and token == _token(fake, "team-a")  # the controllers' copy, in their namespace
        assert out.token_secret == "rlhf-nightly.team-a.ray-token"
        assert fake.clusters[("rlhf", "rlhf-nightly")]["spec"]["authOptions"] == {
            "mode": "token", "secretName": "rlhf-nightly.team-a.ray-token"}
        posts = [p for m, p in fake.requests() if m == "POST"]
        assert posts.index("/api/v1/namespaces/rlhf/secrets") < posts.index(PATH)  # no pod starts with another's
        uid = fake.clusters[("rlhf", "rlhf-nightly")]["metadata"]["uid"]  # then owned by it: it goes with it
        assert fake.objects[("secrets", "rlhf", "rlhf-nightly.team-a.ray-token")]["metadata"]["ownerReferences"] == [
            {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "rlhf-nightly", "uid": uid}]
        # and its own ingress policy: its pods, and the head's ports from its owner's namespace only
        policy = fake.objects[("networkpolicies", "rlhf", "rlhf-nightly.team-a.ingress")]
        assert policy["metadata"]["ownerReferences"][0]["uid"] == fake.clusters[("rlhf", "rlhf-nightly")]["metadata"]["uid"]
        assert [rule["from"] for rule in policy["spec"]["ingress"]] == [
            [{"podSelector": {"matchLabels": {"rlhf.io/cluster": "rlhf-nightly", "rlhf.io/owner-namespace": "team-a"}}}],
            [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}}]]
        launch_component(fake, monkeypatch, {}, run_id="weekly")
        assert _token(fake, "rlhf", "rlhf-weekly.team-a.ray-token") not in (None, token)
        # the next iteration reuses the cluster and its token: nothing written
        before = fake.requests()
        assert launch_component(fake, monkeypatch, {}).token_secret == "rlhf-nightly.team-a.ray-token"
        assert not [p for m, p in fake.requests()[len(before):] if m in ("POST", "DELETE") and "secrets" in p]
        assert _token(fake, "rlhf") == token == _token(fake, "team-a")


def test_a_reused_cluster_whose_token_is_gone_is_refused_in_one_line(monkeypatch):
    with FakeKubeAPI(ready_after_polls=0) as fake:
        fake.set_policy("rlhf", POLICY)
        launch_component(fake, monkeypatch, {})
        del fake.objects[("secrets", "team-a", "rlhf-nightly.team-a.ray-token")]
        with pytest.raises(ClusterLaunchError, match=r"^RayCluster rlhf/rlhf-nightly exists but its Ray token secret "
                                                     r"team-a/rlhf-nightly.team-a.ray-token is gone, .* launch again"):
            launch_component(fake, monkeypatch, {})


def test_a_token_left_in_the_ray_namespace_is_replaced_only_when_it_is_the_profiles_own(monkeypatch):
    with FakeKubeAPI(ready_after_polls=0) as fake:
        fake.set_policy("rlhf", POLICY)
        run = launcher(fake)
        # a launch that died after writing the Ray namespace's copy: written again with the profile's token
        run._create_secret("rlhf", "rlhf-nightly.team-a.ray-token", "stale", dict(OURS))
        run.ensure(owned_body(), timeout_s=5)
        assert _token(fake, "rlhf") == _token(fake, "team-a") != "stale"
        # another profile's token secret has a name of its own (its namespace is in it): untouched
        run._create_secret("rlhf", "rlhf-weekly.team-b.ray-token", "theirs", {"rlhf.io/owner-namespace": "team-b"})
        run.ensure(owned_body("weekly"), timeout_s=5)
        assert _token(fake, "rlhf", "rlhf-weekly.team-b.ray-token") == "theirs"
        assert _token(fake, "rlhf", "rlhf-weekly.team-a.ray-token") == _token(fake, "team-a", "rlhf-weekly.team-a.ray-token")
        # a refused replacement (the API server's answer to anything not the profile's own) stops the launch
        run._create_secret("rlhf", "rlhf-monthly.team-a.ray-token", "left", dict(OURS))
        fake.refused_deletes.add(("secrets", "rlhf", "rlhf-monthly.team-a.ray-token"))
        with pytest.raises(ClusterLaunchError, match=r"^Secret rlhf/rlhf-monthly.team-a.ray-token \(the Ray token of "
                                                     r"RayCluster rlhf-monthly\) exists and could not be replaced: 403"):
            run.ensure(owned_body("monthly"), timeout_s=5)
        assert ("rlhf", "rlhf-monthly") not in fake.clusters


def test_two_launches_of_one_run_at_once_end_with_one_token_everywhere():
    """Both find no cluster and no token, both draw one: the profile's copy decides (the
    second creator reads the first's), and the Ray namespace's copy ends equal to it."""
    with FakeKubeAPI(ready_after_polls=0) as fake:
        both_read = threading.Barrier(2)
        real_read = Launcher._read_token
        reads = []

        def read_then_wait(self, namespace, secret):
            found = real_read(self, namespace, secret)
            reads.append(found)
            if len(reads) <= 2:
                both_read.wait(timeout=30)  # neither writes before both found none
            return found

        Launcher._read_token = read_then_wait
        errors = []

        def launch():
            try:
                launcher(fake).ensure(owned_body(), timeout_s=30)
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        try:
            threads = [threading.Thread(target=launch) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        finally:
            Launcher._read_token = real_read
        assert not errors and reads[:2] == [None, None]
        assert len(fake.verbs("POST", "rayclusters")) == 2 and len(fake.clusters) == 1
        assert _token(fake, "rlhf") == _token(fake, "team-a") is not None


def test_teardown_deletes_the_runs_tokens_with_its_cluster_and_keep_keeps_them(monkeypatch):
    with FakeKubeAPI(ready_after_polls=0) as fake:
        run = launcher(fake)
        run.ensure(owned_body(), timeout_s=5)
        assert run.teardown("rlhf-nightly", "keep", True, OURS) == "kept" and _token(fake, "team-a")
        assert run.teardown("rlhf-nightly", "delete", True, OURS) == "deleted"
        assert _token(fake, "rlhf") is None and _token(fake, "team-a") is None


def test_a_cluster_another_profile_created_meanwhile_gets_nothing_of_ours():
    """The other profile's create lands between our look and our create: its cluster is
    refused, not adopted (no ingress policy, no owner reference, no controllers sent)."""
    with FakeKubeAPI(ready_after_polls=0) as fake:
        run = launcher(fake)
        real_get = Launcher.get
        calls = []

        def theirs_appears(self, name):
            found = real_get(self, name)
            if not calls:
                calls.append(name)
                other = owned_body(profile="team-b")
                fake.clusters[("rlhf", name)] = dict(other, metadata=dict(other["metadata"], uid="uid-theirs"))
            return found

        Launcher.get = theirs_appears
        try:
            with pytest.raises(ClusterLaunchError, match=r"was created meanwhile but belongs to profile namespace "
                                                         r"'team-b', not 'team-a'; it is not reused"):
                run.ensure(owned_body(), timeout_s=5)
        finally:
            Launcher.get = real_get
        assert not [k for k in fake.objects if k[0] == "networkpolicies"]
        assert "ownerReferences" not in fake.objects[("secrets", "rlhf", "rlhf-nightly.team-a.ray-token")]["metadata"]
