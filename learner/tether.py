"""`python -m learner.tether CMD [ARG...]`: run CMD so that it gets SIGTERM when the process that
started it dies.

The learner host starts torchrun through this. Without it, a host killed with SIGKILL (OOM killer,
`kill -9`, a lost node) leaves its torchrun group training on as an orphan: fenced out of the
control plane by the relaunched learner's new token, but holding the GPUs. Linux keeps a parent-death
signal across exec, so this sets it (prctl PR_SET_PDEATHSIG) and then becomes CMD. The starter puts
its pid in ECHO2_TETHER_PARENT, which closes the race of a parent that died before the prctl.
Elsewhere than Linux it just runs CMD.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "ECHO2_TETHER_PARENT"
PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m learner.tether CMD [ARG...]")
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.environ.get(PARENT_ENV) not in (None, str(os.getppid())):
            sys.exit(128 + signal.SIGTERM)  # the starter is already gone: do not start at all
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
