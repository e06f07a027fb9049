"""An SMP v2 training script in the shape of AWS's v2 examples, small enough for a laptop CPU.

The calls are the ones an SMP v2 script makes on SageMaker: ``dist.init_process_group`` then ``tsm.init()``;
a Llama model built on the meta device, ``tsm.transform`` (tensor parallelism), ``DelayedParamIniter``;
the FSDP1 ``FullyShardedDataParallel(...)`` call with hybrid sharding, ``param_init_fn`` and
``post_param_init_fn``; activation checkpointing on ``TransformerLayer``; ``clip_grad_norm_``; sharded
checkpoints (DCP, one ``tp{T}-{r}`` folder per tensor-parallel rank, written by replica 0 over
``model.process_group`` with a global coordinator rank), resume, and a final full Hugging Face save.

    smp-compat run --nproc-per-node 4 --config examples/configs/v2_tp2_hsd2.json examples/v2/train.py
    smp-compat run --nproc-per-node 4 --config examples/configs/v2_tp2_hsd2.json examples/v2/train.py \\
        --resume_from_checkpoint /tmp/smp_v2_example/checkpoints/llama-4steps

Each rank-0 step prints ``step <n> loss <value>``; ``--losses_out FILE`` also writes them as JSON, and
``--eval_out FILE`` the final model's logits on a fixed batch (to compare with the saved full model).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
import torch.sagemaker.checkpoint.utils as tsm_checkpoint
from torch.distributed import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.api import FullStateDictConfig
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.grad_norm import clip_grad_norm_
from torch.sagemaker.tensor_parallel.transformer import TransformerLayer
from torch.sagemaker.utils.process_group_utils import get_global_ranks
from transformers import LlamaConfig, LlamaForCausalLM

SUBDIR_REGEX = r"^.*\d+steps$"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--train_batch_size", type=int, default=2)
    p.add_argument("--max_context_width", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--distributed_backend", default="gloo", choices=["smddp", "nccl", "gloo"])
    p.add_argument("--checkpoint_dir", default="/tmp/smp_v2_example/checkpoints")
    p.add_argument("--checkpoint_freq", type=int, default=4)
    p.add_argument("--num_kept_checkpoints", type=int, default=2)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--model_dir", default=None, help="where the final full model goes (default: checkpoint_dir/model)")
    p.add_argument("--save_final_model", type=int, default=1)
    p.add_argument("--activation_checkpointing", type=int, default=1)
    p.add_argument("--losses_out", default=None)
    p.add_argument("--eval_out", default=None, help="rank 0 saves the trained model's logits on a fixed batch here")
    args, _ = p.parse_known_args()  # SageMaker also passes --mp_parameters
    return args


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       use_cache=False, tie_word_embeddings=False)  # fmt: skip


def build_model(args: argparse.Namespace, config: LlamaConfig) -> torch.nn.Module:
    """Meta model -> transform -> FSDP (hybrid shard) with delayed initialization -> activation checkpointing."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = tsm.transform(model)
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = FSDP(
            model,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            use_orig_params=True,
            device_id=torch.device("cpu"),
            param_init_fn=initer.get_param_init_fn(),
            post_param_init_fn=initer.get_post_param_init_fn(),
            sync_module_states=False,
        )
    if args.activation_checkpointing:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
            check_fn=lambda m: isinstance(m, TransformerLayer),
        )
    return model


def batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """Synthetic, learnable tokens (counting up from a random start) for this data-parallel rank."""
    g = torch.Generator().manual_seed(args.seed + 1000 * step + tsm.state.dp_rank)
    start = torch.randint(0, 64, (args.train_batch_size, 1), generator=g)
    return (start + torch.arange(args.max_context_width)) % 64


def train_step(args: argparse.Namespace, model: Any, optimizer: Any, step: int) -> float:
    tokens = batch(args, step)
    loss = model(input_ids=tokens, attention_mask=None, labels=tokens)["loss"]
    loss.backward()
    clip_grad_norm_(model, args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def tp_dir(folder: str) -> str:
    """One DCP folder per tensor-parallel rank, as SMP v2's sharded checkpoints are laid out."""
    tp = tsm.state.tensor_parallel_degree
    return os.path.join(folder, f"tp{tp}-{tsm.state.tp_rank}") if tp > 1 else folder


def save_sharded(model: Any, optimizer: Any, folder: str, total_steps: int, pg_meta: tuple[Any, int, bool],
                 num_kept: int) -> None:  # fmt: skip
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer),
                 "total_steps": total_steps}  # fmt: skip
    process_group, coordinator_rank, action_rank = pg_meta
    if action_rank:  # replica 0 writes; the other replicas hold the same shards
        checkpoint.save_state_dict(state_dict=state, storage_writer=checkpoint.FileSystemWriter(tp_dir(folder)),
                                   planner=checkpoint.DefaultSavePlanner(), process_group=process_group,
                                   coordinator_rank=coordinator_rank)  # fmt: skip
    dist.barrier()
    tsm_checkpoint.limit_num_subdirs(os.path.abspath(folder), num_kept, regex=SUBDIR_REGEX,
                                     log=dist.get_rank() == 0)  # fmt: skip
    dist.barrier()


def load_sharded(model: Any, optimizer: Any, folder: str, pg_meta: tuple[Any, int, bool]) -> int:
    process_group, coordinator_rank, _ = pg_meta
    path = tp_dir(folder)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "total_steps": 0}
        checkpoint.load_state_dict(state_dict=state, storage_reader=checkpoint.FileSystemReader(path),
                                   process_group=process_group, coordinator_rank=coordinator_rank,
                                   planner=checkpoint.DefaultLoadPlanner())  # fmt: skip
        model.load_state_dict(state["model"])
        optim_state = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optimizer",
                                                        storage_reader=checkpoint.FileSystemReader(path),
                                                        process_group=model.process_group)  # fmt: skip
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model=model, optim=optimizer,
                                                                optim_state_dict=optim_state["optimizer"]))  # fmt: skip
    return int(state["total_steps"])


def save_full(model: Any, config: LlamaConfig, folder: str) -> None:
    """A Hugging Face folder: ``pytorch_model.bin`` + ``config.json``, written by rank 0."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):  # fmt: skip
        state = model.state_dict()
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save(state, os.path.join(folder, "pytorch_model.bin"))
            config.save_pretrained(folder)
    dist.barrier()


def main() -> None:
    args = parse_args()
    dist.init_process_group(args.distributed_backend)
    tsm.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    config = model_config()
    model = build_model(args, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    pg_meta = (model.process_group, min(get_global_ranks(model.process_group)),
               tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0)  # fmt: skip
    total_steps = 0
    if args.resume_from_checkpoint:
        total_steps = load_sharded(model, optimizer, args.resume_from_checkpoint, pg_meta)
    losses = {}
    while total_steps < args.max_steps:
        loss = train_step(args, model, optimizer, total_steps)
        total_steps += 1
        losses[total_steps] = loss
        if dist.get_rank() == 0:
            print(f"step {total_steps} loss {loss:.6f}", flush=True)
        if total_steps % args.checkpoint_freq == 0:
            save_sharded(model, optimizer, os.path.join(args.checkpoint_dir, f"llama-{total_steps}steps"),
                         total_steps, pg_meta, args.num_kept_checkpoints)  # fmt: skip
    if args.eval_out:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=batch(args, 10_000))["logits"]
        if dist.get_rank() == 0:
            torch.save({"input_ids": batch(args, 10_000), "logits": logits}, args.eval_out)
    if args.save_final_model:
        save_full(model, config, args.model_dir or os.path.join(args.checkpoint_dir, "model"))
    if args.losses_out and dist.get_rank() == 0:
        with open(args.losses_out, "w", encoding="utf-8") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
