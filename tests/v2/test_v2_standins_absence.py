"""A stand-in looks exactly like "not installed" for every name it does not provide: an ImportError on
``from x import name`` and on ``x.name`` alike, so libraries' ``except ImportError`` guards take their
no-package branch (megatron-core's ``class TELinear(te.pytorch.Linear)`` behind ``except ImportError``)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import smp_compat.v2.standins as standins
from smp_compat.errors import StandinMissingError
from test_v2_standins import _installed, _launched_python

_SKIP = ("smp_compat.v2.standins.attention", "smp_compat.v2.standins.backend", "smp_compat.v2.standins.real_te")


def _standin_modules() -> list[str]:
    """Every module of the packages served under another name (transformer_engine, megatron, smdistributed)."""
    names = []
    for info in pkgutil.walk_packages(standins.__path__, prefix="smp_compat.v2.standins."):
        if info.name not in _SKIP:
            names.append(info.name)
    return names


def test_every_standin_module_is_walked() -> None:
    names = _standin_modules()
    for expected in ("transformer_engine.pytorch", "transformer_engine.common.recipe", "megatron.core",
                     "smdistributed.dataparallel.torch.torch_smddp"):  # fmt: skip
        assert f"smp_compat.v2.standins.{expected}" in names


@pytest.mark.parametrize("name", _standin_modules())
def test_a_missing_name_is_an_import_error_on_attribute_access_and_from_import(name: str) -> None:
    module = importlib.import_module(name)
    with pytest.raises(ImportError, match="NoSuchName") as raised:
        module.NoSuchName  # noqa: B018 - the attribute access itself is the test
    assert isinstance(raised.value, StandinMissingError)
    with pytest.raises(ImportError, match="NoSuchName"):
        exec(f"from {name} import NoSuchName", {})
    assert not hasattr(module, "__no_such_dunder__")  # Python's own probes still get AttributeError
    assert getattr(module, "__wrapped__", None) is None


def test_the_error_names_the_package_as_the_script_imported_it() -> None:
    from smp_compat.v2.standins.transformer_engine import pytorch

    with pytest.raises(ImportError, match=r"'Linear' from 'transformer_engine\.pytorch'.*not installed") as raised:
        pytorch.Linear  # noqa: B018
    assert raised.value.name == "transformer_engine.pytorch"


def test_the_guard_pattern_takes_the_not_installed_branch(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's pattern, without megatron-core: a module that subclasses a TE class at import, imported
    inside ``try: ... except ImportError``. Before: AttributeError escaped the guard."""
    package = tmp_path / "guarded"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "te_layers.py").write_text(
        "import transformer_engine as te\n\n\nclass TELinear(te.pytorch.Linear):\n    pass\n"
    )
    (package / "specs.py").write_text(
        textwrap.dedent(
            """
            try:
                import transformer_engine
                from guarded.te_layers import TELinear
                HAVE_TE = True
            except ImportError:
                HAVE_TE = False
            try:
                from transformer_engine.pytorch import LayerNormLinear
                HAVE_LNL = True
            except ImportError:
                HAVE_LNL = False
            """
        )
    )
    import smp_compat.v2  # noqa: F401  (installs the finder that serves the stand-in)

    monkeypatch.syspath_prepend(str(tmp_path))
    modules_before, finders_before = set(sys.modules), list(sys.meta_path)
    try:
        import transformer_engine

        if transformer_engine.__name__ != "smp_compat.v2.standins.transformer_engine":
            pytest.skip("a real Transformer Engine is installed")
        specs = importlib.import_module("guarded.specs")
        assert (specs.HAVE_TE, specs.HAVE_LNL) == (False, False)
    finally:  # this process as it was: no alias left in sys.modules, the finder where it stood
        for name in set(sys.modules) - modules_before:
            if not name.startswith("smp_compat."):
                del sys.modules[name]
        sys.meta_path[:] = finders_before


def _plain_python(code: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with no stand-in on the path (no sitecustomize, torch.sagemaker never imported)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow
@pytest.mark.skipif(not _installed("megatron-core"), reason="megatron-core is not installed")
def test_megatron_core_imports_with_and_without_the_te_standin() -> None:
    """The same import, the same answer (no Transformer Engine), whether or not the stand-in serves the name."""
    without = _plain_python(_IMPORT_MEGATRON.format(prelude=""))
    assert without.stdout.split()[-3:] == ["megatron.core", "False", "False"]
    served = _launched_python(_IMPORT_MEGATRON.format(prelude="import torch.sagemaker, transformer_engine"))
    assert served.stdout.split()[-3:] == ["megatron.core", "False", "True"]
