"""``smp-compat checkpoint``: inspect, merge and split SMP / smp_compat checkpoints (no job, no SMP needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from smp_compat.checkpoints import convert, cutting, folders, state_dicts, tp_reshard
from smp_compat.errors import CheckpointError
from smp_compat.checkpoints.serialization import atomic_save

__all__ = ["checkpoint_command"]

_TRANSLATIONS = {
    "hf-gpt2": "gpt2.translate_state_dict_to_hf_gpt2",
    "hf-gptneo": "gptneo.translate_state_dict_to_hf_gptneo",
    "hf-bert": "bert.translate_state_dict_to_hf_bert",
    "hf-gptj": "gptj.translate_state_dict_to_hf_gptj",
    "hf-gptneox": "gptneox.translate_state_dict_to_hf_gptneox",
}
"""``merge --translate``: SMP's translate functions of the swapped Hugging Face models, by module."""

_EPILOG = """\
examples:
  smp-compat checkpoint info ckpts/
  smp-compat checkpoint merge ckpts/ -o model.pt                 # newest partial checkpoint -> one state dict
  smp-compat checkpoint merge ckpts/ --tag step100 -o model.pt --optimizer-output optim.pt
  smp-compat checkpoint merge /smp/checkpoint.pt -o model.pt      # smp.save parts checkpoint.pt_0, _1 ...
  smp-compat checkpoint merge tp2_ckpts/ -o hf.pt --translate hf-gpt2   # tp (x pp) shards joined, stock HF names
  smp-compat checkpoint split model.pt --pp 2 -o ckpts/ --tag imported [--plan ckpts/step100_partial]
  smp-compat checkpoint split tp2_ckpts/ --tp 4 -o tp4_ckpts/ --tag resharded   # re-cut model + optimizer
  smp-compat checkpoint split model.pt --tp 2 --like tp1_ckpts/ --optimizer optim.pt -o ckpts/

tensor parallelism: partial checkpoints saved by smp_compat record which entries are tp shards (and the
dim they are cut along), so merge joins them and split re-cuts them for any tp degree that divides the
model's sizes. The optimizer state follows (tensors of a shard's shape are joined/cut like it; scalars
such as Adam's step are shared). Splitting a checkpoint directly also re-cuts its fp16/bf16 fp32 masters
(fp16_states files); splitting merged files does not (the masters are then made from the 16-bit weights
at resume). SMP's own tp parts lack the record: they merge at tp = 1 only. Details: docs/checkpoints.md.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smp-compat checkpoint",
        description="Convert between partial (per-rank) checkpoints of SMP v1 or smp_compat and plain PyTorch "
        "state-dict files. Files load with weights_only=True unless --unsafe is given.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    info = sub.add_parser("info", help="describe a checkpoint: layout, parts, tags, saved config")
    _source_options(info)
    merge = sub.add_parser("merge", help="merge a partial checkpoint into one plain PyTorch state-dict file")
    _source_options(merge)
    merge.add_argument("-o", "--output", required=True, help="file to write the merged model state dict to")
    merge.add_argument("--optimizer-output", help="also merge the optimizer parts into this file")
    merge.add_argument("--key", help="entry of each part that holds the model dict (default: found)")
    merge.add_argument("--optimizer-key", help="entry of each part that holds the optimizer dict (default: found)")
    merge.add_argument("--strip-prefix", default="auto",
                       help="'auto' drops a module. wrapper prefix on every key, 'none' keeps keys, else this prefix")
    merge.add_argument("--translate", choices=sorted(_TRANSLATIONS),
                       help="write the merged dict of a swapped Hugging Face model under stock HF names")
    merge.add_argument("--max-seq-len", type=int, help="with --translate: add HF's causal-mask buffers of this size")
    merge.add_argument("--num-attention-heads", type=int,
                       help="with --translate hf-gptneox: the model's head count (its q|k|v rows are per head)")
    split = sub.add_parser("split", help="split a state dict (or re-cut a partial checkpoint) for --pp x --tp ranks")
    split.add_argument("source", help="a plain PyTorch state-dict file (or one holding it under --key), or a partial "
                       "checkpoint (folder, save_checkpoint directory with --source-tag, smp.save base) to re-cut")
    split.add_argument("-o", "--output", required=True,
                       help="checkpoint directory (the smp.save base path with --layout save)")
    split.add_argument("--pp", type=int, default=1, help="pipeline_parallel_degree of the job that will load it")
    split.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree of the job that will load it")
    split.add_argument("--like", help="a partial checkpoint of this model saved by smp_compat (any degrees): where "
                       "--tp > 1 learns which entries are shards, when the source is a plain file")
    split.add_argument("--optimizer", help="a merged optimizer file (merge --optimizer-output) to split as well")
    split.add_argument("--source-tag", help="tag inside a save_checkpoint directory given as source (default: newest)")
    split.add_argument("--plan", help="partition plan: JSON, or a checkpoint (folder) saved by that job")
    split.add_argument("--tag", default="converted", help="tag of the checkpoint folder (default: converted)")
    split.add_argument("--layout", choices=("checkpoint", "save"), default="checkpoint",
                       help="checkpoint: <output>/<tag>_partial/ for resume_from_checkpoint; save: smp.save parts")
    split.add_argument("--key", help="entry of the file that holds the model dict (default: found)")
    split.add_argument("--unsafe", action="store_true", help="unpickle arbitrary objects (trusted files only)")
    return parser


def _source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="partial checkpoint folder, save_checkpoint directory, or smp.save base path")
    parser.add_argument("--tag", help="checkpoint tag inside a save_checkpoint directory (default: newest)")
    parser.add_argument("--unsafe", action="store_true", help="unpickle arbitrary objects (trusted files only)")


def _translate(sd: dict, ns: argparse.Namespace) -> dict:
    """SMP's translate function for the swapped model (imported only when asked: it needs torch.nn modules)."""
    import importlib

    extra = {}
    if ns.translate == "hf-gptneox":  # offline, no swapped model to take the head count from
        if ns.num_attention_heads is None:
            raise CheckpointError("--translate hf-gptneox needs --num-attention-heads (the fused query_key_value "
                                  "rows are laid out per head)")  # fmt: skip
        extra["num_attention_heads"] = ns.num_attention_heads
    module, function = _TRANSLATIONS[ns.translate].split(".")
    translate = getattr(importlib.import_module(f"smp_compat.nn.huggingface.{module}"), function)
    return translate(sd, max_seq_len=ns.max_seq_len, **extra)


def checkpoint_command(argv: list[str]) -> int:
    """Entry of ``smp-compat checkpoint``; errors are CheckpointError (the caller prints them)."""
    ns = _parser().parse_args(argv)
    return {"info": _info, "merge": _merge, "split": _split}[ns.action](ns)


def _info_sharded(ns: argparse.Namespace, folder: Path) -> int:
    shards = sorted(p.name for p in folder.iterdir() if p.name.endswith(".distcp"))
    print("layout: sharded data parallelism (torch DCP)")
    print(f"folder: {folder}")
    print(f"rank files: {len(shards)} ({', '.join(shards)})")
    config = folder / folders.CONFIG_FILE
    if config.is_file():
        saved = convert.load_file(config, ns.unsafe)
        if isinstance(saved, dict):
            print(f"saved by: {saved.get('smp_version', '?')}")
            keys = ("sharded_data_parallel_degree", "tensor_parallel_degree", "dp_size", "world_size")
            print(f"degrees: {({k: saved.get(k) for k in keys if k in saved})} (resumes at any sharded degree, "
                  "the same tensor-parallel degree)")
    newest = folders.read_newest(folder.parent)
    if newest:
        print(f"newest (oldest first): {', '.join(newest)}")
    return 0


def _info(ns: argparse.Namespace) -> int:
    sharded = _sharded_folder(ns.source, ns.tag)
    if sharded is not None:
        return _info_sharded(ns, sharded)
    layout = convert.detect_layout(ns.source, ns.tag)
    print(f"layout: {layout.naming}")
    if layout.folder is not None:
        print(f"folder: {layout.folder}")
    print(f"pipeline parts: {layout.pp_size}")
    if layout.tp_size > 1 or layout.model_parts:
        print(f"tensor-parallel parts: {layout.tp_size}{_shard_record(layout, ns.unsafe)}")
    for part in layout.model_parts:
        print(f"  model     pp={part.pp_rank} tp={part.tp_rank}{_rdp(part)}  {part.path.name}")
    for part in layout.optimizer_parts:
        print(f"  optimizer pp={part.pp_rank} tp={part.tp_rank}{_rdp(part)}  {part.path.name}")
    config = layout.folder / "smp_config.pt" if layout.folder is not None else None
    if config is not None and config.is_file():
        saved = convert.load_file(config, ns.unsafe)
        if isinstance(saved, dict):
            print(f"saved by: {saved.get('smp_version', '?')}")
            degrees = {k: saved.get(k) for k in ("pipeline_parallel_degree", "tensor_parallel_degree") if k in saved}
            print(f"degrees: {degrees}")
    if layout.folder is not None:
        newest = folders.read_newest(layout.folder.parent)
        if newest:
            print(f"newest (oldest first): {', '.join(newest)}")
    return 0


def _shard_record(layout: convert.Layout, unsafe: bool) -> str:
    """Whether the parts say which entries are tp shards (needed to merge tp > 1 or split for another tp)."""
    first = layout.model_parts[0].path
    try:
        table = tp_reshard.shard_table(convert.model_dict_of(convert.load_file(first, unsafe), None, first), 1, "")
    except CheckpointError:
        return ""
    if table is None:
        return " (no shard record: " + ("cannot be merged)" if layout.tp_size > 1 else "cannot be re-cut for tp > 1)")
    return f" (shard record: {len(table)} tensor-parallel entries)"


def _rdp(part: convert.PartFile) -> str:
    return f" rdp={part.rdp_rank}" if part.rdp_rank is not None else ""


def _sharded_folder(source: str, tag: str | None) -> Path | None:
    """The DCP folder of a sharded-data-parallel checkpoint named by source/tag, if that is what it is."""
    from smp_compat.sdp.checkpoint import is_sharded_checkpoint

    root = Path(source)
    if root.is_dir() and is_sharded_checkpoint(root):
        return root
    if root.is_dir() and (tag is not None or (root / folders.NEWEST_FILE).is_file()):
        try:
            folder = folders.checkpoint_folder(root, tag)
        except CheckpointError:
            return None
        return folder if is_sharded_checkpoint(folder) else None
    return None


def _merge_sharded(ns: argparse.Namespace, folder: Path) -> int:
    from smp_compat.sdp.checkpoint import merge_sharded

    model_sd, optimizer_sd = merge_sharded(folder)
    if ns.translate:
        model_sd = _translate(model_sd, ns)
    atomic_save(model_sd, ns.output)
    print(f"wrote {ns.output}: {len(model_sd)} tensors from sharded checkpoint {folder} (DCP)")
    if ns.optimizer_output:
        if optimizer_sd is None:
            raise CheckpointError(f"{folder} holds no optimizer state (it was saved without optimizer=...).")
        atomic_save(optimizer_sd, ns.optimizer_output)
        print(f"wrote {ns.optimizer_output}: optimizer state of {len(optimizer_sd['state'])} parameter(s), keyed by name")
    return 0


def _merge(ns: argparse.Namespace) -> int:
    sharded = _sharded_folder(ns.source, ns.tag)
    if sharded is not None:
        return _merge_sharded(ns, sharded)
    layout = convert.detect_layout(ns.source, ns.tag)
    merged = convert.merge_model(layout, ns.key, ns.strip_prefix, ns.unsafe)
    if ns.translate:
        merged = _translate(merged, ns)
    atomic_save(merged, ns.output)
    tensors = sum(1 for v in merged.values() if isinstance(v, torch.Tensor))
    shards = f" x {layout.tp_size} tensor-parallel part(s)" if layout.tp_size > 1 else ""
    print(f"wrote {ns.output}: {tensors} tensors from {layout.pp_size} pipeline part(s){shards} ({layout.naming})"
          + (f", {ns.translate} names" if ns.translate else ""))  # fmt: skip
    if ns.optimizer_output:
        optimizer = convert.merge_optimizer(layout, ns.optimizer_key, ns.unsafe)
        atomic_save(optimizer, ns.optimizer_output)
        print(f"wrote {ns.optimizer_output}: optimizer state of {len(optimizer['state'])} parameter(s)")
    return 0


def _split_source(ns: argparse.Namespace) -> tuple[dict, dict | None, dict | None, dict | None, Path | None]:
    """The whole model dict, its shard record, the optimizer dict, the fp16 masters (or None) to split, and the
    source checkpoint's user_content file (None for a single file)."""
    from smp_compat.checkpoints.fp16_reshard import merge_fp16_states

    source = Path(ns.source)
    optimizer = fp16 = user_content = None
    if source.is_file():
        sd = convert.model_dict_of(convert.load_file(source, ns.unsafe), ns.key, source)
        table = None
    else:  # a partial checkpoint: merge it here (with its optimizer parts), keeping its shard record
        layout = convert.detect_layout(source, ns.source_tag)
        sd, table = convert.merge_model_with_shards(layout, ns.key, "none", ns.unsafe)
        if layout.optimizer_parts and not ns.optimizer:
            optimizer = convert.merge_optimizer(layout, None, ns.unsafe)
        fp16 = merge_fp16_states(layout.folder, table, ns.unsafe)
        user_content = layout.folder / folders.USER_CONTENT_FILE if layout.folder is not None else None
    if ns.like:
        like = convert.detect_layout(ns.like)
        table = convert.merge_model_with_shards(like, None, "none", ns.unsafe)[1] if table is None else table
    if ns.optimizer:
        path = Path(ns.optimizer)
        optimizer = dict(convert.optimizer_dict_of(convert.load_file(path, ns.unsafe), None, path))
    return sd, table, optimizer, fp16, user_content  # no record and --tp > 1: split_grid explains what to pass


def _split(ns: argparse.Namespace) -> int:
    from smp_compat.checkpoints.fp16_reshard import split_fp16_states

    sd, table, optimizer, fp16, user_content = _split_source(ns)
    plan = cutting.read_plan(ns.plan) if ns.plan else None
    parts = cutting.split_model(sd, ns.pp, plan)
    owners = cutting.module_owners(state_dicts.strip_markers(sd), ns.pp, plan)
    grid, optimizer_grid = tp_reshard.split_grid(parts, ns.tp, table, optimizer, owners)
    fp16_grid = split_fp16_states(fp16, ns.pp, ns.tp, table, owners) if fp16 is not None else None
    if ns.layout == "save":
        if optimizer_grid or fp16_grid:
            print("note: --layout save writes the model parts only; the optimizer state is not split")
        paths = cutting.write_save_parts(grid, ns.output)
        print(f"wrote {len(paths)} smp.save part(s): {', '.join(str(p) for p in paths)} (smp.load({ns.output!r}))")
        return 0
    folder = cutting.write_checkpoint_parts(grid, ns.output, ns.tag, plan, optimizer_grid, fp16_grid, user_content)
    with_optimizer = "model and optimizer" if optimizer_grid else "model only"
    with_optimizer += ", fp32 masters" if fp16_grid else ""
    print(f"wrote {folder} ({with_optimizer}) for pipeline_parallel_degree={ns.pp}, tensor_parallel_degree={ns.tp}: "
          f"resume with smp.resume_from_checkpoint({ns.output!r}, tag={ns.tag!r}"
          + ("" if optimizer_grid else ", load_optimizer=False") + ")")  # fmt: skip
    return 0
