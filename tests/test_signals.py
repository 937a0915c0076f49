"""How `rlhf run` takes SIGTERM, the parts that need no run: what its handler ends (its own
session's process trees, nothing outside them), that it acts once, and that ``ray.init``
does not take the handler away. The end-to-end behaviour, in every run mode, is in
tests/test_pipeline.py (``test_sigterm_to_the_command_alone_...``)."""

import contextlib
import json
import signal
import subprocess
import sys
import time

import psutil

# In a process of its own: the handler ends the children of the process it runs in, and the
# test runner's children (a Ray, an object store) are not ours to end.
HANDLER_SCRIPT = r"""
import json, subprocess, sys
from rlhf_core.cli import Terminated, _on_sigterm

quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (our output's pipe closes when we end)
tree = subprocess.Popen(["bash", "-c", "sleep 120 & sleep 120 & wait"], **quiet)      # a child with children
apart = subprocess.Popen(["sleep", "120"], start_new_session=True, **quiet)           # a session of its own
import time, psutil
while len(psutil.Process(tree.pid).children()) < 2:
    time.sleep(0.05)
below = [p.pid for p in psutil.Process(tree.pid).children()]
handler = _on_sigterm(end_children=True)
outcomes = []
for _ in range(2):
    try:
        handler(15, None)
        outcomes.append("returned")
    except Terminated:
        outcomes.append("Terminated")
print(json.dumps({"tree": [tree.pid, *below], "apart": apart.pid, "outcomes": outcomes}))
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def _handler_called_twice(end_children: bool):
    """Run the script; yield what it saw; SIGKILL whatever of its processes is left."""
    script = HANDLER_SCRIPT.replace("end_children=True", f"end_children={end_children}")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    try:
        yield seen
    finally:
        for pid in [seen["apart"], *seen["tree"]]:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def test_the_sigterm_handler_ends_its_own_sessions_trees_and_nothing_else_and_acts_once():
    with _handler_called_twice(end_children=True) as seen:
        assert seen["outcomes"] == ["Terminated", "returned"]  # a second SIGTERM is not raised mid-cleanup
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in seen["tree"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in seen["tree"] if _alive(pid)] == []  # the child and the ones below it
        assert _alive(seen["apart"])  # another session's process (a Ray head) is the command's cleanup's


def test_a_direct_runs_handler_ends_no_process():
    with _handler_called_twice(end_children=False) as seen:
        assert seen["outcomes"] == ["Terminated", "returned"]
        assert all(_alive(pid) for pid in seen["tree"])  # its own Ray's exit handler ends those in order


def test_ray_init_does_not_take_the_callers_sigterm_handler_away():
    from rlhf_core.runtime.ray_head import _sigterm_handler_kept

    def ours(signum, frame):
        pass

    def rays(signum, frame):  # what ray.init installs: sys.exit(signum)
        sys.exit(signum)

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, ours)
        with _sigterm_handler_kept():
            signal.signal(signal.SIGTERM, rays)
        assert signal.getsignal(signal.SIGTERM) is ours
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nobody installed one: Ray's stays, as Ray wants
        with _sigterm_handler_kept():
            signal.signal(signal.SIGTERM, rays)
        assert signal.getsignal(signal.SIGTERM) is rays
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_that_code_under_the_run_turned_into_a_keyboard_interrupt_still_exits_143(tmp_path, monkeypatch,
                                                                                             capsys):
    """A library under the run (Ray's, for one) may catch the handler's ``Terminated`` and
    raise a plain KeyboardInterrupt of its own: the run still says "terminated" and exits
    143 (a direct run once came back with 130, Ctrl-C's code, on a loaded machine)."""
    import os

    from rlhf_core import cli
    from rlhf_core.trainer import run as trainer_run

    def a_library_that_rewraps(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the handler raises in here, at once
        except KeyboardInterrupt:
            raise KeyboardInterrupt() from None

    monkeypatch.setattr(trainer_run, "run_direct", a_library_that_rewraps)
    code = cli.main(["run", "--direct", "--iterations", "1", "--run-id", "r", "--store", f"file://{tmp_path}/s",
                     f"trainer.output_dir={tmp_path / 'out'}"])
    assert code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("rlhf: terminated; run r keeps 0 committed")
