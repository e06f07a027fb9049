"""Hugging Face models with a built-in tensor-parallel version (``smp.nn.huggingface.<model>``).

Importing these never imports transformers; the swap registers itself only when a script uses it.
"""

from smp_compat.nn.huggingface import gpt2

__all__ = ["gpt2"]
