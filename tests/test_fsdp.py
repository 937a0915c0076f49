"""FSDP2 on CPU (gloo) with the trainer's own sharding code: two ranks train what one rank
and two DDP ranks train, and a checkpoint resumes bit-identically, at any world size.

Each case runs real ranks as processes (torch.multiprocessing, a file rendezvous); the
model is a few-layer Qwen2 built from a config, so its decoder layers are what FSDP shards.
"""

from __future__ import annotations

import json
import os
import pickle
import uuid
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROWS, SEQ = 8, 12


def _model():
    from rlhf_core.models.qwen2 import qwen2_from_config

    return qwen2_from_config(0, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                             tie_word_embeddings=False)


def _data(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _rank_main(rank: int, world: int, rdzv: str, strategy: str, steps: range, load: str | None,
               save_at: int | None, ckpt: str, out: str, expected: dict | None = None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import modeling
    from rlhf_core.checkpoint.reader import load_sharded
    from rlhf_core.checkpoint.writer import finish_sharded, start_sharded

    worker = Worker()
    # "hsdp": FSDP over a (replicas, shards) mesh of one-rank shard groups
    spec = sharding.ShardingSpec(strategy="fsdp", fsdp_size=1) if strategy == "hsdp" else \
        sharding.ShardingSpec(strategy=strategy)
    model = modeling.init_distributed_model(worker, _model(), spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if load:
        load_sharded(load, "actor", model, optimizer, scheduler, expected=expected)
    share = ROWS // world
    for step in steps:
        ids = _data(step)[rank * share:(rank + 1) * share]
        optimizer.zero_grad(set_to_none=True)
        # HSDP accumulates two micro-batches, all-reducing across replicas on the last only,
        # its layers kept gathered between them
        parts = ids.chunk(2) if strategy == "hsdp" else (ids,)
        for i, part in enumerate(parts):
            sharding.all_reduce_across_replicas(model, now=i == len(parts) - 1)
            sharding.keep_gathered_after_backward(model, keep=i < len(parts) - 1)
            logits = model(input_ids=part).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), part[:, 1:].reshape(-1))
            (loss / len(parts)).backward()
        sharding.grad_norm_and_clip(model, 0.5)
        optimizer.step()
        if save_at == step:  # the workers' own path: written in the background, on a group of its own
            group = torch.distributed.new_group(backend="gloo") if world > 1 else None
            written = finish_sharded(start_sharded(ckpt, "actor", model, optimizer, scheduler, process_group=group))
            Path(f"{out}.sha256.rank{rank}").write_text(json.dumps(written))  # what the run's manifest records
    model_state, _ = sharding.full_state(model, optimizer)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    if rank == 0:
        torch.save({"state": model_state, "local": local}, out)
    worker_local = torch.tensor([local])
    torch.save(worker_local, f"{out}.rank{rank}")


def train(tmp_path, world: int, strategy: str, steps: range, load: str | None = None,
          save_at: int | None = None, expected: dict | None = None) -> dict:
    tag = uuid.uuid4().hex[:8]
    out, ckpt = str(tmp_path / f"final-{tag}.pt"), f"file://{tmp_path}/ckpt-{tag}"
    mp.start_processes(_rank_main, args=(world, tag, strategy, steps, load, save_at, ckpt, out, expected),
                       nprocs=world, start_method="spawn")
    result = torch.load(out)
    result["ckpt"] = ckpt
    if save_at is not None:
        result["sha256"] = {k: v for r in range(world)
                            for k, v in json.loads(Path(f"{out}.sha256.rank{r}").read_text()).items()}
    result["local_per_rank"] = [int(torch.load(f"{out}.rank{r}")[0]) for r in range(world)]
    return result


_saved_runs: dict = {}


def trained_and_saved(tmp_path_factory, world: int) -> dict:
    """Three FSDP steps at ``world`` ranks, checkpointed after step 0: the same run for
    every resume case that starts from it (the runs are deterministic)."""
    if world not in _saved_runs:
        _saved_runs[world] = train(tmp_path_factory.mktemp(f"saved-{world}"), world, "fsdp", range(3), save_at=0)
    return _saved_runs[world]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_fsdp_ranks_train_what_one_rank_and_two_ddp_ranks_train(tmp_path):
    one = train(tmp_path, 1, "fsdp", range(3))
    fsdp = train(tmp_path, 2, "fsdp", range(3))
    ddp = train(tmp_path, 2, "ddp", range(3))
    hsdp = train(tmp_path, 2, "hsdp", range(3))  # two replicas of one-rank shard groups
    start = _model().state_dict()
    assert _max_diff(one["state"], start) > 1e-3, "the steps must move the weights"
    assert _max_diff(fsdp["state"], one["state"]) < 1e-5
    assert _max_diff(fsdp["state"], ddp["state"]) < 1e-5
    # HSDP's run accumulates two micro-batches: the same gradient summed in another order,
    # through three Adam steps at lr 1e-2 (a step that skipped the all-reduce would be off by far more)
    assert _max_diff(hsdp["state"], fsdp["state"]) < 1e-4
    # each FSDP rank holds about half the parameters; each DDP and HSDP-replica rank all of them
    total = sum(t.numel() for t in start.values())
    assert ddp["local_per_rank"] == [total, total] and hsdp["local_per_rank"] == [total, total]
    assert sum(fsdp["local_per_rank"]) == total and max(fsdp["local_per_rank"]) <= 0.55 * total


@pytest.mark.parametrize("saved_world,resume_world,resume_strategy",
                         [(2, 2, "fsdp"), (2, 1, "fsdp"), (1, 2, "fsdp"), (2, 2, "ddp"), (2, 2, "hsdp")])
def test_sharded_checkpoint_resumes_bit_identical_and_reshards(tmp_path, tmp_path_factory, saved_world,
                                                               resume_world, resume_strategy):
    """Save after step 0 with the workers' background save (every rank writes its shards),
    load in fresh processes at the same or another world size (DCP reshards), or under
    DDP, train steps 1-2: the weights equal an unbroken run's bit for bit at the same world
    size and strategy, within float rounding otherwise."""
    straight = trained_and_saved(tmp_path_factory, saved_world)
    shards = sorted(p.name for p in Path(straight["ckpt"].removeprefix("file://"), "actor").iterdir())
    assert shards == [".metadata", *(f"__{r}_0.distcp" for r in range(saved_world)),
                      *(f"rank-{r:05d}.pt" for r in range(saved_world))], shards
    resumed = train(tmp_path, resume_world, resume_strategy, range(1, 3), load=straight["ckpt"],
                    expected=straight["sha256"])
    assert _max_diff(straight["state"], _model().state_dict()) > 1e-3, "the steps must move the weights"
    if resume_world == saved_world and resume_strategy == "fsdp":
        for key, tensor in straight["state"].items():
            assert torch.equal(tensor, resumed["state"][key]), key
    else:  # one rank sums gradients in another order: equal within float rounding
        assert _max_diff(straight["state"], resumed["state"]) < 1e-5


class CreatesAFile:
    """Pickled, it makes whoever unpickles it create ``path``: code run by loading."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _load_main(rank: int, world: int, rdzv: str, ckpt: str, expected: dict, swapped: bytes, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    import io

    from fsspec.implementations.local import LocalFileSystem

    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import modeling
    from rlhf_core.checkpoint.reader import load_sharded

    if rank == 1:  # the store answers rank 1 with other .metadata bytes than rank 0 got (replaced in between)
        real_open = LocalFileSystem._open
        LocalFileSystem._open = lambda fs, path, mode="rb", **kw: (
            io.BytesIO(swapped) if str(path).endswith("/.metadata") and "r" in mode else real_open(fs, path, mode, **kw))
    model = modeling.init_distributed_model(Worker(), _model(), sharding.ShardingSpec(strategy="fsdp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    try:
        load_sharded(ckpt, "actor", model, optimizer, scheduler, expected=expected)
        outcome = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
        outcome = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.rank{rank}").write_text(outcome)


def test_every_rank_loads_only_the_metadata_bytes_it_checked_itself(tmp_path, tmp_path_factory):
    """Two ranks load one checkpoint; rank 1's read of .metadata returns a pickle that
    creates a file when loaded (the file replaced after rank 0 read it). Rank 1 checks
    the bytes it got against the commit before unpickling them: nothing is created, both
    ranks refuse in one line naming the file."""
    saved = trained_and_saved(tmp_path_factory, 2)
    marker = tmp_path / "created-by-a-pickle"
    out = str(tmp_path / "outcome")
    swapped = pickle.dumps(CreatesAFile(marker))
    mp.start_processes(_load_main, args=(2, uuid.uuid4().hex[:8], saved["ckpt"], saved["sha256"], swapped, out),
                       nprocs=2, start_method="spawn")
    assert not marker.exists(), "a rank unpickled .metadata bytes it had not checked"
    outcomes = [Path(f"{out}.rank{r}").read_text() for r in range(2)]
    for outcome in outcomes:
        assert outcome.startswith("CorruptCheckpointError: ") and "\n" not in outcome, outcome
        assert "/actor/.metadata: sha256 " in outcome and "its iteration committed" in outcome, outcome


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_the_mini_batch_gradient(mode):
    """Gradient accumulation over micro-batches (actor.ppo_micro_batch_size_per_gpu) gives
    the gradient of the whole mini-batch's loss, responses of different lengths included."""
    from rlhf_core.algorithms import agg_loss
    from rlhf_core.protocol import DataProto
    from rlhf_core.workers.modeling import micro_batches

    ids = _data(0)
    mask = (torch.arange(SEQ - 1)[None, :] < torch.tensor([3, 11, 5, 7, 11, 2, 9, 4])[:, None]).long()
    batch = DataProto.from_dict({"input_ids": ids, "response_mask": mask})

    def grads(micro_rows):
        model = _model()
        for part, weight in micro_batches(batch, micro_rows, mode):
            logits = model(input_ids=part.batch["input_ids"]).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), part.batch["input_ids"][:, 1:].reshape(-1),
                                                    reduction="none").view(len(part), -1)
            (agg_loss(nll, part.batch["response_mask"].float(), mode) * weight).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, micro = grads(0), grads(3)  # 8 rows as 3 + 3 + 2
    assert max((whole[k] - micro[k]).abs().max().item() for k in whole) < 1e-6


def _stream_rank(rank: int, world: int, rdzv: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import modeling

    model = modeling.init_distributed_model(Worker(), _model(), sharding.ShardingSpec(strategy="fsdp"))
    dropped, kept, held = sharding.GatherMeter(), sharding.GatherMeter(), []
    sizes = {}
    for name, tensor in sharding.stream_full_parameters(model, dropped):  # the consumer drops each one
        sizes[name] = tensor.numel() * tensor.element_size()
        del tensor
    for name, tensor in sharding.stream_full_parameters(model, kept):  # one that keeps them all
        held.append(tensor)
    if rank == 0:
        torch.save({"dropped": dropped.peak, "kept": kept.peak, "count": dropped.count, "sizes": sizes}, out)


def test_weight_sync_streams_one_gathered_tensor_at_a_time(tmp_path):
    """The metric perf/weight_sync_peak_gathered_mib measures what it says: streaming the
    sharded weights to a consumer that drops each tensor peaks at the largest single
    tensor (not a model copy); a consumer that keeps them all peaks at their sum."""
    out = str(tmp_path / "stream.pt")
    mp.start_processes(_stream_rank, args=(2, uuid.uuid4().hex[:8], out), nprocs=2, start_method="spawn")
    seen = torch.load(out)
    gathered = seen["sizes"]
    assert seen["count"] == len(gathered) > 3
    assert seen["dropped"] == max(gathered.values())
    assert seen["kept"] == sum(gathered.values()) > 2 * seen["dropped"]


def _log_prob_rank_main(rank: int, world: int, rdzv: str, strategy: str, chunk: int | None, out: str,
                        packed: bool = False) -> None:
    """Two optimizer steps on a loss over response log-probs and entropies, computed by
    ``modeling.response_log_probs`` (sliced when ``chunk`` is given; padding-free when
    ``packed``)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import modeling, packing

    model = _model()
    if packed:
        packing.enable_packing(model)
    model = modeling.init_distributed_model(Worker(), model, sharding.ShardingSpec(strategy=strategy))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    share = ROWS // world
    for step in range(2):
        ids = _data(step)[rank * share:(rank + 1) * share]
        mask = torch.ones_like(ids)
        mask[::2, -3:] = 0  # every other response ends early
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        log_probs, entropy = modeling.response_log_probs(model, ids, mask, position_ids, 6, 0.8, with_entropy=True,
                                                         chunk_tokens=chunk, packed=packed)
        resp = mask[:, -6:]
        loss = -((log_probs - 0.01 * entropy) * resp).sum() / share  # data-parallel ranks average gradients
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model_state, _ = sharding.full_state(model, optimizer)
    if rank == 0:
        torch.save({"state": model_state}, out)


def test_sliced_log_probs_train_under_fsdp_and_ddp_what_one_full_pass_trains(tmp_path):
    """The sliced vocabulary projection runs inside the sharded model's forward and is
    recomputed in its backward: two FSDP2 ranks and two DDP ranks with slices of 5 tokens
    train the weights one rank trains with one full-vocabulary pass (within what two Adam
    steps make of float rounding: two ranks without slices differ from one by ~6e-5; a
    gradient off by a factor of two differed by 1.5e-3)."""
    def run(world, strategy, chunk, packed=False):
        out = str(tmp_path / f"lp-{uuid.uuid4().hex[:8]}.pt")
        mp.start_processes(_log_prob_rank_main, args=(world, uuid.uuid4().hex[:8], strategy, chunk, out, packed),
                           nprocs=world, start_method="spawn")
        return torch.load(out)["state"]

    one = run(1, "fsdp", None)
    assert _max_diff(one, _model().state_dict()) > 1e-3, "the steps must move the weights"
    assert _max_diff(run(2, "fsdp", 5), one) < 2e-4
    assert _max_diff(run(2, "ddp", 5), one) < 2e-4
    # padding-free: the packed sequences' attention set up before FSDP2 wraps the model
    assert _max_diff(run(2, "fsdp", 5, packed=True), one) < 2e-4


def _meta_main(rank: int, world: int, rdzv: str, out: str) -> None:
    """Rank 0 builds the model with its weights, the others on the meta device; after
    ``wrap`` every rank computes the same logits as the unsharded model, and a bf16
    reference filled from rank 0's weights holds bf16 shards."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.models.qwen2 import qwen2_from_config
    from rlhf_core.workers import modeling

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    ids = _data(0)
    reads = sharding.reads_checkpoint("fsdp", rank, world)
    if reads:
        model = qwen2_from_config(0, **shape)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
    else:
        with torch.device("meta"):
            model = qwen2_from_config(None, **shape)
    weights = sharding.FullWeights.of(model) if reads else None
    policy = modeling.init_distributed_model(Worker(), model, sharding.ShardingSpec(strategy="fsdp"), source=weights)
    with torch.device("meta"):
        reference = qwen2_from_config(None, **shape)
    for p in reference.parameters():  # parameters only, as a model built in bf16: rotary stays fp32
        p.data = p.data.to(torch.bfloat16)
    import torch.distributed as dist

    sent, broadcast = [], dist.broadcast
    dist.broadcast = lambda tensor, *a, **kw: sent.append((tensor.dtype, tensor.device.type)) or \
        broadcast(tensor, *a, **kw)
    reference = sharding.wrap(reference, sharding.ShardingSpec(mixed_precision="bf16"), trainable=False,
                              source=weights)
    dist.broadcast = broadcast
    with torch.no_grad():
        logits = policy(input_ids=ids).logits
        ref_logits = reference(input_ids=ids).logits.float()
    torch.save({"logits": logits, "ref_logits": ref_logits, "expected": expected if reads else None,
                "ref_dtypes": {str(p.dtype) for p in reference.parameters()},
                "on_meta": any(p.is_meta for p in [*policy.parameters(), *reference.parameters()]),
                "inv_freq": policy.model.rotary_emb.inv_freq.clone(),
                "tied": [m.lm_head.weight is m.model.embed_tokens.weight for m in (policy, reference)],
                "sent": sent},
               f"{out}.rank{rank}")


def test_rank_0_reads_the_weights_and_every_rank_gets_them(tmp_path):
    out = str(tmp_path / "meta")
    mp.start_processes(_meta_main, args=(2, uuid.uuid4().hex[:8], out), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    expected = ranks[0]["expected"]
    for seen in ranks:
        assert not seen["on_meta"]
        assert torch.allclose(seen["logits"], expected, atol=1e-5)        # rank 1 read nothing itself
        assert seen["ref_dtypes"] == {"torch.bfloat16"}                    # cast as it was filled
        assert (seen["ref_logits"] - expected).abs().max() < 0.05          # bf16 rounding only
        assert torch.equal(seen["inv_freq"], ranks[0]["inv_freq"])          # buffers too (in no state dict)
        assert seen["tied"] == [True, True]                                 # one embedding, as loaded
    assert torch.equal(ranks[1]["ref_logits"], ranks[0]["ref_logits"])
    # the reference's weights travel cast to its bf16 (half the bytes), each on the device the
    # model is filled on (on a GPU: NCCL, even for shards offloaded to host memory); its
    # rotary buffers stay fp32
    sent = ranks[1]["sent"]
    assert set(sent) == {(torch.bfloat16, "cpu"), (torch.float32, "cpu")}
