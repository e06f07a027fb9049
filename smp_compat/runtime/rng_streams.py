"""A random stream per microbatch (``deterministic_server: True``): dropout masks that do not depend on timing.

At pp > 1 a rank interleaves the tasks of several microbatches, in an order set by when replies arrive.
They all drew from torch's global generators, so the mask a microbatch's dropout got changed from run to
run. Here each microbatch draws from its own stream, seeded at the start of each step from one draw of the
rank's global generator, and the step caller's stream is put back whenever it runs. The scheduler switches
streams when it hands the baton to another task; only the baton holder draws.
"""

from __future__ import annotations

import torch

__all__ = ["MicrobatchRng"]

_MB_STRIDE = 1_000_003
_SEED_RANGE = 2**62


class MicrobatchRng:
    """The global CPU generator (and the current CUDA device's) as one stream per microbatch of a step."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = _cuda_generator(device) if device.type == "cuda" else None
        self._states: dict[int | None, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._base = 0
        self._current: int | None = None

    def begin_step(self) -> None:
        """Called by the step caller (stream None): one draw of its generator seeds this step's streams."""
        self.switch(None)
        self._states.clear()
        self._base = int(torch.randint(0, _SEED_RANGE, (1,)).item())

    def switch(self, microbatch: int | None) -> None:
        """Make ``microbatch``'s stream the global one (None: the step caller's own)."""
        if microbatch == self._current:
            return
        self._states[self._current] = self._get()
        saved = self._states.get(microbatch)
        if saved is None:
            self._seed(microbatch)
        else:
            self._set(saved)
        self._current = microbatch

    def _seed(self, microbatch: int | None) -> None:
        seed = (self._base * _MB_STRIDE + (microbatch or 0)) % _SEED_RANGE
        torch.default_generator.manual_seed(seed)
        if self._cuda is not None:
            self._cuda.manual_seed(seed)

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.default_generator.get_state(), self._cuda.get_state() if self._cuda is not None else None

    def _set(self, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.default_generator.set_state(saved[0])
        if self._cuda is not None and saved[1] is not None:
            self._cuda.set_state(saved[1])


def _cuda_generator(device: torch.device) -> torch.Generator:
    torch.cuda.init()  # default_generators is filled on initialization
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
