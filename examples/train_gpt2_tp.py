"""A tensor-parallel Hugging Face GPT-2 script in the shape of AWS's SMP v1 GPT-2 example (tiny, synthetic data).

It imports ``smdistributed.modelparallel.torch`` and runs unchanged under ``smp-compat run``; with plain
``python`` it falls back to ``import smp_compat as smp``. tp = 2 on 2 CPU processes, a few seconds:

    smp-compat run --config examples/configs/tp2.json examples/train_gpt2_tp.py

and pipeline x tensor parallelism (pp = 2 x tp = 2, auto partition) on 4:

    smp-compat run --config examples/configs/pp2_tp2.json examples/train_gpt2_tp.py
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

try:
    import smdistributed.modelparallel.torch as smp

    SMP_IMPORT = "smdistributed.modelparallel.torch"
except ImportError:  # no SageMaker, no `smp-compat run`: use smp_compat directly
    import smp_compat as smp

    SMP_IMPORT = "smp_compat"

__all__ = ["make_config", "make_batches", "main"]

VOCAB, SEQ = 64, 16


def make_config() -> GPT2Config:
    """A tiny GPT-2 without dropout, so a run equals plain PyTorch on the global batch."""
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip


def make_batches(steps: int, global_batch: int, seed: int = 1) -> list[torch.Tensor]:
    """Synthetic token ids: the same global batches on every rank; each rank then takes its part."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=g) for _ in range(steps)]


@smp.step
def train_step(model: smp.DistributedModel, input_ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=input_ids, labels=input_ids).loss  # Hugging Face's own loss
    model.backward(loss)
    return loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="rank 0 saves losses and the final model as a stock HF state dict here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if not smp.is_initialized():
        smp.init() if "SM_HP_MP_PARAMETERS" in os.environ else smp.init({"tensor_parallel_degree": 1, "ddp": True})
    torch.manual_seed(args.seed)
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float32):  # swapped at tp = 1 too, as in SMP
        model = GPT2LMHeadModel(make_config())
    model = smp.DistributedModel(model)
    transformer_layers = model.get_module().transformer.seq_layers  # what AWS's script partitions/checkpoints
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0))

    # AWS's scripts: shard data over dp ranks, or over rdp ranks when the tp group shares one batch.
    prescaled = smp.state.cfg.prescaled_batch
    dp_rank = smp.rdp_rank() if prescaled else smp.dp_rank()
    dp_size = smp.rdp_size() if prescaled else smp.dp_size()
    per_rank = args.global_batch // dp_size
    losses = []
    for step, ids in enumerate(make_batches(args.steps, args.global_batch)):
        optimizer.zero_grad()
        out = train_step(model, ids[dp_rank * per_rank : (dp_rank + 1) * per_rank])
        optimizer.step()
        loss = sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
        losses.append(loss)
        if smp.rank() == 0:
            print(f"step {step}: loss {loss:.6f} ({len(transformer_layers)} layers, pp {smp.pp_size()}, "
                  f"tp {smp.tp_size()})", flush=True)  # fmt: skip

    full = model.state_dict()  # collective over the tp group (then the pipeline stages): whole tensors on pp_rank 0
    if args.out and smp.rank() == 0:
        hf = smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2(full)
        torch.save({"losses": losses, "hf_state_dict": hf, "smp_import": SMP_IMPORT, "tp_size": smp.tp_size(),
                    "pp_size": smp.pp_size()}, args.out)  # fmt: skip
    smp.barrier()


if __name__ == "__main__":
    main()
