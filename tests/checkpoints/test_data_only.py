"""Every data-only class of the allow-list loads from a file with no key and no flag; anything else is refused.

Issue 33: a restart in a fresh container has a new checkpoint key, so a job's own files are "from
elsewhere" then, and must still load when they hold only data: its arguments, paths, dates, numpy values,
its Hugging Face config. A function, or a class that rebuilds itself through its own ``__reduce__``,
still needs a valid digest or a trusted folder (test_signing.py, test_load_policy.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import pathlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from smp_compat.checkpoints.hf_configs import config_classes, is_data_only_config
from smp_compat.checkpoints.load_policy import DATA_ONLY, harmless_globals
from smp_compat.checkpoints.serialization import safe_load
from smp_compat.checkpoints.signing import KEY_ENV
from smp_compat.errors import CheckpointError

from opaque import Opaque, opaque_function

__all__: list[str] = []

UTC_PLUS_2 = datetime.timezone(datetime.timedelta(hours=2))

EXAMPLES: dict[Any, Any] = {
    argparse.Namespace: argparse.Namespace(lr=0.1, out=Path("/ckpt"), layers=[1, 2]),
    frozenset: frozenset({"a", "b"}),
    range: range(2, 10, 3),
    slice: slice(1, None, 2),
    pathlib.PurePosixPath: pathlib.PurePosixPath("/a/b"),
    pathlib.PureWindowsPath: pathlib.PureWindowsPath("C:/a/b"),
    pathlib.PosixPath: pathlib.PosixPath("/opt/ml/checkpoints"),
    pathlib.WindowsPath: pathlib.PureWindowsPath("C:/x"),  # no WindowsPath can be made on Linux: its pure form
    datetime.date: datetime.date(2024, 2, 29),
    datetime.time: datetime.time(13, 5, 7, 9, tzinfo=UTC_PLUS_2),
    datetime.datetime: datetime.datetime(2024, 2, 29, 13, 5, 7, 123, tzinfo=UTC_PLUS_2),
    datetime.timedelta: datetime.timedelta(days=3, seconds=4, microseconds=5),
    datetime.timezone: UTC_PLUS_2,
    collections.OrderedDict: collections.OrderedDict(b=1, a=2),
    collections.Counter: collections.Counter("abracadabra"),
    collections.ChainMap: collections.ChainMap({"a": 1}, {"a": 2, "b": 3}),
}

NUMPY_EXAMPLES: dict[str, Any] = {
    "int64": np.int64(7), "float32": np.float32(1.5), "bool": np.bool_(True), "complex": np.complex128(1 + 2j),
    "array": np.arange(6, dtype=np.float32).reshape(2, 3), "dtype": np.dtype("float16"),
    "rng_state": np.random.RandomState(0).get_state(),
}  # fmt: skip

CONFIGS: dict[str, Any] = {
    "gpt2": transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2),
    "t5": transformers.T5Config(d_model=16, num_layers=1),
    "bert": transformers.BertConfig(hidden_size=16),
    "generation": transformers.GenerationConfig(max_new_tokens=5, do_sample=True, top_k=3),
}


@pytest.fixture(autouse=True)
def _no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh container: the key file does not exist, so no digest can verify."""
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "no-key-here" / "checkpoint.key"))


def _round_trip(tmp_path: Path, value: Any) -> Any:
    path = tmp_path / "user_content.pt"
    torch.save({"value": value, "step": 12}, path)
    loaded = safe_load(path)
    assert loaded["step"] == 12
    return loaded["value"]


def test_every_data_only_class_has_an_example() -> None:
    assert set(DATA_ONLY) == set(EXAMPLES)


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__qualname__)
def test_a_data_only_class_loads_with_no_key(tmp_path: Path, cls: Any) -> None:
    value = EXAMPLES[cls]
    loaded = _round_trip(tmp_path, value)
    assert type(loaded) is type(value) and loaded == value
    if cls is argparse.Namespace:
        assert vars(loaded) == vars(value)


@pytest.mark.parametrize("name", list(NUMPY_EXAMPLES))
def test_numpy_values_load_with_no_key(tmp_path: Path, name: str) -> None:
    value = NUMPY_EXAMPLES[name]
    loaded = _round_trip(tmp_path, value)
    if name == "rng_state":
        assert loaded[0] == value[0] and np.array_equal(loaded[1], value[1]) and loaded[2:] == value[2:]
    else:
        assert type(loaded) is type(value) and np.array_equal(loaded, value)


@pytest.mark.hf
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_hugging_face_config_loads_with_no_key(tmp_path: Path, name: str) -> None:
    value = CONFIGS[name]
    loaded = _round_trip(tmp_path, value)
    assert type(loaded) is type(value) and loaded.to_dict() == value.to_dict()
    assert vars(loaded) == vars(value)  # rebuilt as pickle would: the same attributes, nothing recomputed


@pytest.mark.hf
def test_only_the_config_classes_a_file_names_are_allowed(tmp_path: Path) -> None:
    torch.save({"c": CONFIGS["gpt2"], "g": CONFIGS["generation"]}, tmp_path / "f.pt")
    assert {c.__name__ for c in config_classes(tmp_path / "f.pt")} == {"GPT2Config", "GenerationConfig"}
    assert not any(is_data_only_config(c) for c in harmless_globals())  # configs are never allowed globally


class _ScriptConfig(transformers.GPT2Config):
    """A config subclass of the script's own (not transformers' code): not allowed without a key."""


class _ReducingConfig(transformers.GPT2Config):
    def __reduce__(self) -> tuple[Any, ...]:
        return (opaque_function, ())


def _in_transformers(cls: type) -> type:
    """``cls`` as if transformers' GPT-2 configuration module defined it."""
    cls.__module__ = "transformers.models.gpt2.configuration_gpt2"
    return cls


@pytest.mark.hf
def test_config_classes_outside_transformers_or_with_their_own_rebuild_are_not_data() -> None:
    assert is_data_only_config(transformers.GPT2Config) and is_data_only_config(transformers.GenerationConfig)
    assert not is_data_only_config(_ScriptConfig) and not is_data_only_config(_ReducingConfig)
    assert not is_data_only_config(_in_transformers(type("NotAConfig", (), {})))
    setstate = _in_transformers(type("SetState", (transformers.GPT2Config,), {"__setstate__": lambda self, s: None}))
    new = _in_transformers(type("New", (transformers.GPT2Config,), {"__new__": lambda cls: object.__new__(cls)}))
    assert not is_data_only_config(setstate) and not is_data_only_config(new)


@pytest.mark.parametrize(
    "value",
    [opaque_function, Opaque("x"), collections.defaultdict(list, a=[1]), collections.deque([1, 2])],
    ids=["function", "own-reduce", "defaultdict", "deque"],
)
def test_anything_else_is_refused_with_no_key(tmp_path: Path, value: Any) -> None:
    with pytest.raises(CheckpointError, match="safe loading refuses"):
        _round_trip(tmp_path, value)


@pytest.mark.hf
def test_a_script_config_subclass_is_refused_with_no_key(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="_ScriptConfig"):
        _round_trip(tmp_path, _ScriptConfig(n_layer=1))
