"""One rank of the selftest: take the user's config aside, make the job's process group through ``smp.init``,
report the environment, run the battery."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch.distributed as dist

from smp_compat.config import ENV_VAR, extract_mp_parameters, parse_json
from smp_compat.selftest.checks import Context, select
from smp_compat.selftest.environment import collect
from smp_compat.selftest.faults import read_faults

__all__ = ["add_options", "main"]

DEFAULT_TIMEOUTS = {"SMP_PIPELINE_TIMEOUT_S": "30", "SMP_PG_TIMEOUT_S": "60"}
"""A check's steps take milliseconds: a pipeline wait or a collective this long means a lost message or rank."""
_LAUNCH_KEYS = ("ddp_dist_backend", "ddp_port")


def add_options(parser: argparse.ArgumentParser) -> None:
    """The selftest's own options (``smp-compat selftest`` passes them on to every rank)."""
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH (on rank 0's host)")
    parser.add_argument("--checks", metavar="NAME,...", help="run only these (comma-separated; --list shows them)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="where the checkpoint check saves (every host must see it; default: the temporary "
                        "directory on one host, the current directory on several)")  # fmt: skip
    parser.add_argument("--check-timeout", metavar="SECONDS", type=float, default=120.0,
                        help="a check whose ranks have not all reported by then fails (default 120)")  # fmt: skip


def _user_config() -> dict[str, Any] | None:
    """The user's config (``--config`` arrives as SM_HP_MP_PARAMETERS), taken out of the environment: there it
    would override every check's own config, key by key."""
    text = os.environ.pop(ENV_VAR, "")
    if not text.strip():
        return None
    return extract_mp_parameters(parse_json(text, ENV_VAR))


def _checkpoint_root(option: str | None, hosts: int) -> str:
    if option:
        return os.path.abspath(option)
    return tempfile.gettempdir() if hosts == 1 else os.getcwd()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m smp_compat.selftest", allow_abbrev=False,
                                     description="One rank of `smp-compat selftest`.")  # fmt: skip
    add_options(parser)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    user = _user_config()
    for name, value in DEFAULT_TIMEOUTS.items():
        os.environ.setdefault(name, value)
    faults = read_faults()
    names = [n.strip() for n in ns.checks.split(",") if n.strip()] if ns.checks else None
    checks = select(names, user is not None)

    import smp_compat as smp
    from smp_compat.globalstate import release_process_group

    smp.init({"ddp": True, **{k: user[k] for k in _LAUNCH_KEYS if user and k in user}})
    env = collect(smp)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(smp.local_size()))  # later inits see the group, not the launcher
    release_process_group()
    smp.reset()
    ctx = Context(smp, env, faults, user, _checkpoint_root(ns.checkpoint_dir, len(env.hosts)), [])
    _warm_up(ctx)
    from smp_compat.selftest.runner import run_battery

    code = run_battery(ctx, checks, ns.json, ns.check_timeout)
    _finish(ctx)
    return code


def _warm_up(ctx: Context) -> None:
    """One step of plain training first: the first optimizer step and backward pass load code (torch._dynamo
    among it) for seconds, which would otherwise count as the first check's time."""
    from smp_compat.selftest.models import mlp_recipe
    from smp_compat.selftest.training import reference_run

    reference_run(mlp_recipe(), 2, ctx.device)


def _finish(ctx: Context) -> None:
    """Every rank is done: remove the checkpoint folders and the job's process group."""
    import shutil

    if dist.is_initialized():
        dist.barrier()
    for folder in ctx.made_folders:
        shutil.rmtree(folder, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()
