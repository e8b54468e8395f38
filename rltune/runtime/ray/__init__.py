"""``runtime.mode: ray``: the Generator, Scorer and Learner protocols as Ray actors.

The only package of rltune that imports ray. ``cluster`` starts or joins Ray and places the
actors; ``rollouts`` holds the generator and scorer actors (restarted when they die, their
work reissued); ``learner`` the learner group (``fsdp_state`` its FSDP2 checkpoints);
``sync`` the broadcast weight channel; ``roles`` the :class:`~rltune.runtime.ray.roles.RayRoles`
(those, plus the reference and critic actors) from which ``run`` builds a
:class:`rltune.runtime.parts.Run`, which the one loop of ``runtime/loop.py`` drives as it
drives a local run.
"""
