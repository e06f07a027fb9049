"""``torch.sagemaker.distributed``: SMP v2's distributed helpers (checkpointing in ``checkpoint``)."""
