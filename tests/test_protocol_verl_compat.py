"""Code written against verl's DataProto runs unchanged on ours: the behaviours of verl's
own DataProto test module, written here as our own cases (plain-list columns, nested rows,
TensorDict round trips, folding, tensor-free batches, indexing after indexing, merged
worker metrics, AssertionError-catching callers), with our pickle-free rules kept."""


import numpy as np
import pytest
import torch

from rlhf_core.protocol import (
    DataProto, DataProtoConfig, UnionConflictError, UnsupportedObjectError, collate_fn, fold_batch_dim,
    list_of_dict_to_dict_of_list, union_numpy_dict, union_tensor_dict, union_two_dict, unfold_batch_dim,
)


def test_plain_lists_are_object_columns_as_in_verl():
    dp = DataProto.from_dict(tensors={"x": torch.arange(3)}, non_tensors={"labels": ["a", "b", "c"]})
    assert dp.non_tensor_batch["labels"].dtype == object and dp.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    nested = DataProto.from_dict(non_tensors={"pairs": [["a1", "a2"], ["b1", "b2"]],
                                              "msgs": [[{"role": "user", "content": "hi"}], [{"role": "user"}]],
                                              "ragged": [[1], [1, 2]], "empty": [[], []]})
    assert nested.non_tensor_batch["pairs"].shape == (2, 2)
    assert nested.non_tensor_batch["msgs"].shape == (2, 1) and nested.non_tensor_batch["msgs"][1, 0] == {"role": "user"}
    assert nested.non_tensor_batch["ragged"].shape == (2,) and nested.non_tensor_batch["empty"].shape == (2, 0)
    assert len(nested) == 2
    # they survive our pickle-free wire, shapes included
    back = DataProto.from_wire(nested.to_wire())
    assert back.non_tensor_batch["msgs"].shape == (2, 1) and back.non_tensor_batch["pairs"][1].tolist() == ["b1", "b2"]


def test_arbitrary_objects_are_still_refused_on_the_wire():
    dp = DataProto.from_dict(non_tensors={"obj": [object(), object()]})
    with pytest.raises(UnsupportedObjectError, match="obj"):
        dp.to_wire()


def test_misuse_is_catchable_as_assertion_error_like_verl():
    a = DataProto.from_dict({"x": torch.zeros(4)})
    with pytest.raises(AssertionError):
        a.chunk(3)  # 4 rows into 3
    with pytest.raises(AssertionError):
        DataProto.from_dict({"x": torch.zeros(4), "y": torch.zeros(3)})
    with pytest.raises(AssertionError):
        union_tensor_dict(a.batch, DataProto.from_dict({"x": torch.ones(4)}).batch)
    with pytest.raises(KeyError) as missing:  # a KeyError and an assertion at once
        a.pop(batch_keys=["nope"])
    assert isinstance(missing.value, AssertionError) and "nope" in str(missing.value)


def test_union_of_columns_treats_nan_as_equal_and_names_the_key():
    left = {"f": np.array([1.0, np.nan]), "o": np.array([{"a": [float("nan")]}, "x"], dtype=object)}
    right = {"f": np.array([1.0, np.nan]), "o": np.array([{"a": [float("nan")]}, "x"], dtype=object),
             "new": np.array([1, 2])}
    merged = union_numpy_dict(dict(left), right)
    assert set(merged) == {"f", "o", "new"}
    with pytest.raises(AssertionError, match="`o` in tensor_dict1 and tensor_dict2 are not the same object"):
        union_numpy_dict(dict(left), {"o": np.array([{"a": [1.0]}, "x"], dtype=object)})
    cyclic_a = np.empty(1, dtype=object)
    cyclic_a[0] = cyclic_a
    cyclic_b = np.empty(1, dtype=object)
    cyclic_b[0] = cyclic_b
    union_numpy_dict({"c": cyclic_a}, {"c": cyclic_b})  # terminates: equal shapes all the way down


def test_concat_merges_worker_metrics_and_meta():
    parts = [DataProto.from_dict({"x": torch.tensor([i])}, meta_info={"metrics": m, "step": 3})
             for i, m in enumerate([{"loss": 1.0}, [{"loss": 2.0}, {"loss": 3.0}], None])]
    out = DataProto.concat(parts)
    assert out.meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0]} and out.meta_info["step"] == 3
    merged = DataProto.concat([DataProto.from_dict({"x": torch.tensor([0])}, meta_info={"a": 1}),
                               DataProto.from_dict({"x": torch.tensor([1])}, meta_info={"b": 2})])
    assert merged.meta_info == {"a": 1, "b": 2} and "metrics" not in merged.meta_info
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'a'"):
        DataProto.concat([DataProto.from_dict({"x": torch.tensor([0])}, meta_info={"a": 1}),
                          DataProto.from_dict({"x": torch.tensor([1])}, meta_info={"a": 2})])

    class Mine(DataProto):
        pass

    assert type(DataProto.concat([Mine.from_dict({"x": torch.tensor([0])})] * 2)) is Mine


def test_fold_and_unfold_the_batch_dim():
    dp = DataProto.from_dict({"x": torch.arange(12).reshape(6, 2)}, non_tensors={"u": [str(i) for i in range(6)]})
    folded = fold_batch_dim(dp, 2)
    assert len(folded) == 2 and folded.batch["x"].shape == (2, 3, 2)
    assert folded.non_tensor_batch["u"].tolist() == [["0", "1", "2"], ["3", "4", "5"]]
    assert dp.non_tensor_batch["u"].shape == (6,)  # the input is left as it was
    back = unfold_batch_dim(folded, batch_dims=2)
    assert torch.equal(back.batch["x"], dp.batch["x"]) and back.non_tensor_batch["u"].tolist() == list("012345")


def test_unfold_column_chunks_splits_named_columns_and_repeats_the_rest():
    dp = DataProto.from_dict({"ids": torch.arange(8).reshape(2, 4), "r": torch.tensor([1.0, 2.0])},
                             non_tensors={"turns": [["a", "b"], ["c", "d"]], "uid": ["p", "q"]})
    out = dp.unfold_column_chunks(2, split_keys=["ids", "turns"])
    assert out.batch["ids"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert out.batch["r"].tolist() == [1.0, 1.0, 2.0, 2.0] and out.non_tensor_batch["uid"].tolist() == list("ppqq")
    assert out.non_tensor_batch["turns"].tolist() == [["a"], ["b"], ["c"], ["d"]]
    assert len(dp.unfold_column_chunks(3)) == 6  # no split keys: every column repeated


def test_save_and_load_from_disk_without_pickle(tmp_path):
    dp = DataProto.from_dict({"x": torch.randn(3, 2).to(torch.bfloat16)},
                             non_tensors={"m": [{"k": [1, 2]}, None, "s"], "n": np.arange(3)}, meta_info={"t": 0.7})
    path = tmp_path / "batch.npz"
    dp.save_to_disk(str(path))
    dp.save_to_disk(str(path))  # overwrites, as verl's does
    back = DataProto.load_from_disk(str(path))
    assert torch.equal(back.batch["x"], dp.batch["x"]) and back.batch["x"].dtype == torch.bfloat16
    assert back.non_tensor_batch["m"].tolist() == [{"k": [1, 2]}, None, "s"] and back.meta_info == {"t": 0.7}
    with np.load(path, allow_pickle=False) as npz:  # readable without pickle
        assert all(npz[name].dtype != object for name in npz.files)


def test_a_batch_of_only_object_columns_behaves():
    dp = DataProto.from_dict(non_tensors={"a": list("abcdef"), "b": list(range(6))}, meta_info={"m": 1})
    assert len(dp) == 6 and [len(c) for c in dp.chunk(3)] == [2, 2, 2]
    assert DataProto.concat(dp.chunk(2)).non_tensor_batch["a"].tolist() == list("abcdef")
    assert dp[[5, 0]].non_tensor_batch["a"].tolist() == ["f", "a"] and dp[1:3].non_tensor_batch["b"].tolist() == [1, 2]
    assert dp[np.array([True, False] * 3)].non_tensor_batch["a"].tolist() == ["a", "c", "e"]
    assert dp.repeat(2, interleave=True).non_tensor_batch["a"].tolist()[:4] == ["a", "a", "b", "b"]
    assert dp.select(non_tensor_batch_keys=["a", "absent"], meta_info_keys=["absent"]).non_tensor_batch.keys() == {"a"}
    assert dp.pop(non_tensor_batch_keys=["b"]).non_tensor_batch["b"].tolist() == list(range(6))


def test_indexing_after_indexing():
    dp = DataProto.from_dict({"x": torch.arange(10)}, non_tensors={"u": [str(i) for i in range(10)]})
    assert dp[2:8][[0, 2]].batch["x"].tolist() == [2, 4]
    assert dp[[9, 7, 5]][1:].non_tensor_batch["u"].tolist() == ["7", "5"]
    assert dp[::2][torch.tensor([True, False, True, False, True])].batch["x"].tolist() == [0, 4, 8]
    assert [len(c) for c in dp[[1, 2, 3, 4]].chunk(2)] == [2, 2]
    assert dp[3:][0].non_tensor_batch["u"] == "3"


def test_tensordict_round_trip_keeps_nested_rows():
    dp = DataProto.from_dict({"x": torch.arange(2)},
                             non_tensors={"raw_prompt": [[{"role": "user", "content": "q1"}],
                                                         [{"role": "user", "content": "q2"}]],
                                          "tools": [{"name": "calc", "args": {"a": [1, 2]}}, {"name": "none"}],
                                          "uid": ["a", "b"]},
                             meta_info={"temperature": 0.5})
    td = dp.to_tensordict()
    back = DataProto.from_tensordict(td)
    assert back.non_tensor_batch["raw_prompt"].shape == (2, 1)
    assert back.non_tensor_batch["raw_prompt"][1, 0]["content"] == "q2"
    assert back.non_tensor_batch["tools"][0] == {"name": "calc", "args": {"a": [1, 2]}}
    assert back.meta_info == {"temperature": 0.5} and back.non_tensor_batch["uid"].tolist() == ["a", "b"]
    DataProto.from_wire(back.to_wire())  # still wire-safe
    with pytest.raises(UnionConflictError):
        DataProto(batch=dp.batch, non_tensor_batch={"x": np.array([1, 2])}).to_tensordict()


def test_module_helpers_and_global_auto_padding(monkeypatch):
    assert union_two_dict({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(AssertionError):
        union_two_dict({"a": 1}, {"a": 2})
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {"a": [1, 3], "b": [2, 4]}
    dp = DataProto.from_dict({"x": torch.arange(5)}, non_tensors={"u": list("abcde")})
    again = collate_fn([dp[i] for i in range(5)])
    assert torch.equal(again.batch["x"], dp.batch["x"]) and again.non_tensor_batch["u"].tolist() == list("abcde")
    monkeypatch.setattr(DataProtoConfig, "auto_padding", True)
    assert [len(c) for c in dp.chunk(2)] == [3, 2]


def test_make_iterator_accepts_dataloader_settings_and_uses_the_global_rng_unseeded():
    dp = DataProto.from_dict({"x": torch.arange(8)})
    batches = list(dp.make_iterator(4, 1, dataloader_kwargs={"shuffle": True, "num_workers": 0, "drop_last": True}))
    assert sorted(torch.cat([b.batch["x"] for b in batches]).tolist()) == list(range(8))
    torch.manual_seed(1)
    a = torch.cat([b.batch["x"] for b in dp.make_iterator(8, 1, dataloader_kwargs={"shuffle": True})])
    torch.manual_seed(1)
    b = torch.cat([b.batch["x"] for b in dp.make_iterator(8, 1, dataloader_kwargs={"shuffle": True})])
    assert torch.equal(a, b)
    # shuffled by the global RNG, as a DataLoader would: torch.randperm's order under that
    # seed, not the rows in order, and another seed gives another order
    torch.manual_seed(1)
    assert a.tolist() == torch.randperm(8).tolist() != list(range(8))
    torch.manual_seed(2)
    c = torch.cat([b.batch["x"] for b in dp.make_iterator(8, 1, dataloader_kwargs={"shuffle": True})])
    assert not torch.equal(a, c)
