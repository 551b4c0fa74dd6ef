"""A multi-turn environment on the synthetic task, for ppo_ray.py --env_fn tests/sum_env.py:make_env.

The prompt is one of the task's sums. The policy answers; the right answer ends the episode with reward 1, a wrong
one gets the reply "higher" or "lower" (or "a number, please" when it gave none) and another turn. A guess that
moves the way the last reply said earns 1 more, and one that moves the other way loses 1, so that what pays is the
direction of the next guess, not merely giving one: this makes acting on the reply worth learning even where the
policy cannot add. The SFT model has never seen a reply, and its next answer ignores it (or goes the other way).
"""

import re

FOLLOWED = 1.0  # the reward for a guess that moves the way the reply said; minus this for one that moves the other way


class HigherOrLower:
    def reset(self, prompt, label):
        self.answer, self.last, self.told = int(label), None, None
        return None  # the policy starts from the prompt itself

    def step(self, action_text: str):
        numbers = re.findall(r"-?\d+", action_text)
        if not numbers:
            self.last = self.told = None
            return "a number, please", 0.0, False
        guess = int(numbers[0])
        reward = 0.0
        if self.told is not None and guess != self.last:
            reward = FOLLOWED if (guess > self.last) == (self.told == "higher") else -FOLLOWED
        if guess == self.answer:
            return "", 1.0 + reward, True
        self.last, self.told = guess, ("higher" if guess < self.answer else "lower")
        return self.told, reward, False


def make_env():
    return HigherOrLower()
