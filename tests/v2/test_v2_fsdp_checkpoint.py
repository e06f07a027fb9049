"""SMP 2.0 - 2.3's ``torch.sagemaker.distributed.fsdp`` surface that AWS's HyperPod scripts import at module top
(awsome-distributed-training 58b727849cd7, ``17.SM-modelparallelv2`` and ``11.modelparallel``): the model
checkpoint helpers resume bitwise, in the sharded checkpoint's format, and the TP pre-communication hook imports
and refuses a call by name."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: see test_v2_checkpoints.py)
import transformers  # noqa: F401
from torch.distributed.fsdp import StateDictType

from smp_compat.errors import CheckpointError, SMPUnsupportedError
from smp_compat.testing import run_ranks
from v2ckpt_jobs import BATCH, Layout
from v2ckpt_util_jobs import util_job

STEPS, SAVE_AT = 5, 3


def test_tp_pre_comm_hook_refuses_a_call_by_name() -> None:
    from smp_compat.v2.distributed.fsdp.fully_sharded_data_parallel import register_tp_processing_pre_comm_hook

    with pytest.raises(SMPUnsupportedError, match="register_tp_processing_pre_comm_hook is not supported.*DTensor"):
        register_tp_processing_pre_comm_hook(torch.nn.Linear(2, 2))


def test_other_state_dict_types_and_bad_metadata_are_refused() -> None:
    from smp_compat.v2.distributed.fsdp import checkpoint as c

    model = torch.nn.Linear(2, 2)
    with pytest.raises(SMPUnsupportedError, match="FULL_STATE_DICT"):
        c.save_model_checkpoint(model, StateDictType.FULL_STATE_DICT, "/nonexistent", None, (None, 0, True))
    with pytest.raises(CheckpointError, match="process_group, coordinator_rank, action_rank"):
        c.load_model_checkpoint(model, StateDictType.SHARDED_STATE_DICT, "/nonexistent", None, None)
    with pytest.raises(CheckpointError, match="replace the checkpoint's own entries"):
        c.save_model_checkpoint(model, StateDictType.SHARDED_STATE_DICT, "/nonexistent", None, (None, 0, True),
                                extra_exports={"model": 1})


@pytest.mark.slow
@pytest.mark.parametrize("layout", [Layout(2, 2), Layout(1, 2, 2)], ids=["hsd2x2", "tp2xhsd2"])
def test_model_checkpoint_helpers_resume_bitwise_and_share_the_sharded_format(tmp_path, layout: Layout) -> None:
    """Saved with save_model_checkpoint after 3 of 5 steps; resumed in fresh processes (and containers) with
    load_model_checkpoint and with the scripts' own sharded load: the same parameters, counters, learning rate
    schedule and losses as the straight run, bit for bit."""
    folder = str(tmp_path / "llama_v2-3steps")
    whole = run_ranks(util_job, 4, "save", layout, folder, str(tmp_path / "home0"), 0, SAVE_AT, STEPS, timeout=180)
    for index, loader in enumerate(("util", "sharded")):
        home = str(tmp_path / f"home{index + 1}")
        again = run_ranks(util_job, 4, "resume", layout, folder, home, 7, SAVE_AT, STEPS, loader, timeout=180)[0]
        assert again["counters"] == {"resume_from_sequence_number": SAVE_AT * BATCH, "start_train_path_index": 0,
                                     "total_steps": SAVE_AT}, loader  # fmt: skip
        saved, loaded = whole[0]["saved"], again["loaded"]
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), loader
        assert again["losses"] == whole[0]["losses"][SAVE_AT:], loader
        assert again["lr"] == whole[0]["lr"], loader  # the scheduler resumed where it was (1 / (1 + step))
