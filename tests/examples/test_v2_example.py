"""End to end: examples/v2/train.py (an SMP v2 script) at tp 2 x hybrid shard 2 on 4 CPU processes.

Losses fall, a sharded checkpoint resumed in a new job gives the same losses bit for bit, and the final
full save is a Hugging Face folder stock ``from_pretrained`` loads, giving the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launching import ROOT, clean_env, free_port, run_all, smp_compat_command

pytestmark = pytest.mark.hf

EXAMPLE = ROOT / "examples" / "v2" / "train.py"
CONFIG = ROOT / "examples" / "configs" / "v2_tp2_hsd2.json"


def _job(tmp_path: Path, name: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The README's command: ``smp-compat run --nproc-per-node 4 --config <v2 distribution> examples/v2/train.py``."""
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           "--config", str(CONFIG), str(EXAMPLE), "--max_steps", "4", "--checkpoint_freq", "2",
           "--losses_out", str(tmp_path / f"{name}.json"), *args]  # fmt: skip
    return cmd, clean_env(PYTHONPATH=str(ROOT))


@pytest.mark.slow
def test_v2_example_trains_resumes_bitwise_and_saves_a_hugging_face_model(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    first = tmp_path / "ckpt"
    run_all([_job(tmp_path, "first", "--checkpoint_dir", str(first), "--eval_out", str(tmp_path / "eval.pt"))],
            tmp_path)  # fmt: skip
    losses = json.loads((tmp_path / "first.json").read_text())
    assert losses["4"] < losses["1"] - 0.1, losses
    assert sorted(p.name for p in first.iterdir()) == ["llama-2steps", "llama-4steps", "model"]
    assert sorted(p.name for p in (first / "llama-2steps").iterdir()) == ["tp2-0", "tp2-1"]

    run_all([_job(tmp_path, "resumed", "--checkpoint_dir", str(tmp_path / "ckpt2"), "--save_final_model", "0",
                  "--resume_from_checkpoint", str(first / "llama-2steps"))], tmp_path)  # fmt: skip
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed == {"3": losses["3"], "4": losses["4"]}

    evaluated = torch.load(tmp_path / "eval.pt")
    model = LlamaForCausalLM.from_pretrained(first / "model").eval()
    with torch.no_grad():
        logits = model(input_ids=evaluated["input_ids"]).logits
    torch.testing.assert_close(logits, evaluated["logits"], atol=1e-5, rtol=1e-5)
