"""The Kubeflow component that drives a whole fine-tune (``components/driver.py``): it
submits the per-iteration KubeRay pipeline run after run through the KFP API from inside
the cluster, with the pod's service-account token as multi-user Kubeflow provides it."""

from kfp import dsl

from components.iteration import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def drive_finetune(run_id: str, store: str, iterations: int, more: int, stop_at_reward: float, budget_s: float,
                   config: str, config_hash: str, kube_spec: dict, cluster_policy: str, max_retries: int,
                   kfp_host: str, namespace: str, experiment: str, service_account: str,
                   summary: dsl.Output[dsl.Markdown], metrics: dsl.Output[dsl.Metrics], stop_at_val: float = -1.0,
                   pipelined: bool = True):
    """Iterations until the run has ``iterations`` in all (or ``more`` than it had, when
    ``more`` > 0), the mean reward of the last five reaches ``stop_at_reward`` (-1: never),
    the latest validation's score reaches ``stop_at_val`` (-1: never)
    or ``budget_s`` (<= 0: none) is spent. Ends with a report and the last metrics.
    ``pipelined``: submit iteration n+1's run while n's runs, when only the count ends the
    fine-tune (``components.driver.pipelines_ahead``)."""
    import signal
    from importlib import resources

    import kfp

    from components.driver import Plan, drive, report_markdown, score_target
    from rlhf_core.record.run_ids import validate_run_id, validate_store_uri
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.report import run_history

    from rlhf_core.config import config_from_handover

    from components.kuberay.launcher import check_cluster_policy

    validate_run_id(run_id, "run_id")  # before the KFP client or the store is touched
    check_cluster_policy(cluster_policy)
    validate_store_uri(store, "store")
    config_from_handover(config, config_hash)  # a config its runs would refuse is refused here, once
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # run terminated: submit no more
    client = kfp.Client(host=kfp_host or None, namespace=namespace or None)  # in-cluster: the SA token
    try:
        experiment_id = client.get_experiment(experiment_name=experiment, namespace=namespace or None).experiment_id
    except ValueError:
        experiment_id = client.create_experiment(experiment, namespace=namespace or None).experiment_id
    package = str(resources.files("pipelines") / "ppo_iteration_kuberay.yaml")
    plan = Plan(run_id, store, {"run_id": run_id, "store": store, "config": config, "config_hash": config_hash,
                                "kube_spec": dict(kube_spec), "cluster_policy": cluster_policy},
                iterations=iterations if more <= 0 else None, more=more if more > 0 else None,
                stop_at_reward=score_target(stop_at_reward), stop_at_val=score_target(stop_at_val),
                budget_s=budget_s if budget_s > 0 else None, max_retries=max_retries, poll_s=15.0,
                pipelined=pipelined)
    outcome = drive(client, plan, package, experiment_id, stopping=lambda: bool(stop),
                    service_account=service_account or None)
    host = (kfp_host or "").rstrip("/")
    with open(summary.path, "w", encoding="utf-8") as f:
        f.write(report_markdown(plan, outcome, lambda rid: f"{host}/#/runs/details/{rid}" if host else ""))
    rows = run_history(IterationStore(RunRef(store, run_id)))
    if rows:
        for key, value in rows[-1].items():
            if isinstance(value, (int, float)):
                metrics.log_metric(key.replace("/", "."), float(value))
