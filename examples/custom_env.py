"""A custom environment: guess a number with higher/lower hints, within a few turns.
Named in the config as `examples/custom_env.py:GuessingGame`."""

import random
import re

from rltune.envs.base import StepResult


class GuessingGame:
    def __init__(self, *, low: int = 1, high: int = 20, seed: int | None = None):
        self.rng = random.Random(seed)
        self.low, self.high = low, high

    def reset(self, prompt):
        self.secret = self.rng.randint(self.low, self.high)
        return f"Guess my number between {self.low} and {self.high}."

    def step(self, action):
        numbers = re.findall(r"\d+", action)
        if not numbers:
            return StepResult(observation="Say a number.", reward=-0.1)
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation="higher" if guess < self.secret else "lower", reward=-0.1)
