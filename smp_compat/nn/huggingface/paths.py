"""SMP's module paths on every swapped Hugging Face model, beside Hugging Face's own.

SMP v1's distributed transformer replaced a Hugging Face model by its own, whose body was always
``transformer`` with the layers in ``transformer.seq_layers`` (each with children ``attention`` and
``output``), whatever the model type; AWS's scripts walk ``model.get_module().transformer.seq_layers`` to
place layers (``smp.set_partition``) and to checkpoint activations. smp_compat swaps only the body and keeps
Hugging Face's outer model, so GPT-2, GPT-Neo and GPT-J already answer to ``transformer``; GPT-NeoX's body is
``gpt_neox`` and BERT's swapped part is ``bert.encoder``. After the swap:

- each module above exactly one swapped body that has no ``transformer`` of its own reaches it as
  ``.transformer`` (an ``encoder`` for BERT / RoBERTa, whose ``seq_layers`` it holds);
- a swapped body also answers to Hugging Face's name for its layer list (``h``, ``layers``, ``layer``), the
  path the same scripts take when the distributed transformer is off but tensor parallelism swapped anyway.

Both are plain references, never registered submodules: ``state_dict()``, ``named_parameters()``,
``modules()``, checkpoints and parameter counts see each module once, under its real name, and what a
script does through an alias (``set_partition``, ``set_activation_checkpointing``, which go by identity)
acts on the real module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["add_smp_paths", "SMP_BODY"]

SMP_BODY = "transformer"
"""The name SMP's LM-head model gave its body."""


def _hf_layer_lists() -> dict[type, str]:
    """Swapped body class -> Hugging Face's name for its layer list."""
    from smp_compat.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox

    return {
        gpt2.DistributedGPT2Model: "h", gptneo.DistributedGPTNeoModel: "h", gptj.DistributedGPTJModel: "h",
        gptneox.DistributedGPTNeoXModel: "layers", bert.DistributedBertEncoder: "layer",
    }  # fmt: skip


def _alias(owner: nn.Module, name: str, target: nn.Module) -> None:
    """``owner.<name>`` is ``target``, in the instance's dict, so nn.Module never registers it."""
    object.__setattr__(owner, name, target)


def _has(module: nn.Module, name: str) -> bool:
    return name in module._modules or name in module.__dict__ or hasattr(type(module), name)


def add_smp_paths(root: nn.Module) -> None:
    """The aliases of the module doc, for every swapped Hugging Face body under ``root``."""
    lists = _hf_layer_lists()
    bodies: list[tuple[str, Any]] = [(n, m) for n, m in root.named_modules() if type(m) in lists]
    for _, body in bodies:
        if not _has(body, lists[type(body)]):
            _alias(body, lists[type(body)], body.seq_layers)
    for path, body in bodies:
        owner, prefix = root, ""
        for part in path.split(".") if path else []:
            under = [n for n, _ in bodies if n.startswith(prefix)]
            if len(under) == 1 and not _has(owner, SMP_BODY):
                _alias(owner, SMP_BODY, body)
            owner, prefix = getattr(owner, part), f"{prefix}{part}."
