"""Bare-machine GPU smoke check: the training path's GPU parts on a machine that has only
``python3`` with torch, transformers, safetensors and fsspec (no Ray, vLLM, tensordict,
zarr, no network).

    bash benchmarks/gpu_smoke_bare.sh            # one GPU, under 10 minutes
    python3 benchmarks/gpu_smoke_bare.py --shape tiny   # CPU: the CUDA-only steps say SKIP

One ``PASS``/``FAIL``/``SKIP`` line per step, in the order a run meets them: the process
group with the production backends (NCCL and gloo), the device-index rule, a
Qwen2-0.5B-shaped model built from its config, FSDP2 on a one-rank mesh with the production
options (bf16 mixed precision, activation checkpointing, a reference with its parameters
offloaded), padding removal (flash-attn's varlen kernel where installed, else torch's own,
else the per-sequence SDPA fallback, named) checked against the padded forward, log-probs and a PPO step at 4 x 1536
and 40 x 1536 tokens over the 151,936-token vocabulary with the peak memory of each, the
full parameters streamed into a bf16 copy (compared by logits, with GB/s), and a sharded
checkpoint saved and loaded (identical log-probs), the rollout replica protocol on the HF
engine (per-request limits, log-probs against a forward, a weight sync), the checkpoint
engine between two processes (NCCL with two GPUs; NCCL refuses two ranks on one GPU, so
gloo there), and a reward model's forward at gpu.yaml's token bound with its peak memory.
Exits 1 if a step fails.

On a CPU machine (``--shape tiny``; the test in ``tests/test_gpu_smoke_bare.py`` runs it so,
with Ray, vLLM, tensordict and zarr blocked) every step runs except those that need CUDA,
each named with its reason. The full Ray + vLLM smoke for a GPU image is ``gpu_smoke.sh``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, not installed there

import torch  # noqa: E402

#: Qwen2.5-0.5B's shape (its config.json), and a tiny one for CPU checks; both keep the
#: real vocabulary, whose projection dominates log-prob memory.
SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),
}
VOCAB = 151_936
#: (rows, tokens per row) of the log-prob and PPO steps, per shape
BATCHES = {"qwen2-0.5b": [(4, 1536), (40, 1536)], "tiny": [(2, 96), (4, 96)]}


class Steps:
    """One line per step; a failed step ends the check (later steps need its result). A
    step's result comes back from ``run``; a text result is printed on its line too.
    (``gpu_smoke.py`` reports its steps with this class as well.)"""

    def __init__(self) -> None:
        self.failed = False
        self.results: list[tuple[str, str]] = []

    def run(self, name: str, step):
        if self.failed:
            return None
        t0 = time.perf_counter()
        try:
            out = step()
        except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
            self.failed = True
            traceback.print_exc()
            self.results.append(("FAIL", name))  # the error last on its line, where a log's tail shows it
            print(f"FAIL {name} ({time.perf_counter() - t0:.1f}s): {type(exc).__name__}: {exc}", flush=True)
            return None
        self._line("PASS", name, f"{time.perf_counter() - t0:.1f}s" + (f": {out}" if isinstance(out, str) else ""))
        return out

    def skip(self, name: str, why: str) -> None:
        if not self.failed:
            self._line("SKIP", name, why)

    def _line(self, status: str, name: str, detail: str) -> None:
        self.results.append((status, name))
        print(f"{status} {name} ({detail})", flush=True)


def _peak(on_gpu: bool) -> str:
    return f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if on_gpu else "peak memory not measured on CPU"


def _reset_peak(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def make_batch(rows: int, tokens: int, device: torch.device, seed: int = 0) -> dict:
    """Left-padded prompts (a third of the row) and right-padded responses of varied
    lengths, as a rollout hands them to the log-prob stage."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = tokens // 3
    response_len = tokens - prompt_len
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    for r in range(rows):
        mask[r, : int(torch.randint(0, prompt_len // 2, (1,), generator=g))] = 0            # prompt padding
        mask[r, prompt_len + int(torch.randint(1, response_len, (1,), generator=g)):] = 0   # response ends
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": position_ids.to(device),
            "response_length": response_len, "response_mask": mask[:, prompt_len:].to(device)}


def _weight_transfer_rank(rank: int, backend: str, out: str, shape: dict) -> None:
    """One side of the checkpoint engine: rank 0 sends a model's weights in 64 MiB buckets,
    rank 1 receives them into a model of its own and compares."""
    from rlhf_core.models.qwen2 import qwen2_from_config
    from rlhf_core.rollout import checkpoint_engine

    if backend == "nccl":
        torch.cuda.set_device(rank)
    model = qwen2_from_config(seed=rank, vocab_size=VOCAB, **shape).to(torch.bfloat16)
    if backend == "nccl":
        model = model.cuda()
    port_file = Path(out + ".port")
    if rank == 0:
        store, port = checkpoint_engine.WeightGroup.host_store("127.0.0.1", 2, timeout_s=120)
        port_file.write_text(str(port))
        group = checkpoint_engine.WeightGroup("127.0.0.1", port, 0, 2, backend, timeout_s=120, store=store)
        checkpoint_engine.send(group, model.state_dict().items(), 64 << 20, version=3)
        group.barrier().wait()
        return
    deadline = time.monotonic() + 120
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError("the sender published no port")
        time.sleep(0.05)
    group = checkpoint_engine.WeightGroup("127.0.0.1", int(port_file.read_text()), 1, 2, backend, timeout_s=120)
    held, versions, received, buckets = model.state_dict(), [], 0, set()
    t0 = time.perf_counter()
    for name, tensor in checkpoint_engine.receive(group, on_version=versions.append):
        held[name].copy_(tensor)
        received += tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - t0
    group.barrier().wait()
    expected = qwen2_from_config(seed=0, vocab_size=VOCAB, **shape).to(torch.bfloat16).state_dict()
    differ = [k for k, v in held.items() if not torch.equal(v.cpu(), expected[k])]
    chunks = -(-received // (64 << 20))
    torch.save({"equal": not differ, "differ": differ, "bytes": received, "seconds": seconds,
                "version": versions[-1] if versions else None, "buckets": chunks}, out + ".rank1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model shape (default: qwen2-0.5b with CUDA, tiny without)")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the rendezvous file and the checkpoint (default: a new temporary one)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    shape = args.shape or ("qwen2-0.5b" if on_gpu else "tiny")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
          f"{torch.cuda.get_device_name(0) if on_gpu else 'no GPU'}; shape {shape}", flush=True)

    import torch.distributed as dist

    from rlhf_core.algorithms.core import agg_loss, compute_policy_loss, kl_penalty
    from rlhf_core.checkpoint.reader import load_sharded
    from rlhf_core.checkpoint.writer import finish_sharded, start_sharded
    from rlhf_core.distributed import sharding
    from rlhf_core.models.qwen2 import qwen2_from_config
    from rlhf_core.runtime.gpus import local_device_index
    from rlhf_core.workers import devices, packing
    from rlhf_core.workers.modeling import response_log_probs

    steps = Steps()
    work = args.work or Path(tempfile.mkdtemp(prefix="rlhf-smoke-"))
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    state: dict = {}

    # ------------------------------------------------------------ process group, device index
    def process_group():
        backend = devices.process_group_backend(on_gpu)
        kwargs = {"device_id": device} if on_gpu else {}
        dist.init_process_group(backend, init_method=f"file://{work}/rendezvous", rank=0, world_size=1, **kwargs)
        cpu = torch.ones(2)
        dist.all_reduce(cpu)  # gloo: what the background checkpoint writer and offloaded gradients use
        done = [f"{backend}; gloo all-reduce ok"]
        if on_gpu:
            gpu = torch.ones(2, device=device)
            dist.all_reduce(gpu)
            torch.cuda.synchronize()
            done.append("nccl all-reduce ok")
        return ", ".join(done)

    steps.run("process group", process_group)
    if not on_gpu:
        steps.skip("nccl all-reduce", "no CUDA: the CPU group is gloo alone")

    def device_index():
        # the worker's rule (Worker binds LOCAL_RANK with it): the GPU Ray assigned, as this
        # process numbers its devices; each one visible here, then one as Ray narrows it
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
        seen = {}
        old = os.environ.get("LOCAL_RANK")
        try:
            for gpu in ids:
                os.environ["LOCAL_RANK"] = str(local_device_index([gpu], visible))
                seen[gpu] = sharding.device()
                torch.ones(1, device=seen[gpu])  # a valid ordinal
        finally:
            os.environ.pop("LOCAL_RANK", None) if old is None else os.environ.__setitem__("LOCAL_RANK", old)
        narrowed = local_device_index([ids[-1]], ids[-1])
        if narrowed != 0:
            raise AssertionError(f"a worker Ray narrowed to GPU {ids[-1]} got device {narrowed}, expected 0")
        return ", ".join(f"Ray GPU {k} -> {v}" for k, v in seen.items()) + "; narrowed to one GPU -> cuda:0"

    if on_gpu:
        steps.run("device-index rule", device_index)
    else:
        steps.skip("device-index rule", "no CUDA: sharding.device() is the CPU")

    # ------------------------------------------------------------ model, FSDP, padding removal
    def build():
        model = qwen2_from_config(seed=0, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=32768,
                                  **SHAPES[shape])
        state["implementation"] = packing.enable_packing(model, on_gpu=on_gpu)
        state["weights"] = sharding.FullWeights.of(model)  # what rank 0 broadcasts to the others
        # the reference as the actor builds it: on the meta device, in the dtype it computes
        # in, filled from the policy's weights when it is sharded (the other ranks' path)
        with torch.device("meta"):
            reference = qwen2_from_config(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=32768,
                                          **SHAPES[shape])
        for p in reference.parameters():
            p.data = p.data.to(torch.bfloat16)
        packing.enable_packing(reference, on_gpu=on_gpu)
        state["reference"] = reference.eval().requires_grad_(False)
        state["model"] = model
        return f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, vocabulary {VOCAB}"

    steps.run("Qwen2 built from its config", build)

    def wrap():
        # the production options; on CPU bf16 is asked for by name (auto means fp32 there)
        spec = sharding.ShardingSpec(mixed_precision="auto" if on_gpu else "bf16", activation_checkpointing=True)
        policy = sharding.wrap(state.pop("model"), spec)
        reference = sharding.wrap(state.pop("reference"), sharding.ShardingSpec(
            mixed_precision=spec.mixed_precision, param_offload=True), trainable=False, source=state.pop("weights"))
        if not (sharding.is_sharded(policy) and sharding.is_sharded(reference)):
            raise AssertionError("one rank was not wrapped in FSDP")
        seen = []
        hook = policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].dtype))
        with torch.no_grad():
            policy(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device))
        hook.remove()
        if seen != [torch.bfloat16]:
            raise AssertionError(f"expected bf16 compute, found {seen}")
        ref_param = next(iter(reference.parameters())).to_local()
        ref_device = ref_param.device
        if on_gpu and ref_device.type != "cpu":
            raise AssertionError(f"the reference's parameters are on {ref_device}, expected the host")
        if ref_param.dtype != torch.bfloat16:
            raise AssertionError(f"the reference's shards are {ref_param.dtype}, expected bf16")
        state.update(policy=policy, reference=reference,
                     optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-6))
        state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(state["optimizer"], lambda step: 1.0)
        return (f"one-rank mesh, bf16 compute, fp32 master weights, activation checkpointing; reference "
                f"built on the meta device, filled from the policy's weights, bf16 shards on {ref_device.type}")

    steps.run("FSDP2 with the production options", wrap)
    if not on_gpu:
        steps.skip("reference offload to host", "no CUDA: the parameters are already in host memory")

    def padding_removal():
        impl = state["implementation"]
        name = {"flash_attention_2": impl, packing.PACKED_VARLEN: f"{impl} (torch's varlen FlashAttention)",
                }.get(impl, f"{impl} (per-sequence SDPA: " + ("no varlen kernel in this torch)" if on_gpu
                                                              else "no CUDA)"))
        batch = make_batch(*BATCHES[shape][0], device, seed=1)
        args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["response_length"])
        with torch.no_grad():
            packed, _ = response_log_probs(state["policy"], *args, packed=True)
            padded, _ = response_log_probs(state["policy"], *args, packed=False)
        mask = batch["response_mask"].bool()
        diff = (packed - padded)[mask].abs()
        # both in bf16: the packed forward sums in another order, not another result
        if diff.mean() > 0.02 or diff.max() > 0.5:
            raise AssertionError(f"packed log-probs differ from padded: mean {diff.mean():.4f}, max {diff.max():.4f}")
        return f"{name}; |packed - padded| mean {diff.mean():.5f}, max {diff.max():.4f}"

    steps.run("padding removal", padding_removal)

    # ------------------------------------------------------------ log-probs and PPO steps
    for rows, tokens in BATCHES[shape]:
        batch = make_batch(rows, tokens, device, seed=rows)
        args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["response_length"])
        real = int(batch["attention_mask"].sum())

        def log_probs(args=args, batch=batch, real=real):
            _reset_peak(on_gpu)
            t0 = time.perf_counter()
            with torch.no_grad():
                batch["old_log_prob"], _ = response_log_probs(state["policy"], *args, packed=True)
                batch["ref_log_prob"], _ = response_log_probs(state["reference"], *args, packed=True)
            if on_gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if not torch.isfinite(batch["old_log_prob"]).all():
                raise AssertionError("non-finite log-probs")
            detail = ""
            if "updated" not in state:  # before any update the reference is the policy
                gap = (batch["old_log_prob"] - batch["ref_log_prob"])[batch["response_mask"].bool()].abs().max()
                if gap > 1e-3:
                    raise AssertionError(f"the reference's log-probs differ from the policy's by {float(gap)}")
                detail = f"; |policy - reference| {float(gap):.2g} before any update"
            return f"policy + offloaded reference, {real} real tokens in {seconds:.2f}s, {_peak(on_gpu)}{detail}"

        def ppo_step(args=args, batch=batch, real=real):
            policy, optimizer = state["policy"], state["optimizer"]
            mask = batch["response_mask"]
            advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)).to(device) * mask
            _reset_peak(on_gpu)
            t0 = time.perf_counter()
            policy.train()
            log_prob, entropy = response_log_probs(policy, *args, with_entropy=True, packed=True)
            loss = compute_policy_loss(batch["old_log_prob"], log_prob, advantages, mask)["pg_loss"]
            loss = loss + 0.001 * agg_loss(kl_penalty(log_prob, batch["ref_log_prob"], "low_var_kl"), mask, "token-mean")
            loss.backward()
            norm = sharding.grad_norm_and_clip(policy, 1.0)
            optimizer.step()
            state["scheduler"].step()
            optimizer.zero_grad(set_to_none=True)
            state["updated"] = True
            policy.eval()
            if on_gpu:
                torch.cuda.synchronize()
            if not (torch.isfinite(loss) and norm == norm):
                raise AssertionError(f"loss {loss.item()}, grad norm {norm}")
            return (f"loss {loss.item():.4f}, grad norm {norm:.3f}, {real} real tokens in "
                    f"{time.perf_counter() - t0:.2f}s, {_peak(on_gpu)}")

        steps.run(f"log-probs {rows} x {tokens}", log_probs)
        steps.run(f"PPO step {rows} x {tokens}", ppo_step)
        if steps.failed:
            break

    # ------------------------------------------------------------ weight sync into a bf16 copy
    def stream_to_bf16_copy():
        with device:  # what an engine holds: a bf16 model on the GPU, its weights to be overwritten
            copy_model = qwen2_from_config(vocab_size=VOCAB, tie_word_embeddings=True,
                                           max_position_embeddings=32768, **SHAPES[shape])
        for p in copy_model.parameters():  # parameters only: rotary frequencies stay fp32, as in vLLM
            p.data = p.data.to(torch.bfloat16)
        copy_model.eval()
        target = copy_model.state_dict()
        if on_gpu:
            torch.cuda.synchronize()
        t0, moved = time.perf_counter(), 0
        for name, tensor in sharding.stream_full_parameters(state["policy"], dtype=torch.bfloat16):
            if tensor.dtype != torch.bfloat16 and tensor.is_floating_point():
                raise AssertionError(f"{name} streamed as {tensor.dtype}, expected bfloat16")
            target[name].copy_(tensor)
            moved += tensor.numel() * tensor.element_size()
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        batch = make_batch(*BATCHES[shape][0], device, seed=3)
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        with torch.no_grad():
            ours = sharding.unwrap(state["policy"])(**inputs).logits.float()
            theirs = copy_model(**inputs).logits.float()
        real = batch["attention_mask"].bool()  # padding's logits mean nothing
        diff, scale = (ours - theirs)[real].abs().max(), ours[real].abs().max()
        # two bf16 forwards agree to a few units in the last place of the largest logit
        # (bf16 keeps 8 bits: 2**-8 relative), not bit for bit: kernels may differ
        if diff > scale * 2**-5:
            raise AssertionError(f"the bf16 copy's logits differ from the policy's by {float(diff):.4f} "
                                 f"(largest logit {float(scale):.2f})")
        return (f"{moved / 1e9:.2f} GB in {seconds:.2f}s ({moved / 1e9 / seconds:.1f} GB/s); max |logit diff| "
                f"{float(diff):.4f} of largest |logit| {float(scale):.2f}")

    steps.run("full parameters streamed into a bf16 copy", stream_to_bf16_copy)

    # ------------------------------------------------------------ sharded checkpoint
    def checkpoint():
        policy, optimizer, scheduler = state["policy"], state["optimizer"], state["scheduler"]
        uri = str(work / "checkpoint")
        t0 = time.perf_counter()
        digests = finish_sharded(start_sharded(uri, "actor", policy, optimizer, scheduler))
        saved = time.perf_counter() - t0
        batch = make_batch(*BATCHES[shape][0], device, seed=4)
        args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["response_length"])
        with torch.no_grad():
            before, _ = response_log_probs(policy, *args, packed=True)
            for p in policy.parameters():  # what the load must undo
                p.add_(0.01)
            moved, _ = response_log_probs(policy, *args, packed=True)
        t0 = time.perf_counter()
        load_sharded(uri, "actor", policy, optimizer, scheduler, expected=digests)
        loaded = time.perf_counter() - t0
        with torch.no_grad():
            after, _ = response_log_probs(policy, *args, packed=True)
        if torch.equal(moved, before):
            raise AssertionError("the perturbation did not change the log-probs: the check could not fail")
        if not torch.equal(after, before):
            raise AssertionError(f"log-probs after the load differ by {float((after - before).abs().max())}")
        size = sum(f.stat().st_size for f in (work / "checkpoint").rglob("*") if f.is_file())
        return f"{size / 1e9:.2f} GB saved in {saved:.1f}s (async_save), loaded in {loaded:.1f}s; log-probs identical"

    steps.run("sharded checkpoint save and load", checkpoint)

    # ------------------------------------------------------------ rollout replica, checkpoint engine
    def hf_replica():
        from types import SimpleNamespace

        from rlhf_core.rollout.engine import GenerationRequest, Sampling
        from rlhf_core.rollout.engines.hf import HFEngine

        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
        first, second = (qwen2_from_config(seed=s, vocab_size=VOCAB, **SHAPES["tiny"]).to(device).eval()
                         for s in (1, 2))
        engine = HFEngine(first, tokenizer, None, seed=0, owns_weights=True)
        g = torch.Generator().manual_seed(3)
        requests = [GenerationRequest(f"r{i}", tuple(torch.randint(2, VOCAB, (n,), generator=g).tolist()), seed=7,
                                      max_tokens=limit) for i, (n, limit) in enumerate([(5, None), (9, 3), (2, 6)])]
        sampled = engine.generate(requests, Sampling(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8))
        worst = 0.0
        for request, answer in zip(requests, sampled):  # each log-prob is the model's own, teacher-forced
            if not 0 < len(answer.token_ids) <= request.limit(Sampling(1.0, 1.0, -1, 8)):
                raise AssertionError(f"{request.request_id}: {len(answer.token_ids)} tokens past its limit")
            ids = torch.tensor([list(request.prompt_ids) + answer.token_ids], device=device)
            with torch.no_grad():
                logits = first(input_ids=ids).logits[0, len(request.prompt_ids) - 1:-1].float()
            forced = torch.log_softmax(logits, -1).gather(-1, ids[0, len(request.prompt_ids):, None]).squeeze(-1)
            worst = max(worst, float((forced.cpu() - torch.tensor(answer.log_probs)).abs().max()))
        if worst > 1e-3:
            raise AssertionError(f"the engine's log-probs differ from the model's by {worst:.2e}")
        greedy = Sampling(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=6, greedy=True)
        engine.update_weights(second.state_dict().items())  # a weight sync: the replica now serves the second
        theirs = HFEngine(second, tokenizer, None, seed=0).generate(requests, greedy)
        if [a.token_ids for a in engine.generate(requests, greedy)] != [a.token_ids for a in theirs]:
            raise AssertionError("after update_weights the replica does not answer as the model it was sent")
        return f"3 requests, per-request limits kept, log-probs within {worst:.1e} of a forward; weights replaced"

    steps.run("rollout replica protocol on the HF engine", hf_replica)

    def weight_transfer():
        import torch.multiprocessing as mp

        backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
        out = work / "weights"
        t0 = time.perf_counter()
        mp.start_processes(_weight_transfer_rank, args=(backend, str(out), SHAPES[shape]), nprocs=2,
                           start_method="spawn")
        wall = time.perf_counter() - t0
        result = torch.load(f"{out}.rank1")
        if not result["equal"]:
            raise AssertionError(f"the received weights differ: {result['differ'][:3]}")
        why = "" if backend == "nccl" else (" (NCCL refuses two ranks on one GPU: gloo)" if on_gpu else "")
        return (f"{backend}{why}: {result['bytes'] / 2**20:.0f} MiB in {result['buckets']} buckets, "
                f"{result['bytes'] / 2**30 / max(result['seconds'], 1e-9):.2f} GiB/s, version {result['version']}; "
                f"{wall:.1f}s with process start")

    steps.run("checkpoint engine between two processes", weight_transfer)

    def reward_model_forward():
        from transformers import Qwen2Config, Qwen2ForSequenceClassification

        config = Qwen2Config(vocab_size=VOCAB, num_labels=1, pad_token_id=0, **SHAPES[shape],
                             max_position_embeddings=32768)
        model = Qwen2ForSequenceClassification(config).to(device=device, dtype=torch.bfloat16).eval()
        rows, tokens = (16, 2048) if on_gpu else (2, 96)  # gpu.yaml's bound: 32768 tokens a forward
        batch = make_batch(rows, tokens, device, seed=5)
        _reset_peak(on_gpu)
        with torch.no_grad():
            scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
        if scores.shape != (rows, 1) or not torch.isfinite(scores).all():
            raise AssertionError(f"scores of shape {tuple(scores.shape)}, finite: {bool(torch.isfinite(scores).all())}")
        per_layer = 6 * config.hidden_size + 4 * config.intermediate_size
        estimate = rows * tokens * (per_layer + config.hidden_size) * 2  # config.micro_batch_memory's rule
        del model
        return f"{rows} x {tokens} tokens, {_peak(on_gpu)}; estimated activations {estimate / 2**30:.2f} GiB"

    steps.run("reward model forward at the token bound", reward_model_forward)

    if dist.is_initialized():
        dist.destroy_process_group()
    failed = [name for status, name in steps.results if status == "FAIL"]
    skipped = [name for status, name in steps.results if status == "SKIP"]
    print(f"{'FAIL' if failed else 'PASS'} bare smoke: {sum(s == 'PASS' for s, _ in steps.results)} passed, "
          f"{len(failed)} failed, {len(skipped)} skipped{' (' + ', '.join(skipped) + ')' if skipped else ''}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
