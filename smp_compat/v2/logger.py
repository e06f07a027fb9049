"""``torch.sagemaker.logger.get_logger``: the library's logger, which AWS's scripts also log through."""

from __future__ import annotations

import logging

__all__ = ["get_logger"]

_NAME = "smp_compat.v2"
_FORMAT = "%(asctime)s %(levelname)s [torch.sagemaker] %(message)s"


def get_logger(name: str = _NAME) -> logging.Logger:
    """A logger printing INFO and above to stderr once (the scripts' ``logger.info`` lines would vanish under
    Python's default of warnings only), not passing records on to the root logger's handlers twice."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_smp_compat", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._smp_compat = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
