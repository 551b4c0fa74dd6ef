"""No hang without a word, no second run in a running one's folder.

Each wait on something outside the driver's own code (the reward function, an environment, a remote reward model, a
vLLM generation) ends past its deadline in one sentence naming what it waited for and how long; here each is held to
a deadline of a second or less. A run holds its output folder with an OS lock, and a second run started on it is
refused naming the first's pid and host. One ppo_ray.py run puts the two together end to end: a reward function that
hangs at its second call, a second start refused meanwhile, and the stop's sentence (with the rerun that resumes, in
the extended tier).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, metrics, run_script
from test_bad_inputs import command, run_in_process

from common import logging_utils, multi_turn, rewards
from common.args import UserError
from common.deadlines import DeadlinePassed
from common.deepspeed_utils import load_tokenizer
from common.logging_utils import phase, progress, timed
from common.output_lock import LOCK_FILE, hold_output_folders, release_output_folders
from common.ray_workers import WorkerHung

PROMPTS, RESPONSES, LABELS = ["1+1=", "2+2=", "3+3=", "4+4="], ["2", "4", "6", "9"], ["2", "4", "6", "8"]


# ----------------------------------------------------------------------------------------- the user's code hangs
def test_a_reward_function_that_never_returns_ends_in_one_sentence(tmp_path):
    """A judge server or sandbox that hangs kept ppo_ray.py at `ppo: 1/3`, silent, until a scheduler's SIGTERM.
    The batch is not retried one sample at a time, as a raising function's is: each try would hang as long."""
    (tmp_path / "judge.py").write_text("import time\n\n\ndef reward_fn(prompts, responses, labels):\n"
                                       "    time.sleep(3600)\n")
    fn = rewards.load_reward_fn(f"{tmp_path}/judge.py:reward_fn", timeout=1)
    start = time.time()
    with pytest.raises(DeadlinePassed) as stop:
        rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS)
    assert time.time() - start < 1.8, "the batch was retried sample by sample"
    assert str(stop.value) == ("reward function reward_fn did not return within 1 s (--reward_timeout); make it "
                               "answer sooner (a server or sandbox it waits on may hang), or raise --reward_timeout.")


def test_a_reward_function_within_its_deadline_answers_as_it_would_without_one(tmp_path):
    """The deadline's thread hands back the answer and the exception as they were. A function that sets a signal
    handler, as a SIGALRM timeout does, cannot run there (Python allows it in the main thread only): 0 calls it in
    the caller's thread, without a deadline."""
    (tmp_path / "rule.py").write_text("import signal\n\n\n"
                                      "def exact(prompts, responses, labels):\n"
                                      "    return [float(int(r) == int(y)) for r, y in zip(responses, labels)]\n\n\n"
                                      "def exact_with_an_alarm(prompts, responses, labels):\n"
                                      "    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))\n"
                                      "    return exact(prompts, responses, labels)\n")
    for name, timeout in (("exact", 5.0), ("exact_with_an_alarm", 0)):
        fn = rewards.load_reward_fn(f"{tmp_path}/rule.py:{name}", timeout=timeout)
        assert rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS) == [1.0, 1.0, 1.0, 0.0]
        with pytest.raises(UserError, match="raised ValueError: invalid literal .* on sample 1 of the batch"):
            rewards.call_reward_fn(fn, PROMPTS, ["2", "four", "6", "8"], LABELS)
    fn = rewards.load_reward_fn(f"{tmp_path}/rule.py:exact_with_an_alarm", timeout=5.0)
    with pytest.raises(UserError, match="raised ValueError: signal only works in main thread"):
        rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS)


@pytest.mark.parametrize("hangs", ["reset", "step"])
def test_an_environment_that_never_returns_ends_in_one_sentence(hangs, tiny_model):
    """An --env_fn environment whose reset or step never returns (a sandbox that hangs) had no deadline at all."""
    class Sandbox:
        def reset(self, prompt, label):
            if hangs == "reset":
                time.sleep(3600)
            return None

        def step(self, action_text):
            if hangs == "step":
                time.sleep(3600)
            return "", 1.0, True

    def policy(requests, limits):  # the turn's tokens: what the environment answers does not depend on them
        return [{"token_ids": [5, 6], "logprobs": [0.0, 0.0], "finish_reason": "stop"} for _ in requests]

    prompts = [{"prompt": p, "label": y, "ids": [1, 2, 3]} for p, y in zip(PROMPTS, LABELS)]
    start = time.time()
    with pytest.raises(DeadlinePassed) as stop:
        multi_turn.run_episodes(policy, Sandbox, load_tokenizer(tiny_model), prompts, 2, 2, 16, False, None, 32,
                                timeout=0.5)
    assert time.time() - start < 1.5
    assert str(stop.value).startswith(f"the environment's {hangs}() did not return within 0.5 s (--reward_timeout); ")


def test_a_remote_reward_model_that_accepts_and_never_answers_ends_in_one_sentence():
    """A server that takes the connection and never answers: each try waits its timeout, then the sentence says how
    many tries of how long, and what to check."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []  # the accepted connections, open and unanswered

    def accept_and_say_nothing():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # the test closed the server
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/reward"
    start = time.time()
    try:
        with pytest.raises(UserError) as stop:
            rewards.remote_reward(url, PROMPTS, RESPONSES, LABELS, timeout=0.5, retries=2, backoff=0.0)
    finally:
        server.close()
        for connection in held:
            connection.close()
    assert 1.0 <= time.time() - start < 3, time.time() - start
    assert str(stop.value) == (f"remote reward model {url} did not answer after 2 tries of up to 0.5 s each (timed "
                               f"out); check that it is running and the URL is right.")


@pytest.mark.slow
def test_a_generation_or_a_sync_that_an_engine_never_finishes_ends_in_one_sentence(monkeypatch):
    """collect waited on the engines' generate with ray.get and no deadline; the weight sync's wait took an engine
    stuck inside it for a dead one ("a vLLM engine died ... (GetTimeoutError)"), and waited without end on a trainer
    rank stuck inside it while the engines idled. Each now names the engines or ranks that did not answer, and the PPO
    loop turns it into its stop sentence as it does a dead one's. The engines and the trainer rank here are Ray actors
    that run their calls one at a time, as a vLLM engine's actor does: the driver's waits are what is tested, each
    deadline lowered to a second or two."""
    import ray

    from common import vllm_engine

    class Engine:
        def ready(self) -> bool:
            return True

        def generate(self, hangs: bool) -> list:
            time.sleep(3600 if hangs else 0)
            return [[{"token_ids": [1]}]]

        def receive_bucket(self):  # a worker blocked inside the sync
            time.sleep(3600)

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20)
    try:
        generating, syncing = ([ray.remote(Engine).options(num_cpus=0).remote() for _ in range(2)] for _ in range(2))
        trainer = ray.remote(Engine).options(num_cpus=0).remote()  # a trainer rank that blocks inside the sync
        ray.get([e.ready.remote() for e in generating + syncing + [trainer]])
        start = time.time()
        with pytest.raises(vllm_engine.EngineHung) as hung_generating:
            vllm_engine.collect(generating, [e.generate.remote(i == 1) for i, e in enumerate(generating)], timeout=1)
        generate_took, start = time.time() - start, time.time()
        monkeypatch.setattr(vllm_engine, "ENGINE_ANSWER_TIMEOUT_S", 1)
        with pytest.raises(vllm_engine.EngineHung) as hung_syncing:
            vllm_engine.wait_for([syncing[1].receive_bucket.remote()], syncing, "the weight sync")
        sync_took, start = time.time() - start, time.time()
        with pytest.raises(WorkerHung) as hung_trainer:
            vllm_engine.wait_for([syncing[0].ready.remote(), trainer.receive_bucket.remote()], syncing[:1],
                                 "the weight sync", timeout=2)
        trainer_took = time.time() - start
    finally:
        ray.shutdown()
    assert 1 <= generate_took < 5 and sync_took < 15 and 2 <= trainer_took < 15, (generate_took, sync_took,
                                                                                   trainer_took)
    assert str(hung_generating.value) == ("vLLM engine(s) [1] of 2 handed back no responses for 1 s "
                                          "(GENERATE_TIMEOUT_S): hung while generating (the engine's log, under the "
                                          "Ray session's, says where)")
    assert str(hung_syncing.value) == ("vLLM engine(s) [1] of 2 did not answer for 1 s during the weight sync "
                                       "(ENGINE_ANSWER_TIMEOUT_S): stuck inside it, while the other members of its "
                                       "process group wait for them")
    assert str(hung_trainer.value) == ("rank(s) [1] of the 2 trainer workers in the weight sync did not finish it "
                                       "within 2 s while the vLLM engines answered: stuck inside it (a collective that "
                                       "a rank never joined)")


# ------------------------------------------------------------------------------------- one run per output folder
def hold_in_another_process(folder: str) -> subprocess.Popen:
    """A process that holds `folder` as a run does, until killed; returns once it holds it."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from common.output_lock import hold_output_folders\n"
                               "hold_output_folders(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n",
                               folder], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_trainer_started_in_a_folder_another_run_holds_is_refused_naming_it(tiny_model, task, tmp_path, capsys,
                                                                             monkeypatch):
    """A second sft.py on a folder another run holds is refused before its distributed world forms, in one
    sentence naming the holder's pid and host, and leaves the folder as it was; once the holder is killed, the lock
    is gone with it (no stale lock to delete by hand)."""
    import sft

    out = tmp_path / "sft"
    holder = hold_in_another_process(str(out))
    try:
        (out / "metrics.jsonl").write_text('{"step": 1}\n')  # the first run's, which the second must not touch
        before = {name: (out / name).read_bytes() for name in os.listdir(out)}

        def too_late():
            raise AssertionError("the second run reached the distributed world")

        monkeypatch.setattr(sft, "init_distributed", too_late)
        code, stderr = run_in_process("sft", command("sft", tiny_model, task, str(out)), capsys)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert lines[0].startswith(f"error: {out} is in use by another run (pid {holder.pid} on host "
                                   f"{socket.gethostname()}, since "), lines[0]
        assert lines[0].endswith("; wait for that run to end or stop it, or give another --output_dir (or "
                                 "--ckpt_dir)."), lines[0]
        assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    hold_output_folders(str(out))  # the killed holder's lock died with it
    release_output_folders()


def test_a_folder_inside_a_held_one_is_covered_by_its_lock(tmp_path):
    """--ckpt_dir inside --output_dir (its default) is held by the output folder's lock, and a second run that names
    only the inner folder is refused too: it would write the same checkpoints."""
    holder = hold_in_another_process(str(tmp_path / "run"))
    try:
        hold_output_folders(str(tmp_path / "other"), str(tmp_path / "other" / "checkpoints"))
        assert os.listdir(tmp_path / "other") == [LOCK_FILE]  # the inner folder needs no lock of its own
        release_output_folders()
        with pytest.raises(UserError, match=f"in use by another run \\(pid {holder.pid} "):
            hold_output_folders(str(tmp_path / "other"), str(tmp_path / "run"))
        hold_in_another_process(str(tmp_path / "other")).kill()  # the refusal let go of what it had taken
    finally:
        holder.kill()
        holder.wait()


def test_a_checkpoint_whose_folder_was_removed_mid_write_says_so_not_that_the_disk_is_full(tmp_path):
    """Two runs in one folder: the other's rotation removed step 69's folder while this one wrote into it, and the
    sentence said "73,253 MiB free on its disk ... Make room there". A write into a vanished folder now says that."""
    import torch

    from common.checkpoint import describe

    gone = tmp_path / "checkpoints" / ".partial" / "step_69"
    with pytest.raises(RuntimeError) as error:
        torch.save({}, str(gone / "rng_rank0.pt"))  # what DeepSpeed's checkpoint engine calls
    assert describe(error.value, str(gone)) == (f"RuntimeError: Parent directory {gone} does not exist: a folder it "
                                                f"wrote into was removed meanwhile, by another process or a clean-up")
    with pytest.raises(OSError) as full:
        open("/dev/full", "w").write("x" * 2**16)
    assert describe(full.value, str(tmp_path)).endswith(" MiB free on its disk")


# ------------------------------------------------------------------------------------------------ end to end
def hang_in_the_reward_and_start_again(tiny_model, task, tmp_path) -> tuple[list[str], str, object]:
    """The issue's two cases as a new user met them: a second start of the same command while the first runs (it
    resumed from the first's checkpoint and both wrote into one checkpoints/ and metrics.jsonl), and a reward function
    that stops answering at its second call. The second start is refused naming the first's pid and host; the hung
    call ends the first run after --reward_timeout with the stop's sentence, the checkpoint of step 1 intact. Returns
    the command, its checkpoint folder and the file whose presence hangs the reward function."""
    out = str(tmp_path / "ppo")
    hang = tmp_path / "judge_hangs"
    hang.write_text("")
    (tmp_path / "judge.py").write_text(
        "import os\nimport time\n\nfrom common.synthetic_task import reward_fn as rule\n\ncalls = 0\n\n\n"
        "def reward_fn(prompts, responses, labels):\n"
        "    global calls\n    calls += 1\n"
        f"    while calls == 2 and os.path.exists({str(hang)!r}):\n        time.sleep(1)\n"
        "    return rule(prompts, responses, labels)\n")
    argv = command("ppo_ray", tiny_model, task, out, "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2",
                   "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "8",
                   "--max_steps", "2", "--save_steps", "1", "--reward_fn", f"{tmp_path}/judge.py:reward_fn",
                   "--reward_timeout", "5")
    checkpoints = os.path.join(out, "checkpoints")
    first = run_script("ppo_ray.py", argv, background=True)
    try:
        lock = os.path.join(out, LOCK_FILE)  # taken before Ray starts: the second start comes while the first runs
        deadline = time.time() + 300
        while first.poll() is None and time.time() < deadline and not (
                os.path.exists(lock) and f"pid {first.pid} " in open(lock).read()):
            time.sleep(0.2)
        second = run_script("ppo_ray.py", argv, check=False, timeout=300)
        assert first.poll() is None, "the first run ended before the second start was tried"
        output, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert second.returncode == 2 and len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert errors[0].startswith(f"error: {out} is in use by another run (pid {first.pid} on host "
                                f"{socket.gethostname()}, "), errors[0]

    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert first.returncode == 2 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert errors[0] == (f"error: reward function reward_fn did not return within 5 s (--reward_timeout); make it "
                         f"answer sooner (a server or sandbox it waits on may hang), or raise --reward_timeout. The "
                         f"run stopped at step 2; the checkpoint of step 1 in {checkpoints} is intact. Rerun the same "
                         f"command to resume."), errors[0]
    assert json.load(open(os.path.join(checkpoints, "driver_state.json")))["step"] == 1
    assert [m["step"] for m in metrics(out)] == [1]  # one writer: every line is JSON, and step 1's is there once
    return argv, checkpoints, hang


@pytest.mark.slow
def test_ppo_ray_hung_in_its_reward_refuses_a_second_start_and_stops_in_one_sentence(tiny_model, task, tmp_path):
    """One ppo_ray.py run (~40-80 s on 2 cores); that the rerun of a stopped run resumes is shown for a reward
    function that raises by test_bad_inputs.py, and for this hang by the extended test below."""
    hang_in_the_reward_and_start_again(tiny_model, task, tmp_path)


@pytest.mark.slow
@pytest.mark.extended
def test_ppo_ray_hung_in_its_reward_resumes_once_the_judge_answers(tiny_model, task, tmp_path):
    """The same command, once the judge answers again, resumes at step 1 and finishes."""
    argv, checkpoints, hang = hang_in_the_reward_and_start_again(tiny_model, task, tmp_path)
    hang.unlink()
    rerun = run_script("ppo_ray.py", argv, timeout=600)
    assert f"resumed from {checkpoints} at step 1" in rerun.stdout, rerun.stdout[-3000:]
    assert [m["step"] for m in metrics(os.path.dirname(checkpoints)) if "objective/scores" in m] == [1, 2]


# ------------------------------------------------------------------------------------------ where a run is
def test_the_progress_bar_names_the_phase_waited_on_and_a_slow_phase_gets_a_line(capsys, monkeypatch):
    """ppo_ray.py sat at `ppo: 1/3` while its reward function hung: nothing said what it waited on. The bar now
    names the phase and the phase inside it, and a phase that takes SLOW_FACTOR times its median says so in a line
    (which a log file, where the bar does not redraw, shows too)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal's bar, not a log file's lines
    bar = progress(3, 0, "ppo")
    timings = {}
    with timed(timings, "time/make_experience"):
        with phase("reward"):
            assert bar.desc == "ppo [make_experience > reward]"
        assert bar.desc == "ppo [make_experience]"
    assert bar.desc == "ppo" and set(timings) == {"time/make_experience"}
    monkeypatch.setattr(logging_utils, "SLOW_SECONDS", 0.2)  # the floor under which no phase is a stall
    for seconds in (0.0, 0.0, 0.0, 0.1, 0.3):
        with phase("test_generate"):
            time.sleep(seconds)
    bar.close()
    slow = [line for line in capsys.readouterr().err.splitlines() if line.startswith("test_generate took")]
    assert len(slow) == 1 and re.fullmatch(r"test_generate took 0\.3 s, \d+ times its median so far \(0\.0 s\)",
                                           slow[0]), slow
