"""Running untrusted (model-written) Python under hard limits.

:func:`run_python` runs a program in the best isolation this machine gives
(:func:`isolation`: bubblewrap, else ``unshare`` namespaces, else resource limits only,
said in every result and warned about once); :func:`run_tests` runs a solution against
unit tests with verdicts the solution cannot forge. ``docs/sandbox.md`` describes both.
"""

from rltune.sandbox.harness import TestReport, collect_tests, run_tests
from rltune.sandbox.mechanisms import MECHANISMS, Mechanism, SandboxError
from rltune.sandbox.runner import Limits, SandboxResult, isolation, run_python, unavailable

__all__ = [
    "MECHANISMS",
    "Limits",
    "Mechanism",
    "SandboxError",
    "SandboxResult",
    "TestReport",
    "collect_tests",
    "isolation",
    "run_python",
    "run_tests",
    "unavailable",
]
