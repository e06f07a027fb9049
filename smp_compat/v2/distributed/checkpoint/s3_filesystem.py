"""``torch.sagemaker.distributed.checkpoint.s3_filesystem``: SMP's S3 checkpoint storage.

HyperPod's training adapter imports these names at module top and uses them only for ``s3://`` checkpoint
paths. The URI helpers and the retry decorator work; what needs S3 itself (``S3FileSystem``, a bucket's
region) is refused by name when called: smp_compat writes checkpoints to file systems (local or shared), as
``async_save`` / ``save`` say (docs/porting_v2.md, "Checkpoints").
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from smp_compat.errors import SMPUnsupportedError

__all__ = ["S3FileSystem", "format_s3_path", "get_s3_region_from_uri", "is_s3_uri", "parse_s3_uri", "retry_with_jitter"]

_T = TypeVar("_T")
_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_ATTEMPTS, _BASE_DELAY_S = 3, 0.05


def _refuse(what: str) -> SMPUnsupportedError:
    return SMPUnsupportedError(
        f"{what}: smp_compat does not read or write S3. Save checkpoints to a local or shared file system "
        "(FSx, EFS, a local disk) and copy them to S3 afterwards."
    )


def is_s3_uri(path: Any) -> bool:
    """Whether ``path`` names S3: ``s3://bucket/key``, or ``s3:/bucket/key`` (what ``pathlib.Path`` makes of it)."""
    return os.fspath(path).startswith("s3:/")


def format_s3_path(path: Any) -> str:
    """``s3://bucket/key`` from an S3 path ``pathlib.Path`` collapsed to ``s3:/bucket/key``."""
    text = os.fspath(path)
    if not is_s3_uri(text):
        raise ValueError(f"{text!r} is not an s3:// URI")
    return "s3://" + text[len("s3:/") :].lstrip("/")


def parse_s3_uri(uri: Any) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key`` (key "" for a bucket)."""
    bucket, _, key = format_s3_path(uri)[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{os.fspath(uri)!r} names no bucket")
    return bucket, key


def get_s3_region_from_uri(uri: Any, *args: Any, **kwargs: Any) -> str:
    """Refused: a bucket's region is a question for S3."""
    raise _refuse(f"get_s3_region_from_uri({os.fspath(uri)!r})")


class S3FileSystem:
    """SMP's S3 storage for DCP: importable (``isinstance`` checks are False), refused when built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("torch.sagemaker.distributed.checkpoint.s3_filesystem.S3FileSystem")


def retry_with_jitter(function: Callable[..., _T]) -> Callable[..., _T]:
    """``function`` retried on transient OS errors (a shared file system's hiccup), up to 3 attempts with
    exponential back-off and random jitter; missing files and refused permissions raise at once."""

    @functools.wraps(function)
    def retrying(*args: Any, **kwargs: Any) -> _T:
        for attempt in range(_ATTEMPTS):
            try:
                return function(*args, **kwargs)
            except _NOT_TRANSIENT:
                raise
            except OSError:
                if attempt == _ATTEMPTS - 1:
                    raise
                time.sleep(_BASE_DELAY_S * 2**attempt * (1 + random.random()))
        raise AssertionError("unreachable")

    return retrying
