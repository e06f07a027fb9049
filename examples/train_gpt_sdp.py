"""GPT training with SMP's sharded data parallelism, shaped like AWS's 2023 sharded-DP GPT example (train.py).

Tiny config and synthetic tokens so it runs on 2 CPU processes in seconds; the calls are the ones AWS's
script makes: ``smp.model_creation`` + ``AutoModelForCausalLM.from_config``, ``smp.DistributedModel``,
parameter groups split by weight decay built right after wrapping, ``compute_num_params`` via ``p.ds_shape``,
``smp.DistributedOptimizer`` (clipping to ``sdp_gradient_clipping`` inside ``step()``), the LR scheduler on
``optimizer.optimizer``, ``optimizer._global_grad_norm`` logged, partial checkpoints with the scheduler in
``user_content`` and resume, and a full model saved at the end.

    smp-compat run --config examples/configs/sdp2.json examples/train_gpt_sdp.py
    smp-compat run --config examples/configs/tp2_sdp2.json examples/train_gpt_sdp.py   # tp 2 x sdp 2, 4 processes

With ``tensor_parallel_degree`` > 1 the model is created under ``smp.model_creation(tensor_parallelism=True)``,
as AWS's script does, so GPT-2's blocks become ``smp.nn`` layers sharded over tp and then over sdp.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, GPT2Config

try:
    import smdistributed.modelparallel.torch as smp

    SMP_IMPORT = "smdistributed.modelparallel.torch"
except ImportError:  # no SageMaker, no `smp-compat run`: use smp_compat directly
    import smp_compat as smp

    SMP_IMPORT = "smp_compat"

__all__ = ["DEFAULT_CONFIG", "make_config", "make_model", "make_batches", "param_groups", "make_scheduler", "main"]

DEFAULT_CONFIG = {"partitions": 1, "ddp": True, "sharded_data_parallel_degree": 2}
VOCAB, SEQ = 64, 16


def make_config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config())


def make_batches(steps: int, global_batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=g) for _ in range(steps)]


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AWS's get_param_groups_by_weight_decay: no decay for biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        norm = ".ln_" in name or name.startswith("ln_") or "ln_f" in name or "layernorm" in name  # HF or smp.nn names
        (no_decay if name.endswith("bias") or norm else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_scheduler(optimizer: torch.optim.Optimizer, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))


def compute_num_params(model: torch.nn.Module) -> int:
    """As AWS's script: the full shape from ``p.ds_shape`` when the parameter is sharded."""
    total, seen = 0, set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += int(torch.Size(p.ds_shape).numel()) if hasattr(p, "ds_shape") else p.numel()
    return total


@smp.step
def train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=input_ids, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpoint-dir", help="save a partial checkpoint here at --checkpoint-step; resume from it")
    parser.add_argument("--checkpoint-step", type=int, default=3)
    parser.add_argument("--stop-after-checkpoint", action="store_true", help="exit right after the save")
    parser.add_argument("--out", help="rank 0 saves losses, grad norms and the final full model here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if not smp.is_initialized():
        smp.init(DEFAULT_CONFIG if "SM_HP_MP_PARAMETERS" not in os.environ else None)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
        module = make_model()
    model = smp.DistributedModel(module)
    groups = param_groups(model.get_module(), args.weight_decay)  # right after wrapping, as AWS's script
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95)))
    scheduler = make_scheduler(optimizer.optimizer, args.warmup)
    if smp.rank() == 0:
        print(f"# total parameters: {compute_num_params(model)}", flush=True)

    start = 0
    if args.checkpoint_dir and os.path.isfile(os.path.join(args.checkpoint_dir, "newest")):
        content = smp.resume_from_checkpoint(args.checkpoint_dir, tag=None, partial=True)
        scheduler.load_state_dict(content["lr_scheduler"])
        start = content["step"]
    per_rank = args.global_batch // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    losses, norms = [], []
    for step, tokens in enumerate(make_batches(args.steps, args.global_batch)):
        if step < start:
            continue
        optimizer.zero_grad(set_to_none=True)
        out = train_step(model, tokens[lo : lo + per_rank])
        optimizer.step()
        scheduler.step()
        loss = sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
        losses.append(loss)
        norms.append(optimizer._global_grad_norm)
        if smp.rank() == 0:
            print(f"step {step}: loss {loss:.6f} grad norm {optimizer._global_grad_norm:.4f}", flush=True)
        if args.checkpoint_dir and step + 1 == args.checkpoint_step:
            smp.save_checkpoint(args.checkpoint_dir, f"step{step + 1}", partial=True, model=model, optimizer=optimizer,
                                user_content={"lr_scheduler": scheduler.state_dict(), "step": step + 1})  # fmt: skip
            if args.stop_after_checkpoint:
                break
    full = model.state_dict()  # real full tensors on every rank (SMP returned placeholders here)
    if smp.tp_size() > 1:  # smp.nn names -> Hugging Face's, as save_checkpoint(partial=False) writes them
        full = smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2(full)
    if args.out:
        smp.save_checkpoint(os.path.dirname(os.path.abspath(args.out)), "fullmodel.pt", partial=False, model=model)
    if args.out and smp.rank() == 0:
        torch.save({"losses": losses, "norms": norms, "params": full, "smp_import": SMP_IMPORT}, args.out)
    smp.barrier()


if __name__ == "__main__":
    main()
