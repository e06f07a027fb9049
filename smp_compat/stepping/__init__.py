"""What one ``@smp.step`` call does around the model: split the inputs, run the body per microbatch, collect
``StepOutput``s, average gradients over data parallelism.

``step.py`` is ``@smp.step`` itself, ``split.py`` the per-microbatch input split
(``signature.py`` its argument names and option checks), ``output.py`` ``StepOutput``,
``grads.py`` the data-parallel gradient average. May import the core (errors, config, globalstate, comm);
the pipeline runtime sits above and drives microbatches through ``step.py``'s call state.
"""

from __future__ import annotations

__all__: list[str] = []
