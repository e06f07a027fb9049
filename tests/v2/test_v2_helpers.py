"""The small public helpers: get_logger, utils.utils.timeit, utils.module_utils, is_initialized."""

from __future__ import annotations

import logging

import torch
from torch import nn

import smp_compat.v2 as tsm
from smp_compat.v2.logger import get_logger
from smp_compat.v2.utils.module_utils import empty_module_params, move_buffers_to_device
from smp_compat.v2.utils.utils import timeit


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_get_logger_logs_info_through_one_handler_and_timeit_reports_on_rank_0() -> None:
    logger = get_logger()
    assert get_logger() is logger and len(logger.handlers) == 1 and logger.isEnabledFor(logging.INFO)
    records = _Records()
    logger.addHandler(records)
    try:
        with timeit(True, "FSDP constructor", 0):
            pass
        with timeit(True, "elsewhere", 1):
            pass
        with timeit(False, "off", 0):
            pass
    finally:
        logger.removeHandler(records)
    assert len(records.messages) == 1 and records.messages[0].startswith("FSDP constructor took ")


def test_empty_module_params_materialises_a_meta_module_and_buffers_move_alone() -> None:
    with torch.device("meta"):
        module = nn.BatchNorm1d(4)
    empty_module_params(module, "cpu")
    assert {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()} == {"cpu"}
    move_buffers_to_device(module, "meta")
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    assert {b.device.type for b in module.buffers()} == {"meta"}
    assert set(module.state_dict()) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}


def test_is_initialized_before_init() -> None:
    assert tsm.is_initialized() is False
    assert tsm.state.tensor_parallel_degree == 1 and tsm.state.hybrid_shard_degree == 0
