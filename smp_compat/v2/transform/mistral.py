"""Mistral: Llama's layer shape (GQA, gate/up/down MLP); the sliding window lives in the mask, untouched by tp."""

from __future__ import annotations

import dataclasses

from smp_compat.v2.transform import llama

__all__ = ["FAMILY"]

FAMILY = dataclasses.replace(llama.FAMILY, name="Mistral", model_types=("mistral",))
