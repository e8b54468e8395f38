"""A live web dashboard of training runs: charts of their metrics, a browser of their
rollouts and their resolved config, served by ``rltune dashboard`` (see
:mod:`rltune.metrics.dashboard.server` for the HTTP API and its security rules)."""

from rltune.metrics.dashboard.server import DashboardError, DashboardServer, make_server, serve

__all__ = ["DashboardError", "DashboardServer", "make_server", "serve"]
