"""One model construction at a time in a process: every `from_pretrained` of a model takes LOAD_LOCK.

transformers builds a model inside ``with torch.device("meta")``, and torch keeps the current default
device in one process-wide global that each such context saves on entry and restores on exit. Two
threads loading at once can restore each other's "meta"; from then on every load in the process
yields parameters with no data ("Cannot copy out of meta tensor"). Worker threads, the learner's
auditor and in-process stacks all load from threads of their own, so they share this lock.
"""

from __future__ import annotations

import threading

LOAD_LOCK = threading.RLock()  # re-entrant: a backend that loads a model and then its adapter holds it once
