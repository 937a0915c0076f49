"""The ``rlhf`` command.

    rlhf run [--iterations N] [--store URI] [--run-id ID] [--direct] [key=value ...]
        PPO/GRPO on the embedded default (built-in task and model, a local Ray head), each
        iteration a Kubeflow pipeline run (KFP local runner; --direct: all in this
        process); prints `metrics:`, `curve:` and `snapshots:` last.
    rlhf iterate / serve / stop-session / head   the long-lived session, piece by piece
    rlhf compile / submit / schedule             the pipeline for a Kubeflow server
    rlhf config [key=value ...]
        Print every config field with its value and documentation.
    rlhf demo
        Walk one batch through the DataProto contract on a local Ray (a quick smoke check).
"""

from __future__ import annotations

import argparse
import os
import sys


def _config(overrides: list[str]):
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides

    try:
        return apply_overrides(RunConfig(), overrides).validate()
    except ConfigError as exc:
        raise SystemExit(f"rlhf: config error: {exc}") from None


def _cmd_run(args: argparse.Namespace) -> int:
    from rlhf_core.trainer.run import run_direct

    cfg = _config(args.overrides)
    iterations = args.iterations or cfg.trainer.total_iterations
    store = args.store or _default_store(cfg)
    if not args.direct:
        return _run_pipeline(args, cfg, iterations, store)
    result = run_direct(cfg, iterations, store, args.run_id)
    rows = result["rows"]
    if rows:
        first, last = rows[0], rows[-1]
        print(f"reward: {first['critic/score/mean']:.3f} (iteration {first['iteration']}) -> "
              f"{last['critic/score/mean']:.3f} "
              f"(iteration {last['iteration']}), {last['wall_clock_s']:.0f}s of training")
    print(f"checkpoint: {result['checkpoint']}")
    print(f"metrics: {result['metrics']}")
    print(f"curve: {result['curve']}")
    print(f"snapshots: {result['snapshots']}")
    return 0


def _default_store(cfg) -> str:
    return "file://" + os.path.abspath(os.path.join(cfg.trainer.output_dir, "store"))


def _cmd_head(args: argparse.Namespace) -> int:
    from rlhf_core import ray_head

    root = args.root
    if args.action == "start":
        info = ray_head.start_head(root)
        print(f"ray head: {info.address} (pid {info.pid}); clients: RAY_AUTH_MODE=token "
              f"RAY_AUTH_TOKEN_PATH={info.token_path}")
    elif args.action == "stop":
        info = ray_head.read_head(root)
        ray_head.stop_head(info, root)
        print("ray head stopped" if info else "no ray head running under " + root)
    else:
        info = ray_head.read_head(root)
        print(f"ray head: {info.address} (pid {info.pid})" if info else "no ray head running under " + root)
    return 0


def _local_head(args, cfg):
    from rlhf_core import ray_head

    return ray_head.start_head(args.head_root or os.path.join(cfg.trainer.output_dir, "head"))


def _cmd_iterate(args: argparse.Namespace) -> int:
    from rlhf_core import ray_head, session
    from rlhf_core.trainer.run import iterate

    cfg = _config(args.overrides)
    cfg.trainer.progress = False if args.quiet else cfg.trainer.progress
    info = _local_head(args, cfg)  # reuse the running head, or start ours
    ray_head.connect(info, session.namespace_of(args.run_id))
    result = iterate(cfg, args.run_id, args.store or _default_store(cfg), info, args.iterations,
                     log=(lambda *a: None) if args.quiet else print)
    ray_head.disconnect()
    if result.get("lease_held_by"):
        print(f"lease held by {result['lease_held_by']}: another trigger is running this iteration")
    else:
        print(f"session: generation {result['session']['generation']}, job {result['session']['job_id']}")
    for row in result["rows"]:
        print(f"iteration {row['iteration']}: reward {row['critic/score/mean']:.3f}, "
              f"{row['timing_s/iteration']:.2f}s")
    print(f"metrics: {result['metrics']}")
    print(f"snapshots: {result['snapshots']}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import json

    from rlhf_core import ray_head, session
    from rlhf_core.config import config_from_dict

    if args.foreground:  # the Ray job's entrypoint: the session lives in this process
        import ray

        from_env = os.environ.get("RLHF_SESSION_CONFIG")
        cfg = config_from_dict(json.loads(from_env)) if from_env else _config(args.overrides)
        ray.init(namespace=session.namespace_of(args.run_id), log_to_driver=False, configure_logging=False)
        session.serve(cfg, args.run_id, args.store)
        return 0
    cfg = _config(args.overrides)
    info = _local_head(args, cfg)
    client = ray_head.jobs_client(info)
    job = session.submit_job(client, cfg, args.run_id, args.store or _default_store(cfg))
    session.wait_job_ready(client, job)
    print(f"session of run {args.run_id}: job {job} on {info.dashboard_url} (ready; ends after "
          f"{cfg.trainer.session_idle_timeout_s:.0f}s idle or `rlhf stop-session`)")
    return 0


def _cmd_stop_session(args: argparse.Namespace) -> int:
    from rlhf_core import ray_head, session

    info = ray_head.read_head(args.head_root)
    if info is None:
        print("no ray head running; nothing to stop")
        return 0
    ray_head.connect(info, session.namespace_of(args.run_id))
    print("session stopped" if session.stop(args.run_id, info) else "no session for run " + args.run_id)
    return 0


def _run_pipeline(args, cfg, iterations: int, store: str) -> int:
    """Each iteration as a Kubeflow pipeline run through the KFP local runner."""
    import time

    from rlhf_core import ray_head
    from rlhf_core.trainer.report import run_history
    from rlhf_core.trainer.run import plot_curve

    sys.path.insert(0, _repo_root())
    from pipelines.local import run_local_iterations

    run_id = args.run_id or time.strftime("run-%Y%m%d-%H%M%S")
    root = os.path.join(cfg.trainer.output_dir, run_id, "kfp")
    head_root = os.path.join(cfg.trainer.output_dir, "head")
    ours = ray_head.read_head(head_root) is None  # a head someone started stays up
    try:
        run_local_iterations(run_id, store, args.overrides, head_root, iterations, root)
    finally:
        if ours and not args.keep_session:
            ray_head.stop_head(ray_head.read_head(head_root), head_root)
    rows = run_history(store, run_id)
    curve = os.path.join(cfg.trainer.output_dir, run_id, "reward_curve.png")
    if rows:
        plot_curve(rows, curve)
        print(f"reward: {rows[0]['critic/score/mean']:.3f} (iteration {rows[0]['iteration']}) -> "
              f"{rows[-1]['critic/score/mean']:.3f} (iteration {rows[-1]['iteration']})")
        print(f"checkpoint: {rows[-1]['checkpoint']}")
    print(f"metrics: {os.path.join(cfg.trainer.output_dir, run_id, 'metrics.jsonl')}")
    print(f"curve: {curve}")
    print(f"pipeline runs: {root}")
    print(f"snapshots: {store.rstrip('/')}/{run_id}")
    return 0


def _remote(args):
    sys.path.insert(0, _repo_root())
    from pipelines import remote

    from components.kuberay import spec as kube
    from components.kuberay.names import KubeNameError, cluster_name

    try:  # refuse bad input here, before anything reaches the cluster
        cfg, kube_spec = kube.load_deployment(args.deployment, args.overrides)
        cluster_name(args.run_id)
    except (kube.DeploySpecError, KubeNameError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    except Exception as exc:  # ConfigError and friends
        raise SystemExit(f"rlhf: config error: {exc}") from None
    target = remote.Target(host=args.host, namespace=args.namespace, experiment=args.experiment,
                           service_account=args.service_account)
    arguments = remote.pipeline_arguments(args.run_id, args.store, args.overrides, kube_spec, args.cluster_policy)
    return remote, cfg, target, arguments


def _cmd_submit(args: argparse.Namespace) -> int:
    remote, _, target, arguments = _remote(args)
    out = remote.submit(target, arguments)
    print(f"submitted: run {out['run_id']} (experiment {out['experiment_id']}) on {args.host}: one iteration "
          f"of {args.run_id}, continuing from its last committed iteration in {args.store}")
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    remote, _, target, arguments = _remote(args)
    try:
        out = remote.schedule(target, arguments, args.cron)
    except remote.ScheduleError as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    print(f"scheduled: recurring run {out['recurring_run_id']} (experiment {out['experiment_id']}) on "
          f"{args.host}, cron '{out['cron']}': each trigger runs the next iteration of {args.run_id}")
    return 0


def _cmd_manifests(args: argparse.Namespace) -> int:
    import yaml

    sys.path.insert(0, _repo_root())
    from components.kuberay import crd, render, spec
    from components.kuberay.names import KubeNameError

    try:
        cfg, kube = spec.load_deployment(args.config, args.overrides)
        objects = render.render_all(cfg, kube, args.run_id, args.store)
        if args.crds:
            for obj in objects.values():
                crd.validate(obj, args.crds)
    except (spec.DeploySpecError, render.PoolShapeError, KubeNameError, crd.SchemaViolation) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    os.makedirs(args.out, exist_ok=True)
    for name, obj in objects.items():
        path = os.path.join(args.out, name)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(obj, f, sort_keys=False)
        print(f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}: {path}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from rlhf_core.config import ConfigError
    from rlhf_core.snapshot import SnapshotError
    from rlhf_core.trainer.replay import ReplayError, format_table, replay

    stages = None if not args.stage or args.stage == ["all"] else args.stage
    try:
        results = replay(args.uri, stages, args.iteration, args.override, args.atol, args.rtol,
                         log=lambda *a: print(*a, file=sys.stderr))
    except (ReplayError, ConfigError, SnapshotError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    print(format_table(results))
    same = [r.stage for r in results if r.ok]
    print(f"replayed {len(results)} stage(s): {len(same)} within tolerance (atol={args.atol}, rtol={args.rtol})"
          + ("" if len(same) == len(results) else f"; different: {[r.stage for r in results if not r.ok]}"))
    # a replay with overrides is expected to differ: it succeeded when it ran and was saved
    return 0 if args.override or len(same) == len(results) else 1


def _cmd_lineage(args: argparse.Namespace) -> int:
    from rlhf_core.lineage import LineageError, chain, format_lineage

    try:
        print(format_lineage(chain(args.uri), args.format))
    except LineageError as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    return 0


def _cmd_snapshots(args: argparse.Namespace) -> int:
    from rlhf_core import audit
    from rlhf_core.snapshot import SnapshotError

    try:
        print(audit.list_store(args.uri) if args.action == "ls" else audit.show(args.uri, args.uid, args.fields))
    except (SnapshotError, audit.AuditError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    return 0


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cmd_compile(args: argparse.Namespace) -> int:
    sys.path.insert(0, _repo_root())
    from pipelines.ppo_iteration import HERE, compile_all

    for path in compile_all(args.out or HERE):
        print(f"compiled: {path}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from rlhf_core.config import describe

    print(describe(_config(args.overrides)))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlhf_core.demo import run_dataproto_demo

    return run_dataproto_demo(prompts=args.prompts, n=args.n, workers=args.workers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="HybridFlow-style PPO/GRPO post-training")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run PPO/GRPO iterations on the embedded default")
    run.add_argument("--iterations", type=int, default=None, help="iterations (default trainer.total_iterations)")
    run.add_argument("--store", default=None, help="fsspec URI for snapshots and checkpoints (default runs/store)")
    run.add_argument("--run-id", default=None, help="name of the run (default: timestamped); an existing "
                     "run id continues from its last committed iteration")
    run.add_argument("--direct", action="store_true", help="run every iteration in this one process instead "
                     "of one Kubeflow pipeline run (KFP local runner) per iteration")
    run.add_argument("--keep-session", action="store_true", help="leave the local Ray head and the run's "
                     "session up afterwards (rlhf iterate / rlhf run continue on it)")
    run.add_argument("overrides", nargs="*", help="config overrides, e.g. actor.lr=1e-5 rollout.n=4")
    run.set_defaults(func=_cmd_run)

    head = sub.add_parser("head", help="start/stop/status of this project's own local Ray head")
    head.add_argument("action", choices=["start", "stop", "status"])
    head.add_argument("--root", default=os.path.join("runs", "head"), help="folder holding the head's state and token")
    head.set_defaults(func=_cmd_head)

    it = sub.add_parser("iterate", help="run iterations against the run's long-lived session")
    it.add_argument("--run-id", required=True)
    it.add_argument("--store", default=None, help="fsspec URI of the snapshot store (default runs/store)")
    it.add_argument("--iterations", type=int, default=1)
    it.add_argument("--head-root", default=None, help="folder of the local Ray head, started if absent "
                    "(default: {trainer.output_dir}/head, the one `rlhf run` uses)")
    it.add_argument("--quiet", action="store_true", help="no config dump, no progress bars")
    it.add_argument("overrides", nargs="*")
    it.set_defaults(func=_cmd_iterate)

    serve = sub.add_parser("serve", help="start the run's long-lived session as a Ray job (Jobs API)")
    serve.add_argument("--run-id", required=True)
    serve.add_argument("--store", default=None, help="where the run's checkpoints are (default runs/store)")
    serve.add_argument("--head-root", default=None, help="folder of the local Ray head, started if absent")
    serve.add_argument("--foreground", action="store_true", help=argparse.SUPPRESS)  # the job's entrypoint
    serve.add_argument("overrides", nargs="*")
    serve.set_defaults(func=_cmd_serve)

    stop = sub.add_parser("stop-session", help="kill the run's session actors")
    stop.add_argument("--run-id", required=True)
    stop.add_argument("--head-root", default=os.path.join("runs", "head"))
    stop.set_defaults(func=_cmd_stop_session)

    for name, func, text in (("submit", _cmd_submit, "run one iteration on a Kubeflow Pipelines server"),
                             ("schedule", _cmd_schedule, "a recurring run on a Kubeflow Pipelines server: "
                              "each trigger runs the next iteration")):
        remote = sub.add_parser(name, help=text)
        remote.add_argument("--host", required=True, help="the KFP API endpoint, e.g. http://ml-pipeline-ui.kubeflow")
        if name == "schedule":
            remote.add_argument("--cron", required=True, help="cron expression, 5 fields (or KFP's 6, seconds "
                                "first), e.g. '0 */2 * * *'")
        remote.add_argument("--run-id", required=True, help="the run the iterations belong to")
        remote.add_argument("--store", required=True, help="object store URI of the run, e.g. s3://bucket/runs")
        remote.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user servers)")
        remote.add_argument("--experiment", default="rlhf", help="KFP experiment the runs go to")
        remote.add_argument("--deployment", default=None, help="deployment file whose `kubernetes:` and "
                            "`resources:` sections shape the cluster (manifests/configs/)")
        remote.add_argument("--cluster-policy", default="keep", choices=["keep", "delete", "delete-on-success"],
                            help="what happens to the RayCluster when the run ends (keep: the session serves "
                            "the next iteration and ends itself when idle)")
        remote.add_argument("--service-account", default="rlhf-pipeline", help="Kubernetes service account of "
                            "the run's pods (manifests/base grants it the KubeRay rights)")
        remote.add_argument("overrides", nargs="*", help="config overrides passed to every iteration")
        remote.set_defaults(func=func)

    man = sub.add_parser("manifests", help="render the run's KubeRay RayCluster and RayJob as YAML")
    man.add_argument("--config", default=None, help="deployment file: run config sections plus a `kubernetes:` "
                     "section (default: the default run config; see manifests/configs/)")
    man.add_argument("--run-id", default="demo", help="names the cluster (normalized to a DNS-1035 label)")
    man.add_argument("--store", default="s3://rlhf/runs", help="object store URI the session restores from")
    man.add_argument("--out", required=True, help="folder for raycluster.yaml and rayjob.yaml")
    man.add_argument("--crds", default=None, help="validate against the KubeRay CRDs in this folder first")
    man.add_argument("overrides", nargs="*")
    man.set_defaults(func=_cmd_manifests)

    rep = sub.add_parser("replay", help="re-run a stage of a committed iteration from its saved input and compare")
    rep.add_argument("uri", help="{store}/{run}/iter-NNNNNN[/stage], or a run URI with --iteration")
    rep.add_argument("--stage", action="append", help="stage to replay (repeatable; `all`, or omit: every stage, "
                     "or the URI's stage)")
    rep.add_argument("--iteration", type=int, default=None)
    rep.add_argument("--override", action="append", default=[], help="config change for a what-if replay "
                     "(key=value, repeatable); the result is saved under {run}/replays/, never over the original")
    rep.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for float fields (default exact)")
    rep.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for float fields")
    rep.set_defaults(func=_cmd_replay)

    lin = sub.add_parser("lineage", help="walk from a checkpoint, snapshot or iteration back to the run's start")
    lin.add_argument("uri")
    lin.add_argument("--format", choices=["table", "json", "dot"], default="table")
    lin.set_defaults(func=_cmd_lineage)

    snaps = sub.add_parser("snapshots", help="list a store's runs, iterations and stages, or show one sample")
    snaps.add_argument("action", choices=["ls", "show"])
    snaps.add_argument("uri", help="ls: a store, run or iteration URI; show: a stage snapshot URI")
    snaps.add_argument("--uid", default=None, help="show: the prompt uid (default: the first row's)")
    snaps.add_argument("--fields", nargs="*", default=None, help="show: only these fields")
    snaps.set_defaults(func=_cmd_snapshots)

    comp = sub.add_parser("compile", help="compile the per-iteration pipeline to YAML")
    comp.add_argument("--out", default=None, help="folder for ppo_iteration.yaml and ppo_iteration_kuberay.yaml "
                      "(default: pipelines/)")
    comp.set_defaults(func=_cmd_compile)

    config = sub.add_parser("config", help="print the run config with documentation")
    config.add_argument("overrides", nargs="*")
    config.set_defaults(func=_cmd_config)

    demo = sub.add_parser("demo", help="DataProto walk-through on a local Ray")
    demo.add_argument("--prompts", type=int, default=6)
    demo.add_argument("--n", type=int, default=4)
    demo.add_argument("--workers", type=int, default=2)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
