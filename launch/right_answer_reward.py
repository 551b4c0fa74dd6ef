"""The rule reward of `make demo-real` (launch/demo_real.py): 1.0 when the answer is right, 0.0 otherwise.

The answer is the response's last number, as GSM8K-style graders read it: "12 + 13 = 25." answers 25, and so does
"The answer is 25.", while "12 + 13 = 24, no, 26" answers 26. Only correctness is paid: a response listing numbers
earns nothing for holding the right one somewhere, and a short wrong answer earns no more than a long wrong one.

    python ppo_ray.py ... --reward_fn launch/right_answer_reward.py:reward_fn
"""

import re


def final_number(response: str) -> str | None:
    """The last integer in the response (thousands separators dropped), or None without one."""
    numbers = re.findall(r"-?\d+", response.replace(",", ""))
    return numbers[-1] if numbers else None


def is_right(response: str, label: str) -> bool:
    """Whether the response's last number is the label."""
    return final_number(response) == str(label).strip()


def reward_fn(prompts: list[str], responses: list[str], labels: list[str]) -> list[float]:
    """ppo_ray.py's and rejection_sampling.py's --reward_fn: 1.0 for a right answer, 0.0 for any other."""
    return [float(is_right(response, label)) for response, label in zip(responses, labels)]
