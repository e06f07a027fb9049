"""The one registry of what smp_compat supports of SMP v1: every API name and config key, with status and advice.

``smp-compat check`` and ``docs/api_support.md`` (``python -m smp_compat.cli.support --markdown``, rendered by
``support_docs.py``) both read it, and tests hold it against the package itself (a name marked supported must exist, an unsupported one
must not; tests/test_support_e2e.py uses every supported entry end to end), so code, checker and docs
cannot disagree. Config-key statuses are not written here at all:
they are derived from ``smp_compat.config.NOT_ACTED_ON`` and ``UNSUPPORTED``.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from smp_compat.config import NOT_ACTED_ON, UNSUPPORTED, SMPConfig

__all__ = [
    "API",
    "API_SECTIONS",
    "CONFIG",
    "CONFIG_ALIASES",
    "METHODS",
    "METHOD_SECTIONS",
    "Entry",
    "Status",
    "config_default",
    "config_value_status",
    "lookup_api",
    "main",
    "suggest_key",
]


class Status(str, Enum):
    """How far smp_compat implements an SMP name: fully, with a stated limit, or not at all."""

    SUPPORTED = "supported"
    PARTIAL = "partial"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Entry:
    """One SMP name (``DistributedModel``, ``nn.DistributedLinear``, a config key) and what we do with it.

    ``group`` entries stand for every name below them (``nn.huggingface`` covers all its translate
    functions), so a checker can classify names it has never seen.
    """

    name: str
    kind: str  # "api", "method" or "config"
    status: Status
    section: str
    note: str = ""
    action: str = ""
    group: bool = False
    meaning: str = ""  # config keys: what the key does (SMPConfig's field docstring)


_S, _P, _U = Status.SUPPORTED, Status.PARTIAL, Status.UNSUPPORTED
_LINEAR_FIX = "Build the layer as smp.nn.DistributedLinear(in_features, out_features), or smp.tp_register a module."
_SAFE_LOAD = (
    "Safe loading (tensors, containers, argparse.Namespace, numpy values, paths, dates, Hugging Face configs: "
    "no key needed); other objects from the job's own signed files, trusted folders (SMP_COMPAT_TRUST_CHECKPOINTS, "
    "smp-compat run --trust-checkpoint) or with weights_only=False."
)
_Row = tuple  # (name, status, note, action[, group])

_TP_PP = ("Composes with pipeline parallelism (pp x tp x rdp): the tp peers of a stage run their pipelines in "
          "lockstep (docs/design.md).")

_API_ROWS: list[tuple[str, list[_Row]]] = [
    ("Initialization and state", [
        ("init", _S, "Also accepts a path to a JSON file; SM_HP_MP_PARAMETERS overrides the dict key by key.", ""),
        ("is_initialized", _S, "", ""),
        ("is_tracing", _S, "Always False at pp = 1: there is no tracing pass there.", ""),
        ("num_microbatches", _S, "", ""),
        ("state", _S, "state.cfg (every config key), state.model, state.optimizer, state.module_manager.translate_functions "
                   "(SMP >= 1.10; Hugging Face's save_pretrained reads it).", ""),
        ("reset", _S, "", ""),
        ("shutdown", _S, "", ""),
    ]),
    ("Steps", [
        ("step", _S, "non_split_inputs, input_split_axes, detach_outputs and smp_slice as in SMP; decorates functions and methods alike.", ""),
        ("StepOutput", _S, "", ""),
    ]),
    ("Model and optimizer", [
        ("DistributedModel", _S, "Swaps modules marked for tensor parallelism in place (HF GPT-2, GPT-J, GPT-Neo, "
         "GPT-NeoX, BERT, RoBERTa and smp.tp_register'd classes; docs/porting.md, Tensor parallelism). With "
         "sharded_data_parallel_degree > 1 it shards the model with FSDP2 when called, as SMP did (with "
         "tensor_parallel_degree > 1 too: over the rdp group, as SMP 1.15).", ""),
        ("DistributedOptimizer", _S, "Returns the optimizer patched with SMP's methods; with fp16/bf16 on, a wrapper "
         "with fp32 master weights and loss scaling, as SMP. Under sharded data parallelism, a wrapper that clips "
         "to sdp_gradient_clipping inside step() and sets _global_grad_norm, as SMP.", ""),
        ("register_parameter", _S, "Sharded data parallelism: keeps the module and the parameter it borrows in one "
         "FSDP2 unit; call it before smp.DistributedModel (a no-op without sharding).", ""),
    ]),
    ("Partitioning", [
        ("partition", _S, "", ""),
        ("set_partition", _S, "", ""),
    ]),
    ("Tensor parallelism, model creation, activation checkpointing", [
        ("tensor_parallelism", _P, "Marks supported modules (built in: Hugging Face GPT-2, GPT-J, GPT-Neo, GPT-NeoX, BERT, RoBERTa). "
         "A plain nn.Linear is not swapped (SMP made it an smp.nn.DistributedLinear): it stays replicated, with a "
         "warning. " + _TP_PP, _LINEAR_FIX),
        ("set_tensor_parallelism", _P, "A plain nn.Linear is not swapped, as under tensor_parallelism. " + _TP_PP,
         _LINEAR_FIX),
        ("tp_register", _S, "init/forward/return hooks as in SMP. " + _TP_PP, ""),
        ("tp_register_with_module", _S, "init/forward/return hooks as in SMP. " + _TP_PP, ""),
        ("delay_param_initialization", _S, "Parameters are created on the meta device (buffers stay real); each "
         "rank allocates its own after partitioning and replays reset_parameters() / _reset_parameters() / a "
         "transformers model's _init_weights. Other writes made before partitioning are not replayed (warning).",
         ""),
        ("model_creation", _S, "dtype, delayed initialization (each rank materializes only its tensor-parallel "
         "shards) and tensor_parallelism (the swap happens at tp = 1 too, as in SMP).", ""),
        ("set_activation_checkpointing", _S, "A module spanning pipeline ranks is skipped with a warning, as in SMP.",
         ""),
        ("checkpoint", _S, "", ""),
        ("checkpoint_sequential", _S, "SMP has it only as patches.checkpoint.checkpoint_sequential; smp_compat "
         "also exports it here.", ""),
        ("patches", _P, "Only patches.checkpoint (activation checkpointing) is provided.",
         "Import other internals from their public names.", True),
        ("patches.checkpoint.checkpoint", _S, "Same function as smp.checkpoint.", ""),
        ("patches.checkpoint.checkpoint_sequential", _S, "Same function as smp.checkpoint_sequential.", ""),
    ]),
    ("smp.nn, smp.amp, smp.optimizers", [
        ("nn", _S, "SMP's tensor-parallel modules (Megatron-style splits over the tp group) and fused stand-ins.",
         "", True),
        ("nn.DistributedLinear", _S, "Row-parallel (in_features split), as SMP documents.", ""),
        ("nn.DistributedEmbedding", _P, "Split over embedding_dim; max_norm, sparse and the _skip_* options raise "
         "SMPUnsupportedError.", "Leave those options at their defaults."),
        ("nn.DistributedLayerNorm", _U, "Not in SMP's public API; not provided.", "Use torch.nn.LayerNorm."),
        ("nn.DistributedModule", _S, "", ""),
        ("nn.DistributedTransformerLMHead", _P, "Returns the logits; labels and add_cross_attention raise "
         "SMPUnsupportedError.", "Pass labels=None and compute the loss from the logits."),
        ("nn.DistributedTransformer", _S, "Layers in seq_layers.", ""),
        ("nn.DistributedTransformerLayer", _P, "use_alibi raises SMPUnsupportedError.", "Leave use_alibi False."),
        ("nn.DistributedAttentionLayer", _P, "Heads split over tp; use_alibi raises SMPUnsupportedError.",
         "Leave use_alibi False."),
        ("nn.DistributedTransformerOutputLayer", _S, "", ""),
        ("nn.FlashAttentionLayer", _P, "torch's scaled_dot_product_attention; triton_flash_attention and use_alibi "
         "raise SMPUnsupportedError.", "Leave those options False."),
        ("nn.FusedLayerNorm", _S, "torch.nn.LayerNorm (same numerics).", ""),
        ("nn.huggingface", _P, "gpt2 (with get_hf_gpt2_transformer_layer_hooks), gptj, gptneo, gptneox, bert and "
         "roberta (swaps and translate functions). The swapped models refuse a KV cache (generation), "
         "cross-attention and output_attentions/output_hidden_states (SMPUnsupportedError); gptneox's translate "
         "names follow SMP's pattern (SMP never documented them) and take num_attention_heads.",
         "Generate with stock HF: load the translated full state dict into the plain model.", True),
        ("amp", _S, "", ""),
        ("amp.GradScaler", _S, "torch's GradScaler; every pipeline stage skips or steps together.", ""),
        ("optimizers", _U, "SMP's apex-based fused optimizers are not provided.",
         "Use torch.optim (Adam, AdamW with fused=True on GPU).", True),
        ("optimizers.FusedAdam", _U, "Not provided (SMP's needed apex).", "Use torch.optim.Adam / AdamW."),
        ("optimizers.FusedLamb", _U, "Not provided (SMP's needed apex).", "Use torch.optim.AdamW, or a LAMB package."),
        ("optimizers.FusedLAMB", _U, "Not provided (SMP's needed apex).", "Use torch.optim.AdamW, or a LAMB package."),
        ("optimizers.FusedNovoGrad", _U, "Not provided (SMP's needed apex).", "Use torch.optim.AdamW."),
    ]),
    ("Save and load", [
        ("save", _S, "Atomic writes.", ""),
        ("load", _S, _SAFE_LOAD, ""),
        ("save_checkpoint", _S, "SMP's folder layout; written atomically (docs/checkpoints.md).", ""),
        ("resume_from_checkpoint", _S, _SAFE_LOAD, ""),
    ]),
    ("Ranks, sizes and groups", [
        *((name, _S, "", "") for name in (
            "rank", "size", "local_rank", "local_size", "pp_rank", "pp_size", "tp_rank", "tp_size",
            "dp_rank", "dp_size", "rdp_rank", "rdp_size", "mp_rank", "mp_size",
            "get_mp_group", "get_dp_group", "get_pp_group", "get_tp_group", "get_rdp_group",
        )),
        *((f"get_{axis}_process_group", _S, "Needs ddp: True (DDPNotEnabledError otherwise), as in SMP.", "")
          for axis in ("world", "dp", "mp", "pp", "tp", "rdp")),
    ]),
    ("Communication", [
        *((name, _S, "", "") for name in (
            "CommGroup", "RankType", "WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "DP_GROUP", "MP_GROUP",
            "broadcast", "send", "recv_from", "allgather", "barrier",
            "dp_barrier", "mp_barrier", "pp_barrier", "tp_barrier", "rdp_barrier",
        )),
        ("gather", _S, "Built on allgather: every member receives the data.", ""),
    ]),
    ("Exceptions", [
        *((name, _S, "", "") for name in (
            "SMPError", "SMPConfigError", "SMPUnsupportedError", "TensorSplitError",
            "FwdExecutionNotInStepFnError", "MultipleDistributedModelError", "DDPNotEnabledError",
        )),
    ]),
]  # fmt: skip

_METHOD_ROWS: list[tuple[str, list[_Row]]] = [
    ("DistributedModel", [
        ("forward", _S, "Inside @smp.step when pp > 1, as in SMP.", ""),
        ("backward", _S, "retain_graph/create_graph unsupported, as in SMP.", ""),
        ("partitioned", _S, "", ""),
        *((name, _S, "", "") for name in (
            "local_parameters", "local_named_parameters", "local_buffers", "local_named_buffers",
            "local_modules", "local_named_modules", "is_local_parameter", "is_local_buffer",
            "get_param_name", "register_post_partition_hook", "register_post_step_hook",
        )),
        ("get_module", _S, "The user's module. A swapped Hugging Face model also answers to SMP's paths for every "
         "model type: transformer (the swapped body; GPT-NeoX's gpt_neox, BERT / RoBERTa's encoder) and its "
         "seq_layers, each layer with attention and output; the layer list also under Hugging Face's name (h, "
         "layers, layer). Unregistered references: state_dict keys and named_parameters stay Hugging Face's.", ""),
        ("module", _P, "The user's module itself: SMP had its DDP and 16-bit wrappers in between.",
         "Write model.get_module() for the user's module (it works in both) instead of model.module.module chains."),
        ("state_dict", _S, "Collective over the pipeline stages, as in SMP. Under sharded data parallelism: real "
         "full tensors on every rank (SMP returned placeholders).", ""),
        ("local_state_dict", _S, "Under sharded data parallelism: DTensors holding this rank's shards.", ""),
        ("load_state_dict", _S, "Full or partial dicts; applied after partitioning, as in SMP.", ""),
        *((name, _S, "Distributed and scaled-batch parameters are the tensor-parallel shards.", "")
          for name in (
            "distributed_modules", "is_distributed_parameter", "is_distributed_buffer", "is_scaled_batch_parameter",
            "is_scaled_batch_buffer", "default_reducer_named_parameters", "scaled_batch_reducer_named_parameters",
        )),
        ("cuda", _P, "torch's Module.cuda(): moves the whole model at once (SMP ignored it before partitioning).",
         "Leave it out: each rank's partition is moved to its device when the model is partitioned."),
        ("cpu", _U, "Gathering a partitioned model onto the CPU is not implemented (raises SMPUnsupportedError).",
         "At pp = 1 use model.get_module().cpu()."),
        ("join", _U, "DDP's uneven-input join is not implemented (raises SMPUnsupportedError).",
         "Give every data-parallel rank the same number of batches (DistributedSampler, drop_last=True)."),
        ("register_comm_hook", _U, "DDP communication hooks are not implemented (raises SMPUnsupportedError).",
         "Remove the call; gradients are averaged over microbatches and data-parallel ranks."),
    ]),
    ("DistributedOptimizer", [
        ("step", _S, "", ""),
        ("zero_grad", _S, "", ""),
        ("state_dict", _S, "", ""),
        ("local_state_dict", _S, "With shard_optimizer_state this rank's share; gather_if_shard=True adds every "
         "rdp rank's share (a collective over the rdp group: every rank calls it), for a script that saves from "
         "rdp_rank 0 only, as AWS's 2021-22 GPT-2 script does.", ""),
        ("local_optimizer_state_dict", _S, "", ""),
        ("load_state_dict", _S, "Full or partial dicts. SMP's second argument, gather_if_shard, is accepted: each "
         "rank takes its own share's state by parameter name, from a gathered dict or its own share's.", ""),
        ("load_local_optimizer_state_dict", _S, "", ""),
        ("clip_master_grads", _P, "Exists only with fp16 or bf16 on (the master-weight wrapper) or sharded data "
         "parallelism, as in SMP.",
         "In fp32 use torch.nn.utils.clip_grad_norm_; with pp > 1 all-reduce the norm over the stages."),
        ("optimizer", _P, "The wrapped torch optimizer; exists only with fp16 or bf16 on or sharded data "
         "parallelism, as in SMP.",
         "In fp32 the returned optimizer is the torch optimizer itself."),
        ("overflow", _P, "True when the last step was skipped for inf/nan gradients; exists only with fp16 or bf16 "
         "on, as in SMP.", "In fp32 no step is skipped: leave the check out."),
        ("local_fp16_state_dict", _P, "Loss scaler and fp32 master weights; exists only with fp16 or bf16 on, "
         "as in SMP.", "In fp32 there is no such state: save optimizer.local_state_dict() alone."),
        ("load_local_fp16_state_dict", _P, "Restores local_fp16_state_dict(); exists only with fp16 or bf16 on, "
         "as in SMP.", "In fp32 load optimizer.local_state_dict() alone."),
        ("_global_grad_norm", _P, "The gradient norm of the last step, computed by the clipping inside step(); "
         "exists only with sharded data parallelism, as in SMP.", "Without it, log what clip_grad_norm_ returns."),
        ("fp16_groups", _P, "Exists only with sharded data parallelism: the parameter groups' parameters (DTensors), as "
         "DeepSpeed's ZeRO-3 exposed them.", "Without sharded data parallelism use optimizer.param_groups."),
        ("fp32_partitioned_groups_flat", _P, "Exists only with sharded data parallelism: a read-only snapshot of this rank's "
         "fp32 shards per group, flattened (enough for AWS's param-norm logging).", "Read p.to_local() to change shards."),
        ("ds_param_shard_group", _P, "Exists only with sharded data parallelism: the sharding group.",
         "Without sharded data parallelism there is no sharding group: smp.get_dp_process_group() is the replicas'."),
    ]),
    ("StepOutput", [
        *((name, _S, "", "") for name in ("outputs", "reduce_mean", "reduce_sum", "concat", "stack", "map", "detach", "clear")),
    ]),
]  # fmt: skip


def _build(rows: list[tuple[str, list[_Row]]], kind: str, prefix: bool) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for section, items in rows:
        for name, status, note, action, *rest in items:
            full = f"{section}.{name}" if prefix else name
            if full in entries:
                raise ValueError(f"duplicate support entry {full!r}")  # a bug in this table, not user input
            entries[full] = Entry(full, kind, status, section, note, action, bool(rest and rest[0]))
    return entries


API: dict[str, Entry] = _build(_API_ROWS, "api", prefix=False)
"""Module-level names of ``smdistributed.modelparallel.torch``, relative to it (``nn.DistributedLinear``)."""

METHODS: dict[str, Entry] = _build(_METHOD_ROWS, "method", prefix=True)
"""Members of DistributedModel, the optimizer DistributedOptimizer returns, and StepOutput (``Class.member``)."""

API_SECTIONS: tuple[str, ...] = tuple(section for section, _ in _API_ROWS)
METHOD_SECTIONS: tuple[str, ...] = tuple(section for section, _ in _METHOD_ROWS)

# ---------------------------------------------------------------- config keys (derived from smp_compat.config)

CONFIG_ALIASES: dict[str, str] = {"partitions": "pipeline_parallel_degree"}
"""Old key names SMP still accepted."""

_FIELDS = {field.alias or name: (name, field) for name, field in SMPConfig.model_fields.items()}

_CONFIG_ADVICE: dict[str, str] = {
    "fp16": "Remove it (trains in fp32), or keep fp32 weights and use torch.autocast with smp.amp.GradScaler.",
    "bf16": "Remove it (trains in fp32), or use torch.autocast(dtype=torch.bfloat16) in the step.",
    "fp16_params": "Remove it (trains in fp32).",
    "shard_optimizer_state": "Remove it: every data-parallel rank keeps the full optimizer state.",
    "offload_activations": "Remove it: activations stay on the device.",
    "activation_loading_horizon": "Remove it (only used with offload_activations).",
    "delayed_parameter_initialization": "Remove it: parameters are created when the module is.",
    "skip_tracing": "Nothing to do: the partitioner still traces at pp > 1.",
    "horovod": "Remove it and use ddp: True for data parallelism.",
    "sdp_reduce_bucket_size": "Nothing to do: FSDP2 reduce-scatters each block's gradients in one collective.",
    "sdp_param_persistence_threshold": "Nothing to do: every parameter is sharded; FSDP2 gathers a block's "
    "parameters in one collective, so small tensors add no latency.",
    "sdp_max_live_parameters": "Nothing to do: FSDP2 keeps the current and the next block gathered (no cap).",
    "sdp_hierarchical_allgather": "Nothing to do: FSDP2 has no hierarchical all-gather (NCCL picks its algorithm).",
}
_SDP_ONLY = ", and only with sharded_data_parallel_degree > 1"
_WARNS_ONLY: dict[str, str] = {  # where another value changes nothing, in SMP either (SMPConfig.inert_keys)
    "skip_tracing": ", and only at pipeline_parallel_degree > 1",
    "activation_loading_horizon": ", and only with offload_activations",
    "sdp_reduce_bucket_size": _SDP_ONLY,
    "sdp_param_persistence_threshold": _SDP_ONLY,
    "sdp_max_live_parameters": _SDP_ONLY,
    "sdp_hierarchical_allgather": "; False, the flat all-gather FSDP2 does, never warns",
}
_DEFAULT_ADVICE = "Nothing to do: the key is accepted and has no effect here."


def config_default(key: str) -> Any:
    """The default smp_compat uses for a config key (SMP's own spelling or the alias)."""
    _, field = _FIELDS[CONFIG_ALIASES.get(key, key)]
    return field.default


def _config_entry(key: str) -> Entry:
    _, field = _FIELDS[key]
    meaning = (field.description or "").strip()
    section = _config_section(key)
    if key in UNSUPPORTED:
        note = (f"Only the default ({field.default!r}) is accepted: {UNSUPPORTED[key]} is not implemented, so any "
                "other value raises SMPUnsupportedError at smp.init.")  # fmt: skip
        return Entry(key, "config", _U, section, note, f"Set it to {field.default!r} or remove it.", meaning=meaning)
    if key in NOT_ACTED_ON:
        note = ("Accepted and checked, but not acted on (smp.init warns when it is not the default"
                f"{_WARNS_ONLY.get(key, '')}).")  # SMPConfig.inert_keys
        if key == "prescaled_batch":  # SMPConfig.inert_keys: no effect at tp = 1, in SMP either
            note = "Accepted and checked; without tensor parallelism it changes nothing (nor did it in SMP): no warning."
        return Entry(key, "config", _P, section, note, _CONFIG_ADVICE.get(key, _DEFAULT_ADVICE), meaning=meaning)
    return Entry(key, "config", _S, section, meaning=meaning)


def _config_section(key: str) -> str:
    if key.startswith("sdp_") or key == "sharded_data_parallel_degree":
        return "Sharded data parallelism"
    if key.startswith("_") or key in {"checkpoint_attentions", "task_level_activation_loading_horizon", "herring",
                                      "load_partition", "partition_file"}:  # fmt: skip
        return "Internal SMP keys"
    return "Configuration"


def _all_config_entries() -> dict[str, Entry]:
    """Every key in SMPConfig's order, each alias right after the key it names."""
    entries: dict[str, Entry] = {}
    for key in _FIELDS:
        entry = entries[key] = _config_entry(key)
        for alias in (a for a, target in CONFIG_ALIASES.items() if target == key):
            entries[alias] = Entry(alias, "config", entry.status, entry.section, entry.note, entry.action,
                                   meaning=f"Old name of `{key}`.")
    return entries


CONFIG: dict[str, Entry] = _all_config_entries()
"""Every SMP config key smp_compat knows (and the alias), status derived from smp_compat.config."""


def config_value_status(key: str, value: Any, known: bool = True) -> tuple[Status, str]:
    """Status of ``key`` set to ``value`` (``known=False``: the value is an expression, unknown before run time).

    The default value of a key smp_compat lacks (``tensor_parallel_degree: 1``) is simply supported.
    Raises KeyError for a key SMP does not have.
    """
    entry = CONFIG[key]
    if entry.status is Status.SUPPORTED:
        return entry.status, ""
    default = config_default(key)
    if known and _same_value(value, default):
        return Status.SUPPORTED, f"The default ({default!r}): nothing to do."
    if not known and entry.status is Status.UNSUPPORTED:
        return Status.PARTIAL, f"Set from an expression: must be {default!r} at run time. {entry.note}"
    return entry.status, entry.note


def _same_value(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def suggest_key(key: str) -> list[str]:
    """The closest valid config keys, for an unknown one."""
    return difflib.get_close_matches(key, sorted(set(CONFIG)), n=3, cutoff=0.6)


# ---------------------------------------------------------------- lookups


def lookup_api(parts: Sequence[str]) -> tuple[Entry, int] | None:
    """The registry entry for a dotted name below ``smp`` and how many of its parts it covers.

    The longest registered prefix wins; a group entry also covers names below it that are not listed.
    ``("CommGroup", "DP_GROUP")`` gives (CommGroup, 1); ``("nn", "Foo")`` gives (nn, 1) since nn is a group.
    """
    for length in range(len(parts), 0, -1):
        entry = API.get(".".join(parts[:length]))
        if entry is not None:
            return entry, length
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m smp_compat.cli.support --markdown``: print the generated docs page."""
    parser = argparse.ArgumentParser(prog="python -m smp_compat.cli.support", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/api_support.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    from smp_compat.cli.support_docs import markdown

    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
