"""Models bigger than one device: the learner group's layout as one DeviceMesh and the
tensor, pipeline, expert and data parallelism applied over it (``docs/parallel.md``)."""
