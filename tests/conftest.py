"""Shared fixtures (a local Ray owned by the test session, a SeaweedFS server, one model
cache) and the test tiers.

Markers are applied here, by fixture and by module, so a new test cannot forget them:

- ``ray``: uses a Ray cluster (the session's ``ray_local``, or a head of its own)
- ``s3``: uses the SeaweedFS S3 server
- ``session``: starts a long-lived training session on a local Ray head
- ``kfp``: runs pipeline runs on the KFP local runner
- ``multinode``: a simulated multi-node Ray cluster
- ``slow``: everything above but ``s3``, and tests measured at more than ~10 s on a 2-core
  machine (``SLOW``); the fast tier is ``-m "not slow"``

A fast-tier test that takes longer than ``FAST_BUDGET_S`` is named at the end of the run,
so it can be marked (a report, not an assertion: timing never fails a test).
"""

import os
import tempfile

import pytest

FAST_BUDGET_S = 10.0

#: Modules whose every test is in a tier (beyond what its fixtures say).
MODULE_MARKS = {
    "test_session": ("session", "ray", "slow"),
    "test_finetune_driver": ("kfp", "session", "ray", "slow"),
    "test_multinode": ("multinode", "ray", "slow"),
    "test_fsdp": ("slow",),  # real ranks as processes (FSDP2 / DCP on gloo)
}
#: Single tests measured slow on a 2-core machine (``--durations``), by node id prefix.
SLOW = (
    "test_log_probs.py::test_a_log_prob_pass_at_qwen2s_vocabulary",
    "test_verl_keys.py::test_the_qwen2_7b_script_scaled_down_runs_through_rlhf_run_direct",
    "test_pipeline.py::test_rlhf_run_runs_iterations_as_local_pipeline_runs",
    "test_pipeline.py::test_a_pipeline_mode_run_killed_in_its_first_iteration",
    "test_pipeline.py::test_ctrl_c_in_the_first_iteration",
    "test_pipeline.py::test_sigterm_to_the_command_alone",
    "test_pipeline.py::test_a_parent_model_the_run_has_moved_past_is_refused",
    "test_pipeline.py::test_a_failed_pipeline_run_ends_rlhf_run",
    "test_hardening.py::test_a_real_head_is_recognized_stopped_and_cleaned",
    "test_hardening.py::test_a_run_adopts_the_head_of_a_dead_run_but_not_a_users_head",
    "test_hardening.py::test_no_raw_exception_escapes_a_command",
    # measured over 10 s in the fast tier on 2 cores (item 13 of issue [7/7])
    "test_cli_inputs.py::test_any_bad_argument_of_any_command_ends_in_one_line",
    "test_gpu_smoke_bare.py::test_the_bare_smoke_",
    "test_lora.py::test_two_fsdp_ranks_train_the_adapter",
    "test_snapshot_bounds.py::test_an_inflating_chunk_is_refused_before_it_decodes",
    "test_hardening.py::test_no_local_ray_temp_dir_outlives_its_process",
    "test_validation.py::test_submit_passes_stop_at_val_to_the_finetune_pipeline",
    "test_kuberay_render.py::test_every_pool_shape_and_run_id_renders_valid_objects",
    "test_manifests.py::test_the_role_grants_every_call_the_components_make_and_nothing_else",
)
FIXTURE_MARKS = {"ray_local": ("ray", "slow"), "s3_server": ("s3",)}
KFP_TESTS = ("test_pipeline.py::test_rlhf_run_runs_iterations_as_local_pipeline_runs",
             "test_pipeline.py::test_a_pipeline_mode_run_killed_in_its_first_iteration",
             "test_pipeline.py::test_ctrl_c_in_the_first_iteration",
             "test_pipeline.py::test_sigterm_to_the_command_alone",
             "test_pipeline.py::test_a_parent_model_the_run_has_moved_past_is_refused",
             "test_pipeline.py::test_a_failed_pipeline_run_ends_rlhf_run")


#: The longest modules, longest first (per-module totals of ``--durations=0`` on a 2-core
#: machine): with two worker processes they start first, so no long module is left to run
#: alone at the end. pytest's addopts say ``--no-loadscope-reorder``: xdist would otherwise
#: reorder files by their number of tests and undo this order.
LONGEST_FIRST = ("test_pipeline", "test_session", "test_finetune_driver", "test_multinode", "test_fsdp",
                 "test_resume", "test_controller", "test_trainer_smoke", "test_replay", "test_hardening",
                 "test_real_model", "test_log_probs", "test_reward_model", "test_cli_inputs", "test_store_trust",
                 "test_validation")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: in-module order kept
    for item in items:
        names = set(MODULE_MARKS.get(item.module.__name__, ()))
        for fixture, marks in FIXTURE_MARKS.items():
            if fixture in item.fixturenames:
                names.update(marks)
        node = item.nodeid.split("/")[-1]
        if node.startswith(SLOW):
            names.add("slow")
        if node.startswith(KFP_TESTS):
            names.add("kfp")
        if "ray" in names or "session" in names:
            names.add("slow")
        for name in sorted(names):
            item.add_marker(getattr(pytest.mark, name))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # (reports carry the test's markers, also where a worker process ran the test)
    if report.when == "call" and "slow" not in report.keywords:
        _durations[report.nodeid] = report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = sorted((d, n) for n, d in _durations.items() if d > FAST_BUDGET_S)
    if over:
        terminalreporter.write_line(f"fast-tier tests over {FAST_BUDGET_S:.0f} s (mark them slow in conftest.SLOW):")
        for seconds, node in reversed(over):
            terminalreporter.write_line(f"  {seconds:6.1f}s {node}")


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """One cache of built-in models for the whole test run (the warm-start SFT runs once,
    not once per module or per worker process: the workers' temp folders share a parent);
    a cache the environment names is used as is."""
    if "RLHF_CACHE" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "rlhf-cache"
        shared.mkdir(exist_ok=True)
        os.environ["RLHF_CACHE"] = str(shared)
    yield os.environ["RLHF_CACHE"]

# Every Ray this test session starts listens on loopback only and wants a token; Ray reads
# these when it is imported, so before any test module imports it.
from rlhf_core.runtime.ray_head import local_ray_env  # noqa: E402  (imports no Ray)

local_ray_env()


@pytest.fixture(scope="session")
def ray_local():
    """A private Ray head for this test session (never attaches to another cluster)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rlhf-test-ray-")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray workers import the classes they host by module name (tests define workers in
    # test modules): give them the test folder and the repository on their path.
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # Logical CPUs and fake GPUs: pools are placed by Ray's accounting, not the hardware.
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, _temp_dir=temp_dir,
             configure_logging=False, log_to_driver=False, object_store_memory=300 * 1024**2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (SeaweedFS) on loopback with its own credentials, for the session."""
    from rlhf_core.testing.s3server import LocalS3

    with LocalS3() as server:
        yield server


#: Names the folder of KubeRay's CRD files (``ray.io_rayclusters.yaml``, ...) that rendered
#: objects are validated against. CI sets it (``.ci/run``); without it those tests skip.
KUBERAY_CRDS_ENV = "RLHF_KUBERAY_CRDS"


@pytest.fixture(scope="session")
def kuberay_crds():
    """The folder of KubeRay's CRD schemas, from ``$RLHF_KUBERAY_CRDS``. Unset: the test
    is skipped with how to get them (the render checks that need no schema run anyway);
    set to a folder without them: an error, so a misconfigured CI never passes by skipping."""
    from pathlib import Path

    from components.kuberay.crd import CRD_FILES

    where = os.environ.get(KUBERAY_CRDS_ENV, "")
    if not where:
        pytest.skip(f"KubeRay's CRD schemas are not here: set {KUBERAY_CRDS_ENV} to a folder holding "
                    f"{', '.join(CRD_FILES.values())} (from a cluster with KubeRay: kubectl get crd "
                    f"rayclusters.ray.io -o yaml, one file per CRD; or ray-operator/config/crd/bases/ of a "
                    f"KubeRay v1.7 release)")
    folder = Path(where)
    missing = [name for name in CRD_FILES.values() if not (folder / name).is_file()]
    if missing:
        pytest.fail(f"{KUBERAY_CRDS_ENV}={where}: expected {', '.join(missing)} there; found "
                    f"{sorted(p.name for p in folder.iterdir()) if folder.is_dir() else 'no such folder'}",
                    pytrace=False)
    return folder
