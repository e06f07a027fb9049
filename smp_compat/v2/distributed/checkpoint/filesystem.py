"""``torch.sagemaker.distributed.checkpoint.filesystem``: SMP's file-system storage reader and writer.

SMP's versions add S3 and multi-threaded writes to DCP's; on a shared or local file system they are DCP's
own ``FileSystemReader`` / ``FileSystemWriter`` (the format is DCP's, so either side reads the other's).
"""

from __future__ import annotations

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter"]


class DistributedFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` under SMP's name."""


class DistributedFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` under SMP's name."""
