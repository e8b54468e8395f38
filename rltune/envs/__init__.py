"""Environments for multi-turn episodes: the protocol, the episode runner, tools
(calculator, Python through the sandbox, search) and retrieval over a document store."""
