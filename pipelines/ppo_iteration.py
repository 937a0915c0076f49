"""The per-iteration pipeline: ensure the session, run one iteration, report.

Compiled to ``pipelines/ppo_iteration.yaml`` (checked in; CI verifies it matches a fresh
compile) for upload in the Kubeflow UI; run locally by the KFP local runner.
"""


from pathlib import Path

from kfp import compiler, dsl, kubernetes

from components.iteration import ensure_session, report, run_iteration

COMPILED = Path(__file__).with_name("ppo_iteration.yaml")
#: Kubernetes secret holding the object store credentials (see manifests/).
S3_SECRET = "rlhf-object-store"


@dsl.pipeline(name="rlhf-ppo-iteration",
              description="One PPO/GRPO iteration of a run, resumable at the stage where it stopped.")
def ppo_iteration(run_id: str = "demo", store: str = "s3://rlhf/runs", config_overrides: list = [],
                  head_root: str = "/var/run/rlhf", session_policy: str = "reuse"):
    # session_policy is recorded for lineage; "reuse" attaches to the live session
    session = ensure_session(run_id=run_id, store=store, config_overrides=config_overrides, head_root=head_root)
    step = run_iteration(run_id=run_id, store=store, config_overrides=config_overrides, head_root=head_root,
                         ray_address=session.output)
    step.set_retry(num_retries=2, backoff_duration="30s")  # stages are idempotent: a retry resumes
    summary = report(run_id=run_id, store=store, iteration=step.outputs["Output"])
    # No component needs an accelerator: the GPUs belong to the session's Ray workers
    # (requested in the RayCluster, manifests/). The controller holds one iteration's
    # batch in memory; the other two are small clients.
    step.set_cpu_request("1").set_memory_request("2G").set_memory_limit("16G")
    for task in (session, summary):
        task.set_cpu_request("0.5").set_memory_request("512M").set_memory_limit("2G")
    for task in (session, step, summary):
        task.set_caching_options(False)  # every trigger must look at the store again
        kubernetes.use_secret_as_env(task, secret_name=S3_SECRET, secret_key_to_env={
            "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL"})
        kubernetes.add_node_selector(task, label_key="rlhf.io/pool", label_value="controller")
        kubernetes.add_toleration(task, key="rlhf.io/dedicated", operator="Equal", value="rlhf", effect="NoSchedule")


def compile_pipeline(path=COMPILED) -> Path:
    compiler.Compiler().compile(ppo_iteration, package_path=str(path))
    return Path(path)


if __name__ == "__main__":
    print(compile_pipeline())
