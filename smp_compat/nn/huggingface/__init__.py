"""Hugging Face models with a built-in tensor-parallel version (``smp.nn.huggingface.<model>``)."""
