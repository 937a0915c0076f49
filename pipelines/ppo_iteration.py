"""The per-iteration pipelines: ensure the session, run one iteration, report (one pod).

``ppo_iteration`` runs against a Ray head on the machine that runs it (the KFP local
runner here; `rlhf run`). ``ppo_iteration_kuberay`` is the one for a Kubeflow server: it
first launches (or reuses) the run's KubeRay cluster and tears it down by policy when the
run ends. ``finetune`` drives a whole fine-tune, one per-iteration run after another
(``components/finetune.py``); ``reward_model_finetune`` first trains the reward model that
scores it from preference pairs (``components/reward_model.py``). All four are compiled to YAML next to this file (checked
in; a test verifies they match a fresh compile) for upload in the Kubeflow UI.
"""


from pathlib import Path

from kfp import compiler, dsl, kubernetes

from components.cluster import launch_cluster, teardown_cluster
from components.finetune import drive_finetune
from components.reward_model import train_reward_model, with_reward_model
from components.iteration import run_iteration
from components.kuberay.launcher import POD_NAMESPACE_ENV
from components.kuberay.spec import OBJECT_STORE_SECRET

HERE = Path(__file__).parent
COMPILED = HERE / "ppo_iteration.yaml"
COMPILED_KUBERAY = HERE / "ppo_iteration_kuberay.yaml"
COMPILED_FINETUNE = HERE / "finetune.yaml"
COMPILED_RM_FINETUNE = HERE / "reward_model_finetune.yaml"
#: How long a failed controller waits before its retry: on a server a pod is rescheduled
#: (and a node may be replaced); on this machine (the KFP local runner) nothing needs
#: that long, and a crash's retry should resume promptly.
RETRY_BACKOFF, LOCAL_RETRY_BACKOFF = "30s", "3s"



def _pod_settings(task, small: bool) -> None:
    """Every component: fresh look at the store, credentials as env, the controller pool.
    No component requests an accelerator: the GPUs belong to the session's Ray workers
    (the RayCluster's worker group); the controller holds one iteration's batch."""
    task.set_caching_options(False)  # every trigger must look at the store again
    if small:
        task.set_cpu_request("0.5").set_memory_request("512M").set_memory_limit("2G")
    else:
        task.set_cpu_request("1").set_memory_request("2G").set_memory_limit("16G")
    kubernetes.use_secret_as_env(task, secret_name=OBJECT_STORE_SECRET, secret_key_to_env={
        "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL"})
    # the image's user (Dockerfile: uid 1000), never root; kfp.kubernetes sets identity only
    # (the compiler and backend add allowPrivilegeEscalation=false, drop ALL, RuntimeDefault
    # seccomp); a read-only root filesystem cannot be asked for from the SDK
    kubernetes.set_security_context(task, run_as_user=1000, run_as_group=1000, run_as_non_root=True)
    kubernetes.add_node_selector(task, label_key="rlhf.io/pool", label_value="controller")
    kubernetes.add_toleration(task, key="rlhf.io/dedicated", operator="Equal", value="rlhf", effect="NoSchedule")


def _owner_namespace(task) -> None:
    """The pod's own namespace (its Kubeflow profile), from the API server through the
    downward API: what a cluster's owner label says, never a run parameter."""
    kubernetes.use_field_path_as_env(task, env_name=POD_NAMESPACE_ENV, field_path="metadata.namespace")


def _iteration(run_id, store, config, config_hash, head_root, ray_address="", dashboard_url="", attempt="",
               parent_model="", prefetch_next=True, follows=-1, retry_backoff=RETRY_BACKOFF):
    # One controller pod per iteration (plus the cluster's launch, and the parent's import
    # on a server): the controller makes sure the session is up itself (it submits the
    # session job when there is none and waits for it) and writes the report, so separate
    # session-check or report pods would only add pod starts to every run.
    def controller(**parent):
        step = run_iteration(run_id=run_id, store=store, config=config, config_hash=config_hash, head_root=head_root,
                             ray_address=ray_address, dashboard_url=dashboard_url,
                             kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                             kfp_task=dsl.PIPELINE_TASK_NAME_PLACEHOLDER, attempt=attempt,
                             prefetch_next=prefetch_next, follows=follows, **parent)
        step.set_retry(num_retries=2, backoff_duration=retry_backoff)  # stages are idempotent: a retry resumes
        step.set_display_name("run-iteration")  # one of the two branches runs: the same name in the UI
        _pod_settings(step, small=False)
        return step

    # the parent checkpoint as an input artifact: KFP's lineage view links iteration runs
    # (the importer finds the Model the previous run output under the same URI); a run
    # started by hand without one just has no link
    with dsl.If(parent_model != "", name="continues-a-checkpoint"):
        imported = dsl.importer(artifact_uri=parent_model, artifact_class=dsl.Model, reimport=False)
        linked = controller(parent=imported.output)
    with dsl.Else(name="no-parent-given"):
        unlinked = controller()
    return linked, unlinked


def _ppo_iteration(retry_backoff: str):
    @dsl.pipeline(name="rlhf-ppo-iteration",
                  description="One PPO/GRPO iteration of a run on a local Ray head, resumable at the stage where it "
                              "stopped.")
    def ppo_iteration(run_id: str = "demo", store: str = "s3://rlhf/runs", config: str = "", config_hash: str = "",
                      head_root: str = "/var/run/rlhf", attempt: str = "", parent_model: str = "",
                      prefetch_next: bool = True, follows: int = -1):
        _iteration(run_id, store, config, config_hash, head_root, attempt=attempt, parent_model=parent_model,
                   prefetch_next=prefetch_next, follows=follows, retry_backoff=retry_backoff)

    return ppo_iteration


#: The per-iteration pipeline as compiled for a Kubeflow server, and as the KFP local
#: runner runs it on this machine (the same but for the retry backoff).
ppo_iteration = _ppo_iteration(RETRY_BACKOFF)
ppo_iteration_local = _ppo_iteration(LOCAL_RETRY_BACKOFF)


@dsl.pipeline(name="rlhf-ppo-iteration-kuberay",
              description="One PPO/GRPO iteration of a run on its KubeRay cluster (created or reused), "
                          "resumable at the stage where it stopped.")
def ppo_iteration_kuberay(run_id: str = "demo", store: str = "s3://rlhf/runs", config: str = "", config_hash: str = "",
                          kube_spec: dict = {}, cluster_policy: str = "keep", launch_timeout_s: int = 1200,
                          attempt: str = "", parent_model: str = "", prefetch_next: bool = True,
                          follows: int = -1):
    teardown = teardown_cluster(run_id=run_id, kube_spec=kube_spec, policy=cluster_policy)
    _pod_settings(teardown, small=True)
    _owner_namespace(teardown)
    with dsl.ExitHandler(teardown, name="iteration"):
        cluster = launch_cluster(run_id=run_id, config=config, config_hash=config_hash, kube_spec=kube_spec,
                                 timeout_s=launch_timeout_s, cluster_policy=cluster_policy,
                                 kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        _pod_settings(cluster, small=True)
        _owner_namespace(cluster)
        # what kube_spec may choose is not given to this pod: launch_cluster reads the policy
        # from the Ray namespace (where profile users cannot edit it), not from the profile's
        controllers = _iteration(run_id, store, config, config_hash, "", cluster.outputs["ray_address"],
                                 cluster.outputs["dashboard_url"], attempt, parent_model, prefetch_next, follows)
        for step in controllers:  # they talk to the cluster with its own token (launch_cluster made it)
            kubernetes.use_secret_as_env(step, secret_name=cluster.outputs["token_secret"],
                                         secret_key_to_env={"auth_token": "RAY_AUTH_TOKEN"})


@dsl.pipeline(name="rlhf-finetune",
              description="A whole PPO/GRPO fine-tune: runs the per-iteration KubeRay pipeline again and again "
                          "until the run's total, a reward target, a validation score or a time budget is reached.")
def finetune(run_id: str = "demo", store: str = "s3://rlhf/runs", iterations: int = 300, more: int = 0,
             stop_at_reward: float = -1.0, budget_s: float = 0.0, config: str = "", config_hash: str = "",
             kube_spec: dict = {},
             cluster_policy: str = "keep", max_retries: int = 2, kfp_host: str = "", namespace: str = "",
             experiment: str = "rlhf", service_account: str = "rlhf-pipeline", stop_at_val: float = -1.0,
             pipelined: bool = True):
    driver = drive_finetune(run_id=run_id, store=store, iterations=iterations, more=more,
                            stop_at_reward=stop_at_reward, budget_s=budget_s, config=config, config_hash=config_hash,
                            kube_spec=kube_spec, cluster_policy=cluster_policy, max_retries=max_retries,
                            kfp_host=kfp_host, namespace=namespace, experiment=experiment,
                            service_account=service_account, stop_at_val=stop_at_val, pipelined=pipelined)
    _pod_settings(driver, small=True)
    driver.set_retry(num_retries=3, backoff_duration="60s")  # a retried driver continues from the store


@dsl.pipeline(name="rlhf-reward-model-finetune",
              description="RLHF end to end: a reward model trained from preference pairs (Bradley-Terry), then "
                          "the PPO/GRPO fine-tune scored by it; the fine-tune's config names the reward model's "
                          "artifact, so the lineage reads policy <- reward model <- preferences.")
def reward_model_finetune(preferences: str, reward_model_base: str, reward_model_out: str, rm_epochs: int = 1,
                          rm_lr: float = 1e-5, rm_batch_size: int = 8, rm_max_length: int = 512,
                          rm_eval_share: float = 0.1, rm_seed: int = 0, run_id: str = "demo",
                          store: str = "s3://rlhf/runs", iterations: int = 300, more: int = 0,
                          stop_at_reward: float = -1.0, budget_s: float = 0.0, config: str = "",
                          config_hash: str = "", kube_spec: dict = {}, cluster_policy: str = "keep",
                          max_retries: int = 2, kfp_host: str = "", namespace: str = "", experiment: str = "rlhf",
                          service_account: str = "rlhf-pipeline", stop_at_val: float = -1.0, pipelined: bool = True):
    trained = train_reward_model(preferences=preferences, base=reward_model_base, out=reward_model_out,
                                 epochs=rm_epochs, lr=rm_lr, batch_size=rm_batch_size, max_length=rm_max_length,
                                 eval_share=rm_eval_share, seed=rm_seed, store=store,
                                 # a retry of the task within this pipeline run continues its epochs
                                 run_id=dsl.PIPELINE_JOB_NAME_PLACEHOLDER)
    _pod_settings(trained, small=False)  # one process on its pod's CPUs (rlhf_core/trainer/preference.py)
    trained.set_retry(num_retries=2, backoff_duration="30s")  # continues after its last committed epoch
    scored = with_reward_model(config=config, config_hash=config_hash, reward_model=trained.outputs["reward_model"])
    _pod_settings(scored, small=True)
    driver = drive_finetune(run_id=run_id, store=store, iterations=iterations, more=more,
                            stop_at_reward=stop_at_reward, budget_s=budget_s, config=scored.outputs["config"],
                            config_hash=scored.outputs["config_hash"], kube_spec=kube_spec,
                            cluster_policy=cluster_policy, max_retries=max_retries, kfp_host=kfp_host,
                            namespace=namespace, experiment=experiment, service_account=service_account,
                            stop_at_val=stop_at_val, pipelined=pipelined)
    _pod_settings(driver, small=True)
    driver.set_retry(num_retries=3, backoff_duration="60s")


def compile_pipeline(path=COMPILED, pipeline=ppo_iteration) -> Path:
    compiler.Compiler().compile(pipeline, package_path=str(path))
    return Path(path)


def compile_all(folder: Path = HERE) -> list[Path]:
    return [compile_pipeline(Path(folder) / COMPILED.name, ppo_iteration),
            compile_pipeline(Path(folder) / COMPILED_KUBERAY.name, ppo_iteration_kuberay),
            compile_pipeline(Path(folder) / COMPILED_FINETUNE.name, finetune),
            compile_pipeline(Path(folder) / COMPILED_RM_FINETUNE.name, reward_model_finetune)]


if __name__ == "__main__":
    print(*compile_all(), sep="\n")
