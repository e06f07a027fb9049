"""``torch.sagemaker.distributed.checkpoint.filesystem``: SMP's file-system storage reader and writer.

SMP's versions add S3 and multi-threaded writes to DCP's; on a shared or local file system they are DCP's
own ``FileSystemReader`` / ``FileSystemWriter`` (the format is DCP's, so either side reads the other's). The
writer takes SMP's hooks (HyperPod's local checkpoints time the write and mark a checkpoint complete with them)
and knows whether it is the save's coordinator.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from smp_compat.v2.distributed.checkpoint.s3_filesystem import S3FileSystem, is_s3_uri

__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter", "path_to_file_system"]

Hook = Callable[["DistributedFileSystemWriter"], Any]


class DistributedFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` under SMP's name."""


class DistributedFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` under SMP's name, with SMP's write hooks.

    Each hook is called with the writer: ``pre_write_hooks`` before this rank writes its files,
    ``post_write_hooks`` once they are written, on the coordinator once the whole checkpoint (its metadata
    included) is. With ``async_save`` they run in the background write.
    """

    def __init__(self, path: str | os.PathLike[str], *args: Any, pre_write_hooks: Sequence[Hook] | None = None,
                 post_write_hooks: Sequence[Hook] | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(path, *args, **kwargs)
        self.pre_write_hooks = list(pre_write_hooks or [])
        self.post_write_hooks = list(post_write_hooks or [])
        self.is_coordinator = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def write_data(self, plan: Any, planner: Any) -> Any:
        for hook in self.pre_write_hooks:
            hook(self)
        written = super().write_data(plan, planner)
        if not self.is_coordinator:
            written.wait()
            self._run_post_hooks()
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        self._run_post_hooks()  # finish runs on the coordinator only

    def _run_post_hooks(self) -> None:
        for hook in self.post_write_hooks:
            hook(self)


def path_to_file_system(path: str | os.PathLike[str]) -> FileSystem:
    """The storage ``path`` lies on: DCP's ``FileSystem`` (``concat_path``, ``create_stream``, ``ls`` ...); an
    S3 path is refused (``S3FileSystem``)."""
    if is_s3_uri(path):
        S3FileSystem()  # raises, naming S3
    return FileSystem()
