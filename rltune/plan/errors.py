"""The planner's one error type."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad input to the planner: an unreadable or unsupported model config, an unknown
    catalogue name, a nonsensical cluster flag, a workload the planner cannot model.

    The message names what is wrong and where (the file, key or flag) on one line; the
    ``rltune plan`` command prints it as that one line and exits with status 2, without a
    traceback.
    """
