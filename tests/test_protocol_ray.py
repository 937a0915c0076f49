"""DataProto across real Ray actors: the wire is the same pickle-free format."""

import pytest
import torch

from rlhf_core.protocol import DataProto, UnsupportedObjectError, object_column


obj = object_column  # one object per row (lists stay cells)


def test_actor_to_actor_roundtrip_keeps_every_layer(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Hop:
        def __init__(self, peer=None):
            self.peer = peer

        def forward(self, data):
            if self.peer is not None:
                data = ray.get(self.peer.forward.remote(data))
            data.batch["ids"] += 1  # received tensors must be writable
            return data

    last = Hop.remote()
    first = Hop.remote(last)
    big = torch.arange(300_000, dtype=torch.int64).reshape(3, -1)  # out-of-band sized
    dp = DataProto.from_dict(
        {"ids": big, "bf": torch.tensor([0.5, 1.5, -2.0], dtype=torch.bfloat16)},
        {"uid": obj(["a", "b", "c"]), "extra": obj([{"k": [1]}, None, 3])},
        {"temperature": 0.7, "metrics": {"m": [1.0]}},
    )
    out = ray.get(first.forward.remote(dp))
    assert torch.equal(out.batch["ids"], big + 2)
    assert out.batch["bf"].dtype == torch.bfloat16 and torch.equal(out.batch["bf"], dp.batch["bf"])
    assert out.non_tensor_batch["uid"].tolist() == ["a", "b", "c"]
    assert out.non_tensor_batch["extra"].tolist() == [{"k": [1]}, None, 3]
    assert out.meta_info == {"temperature": 0.7, "metrics": {"m": [1.0]}}


def test_unsupported_object_is_refused_before_it_reaches_ray(ray_local):
    dp = DataProto(non_tensor_batch={"img": obj([b"raw-bytes"])})
    with pytest.raises(Exception) as err:  # Ray wraps serializer errors in a TypeError
        ray_local.put(dp)
    chain, exc = [], err.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    ours = [e for e in chain if isinstance(e, UnsupportedObjectError)]
    assert ours, f"expected UnsupportedObjectError in the chain, got {chain!r}"
    assert "non_tensor_batch['img']" in str(ours[0]) and "builtins.bytes" in str(ours[0])
    assert "non_tensor_batch['img']" in str(err.value), "the top-level message must name the column"
