"""The ``torch.sagemaker`` names HyperPod's training adapter (aws/sagemaker-hyperpod-training-adapter-for-nemo
v1.4.0, 0f91fdd) imports at module top and the arguments it passes: each works as SMP describes, or (S3, Transformer
Engine's context parallelism) imports and is refused by name when called."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: see test_v2_checkpoints.py)
import torch.distributed as dist
import transformers  # noqa: F401

from smp_compat.errors import SMPUnsupportedError
from smp_compat.testing import run_ranks
from test_v2_standins import _launched_python


def test_the_adapters_and_hyperpod_scripts_module_top_imports_work_under_torch_sagemaker() -> None:
    """The adapter's import lines (fsdp_strategy.py, checkpoint.py, local_ckpt_io.py, base_ckpt_io.py,
    sagemaker_base_model.py, patch_llama_flash_attn_cp.py) and AWS's HyperPod scripts' (checkpoints.py,
    train_lib.py; their flash attention: test_v2_flash_attn.py), in a process as ``smp-compat run`` starts it."""
    done = _launched_python(
        """
        import torch.sagemaker as tsm
        import transformer_engine
        import transformer_engine.pytorch as te
        from torch.sagemaker.checkpoint.constants import SMP_IS_LOAD_INFO_KEY, SMP_IS_PARTIAL_KEY
        from torch.sagemaker.context_parallel.utils import setup_transformer_engine_cp_groups
        from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
        from torch.sagemaker.distributed.checkpoint.filesystem import (
            DistributedFileSystemReader, DistributedFileSystemWriter, path_to_file_system)
        from torch.sagemaker.distributed.checkpoint.s3_filesystem import (
            S3FileSystem, format_s3_path, get_s3_region_from_uri, is_s3_uri, parse_s3_uri, retry_with_jitter)
        from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
        from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
            SMStateDictType, _Interval, compute_auto_checkpoint_interval, init_optim_state, sm_state_dict_type)
        import torch.sagemaker.distributed.checkpoint.state_dict_saver as saver
        from torch.sagemaker.state_handler import state
        from torch.sagemaker import state as tsm_state
        from torch.sagemaker.distributed.fsdp import checkpoint as tsm_fsdp_checkpoint
        from torch.sagemaker.distributed.fsdp.fully_sharded_data_parallel import register_tp_processing_pre_comm_hook
        get_extra_state = te.attention.DotProductAttention.get_extra_state  # read at import by the cp patch
        print(state is tsm.state is tsm_state, SMP_IS_PARTIAL_KEY, SMP_IS_LOAD_INFO_KEY, callable(get_extra_state),
              callable(tsm.state.reset), tsm_fsdp_checkpoint.EXPORT_KEY_MODEL, tsm_fsdp_checkpoint.EXPORT_KEY_IDENTITY)
        """
    )
    assert done.stdout.split() == ["True", "_smp_is_partial", "_smp_load_info", "True", "True", "model", "identity"]


def test_te_only_context_parallelism_and_te_attention_are_refused_by_name() -> None:
    from smp_compat.v2.context_parallel.utils import setup_transformer_engine_cp_groups
    from smp_compat.v2.standins.transformer_engine.pytorch.attention import DotProductAttention

    with pytest.raises(SMPUnsupportedError, match="setup_transformer_engine_cp_groups is not supported.*transform"):
        setup_transformer_engine_cp_groups(torch.nn.Linear(2, 2), [0, 1], None)
    with pytest.raises(SMPUnsupportedError, match="DotProductAttention needs the real Transformer Engine"):
        DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="sbhd")


def test_s3_uri_helpers_work_and_s3_itself_is_refused() -> None:
    from smp_compat.v2.distributed.checkpoint.filesystem import path_to_file_system
    from smp_compat.v2.distributed.checkpoint.s3_filesystem import (
        S3FileSystem, format_s3_path, get_s3_region_from_uri, is_s3_uri, parse_s3_uri)  # fmt: skip

    collapsed = Path("s3://bucket/run/ckpt")  # what the adapter passes: pathlib makes it s3:/bucket/run/ckpt
    assert is_s3_uri(collapsed) and is_s3_uri("s3://bucket") and not is_s3_uri("/fsx/s3/ckpt")
    assert format_s3_path(collapsed) == "s3://bucket/run/ckpt"
    assert parse_s3_uri("s3://bucket/run/ckpt") == ("bucket", "run/ckpt") and parse_s3_uri("s3://b") == ("b", "")
    with pytest.raises(SMPUnsupportedError, match="does not read or write S3"):
        get_s3_region_from_uri("s3://bucket/x")
    with pytest.raises(SMPUnsupportedError, match="S3FileSystem"):
        S3FileSystem(region="us-west-2")
    with pytest.raises(SMPUnsupportedError, match="S3"):
        path_to_file_system(collapsed)
    assert not isinstance(path_to_file_system("/tmp"), S3FileSystem)


def test_retry_with_jitter_retries_transient_errors_only() -> None:
    from smp_compat.v2.distributed.checkpoint.s3_filesystem import retry_with_jitter

    calls = []

    @retry_with_jitter
    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OSError("Input/output error")
        return "ok"

    assert flaky() == "ok" and len(calls) == 3

    @retry_with_jitter
    def missing() -> None:
        calls.append(2)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        missing()
    assert calls.count(2) == 1


def test_auto_checkpoint_interval_and_its_saved_form() -> None:
    from smp_compat.v2.distributed.checkpoint.state_dict_utils import _Interval, compute_auto_checkpoint_interval

    assert _Interval().interval <= 0  # the adapter's "not computed yet"
    # io 2.5 s per 1 s step: a write must end before the next one starts -> every 3 steps
    assert compute_auto_checkpoint_interval([1.0, 1.0], [1.1, 1.1], [0.05, 0.05], [2.5, 2.5]).interval == 3
    # a checkpointing step 0.8 s slower: 10 % overhead needs 8 steps
    got = compute_auto_checkpoint_interval([1.0], [1.8], [0.1], [0.5])
    assert got.interval == 8 and got.step_ckpt_duration == 1.8
    assert compute_auto_checkpoint_interval([1.0], [1.0], [0.0], [0.2]).interval == 1
    saved = dataclasses.asdict(got)  # the adapter's dump() / load()
    assert _Interval(**saved) == got
    assert _Interval(**saved, some_future_field=1).interval == 8


def _writer_hooks_and_reset_job(folder: str) -> dict:
    """Two ranks: an async save through DistributedFileSystemWriter with the adapter's hooks, finalized as its
    local checkpoints do; the automatic interval from different timings per rank; then tsm.state.reset() and a
    second tsm.init with another layout."""
    import smp_compat.v2 as tsm
    from smp_compat.v2.distributed.checkpoint.async_utils import AsyncCallsQueue
    from smp_compat.v2.distributed.checkpoint.filesystem import DistributedFileSystemWriter, path_to_file_system
    from smp_compat.v2.distributed.checkpoint.state_dict_saver import async_save

    tsm.init({"hybrid_shard_degree": 2})
    rank = dist.get_rank()
    events: list = []

    def on_start(writer: DistributedFileSystemWriter) -> None:
        events.append(["pre", writer.is_coordinator])

    def write_local_metadata(writer: DistributedFileSystemWriter) -> None:  # the adapter's hook, in kind
        if writer.is_coordinator:
            path = writer.fs.concat_path(writer.path, ".local.metadata")
            with writer.fs.create_stream(path, "wb") as stream:
                torch.save({"step": 7}, stream)
        events.append(["post", writer.is_coordinator, os.path.exists(os.path.join(folder, f"__{rank}_0.distcp"))])

    queue = AsyncCallsQueue()
    writer = DistributedFileSystemWriter(folder, pre_write_hooks=[on_start], post_write_hooks=[write_local_metadata])
    async_save({f"w{rank}": torch.full((3,), float(rank))}, storage_writer=writer, process_group=None,
               coordinator_rank=0, queue=queue)  # fmt: skip
    queue.maybe_finalize_async_calls(blocking=True, skip_sync=True)
    assert queue.get_num_unfinalized_calls() == 0
    dist.barrier()
    fs = path_to_file_system(folder)
    with fs.create_stream(fs.concat_path(fs.init_path(folder), ".local.metadata"), "rb") as stream:
        step = torch.load(stream)["step"]
    from smp_compat.v2.distributed.checkpoint.state_dict_utils import compute_auto_checkpoint_interval

    interval = compute_auto_checkpoint_interval([1.0], [1.0], [0.0], [1.0 + 2.0 * rank]).interval  # io 1 s / 3 s
    tsm.state.reset()
    reset = [tsm.is_initialized(), tsm.state.tensor_parallel_degree]
    tsm.init({"hybrid_shard_degree": 1})
    return {"events": events, "step": step, "reset": reset, "after": tsm.state.hybrid_shard_degree,
            "interval": interval}


def test_writer_hooks_coordinator_and_skip_sync_finalize_then_state_reset(tmp_path) -> None:
    folder = str(tmp_path / "tp0_ep0_fsdp0")
    results = run_ranks(_writer_hooks_and_reset_job, 2, folder, timeout=120)
    assert results[0]["events"] == [["pre", True], ["post", True, True]]  # coordinator: after the whole save
    assert results[1]["events"] == [["pre", False], ["post", False, True]]  # others: after their own files
    assert all(r["step"] == 7 for r in results)
    assert all(r["reset"] == [False, 1] and r["after"] == 1 for r in results)
    assert [r["interval"] for r in results] == [3, 3]  # the slowest rank's timings, on every rank


def test_skip_sync_finalizes_this_ranks_done_saves_without_a_collective() -> None:
    from concurrent.futures import Future

    from smp_compat.v2.distributed.checkpoint.async_utils import AsyncCallsQueue, AsyncRequest

    done, pending = Future(), Future()
    done.set_result(None)
    queue = AsyncCallsQueue()
    queue.schedule_async_call(AsyncRequest(done, "a"))
    queue.schedule_async_call(AsyncRequest(pending, "b"))
    assert not dist.is_initialized()  # no process group: a collective would fail
    assert queue.maybe_finalize_async_calls(blocking=False, skip_sync=True) == [0]
    assert queue.get_num_unfinalized_calls() == 1
