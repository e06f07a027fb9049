"""CPU mode: the ``torch.cuda`` calls AWS's SMP scripts make unguarded, served harmlessly on a machine with no CUDA.

AWS's SMP v2 scripts (the SageMaker examples' shared-scripts, the HyperPod copies) call
``torch.cuda.set_device(global_rank % torch.cuda.device_count())``, pass ``device_id=torch.cuda.current_device()``
to FSDP, time steps with ``torch.cuda.synchronize()``, mark them with ``torch.cuda.nvtx.range_push/pop`` and
start nsys with ``torch.cuda.cudart().cudaProfilerStart()``. On a CPU those raise (or divide by zero), so a
laptop run meant editing the script. In a worker that ``smp-compat run`` or ``smp-compat env`` started, this
module replaces just those functions of ``torch.cuda`` by CPU answers (``SERVED``), each announced once per
process on stderr.

Safe by construction:

* installed only when ``torch.cuda.is_available()`` is False once torch is imported: on a machine with a CUDA
  device nothing is replaced, so a real CUDA error can never become a silent no-op;
* ``torch.cuda.is_available()`` stays False, and only the script's own code (files in the running script's
  folder, or code in no file: ``python -c``, a notebook) is served; calls from torch, smp_compat and every
  other package (transformers, accelerate, FSDP, wherever installed) get torch's own function, so no library
  is led to think CUDA exists;
* opt out with ``SMP_COMPAT_CPU_CUDA=0`` (``smp-compat run --no-cpu-cuda``).

Standard library only at module level: the launcher's ``sitecustomize`` loads this file by path at interpreter
start (``install_on_torch_import``), before torch is imported and whether or not smp_compat is importable.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["CPU_CUDA_ENV", "SERVED", "enabled", "install", "install_on_torch_import", "installed"]

CPU_CUDA_ENV = "SMP_COMPAT_CPU_CUDA"
"""``0`` turns the CPU mode off (``smp-compat run --no-cpu-cuda`` exports it); anything else or unset: on."""

_MARK = "_smp_compat_cpu_served"
"""Set on every replacement, so a second install (a copy of this file loaded under another name) does nothing."""

_LIBRARY_PACKAGES = ("torch", "smp_compat")


class _CudartOnCPU:
    """What ``torch.cuda.cudart()`` returns on CPU: the profiler's start and stop do nothing (no nsys here)."""

    def cudaProfilerStart(self) -> int:  # noqa: N802 - CUDA's runtime name
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802 - CUDA's runtime name
        return 0


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _one(*args: Any, **kwargs: Any) -> int:
    return 1


def _cudart(*args: Any, **kwargs: Any) -> _CudartOnCPU:
    return _CudartOnCPU()


@contextlib.contextmanager
def _no_range(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


SERVED: dict[str, tuple[Callable[..., Any], str]] = {
    "device_count": (_one, "returns 1 (one CPU 'device'), so `rank % device_count()` is 0"),
    "current_device": (_zero, "returns 0"),
    "set_device": (_none, "does nothing"),
    "synchronize": (_none, "does nothing (CPU work is already done when the call returns)"),
    "reset_peak_memory_stats": (_none, "does nothing (the CUDA memory counters stay 0)"),
    "reset_max_memory_allocated": (_none, "does nothing (the CUDA memory counters stay 0)"),
    "reset_max_memory_cached": (_none, "does nothing (the CUDA memory counters stay 0)"),
    "cudart": (_cudart, "returns an object whose cudaProfilerStart/Stop do nothing"),
    "profiler.start": (_none, "does nothing"),
    "profiler.stop": (_none, "does nothing"),
    "nvtx.range_push": (_zero, "does nothing (returns depth 0)"),
    "nvtx.range_pop": (_zero, "does nothing (returns depth 0)"),
    "nvtx.mark": (_none, "does nothing"),
    "nvtx.range": (_no_range, "is an empty context manager"),
}
"""``torch.cuda`` attribute -> (its CPU answer, what that does). Each of these raises on a machine without CUDA
(or, for device_count, returns 0); memory_allocated and the other memory counters, empty_cache and
manual_seed[_all] already answer harmlessly there and are left alone."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the CPU mode may install here (``SMP_COMPAT_CPU_CUDA`` is not ``0``)."""
    env = os.environ if environ is None else environ
    return env.get(CPU_CUDA_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def installed(torch: ModuleType) -> bool:
    """Whether ``torch.cuda``'s functions are ours in this process."""
    return bool(getattr(torch.cuda.synchronize, _MARK, False))


def install(torch: ModuleType | None = None, script_dir: str | None = None) -> bool:
    """Replace the ``SERVED`` functions of ``torch.cuda`` when no CUDA device is usable; True when it did.

    Served to code in ``script_dir`` (default: the folder of the running script, ``sys.argv[0]``) and to code
    that is not in a file (``python -c``, a notebook cell); everything else gets torch's own function. Nothing
    happens when CUDA is available (a GPU machine), when opted out, or when already installed.
    """
    if torch is None:
        import torch  # noqa: PLC0415 - only here: this file must load before torch
    if not enabled() or installed(torch) or torch.cuda.is_available():
        return False
    folder = _folder(script_dir if script_dir is not None else _script_dir())
    for name, (answer, what) in SERVED.items():
        owner, attr = _owner(torch.cuda, name)
        if owner is not None:
            setattr(owner, attr, _serve(f"torch.cuda.{name}", getattr(owner, attr), answer, what, folder))
    return True


def _script_dir() -> str:
    """The running script's folder; the working directory for ``python -c`` and the interactive prompt."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.dirname(os.path.abspath(script)) if os.path.isfile(script) else os.getcwd()


def _folder(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


def _owner(cuda: ModuleType, name: str) -> tuple[Any, str]:
    """The module holding ``name`` (``nvtx.range_push`` -> torch.cuda.nvtx, ``range_push``), None if absent."""
    parent, _, attr = name.rpartition(".")
    owner: Any = cuda
    for part in filter(None, parent.split(".")):
        owner = getattr(owner, part, None)
    return (owner, attr) if owner is not None and hasattr(owner, attr) else (None, attr)


def _serve(
    qualname: str, real: Callable[..., Any], answer: Callable[..., Any], what: str, folder: str
) -> Callable[..., Any]:
    """``answer`` for the script's own code (announced once), torch's ``real`` for everything else."""
    announced: list[bool] = []

    @functools.wraps(real)
    def served(*args: Any, **kwargs: Any) -> Any:
        if not _called_from_script(sys._getframe(1), folder):
            return real(*args, **kwargs)
        if not announced:
            announced.append(True)
            _announce(qualname, what)
        return answer(*args, **kwargs)

    setattr(served, _MARK, True)
    return served


def _announce(qualname: str, what: str) -> None:
    rank = os.environ.get("RANK")
    where = f"rank {rank}: " if rank is not None else ""
    print(f"smp-compat: {where}{qualname}() served on CPU (no CUDA device): {what}. Set {CPU_CUDA_ENV}=0 to "
          "turn this off.", file=sys.stderr, flush=True)  # fmt: skip


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Folders whose code is a library's: site-packages (pure and platform) and the standard library."""
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[key]) for key in ("purelib", "platlib", "stdlib", "platstdlib") if key in paths}
    return tuple(sorted(os.path.join(root, "") for root in roots))


def _called_from_script(frame: Any, folder: str) -> bool:
    """True for code in the script's folder (not torch's, smp_compat's or an installed package's, even there) and
    for code that is in no file; False for everything else (transformers, accelerate, FSDP, ...)."""
    module = str(frame.f_globals.get("__name__", ""))
    if module.split(".")[0] in _LIBRARY_PACKAGES or module.startswith("_smp_compat_"):
        return False
    filename = frame.f_code.co_filename
    if filename.startswith("<"):
        return not filename.startswith("<frozen")  # python -c, the prompt, a notebook cell; not frozen stdlib
    path = os.path.realpath(filename)
    return path.startswith(folder) and not path.startswith(_library_roots())


# ---------------------------------------------------------------- at interpreter start, before torch


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torch`` so ``install`` runs once torch is imported.

    Stays on ``sys.meta_path`` until torch is executed: ``importlib.util.find_spec("torch")`` (transformers
    asks it before importing torch) only finds.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, _AfterTorch) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _InstallAfter(spec.loader)
            return spec
        return None


class _InstallAfter(importlib.abc.Loader):
    """torch's own loader, then ``install``; puts torch's loader back on the module."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        for finder in [f for f in sys.meta_path if isinstance(f, _AfterTorch)]:
            sys.meta_path.remove(finder)  # torch is imported once
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        module.__loader__ = self.real
        self.real.exec_module(module)  # type: ignore[attr-defined]
        _install_noting_failure(module)


def _install_noting_failure(torch: ModuleType) -> None:
    try:
        install(torch)
    except Exception as exc:  # noqa: BLE001 - the script must still run; say why the mode is off
        print(f"smp-compat: the CPU mode for torch.cuda calls could not be installed ({exc!r}); the script's "
              "CUDA calls behave as in plain torch.", file=sys.stderr)  # fmt: skip


def install_on_torch_import() -> None:
    """Arrange ``install`` for when the script imports torch (now, when it already is); cheap until then."""
    if not enabled():
        return
    if "torch" in sys.modules:
        _install_noting_failure(sys.modules["torch"])
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
