"""A multi-turn environment on the synthetic task, for ppo_ray.py --env_fn tests/sum_env.py:make_env.

The prompt is one of the task's sums. The policy answers; a right answer ends the episode with reward 1, and a wrong
one gets the reply "higher" or "lower" (or "a number, please" when it gave none) and another turn. An episode that
ends without the answer gets 0.
"""

import re


class HigherOrLower:
    def reset(self, prompt, label):
        self.answer = int(label)
        return None  # the policy starts from the prompt itself

    def step(self, action_text: str):
        numbers = re.findall(r"-?\d+", action_text)
        if not numbers:
            return "a number, please", 0.0, False
        guess = int(numbers[0])
        if guess == self.answer:
            return "", 1.0, True
        return ("higher" if guess < self.answer else "lower"), 0.0, False


def make_env():
    return HigherOrLower()
