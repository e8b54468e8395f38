"""``rltune plan``: choose a run's layout before renting the cluster.

A cost model of memory, compute and communication (``memory``, ``timing``), fed by the
model's hyperparameters (``catalogue``: a ``config.json``, a model directory or a
``builtin:`` name; no weights are loaded), the cluster (``cluster``) and the config's
workload (``workload``); a search over layouts (``search``) ranked by predicted samples
per second; a report and the config sections to paste (``report``); constants fitted on
the machine at hand (``calibrate``); and a discrete-event simulation of the asynchronous
pipeline at scale (``simulate``). The records every part shares are in ``spec``.

Nothing here but ``calibrate`` imports torch.
"""
