"""Submit the per-iteration KubeRay pipeline to a Kubeflow Pipelines server (kfp.Client).

``submit`` starts one run (one iteration); ``schedule`` creates a recurring run whose
every trigger runs the next iteration. Triggers never double-run an iteration: the
recurring run allows one active run at a time (``max_concurrency=1``), and should two
overlap anyway (a retried run, a manual submit), the controller's create-only lease in
the store makes the late one exit cleanly without touching anything.
"""

import os
import re
from dataclasses import dataclass

from pipelines.ppo_iteration import COMPILED_FINETUNE, COMPILED_KUBERAY

EXPERIMENT = "rlhf"
_CRON_FIELD = re.compile(r"^[\d*/,\-?LW#A-Za-z]+$")


class ScheduleError(ValueError):
    """A bad --cron (or other schedule input); the message names the field."""


def kfp_cron(expr: str) -> str:
    """KFP's scheduler takes 6-field cron (seconds first). A standard 5-field expression
    gets ``0`` seconds prepended; anything else is refused with the reason."""
    fields = expr.split()
    if len(fields) == 5:
        fields = ["0"] + fields
    if len(fields) != 6:
        raise ScheduleError(f"--cron: expected 5 fields (minute hour day month weekday) or 6 (with "
                            f"seconds first), found {len(expr.split())} in {expr!r}")
    bad = [f for f in fields if not _CRON_FIELD.match(f)]
    if bad:
        raise ScheduleError(f"--cron: field(s) {bad} of {expr!r} are not cron syntax")
    return " ".join(fields)


@dataclass
class Target:
    """Which Kubeflow server, and where runs go there."""

    host: str
    namespace: str | None = None
    experiment: str = EXPERIMENT
    service_account: str = "rlhf-pipeline"

    def client(self):
        import kfp

        # KF_PIPELINES_TOKEN: a bearer token for servers behind auth (e.g. a service
        # account token); without it, kfp.Client's own discovery applies.
        return kfp.Client(host=self.host, namespace=self.namespace or "kubeflow",
                          existing_token=os.environ.get("KF_PIPELINES_TOKEN"))

    def experiment_id(self, client) -> str:
        try:
            return client.get_experiment(experiment_name=self.experiment, namespace=self.namespace).experiment_id
        except ValueError:  # kfp raises ValueError when no experiment has the name
            return client.create_experiment(self.experiment, namespace=self.namespace).experiment_id


def pipeline_arguments(run_id: str, store: str, cfg, kube_spec, cluster_policy: str = "keep") -> dict:
    """Parameters of the KubeRay pipeline (``pipelines/ppo_iteration_kuberay.yaml``): the
    resolved config ``cfg`` as data and its hash (``rlhf_core.config.handover``)."""
    import dataclasses

    from components.kuberay.launcher import check_cluster_policy
    from rlhf_core.config import handover

    check_cluster_policy(cluster_policy)
    return {"run_id": run_id, "store": store, **handover(cfg),
            "kube_spec": dataclasses.asdict(kube_spec), "cluster_policy": cluster_policy}


def submit(target: Target, arguments: dict, run_name: str | None = None) -> dict:
    """One run of the per-iteration pipeline; returns its id. (It gets no parent_model:
    this machine may not reach the store; the fine-tune driver, inside the cluster, gives
    every run it submits the checkpoint it continues from.)"""
    client = target.client()
    experiment_id = target.experiment_id(client)
    run = client.run_pipeline(experiment_id=experiment_id,
                              job_name=run_name or f"{arguments['run_id']}-iteration",
                              pipeline_package_path=str(COMPILED_KUBERAY), params=arguments, enable_caching=False,
                              service_account=target.service_account)
    return {"run_id": run.run_id, "experiment_id": experiment_id}


def schedule(target: Target, arguments: dict, cron: str, name: str | None = None) -> dict:
    """A recurring run: every trigger continues the run from its last committed iteration."""
    cron = kfp_cron(cron)
    client = target.client()
    experiment_id = target.experiment_id(client)
    job = client.create_recurring_run(experiment_id=experiment_id,
                                      job_name=name or f"{arguments['run_id']}-recurring",
                                      description=f"PPO iterations of run {arguments['run_id']}, one per trigger",
                                      cron_expression=cron, max_concurrency=1, no_catchup=True,
                                      params=arguments, pipeline_package_path=str(COMPILED_KUBERAY),
                                      enable_caching=False, service_account=target.service_account)
    return {"recurring_run_id": job.recurring_run_id, "experiment_id": experiment_id, "cron": cron}


def finetune_arguments(arguments: dict, target: Target, iterations: int | None = None, more: int | None = None,
                       stop_at_reward: float | None = None, budget_s: float | None = None,
                       max_retries: int = 2, stop_at_val: float | None = None) -> dict:
    """Parameters of the driver pipeline (``pipelines/finetune.yaml``): the per-iteration
    pipeline's, plus when to stop. ``iterations`` is the run's total; ``more`` adds to
    what is committed when the driver starts (a schedule's trigger)."""
    return {**{k: v for k, v in arguments.items()}, "iterations": int(iterations or 0), "more": int(more or 0),
            "stop_at_reward": -1.0 if stop_at_reward is None else float(stop_at_reward),
            "stop_at_val": -1.0 if stop_at_val is None else float(stop_at_val),
            "budget_s": float(budget_s or 0.0), "max_retries": max_retries, "kfp_host": target.host,
            "namespace": target.namespace or "", "experiment": target.experiment,
            "service_account": target.service_account}


def submit_finetune(target: Target, arguments: dict) -> dict:
    """One run of the driver pipeline: the whole fine-tune."""
    client = target.client()
    experiment_id = target.experiment_id(client)
    run = client.run_pipeline(experiment_id=experiment_id, job_name=f"{arguments['run_id']} fine-tune",
                              pipeline_package_path=str(COMPILED_FINETUNE), params=arguments, enable_caching=False,
                              service_account=target.service_account)
    return {"run_id": run.run_id, "experiment_id": experiment_id}


def schedule_finetune(target: Target, arguments: dict, cron: str) -> dict:
    """A recurring run of the driver: each trigger trains ``more`` iterations of the run,
    continuing from its last committed one; a trigger that finds a driver of the run
    still at work exits (the run's driver lease)."""
    cron = kfp_cron(cron)
    client = target.client()
    experiment_id = target.experiment_id(client)
    job = client.create_recurring_run(experiment_id=experiment_id, job_name=f"{arguments['run_id']}-recurring",
                                      description=f"{arguments['more']} more iteration(s) of run "
                                                  f"{arguments['run_id']} per trigger",
                                      cron_expression=cron, max_concurrency=1, no_catchup=True, params=arguments,
                                      pipeline_package_path=str(COMPILED_FINETUNE), enable_caching=False,
                                      service_account=target.service_account)
    return {"recurring_run_id": job.recurring_run_id, "experiment_id": experiment_id, "cron": cron}
