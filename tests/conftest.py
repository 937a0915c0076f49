"""Shared fixtures: a local Ray head owned by the test session."""

import os
import tempfile

import pytest

# Every Ray this test session starts listens on loopback only and wants a token; Ray reads
# these when it is imported, so before any test module imports it.
from rlhf_core.ray_head import local_ray_env  # noqa: E402  (imports no Ray)

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
