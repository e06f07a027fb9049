"""A torch older than the floor gets one SMPUnsupportedError at ``import smp_compat`` naming each missing API,
the feature that needs it and the version, not an ImportError or AttributeError from deep inside a step.

Each missing API is checked in this process (the check itself, with the API removed for the test); one
subprocess, with both removed, checks that ``import smp_compat`` raises it, naming both in one message.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch

from smp_compat.errors import SMPUnsupportedError
from smp_compat.host.torch_floor import check_sharding, check_torch

FSDP2 = ("torch.distributed.fsdp", "fully_shard", "sharded data parallelism: FSDP2")  # torch 2.5
HOOKS = ("torch._C._autograd", "_top_saved_tensors_default_hooks", "pipeline parallelism")  # 2.6, 2.7


@pytest.mark.parametrize(("module", "name", "named"), [FSDP2, HOOKS])
def test_each_missing_api_is_named_with_its_feature_and_version(
    module: str, name: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.fsdp  # noqa: F401 - the module whose attribute goes

    monkeypatch.delattr(f"{module}.{name}")
    with pytest.raises(SMPUnsupportedError) as refused:
        check_torch()
    message = str(refused.value)
    assert message.startswith("smp_compat needs torch >= 2.8") and named in message
    assert "pip install 'torch>=2.8'" in message and torch.__version__ in message
    assert (FSDP2[2] in message) == (named == FSDP2[2]) and (HOOKS[2] in message) == (named == HOOKS[2])


def test_import_smp_compat_on_an_older_torch_raises_one_error_naming_every_missing_api() -> None:
    code = textwrap.dedent(f"""
        import torch, {FSDP2[0]}
        del {FSDP2[0]}.{FSDP2[1]}, {HOOKS[0]}.{HOOKS[1]}
        try:
            import smp_compat
        except NotImplementedError as exc:
            print(type(exc).__name__, exc)
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("SMPUnsupportedError smp_compat needs torch >= 2.8"), out
    assert FSDP2[2] in out and HOOKS[2] in out and "pip install 'torch>=2.8'" in out


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.8.1"])
def test_sharding_is_refused_where_fsdp2_trains_wrong(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.8 imports fine but its FSDP2 does not equal plain PyTorch: both sharding entry points refuse it."""
    from torch import nn

    from smp_compat.sdp.wrap import shard_module
    from smp_compat.v2.fsdp.build import build

    monkeypatch.setattr(torch, "__version__", version)
    for shard, named in [(lambda: shard_module(nn.Linear(2, 2)), "sharded data parallelism"),
                         (lambda: build(None, nn.Linear(2, 2)), "FullyShardedDataParallel")]:  # fmt: skip
        with pytest.raises(SMPUnsupportedError, match=rf"{named}.* needs torch >= 2\.9.*{re.escape(version)}"):
            shard()
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    check_sharding("sharded data parallelism")  # no error from 2.9
