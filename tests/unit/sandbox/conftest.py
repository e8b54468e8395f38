"""What a test of a namespaced mechanism (``bwrap``, ``unshare``) does where that mechanism
does not work on this machine.

A test takes the mechanism as its ``mech`` parameter. Where it does not work the test is
skipped with the reason, so the suite runs on a laptop without bubblewrap or root. Under
CI (the ``CI`` environment variable set to ``true``, as ``.ci/run`` and CI services do) it
fails instead: a green CI run then means the sandbox's containment was tested under both
mechanisms, not skipped. ``make test`` installs bubblewrap where it can.
"""

from __future__ import annotations

import os

import pytest

from rltune.sandbox import unavailable

NAMESPACED = ("bwrap", "unshare")


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


@pytest.fixture(autouse=True)
def _mechanism_works(request: pytest.FixtureRequest) -> None:
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("mech") if callspec is not None else None
    if name not in NAMESPACED:
        return
    reason = unavailable(name)
    if reason is None:
        return
    if on_ci():
        pytest.fail(f"{name} does not work on this machine, so the sandbox's containment "
                    f"under it is untested: {reason} (CI=true fails instead of skipping; "
                    "`make test` installs bubblewrap as root, `unshare` needs root)",
                    pytrace=False)
    pytest.skip(f"{name}: {reason}")
