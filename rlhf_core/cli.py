"""The ``rlhf`` command.

    rlhf run [--iterations N] [--store URI] [--run-id ID] [--direct] [key=value ...]
        PPO/GRPO on the embedded default (built-in task and model, a local Ray head), each
        iteration a Kubeflow pipeline run (KFP local runner; --direct: all in this
        process); prints `metrics:`, `curve:` and `snapshots:` last.
    rlhf iterate / serve / stop-session / head   the long-lived session, piece by piece
    rlhf compile / submit / schedule / manifests the pipeline for a Kubeflow server and the
        KubeRay objects: registered by `pipelines` and `components` through the
        ``rlhf.commands`` entry point (this package imports neither)
    rlhf config [key=value ...]
        Print every config field with its value and documentation.
    rlhf demo
        Walk one batch through the DataProto contract on a local Ray (a quick smoke check).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

#: How ``rlhf run`` runs iterations when not ``--direct``: filled by plugins.
RUN_MODES: dict[str, Callable] = {}
PLUGIN_GROUP = "rlhf.commands"


class PluginAPI:
    """What a plugin's ``register(subparsers, api)`` may use besides adding subcommands."""

    @staticmethod
    def register_run_mode(name: str, runner: Callable) -> None:
        """``runner(args, cfg, iterations, store, api) -> exit code`` for ``rlhf run``."""
        RUN_MODES[name] = runner

    config = staticmethod(lambda overrides: _config(overrides))
    default_store = staticmethod(lambda cfg: _default_store(cfg))


def load_plugins(sub) -> list[str]:
    """Let every installed ``rlhf.commands`` entry point add its subcommands."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        ep.load()(sub, PluginAPI)
        loaded.append(ep.name)
    return loaded


#: ``--config``'s help, for every command that takes it.
CONFIG_FILE_HELP = ("a config file, ours or verl's (nested keys, as verl's trainer writes its YAML); the overrides "
                    "apply on top")


def _config(overrides: list[str], config_file: str | None = None):
    """The config of ``--config FILE`` (ours or verl's layout; None: none) and ``overrides``."""
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides, config_file_items

    try:
        items = config_file_items(config_file, overrides) if config_file else []
        return apply_overrides(RunConfig(), [*items, *overrides]).validate()
    except ConfigError as exc:
        raise SystemExit(f"rlhf: config error: {exc}") from None


def _run_config(args: argparse.Namespace):
    """``rlhf run``'s config and provenance: ``--config FILE`` (ours or verl's layout), then
    the overrides. Resolved here, once: every process an iteration starts (pipeline
    components, the session) is handed this config as data (``config.handover``)."""
    from rlhf_core.config import ConfigError, load_config

    try:
        cfg, provenance = load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise SystemExit(f"rlhf: config error: {exc}") from None
    return cfg, provenance


def _save_provenance(cfg, run_id: str, provenance: dict) -> None:
    """Where each value came from, beside the run's config.json (not part of the config or its hash)."""
    import json
    from pathlib import Path

    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=1))


def _check_model_path(cfg) -> None:
    """A model folder this machine lacks fails here, in one line, before any Ray process starts."""
    from rlhf_core.workers.modeling import ModelPathError, resolve_model_path

    from rlhf_core.data import fetch

    if fetch.is_remote(cfg.model.path):  # the nodes fetch it; here only check that it is there
        try:
            _, _, entries = fetch.listing(cfg.model.path, "model.path", weights=False)
        except fetch.FetchError as exc:
            raise SystemExit(f"rlhf: {exc}") from None
        if not any(e.name == "config.json" for e in entries):
            raise SystemExit(f"rlhf: model.path: expected a Hugging Face model folder with config.json; found "
                             f"{len(entries)} object(s) at {cfg.model.path} and no config.json")
    elif not cfg.model.path.startswith("builtin:"):
        try:
            resolve_model_path(cfg.model.path, cfg.trainer.seed)
        except ModelPathError as exc:
            raise SystemExit(f"rlhf: {exc}") from None


def _new_run_id() -> str:
    from rlhf_core.record.run_ids import new_run_id

    return new_run_id()


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``, a container or a job scheduler stopping ``rlhf run``): handled
    as Ctrl-C is, once the processes this one started are ended (see ``_on_sigterm``)."""


def _on_sigterm(end_children: bool):
    """The SIGTERM handler of ``rlhf run``. Unlike Ctrl-C, which the terminal sends to the
    whole foreground group, SIGTERM reached this process alone. With ``end_children`` (a
    pipeline-mode run) its children in its own session are SIGKILLed, with all under them
    (the runners, the components and their controllers: a controller left running would
    hold its iteration's lease), before the exception unwinds: unwinding can wait on them
    (``subprocess.Popen.__exit__`` waits for its child on any exception but
    KeyboardInterrupt itself). A direct run's children are its own Ray's processes, which
    its exit handler shuts down in order; a Ray head the run started is in a session of its
    own and is left to the command's cleanup, which stops it or keeps it. The handler acts
    once: a second SIGTERM while the first unwinds is ignored, not raised mid-cleanup."""
    import psutil  # noqa: F401 - imported now, not in the handler

    from rlhf_core.runtime.processes import kill_tree  # noqa: F401 - likewise

    fired = []

    def handler(signum, frame) -> None:
        if fired:
            return
        fired.append(signum)
        if end_children:
            _kill_own_session_children()
        raise Terminated()

    handler.fired = fired  # the run reads it: code under it may turn Terminated into a plain KeyboardInterrupt
    return handler


def _kill_own_session_children() -> None:
    import psutil

    from rlhf_core.runtime.processes import kill_tree

    own_session = os.getsid(0)
    for child in psutil.Process().children():
        try:
            if os.getsid(child.pid) == own_session:
                kill_tree(child.pid)
        except OSError:
            continue


def _cmd_run(args: argparse.Namespace) -> int:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread only)
        return _run(args)
    handler = _on_sigterm(end_children=not args.direct)
    args.sigterm_fired = handler.fired
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        return _run(args)
    except Terminated:  # before the run began (config, store, model checks): nothing to continue yet
        print("rlhf: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:  # (None: a handler not installed from Python, which cannot be put back)
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    args.started = time.monotonic()  # wall time reported at the end counts from here
    from rlhf_core.trainer.progress import ProgressLine, closing_lines
    from rlhf_core.record.lease import CLOCK_SKEW_MARGIN_S, CONTROLLER_TTL_S, LeaseHeld
    from rlhf_core.record.checkpoints import iterations_to_run
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.run import run_direct
    from rlhf_core.checkpoint.reader import CheckpointRefusedError
    from rlhf_core.config import ConfigError
    from rlhf_core.snapshot import SnapshotError

    cfg, provenance = _run_config(args)
    _check_model_path(cfg)
    args.run_id = args.run_id or _new_run_id()
    store = args.store or _default_store(cfg)
    if args.more is not None and args.iterations is not None:
        raise SystemExit("rlhf: --iterations (the run's total) and --more (iterations to add) exclude each other")
    if cfg.trainer.total_epochs and provenance["trainer.total_iterations"] == "default":
        from rlhf_core.data.dataset import DatasetError
        from rlhf_core.trainer.loaders import total_iterations

        try:  # verl's len(dataloader) * total_epochs; every iteration's process is told the total
            cfg.trainer.total_iterations = total_iterations(cfg)
        except DatasetError as exc:
            raise SystemExit(f"rlhf: {exc}") from None
        provenance["trainer.total_iterations"] = provenance["trainer.total_epochs"]
    _save_provenance(cfg, args.run_id, provenance)
    total = None if args.more is not None else (args.iterations if args.iterations is not None
                                                 else cfg.trainer.total_iterations)
    try:
        run = RunRef(store, args.run_id)
        committed, iterations = iterations_to_run(IterationStore(run), total, args.more)
    except ValueError as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    if iterations == 0:
        print(f"run {args.run_id} has {committed} committed iteration(s), its total is {total}: nothing to do "
              f"(add iterations with --more N)")
        print(f"snapshots: {store.rstrip('/')}/{args.run_id}")
        return 0
    if committed:
        print(f"run {args.run_id}: {committed} iteration(s) committed, {iterations} to run")
    if not args.direct and "pipeline" not in RUN_MODES:
        raise SystemExit("rlhf: running iterations as pipeline runs needs the `pipelines` package (installed "
                         "with rlhf-core; its `rlhf.commands` entry point is missing); use --direct")
    from rlhf_core.data.dataset import DatasetError
    from rlhf_core.trainer.preflight import PreflightError, check_inputs
    from rlhf_core.workers.modeling import ModelPathError

    try:  # before any worker is placed or pipeline run started
        check_inputs(cfg)
    except (DatasetError, PreflightError, ModelPathError, OSError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    try:
        if not args.direct:
            return RUN_MODES["pipeline"](args, cfg, iterations, run, PluginAPI)
        result = run_direct(cfg, iterations, run)
    except KeyboardInterrupt as stop:
        # (a library under the run, Ray's for one, may catch ours and raise a KeyboardInterrupt of its own)
        terminated = isinstance(stop, Terminated) or bool(getattr(args, "sigterm_fired", ()))
        print(_interrupted(args, cfg, store, committed + iterations, "terminated" if terminated else "interrupted"),
              file=sys.stderr)
        return 143 if terminated else 130  # 128 + the signal's number, as a shell reports it
    except LeaseHeld as held:
        raise SystemExit(f"rlhf: iteration {committed} of run {args.run_id} is being run by {held}; nothing was "
                         f"written: run again once it has ended (a holder that stopped renewing its lease loses it "
                         f"after {CONTROLLER_TTL_S + CLOCK_SKEW_MARGIN_S:.0f}s)") from None
    # a checkpoint changed after its commit (nothing of it was loaded), a damaged snapshot, a
    # reward model or teacher changed since the run began: one line, nothing more written
    except (CheckpointRefusedError, SnapshotError, ConfigError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    rows = result["rows"]
    progress = ProgressLine(len(rows), started=args.started)
    for row in rows:  # the pace the run had, from its rows
        progress.ends.append(result["started"] + row["wall_clock_s"])
        progress.rewards.append(row["critic/score/mean"])
    outputs = {name: result[name] for name in ("checkpoint", "metrics", "curve", "snapshots")}
    print(*closing_lines(rows, progress, outputs, training_s=rows[-1]["wall_clock_s"] if rows else None), sep="\n")
    return 0


def _interrupted(args, cfg, store: str, total: int, how: str = "interrupted") -> str:
    """The one line a stopped run ends with: what the store kept and how to go on."""
    import shlex

    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.stages import persisted_names

    again = ["rlhf", "run", "--run-id", args.run_id, "--iterations", str(total), *(["--direct"] if args.direct else []),
             *(["--store", args.store] if args.store else []), *(["--config", args.config] if args.config else []),
             *args.overrides]
    try:
        istore = IterationStore(RunRef(store, args.run_id))
        n = len(istore.committed_iterations())
        stages = [name for name in persisted_names(cfg, n) if istore.has(n, name)]
    except Exception as exc:  # noqa: BLE001 - the store is unreachable: say so, the command still holds
        kept = f"(the store could not be read: {type(exc).__name__})"
    else:
        kept = f"{n} committed iteration(s)" + (f" and iteration {n}'s finished stages ({', '.join(stages)})"
                                               if stages else "")
    return f"rlhf: {how}; run {args.run_id} keeps {kept}; continue with: {shlex.join(again)}"


def _default_store(cfg) -> str:
    return "file://" + os.path.abspath(os.path.join(cfg.trainer.output_dir, "store"))


def _cmd_head(args: argparse.Namespace) -> int:
    from rlhf_core.runtime import ray_head

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
    from rlhf_core.runtime import ray_head

    return ray_head.start_head(args.head_root or ray_head.default_head_root(cfg.trainer.output_dir))


def _cmd_iterate(args: argparse.Namespace) -> int:
    from rlhf_core.runtime import ray_head
    from rlhf_core.session import session
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.session.iteration import iterate

    cfg = _config(args.overrides, getattr(args, "config", None))
    cfg.trainer.progress = False if args.quiet else cfg.trainer.progress
    info = _local_head(args, cfg)  # reuse the running head, or start ours
    ray_head.connect(info, session.namespace_of(args.run_id))
    istore = IterationStore(RunRef(args.store or _default_store(cfg), args.run_id))
    result = iterate(cfg, istore, info, args.iterations, log=(lambda *a: None) if args.quiet else print)
    ray_head.disconnect()
    if result.get("lease_held_by"):
        print(f"lease held by {result['lease_held_by']}: another trigger is running this iteration")
    else:
        print(f"session: generation {result['session']['generation']}, job {result['session']['job_id']}")
    for note in result.get("prefetch", []):
        print(note)
    for row in result["rows"]:
        print(f"iteration {row['iteration']}: reward {row['critic/score/mean']:.3f}, "
              f"{row['timing_s/iteration']:.2f}s")
    print(f"metrics: {result['metrics']}")
    print(f"snapshots: {result['snapshots']}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import json

    from rlhf_core.runtime import ray_head
    from rlhf_core.session import session
    from rlhf_core.config import config_from_dict
    from rlhf_core.record.run_layout import RunRef

    if args.foreground:  # the Ray job's entrypoint: the session lives in this process
        from rlhf_core.config import ConfigError

        from_env = os.environ.get("RLHF_SESSION_CONFIG")
        try:
            cfg = config_from_dict(json.loads(from_env)).validate() if from_env else \
                _config(args.overrides, getattr(args, "config", None))
        except (ConfigError, ValueError) as exc:
            raise SystemExit(f"rlhf: session config: {exc}") from None
        session.load_credentials_file(os.environ.get("RLHF_CREDENTIALS_FILE"))
        import ray  # after the config is checked: a bad one is refused in a moment

        ray.init(namespace=session.namespace_of(args.run_id), log_to_driver=False, configure_logging=False)
        session.serve(cfg, RunRef(args.store, args.run_id))
        return 0
    cfg = _config(args.overrides, getattr(args, "config", None))
    info = _local_head(args, cfg)
    client = ray_head.jobs_client(info)
    job = session.submit_job(client, cfg, RunRef(args.store or _default_store(cfg), args.run_id), info)
    session.wait_job_ready(client, job)
    print(f"session of run {args.run_id}: job {job} on {info.dashboard_url} (ready; ends after "
          f"{cfg.trainer.session_idle_timeout_s:.0f}s idle or `rlhf stop-session`)")
    return 0


def _cmd_stop_session(args: argparse.Namespace) -> int:
    from rlhf_core.runtime import ray_head
    from rlhf_core.session import session
    info = ray_head.read_head(args.head_root)
    if info is None:
        print("no ray head running; nothing to stop")
        return 0
    ray_head.connect(info, session.namespace_of(args.run_id))
    stopped = session.stop(args.run_id, info)
    print(f"session stopped: {stopped}" if stopped else "no session for run " + args.run_id)
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from rlhf_core.config import ConfigError
    from rlhf_core.snapshot import SnapshotError
    from rlhf_core.trainer.replay import ReplayError, format_table, replay
    from rlhf_core.checkpoint.reader import CheckpointRefusedError

    stages = None if not args.stage or args.stage == ["all"] else args.stage
    try:
        results = replay(args.uri, stages, args.iteration, args.override, args.atol, args.rtol,
                         log=lambda *a: print(*a, file=sys.stderr), trust_reward_function=args.trust_reward_function)
    except (ReplayError, ConfigError, SnapshotError, CheckpointRefusedError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    print(format_table(results))
    same = [r.stage for r in results if r.ok]
    print(f"replayed {len(results)} stage(s): {len(same)} within tolerance (atol={args.atol}, rtol={args.rtol})"
          + ("" if len(same) == len(results) else f"; different: {[r.stage for r in results if not r.ok]}"))
    # a replay with overrides is expected to differ: it succeeded when it ran and was saved
    return 0 if args.override or len(same) == len(results) else 1


def _cmd_lineage(args: argparse.Namespace) -> int:
    from rlhf_core.record.lineage import LineageError, chain_across_runs, format_runs

    try:
        print(format_runs(chain_across_runs(args.uri), args.format))
    except LineageError as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    return 0


def _run_tokenizer(config: dict):
    """The tokenizer of a run's model, from its config (its weights are not fetched)."""
    from rlhf_core.workers import modeling

    path = modeling.resolve_model_path(config["model"]["path"], config["trainer"]["seed"], progress=False,
                                      weights=False)
    return modeling.load_tokenizer(path)


def _cmd_snapshots(args: argparse.Namespace) -> int:
    from rlhf_core.record import audit
    from rlhf_core.snapshot import SnapshotError

    try:
        print(audit.list_store(args.uri) if args.action == "ls"
              else audit.show(args.uri, args.uid, args.fields, tokenizer_for=_run_tokenizer))
    except (SnapshotError, audit.AuditError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from rlhf_core.export import ExportError, export_checkpoint
    from rlhf_core.snapshot import SnapshotError
    from rlhf_core.checkpoint.reader import CheckpointRefusedError
    from rlhf_core.workers.modeling import ModelPathError

    try:
        record = export_checkpoint(args.uri, args.out, merged=args.merged)
    except (ExportError, ModelPathError, SnapshotError, CheckpointRefusedError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    print(f"exported step {record['global_step']} of {args.uri} to {args.out} "
          f"(weights sha256 {record['weights_sha256'][:16]}...)")
    return 0


def _cmd_reward_model_train(args: argparse.Namespace) -> int:
    from rlhf_core.checkpoint.reader import CheckpointRefusedError
    from rlhf_core.data.preferences import PreferenceDataError
    from rlhf_core.record.manifest_schema import ManifestError
    from rlhf_core.trainer.preference import RewardModelTraining, RewardModelTrainingError, train_reward_model_to
    from rlhf_core.workers.modeling import ModelPathError

    spec = RewardModelTraining(data=args.data, base=args.base, out=args.out, epochs=args.epochs, lr=args.lr,
                               batch_size=args.batch_size, max_length=args.max_length, eval_share=args.eval_share,
                               seed=args.seed, skip_bad_rows=args.skip_bad_rows,
                               remove_padding=not args.no_remove_padding, store=args.store, run_id=args.run_id)
    try:
        train_reward_model_to(spec)  # --out: a folder, or an object-store prefix
    except (PreferenceDataError, RewardModelTrainingError, ModelPathError, ManifestError,
            CheckpointRefusedError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from rlhf_core.record import retention, run_layout
    from rlhf_core.config import ConfigError, apply_overrides, config_from_dict
    from rlhf_core.snapshot import SnapshotError
    from rlhf_core.record.iteration_store import IterationStore

    uri = args.uri.rstrip("/")
    if not args.grace_s >= retention.MIN_GRACE_S:  # before anything is read: a refusal, not a plan
        raise SystemExit(f"rlhf: --grace-s: expected at least {retention.MIN_GRACE_S:g} (anything younger may "
                         f"be a write still under way); found {args.grace_s:g}")
    try:
        istore = IterationStore(run_layout.RunRef.from_uri(uri))
        committed = istore.committed_iterations()
        if not committed:
            raise SystemExit(f"rlhf: {uri}: no committed iteration; expected a run URI ({{store}}/{{run_id}})")
        # a reward model's training records no run config: its policy is the overrides' alone
        cfg = config_from_dict(istore.read_manifest(committed[-1], format=None).get("config") or {})
        policy = retention.RetentionPolicy.from_config(apply_overrides(cfg, args.overrides).validate())
        plan = retention.collect(uri, policy, grace_s=args.grace_s, dry_run=args.dry_run)
    except (ConfigError, SnapshotError, ValueError) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    print(f"policy: {policy} (grace {args.grace_s:g}s)")
    print(retention.format_plan(plan, args.dry_run, istore.run_uri))  # the plan's URIs are resolved ones
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from rlhf_core.config import describe, fields_where

    cfg = _config(args.overrides, getattr(args, "config", None))
    if args.verl:
        from rlhf_core.verl_keys import table_text

        print(table_text(set(fields_where(lambda meta: True))))
        return 0
    if args.handover:
        import json

        from rlhf_core.config import handover

        print(json.dumps(handover(cfg), indent=1, sort_keys=True))
        return 0
    print(describe(cfg))
    return 0


def _cmd_rlhf_demo(args: argparse.Namespace) -> int:
    """Preferences from a simulated annotator -> a reward model trained on them -> PPO
    scored by it (the same iterations as ``rlhf run``), the task's own score logged beside
    the model's. With ``--rounds R`` (iterated RLHF), each later round asks the annotator
    about the current policy's responses (beside other models'), continues the reward model's training on
    every pair so far, and continues PPO from the round's policy in a run of its own.
    Each phase's output is kept in ``--out`` and reused when it is there."""
    from pathlib import Path

    from rlhf_core.data.preferences import PreferenceDataError
    from rlhf_core.trainer.preference import RewardModelTrainingError

    out = Path(args.out or f"runs/rlhf-demo-seed{args.seed}").resolve()  # manifests record the model's path
    out.mkdir(parents=True, exist_ok=True)
    if args.rounds < 1:
        raise SystemExit(f"rlhf: --rounds: expected at least 1; found {args.rounds}")
    iterations = args.iterations
    if args.rounds > 1:
        iterations = args.iterations or 60
        if iterations % args.rounds:
            raise SystemExit(f"rlhf: --iterations: expected a multiple of --rounds ({args.rounds}); found {iterations}")
    # later rounds name their runs and read the one before: fixed ids and one store
    base_id = args.run_id or (f"rlhf-demo-seed{args.seed}" if args.rounds > 1 else None)
    store = args.store or (f"file://{out / 'store'}" if args.rounds > 1 else None)
    for r in range(args.rounds):
        try:
            policy, reward_model = _rlhf_demo_round(args, out, r, store, base_id)
        except (PreferenceDataError, RewardModelTrainingError) as exc:
            raise SystemExit(f"rlhf: {exc}") from None
        run_id = base_id if args.rounds == 1 else f"{base_id}-round{r}"
        run = build_parser().parse_args(
            ["run", *(["--direct"] if args.direct else []),
             *(["--iterations", str(iterations // args.rounds)] if iterations else []),
             *(["--run-id", run_id] if run_id else []), *(["--store", store] if store else []),
             f"trainer.seed={args.seed}", "reward_model.enable=true", f"reward_model.model.path={reward_model}",
             # a later round's policy starts where the last ended, and is its reference
             "reward_model.log_function_score=true", *([f"model.path={policy}"] if r else []), *args.overrides])
        code = _cmd_run(run)
        if code:
            return code
    if args.rounds > 1:
        from rlhf_core.demo import write_rounds_curve

        print(f"[rlhf-demo] every round's curve: {write_rounds_curve(out, store, base_id, args.rounds)}")
    return 0


def _rlhf_demo_round(args: argparse.Namespace, out, r: int, store: str | None, base_id: str | None):
    """Round ``r``'s policy to start from and its reward model, made if not there yet."""
    import json

    from rlhf_core.demo import export_round_policy, simulated_preferences
    from rlhf_core.models.builtin import builtin_model_path
    from rlhf_core.trainer.preference import RewardModelTraining, train_reward_model
    from rlhf_core.workers.reward_model import PROVENANCE

    suffix = f"-round{r}" if r else ""
    policy = builtin_model_path(seed=args.seed, progress=True) if r == 0 else \
        export_round_policy(store, f"{base_id}-round{r - 1}", out / f"policy-round{r}")
    pairs = out / f"preferences{suffix}.jsonl"
    if not pairs.exists():
        # a later round: the round's policy in place of the first, on prompts of the round's own
        # draw; the other models' responses stay (a collapsed policy's pairs are mostly ties, and
        # its short answers are learnt bad only beside a whole one)
        rows, counts = simulated_preferences(policy, args.prompts if r == 0 else args.round_prompts,
                                             args.seed + 1000 * r, noise=args.noise, degenerate=args.degenerate)
        earlier = (out / (f"preferences-round{r - 1}.jsonl" if r > 1 else "preferences.jsonl")).read_text() \
            if r else ""
        partial = pairs.with_name(pairs.name + ".partial")  # a kill mid-write leaves no short file to reuse
        partial.write_text(earlier + "".join(json.dumps(row) + "\n" for row in rows))  # every pair so far
        partial.replace(pairs)
        print(f"[rlhf-demo] round {r}: {counts['pairs']} new preference pairs from the simulated annotator "
              f"({counts['flipped']} labels flipped, {counts['ties_skipped']} ties and {counts['empty_skipped']} "
              f"empty responses passed on): {pairs}")
    reward_model = out / f"reward-model{suffix}"
    if not (reward_model / PROVENANCE).exists():
        rm_id = f"{args.run_id}-rm" if args.run_id else f"rm-demo-seed{args.seed}"
        train_reward_model(RewardModelTraining(
            data=str(pairs), base=policy if r == 0 else str(out / f"reward-model{f'-round{r - 1}' if r > 1 else ''}"),
            out=str(reward_model), epochs=args.rm_epochs if r == 0 else args.round_rm_epochs, lr=args.rm_lr,
            batch_size=64, eval_share=0.05, max_length=16, seed=args.seed,
            store=args.store or str(out / "store"),
            run_id=rm_id + suffix))  # continued if killed; apart from other demos' in one store
    return policy, reward_model


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlhf_core.demo import run_dataproto_demo

    return run_dataproto_demo(prompts=args.prompts, n=args.n, workers=args.workers)


def build_parser() -> argparse.ArgumentParser:
    from rlhf_core.cli_args import ABSENT, Parser, add_run_arguments, run_uri, store_uri
    from rlhf_core.runtime.ray_head import default_head_root

    parser = Parser(prog="rlhf", description="HybridFlow-style PPO/GRPO post-training")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run PPO/GRPO iterations on the embedded default")
    run.add_argument("--iterations", type=int, default=None, help="the run's total iterations (default "
                     "trainer.total_iterations); running the same command again finishes the run, then does "
                     "nothing")
    run.add_argument("--more", type=int, default=None, help="train this many iterations more than the run has")
    add_run_arguments(run, run_id=None, run_id_help="name of the run (default: timestamped); an existing run "
                      "id continues from its last committed iteration")
    run.add_argument("--direct", action="store_true", help="run every iteration in this one process instead "
                     "of one Kubeflow pipeline run (KFP local runner) per iteration")
    run.add_argument("--keep-session", action="store_true", help="leave the local Ray head and the run's "
                     "session up afterwards (rlhf iterate / rlhf run continue on it)")
    run.add_argument("--no-pipelining", dest="pipelined", action="store_false", help="start an iteration's "
                     "pipeline run only once the one before it has ended (by default it starts while the one "
                     "before runs its stages, and waits for its commit; the results are the same)")
    run.add_argument("--config", default=None, metavar="FILE.yaml", help=CONFIG_FILE_HELP)
    run.add_argument("overrides", nargs="*", help="config overrides, ours or verl's, e.g. actor.lr=1e-5 "
                     "rollout.n=4 actor_rollout_ref.rollout.n=4 (rlhf config --verl)")
    run.set_defaults(func=_cmd_run)

    head = sub.add_parser("head", help="start/stop/status of this project's own local Ray head")
    head.add_argument("action", choices=["start", "stop", "status"])
    head.add_argument("--root", default=default_head_root(), help="folder holding the head's state and token "
                      "(default: {trainer.output_dir}/head, the one every command uses)")
    head.set_defaults(func=_cmd_head)

    it = sub.add_parser("iterate", help="run iterations against the run's long-lived session")
    add_run_arguments(it, head_root=None)
    it.add_argument("--iterations", type=int, default=1)
    it.add_argument("--quiet", action="store_true", help="no config dump, no progress bars")
    it.add_argument("--config", default=None, metavar="FILE.yaml", help=CONFIG_FILE_HELP)
    it.add_argument("overrides", nargs="*")
    it.set_defaults(func=_cmd_iterate)

    serve = sub.add_parser("serve", help="start the run's long-lived session as a Ray job (Jobs API)")
    add_run_arguments(serve, head_root=None)
    serve.add_argument("--foreground", action="store_true", help=argparse.SUPPRESS)  # the job's entrypoint
    serve.add_argument("--config", default=None, metavar="FILE.yaml", help=CONFIG_FILE_HELP)
    serve.add_argument("overrides", nargs="*")
    serve.set_defaults(func=_cmd_serve)

    stop = sub.add_parser("stop-session", help="kill the run's session actors")
    add_run_arguments(stop, store=ABSENT, head_root=default_head_root())
    stop.set_defaults(func=_cmd_stop_session)

    rep = sub.add_parser("replay", help="re-run a stage of a committed iteration from its saved input and compare")
    rep.add_argument("uri", metavar="URI", type=run_uri,
                     help="{store}/{run}/iter-NNNNNN[/stage], or a run URI with --iteration")
    rep.add_argument("--stage", action="append", help="stage to replay (repeatable; `all`, or omit: every stage, "
                     "or the URI's stage)")
    rep.add_argument("--iteration", type=int, default=None)
    rep.add_argument("--override", action="append", default=[], help="config change for a what-if replay "
                     "(key=value, repeatable); the result is saved under {run}/replays/, never over the original")
    rep.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for float fields (default exact)")
    rep.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for float fields")
    rep.add_argument("--trust-reward-function", action="store_true", help="import and run the manifest's "
                     "reward.function even when it is neither built in nor registered by an installed package "
                     "(entry points rlhf.rewards): it is code, chosen by whoever wrote the run")
    rep.set_defaults(func=_cmd_replay)

    lin = sub.add_parser("lineage", help="walk from a checkpoint, snapshot or iteration back to the run's start")
    lin.add_argument("uri", metavar="URI", type=run_uri, help="a run, iteration, stage snapshot or checkpoint "
                     "URI: {store}/{run}[/iter-NNNNNN[/stage] | /checkpoints/step-SSSSSS]")
    lin.add_argument("--format", choices=["table", "json", "dot"], default="table")
    lin.set_defaults(func=_cmd_lineage)

    snaps = sub.add_parser("snapshots", help="list a store's runs, iterations and stages, or show one sample")
    snaps.add_argument("action", choices=["ls", "show"])
    snaps.add_argument("uri", metavar="URI", type=store_uri,
                       help="ls: a store, run or iteration URI; show: a stage snapshot URI")
    snaps.add_argument("--uid", default=None, help="show: the prompt uid (default: the first row's)")
    snaps.add_argument("--fields", nargs="*", default=None, help="show: only these fields")
    snaps.set_defaults(func=_cmd_snapshots)

    export = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model folder")
    export.add_argument("uri", metavar="URI", type=store_uri,
                        help="a checkpoint URI (an iteration manifest's checkpoint_uri)")
    export.add_argument("--out", required=True, help="a new or empty folder")
    export.add_argument("--merged", action="store_true",
                        help="a LoRA run: the base with the adapter merged in (default: the PEFT adapter folder)")
    export.set_defaults(func=_cmd_export)

    rm = sub.add_parser("reward-model", help="train a reward model from preference pairs")
    rm_sub = rm.add_subparsers(dest="action", required=True)
    train = rm_sub.add_parser("train", help="Bradley-Terry training of a one-label sequence classifier; writes a "
                                            "folder reward_model.model.path takes, with its data's URI and sha256")
    train.add_argument("--data", required=True, help="preference pairs: .parquet or .jsonl with prompt, chosen, "
                                                     "rejected (text or chat messages; TRL's and OpenRLHF's layouts)")
    train.add_argument("--base", required=True, help="a causal LM folder (a new score head is added) or a one-label "
                                                     "classifier; a path, an s3:// / gs:// folder, or builtin:digits")
    train.add_argument("--out", required=True, help="the reward model folder to write")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--lr", type=float, default=1e-5)
    train.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    train.add_argument("--max-length", type=int, default=512, help="tokens per side (a longer one keeps its end)")
    train.add_argument("--eval-share", type=float, default=0.1, help="share of the pairs held out for accuracy")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--skip-bad-rows", action="store_true",
                       help="count and skip pairs with a missing, empty or identical side instead of refusing")
    train.add_argument("--no-remove-padding", action="store_true",
                       help="padded forwards (by default each batch's sides are packed without padding)")
    add_run_arguments(train, run_id=None, store="runs/store",
                      run_id_help="the training run's id (default: a new rm-... id); an existing run continues "
                                  "after its last committed epoch",
                      store_help="fsspec URI of the store that records each epoch: scored pairs, checkpoint, "
                                 "manifest (default runs/store)")
    train.set_defaults(func=_cmd_reward_model_train)

    from rlhf_core.record.retention import MIN_GRACE_S

    gc = sub.add_parser("gc", help="remove what a run's retention policy lets go, orphaned writes, dead leases")
    gc.add_argument("uri", metavar="URI", type=run_uri, help="a run URI: {store}/{run_id}")
    gc.add_argument("overrides", nargs="*", help="policy overrides, e.g. trainer.keep_checkpoints=2 "
                                                 "(default: the run's own config)")
    gc.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    gc.add_argument("--grace-s", type=float, default=3600.0,
                    help="orphaned writer prefixes, scratch files, incomplete uploads and leases younger "
                         f"than this stay (a writer may be live); at least {MIN_GRACE_S:g}, by the store's clock")
    gc.set_defaults(func=_cmd_gc)

    config = sub.add_parser("config", help="print the run config with documentation")
    config.add_argument("--verl", action="store_true", help="print the table of verl's keys: what each becomes here")
    config.add_argument("--handover", action="store_true",
                        help="print the resolved config and its hash as JSON: a pipeline run's `config` and "
                             "`config_hash` parameters")
    config.add_argument("--config", default=None, metavar="FILE.yaml", help=CONFIG_FILE_HELP)
    config.add_argument("overrides", nargs="*")
    config.set_defaults(func=_cmd_config)

    rd = sub.add_parser("rlhf-demo", help="the built-in task with a learned reward: simulated preferences, a "
                                          "reward model trained on them, PPO scored by it")
    rd.add_argument("--seed", type=int, default=0)
    rd.add_argument("--prompts", type=int, default=20000, help="prompts the annotator sees (two responses each)")
    rd.add_argument("--noise", type=float, default=0.1, help="the share of labels the annotator gets wrong")
    rd.add_argument("--degenerate", type=float, default=0.0,
                    help="of the other models' responses, the share that copy, reorder or repeat the prompt's digits")
    rd.add_argument("--rm-epochs", type=int, default=6)
    rd.add_argument("--rm-lr", type=float, default=3e-4)
    rd.add_argument("--out", default=None, help="where the preferences and the reward model go (default "
                                                "runs/rlhf-demo-seed<seed>; reused when there)")
    rd.add_argument("--iterations", type=int, default=None, help="PPO iterations in all (with --rounds: default 60, "
                                                                 "shared equally by the rounds)")
    rd.add_argument("--rounds", type=int, default=1, help="iterated RLHF: after each round's PPO, preferences on "
                    "that policy's responses (beside the other models'), the reward model trained on every pair so "
                    "far, PPO continued from that policy (a run per round, <run-id>-round<R>)")
    rd.add_argument("--round-prompts", type=int, default=4000, help="prompts the annotator sees in each later round")
    rd.add_argument("--round-rm-epochs", type=int, default=1, help="reward-model epochs in each later round")
    rd.add_argument("--direct", action="store_true", help="as rlhf run --direct")
    from rlhf_core.cli_args import run_id as run_id_type

    rd.add_argument("--run-id", default=None, type=run_id_type)
    rd.add_argument("--store", default=None, type=store_uri)
    rd.add_argument("overrides", nargs="*", help="config overrides for the PPO run")
    rd.set_defaults(func=_cmd_rlhf_demo)

    demo = sub.add_parser("demo", help="DataProto walk-through on a local Ray")
    demo.add_argument("--prompts", type=int, default=6)
    demo.add_argument("--n", type=int, default=4)
    demo.add_argument("--workers", type=int, default=2)
    demo.set_defaults(func=_cmd_demo)
    load_plugins(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names; every failure ends it with one line ``rlhf: ...``.

    Arguments are checked while parsing (``cli_args``: run ids and URIs before any path,
    process or request exists). Bad data met later (a damaged manifest, a run id inside a
    URI) ends in its own one-line message; anything else a command did not expect ends in
    one line naming the exception, and ``RLHF_DEBUG=1`` shows its traceback. The session's
    job (``serve --foreground``) keeps its tracebacks: its log is where they are read.
    KeyboardInterrupt is not an error here (``rlhf run`` says what it kept)."""
    from rlhf_core.cli_args import one_line
    from rlhf_core.record.run_ids import RunIdError, StoreUriError
    from rlhf_core.record.manifest_schema import ManifestError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SystemExit as exc:  # the commands' own one-line errors, kept to one line
        raise SystemExit(one_line(exc.code) if isinstance(exc.code, str) else exc.code) from None
    except (RunIdError, StoreUriError, ManifestError) as exc:
        raise SystemExit(f"rlhf: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the last guard: one line, the traceback on request
        if os.environ.get("RLHF_DEBUG") or getattr(args, "foreground", False):
            raise
        raise SystemExit(f"rlhf: {args.command} failed: {type(exc).__name__}: {one_line(exc) or '(no message)'} "
                         f"(run again with RLHF_DEBUG=1 for the traceback)") from None
    except BaseException as exc:
        # torch.distributed.checkpoint's failures are BaseExceptions: the cause per rank,
        # in one line (a full disk, an S3 error), not its traceback of every rank
        failures = getattr(exc, "failures", None)
        if type(exc).__name__ != "CheckpointException" or not isinstance(failures, dict) or \
                os.environ.get("RLHF_DEBUG") or getattr(args, "foreground", False):
            raise
        causes = "; ".join(f"rank {rank}: {type(pair[0]).__name__}: {one_line(pair[0])}"
                           for rank, pair in sorted(failures.items()))
        raise SystemExit(f"rlhf: {args.command} failed: the checkpoint could not be written or read ({causes}) "
                         f"(run again with RLHF_DEBUG=1 for the traceback)") from None


if __name__ == "__main__":
    sys.exit(main())
