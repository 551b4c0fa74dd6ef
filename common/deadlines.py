"""Deadlines on calls into the user's code that may never return: a reward function, an environment's reset and step.

A judge server or a sandbox that hangs leaves its caller waiting without a word, on a cluster that looks alive. The
call runs in a thread of its own and is waited on for at most `seconds`; past that the run ends with one sentence.
A thread cannot be killed, so the stuck call is left behind (a daemon thread, which does not hold the process up):
the run must stop, and the rerun resumes from its last checkpoint.

    fn = within_deadline(fn, 600, "reward function f", "--reward_timeout")
    fn(prompts, responses, labels)        # its answer, its exception, or DeadlinePassed after 600 s
"""

import functools
import threading

from common.args import UserError

# Seconds a reward function or an environment's reset or step may take per call before the run stops (--reward_timeout).
REWARD_TIMEOUT_S = 600.0


class DeadlinePassed(UserError):
    """A call into the user's code did not return in time; the message names it, the wait and the flag to raise."""


def call_within(seconds: float, what: str, flag: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), its answer or its exception, if it returns within `seconds`; DeadlinePassed if not.
    `seconds` 0 calls it in this thread, without a deadline: for a function that sets signal handlers of its own
    (a SIGALRM timeout, as some math verifiers use), which Python allows in the main thread only."""
    if not seconds:
        return fn(*args, **kwargs)
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread, which raises it
            outcome["error"] = e

    worker = threading.Thread(target=run, name=f"deadline: {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise DeadlinePassed(f"{what} did not return within {seconds:g} s ({flag}); make it answer sooner (a "
                             f"server or sandbox it waits on may hang), or raise {flag}.")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def within_deadline(fn, seconds: float, what: str, flag: str):
    """`fn` bounded by call_within, under its own name."""
    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        return call_within(seconds, what, flag, fn, *args, **kwargs)

    return bounded
