"""A torch older than the floor gets one SMPUnsupportedError at ``import smp_compat`` naming each missing API,
the feature that needs it and the version, not an ImportError or AttributeError from deep inside a step."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize(("remove", "named"), [
    ("import torch.distributed.fsdp as m; del m.fully_shard", "sharded data parallelism: FSDP2"),  # torch 2.5
    ("import torch; del torch._C._autograd._top_saved_tensors_default_hooks", "pipeline parallelism"),  # 2.6, 2.7
])  # fmt: skip
def test_an_older_torch_is_named_with_the_feature_and_version(remove: str, named: str) -> None:
    code = textwrap.dedent(f"""
        {remove}
        try:
            import smp_compat
        except NotImplementedError as exc:
            print(type(exc).__name__, exc)
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("SMPUnsupportedError smp_compat needs torch >= 2.8"), out
    assert named in out and "pip install 'torch>=2.8'" in out
