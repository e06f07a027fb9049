"""The GPU-only packages' stand-ins: served where absent (announced once), a real install wins, and each does
what the scripts need (smddp/nccl backends, fp8_autocast, TE's checkpoint with the RNG tracker, flash -> sdpa)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import smp_compat
from smp_compat.errors import SMPUnsupportedError
from smp_compat.shim import SITE_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(smp_compat.__file__)))


def _launched_python(code: str, extra_path: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with the PYTHONPATH ``smp-compat run`` gives its workers (the shim's site folder first)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SITE_DIR, *(extra_path or []), ROOT])}
    env.pop("SM_HP_MP_PARAMETERS", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_launched_process_imports_every_standin_once_announced(tmp_path) -> None:
    other = tmp_path / "other_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    done = _launched_python(
        """
        import os, sys
        print("torch" in sys.modules, os.environ.get("OTHER_SITECUSTOMIZE_RAN"))
        import torch.sagemaker as tsm
        import transformer_engine
        from transformer_engine.common.recipe import DelayedScaling, Format
        from transformer_engine.pytorch.attention import MultiheadAttention
        from megatron.core.dist_checkpointing.mapping import CheckpointingException
        import smdistributed.dataparallel.torch.torch_smddp
        import transformer_engine.pytorch
        for _ in range(2):
            with transformer_engine.pytorch.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(Format.HYBRID)):
                pass
        import torch.distributed as dist
        dist.init_process_group("smddp", store=dist.HashStore(), rank=0, world_size=1)
        print(transformer_engine.pytorch is sys.modules["smp_compat.v2.standins.transformer_engine.pytorch"],
              dist.get_backend())
        """,
        [str(other)],
    )
    printed = [line for line in done.stdout.splitlines() if not line.startswith("[Gloo] ")]  # torch 2.9, 2.10
    assert " ".join(printed).split() == ["False", "1", "True", "gloo"]
    lines = [line for line in done.stderr.splitlines() if line.startswith("smp_compat: ")]
    real_megatron = _installed("megatron-core")  # installed: it wins, no announcement
    # transformer_engine, megatron (unless installed), fp8 (once for two blocks), smddp
    assert len(lines) == 4 - real_megatron, done.stderr
    assert any('backend "smddp"' in line and '"gloo"' in line for line in lines)


def test_a_real_transformer_engine_wins(tmp_path) -> None:
    real = tmp_path / "real" / "transformer_engine"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    done = _launched_python("import transformer_engine; print(transformer_engine.REAL)", [str(tmp_path / "real")])
    assert done.stdout.strip() == "True"


def test_backend_names_this_machine_cannot_build_are_mapped() -> None:
    from smp_compat.v2.standins.backend import mapped_backend

    if torch.cuda.is_available():
        pytest.skip("CPU-only mapping")
    assert mapped_backend("smddp") == "gloo"
    assert mapped_backend("nccl") == "gloo"
    assert mapped_backend("gloo") == "gloo"
    assert mapped_backend(None) is None


def test_te_multihead_attention_is_refused_by_name() -> None:
    from smp_compat.v2.standins.transformer_engine.pytorch.attention import MultiheadAttention

    with pytest.raises(SMPUnsupportedError, match="MultiheadAttention needs the real Transformer Engine"):
        MultiheadAttention(32, 4)


def test_te_checkpoint_replays_the_tracker_streams_for_recomputation() -> None:
    from smp_compat.v2.rng import RNGStatesTracker
    from smp_compat.v2.standins.transformer_engine.pytorch import checkpoint

    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    weight = torch.randn(16, 16)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(x @ weight, p=0.5).tanh()

    start = tracker.get_states()
    plain = torch.ones(4, 16, requires_grad=True)
    block(plain).sum().backward()
    tracker.set_states(start)
    x = torch.ones(4, 16, requires_grad=True)
    out = checkpoint(block, x, get_rng_state_tracker=lambda: tracker, tp_group=None,
                     distribute_saved_activations=False, use_reentrant=False)  # fmt: skip
    tracker.add("moves-on", 99)  # other streams may change between forward and backward
    with tracker.fork():
        torch.rand(3)  # the forward's stream advances before the recomputation
    out.sum().backward()
    assert torch.equal(x.grad, plain.grad)
    assert (out == 0).any()  # dropout did drop something (tanh(0) = 0)


@pytest.mark.hf
def test_flash_attention_2_without_flash_attn_builds_sdpa() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
    from transformers.utils import is_flash_attn_2_available

    from smp_compat.v2.standins.attention import install_sdpa_fallback

    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed: nothing to fall back from")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    if not getattr(PreTrainedModel._from_config.__func__, "_smp_compat_sdpa_fallback", False):
        with pytest.raises(ImportError):  # what AWS's create_model meets without the fallback
            AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2")
    assert install_sdpa_fallback()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2")
    assert model.config._attn_implementation == "sdpa"


class _Block(torch.nn.Module):
    """A layer called as Hugging Face calls its decoder layers: hidden states positional, the rest by keyword."""

    def __init__(self, tracker: object) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, hidden: torch.Tensor, *, bias: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        with self.tracker.fork():  # type: ignore[attr-defined]
            dropped = torch.nn.functional.dropout(self.linear(hidden), p=0.5)
        return (dropped * scale + bias).tanh()


def test_te_checkpoint_as_the_hyperpod_scripts_call_it() -> None:
    """17.SM-modelparallelv2's apply_activation_checkpoint: TE 1.2's ``get_cuda_rng_tracker=`` keyword, no
    ``use_reentrant``, through checkpoint_wrapper with keyword arguments. Gradients (a keyword tensor's
    included) equal the unwrapped layer's; before, ``ValueError: Unexpected keyword arguments``."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from smp_compat.v2.rng import RNGStatesTracker
    from smp_compat.v2.standins.transformer_engine import pytorch as te

    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 77)
    torch.manual_seed(0)
    block = _Block(tracker)
    hidden = torch.randn(4, 8)
    bias = torch.randn(4, 8)

    start = tracker.get_states()
    plain_x, plain_b = hidden.clone().requires_grad_(), bias.clone().requires_grad_()
    block(plain_x, bias=plain_b, scale=2.0).sum().backward()
    plain_w = block.linear.weight.grad.clone()
    block.zero_grad()

    tracker.set_states(start)
    checkpoint_fn = functools.partial(te.checkpoint, distribute_saved_activations=False,
                                      get_cuda_rng_tracker=lambda: tracker, tp_group=None)  # fmt: skip
    wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=checkpoint_fn)
    x, b = hidden.clone().requires_grad_(), bias.clone().requires_grad_()
    out = wrapped(x, bias=b, scale=2.0)
    with tracker.fork():
        torch.rand(5)  # the stream moves on before the recomputation
    out.sum().backward()
    assert torch.equal(x.grad, plain_x.grad)
    assert torch.equal(b.grad, plain_b.grad)
    assert torch.equal(block.linear.weight.grad, plain_w)


def test_te_checkpoint_refuses_both_tracker_names() -> None:
    from smp_compat.v2.standins.transformer_engine import pytorch as te

    with pytest.raises(TypeError, match="get_cuda_rng_tracker"):
        te.checkpoint(torch.tanh, torch.ones(2), get_rng_state_tracker=object, get_cuda_rng_tracker=object)
