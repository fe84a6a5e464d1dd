"""One model construction at a time in a process: every model is built through `load_causal_lm` (or under
LOAD_LOCK, for what else builds modules, such as peft's adapters).

While transformers builds a model it swaps process-wide globals (torch.nn.init's functions, torch.linspace)
for versions that skip initialisation or work on the "meta" device, and puts the saved ones back at the end.
Two threads loading at once save each other's swapped versions; from then on every load in the process gets
parameters that were never filled ("Cannot copy out of meta tensor"). Worker threads, the learner's
auditor, the tests' cheaters and in-process stacks all load from threads of their own, so one load that
skips the lock breaks the others: tests/test_layers.py refuses a direct `from_pretrained`.
"""

from __future__ import annotations

import threading
from typing import Any

LOAD_LOCK = threading.RLock()  # re-entrant: a backend that loads a model and then its adapter holds it once


def load_causal_lm(path: Any, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` holding LOAD_LOCK."""
    from transformers import AutoModelForCausalLM

    with LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def causal_lm_from_config(config: Any, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_config(config, **kwargs)` holding LOAD_LOCK."""
    from transformers import AutoModelForCausalLM

    with LOAD_LOCK:
        return AutoModelForCausalLM.from_config(config, **kwargs)
