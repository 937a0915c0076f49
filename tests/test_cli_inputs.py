"""Bad input ends in one line, before anything is resolved: every argument that names a run
or a URI in a store is checked where it enters (each `rlhf` command, the KFP components,
the fine-tune driver, the local stand-in); a manifest read from the store is checked like
input; every command ends any bad input in one line `rlhf: ...`, never a traceback.

``offline`` makes a network lookup, a connection or a new process fail the test (it raises
``Reached``, which no handler of ours catches), so "refused before any lookup" is checked,
not assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_core import cli_args
from rlhf_core.cli import build_parser, main
from rlhf_core.record.run_ids import RunIdError, StoreUriError
from rlhf_core.record.manifest_schema import ManifestError
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef
from rlhf_core.config import ConfigError, RunConfig, apply_overrides, config_from_handover, handover

URI_TYPES = (cli_args.store_uri, cli_args.run_uri)


class Reached(BaseException):
    """Something a refused input must never get to (a lookup, a connection, a process)."""


@pytest.fixture
def offline(monkeypatch):
    # what the commands import lazily, imported now: an import may look things up itself
    import rlhf_core.record.audit  # noqa: F401
    import rlhf_core.export  # noqa: F401
    import rlhf_core.record.lineage  # noqa: F401
    import rlhf_core.record.retention  # noqa: F401
    import rlhf_core.snapshot.reader  # noqa: F401
    import rlhf_core.trainer.replay  # noqa: F401
    import pipelines.remote  # noqa: F401  (kfp: seconds, once)

    def refuse(what):
        def _refused(*args, **kwargs):
            raise Reached(f"{what}{args[:2]!r}")
        return _refused

    class RefusedPopen(subprocess.Popen):  # a class still: libraries subclass it at import
        __init__ = refuse("Popen")

    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(subprocess, "Popen", RefusedPopen)


def _ended(argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) as a shell would see them from `rlhf *argv`, run in-process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # Python prints the message and exits 1
        return 1, err + code + "\n"
    return int(code or 0), err


def _assert_one_line_error(status: int, err: str, argv) -> str:
    lines = err.strip().splitlines()
    assert status != 0, argv
    assert "Traceback" not in err, (argv, err)
    assert lines and lines[-1].startswith("rlhf: "), (argv, err)
    return lines[-1]


# ------------------------------------------------------------------ URI arguments

@pytest.mark.parametrize("argv, found", [
    (["snapshots", "ls", "ftp://example.invalid/x"], "found 'ftp' in 'ftp://example.invalid/x'"),
    (["snapshots", "show", "http://example.invalid/r/iter-000000/rollout"], "found 'http'"),
    (["export", "bogus://x", "--out", "unused"], "found 'bogus' in 'bogus://x'"),
    (["lineage", "ftp://example.invalid/r"], "found 'ftp'"),
    (["replay", "ftp://example.invalid/r/iter-000000/reward"], "found 'ftp'"),
    (["gc", "sftp://example.invalid/r", "--dry-run"], "found 'sftp'"),
    (["lineage", "file:///tmp/store/x y"], "the run id in it: expected 1-128 ASCII letters"),
    (["replay", "file:///tmp/store/x;id/iter-000000/reward"], "the run id in it: expected 1-128"),
    (["gc", "/tmp/store/$(id)"], "the run id in it: expected 1-128"),
])
def test_positional_uris_are_refused_by_their_text_before_any_lookup(argv, found, offline, capsys):
    status, err = _ended(argv, capsys)
    line = _assert_one_line_error(status, err, argv)
    assert line.startswith("rlhf: URI: ") and found in line, line


def test_a_refused_uri_in_a_real_process_ends_in_one_line():
    """The user's view: `rlhf snapshots ls ftp://example.invalid/x` as its own process."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "snapshots", "ls", "ftp://example.invalid/x"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("rlhf: URI: expected a scheme among file, s3, gs, gcs, memory; "
                                                   "found 'ftp' in 'ftp://example.invalid/x'")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_uri_and_run_id_argument_of_every_command_is_checked_while_parsing():
    """A new command (or plugin) that takes a URI or a run id without the check fails here."""
    unchecked = []
    for name, parser in _subcommands().items():
        for action in parser._actions:
            names_a_uri = (action.dest in ("uri", "store") or action.dest.endswith(("_uri", "_store"))
                           or action.metavar == "URI")
            if names_a_uri and action.type not in URI_TYPES:
                unchecked.append(f"{name} {action.dest}")
            if action.dest == "run_id" and action.type is not cli_args.run_id:
                unchecked.append(f"{name} {action.dest}")
    assert unchecked == []


# ------------------------------------------------------------------ components, driver, stand-in

BAD_STORE = "ftp://example.invalid/x"


def test_the_iteration_component_checks_its_store_and_run_id_first(offline, tmp_path):
    from components.iteration import run_iteration

    parent = SimpleNamespace(uri=f"{BAD_STORE}/r/checkpoints/step-000000")
    common = dict(**handover(RunConfig()), head_root=str(tmp_path), ray_address="", snapshots=None, model=None,
                  metrics=None, summary=None, parent=parent)
    with pytest.raises(StoreUriError, match="^store: expected a scheme among .* found 'ftp'"):
        run_iteration.python_func(run_id="r", store=BAD_STORE, **common)
    with pytest.raises(RunIdError, match="^run_id: expected 1-128"):
        run_iteration.python_func(run_id="../r", store=str(tmp_path), **common)


def test_the_finetune_component_checks_its_store_before_the_kfp_client(offline):
    from components.finetune import drive_finetune

    with pytest.raises(StoreUriError, match="^store: expected a scheme among"):
        drive_finetune.python_func(run_id="r", store=BAD_STORE, iterations=1, more=0, stop_at_reward=-1.0,
                                   budget_s=0.0, **handover(RunConfig()), kube_spec={}, cluster_policy="keep",
                                   max_retries=0, kfp_host="http://example.invalid", namespace="", experiment="e",
                                   service_account="", summary=None, metrics=None)


def test_the_driver_checks_its_plan_before_the_store(offline):
    from components.driver import Plan, drive

    with pytest.raises(StoreUriError, match="^store: expected a scheme among"):
        drive(object(), Plan("r", BAD_STORE, {}), "", "e")
    with pytest.raises(RunIdError, match="^run_id: "):
        drive(object(), Plan("a b", "/tmp/store", {}), "", "e")


def test_the_local_stand_in_checks_before_a_process_or_runner_starts(offline, tmp_path):
    from pipelines import local, local_finetune

    stand_in = local.LocalKfpStandIn(str(tmp_path / "head"), str(tmp_path / "runs"))
    with pytest.raises(StoreUriError, match="^params.store: "):
        stand_in.run_pipeline("e", "j", params={"run_id": "r", "store": BAD_STORE})
    assert stand_in.submitted == []
    with pytest.raises(StoreUriError, match="^store: "):
        local.run_one_iteration("r", BAD_STORE, [], str(tmp_path / "head"), str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()  # refused before the runner made its folder
    for entry in (local.main, local_finetune.main):
        with pytest.raises(SystemExit) as exc:
            entry(["--run-id", "r", "--store", BAD_STORE, "--head-root", str(tmp_path), "--root", str(tmp_path)])
        assert exc.value.code == 2  # argparse: "argument --store: expected a scheme among ..."


# ------------------------------------------------------------------ manifests read from the store

def _run_with_manifest(tmp_path: Path, run_id: str, edit) -> str:
    """A run of one committed iteration whose manifest is what ``edit`` makes of a whole one."""
    from rlhf_core.config import RunConfig

    cfg = RunConfig()
    body = {"config_hash": cfg.config_hash(), "config": cfg.to_dict(), "code_version": {"source_sha256": "0" * 64},
            "checkpoint": f"file://{tmp_path}/store/{run_id}/checkpoints/step-000001", "checkpoint_sha256": {},
            "data_cursor": {"epoch": 0, "position": 8}, "kl_coef": 0.001, "global_step": 1, "rng": {},
            "stage_timings_s": {}, "metrics": {"critic/score/mean": 0.5}, "snapshots": {}, "computed_ahead": [],
            "weights": {"checkpoint_step": 1, "checkpoint": "x", "redo": []}}
    IterationStore(RunRef(str(tmp_path / "store"), run_id)).commit_iteration(0, body)
    path = tmp_path / "store" / run_id / "iter-000000" / "MANIFEST.json"
    path.write_bytes(edit(json.loads(path.read_text())))
    return f"file://{tmp_path}/store/{run_id}"


def _without(*keys):
    return lambda m: json.dumps({k: v for k, v in m.items() if k not in keys}).encode()


def _with(**values):
    return lambda m: json.dumps({**m, **values}).encode()


@pytest.mark.parametrize("argv, edit, named", [
    (["lineage", "{run}"], _without("config_hash"), "no key config_hash"),
    (["lineage", "{run}/iter-000000"], _with(data_cursor={"epoch": "zero", "position": 0}),
     "data_cursor.epoch: expected a whole number >= 0; found \"zero\""),
    (["replay", "{run}/iter-000000/reward"], _without("config"), "no key config"),
    (["replay", "{run}/iter-000000/reward"], _with(parent_iteration="none"), "parent_iteration: expected null or"),
    (["gc", "{run}", "--dry-run"], _with(weights={}), "weights.checkpoint: expected a string (a checkpoint URI); "
                                                      "found nothing"),
    (["gc", "{run}", "--dry-run"], _with(weights={"checkpoint": "x"}), "weights.checkpoint_step: expected a whole "
                                                                        "number >= 0; found nothing"),
    (["gc", "{run}", "--dry-run"], _with(weights={"checkpoint": "x", "checkpoint_step": 0, "redo": "0"}),
     "weights.redo: expected a list"),
    (["gc", "{run}", "--dry-run"], lambda m: b"{not json", "expected a JSON object; found bytes that are not JSON"),
    (["lineage", "{run}"], lambda m: b"[1, 2]", "expected a JSON object; found list"),
    (["lineage", "{run}"], _with(iteration=7), "iteration: expected 0 (the folder it is in); found 7"),
    (["lineage", "{run}"], _with(schema_version="1"), "not an iteration manifest this build reads"),
])
def test_a_damaged_manifest_ends_a_command_in_one_line_naming_it_and_the_key(argv, edit, named, offline, tmp_path,
                                                                            capsys):
    run = _run_with_manifest(tmp_path, "r", edit)
    argv = [a.format(run=run) for a in argv]
    line = _assert_one_line_error(*_ended(argv, capsys), argv)
    assert line.startswith(f"rlhf: {run}/iter-000000/MANIFEST.json: ") and named in line, line


def test_manifest_checks_pass_what_a_run_writes_and_stay_plain_dicts(tmp_path):
    run = _run_with_manifest(tmp_path, "r", lambda m: json.dumps(m).encode())
    manifest = IterationStore(RunRef(run.rsplit("/", 1)[0], "r")).read_manifest(0)
    assert manifest["weights"]["checkpoint_step"] == 1 and manifest.get("nothing") is None
    assert json.loads(json.dumps(manifest)) == manifest  # written and compared as the dict it is
    with pytest.raises(ManifestError, match=r"MANIFEST.json: no key metrics.actor/kl"):
        manifest["metrics"]["actor/kl"]


# ------------------------------------------------------------------ the last guard

def test_an_unexpected_exception_in_a_command_is_one_line_with_a_way_to_the_traceback(monkeypatch, capsys):
    from rlhf_core.record import audit

    def broken(uri):
        raise RuntimeError("the listing broke\n  on its second line")

    monkeypatch.setattr(audit, "list_store", broken)
    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    status, err = _ended(["snapshots", "ls", "/nowhere"], capsys)
    assert _assert_one_line_error(status, err, "snapshots ls") == (
        "rlhf: snapshots failed: RuntimeError: the listing broke on its second line (run again with "
        "RLHF_DEBUG=1 for the traceback)")
    monkeypatch.setenv("RLHF_DEBUG", "1")
    with pytest.raises(RuntimeError, match="the listing broke"):
        main(["snapshots", "ls", "/nowhere"])


def test_keyboard_interrupt_is_not_turned_into_an_error(monkeypatch):
    from rlhf_core.record import audit

    def interrupted(uri):
        raise KeyboardInterrupt

    monkeypatch.setattr(audit, "list_store", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["snapshots", "ls", "/nowhere"])


# ------------------------------------------------------------------ any bad argument, any command

def _refused_by(kind, value: str) -> bool:
    try:
        kind(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return True
    return False


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
BAD_RUN_IDS = st.one_of(TEXT, st.sampled_from(["../x", "x;id", "$(id)", "-rf", "x" * 129, "a b", ""]))
BAD_URIS = st.one_of(
    st.builds(lambda scheme, rest: f"{scheme}://{rest}", st.sampled_from(["ftp", "http", "https", "bogus", "sftp",
                                                                          "hdfs", "ssh", "FTP"]),
              st.one_of(st.sampled_from(["example.invalid/x", "127.0.0.1:21/r", "h/r/iter-000000"]), TEXT)),
    st.builds(lambda a, b: f"{a}\n{b}", TEXT, TEXT), st.sampled_from(["", " ", "://x", "s3://b/\nx", "file:///t/\x7f"]))
# a run URI whose run id is wrong: a store URI that names no run
BAD_RUN_URIS = st.one_of(BAD_URIS, st.builds(lambda store, run: f"{store}/{run}",
                                              st.sampled_from(["file:///tmp/s", "/tmp/s", "s3://b/runs"]), BAD_RUN_IDS))
# store contents every command that reads a store must refuse: the run is damaged, or absent
DAMAGED = {"weights-empty": _with(weights={}), "step-text": _with(global_step="x"), "not-json": lambda m: b"{",
           "a-list": lambda m: b"[]", "future": _with(schema_version=99), "moved": _with(iteration=3)}


def _store_uris(root: str):
    runs = st.sampled_from(sorted(DAMAGED) + ["absent"])
    tails = st.sampled_from(["", "/iter-000000", "/iter-000000/reward", "/checkpoints/step-000001", "/iter-000001"])
    return st.builds(lambda run, tail: f"{root}/{run}{tail}", runs, tails)


def _slots(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _bad(action: argparse.Action, store_uris):
    """A value of ``action`` that the command must refuse, and the argv it becomes."""
    opt = action.option_strings[-1] if action.option_strings else None
    if opt and action.nargs == 0:
        return TEXT.map(lambda v: [f"{opt}={v}"])  # a flag given a value
    if action.choices:
        values = TEXT.filter(lambda v: v not in action.choices)
    elif action.type in URI_TYPES:
        values = (BAD_RUN_URIS if action.type is cli_args.run_uri else BAD_URIS).filter(
            lambda v: _refused_by(action.type, v))
        if not opt:  # a URI in a store: refused by its text, or because what it names is damaged or absent
            values = st.one_of(values, store_uris)
    elif action.type is cli_args.run_id:
        values = BAD_RUN_IDS.filter(lambda v: _refused_by(action.type, v))
    elif action.type in (int, float):
        values = TEXT.filter(lambda v: _refused_by(action.type, v))
    elif action.nargs == "*" and not opt:  # config overrides
        return st.builds(lambda k: [f"no_such_section.{k}=1"], st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
    else:
        return None  # any text is a valid folder, host or cron line here: nothing is surely bad
    if opt:
        return values.map(lambda v: [f"{opt}={v}"])
    return values.filter(lambda v: not v.startswith("-")).map(lambda v: [v])


def _filler(action: argparse.Action, store_uris, tmp: str):
    """A plausible value of ``action`` (or none, when it may be left out)."""
    opt = action.option_strings[-1] if action.option_strings else None
    if action.choices:
        value = st.sampled_from(sorted(action.choices))
    elif action.type in URI_TYPES:
        value = store_uris if not opt else st.just(f"file://{tmp}/new-store")
    elif action.type is cli_args.run_id:
        value = st.sampled_from(["r", "run-1"])
    elif action.type in (int, float):
        value = st.sampled_from(["1", "2"])
    elif action.nargs == "*" and not opt:
        return st.just([])
    else:
        value = st.just(f"{tmp}/x")
    if not opt:
        return value.map(lambda v: [v])
    if action.nargs == 0:
        given = st.just([opt])
    else:
        given = value.map(lambda v: [f"{opt}={v}"])
    return given if action.required else st.one_of(st.just([]), given)


@st.composite
def bad_command_lines(draw, subcommands, tmp: str):
    name = draw(st.sampled_from(sorted(subcommands)))
    parser = subcommands[name]
    store_uris = _store_uris(f"file://{tmp}/store")
    slots = [(a, s) for a in _slots(parser) if (s := _bad(a, store_uris)) is not None]
    # an unknown option is wrong for every command, those with nothing else to get wrong too
    bad_at = draw(st.integers(-1, len(slots) - 1))
    options, positionals = [], []
    for action in _slots(parser):
        chosen = bad_at >= 0 and slots[bad_at][0] is action
        part = draw(slots[bad_at][1] if chosen else _filler(action, store_uris, tmp))
        (options if action.option_strings else positionals).extend(part)
    if bad_at < 0:
        options.append("--no-such-option" + draw(st.from_regex(r"[a-z-]{0,8}", fullmatch=True)))
    return [name, *draw(st.permutations(options)), *positionals]


@pytest.fixture
def damaged_store(tmp_path):
    for run, edit in DAMAGED.items():
        _run_with_manifest(tmp_path, run, edit)
    return tmp_path


SUBCOMMANDS = _subcommands()


#: examples a run draws (every subcommand is drawn often at 80; RLHF_CLI_EXAMPLES=500 for a longer hunt)
CLI_EXAMPLES = int(os.environ.get("RLHF_CLI_EXAMPLES", "80"))


@settings(max_examples=CLI_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_any_bad_argument_of_any_command_ends_in_one_line(data, damaged_store, offline, capsys):
    """Every subcommand of the real parser (plugins' included), each with one argument
    wrong (a refused URI or run id, a damaged or absent run, a value of the wrong type, a
    choice it lacks, a flag given a value, an unknown option or config key): non-zero exit,
    the last line of stderr is `rlhf: ...`, no traceback, nothing looked up or started."""
    argv = data.draw(bad_command_lines(SUBCOMMANDS, str(damaged_store)))
    _assert_one_line_error(*_ended(argv, capsys), argv)


@pytest.mark.parametrize("argv", [[], ["no-such-command"], ["--no-such-option"]])
def test_no_command_or_an_unknown_one_is_one_line(argv, capsys):
    _assert_one_line_error(*_ended(argv, capsys), argv)


def test_a_pipeline_run_is_handed_the_resolved_config_and_refuses_one_that_is_not_what_was_hashed(offline, tmp_path,
                                                                                                   capsys):
    """The config reaches a pipeline run as data (``config``, JSON text, and
    ``config_hash``, through KFP's JSON): it comes back field for field, and a config changed on the way, or none,
    is refused in one line naming the parameter, before the store or a head is touched."""
    from components.iteration import run_iteration

    cfg = apply_overrides(RunConfig(), ["actor.lr=2e-5", "rollout.n=3", "data.train_batch_size=64"]).validate()
    given = json.loads(json.dumps(handover(cfg)))  # what a pipeline parameter carries
    back = config_from_handover(given["config"], given["config_hash"])
    assert back.to_dict() == cfg.to_dict() and back.config_hash() == cfg.config_hash()
    tampered = {**given, "config": given["config"].replace('"lr": 2e-05', '"lr": 3e-05')}
    assert tampered["config"] != given["config"]
    with pytest.raises(ConfigError, match=f"^config_hash: expected the hash of config, [0-9a-f]{{64}}; found "
                                          f"'{given['config_hash']}'$"):
        config_from_handover(tampered["config"], tampered["config_hash"])
    for nothing in ("", "{}", "not json", {"actor": {}}):
        with pytest.raises(ConfigError, match="^config: expected the run's resolved config as JSON text"):
            config_from_handover(nothing, given["config_hash"])
    common = dict(head_root=str(tmp_path / "head"), ray_address="", snapshots=None, model=None, metrics=None,
                  summary=None)
    with pytest.raises(ConfigError, match="^config_hash: expected the hash of config"):
        run_iteration.python_func(run_id="r", store=str(tmp_path / "store"), **tampered, **common)
    assert not (tmp_path / "head").exists()
    # what `rlhf config --handover` prints is what a run of the pipeline takes
    assert main(["config", "--handover", "actor.lr=2e-5", "rollout.n=3", "data.train_batch_size=64"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == given


def test_only_the_no_target_value_turns_a_stop_target_off():
    """A fine-tune's stop_at_reward / stop_at_val: -1 (the pipeline parameter's default)
    is none; any other value, a negative one too, is a score to reach (before, every
    negative value silently meant none)."""
    from components.driver import NO_TARGET, score_target

    assert score_target(NO_TARGET) is None
    assert [score_target(v) for v in (-0.5, -1.5, 0.0, 0.9)] == [-0.5, -1.5, 0.0, 0.9]


def test_snapshots_show_with_object_fields_only(tmp_path):
    """`rlhf snapshots show URI --fields uid` (no tensor asked for) lists the rows instead
    of failing on a batch without tensors."""
    import numpy as np
    import torch

    from rlhf_core.protocol import DataProto
    from rlhf_core.record.audit import show
    from rlhf_core.snapshot.writer import save_snapshot

    dp = DataProto.from_dict({"responses": torch.arange(6).reshape(2, 3)},
                             non_tensors={"uid": np.array(["a", "b"], dtype=object),
                                          "data_source": np.array(["x", "y"], dtype=object)})
    uri = f"file://{tmp_path}/snap"
    save_snapshot(dp, uri)
    text = show(uri, uid="b", fields=["uid", "data_source"])
    assert "uid: b" in text and "data_source: y" in text and "1 row(s) of 2" in text


def test_one_broken_snapshot_manifest_does_not_hide_a_stores_listing(tmp_path):
    """`rlhf snapshots ls`: a snapshot whose manifest is not valid is listed as unreadable,
    with why, beside the others (it failed the whole listing before)."""
    import torch

    from rlhf_core.protocol import DataProto
    from rlhf_core.record.audit import list_store
    from rlhf_core.snapshot.layout import MANIFEST_NAME
    from rlhf_core.snapshot.writer import save_snapshot

    for stage in ("rollout", "reward"):
        save_snapshot(DataProto.from_dict({"responses": torch.arange(6).reshape(2, 3)}),
                      f"file://{tmp_path}/run/iter-000000/{stage}")
    (tmp_path / "run" / "iter-000000" / "reward" / MANIFEST_NAME).write_text("{not json")
    text = list_store(f"file://{tmp_path}/run")
    assert "iter-000000/rollout" in text and "committed" in text
    assert "iter-000000/reward" in text and "unreadable" in text and "2 snapshot(s)" in text
