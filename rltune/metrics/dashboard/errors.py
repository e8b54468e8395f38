"""The one error type of the dashboard: something the user gave it is wrong."""

from __future__ import annotations


class DashboardError(ValueError):
    """A path, address, port or token given to the dashboard cannot be used; the message
    names the bad input and says what to give instead."""
