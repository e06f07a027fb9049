"""Tests for StepOutput and merge_step_outputs (SMP_REFERENCE §2.2 and §4.1 rule 9)."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import pytest
import torch

from smp_compat.errors import StepUsageError
from smp_compat.stepping.output import StepOutput, merge_step_outputs


class Out(NamedTuple):
    loss: Any
    logits: Any


class TaggedDict(dict):
    """A dict subclass with an attribute, as user code and HF's ModelOutput have."""

    tag = "class-level"


# --- StepOutput -------------------------------------------------------------------------------------


def test_reduce_mean_and_sum_match_the_full_batch() -> None:
    data = torch.arange(12, dtype=torch.float64)
    per_mb = [chunk.mean() for chunk in data.split(3)]
    so = StepOutput(per_mb)
    assert so.reduce_sum().item() == pytest.approx(sum(c.item() for c in per_mb))
    assert so.reduce_mean().item() == pytest.approx(data.mean().item())


def test_reductions_of_non_scalar_values() -> None:
    so = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    torch.testing.assert_close(so.reduce_sum(), torch.tensor([4.0, 8.0]))
    torch.testing.assert_close(so.reduce_mean(), torch.tensor([2.0, 4.0]))


def test_concat_is_dim0_and_stack_adds_a_leading_dim() -> None:
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    so = StepOutput([a, b])
    cat = so.concat()
    assert cat.shape == (4, 3)
    torch.testing.assert_close(cat, torch.cat([a, b]))
    stacked = so.stack()
    assert stacked.shape == (2, 2, 3)
    torch.testing.assert_close(stacked[1], b)


def test_concat_of_scalars_says_what_to_use() -> None:
    so = StepOutput([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(StepUsageError, match="stack"):
        so.concat()
    torch.testing.assert_close(so.stack(), torch.tensor([1.0, 2.0]))


def test_sequence_protocol() -> None:
    values = [torch.tensor(float(i)) for i in range(3)]
    so = StepOutput(values)
    assert len(so) == 3
    assert so[2] is values[2]
    assert so.outputs[0] is values[0]
    assert list(so) == values


def test_constructor_copies_the_list() -> None:
    values = [torch.tensor(1.0)]
    so = StepOutput(values)
    values.append(torch.tensor(2.0))
    assert len(so) == 1


def test_map_and_clear() -> None:
    so = StepOutput([torch.tensor(1.0), torch.tensor(2.0)])
    doubled = so.map(lambda t: t * 2)
    assert isinstance(doubled, StepOutput)
    assert [t.item() for t in doubled] == [2.0, 4.0]
    assert [t.item() for t in so] == [1.0, 2.0]
    so.clear()
    assert len(so) == 0
    with pytest.raises(StepUsageError, match="clear"):
        so.reduce_mean()


def test_repr_shows_count_shapes_and_dtype() -> None:
    same = repr(StepOutput([torch.zeros(2, 3), torch.zeros(2, 3)]))
    assert "num_microbatches=2" in same and "(2, 3)" in same and "float32" in same
    mixed = repr(StepOutput([torch.zeros(2), torch.zeros(5, dtype=torch.int64)]))
    assert "(2,)" in mixed and "(5,)" in mixed and "int64" in mixed


# --- merge_step_outputs -----------------------------------------------------------------------------


def test_merge_single_tensor() -> None:
    values = [torch.tensor(1.0), torch.tensor(3.0)]
    merged = merge_step_outputs(values)
    assert isinstance(merged, StepOutput)
    assert merged.outputs == values
    assert merged.reduce_mean().item() == 2.0


def test_merge_tuple_keeps_tuple_and_turns_tensors_into_step_outputs() -> None:
    merged = merge_step_outputs([(torch.tensor(1.0), torch.ones(2)), (torch.tensor(2.0), torch.zeros(2))])
    assert type(merged) is tuple and len(merged) == 2
    loss, logits = merged
    assert isinstance(loss, StepOutput) and loss.reduce_sum().item() == 3.0
    assert logits.concat().tolist() == [1.0, 1.0, 0.0, 0.0]


def test_merge_namedtuple_keeps_type() -> None:
    per_mb = [Out(torch.tensor(1.0), torch.ones(1)), Out(torch.tensor(2.0), torch.ones(1))]
    merged = merge_step_outputs(per_mb)
    assert type(merged) is Out
    assert isinstance(merged.loss, StepOutput)
    assert merged.loss.reduce_mean().item() == 1.5


def test_merge_dict_and_dict_subclasses_keep_type() -> None:
    merged = merge_step_outputs([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}])
    assert type(merged) is dict and isinstance(merged["loss"], StepOutput)

    first, second = TaggedDict(loss=torch.tensor(1.0)), TaggedDict(loss=torch.tensor(3.0))
    first.tag = "instance"
    sub = merge_step_outputs([first, second])
    assert type(sub) is TaggedDict and sub.tag == "instance"
    assert sub["loss"].reduce_mean().item() == 2.0

    dd = collections.defaultdict(list, {"x": torch.tensor(1.0)})
    merged_dd = merge_step_outputs([dd, collections.defaultdict(list, {"x": torch.tensor(2.0)})])
    assert type(merged_dd) is collections.defaultdict and merged_dd.default_factory is list


def test_merge_non_tensor_leaves_become_lists() -> None:
    merged = merge_step_outputs([(torch.tensor(1.0), 5, "a"), (torch.tensor(2.0), 7, "b")])
    assert merged[1] == [5, 7]
    assert merged[2] == ["a", "b"]
    assert type(merged[1]) is list


def test_merge_nested_structure() -> None:
    mb = [{"out": [torch.tensor(float(i)), {"n": i}]} for i in range(3)]
    merged = merge_step_outputs(mb)
    assert merged["out"][0].outputs == [mb[i]["out"][0] for i in range(3)]
    assert merged["out"][1] == {"n": [0, 1, 2]}


def test_merge_none() -> None:
    assert merge_step_outputs([None, None]) is None
    merged = merge_step_outputs([(torch.tensor(1.0), None), (torch.tensor(2.0), None)])
    assert merged[1] == [None, None]
    mixed = merge_step_outputs([(torch.tensor(1.0), None), (torch.tensor(2.0), torch.tensor(0.0))])
    assert type(mixed[1]) is list and mixed[1][0] is None


def test_merge_single_microbatch() -> None:
    merged = merge_step_outputs([(torch.tensor(4.0),)])
    assert merged[0].reduce_mean().item() == 4.0


def test_merge_structure_mismatch_names_microbatch_and_structures() -> None:
    with pytest.raises(StepUsageError) as info:
        merge_step_outputs([(torch.tensor(1.0), torch.tensor(1.0)), (torch.tensor(1.0), torch.tensor(1.0)),
                            (torch.tensor(1.0),)])
    text = str(info.value)
    assert "Microbatch 2" in text
    assert "tuple(Tensor, Tensor)" in text and "tuple(Tensor)" in text


def test_merge_mismatched_keys_and_container_types() -> None:
    with pytest.raises(StepUsageError, match="Microbatch 1"):
        merge_step_outputs([{"a": torch.tensor(1.0)}, {"b": torch.tensor(1.0)}])
    with pytest.raises(StepUsageError, match=r"first difference at return value\[0\]"):
        merge_step_outputs([[[torch.tensor(1.0)]], [(torch.tensor(1.0),)]])
    with pytest.raises(StepUsageError):
        merge_step_outputs([torch.tensor(1.0), None, (torch.tensor(1.0),)])


def test_merge_empty_is_an_error() -> None:
    with pytest.raises(StepUsageError, match="no microbatch"):
        merge_step_outputs([])
