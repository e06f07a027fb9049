"""The registry of what smp_compat supports of SMP v2 (``torch.sagemaker``): every public symbol AWS's scripts and
SMP's reference name, every ``tsm.state`` attribute and the nine config keys, with status and advice.

``smp-compat check`` (``scan.py``, ``check.py``) and the "SMP v2" part of docs/api_support.md read it; tests
hold it against the package (a supported or partial name must import through ``torch.sagemaker``, an
unsupported one must not). Config-key meanings come from ``SMPv2Config``'s field docstrings.
"""

from __future__ import annotations

from collections.abc import Sequence

from smp_compat.cli.support import Entry, Status
from smp_compat.v2.config import SMPv2Config

__all__ = ["API_V2", "API_V2_SECTIONS", "CONFIG_V2", "lookup_api_v2"]

_S, _P, _U = Status.SUPPORTED, Status.PARTIAL, Status.UNSUPPORTED
_Row = tuple  # (name, status, note, action[, group])
_CP = ("Context parallelism (cp_comm_type p2p or all_gather) for the same models: the scripts' head/tail chunks, "
       "true positions, causal attention over the whole sequence, the loss shifted in the whole sequence; no "
       "sliding window, padding mask or attention dropout.")

_ROWS: list[tuple[str, list[_Row]]] = [
    ("Initialization, transform, parameters, clipping", [
        ("init", _S, "A dict or a JSON path; SM_HP_MP_PARAMETERS wins key by key; uses the script's process "
         "group or starts one (torchrun, Slurm, Open MPI).", ""),
        ("is_initialized", _S, "", ""),
        ("transform", _P, "Tensor parallelism on DTensor for GPT-NeoX, Llama 2/3 (llama3 rope scaling), Mistral and "
         "Mixtral (attention split; router and experts whole on every tp rank), transformers 4.x and 5, "
         "Hugging Face names kept (a full save is a Hugging Face checkpoint); load_state_dict_from_rank0. "
         + _CP + " Mixtral with expert parallelism: config=MoEConfig(...).",
         "Other models: one SMPUnsupportedError naming the supported ones; use them at tp 1 without "
         "transform, or port the model."),
        ("delayed_param.DelayedParamIniter", _S, "Hugging Face's initialization per FSDP unit, then re-tying.", ""),
        ("grad_norm.clip_grad_norm_", _S, "The global norm over shards and tensor-parallel pieces, as one-process "
         "torch.nn.utils.clip_grad_norm_.", ""),
        ("tensor_parallel.transformer.TransformerLayer", _S, "isinstance holds for the decoder layers of a "
         "transformed model (the scripts' wrap policy and activation checkpointing).", ""),
        ("tensor_parallel.transformer.TETransformerLayer", _P, "SMP's name on torch < 2.2: AWS's fsdp_utils picks "
         "TransformerLayer on every torch smp_compat runs on; here the same class.", ""),
        ("moe.moe_config.MoEConfig", _P, "transform(model, config=MoEConfig(...)) runs Hugging Face Mixtral "
         "(transformers 4.40-4.57's per-expert modules, whose names a full save keeps, or 5's stacked experts) "
         "with SMP's MoE layer and expert parallelism: all four moe_load_balancing options, moe_aux_loss_coeff and "
         "moe_z_loss_coeff, dropless. With tp at ep 1; not with ep and tp both > 1 (as SMP), nor cp, nor "
         "load_state_dict_from_rank0 at ep > 1.", "Other MoE models: train them without config=MoEConfig."),
        ("moe.moe_layer.MoELayer", _S, "Each Mixtral decoder layer's mlp (transformers 4.x: block_sparse_moe, "
         "returning 4.x's (hidden_states, router_logits)) after transform(config=MoEConfig(...)) "
         "(the scripts' isinstance checks find it).", ""),
        ("nn.huggingface.llama_flashattn.LlamaFlashAttention", _S, "LlamaFlashAttention(config[, layer_idx]): the "
         "installed transformers' Llama attention (same parameters, call and return) computed by "
         "FlashGroupedQueryAttention, the model's padding mask applied. AWS's 2023 HyperPod scripts "
         "(use_smp_flash_attn 1) swap it in on transformers < 4.34.", ""),
        ("nn.attn.FlashSelfAttention", _S, "SMP's signature, computed with torch's scaled_dot_product_attention (equal "
         "to plain attention up to rounding); output in the input's layout; dropout in training mode only; attn_mask "
         "only with use_alibi=True, as SMP documents.", ""),
        ("nn.attn.FlashGroupedQueryAttention", _S, "forward(q, kv, causal, cast_dtype, layout) with kv packed or (k, "
         "v); torch's scaled_dot_product_attention.", ""),
    ]),
    ("Helpers", [
        ("logger.get_logger", _S, "", ""),
        ("utils.utils.timeit", _S, "", ""),
        ("utils.process_group_utils.get_global_ranks", _S, "", ""),
        ("utils.module_utils.empty_module_params", _P, "SMP documents no signature: (module, device=None, "
         "recurse=True) gives parameters and buffers uninitialised storage on the device.", ""),
        ("utils.module_utils.move_buffers_to_device", _P, "SMP documents no signature: (module, device=None, "
         "recurse=True) moves buffers only.", ""),
    ]),
    ("Checkpoints", [
        ("checkpoint.utils.limit_num_subdirs", _S, "", ""),
        ("checkpoint.utils.SORT_BY_LAST_INT", _S, "", ""),
        ("distributed.checkpoint.async_utils.AsyncCallsQueue", _S, "", ""),
        ("distributed.checkpoint.state_dict_saver.async_save", _P, "DCP's async save with the scripts' global "
         "coordinator rank (the group's lowest rank, as the scripts pass; others are refused); written by a "
         "background thread over its own gloo group; S3 (s3_region, s3client_config, s3://) is refused.",
         "Save to a local or shared file system."),
        ("distributed.checkpoint.state_dict_saver.save", _P, "DCP's save with the global coordinator rank; S3 "
         "is refused.", "Save to a local or shared file system."),
        ("distributed.checkpoint.state_dict_saver.maybe_finalize_async_calls", _S, "", ""),
        ("distributed.checkpoint.state_dict_saver.PyTorchDistSaveShardedStrategy", _P, "Accepted as async_save's "
         "sharded_strategy; the writer is always DCP's file-per-rank one.", ""),
        ("distributed.checkpoint.state_dict_loader.load", _S, "", ""),
        ("distributed.checkpoint.filesystem.DistributedFileSystemReader", _S, "", ""),
        ("distributed.checkpoint.filesystem.DistributedFileSystemWriter", _S, "DCP's FileSystemWriter with SMP's "
         "pre_write_hooks / post_write_hooks (each called with the writer: before this rank writes; after its files, "
         "on the coordinator after the whole checkpoint) and is_coordinator.", ""),
        ("distributed.checkpoint.filesystem.path_to_file_system", _P, "DCP's FileSystem for a file-system path; an "
         "s3:// path is refused (SMPUnsupportedError).", "Save to a local or shared file system."),
        *[(f"distributed.checkpoint.s3_filesystem.{name}", _S, "", "")
          for name in ("is_s3_uri", "format_s3_path", "parse_s3_uri")],
        ("distributed.checkpoint.s3_filesystem.retry_with_jitter", _S, "Retries transient OS errors (3 attempts, "
         "jittered back-off); missing files and permissions raise at once.", ""),
        *[(f"distributed.checkpoint.s3_filesystem.{name}", _P, "Importable (HyperPod's adapter imports it at module "
           "top); a call raises SMPUnsupportedError: smp_compat does not read or write S3.", "Save to a local or "
           "shared file system and copy to S3.") for name in ("S3FileSystem", "get_s3_region_from_uri")],
        *[(f"checkpoint.constants.{name}", _S, "The keys SMP marks partial state dicts with (_smp_is_partial, "
           "_smp_load_info).", "") for name in ("SMP_IS_PARTIAL_KEY", "SMP_IS_LOAD_INFO_KEY")],
        ("distributed.checkpoint.state_dict_utils.sm_state_dict_type", _S, "SM_LOCAL_STATE_DICT is the FSDP "
         "model's sharded state dict (this rank's shard, no collective); other types go to FSDP.state_dict_type.",
         ""),
        ("distributed.checkpoint.state_dict_utils.SMStateDictType", _S, "", ""),
        ("distributed.checkpoint.state_dict_utils.init_optim_state", _S, "", ""),
        *[(f"distributed.checkpoint.state_dict_utils.{name}", _P, "HyperPod's automatic checkpoint interval; SMP "
           "documents no formula: the fewest steps so one checkpoint's background write ends before the next and "
           "checkpointing steps cost at most 10 % of training time, from the slowest rank's timings (collective); "
           "_Interval round-trips through dataclasses.asdict.", "") for name in ("_Interval",
                                                                                "compute_auto_checkpoint_interval")],
        ("context_parallel.utils.setup_transformer_engine_cp_groups", _P, "Importable (HyperPod's adapter imports "
         "it at module top and calls it only for Transformer Engine attention modules); a call raises "
         "SMPUnsupportedError: Transformer Engine's context parallelism needs the real TE.", "Let tsm.transform(model, "
         "cp_comm_type=...) apply context parallelism to the Hugging Face attention."),
        *[(f"distributed.fsdp.checkpoint.{name}", _S, "SMP 2.0 - 2.3's model checkpoint helpers (AWS's HyperPod "
           "scripts, --checkpoint_type use_pg_with_util): the sharded checkpoint's format (model, optimizer, "
           "scheduler, the exports; tp{T}-{r} folders at tp > 1), so either type resumes the other's; "
           "SHARDED_STATE_DICT only.", "") for name in ("save_model_checkpoint", "load_model_checkpoint")],
        *[(f"distributed.fsdp.checkpoint.EXPORT_KEY_{key}", _S, "", "")
          for key in ("MODEL", "OPTIMIZER", "SCHEDULER", "IDENTITY")],
        ("distributed.fsdp.fully_sharded_data_parallel.register_tp_processing_pre_comm_hook", _P, "Importable (AWS's "
         "2023 HyperPod script imports it and never calls it); a call raises SMPUnsupportedError: DTensor tensor "
         "parallelism under FSDP2 needs no pre-communication hook.", "Remove the call."),
    ]),
]

_STATE_ROWS: list[_Row] = [
    *[(f"state.{key}", _S, "Writable before tsm.init(); init keeps a written value where the config does not set "
       "the key.", "") for key in ("tensor_parallel_degree", "tp_size", "hybrid_shard_degree")],
    *[(f"state.{key}", _S, "Writable before tsm.init(); the cp degree of the job after it.", "")
      for key in ("context_parallel_degree", "cp_size")],
    *[(f"state.{key}", _S, "Writable before tsm.init(); ep_rank = dp_rank % ep.", "")
      for key in ("expert_parallel_degree", "ep_size")],
    *[(f"state.{key}", _S, "", "") for key in (
        "tp_rank", "cp_rank", "ep_rank", "rank", "world_size", "dp_rank", "dp_size", "tp_process_group",
        "world_process_group", "rep_rank_process_group", "ranker.get_rep_rank", "ranker.get_rep_groups",
        "sm_activation_offloading", "activation_loading_horizon", "random_seed")],
    ("state.get_rng_state_tracker", _S, "Megatron's tracker API (add, fork, get_states, set_states, reset), seeded "
     "random_seed + tp_rank on the CPU and CUDA generators.", ""),
    ("state.reset", _S, "Forgets init and every value written before it, so tsm.init may run again.", ""),
    ("state_handler.state", _S, "The same object as tsm.state.", ""),
    ("state.device_mesh", _S, "An smp_compat addition: the (\"rep\", \"shard\", \"cp\", \"tp\") DeviceMesh.", ""),
]

_CONFIG_NOTES: dict[str, tuple[Status, str, str]] = {
    "sm_activation_offloading": (_P, "Read by the scripts, which then apply torch's offload_wrapper (which works); "
                                 "SMP's own prefetching offload is not implemented.", ""),
    "activation_loading_horizon": (_P, "Accepted; a prefetch depth with no effect here (speed only).", ""),
    "fsdp_cache_flush_warnings": (_P, "Accepted; no allocator-flush warning is printed.", ""),
    "allow_empty_shards": (_S, "FSDP2 shards uneven tensors (empty shards included) either way.", ""),
    "context_parallel_degree": (_S, "Through tsm.transform(model, cp_comm_type=...): " + _CP, ""),
    "expert_parallel_degree": (_P, "Mixtral through transform(config=MoEConfig(...)); must divide the FSDP "
                               "shard group (hybrid_shard_degree >= 2), not with tensor parallelism.", ""),
}


_MODULES = (
    "delayed_param", "grad_norm", "moe", "moe.moe_config", "moe.moe_layer", "tensor_parallel",
    "tensor_parallel.transformer", "nn", "nn.huggingface", "nn.huggingface.llama_flashattn", "nn.attn", "logger",
    "utils", "utils.utils", "utils.process_group_utils", "utils.module_utils", "checkpoint", "checkpoint.utils",
    "distributed", "distributed.checkpoint", "distributed.checkpoint.async_utils",
    "distributed.checkpoint.state_dict_saver", "distributed.checkpoint.state_dict_loader",
    "distributed.checkpoint.filesystem", "distributed.checkpoint.state_dict_utils", "distributed.fsdp",
    "distributed.fsdp.checkpoint", "distributed.fsdp.fully_sharded_data_parallel",
    "distributed.checkpoint.s3_filesystem", "checkpoint.constants", "context_parallel", "context_parallel.utils",
    "state_handler",
)  # fmt: skip
"""torch.sagemaker's module paths (imported as modules by the scripts); a name below one must be registered, as
below ``state`` and ``state.ranker`` (kind "module" too: namespaces, listed in no docs table)."""


def _entries() -> dict[str, Entry]:
    out = {name: Entry(name, "module", _S, "Modules", "A module of torch.sagemaker.") for name in _MODULES}
    out["state"] = Entry("state", "module", _S, "tsm.state", "Importable and writable before tsm.init().")
    out["state.ranker"] = Entry("state.ranker", "module", _S, "tsm.state", "Replication ranks.")
    for section, rows in _ROWS:
        for name, status, note, action, *group in rows:
            out[name] = Entry(name, "api", status, section, note, action, bool(group and group[0]))
    for name, status, note, action in _STATE_ROWS:
        out[name] = Entry(name, "api", status, "tsm.state", note, action)
    return out


API_V2: dict[str, Entry] = _entries()
"""Names below ``torch.sagemaker`` -> entry."""

API_V2_SECTIONS: tuple[str, ...] = (*(section for section, _ in _ROWS), "tsm.state")
"""The docs' sections (module entries are not listed there)."""

def _config_entry(key: str, meaning: str) -> Entry:
    status, note, action = _CONFIG_NOTES.get(key, (_S, "", ""))
    return Entry(key, "config", status, "SMP v2", note, action, meaning=meaning)


CONFIG_V2: dict[str, Entry] = {key: _config_entry(key, field.description or "")
                               for key, field in SMPv2Config.model_fields.items()}  # fmt: skip
"""The nine SMP v2 keys."""


def lookup_api_v2(parts: Sequence[str]) -> tuple[Entry, int] | None:
    """The entry for a dotted name below ``torch.sagemaker`` and how many parts it covers (the longest prefix)."""
    for length in range(len(parts), 0, -1):
        entry = API_V2.get(".".join(parts[:length]))
        if entry is not None and entry.kind == "module" and length < len(parts):
            return None  # an unknown name in a known module
        if entry is not None:
            return entry, length
    return None
