"""Kubeflow components for the cluster path: launch (or reuse) the run's RayCluster,
and tear it down by policy when the pipeline ends (under ``dsl.ExitHandler``).

The cluster is named from the run id given at run time (``rlhf-<run id>``), never from
anything fixed at compile time, so concurrent runs of one compiled pipeline with
different run ids get different clusters, and the iterations of one run share its
cluster and long-lived session.
"""

from typing import NamedTuple

from kfp import dsl

from components.iteration import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def launch_cluster(run_id: str, config: str, config_hash: str, kube_spec: dict, timeout_s: int,
                   cluster_policy: str = "keep", kfp_run_id: str = "") -> NamedTuple(
        "Cluster", [("name", str), ("ray_address", str), ("dashboard_url", str), ("token_secret", str)]):
    """Create or reuse the run's RayCluster and wait until it is ready (on timeout, fail
    with the pods' phases and events); outputs its Ray Client and Jobs API addresses and
    the Secret, in this pod's namespace, holding the cluster's own Ray token. The
    cluster is labelled with the profile namespace this pod runs in and the KFP run; one
    created from another profile is never reused."""
    from collections import namedtuple

    from components.kuberay.launcher import Launcher, check_cluster_policy, kube_apis, pod_namespace, with_owner
    from components.kuberay.render import render_raycluster
    from components.kuberay.spec import spec_from_dict
    from rlhf_core.config import config_from_handover

    check_cluster_policy(cluster_policy)  # before anything runs, not first at teardown
    owner = pod_namespace()
    cfg = config_from_handover(config, config_hash)
    spec = spec_from_dict(kube_spec)
    custom, core = kube_apis()
    launcher = Launcher(custom, core, spec.namespace)
    # kube_spec is a run parameter: its namespace, image, account, secrets and node choices
    # only among what that namespace's policy (set by the platform, not the run) allows
    launcher.policy().check(spec)
    if "ray_token_secret" in kube_spec:
        print(f"kubernetes.ray_token_secret={spec.ray_token_secret!r} has no effect on a pipeline's cluster: each run's "
              f"cluster gets a token of its own (it is used by `rlhf manifests`)")
    body = with_owner(render_raycluster(cfg, spec, run_id), owner, kfp_run_id)
    address = launcher.ensure(body, timeout_s)
    return namedtuple("Cluster", ["name", "ray_address", "dashboard_url", "token_secret"])(
        address.name, address.ray_address, address.dashboard_url, body["spec"]["authOptions"]["secretName"])


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def teardown_cluster(run_id: str, kube_spec: dict, policy: str, status: dsl.PipelineTaskFinalStatus):
    """keep (default: the session serves the next iteration and ends itself when idle),
    delete, or delete-on-success (a failed run's cluster stays for debugging). Deletes only
    a cluster of this run id created from this pod's profile namespace."""
    from components.kuberay.launcher import OWNER_NAMESPACE_LABEL, Launcher, kube_apis, pod_namespace
    from components.kuberay.names import cluster_name, label_value
    from components.kuberay.spec import spec_from_dict

    spec = spec_from_dict(kube_spec)
    custom, core = kube_apis()
    labels = {"rlhf.io/run-id": label_value(run_id), OWNER_NAMESPACE_LABEL: pod_namespace()}
    outcome = Launcher(custom, core, spec.namespace).teardown(cluster_name(run_id), policy,
                                                              succeeded=status.state == "SUCCEEDED", labels=labels)
    print(f"RayCluster {cluster_name(run_id)}: {outcome} (policy {policy}, pipeline {status.state})")
