"""Ctrl-C stops the test suite, even after a test ran a script's run_main in the pytest process.

run_main's clean-up ignores Ctrl-C and SIGTERM (a second Ctrl-C must not cut it short), and a run that ends well
leaves its own handlers installed; conftest's `_signal_handlers` puts pytest's back after each test. Without it, two
Ctrl-C's and a SIGTERM did not stop `pytest --lf`, and only SIGKILL did, leaving its DeepSpeed ranks behind.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import ROOT

# A suite in miniature: a user's mistake ends run_main in-process, as tests/test_bad_inputs.py does, then a long
# test that says when it has started.
SUITE = textwrap.dedent("""
    import os
    import time

    import pytest

    from common.args import UserError, run_main


    def main(args):
        raise UserError("a flag is wrong; change it.")


    def test_a_mistake_ends_run_main_in_this_process():
        with pytest.raises(SystemExit):
            run_main(main, None)


    def test_a_long_test_after_it():
        open(os.environ["STARTED_FILE"], "w").close()
        time.sleep(300)
""")


# The miniature suite starts as from a terminal: Ctrl-C raising KeyboardInterrupt and not blocked. A child inherits
# its parent's ignored and blocked signals and its environment, and this suite's process, after hundreds of tests and
# the libraries they ran in it, is no terminal: the test failed twice in whole runs of the suite (never alone), its
# cause not found; a failure now prints both processes' signal masks.
TERMINAL_START = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); import pytest; "
                  "sys.exit(pytest.main(sys.argv[1:]))")
# what an earlier test's in-process trainer leaves in this process's environment, which a terminal would not hold
DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def signal_state(pid: int | str = "self") -> str:
    """The kernel's view of a process's signals (hex masks), for a failure message."""
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        return "gone"
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_ctrl_c_stops_the_suite_after_an_in_process_run_main(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    started = tmp_path / "started"
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env.update(STARTED_FILE=str(started), PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]))
    # this suite's conftest as a plugin, so that the miniature runs under the same fixtures
    proc = subprocess.Popen([sys.executable, "-c", TERMINAL_START, "-q", "-p", "no:cacheprovider", "-p", "conftest",
                             "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_suite.py")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while not started.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert started.exists(), f"the long test never started:\n{proc.communicate(timeout=30)[0][-3000:]}"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        output, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child = signal_state(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"pytest ran on for 30 s after Ctrl-C: the signal was ignored (the miniature suite: "
                             f"{child}; this process: {signal_state()}, SIGINT handler "
                             f"{signal.getsignal(signal.SIGINT)})\n{output[-3000:]}") from None
    assert proc.returncode == 2 and "KeyboardInterrupt" in output, output[-3000:]
    assert "1 passed" in output, output[-3000:]  # the in-process run_main ran, and its mistake ended it
