"""The ``rlhf`` subcommands that know Kubeflow Pipelines: pipeline-mode ``run``,
``compile``, ``submit`` and ``schedule``.

``rlhf_core.cli`` finds this module through the ``rlhf.commands`` entry point
(pyproject.toml) and calls ``register``; rlhf_core itself never imports it.
"""

from __future__ import annotations

import argparse
import os


def run_pipeline(args, cfg, iterations: int, run, api) -> int:
    """Each iteration as a Kubeflow pipeline run through the KFP local runner, scheduled by
    the fine-tune driver (the one scheduler, as on a cluster) over the local stand-in of
    the KFP API. One attempt per iteration (a failed run ends the command, with the command
    that continues: its iteration resumes at the stage where it stopped)."""
    from components.driver import DriveError, Plan, drive
    from rlhf_core.config import handover
    from rlhf_core.runtime import ray_head
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.trainer.progress import ProgressLine, closing_lines
    from rlhf_core.trainer.report import run_history, write_curve

    from pipelines.local import LocalKfpStandIn, show_tail

    run_id, store = run.run_id, run.store
    root = os.path.join(cfg.trainer.output_dir, run_id, "kfp")
    head_root = ray_head.default_head_root(cfg.trainer.output_dir)
    # a head someone started by hand stays up; one this run started, or adopted from a run
    # that died, is stopped at the end
    head, ours = ray_head.adopt_or_start(head_root, owner_pid=os.getpid())
    istore, progress = IterationStore(run), ProgressLine(iterations, started=args.started)
    log_path = os.path.join(cfg.trainer.output_dir, run_id, "pipeline-runs.log")

    def show(n: int) -> None:  # the iteration the driver saw committed, from the store
        line = progress.line(n, istore.read_manifest(n)["metrics"]["critic/score/mean"])
        if cfg.trainer.progress:
            print(line, flush=True)

    def driver_says(line: str) -> None:  # who runs an iteration this run waits for: the console; the rest: the log
        if "is being run by" in line or "runs the iteration" in line:
            print(line.replace("[driver]", "[rlhf]", 1), flush=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(line + "\n")

    os.makedirs(root, exist_ok=True)
    standin = LocalKfpStandIn(head_root, root, log_path=log_path)
    # the session computes ahead after the last run too only when it outlives this command
    # the run's total when the command names one (a controller left by a killed command may
    # commit meanwhile: the total stays the total), else this many more
    total = (args.iterations if args.iterations is not None else cfg.trainer.total_iterations) \
        if args.more is None else None
    plan = Plan(run_id, store, {"run_id": run_id, "store": store, **handover(cfg)},
                iterations=total, more=None if total is not None else iterations, max_retries=0, poll_s=0.2,
                pipelined=getattr(args, "pipelined", True), prefetch_after_last=not ours or bool(args.keep_session))
    try:
        print(f"[rlhf] {iterations} iteration(s) of run {run_id}, each a pipeline run on the KFP local runner "
              f"(its output: {log_path})", flush=True)
        try:
            outcome = drive(standin, plan, "", "local", log=driver_says, on_commit=show)
        except KeyboardInterrupt:
            standin.close(wait=True)  # the runners had the signal too: let them end their components' writes
            raise
        finally:
            standin.close()
        if outcome.reason.startswith("driven by"):
            raise SystemExit(f"rlhf: run {run_id} is {outcome.reason} (another `rlhf run` of it); this command "
                             f"trained nothing: run again once it has ended")
    except DriveError as exc:
        show_tail(log_path)
        raise SystemExit(f"rlhf: {exc}; see {log_path}") from None
    finally:
        if ours and not args.keep_session:
            ray_head.stop_head(head, head_root)
        elif ours:
            ray_head.set_owner(head_root, head, 0)  # kept on request: it is the user's now
    rows = run_history(istore)
    curve = os.path.join(cfg.trainer.output_dir, run_id, "reward_curve.png")
    if rows:
        write_curve(rows, curve)
    last_weights = (rows[-1]["checkpoint"] + (f" + a redo of iterations {rows[-1]['redo']}" if rows[-1]["redo"]
                                              else "")) if rows else ""
    outputs = {"checkpoint": last_weights,
               "metrics": os.path.join(cfg.trainer.output_dir, run_id, "metrics.jsonl"), "curve": curve,
               "pipeline runs": root, "snapshots": f"{store.rstrip('/')}/{run_id}"}
    print(*closing_lines(rows, progress, outputs), sep="\n")
    return 0


def _remote(args):
    from components.kuberay import spec as kube
    from components.kuberay.names import KubeNameError, cluster_name
    from pipelines import remote

    try:  # refuse bad input here, before anything reaches the cluster
        from rlhf_core.config import config_file_items

        items = config_file_items(args.config) if getattr(args, "config", None) else []  # under the overrides
        cfg, kube_spec = kube.load_deployment(args.deployment, [*items, *args.overrides])
        cluster_name(args.run_id)
    except (kube.DeploySpecError, KubeNameError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    except Exception as exc:  # ConfigError and friends
        raise SystemExit(f"rlhf: config error: {exc}") from None
    target = remote.Target(host=args.host, namespace=args.namespace, experiment=args.experiment,
                           service_account=args.service_account)
    arguments = remote.pipeline_arguments(args.run_id, args.store, cfg, kube_spec, args.cluster_policy)
    return remote, cfg, target, arguments


def _cmd_submit(args: argparse.Namespace) -> int:
    remote, _, target, arguments = _remote(args)
    if args.iterations is not None:
        params = remote.finetune_arguments(arguments, target, iterations=args.iterations,
                                           stop_at_reward=args.stop_at_reward, budget_s=args.budget_s,
                                           stop_at_val=args.stop_at_val)
        out = remote.submit_finetune(target, params)
        print(f"submitted: fine-tune run {out['run_id']} (experiment {out['experiment_id']}) on {args.host}: "
              f"{args.run_id} up to {args.iterations} iterations in all, continuing from its last committed one")
        return 0
    out = remote.submit(target, arguments)
    print(f"submitted: run {out['run_id']} (experiment {out['experiment_id']}) on {args.host}: one iteration "
          f"of {args.run_id}, continuing from its last committed iteration in {args.store}")
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    remote, _, target, arguments = _remote(args)
    try:
        if args.iterations_per_trigger is not None:
            if args.iterations_per_trigger < 1:
                raise remote.ScheduleError(f"--iterations-per-trigger: expected a whole number >= 1, found "
                                           f"{args.iterations_per_trigger}")
            out = remote.schedule_finetune(target, remote.finetune_arguments(
                arguments, target, more=args.iterations_per_trigger), args.cron)
            print(f"scheduled: recurring run {out['recurring_run_id']} (experiment {out['experiment_id']}) on "
                  f"{args.host}, cron '{out['cron']}': each trigger trains {args.iterations_per_trigger} more "
                  f"iteration(s) of {args.run_id}")
            return 0
        out = remote.schedule(target, arguments, args.cron)
    except remote.ScheduleError as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    print(f"scheduled: recurring run {out['recurring_run_id']} (experiment {out['experiment_id']}) on "
          f"{args.host}, cron '{out['cron']}': each trigger runs the next iteration of {args.run_id}")
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from pipelines.ppo_iteration import HERE, compile_all

    for path in compile_all(args.out or HERE):
        print(f"compiled: {path}")
    return 0


def register(sub, api) -> None:
    """Add this package's subcommands to ``rlhf`` and its pipeline runner to ``rlhf run``."""
    from rlhf_core.cli_args import REQUIRED, add_run_arguments

    api.register_run_mode("pipeline", run_pipeline)
    for name, func, text in (("submit", _cmd_submit, "run one iteration on a Kubeflow Pipelines server"),
                             ("schedule", _cmd_schedule, "a recurring run on a Kubeflow Pipelines server: "
                              "each trigger runs the next iteration")):
        remote = sub.add_parser(name, help=text)
        remote.add_argument("--host", required=True, help="the KFP API endpoint, e.g. http://ml-pipeline-ui.kubeflow")
        if name == "schedule":
            remote.add_argument("--cron", required=True, help="cron expression, 5 fields (or KFP's 6, seconds "
                                "first), e.g. '0 */2 * * *'")
            remote.add_argument("--iterations-per-trigger", type=int, default=None, help="each trigger runs the "
                                "fine-tune driver for this many more iterations (default: one iteration, the "
                                "per-iteration pipeline)")
        else:
            remote.add_argument("--iterations", type=int, default=None, help="drive a whole fine-tune: the run's "
                                "total iterations (default: one iteration, the per-iteration pipeline)")
            remote.add_argument("--stop-at-reward", type=float, default=None, help="with --iterations: stop "
                                "when the mean reward of the last 5 iterations reaches this")
            remote.add_argument("--stop-at-val", type=float, default=None, help="with --iterations: stop when "
                                "the latest validation's score (mean of its val-core/* metrics; data.val_files) "
                                "reaches this")
            remote.add_argument("--budget-s", type=float, default=None, help="with --iterations: wall-clock "
                                "budget of the fine-tune in seconds")
        add_run_arguments(remote, store=REQUIRED, run_id_help="the run the iterations belong to",
                          store_help="object store URI of the run, e.g. s3://bucket/runs")
        remote.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user servers)")
        remote.add_argument("--experiment", default="rlhf", help="KFP experiment the runs go to")
        remote.add_argument("--deployment", default=None, help="deployment file whose `kubernetes:` and "
                            "`resources:` sections shape the cluster (manifests/configs/)")
        remote.add_argument("--cluster-policy", default="keep", choices=["keep", "delete", "delete-on-success"],
                            help="what happens to the RayCluster when the run ends (keep: the session serves "
                            "the next iteration and ends itself when idle)")
        remote.add_argument("--service-account", default="rlhf-pipeline", help="Kubernetes service account of "
                            "the run's pods (manifests/base grants it the KubeRay rights)")
        remote.add_argument("--config", default=None, metavar="FILE.yaml", help="a config file, ours or verl's "
                            "(nested keys, as verl's trainer writes its YAML), applied over --deployment's sections; "
                            "the overrides apply on top")
        remote.add_argument("overrides", nargs="*", help="config overrides passed to every iteration")
        remote.set_defaults(func=func)

    comp = sub.add_parser("compile", help="compile the per-iteration pipeline to YAML")
    comp.add_argument("--out", default=None, help="folder for ppo_iteration.yaml and ppo_iteration_kuberay.yaml "
                      "(default: pipelines/)")
    comp.set_defaults(func=_cmd_compile)
