"""Environments that ship with rltune, named in a config as ``builtin:NAME``.

- ``tools``: the model may call built-in tools (``calculator``, ``python`` in the sandbox,
  ``search`` over a document store) in the chat template's tool-call convention; a turn
  without a call is the answer (:func:`rltune.envs.tools.tools_env`).
"""

from rltune.envs.tools import tools_env as tools

__all__ = ["tools"]
