"""The bare-machine GPU smoke check (``benchmarks/gpu_smoke_bare.py``) on this CPU machine:
it must run where only torch, transformers, safetensors and fsspec are installed, so it
runs here with Ray, vLLM, tensordict, zarr and kfp blocked from import, and every step
but the CUDA-only ones passes; those say SKIP with their reason. (On an H200 it ran in full:
docs/scale.md, "The first GPU run".)"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

#: Run a script with the packages a bare GPU image lacks made unimportable.
BLOCKED_RUN = """
import runpy, sys
BLOCKED = {"ray", "vllm", "tensordict", "zarr", "kfp"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is not installed on a bare GPU machine")
sys.meta_path.insert(0, Block())
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def cpu_smoke():
    out = subprocess.run([sys.executable, "-c", BLOCKED_RUN, str(ROOT / "benchmarks" / "gpu_smoke_bare.py"),
                          "--shape", "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    return out, lines


def test_the_bare_smoke_runs_every_step_but_the_cuda_ones_without_ray_vllm_tensordict_or_zarr(cpu_smoke):
    out, lines = cpu_smoke
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    status = {line.split(" (")[0].split(" ", 1)[1]: line.split(" ")[0] for line in lines}
    assert "FAIL" not in status.values()
    for step in ("process group", "Qwen2 built from its config", "FSDP2 with the production options",
                 "padding removal", "log-probs 2 x 96", "PPO step 2 x 96", "log-probs 4 x 96", "PPO step 4 x 96",
                 "full parameters streamed into a bf16 copy", "sharded checkpoint save and load",
                 "rollout replica protocol on the HF engine", "checkpoint engine between two processes",
                 "reward model forward at the token bound"):
        assert status.get(step) == "PASS", (step, lines)
    skips = [line for line in lines if line.startswith("SKIP")]
    # only the CUDA-specific steps are skipped, each with its reason
    assert [line.split(" (")[0] for line in skips] == ["SKIP nccl all-reduce", "SKIP device-index rule",
                                                       "SKIP reference offload to host"]
    assert all("no CUDA" in line for line in skips)
    assert lines[-1].startswith("PASS bare smoke: 13 passed, 0 failed, 3 skipped")


def test_the_bare_smoke_names_the_attention_it_used_and_what_it_measured(cpu_smoke):
    _, lines = cpu_smoke
    text = "\n".join(lines)
    assert "rlhf_packed_sdpa (per-sequence SDPA: no CUDA)" in text
    assert "bf16 compute" in text and "log-probs identical" in text and "GB/s" in text


def test_a_failing_step_is_a_fail_line_and_a_nonzero_exit(tmp_path):
    # the check can fail: a work folder that is a file ends the first step, and the check
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke_bare.py"), "--shape", "tiny",
                          "--work", str(not_a_folder)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert out.returncode == 1
    assert lines[0].startswith("FAIL process group")
    assert lines[-1].startswith("FAIL bare smoke: 0 passed, 1 failed")


def test_one_cpu_rank_asked_for_bf16_trains_under_fsdp_and_fp32_trains_the_plain_module(tmp_path):
    """The world-size-1 rule of ``sharding.wrap`` (on a GPU, FSDP always: mixed precision is
    FSDP's): checked in a one-rank gloo group."""
    code = f"""
import torch, torch.distributed as dist
from rlhf_core.distributed import sharding
from rlhf_core.models.qwen2 import qwen2_from_config
dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0, world_size=1)
shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
bf16 = sharding.wrap(qwen2_from_config(seed=0, **shape), sharding.ShardingSpec(mixed_precision="bf16"))
plain = sharding.wrap(qwen2_from_config(seed=0, **shape), sharding.ShardingSpec())
streamed = dict(sharding.stream_full_parameters(bf16, dtype=torch.bfloat16))
print(sharding.is_sharded(bf16), sharding.is_sharded(plain),
      {{str(t.dtype) for t in streamed.values()}}, type(streamed["lm_head.weight"]).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "True False {'torch.bfloat16'} Tensor"


def test_streaming_casts_each_shard_before_it_is_gathered():
    """``dtype`` halves the bytes a bf16 engine's weight sync gathers: the cast happens on
    the shard (the gather then moves bf16), and plain tensors are cast as well."""
    from rlhf_core.distributed import sharding

    model = torch.nn.Linear(4, 3)
    as_is = dict(sharding.stream_full_parameters(model))
    cast = dict(sharding.stream_full_parameters(model, dtype=torch.bfloat16))
    assert {t.dtype for t in as_is.values()} == {torch.float32}
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}
    assert torch.equal(cast["weight"], model.weight.detach().to(torch.bfloat16))
