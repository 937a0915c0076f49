"""Shared fixtures: a local Ray head owned by the test session."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A private Ray head for this test session (never attaches to another cluster)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rlhf-test-ray-")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir,
             configure_logging=False, log_to_driver=False, object_store_memory=300 * 1024**2)
    yield ray
    ray.shutdown()
