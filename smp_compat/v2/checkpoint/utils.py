"""``torch.sagemaker.checkpoint.utils``: keep only the newest checkpoint folders.

The scripts pass the folder they just wrote (``<root>/<model>-<N>steps``, or a ``tp{T}-{r}`` folder inside
it) and a regex its name matches; the folders pruned are that checkpoint's siblings that match, newest kept
by ``sort_fn``. Only the call with ``log=True`` deletes (the scripts call it on every rank with
``log=rank == 0``), so no two ranks race to remove the same tree.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs"]

_logger = logging.getLogger("smp_compat.v2.checkpoint")
_INT = re.compile(r"\d+")


def _last_int(path: str) -> int:
    """The last integer in ``path`` (``/ckpt/llama_v2-120steps`` -> 120); -1 when it has none."""
    found = _INT.findall(os.fspath(path))
    return int(found[-1]) if found else -1


SORT_BY_LAST_INT: Callable[[str], int] = _last_int
"""Sort key: the last integer in a folder's path, so ``...-9steps`` sorts before ``...-10steps``."""


def _pruned_folder(abs_dir: Path, pattern: re.Pattern[str]) -> Path:
    """The folder whose matching children are pruned: the parent of the nearest matching ancestor, else abs_dir."""
    for candidate in (abs_dir, *abs_dir.parents):
        if pattern.match(str(candidate)):
            return candidate.parent
    return abs_dir


def limit_num_subdirs(
    abs_dir: str | os.PathLike[str],
    num_kept: int,
    sort_fn: Callable[[str], int] = SORT_BY_LAST_INT,
    regex: str = r"^.*\d+steps$",
    log: bool = True,
) -> list[str]:
    """Delete all but the ``num_kept`` newest folders matching ``regex`` (full paths); returns those deleted.

    ``num_kept <= 0`` keeps everything. Only a call with ``log=True`` deletes; the others return ``[]``.
    """
    if num_kept <= 0 or not log:
        return []
    pattern = re.compile(regex)
    folder = _pruned_folder(Path(os.path.abspath(abs_dir)), pattern)
    if not folder.is_dir():
        return []
    matching = [str(p) for p in folder.iterdir() if p.is_dir() and pattern.match(str(p))]
    doomed = sorted(matching, key=sort_fn)[:-num_kept]
    for path in doomed:
        _logger.info("Removing old checkpoint %s (keeping the newest %d).", path, num_kept)
        shutil.rmtree(path, ignore_errors=True)
    return doomed
