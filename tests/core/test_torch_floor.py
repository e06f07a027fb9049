"""A torch without FSDP2 or DTensor (older than the floor) gets an SMPUnsupportedError naming the feature and
the version at ``import smp_compat``, not an ImportError from deep inside it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_torch_without_fsdp2_is_named_with_the_version_it_needs() -> None:
    code = textwrap.dedent("""
        import torch.distributed.fsdp as fsdp
        del fsdp.fully_shard  # what torch 2.5 looks like to smp_compat
        try:
            import smp_compat
        except NotImplementedError as exc:
            print(type(exc).__name__, exc)
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("SMPUnsupportedError smp_compat needs torch >= 2.6"), out
    assert "FSDP2" in out and "fully_shard" in out and "pip install 'torch>=2.6'" in out
