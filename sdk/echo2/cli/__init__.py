"""The `echo2` command: submit, list, inspect, cancel and watch jobs; upload datasets; download checkpoints.

Only the standard library is imported until a command runs, so `echo2 --help` answers at once.
Errors are one line on stderr (no traceback) and a non-zero exit status: 2 for a bad command line,
1 for anything the server or the local system refused, 130 when interrupted.

Layout: `app` builds the parser and runs a command; `jobs`, `money` and `assets` each add one group of
commands with the functions that run them; `spec` turns `jobs submit` flags into a job spec; `render`
and `watch` print tables, descriptions and live progress.
"""

from .app import build_parser, main

__all__ = ["build_parser", "main"]
