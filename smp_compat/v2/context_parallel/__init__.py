"""SMP v2 context parallelism (``context_parallel_degree``, ``cp_comm_type``) on stock PyTorch.

chunks.py: which tokens a cp rank holds (the scripts' head/tail split); blocks.py: blockwise attention math;
attention.py: the all-gather and ring (p2p) attention; loss.py: the whole-sequence loss; hf.py: wiring into a
Hugging Face model (``tsm.transform`` calls it); mesh.py: the FSDP mesh over shard x cp.
"""

from smp_compat.v2.context_parallel.chunks import local_positions, split_for_cp_rank

__all__ = ["local_positions", "split_for_cp_rank"]
