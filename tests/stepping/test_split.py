"""Tests for splitting @smp.step inputs into microbatches (SMP_REFERENCE §4.1 rules 1-7)."""

from __future__ import annotations

import argparse
import collections
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

from smp_compat.stepping import split as split_module
from smp_compat.errors import SMPConfigError, StepUsageError, TensorSplitError
from smp_compat.stepping.signature import validate_split_options
from smp_compat.stepping.split import split_step_inputs
from smp_compat.stepping.output import StepOutput


class Batch(NamedTuple):
    x: Any
    y: Any
    name: Any


class AttrDict(dict):
    """A dict subclass with an instance attribute that must survive the split."""


class Sliceable:
    """A custom object that slices itself (SMP's smp_slice protocol) and records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> tuple[str, int, int, int]:
        self.calls.append((num_mb, mb, axis))
        return ("slice", num_mb, mb, axis)


@pytest.fixture(autouse=True)
def _fresh_warning_state() -> Iterator[None]:
    """The module warns once per type; each test starts from a clean record."""
    split_module._warned.clear()
    yield
    split_module._warned.clear()


def step(model: Any, x: Any, y: Any = None) -> None:
    """A stand-in step function: only its signature matters here."""


def _shares_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# --- rule 5: tensors are cut into contiguous blocks -------------------------------------------------


def test_tensor_split_into_contiguous_views() -> None:
    model = torch.nn.Linear(2, 2)
    x = torch.arange(16.0).reshape(8, 2)
    y = torch.arange(8)
    result = split_step_inputs(step, (model, x, y), {}, 4)
    assert len(result) == 4
    for mb, (args, kwargs) in enumerate(result):
        assert kwargs == {}
        assert args[0] is model
        torch.testing.assert_close(args[1], x[2 * mb: 2 * mb + 2])
        assert args[2].tolist() == [2 * mb, 2 * mb + 1]
        assert _shares_storage(args[1], x)
    assert torch.equal(torch.cat([args[1] for args, _ in result]), x)


def test_split_views_carry_gradients_back() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    parts = split_step_inputs(step, (None, x), {}, 2)
    for args, _ in parts:
        (args[1] * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4, 3), 2.0))


def test_keyword_arguments_are_split_and_named() -> None:
    x = torch.arange(6)
    result = split_step_inputs(step, (), {"model": "m", "x": x, "y": torch.ones(6)}, 3)
    assert [kw["x"].tolist() for _, kw in result] == [[0, 1], [2, 3], [4, 5]]
    assert all(kw["model"] == "m" and args == () for args, kw in result)


def test_each_microbatch_gets_its_own_kwargs_dict() -> None:
    result = split_step_inputs(step, (), {"model": 1, "x": 2}, 2)
    result[0][1]["x"] = 99
    assert result[1][1]["x"] == 2


def test_input_split_axes_on_axis_1() -> None:
    x = torch.arange(12).reshape(2, 6)
    result = split_step_inputs(step, (None, x), {}, 3, input_split_axes={"x": 1})
    for mb, (args, _) in enumerate(result):
        assert args[1].shape == (2, 2)
        assert torch.equal(args[1], x[:, 2 * mb: 2 * mb + 2])
        assert _shares_storage(args[1], x)


def test_input_split_axes_by_keyword_and_negative_axis() -> None:
    y = torch.arange(8).reshape(1, 8)
    result = split_step_inputs(step, (None, torch.zeros(2)), {"y": y}, 2, input_split_axes={"y": -1})
    assert [kw["y"].tolist() for _, kw in result] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_non_split_inputs_positional_and_keyword() -> None:
    x, y = torch.zeros(4), torch.ones(3)
    by_position = split_step_inputs(step, (None, x, y), {}, 2, non_split_inputs=["y"])
    by_keyword = split_step_inputs(step, (None, x), {"y": y}, 2, non_split_inputs=["y"])
    assert all(args[2] is y for args, _ in by_position)
    assert all(kw["y"] is y for _, kw in by_keyword)
    assert all(args[1].shape == (2,) for args, _ in by_keyword)


# --- rule 2: containers -----------------------------------------------------------------------------


def test_namedtuple_type_and_non_tensor_fields_kept() -> None:
    batch = Batch(x=torch.arange(4), y=torch.arange(4) * 10, name=["a", "b"])
    result = split_step_inputs(step, (None, batch), {}, 2)
    second = result[1][0][1]
    assert type(second) is Batch
    assert second.x.tolist() == [2, 3] and second.y.tolist() == [20, 30]
    assert second.name is batch.name


def test_dict_subclass_and_defaultdict_keep_type_and_state() -> None:
    batch = AttrDict(input_ids=torch.arange(4), meta="keep")
    batch.source = "loader"
    dd = collections.defaultdict(list, {"t": torch.arange(4)})
    result = split_step_inputs(step, (None, batch, dd), {}, 2)
    part, part_dd = result[1][0][1], result[1][0][2]
    assert type(part) is AttrDict and part.source == "loader" and part["meta"] == "keep"
    assert part["input_ids"].tolist() == [2, 3]
    assert batch["input_ids"].tolist() == [0, 1, 2, 3]  # the caller's dict is not modified
    assert type(part_dd) is collections.defaultdict and part_dd.default_factory is list
    assert part_dd["t"].tolist() == [2, 3]


def test_user_dict_mapping_is_split() -> None:
    batch = collections.UserDict({"ids": torch.arange(4)})
    result = split_step_inputs(step, (None, batch), {}, 2)
    assert type(result[0][0][1]) is collections.UserDict
    assert result[0][0][1]["ids"].tolist() == [0, 1]


def test_nested_lists_tuples_and_sets() -> None:
    t = torch.arange(4)
    value = [(t, 3), {"inner": [t]}]
    result = split_step_inputs(step, (None, value), {}, 2)
    part = result[1][0][1]
    assert type(part) is list and type(part[0]) is tuple
    assert part[0][0].tolist() == [2, 3] and part[0][1] == 3
    assert part[1]["inner"][0].tolist() == [2, 3]

    as_set = split_step_inputs(step, (None, {t}), {}, 2)[0][0][1]
    assert type(as_set) is set and [v.tolist() for v in as_set] == [[0, 1]]


def test_structseq_tuple_subclass_kept() -> None:
    maxed = torch.max(torch.arange(8.0).reshape(4, 2), dim=1)
    part = split_step_inputs(step, (None, maxed), {}, 2)[1][0][1]
    assert type(part) is type(maxed)
    assert part.values.tolist() == [5.0, 7.0]


def test_containers_without_tensors_are_passed_as_the_same_object() -> None:
    config = {"lr": 0.1, "names": ["a", "b"]}
    result = split_step_inputs(step, (None, torch.zeros(2)), {"y": config}, 2)
    assert all(kw["y"] is config for _, kw in result)


# --- rule 6: everything else passes through ---------------------------------------------------------


def test_non_tensor_leaves_pass_through_by_identity_without_warning() -> None:
    model = torch.nn.Linear(1, 1)
    namespace = argparse.Namespace(lr=1.0)
    values = (model, 3, 2.5, "s", None, torch.device("cpu"), torch.float16, namespace, len, torch.Size([2]))
    def many(*args: Any) -> None:
        """Takes anything."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = split_step_inputs(many, values, {}, 3)
    for args, _ in result:
        assert all(a is b for a, b in zip(args, values))


def test_unsplittable_object_warns_once_per_type_and_is_shared() -> None:
    class Opaque:  # holds per-sample data (an object without tensors is shared silently)
        def __init__(self) -> None:
            self.data = torch.zeros(2)

    first, second = Opaque(), Opaque()
    with pytest.warns(UserWarning, match=r"`x`.*Opaque.*cannot be split") as record:
        result = split_step_inputs(step, (None, first, second), {}, 2)
        split_step_inputs(step, (None, first, second), {}, 2)
    assert len([w for w in record if "Opaque" in str(w.message)]) == 1
    assert all(args[1] is first and args[2] is second for args, _ in result)


def test_non_split_inputs_and_single_microbatch_silence_the_unsplittable_warning() -> None:
    class Opaque:
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split_step_inputs(step, (None, Opaque()), {}, 2, non_split_inputs=["x"])
        split_step_inputs(step, (None, Opaque()), {}, 1)


@pytest.mark.parametrize(
    ("make", "advice"),
    [(lambda: torch.utils.data.DataLoader(list(range(4))), "Iterate the DataLoader")],
)
def test_dataloader_warns_even_when_not_split(make: Any, advice: str) -> None:
    obj = make()
    with pytest.warns(UserWarning, match=advice):
        result = split_step_inputs(step, (None, obj), {}, 2, non_split_inputs=["x"])
    assert all(args[1] is obj for args, _ in result)


# --- rules 3 and 4: smp_slice and StepOutput --------------------------------------------------------


def test_smp_slice_object_is_called_per_microbatch_with_axis() -> None:
    obj = Sliceable()
    result = split_step_inputs(step, (None, obj), {}, 3, input_split_axes={"x": 1})
    assert [args[1] for args, _ in result] == [("slice", 3, mb, 1) for mb in range(3)]
    assert obj.calls == [(3, 0, 1), (3, 1, 1), (3, 2, 1)]


def test_smp_slice_applies_under_non_split_inputs_and_inside_containers() -> None:
    obj = Sliceable()
    result = split_step_inputs(step, (None, {"k": [obj]}), {}, 2, non_split_inputs=["x"])
    assert result[1][0][1]["k"][0] == ("slice", 2, 1, 0)


def test_smp_slice_set_on_the_instance() -> None:
    class Holder:
        pass

    obj = Holder()
    obj.smp_slice = lambda num_mb, mb, axis: mb * 10  # type: ignore[attr-defined]
    result = split_step_inputs(step, (None, obj), {}, 2)
    assert [args[1] for args, _ in result] == [0, 10]


def test_step_output_from_another_step_is_unpacked_per_microbatch() -> None:
    previous = StepOutput([torch.tensor(float(i)) for i in range(3)])
    result = split_step_inputs(step, (None, torch.zeros(3)), {"y": previous}, 3, non_split_inputs=["y"])
    assert [kw["y"] for _, kw in result] == previous.outputs


def test_step_output_with_a_different_microbatch_count_is_an_error() -> None:
    with pytest.raises(TensorSplitError, match="StepOutput with 2 microbatch values.*runs 4"):
        split_step_inputs(step, (None, StepOutput([1, 2])), {}, 4)


def test_single_microbatch_returns_inputs_as_they_are_but_resolves_special_leaves() -> None:
    x, scalar = torch.zeros(3), torch.tensor(1.0)
    batch = {"ids": x}
    [(args, kwargs)] = split_step_inputs(step, (None, batch, scalar), {}, 1)
    assert args[1] is batch and args[2] is scalar
    [(args, _)] = split_step_inputs(step, (None, StepOutput([x]), Sliceable()), {}, 1)
    assert args[1] is x and args[2] == ("slice", 1, 0, 0)


# --- errors -----------------------------------------------------------------------------------------


def test_not_divisible_error_names_argument_path_sizes_and_remedies() -> None:
    batch = {"input_ids": torch.zeros(10, 7)}
    with pytest.raises(TensorSplitError) as info:
        split_step_inputs(step, (None, batch), {}, 4)
    text = str(info.value)
    assert '`x["input_ids"]`' in text
    assert "(10, 7)" in text and "is 10" in text and "4 microbatches" in text
    assert "drop_last=True" in text and "non_split_inputs" in text and "input_split_axes" in text
    assert isinstance(info.value, ValueError)


def test_not_divisible_on_another_axis_and_in_var_positional() -> None:
    with pytest.raises(TensorSplitError, match="along axis 1 is 5"):
        split_step_inputs(step, (None, torch.zeros(4, 5)), {}, 2, input_split_axes={"x": 1})

    def varargs(model: Any, *tensors: Any) -> None:
        """Takes tensors positionally."""
    with pytest.raises(TensorSplitError, match=r"`tensors\[1\]`"):
        split_step_inputs(varargs, (None, torch.zeros(4), torch.zeros(3)), {}, 2)


def test_zero_dim_tensor_needs_non_split_inputs() -> None:
    scalar = torch.tensor(0.5)
    with pytest.raises(TensorSplitError, match=r"0-dim.*non_split_inputs=\['y'\]"):
        split_step_inputs(step, (None, torch.zeros(2), scalar), {}, 2)
    result = split_step_inputs(step, (None, torch.zeros(2), scalar), {}, 2, non_split_inputs=["y"])
    assert all(args[2] is scalar for args, _ in result)


def test_axis_out_of_range() -> None:
    with pytest.raises(TensorSplitError, match="axis 2 is out of range"):
        split_step_inputs(step, (None, torch.zeros(4, 4)), {}, 2, input_split_axes={"x": 2})


def test_bad_microbatch_count_and_bad_call() -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(SMPConfigError, match="microbatches"):
            split_step_inputs(step, (None,), {}, bad)
    with pytest.raises(TypeError):
        split_step_inputs(step, (1, 2, 3, 4), {}, 2)
    with pytest.raises(TypeError):
        split_step_inputs(step, (1, 2), {"unknown": 3}, 2)


# --- names: *args, **kwargs, methods ----------------------------------------------------------------


def test_var_positional_name_applies_to_the_whole_var_arg() -> None:
    def varargs(model: Any, *tensors: Any) -> None:
        """Takes tensors positionally."""
    a, b = torch.zeros(4), torch.zeros(3)
    result = split_step_inputs(varargs, (None, a, b), {}, 2, non_split_inputs=["tensors"])
    assert all(args[1] is a and args[2] is b for args, _ in result)


def test_var_keyword_by_key_or_by_its_own_name() -> None:
    def kw_step(model: Any, **batch: Any) -> None:
        """Takes tensors by keyword."""
    mask, ids = torch.zeros(3), torch.arange(4)
    by_key = split_step_inputs(kw_step, (None,), {"mask": mask, "ids": ids}, 2, non_split_inputs=["mask"])
    assert all(kw["mask"] is mask for _, kw in by_key)
    assert by_key[1][1]["ids"].tolist() == [2, 3]
    whole = split_step_inputs(kw_step, (None,), {"mask": mask}, 2, non_split_inputs=["batch"])
    assert all(kw["mask"] is mask for _, kw in whole)
    axis = split_step_inputs(kw_step, (None,), {"m": torch.zeros(1, 4)}, 2, input_split_axes={"batch": 1})
    assert axis[0][1]["m"].shape == (1, 2)


def test_bound_method_names_skip_self() -> None:
    class Trainer:
        def train_step(self, model: Any, x: Any, scale: Any) -> None:
            """A step defined as a method."""

    method = Trainer().train_step
    validate_split_options(method, ["scale"], None)
    scale = torch.zeros(3)
    result = split_step_inputs(method, (None, torch.zeros(2), scale), {}, 2, non_split_inputs=["scale"])
    assert all(args[2] is scale for args, _ in result)


# --- validate_split_options -------------------------------------------------------------------------


def test_validate_accepts_valid_options() -> None:
    validate_split_options(step, None, None)
    validate_split_options(step, ["y"], {"x": 1})
    validate_split_options(step, ("model",), {"y": -1})


def test_validate_unknown_name_lists_parameters() -> None:
    with pytest.raises(StepUsageError) as info:
        validate_split_options(step, ["mask"], None)
    text = str(info.value)
    assert "'mask'" in text and "['model', 'x', 'y']" in text
    with pytest.raises(StepUsageError, match="'z'"):
        validate_split_options(step, None, {"z": 0})


def test_validate_with_var_keyword_accepts_any_name() -> None:
    def kw_step(model: Any, **batch: Any) -> None:
        """Takes tensors by keyword."""
    validate_split_options(kw_step, ["attention_mask"], {"pixel_values": 1})


@pytest.mark.parametrize(
    ("non_split", "axes", "pattern"),
    [
        ("y", None, r"non_split_inputs=\['y'\]"),
        ({"y"}, None, "got a set"),
        (["y", 3], None, r"got \[3\]"),
        (None, [("x", 1)], "must be a dict"),
        (None, {"x": "1"}, "integer axes"),
        (None, {"x": True}, "integer axes"),
        (None, {1: 1}, "integer axes"),
    ],
)
def test_validate_wrong_types(non_split: Any, axes: Any, pattern: str) -> None:
    with pytest.raises(StepUsageError, match=pattern):
        validate_split_options(step, non_split, axes)


def test_validate_warns_when_a_name_is_in_both_options() -> None:
    with pytest.warns(UserWarning, match="both non_split_inputs and input_split_axes"):
        validate_split_options(step, ["x"], {"x": 1})
