"""Hugging Face RoBERTa: the same encoder layout as BERT (see ``bert.py``), under RoBERTa's names."""

from __future__ import annotations

from smp_compat.nn.huggingface.bert import (
    translate_hf_state_dict_to_smdistributed_bert as translate_hf_state_dict_to_smdistributed_roberta,
    translate_state_dict_to_hf_bert as translate_state_dict_to_hf_roberta,
    translate_state_dict_to_smdistributed,
)

__all__ = ["translate_hf_state_dict_to_smdistributed_roberta", "translate_state_dict_to_hf_roberta",
           "translate_state_dict_to_smdistributed"]  # fmt: skip
