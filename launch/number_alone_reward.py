"""The rule reward of `make demo-real` (launch/demo_real.py): answer an arithmetic question with the number alone.

A response that is a number and nothing else ("25", "25.") earns 1.0 when the number is right and 0.5 when it is
wrong. One that holds a number among other words earns at most half that, a little less for every further word
("12 + 13 = 25." earns 0.37), and one without a number earns 0. The slope matters: a chat model never samples a bare
number at first, but its answers differ in length, so a group of samples mostly holds a shorter one to prefer and
GRPO has something to push on from the first step. The form is most of the reward and rightness the rest, because
the form is what a short run can teach: sampling, SmolLM2-135M-Instruct wrote the right sum in 9 of 48 answers, and
GRPO with rewards that required it stalled there (docs/real_model.md).

    python ppo_ray.py ... --reward_fn launch/number_alone_reward.py:reward_fn
"""

import re

WORDS_TO_ZERO = 16  # an answer of this many words or more earns nothing


def is_number_alone(response: str) -> bool:
    """Whether a response is one number and nothing else (a final full stop allowed): what a person sees at a glance."""
    return re.fullmatch(r"-?\d+\.?", response.strip()) is not None


def is_right(response: str, label: str) -> bool:
    """Whether the right number is among the response's numbers."""
    return str(label).strip() in re.findall(r"-?\d+", response)


def number_alone_reward(response: str, label: str) -> float:
    """The form's score (1.0 for a number alone, at most 0.5 and less a word for a number among other words, 0.0
    without a number), halved when the right number is not in the response."""
    if not re.search(r"\d", response):
        return 0.0
    extra_words = len(response.split()) - 1
    form = 1.0 if is_number_alone(response) else 0.5 * max(0.0, 1.0 - extra_words / (WORDS_TO_ZERO - 1))
    return form if is_right(response, label) else form / 2


def reward_fn(prompts: list[str], responses: list[str], labels: list[str]) -> list[float]:
    """ppo_ray.py's --reward_fn: one reward per response (number_alone_reward)."""
    return [number_alone_reward(response, label) for response, label in zip(responses, labels)]
