"""Models and prompts from an object store (``rlhf_core/data/fetch.py``), on the real S3
server (SeaweedFS): ``model.path`` and ``data.train_files`` as ``s3://`` URIs load like
local ones; each node fetches once into its cache, concurrent fetchers leave one intact
copy, and bytes that do not match what the store listed are refused in one line."""

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rlhf_core.data import fetch
from rlhf_core.data.dataset import DatasetError, load_rows
from rlhf_core.testing.model_folders import build_model_folder, write_verl_parquet
from rlhf_core.workers import modeling

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("inputs")
    return build_model_folder(base / "tiny-qwen2"), write_verl_parquet(base / "train.parquet")


@pytest.fixture
def remote(s3_server, local_inputs, tmp_path, monkeypatch):
    """The model folder and the parquet uploaded under a fresh prefix; the AWS_* variables
    (as the Ray pods get them from the secret) and a fresh node cache set."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "node-cache"))
    model, data = local_inputs
    prefix = f"{s3_server.bucket}/inputs-{uuid.uuid4().hex[:8]}"
    fs = s3_server._client
    fs.put(str(model), f"{prefix}/models/tiny-qwen2", recursive=True)
    fs.put_file(str(data), f"{prefix}/data/train.parquet")
    return {"model": f"s3://{prefix}/models/tiny-qwen2", "data": f"s3://{prefix}/data/train.parquet",
            "prefix": prefix, "fs": fs, "cache": tmp_path / "node-cache" / "inputs"}


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != fetch.RECORD}


def test_model_and_prompts_load_from_object_store_uris(remote, local_inputs):
    model, data = local_inputs
    path = modeling.resolve_model_path(remote["model"], seed=0)
    assert Path(path).is_relative_to(remote["cache"]) and _tree(Path(path)) == _tree(model)
    lm = modeling.load_causal_lm(path)
    assert lm.config.hidden_size == 128
    assert modeling.load_tokenizer(path).chat_template
    # a second resolve on the node reuses the copy: same folder, same files, nothing fetched
    inode = os.stat(Path(path) / "model.safetensors").st_ino
    assert modeling.resolve_model_path(remote["model"], seed=0) == path
    assert os.stat(Path(path) / "model.safetensors").st_ino == inode
    # the controller tokenizes only: its copy leaves the weights out
    tokenizer_only = Path(modeling.resolve_model_path(remote["model"], seed=0, weights=False))
    assert tokenizer_only != Path(path) and (tokenizer_only / "tokenizer.json").exists()
    assert not list(tokenizer_only.glob("*.safetensors"))
    assert load_rows(remote["data"]) == load_rows(str(data))


def test_a_missing_uri_is_refused_in_one_line(remote):
    with pytest.raises(modeling.ModelPathError, match=r"^model.path: expected an object or a folder of objects at "
                                                      r"s3://.*/nothing; found nothing there$"):
        modeling.resolve_model_path(f"s3://{remote['prefix']}/nothing", seed=0)
    with pytest.raises(DatasetError, match=r"^data.train_files: expected an object .* found nothing there$"):
        load_rows(f"s3://{remote['prefix']}/nothing.parquet")


def test_the_cli_checks_a_remote_model_without_fetching_it(remote):
    from rlhf_core.cli import _check_model_path
    from rlhf_core.config import RunConfig, apply_overrides

    _check_model_path(apply_overrides(RunConfig(), [f"model.path={remote['model']}"]))
    assert not remote["cache"].exists()
    with pytest.raises(SystemExit, match=r"model.path: expected a Hugging Face model folder with config.json; found "
                                         r"1 object\(s\) at s3://.*/data and no config.json"):
        _check_model_path(apply_overrides(RunConfig(), [f"model.path=s3://{remote['prefix']}/data"]))


CONTENDER = textwrap.dedent("""
    import os, sys, time
    from rlhf_core.data import fetch
    calls = []
    real = fetch.download
    def counting(*args, **kwargs):
        calls.append(1)
        time.sleep(1.0)  # a large model: the other contender arrives while this one downloads
        return real(*args, **kwargs)
    fetch.download = counting
    start = float(sys.argv[2])
    while time.time() < start:  # both contenders leave this line together
        time.sleep(0.001)
    path = fetch.fetch(sys.argv[1], "model.path")
    print(path, len(calls))
""")


def test_two_fetchers_on_one_node_at_once_leave_one_intact_copy(remote, local_inputs):
    """Two ranks of one node (one cache) fetch the model at the same moment: one
    downloads, the other waits for it and reuses the copy; no temp folder is left."""
    model, _ = local_inputs
    start = time.time() + 3.0  # both interpreters are up and importing well before this
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, remote["model"], str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    outputs = [out.split() for out, _ in results]
    assert outputs[0][0] == outputs[1][0]
    assert sorted(int(o[1]) for o in outputs) == [0, 1], "exactly one of them downloaded"
    folders = [p for p in remote["cache"].iterdir() if p.is_dir()]
    assert folders == [Path(outputs[0][0])], "one copy, no temp folder left"
    assert _tree(folders[0]) == _tree(model)


def test_an_object_replaced_during_the_fetch_is_refused_and_nothing_is_cached(remote, monkeypatch):
    """Listed, then replaced before its bytes arrive (a re-upload mid-fetch): the read is
    pinned to the listed ETag, so the fetch fails naming the object; the cache is empty."""
    real = fetch.download
    weights = f"{remote['prefix']}/models/tiny-qwen2/model.safetensors"

    def replaced_first(*args, **kwargs):
        data = remote["fs"].cat_file(weights)
        remote["fs"].pipe_file(weights, bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
        return real(*args, **kwargs)

    monkeypatch.setattr(fetch, "download", replaced_first)
    with pytest.raises(modeling.ModelPathError) as err:
        modeling.resolve_model_path(remote["model"], seed=0)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"s3://{weights}: expected ETag ")
    assert "nothing was cached" in message
    assert not [p for p in remote["cache"].iterdir() if p.is_dir()]
    monkeypatch.setattr(fetch, "download", real)  # the next fetch lists the new object and takes it
    assert Path(modeling.resolve_model_path(remote["model"], seed=0)).is_dir()


@pytest.mark.parametrize("change, message", [
    (lambda e: dataclasses.replace(e, size=e.size + 1), r"expected (\d+) bytes \(listed\), received \d+"),
    (lambda e: dataclasses.replace(e, md5="0" * 32), r"expected MD5 0{32} \(its ETag\), found [0-9a-f]{32}"),
])
def test_bytes_that_differ_from_the_listing_are_refused_in_one_line(remote, tmp_path, change, message):
    """What arrives is checked against what the store vouched for: its size, and its MD5
    when the ETag is one (a transfer that lost or flipped bytes)."""
    loc, single, entries = fetch.listing(remote["data"], "data.train_files")
    (entry,) = entries
    assert entry.md5 == hashlib.md5(remote["fs"].cat_file(remote["data"][len("s3://"):])).hexdigest()
    with pytest.raises(fetch.FetchError, match=rf"^{remote['data']}: {message}; nothing was cached") as err:
        fetch.download(loc, single, [change(entry)], tmp_path, remote["data"])
    assert "\n" not in str(err.value)


def test_a_sha256sums_file_is_checked_when_present(remote):
    folder = f"{remote['prefix']}/summed"
    remote["fs"].pipe_file(f"{folder}/a.txt", b"alpha")
    remote["fs"].pipe_file(f"{folder}/SHA256SUMS", f"{'0' * 64}  a.txt\n".encode())
    with pytest.raises(fetch.FetchError, match=r"a.txt: expected SHA-256 0{64} \(SHA256SUMS\), found "):
        fetch.fetch(f"s3://{folder}")
    remote["fs"].pipe_file(f"{folder}/SHA256SUMS", f"{hashlib.sha256(b'alpha').hexdigest()} *a.txt\n".encode())
    assert (Path(fetch.fetch(f"s3://{folder}")) / "a.txt").read_bytes() == b"alpha"


def test_a_cached_copy_changed_after_the_fetch_is_refused(remote):
    path = Path(fetch.fetch(remote["data"], "data.train_files"))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DatasetError, match=r"the cached copy .*train.parquet has \d+ bytes, expected \d+; it was "
                                               r"changed after the fetch: remove .* and run again"):
        load_rows(remote["data"])


@pytest.mark.parametrize("key", ["../escaped.txt", "a/../../escaped.txt", "a//b.txt", "./c.txt", "/abs.txt"])
def test_an_object_key_that_leaves_the_folder_is_refused_and_nothing_is_written(key, tmp_path, monkeypatch):
    """A key under a model prefix with '..', '.', an empty part or a leading '/' (anyone
    who can add an object to a shared bucket can make one) is refused in one line before
    anything is downloaded; nothing appears outside the cache (an in-memory filesystem
    stands in for the bucket: it keeps such keys as they are)."""
    import fsspec

    from rlhf_core.record import run_ids

    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(run_ids, "validate_store_uri", lambda uri, field: None)
    memory = fsspec.filesystem("memory")
    root = f"/bucket-{uuid.uuid4().hex[:8]}/model"
    memory.pipe(f"{root}/config.json", b"{}")
    memory.store[f"{root}/{key}"] = memory.store[f"{root}/config.json"]  # the raw key, as a store would list it
    with pytest.raises(fetch.FetchError, match=r"^model.path: expected object keys under memory://.* that name "
                                               r"files inside it; found .*nothing was fetched$"):
        fetch.fetch(f"memory://{root}", "model.path")
    assert not list(tmp_path.rglob("*escaped*")) and not list((tmp_path / "cache" / "inputs").glob("*-*/config.json"))


def test_a_cached_file_with_its_size_but_other_bytes_is_refused(remote):
    """Reuse checks the sha256 each file had when it arrived, not only its size."""
    path = Path(fetch.fetch(remote["data"], "data.train_files"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"the cached copy .*train.parquet does not have the sha256 its fetch "
                                           r"recorded \(\.rlhf-fetch\.json\); it was changed after the fetch: remove"):
        load_rows(remote["data"])
