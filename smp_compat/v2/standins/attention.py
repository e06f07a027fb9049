"""``attn_implementation="flash_attention_2"`` without flash-attn -> ``"sdpa"``, announced once.

AWS's create_model always asks Hugging Face for flash-attention 2 (transformers >= 4.37.1), which raises
ImportError where flash-attn is not installed (every CPU, and GPU hosts without it). tsm.init wraps the two
class methods every model construction with that argument goes through, ``PreTrainedModel.from_pretrained``
and ``PreTrainedModel._from_config`` (where ``AutoModel*.from_config`` and ``Model._from_config`` arrive; the
Auto classes carry per-class copies of ``from_config``, so wrapping below them is the one place), to ask for
torch's SDPA kernels instead. With flash-attn installed nothing changes.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from smp_compat.v2.standins import announce

__all__ = ["install_sdpa_fallback", "sdpa_instead_of_flash"]

_FLASH = "flash_attention_2"
_MARK = "_smp_compat_sdpa_fallback"


def _flash_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def sdpa_instead_of_flash(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``attn_implementation`` "flash_attention_2" replaced by "sdpa" when flash-attn is missing."""
    if kwargs.get("attn_implementation") != _FLASH or _flash_available():
        return kwargs
    announce("flash_attention_2", 'attn_implementation="flash_attention_2" without flash-attn installed: using '
             '"sdpa" (torch\'s scaled_dot_product_attention, same results up to rounding).')  # fmt: skip
    return {**kwargs, "attn_implementation": "sdpa"}


def _wrap_classmethod(owner: type, name: str) -> None:
    method = owner.__dict__[name]
    if getattr(method.__func__, _MARK, False):
        return
    original = method.__func__

    @functools.wraps(original)
    def wrapper(cls: type, *args: Any, **kwargs: Any) -> Any:
        return original(cls, *args, **sdpa_instead_of_flash(kwargs))

    setattr(wrapper, _MARK, True)
    setattr(owner, name, classmethod(wrapper))


def install_sdpa_fallback() -> bool:
    """Wrap transformers' model constructors (when transformers is installed); True when wrapped."""
    if importlib.util.find_spec("transformers") is None:
        return False
    from transformers import PreTrainedModel

    _wrap_classmethod(PreTrainedModel, "_from_config")
    _wrap_classmethod(PreTrainedModel, "from_pretrained")
    return True
