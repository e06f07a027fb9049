"""``import torch.sagemaker`` resolves to smp_compat.v2 (one copy of every module), and a real one wins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import smp_compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(smp_compat.__file__)))


GLOO_CHATTER = "[Gloo] "
"""torch 2.9 and 2.10's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks..." on stdout at init."""


def _python(code: str, tmp_path=None) -> str:
    """Run ``code`` in a fresh interpreter (the import system's state is per process) and return its stdout."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("SM_HP_MP_PARAMETERS", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return "\n".join(line for line in done.stdout.strip().splitlines() if not line.startswith(GLOO_CHATTER))


def test_torch_sagemaker_and_its_submodules_are_smp_compat_v2s_modules() -> None:
    out = _python(
        """
        import smp_compat.v2, sys
        import torch.sagemaker as tsm
        from torch.sagemaker import state
        import torch.sagemaker.layout, torch.sagemaker.state
        import smp_compat.v2.layout
        import torch
        print(tsm is smp_compat.v2, state is smp_compat.v2.state, torch.sagemaker is tsm,
              torch.sagemaker.layout is smp_compat.v2.layout,
              sys.modules["torch.sagemaker.state"] is sys.modules["smp_compat.v2.state"],
              type(sys.meta_path[0]).__name__)
        try:
            import torch.sagemaker.no_such_module
        except ModuleNotFoundError as exc:
            print(exc.name)
        import torch.distributed as dist
        tsm.init()  # no process group and no launcher variables: tsm.init starts a world of one
        print(dist.get_world_size(), dist.get_backend(), tsm.state.device_mesh.mesh.shape[0])
        import smdistributed  # no smdistributed anywhere: SMP v2's stand-in (for SMDDP) ...
        before = smdistributed.__name__
        from smp_compat import shim
        shim.install()  # ... gives way to the SMP v1 shim's
        import smdistributed.modelparallel.torch as smp
        import smdistributed.dataparallel.torch.torch_smddp
        print(before, smdistributed.__name__, smp is sys.modules["smp_compat"])
        """
    )
    assert out.splitlines() == ["True True True True True TorchSagemakerFinder", "torch.sagemaker.no_such_module",
                                "1 gloo 1", "smp_compat.v2.standins.smdistributed smdistributed True"]


def test_a_real_torch_sagemaker_wins(tmp_path) -> None:
    real = tmp_path / "fake_torch_ext" / "sagemaker"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    out = _python(
        f"""
        import torch
        torch.__path__.append({str(tmp_path / "fake_torch_ext")!r})
        import smp_compat.v2  # installs the finder at the end of sys.meta_path
        import torch.sagemaker as tsm
        print(getattr(tsm, "REAL", False))
        try:
            import torch.sagemaker.state  # the real package lacks it: not filled in from smp_compat
        except ModuleNotFoundError:
            print("missing")
        """
    )
    assert out.splitlines() == ["True", "missing"]


def test_state_and_transform_stay_smps_objects_when_same_named_submodules_are_bound() -> None:
    import smp_compat.v2 as tsm
    from smp_compat.v2.state import state

    tsm.state = object()  # what the import system does on `import torch.sagemaker.state`
    tsm.transform = object()  # ... and on importing the smp_compat.v2.transform subpackage
    assert tsm.state is state
    assert "state" not in vars(tsm) and "transform" not in vars(tsm)


@pytest.mark.parametrize("path", ["torch.sagemaker", "torch.sagemaker.state", "torch.sagemaker.layout"])
def test_target_names(path: str) -> None:
    from smp_compat.v2.finder import target_name

    assert target_name(path) == path.replace("torch.sagemaker", "smp_compat.v2")
    assert target_name("torch.sagemakers") is None


@pytest.mark.parametrize("name", ["transformer_engine", "smdistributed.modelparallel.torch"])
def test_a_python_that_cannot_import_smp_compat_is_named_with_the_fix(name: str, tmp_path) -> None:
    """A launcher that starts another Python (only the shim folder on its PYTHONPATH): one message naming that
    interpreter and the fix, not "No module named 'smp_compat'" from inside the finder. ``-S``: no site-packages,
    so smp_compat is not importable; the sitecustomize runs as the launched worker's would."""
    from smp_compat.shim import SITE_DIR

    code = f"import sitecustomize\ntry:\n    import {name}\nexcept ModuleNotFoundError as exc:\n    print(repr(exc.name), exc)"
    done = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": SITE_DIR}, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"'{name}' {name} is provided by smp_compat, which this Python cannot import: "
                                  f"{sys.executable}."), done.stdout  # fmt: skip
    assert f"{sys.executable} -m pip install smp-compat" in done.stdout
