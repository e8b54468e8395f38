"""A custom reward: plain Python, named in the config as `examples/custom_reward.py:brevity`."""


def brevity(prompt, completion, *, answer, **meta):
    """1 for the right answer, less the longer the completion; 0 for a wrong one."""
    if str(answer) not in completion:
        return 0.0
    return 1.0 / (1 + len(completion) / 20)
