"""DataProto: every method on hand-built batches, and every error it promises."""

import pickle
import pickletools

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlhf_core.protocol import (
    AUTO_PADDING_KEY,
    BatchSizeMismatchError,
    ChunkSizeError,
    DataProto,
    DataProtoItem,
    DataProtoTypeError,
    UnionConflictError,
    UnsupportedObjectError,
    object_column,
    pad_dataproto_to_divisor,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


obj = object_column  # one object per row (lists stay cells)


def make(n=4, meta=None):
    """Rows i = 0..n-1 where every column encodes i, so alignment is checkable."""
    return DataProto.from_dict(
        tensors={
            "ids": torch.arange(n * 3).reshape(n, 3),
            "logp": torch.arange(n, dtype=torch.float32) / 10,
        },
        non_tensors={"uid": obj([f"u{i}" for i in range(n)]), "num": np.arange(n)},
        meta_info=dict(meta or {"temperature": 1.0}),
    )


def rows(dp):
    """The row ids each column says it holds (must agree when aligned)."""
    return {
        "ids": (dp.batch["ids"][:, 0] // 3).tolist(),
        "logp": [round(x * 10) for x in dp.batch["logp"].tolist()],
        "uid": [int(u[1:]) for u in dp.non_tensor_batch["uid"]],
        "num": dp.non_tensor_batch["num"].tolist(),
    }


def assert_rows(dp, expected):
    for column, got in rows(dp).items():
        assert got == expected, f"column {column} holds rows {got}, expected {expected}"


# ------------------------------------------------------------------ construction


def test_from_single_dict_splits_tensors_and_arrays():
    dp = DataProto.from_single_dict({"a": torch.ones(3, 2), "s": obj(["x", "y", "z"])},
                                    meta_info={"k": 1})
    assert list(dp.batch.keys()) == ["a"]
    assert list(dp.non_tensor_batch) == ["s"]
    assert dp.meta_info == {"k": 1}
    assert len(dp) == 3


def test_from_single_dict_rejects_other_types_naming_the_field():
    with pytest.raises(DataProtoTypeError, match=r"'prompts'.*found list"):
        DataProto.from_single_dict({"a": torch.ones(2), "prompts": ["p", "q"]})


def test_from_dict_rejects_misaligned_tensors_with_both_sizes():
    with pytest.raises(BatchSizeMismatchError, match=r"'b' has 2 rows but 'a' has 3"):
        DataProto.from_dict({"a": torch.ones(3), "b": torch.ones(2)})


def test_misaligned_object_column_names_field_and_sizes():
    with pytest.raises(BatchSizeMismatchError, match=r"non_tensor_batch\['uid'\] has 2 rows but batch has 3"):
        DataProto.from_dict({"a": torch.ones(3)}, {"uid": obj(["a", "b"])})


def test_object_column_must_be_ndarray():
    with pytest.raises(DataProtoTypeError, match=r"non_tensor_batch\['uid'\] must be a np.ndarray; found list"):
        DataProto(batch=TensorDict({"a": torch.ones(2)}, batch_size=[2]),
                  non_tensor_batch={"uid": ["a", "b"]})


def test_batch_must_be_tensordict_and_meta_a_dict():
    with pytest.raises(DataProtoTypeError, match="batch must be a tensordict.TensorDict"):
        DataProto(batch={"a": torch.ones(2)})
    with pytest.raises(DataProtoTypeError, match="meta_info must be a dict; found list"):
        DataProto(batch=TensorDict({"a": torch.ones(2)}, batch_size=[2]), meta_info=[1])


def test_tensor_field_must_be_tensor():
    with pytest.raises(DataProtoTypeError, match=r"tensor field 'a' must be a torch.Tensor; found np.ndarray"):
        DataProto.from_dict({"a": np.ones(3)})


def test_auto_padding_flag_sets_meta():
    dp = DataProto.from_dict({"a": torch.ones(3)}, auto_padding=True)
    assert dp.meta_info[AUTO_PADDING_KEY] is True and dp.is_padding_enabled()


def test_len_without_tensors_comes_from_object_columns():
    dp = DataProto(non_tensor_batch={"uid": obj(["a", "b"])})
    assert len(dp) == 2 and dp.batch is None
    assert len(DataProto()) == 0


# ------------------------------------------------------------------ indexing


def test_int_index_returns_item_of_that_row():
    dp = make(4)
    item = dp[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [6, 7, 8]
    assert item.non_tensor_batch["uid"] == "u2"
    assert dp[-1].non_tensor_batch["uid"] == "u3"
    with pytest.raises(IndexError, match="index 4 is out of range for a batch of 4 rows"):
        dp[4]


def test_slice_index_is_a_view():
    dp = make(5)
    part = dp[1:4]
    assert_rows(part, [1, 2, 3])
    part.batch["logp"][0] = 99.0
    assert dp.batch["logp"][1] == 99.0, "slice must share memory with the parent"
    assert_rows(dp.slice(0, 5, 2), [0, 2, 4])


def test_list_array_tensor_and_mask_indexing_copy():
    dp = make(5)
    assert_rows(dp[[4, 0, 0]], [4, 0, 0])
    assert_rows(dp[np.array([1, 3])], [1, 3])
    assert_rows(dp[torch.tensor([2])], [2])
    mask = torch.tensor([True, False, True, False, True])
    assert_rows(dp[mask], [0, 2, 4])
    assert_rows(dp[mask.numpy()], [0, 2, 4])
    picked = dp[[0]]
    picked.batch["logp"][0] = 42.0
    assert dp.batch["logp"][0] == 0.0, "index selection must copy"


def test_bad_index_types_and_mask_length():
    dp = make(3)
    with pytest.raises(DataProtoTypeError, match="found float"):
        dp[1.5]
    with pytest.raises(BatchSizeMismatchError, match="mask has 2 entries but the batch has 3 rows"):
        dp.select_idxs(np.array([True, False]))
    with pytest.raises(DataProtoTypeError, match="int or bool; found dtype torch.float32"):
        dp.select_idxs(torch.tensor([0.0]))
    with pytest.raises(IndexError, match="index 7 is out of range"):
        dp.select_idxs([7])


def test_iter_yields_items():
    assert [it.non_tensor_batch["uid"] for it in make(3)] == ["u0", "u1", "u2"]


# ------------------------------------------------------------------ select / pop / rename


def test_select_shares_by_default_and_copies_with_deepcopy():
    dp = make(3, meta={"t": 1, "other": 2})
    sub = dp.select(batch_keys=["logp"], non_tensor_batch_keys=["uid"], meta_info_keys=["t"])
    assert list(sub.batch.keys()) == ["logp"] and list(sub.non_tensor_batch) == ["uid"]
    assert sub.meta_info == {"t": 1}
    sub.batch["logp"][0] = 5.0
    assert dp.batch["logp"][0] == 5.0
    deep = dp.select(deepcopy=True)
    deep.batch["logp"][0] = 7.0
    deep.non_tensor_batch["num"][0] = 70
    assert dp.batch["logp"][0] == 5.0 and dp.non_tensor_batch["num"][0] == 0


def test_select_unknown_key_lists_choices():
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['nope'\]; available: \['ids', 'logp'\]"):
        make(2).select(batch_keys=["nope"])


def test_pop_removes_from_self_and_returns_them():
    dp = make(3, meta={"t": 1, "s": 2})
    popped = dp.pop(batch_keys=["logp"], non_tensor_batch_keys=["uid"], meta_info_keys=["t"])
    assert list(dp.batch.keys()) == ["ids"] and list(dp.non_tensor_batch) == ["num"]
    assert dp.meta_info == {"s": 2}
    assert popped.batch["logp"].tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert popped.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]
    assert popped.meta_info == {"t": 1}
    with pytest.raises(KeyError, match="batch has no key 'logp'"):
        dp.pop(batch_keys=["logp"])


def test_rename_in_place():
    dp = make(2)
    assert dp.rename("logp", "old_log_probs") is dp
    assert sorted(dp.batch.keys()) == ["ids", "old_log_probs"]
    with pytest.raises(KeyError, match="batch has no key 'missing'"):
        dp.rename(["missing"], ["x"])
    with pytest.raises(KeyError, match="target key 'ids' already exists"):
        dp.rename("old_log_probs", "ids")


# ------------------------------------------------------------------ union


def test_union_adds_columns_in_place():
    dp = make(3)
    extra = DataProto.from_dict({"values": torch.ones(3)}, {"score": np.ones(3)}, {"step": 4})
    assert dp.union(extra) is dp
    assert "values" in dp.batch.keys() and "score" in dp.non_tensor_batch
    assert dp.meta_info["step"] == 4


def test_union_equal_overlap_is_fine():
    dp = make(3)
    dp.union(make(3))
    assert_rows(dp, [0, 1, 2])


def test_union_conflicting_tensor_names_key_and_row():
    dp, other = make(3), make(3)
    other.batch["logp"][2] = 9.0
    with pytest.raises(UnionConflictError, match=r"key 'logp'.*first differing row 2"):
        dp.union(other)


def test_union_conflicting_object_column_and_meta():
    other = make(3)
    other.non_tensor_batch["uid"][1] = "zzz"
    with pytest.raises(UnionConflictError, match=r"column 'uid'.*row 1: 'u1' vs 'zzz'"):
        make(3).union(other)
    with pytest.raises(UnionConflictError, match=r"meta_info key 'temperature' differs: 1.0 vs 0.5"):
        make(3).union(make(3, meta={"temperature": 0.5}))


def test_union_size_mismatch():
    with pytest.raises(BatchSizeMismatchError, match="left batch has 3 rows, right batch has 2"):
        make(3).union(make(2))


def test_module_union_helpers():
    a = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    b = TensorDict({"y": torch.zeros(2)}, batch_size=[2])
    assert sorted(union_tensor_dict(a, b).keys()) == ["x", "y"]
    with pytest.raises(BatchSizeMismatchError, match=r"left has \(2,\), right has \(3,\)"):
        union_tensor_dict(a, TensorDict({"z": torch.ones(3)}, batch_size=[3]))
    d = union_numpy_dict({"u": obj(["a"])}, {"v": obj([1])})
    assert sorted(d) == ["u", "v"]
    with pytest.raises(UnionConflictError, match="'u'"):
        union_numpy_dict({"u": obj(["a"])}, {"u": obj(["b"])})


# ------------------------------------------------------------------ chunk / split / concat


def test_chunk_even_and_concat_roundtrip():
    dp = make(6)
    parts = dp.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert_rows(parts[1], [2, 3])
    assert_rows(DataProto.concat(parts), list(range(6)))


def test_chunk_uneven_without_padding_raises_with_sizes():
    with pytest.raises(ChunkSizeError, match=r"batch of 5 rows does not split into 2 equal chunks"):
        make(5).chunk(2)


def test_chunk_uneven_with_auto_padding_balances_sizes():
    dp = make(5, meta={AUTO_PADDING_KEY: True})
    parts = dp.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert_rows(DataProto.concat(parts), list(range(5)))
    assert [len(p) for p in make(2, meta={AUTO_PADDING_KEY: True}).chunk(3)] == [1, 1, 0]


def test_split_last_part_shorter():
    parts = make(5).split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert_rows(parts[2], [4])


def test_concat_merges_metrics_and_keeps_first_meta():
    parts = make(4).chunk(2)
    parts[0].meta_info["metrics"] = {"loss": 1.0, "grad": [0.1, 0.2]}
    parts[1].meta_info["metrics"] = {"loss": 3.0, "grad": [0.3]}
    merged = DataProto.concat(parts)
    assert merged.meta_info["metrics"] == {"loss": [1.0, 3.0], "grad": [0.1, 0.2, 0.3]}
    assert merged.meta_info["temperature"] == 1.0


def test_concat_refuses_mismatched_keys():
    a = make(2)
    b = make(2)
    b.pop(batch_keys=["logp"])
    with pytest.raises(Exception, match=r"part 1 has batch keys \['ids'\] but part 0 has \['ids', 'logp'\]"):
        DataProto.concat([a, b])


# ------------------------------------------------------------------ repeat / reorder / padding


def test_repeat_interleave_and_tile():
    assert_rows(make(3).repeat(2, interleave=True), [0, 0, 1, 1, 2, 2])
    assert_rows(make(3).repeat(2, interleave=False), [0, 1, 2, 0, 1, 2])


def test_repeat_copies():
    dp = make(2)
    rep = dp.repeat(2)
    rep.batch["logp"][0] = 9.0
    assert dp.batch["logp"][0] == 0.0


def test_sample_level_repeat():
    assert_rows(make(3).sample_level_repeat([2, 0, 3]), [0, 0, 2, 2, 2])
    with pytest.raises(BatchSizeMismatchError, match="repeat_times has 2 entries but the batch has 3 rows"):
        make(3).sample_level_repeat([1, 1])


def test_reorder_in_place():
    dp = make(4)
    assert dp.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert_rows(dp, [3, 1, 0, 2])
    with pytest.raises(BatchSizeMismatchError, match="indices has 2 entries but the batch has 4 rows"):
        dp.reorder([0, 1])


def test_padding_in_place_first_and_last():
    dp = make(3)
    dp.padding(2)
    assert_rows(dp, [0, 1, 2, 2, 2])
    dp = make(3)
    dp.padding(1, padding_candidate="first")
    assert_rows(dp, [0, 1, 2, 0])


def test_pad_and_unpad_to_divisor():
    dp = make(5)
    padded, pad = pad_dataproto_to_divisor(dp, 4)
    assert pad == 3 and len(padded) == 8
    assert_rows(padded, [0, 1, 2, 3, 4, 0, 1, 2])
    assert_rows(unpad_dataproto(padded, pad), [0, 1, 2, 3, 4])
    same, zero = pad_dataproto_to_divisor(dp, 5)
    assert zero == 0 and same is dp


def test_make_iterator_epochs_and_seeded_shuffle():
    dp = make(4)
    plain = [rows(b)["uid"] for b in dp.make_iterator(mini_batch_size=2, epochs=2)]
    assert plain == [[0, 1], [2, 3], [0, 1], [2, 3]]
    with pytest.raises(ChunkSizeError, match="batch of 4 rows does not split into mini-batches of 3"):
        dp.make_iterator(3, 1)


def test_make_iterator_shuffles_each_epoch_by_its_seed():
    """shuffle=True reorders rows (an iterator that ignored it would yield 0..15 in order),
    every epoch is a permutation of all rows, epochs differ, the seed decides the order,
    and the order is torch.randperm's under a generator seeded with ``seed``."""
    dp = make(16)

    def order(seed, epochs=2):
        return [rows(b)["uid"] for b in dp.make_iterator(4, epochs, seed=seed, dataloader_kwargs={"shuffle": True})]

    a = order(7)
    first, second = sum(a[:4], []), sum(a[4:], [])
    assert sorted(first) == sorted(second) == list(range(16))
    assert first != list(range(16)) and first != second
    assert order(7) == a and order(8) != a
    generator = torch.Generator().manual_seed(7)
    assert first == torch.randperm(16, generator=generator).tolist()
    assert second == torch.randperm(16, generator=generator).tolist()


def test_to_device_in_place():
    dp = make(2)
    assert dp.to("cpu") is dp
    assert dp.batch["ids"].device.type == "cpu"


# ------------------------------------------------------------------ tensordict interop


def test_to_tensordict_and_back():
    dp = make(3, meta={"temperature": 0.7, "metrics": {"a": 1}})
    td = dp.to_tensordict()
    assert isinstance(td.get("uid"), NonTensorStack)
    assert isinstance(td.get("temperature"), NonTensorData)
    back = DataProto.from_tensordict(td)
    assert_rows(back, [0, 1, 2])
    assert back.meta_info == {"temperature": 0.7, "metrics": {"a": 1}}
    assert back.non_tensor_batch["uid"].dtype == object


# ------------------------------------------------------------------ the pickle-free wire


def wire_roundtrip(dp):
    # protocol 5 with a buffer callback is what Ray does: buffers go out of band.
    buffers = []
    payload = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    return payload, buffers, pickle.loads(payload, buffers=buffers)


def test_wire_roundtrip_preserves_everything_including_bf16():
    dp = make(4, meta={"temperature": 0.5, "metrics": {"x": [1.0, 2.0]}, "step": np.int64(3)})
    dp.batch["bf"] = torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16)
    dp.batch["mask"] = torch.tensor([True, False, True, True])
    dp.non_tensor_batch["extra"] = obj([{"a": [1, 2]}, None, [1, "x"], 2.5])
    _, buffers, back = wire_roundtrip(dp)
    assert back.batch["bf"].dtype == torch.bfloat16
    assert torch.equal(back.batch["bf"], dp.batch["bf"])
    assert torch.equal(back.batch["mask"], dp.batch["mask"])
    assert_rows(back, [0, 1, 2, 3])
    assert back.non_tensor_batch["extra"].tolist() == [{"a": [1, 2]}, None, [1, "x"], 2.5]
    assert back.meta_info == {"temperature": 0.5, "metrics": {"x": [1.0, 2.0]}, "step": 3}
    back.batch["logp"][0] = 1.0  # received tensors are writable process memory
    assert len(buffers) >= 3


def test_wire_carries_tensor_bytes_out_of_band_and_no_foreign_globals():
    dp = DataProto.from_dict({"big": torch.arange(100_000, dtype=torch.float32)},
                             {"uid": obj(["a"] * 100_000)})
    payload, buffers, _ = wire_roundtrip(dp)
    assert sum(memoryview(b).nbytes for b in buffers) >= 400_000
    assert len(payload) < 20_000, "tensor data must not be inside the pickle stream"
    # The only callables named in the stream are our decoder and numpy's array rebuild:
    # no torch storage, no object-array element pickling.
    globals_used = {arg for op, arg, _ in pickletools.genops(payload)
                    if op.name in ("GLOBAL", "STACK_GLOBAL") and arg}
    strings = [arg for op, arg, _ in pickletools.genops(payload) if isinstance(arg, str)]
    assert "torch._utils" not in strings and "_rebuild_tensor_v2" not in strings
    assert "_from_wire" in strings
    assert not globals_used - {"rlhf_core.protocol _from_wire"}


@pytest.mark.parametrize("bad, typename", [
    (obj([("a", 1)]), "builtins.tuple"),
    (obj([object()]), "builtins.object"),
    (obj([torch.ones(1)]), "torch.Tensor"),
    (obj([{1: "x"}]), "dict keys must be str"),
])
def test_wire_refuses_unsupported_objects_naming_column_and_type(bad, typename):
    dp = DataProto(non_tensor_batch={"weird": bad})
    with pytest.raises(UnsupportedObjectError, match=r"non_tensor_batch\['weird'\]") as err:
        pickle.dumps(dp, protocol=5)
    assert typename in str(err.value)


def test_wire_refuses_unsupported_meta():
    dp = make(2, meta={"when": {1, 2}})
    with pytest.raises(UnsupportedObjectError, match=r"meta_info\['when'\].*builtins.set"):
        pickle.dumps(dp, protocol=5)


def test_wire_version_mismatch_is_a_clear_error():
    state = make(2).to_wire()
    state["wire_version"] = 99
    with pytest.raises(Exception, match="wire_version 99 is not supported"):
        DataProto.from_wire(state)


# ------------------------------------------------------------------ dtypes through row ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.float64])
def test_row_ops_keep_dtype_and_values(dtype):
    values = torch.tensor([[1, 0], [2, 1], [3, 0]]).to(dtype)
    dp = DataProto.from_dict({"x": values})
    assert torch.equal(dp.repeat(2).batch["x"], values.repeat_interleave(2, dim=0))
    assert torch.equal(dp.repeat(2, interleave=False).batch["x"], values.repeat(2, 1))
    assert torch.equal(dp.select_idxs([2, 0]).batch["x"], values[[2, 0]])
    assert torch.equal(DataProto.concat(dp.split(2)).batch["x"], values)
    assert dp.repeat(2).batch["x"].dtype == dtype


def test_row_ops_keep_autograd_for_tensors_that_need_it():
    leaf = torch.ones(3, 2, requires_grad=True)
    dp = DataProto.from_dict({"x": leaf * 2})
    out = dp.repeat(2).batch["x"].sum() + dp.select_idxs([0]).batch["x"].sum()
    out.backward()
    assert leaf.grad.tolist() == [[6.0, 6.0], [4.0, 4.0], [4.0, 4.0]]
