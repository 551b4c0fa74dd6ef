"""What must not change a PPO run: running it again, stopping and resuming it, and the layouts that only move the
same math around (docs/reliability.md tables each equality, its tolerance and its test).

Each comparison reads two ppo_ray.py runs' metrics.jsonl step by step and their saved actors weight by weight. A
tolerance of 0 means bit for bit; the others are about 10x the float rounding measured on a 2-core CPU (given beside
each), and each equality was broken on purpose once to see its test fail (docs/equivalence.md says how). Every run
samples its rollouts with per-prompt seeds (`sample_seeds` in common/rollout.py): a resumed run samples what the
uninterrupted one did, and layouts that differ by rounding sample the same tokens unless rounding moves a probability
across a draw.

A ppo_ray.py run costs about a minute here, most of it starting vLLM and the workers, so the runs are tiny (two
steps of 32 responses of 8 tokens) and in the extended tier (`make test-extended`); the default tier checks the
resume equality on the GRPO learning run of test_ppo.py (rerun_from_checkpoint).
"""

import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import ROOT, SEED, metrics, run_script
from safetensors.torch import load_file

REWARD_FN = os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn"
WALL_CLOCK = ("time", "perf/", "weight_sync/vllm_load")  # metrics that time the run: never equal


# ------------------------------------------------------------------------------------------------- comparing runs
def logged(out: str) -> dict[int, dict]:
    """Every step's metrics (a step's rows merged: the final evaluation logs a row of its own), wall clock left out."""
    rows: dict[int, dict] = {}
    for row in metrics(out):
        rows.setdefault(row["step"], {}).update({k: v for k, v in row.items() if not k.startswith(WALL_CLOCK)})
    return rows


def metric_difference(a: str, b: str, rename: dict | None = None, ignore: tuple = ()) -> float:
    """The largest |a - b| over every metric of every step run b logged; a must log the same metrics at those steps
    (b's named as `rename` says; `ignore`d ones left out of both)."""
    rows_a, rows_b = logged(a), logged(b)
    assert rows_b and set(rows_b) <= set(rows_a), (sorted(rows_a), sorted(rows_b))
    worst = 0.0
    for step, row_b in rows_b.items():
        x = {k: v for k, v in rows_a[step].items() if k not in ignore}
        y = {(rename or {}).get(k, k): v for k, v in row_b.items() if k not in ignore}
        assert x.keys() == y.keys(), (step, sorted(x.keys() ^ y.keys()))
        worst = max(worst, *(abs(x[k] - y[k]) for k in x))
    return worst


def actor_weights(path: str) -> dict[str, torch.Tensor]:
    """A saved model's tensors, or those of a checkpoint's ZeRO-0 actor (a ...model_states.pt file)."""
    if path.endswith(".pt"):
        return torch.load(path, map_location="cpu", weights_only=False)["module"]
    return load_file(os.path.join(path, "model.safetensors"))


def weight_difference(a: str, b: str) -> float:
    """The largest |a - b| over every weight of two saved actors, which must hold the same tensors."""
    wa, wb = actor_weights(a), actor_weights(b)
    assert wa.keys() == wb.keys(), sorted(wa.keys() ^ wb.keys())
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def rerun_from_checkpoint(argv: list[str], out: str, resumed: str, step: int | None = None) -> int:
    """Rerun ppo_ray.py's `argv` writing to `resumed`, which starts with a copy of `out`'s checkpoints, as the run
    stopped after committing them left them (`step`: the step it had committed, an earlier one it kept); returns
    the step the rerun resumed from."""
    checkpoints = os.path.join(resumed, "checkpoints")
    shutil.copytree(os.path.join(out, "checkpoints"), checkpoints)
    state_file = os.path.join(checkpoints, "driver_state.json")
    state = json.load(open(state_file))
    if step is not None:
        state["step"] = step
        with open(state_file, "w") as f:
            json.dump(state, f)
    argv = list(argv)
    argv[argv.index("--output_dir") + 1] = resumed
    result = run_script("ppo_ray.py", argv)
    assert f"resumed from {checkpoints} at step {state['step']}" in result.stdout, result.stdout[-2000:]
    assert "before any sync" not in result.stdout  # the resumed engines took the checkpoint's weights by a sync
    return state["step"]


def assert_resumed_run_is_the_uninterrupted_one(argv: list[str], out: str, resumed: str, step: int | None = None):
    """The steps after the checkpoint log the metrics, and end in the weights, of the run never stopped: bit for bit
    (the rollouts' seeds come from the step, and the rest from the checkpoint)."""
    rerun_from_checkpoint(argv, out, resumed, step)
    assert metric_difference(out, resumed) == 0
    assert weight_difference(out, resumed) == 0


# ------------------------------------------------------------------------------------------------------ the runs
def command(policy: str, task: dict, out: str, *flags: str) -> list[str]:
    """Two steps of 16 prompts x 2 responses of 8 tokens, one optimizer step each, saved after every step."""
    return ["--pretrain", policy, "--prompt_data", task["prompts_train"], "--apply_chat_template", "--output_dir", out,
            "--generate_max_len", "8", "--prompt_max_len", "64", "--rollout_batch_size", "16",
            "--n_samples_per_prompt", "2", "--train_batch_size", "32", "--micro_train_batch_size", "16",
            "--max_steps", "2", "--save_steps", "1", "--actor_learning_rate", "1e-3", "--seed", str(SEED), *flags]


def gae(rm: str, *flags: str) -> list[str]:
    """GAE with a reward model (also the critic's start), a KL penalty to the reference model."""
    return ["--advantage_estimator", "gae", "--critic_learning_rate", "1e-3",
            *(flags if "--reward_pretrain" in flags else ("--reward_pretrain", rm, *flags))]


GRPO = ["--advantage_estimator", "grpo", "--reward_fn", REWARD_FN]


@pytest.fixture(scope="module")
def reward_model(sft_model, tmp_path_factory) -> str:
    """A reward model as rm.py saves it, its score head untrained: it tells the responses apart all the same."""
    from test_rewards import write_reward_model

    return write_reward_model(sft_model, str(tmp_path_factory.mktemp("rm")))


def run(policy, task, out, *flags) -> list[str]:
    argv = command(policy, task, out, *flags)
    run_script("ppo_ray.py", argv)
    return argv


@pytest.fixture(scope="module")
def gae_run(sft_model, task, reward_model, tmp_path_factory) -> tuple[list[str], str]:
    out = str(tmp_path_factory.mktemp("gae"))
    return run(sft_model, task, out, *gae(reward_model)), out


@pytest.fixture(scope="module")
def grpo_run(sft_model, task, tmp_path_factory) -> tuple[list[str], str]:
    out = str(tmp_path_factory.mktemp("grpo"))
    return run(sft_model, task, out, *GRPO), out


def assert_moved(out: str, start: str, tolerance: float) -> None:
    """The comparison can see a difference: the update moved the actor's weights well beyond the tolerance (a step
    of Adam at the learning rate of 1e-3 moves the largest by about that much)."""
    assert weight_difference(out, start) > max(3 * tolerance, 1e-4)


# ------------------------------------------------------------------------------------------ the same run twice
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_the_same_command_twice_gives_the_same_run(estimator, request, sft_model, tmp_path):
    """GRPO with the rule reward, and GAE with a reward model and a critic: the same metrics at every step and the
    same saved actor, bit for bit (on one CPU; docs/reliability.md says what a GPU leaves nondeterministic)."""
    argv, out = request.getfixturevalue(f"{estimator}_run")
    again = list(argv)
    again[again.index("--output_dir") + 1] = str(tmp_path / "again")
    run_script("ppo_ray.py", again)
    assert metric_difference(out, str(tmp_path / "again")) == 0
    assert weight_difference(out, str(tmp_path / "again")) == 0
    assert_moved(out, sft_model, 0)


@pytest.mark.slow
@pytest.mark.extended
def test_a_gae_run_resumed_from_step_1_is_the_uninterrupted_run(gae_run, tmp_path):
    """Stopped after committing step 1 (the actor's and the critic's states, the KL controller), resumed: step 2 and
    the saved actor bit for bit. test_ppo.py's GRPO learning run checks the same in the default tier."""
    argv, out = gae_run
    assert_resumed_run_is_the_uninterrupted_one(argv, out, str(tmp_path / "resumed"), step=1)


# --------------------------------------------------------------------------------------------------- layouts
# flags, then the tolerances of the metrics and of the weights: about 10x the largest difference measured (2-core
# AMD EPYC, fp32, seed 0), given beside them. 0: bit for bit.
LAYOUTS = {
    "zero2": (["--zero_stage", "2"], 3e-7, 3e-6),  # measured 1.5e-8, 1.2e-7
    "zero3": (["--zero_stage", "3"], 1e-6, 3e-5),  # 6.0e-8, 2.8e-6
    "two actor ranks": (["--actor_num_workers", "2", "--zero_stage", "3"], 1e-6, 3e-5),  # 6.0e-8, 2.0e-6
    "micro-batch 4": (["--micro_train_batch_size", "4"], 1e-6, 1e-5),  # 6.0e-8, 9.7e-7
    "colocate_all": (["--colocate_all"], 0, 0),  # 0, 0
    "colocate pairs": (["--colocate_actor_ref", "--colocate_critic_reward"], 0, 0),  # 0, 0
    "packing": (["--packing_samples"], 1e-6, 1e-4),  # 3.7e-8, 3.1e-6
    "share_prompts": (["--share_prompts"], 1e-6, 1e-4),  # 6.0e-8, 5.6e-6
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_that_moves_the_math_around_leaves_the_run_as_it_was(layout, gae_run, reward_model, sft_model,
                                                                      task, tmp_path):
    """GAE with a reward model and a critic, in another layout: ZeRO stage 2 or 3 instead of 0 (actor and critic),
    the actor over 2 ranks (ZeRO-3) for the same global batch, micro-batches of 4 instead of 16 (8 accumulated instead
    of 2), every role and the engine colocated, the reference on the actor's workers and the reward model on the
    critic's, packed micro-batches instead of padded ones, each prompt computed once for its 2 samples (the actor's
    update, its log-probs and the reference's). Every metric of both steps and the saved actor agree to
    float rounding."""
    flags, metric_tolerance, weight_tolerance = LAYOUTS[layout]
    _, out = gae_run
    other = str(tmp_path / "other")
    run(sft_model, task, other, *gae(reward_model, *flags))
    measured = metric_difference(out, other), weight_difference(out, other)
    print(f"{layout}: metrics {measured[0]:.3g}, weights {measured[1]:.3g}")
    assert measured[0] <= metric_tolerance and measured[1] <= weight_tolerance, measured
    assert_moved(out, sft_model, weight_tolerance)


@pytest.mark.slow
@pytest.mark.extended
def test_a_reward_model_twice_at_half_weight_is_the_model_once(gae_run, reward_model, sft_model, task, tmp_path):
    """--reward_pretrain RM RM --reward_weights 0.5 0.5 against RM at weight 1: the same summed reward, so the same
    run; the second model's own metric, rewards/rm1, is the first's."""
    _, out = gae_run
    twice = str(tmp_path / "twice")
    run(sft_model, task, twice, *gae(reward_model, "--reward_pretrain", reward_model, reward_model,
                                     "--reward_weights", "0.5", "0.5"))
    assert all(row["rewards/rm1"] == row["rewards/rm0"] for row in logged(twice).values())
    assert metric_difference(out, twice, ignore=("rewards/rm1",)) <= 0
    assert weight_difference(out, twice) <= 0


@pytest.fixture
def remote_rule_reward():
    """The rule reward (common/synthetic_task.reward_fn) served over HTTP on 127.0.0.1, as --remote_rm_url reads it."""
    from common.rewards import load_reward_fn

    reward_fn = load_reward_fn(REWARD_FN)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps({"rewards": reward_fn(body["prompts"], body["responses"], body["labels"])}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
@pytest.mark.extended
def test_a_rule_served_as_a_remote_reward_model_gives_the_same_run(grpo_run, remote_rule_reward, sft_model, task,
                                                                    tmp_path):
    """GRPO scored by the rule in-process (--reward_fn) and by the same rule behind --remote_rm_url: the same
    numbers reach the advantages, so the same run, bit for bit."""
    _, out = grpo_run
    remote = str(tmp_path / "remote")
    run(sft_model, task, remote, "--advantage_estimator", "grpo", "--remote_rm_url", remote_rule_reward)
    assert metric_difference(out, remote, rename={"rewards/remote": "rewards/rule"}) <= 0
    assert weight_difference(out, remote) <= 0


@pytest.mark.slow
@pytest.mark.extended
def test_partial_rollouts_at_staleness_0_are_the_synchronous_run(grpo_run, sft_model, task, tmp_path):
    """--partial_rollouts --max_staleness 0: the engines generate step 2's prompts ahead during step 1's update,
    under step 1's policy, and all of it is dropped at the boundary (partial/dropped); step 2 then samples its
    prompts anew under its own policy, with the synchronous loop's seeds in the synchronous loop's one call, and
    updates on-policy as the synchronous loop does. Every metric of both steps and the saved actor, bit for bit."""
    _, out = grpo_run
    partial = str(tmp_path / "partial")
    run(sft_model, task, partial, *GRPO, "--async_rollouts", "--partial_rollouts", "--max_staleness", "0")
    rows = logged(partial)
    assert rows[2]["partial/dropped"] > 0 and all(row["partial/staleness_0"] == 1 for row in rows.values()), rows
    own = tuple({key for row in rows.values() for key in row if key.startswith("partial/")})
    # (the synchronous run syncs after step 1 and logs it there; the partial one at step 2's start)
    assert metric_difference(out, partial, ignore=own + ("weight_sync/bytes",)) == 0
    assert weight_difference(out, partial) == 0
    assert_moved(partial, sft_model, 0)


@pytest.mark.slow
@pytest.mark.extended
def test_async_rollouts_agree_with_the_synchronous_loop_on_the_first_step(grpo_run, sft_model, task, tmp_path):
    """--async_rollouts samples step 1 from the weights the synchronous loop samples it from, and updates on that
    experience as the synchronous loop does (the old log-probs from the experience pass instead of the update's
    own, importance weights of 1 to rounding): step 1's metrics, and its actor against the synchronous run's
    checkpoint of step 1. (From step 2 on the two differ by design: one step of policy lag.)"""
    _, out = grpo_run
    lagged = str(tmp_path / "async")
    argv = command(sft_model, task, lagged, *GRPO, "--async_rollouts")
    argv[argv.index("--max_steps") + 1] = "1"
    run_script("ppo_ray.py", argv)
    # The synchronous run syncs its weights after step 1 (for step 2); the asynchronous one samples step 2 meanwhile
    step_1 = os.path.join(out, "checkpoints", "actor", "step_1", "model", "state", "mp_rank_00_model_states.pt")
    measured = (metric_difference(out, lagged, ignore=("vllm/is_capped", "weight_sync/bytes")),
                weight_difference(step_1, lagged))
    print(f"async: metrics {measured[0]:.3g}, weights {measured[1]:.3g}")
    # measured 1.5e-8 and 2.0e-5: Adam divides each gradient by its own size, so the rounding of the old log-probs,
    # recomputed in the experience pass's batches, shows most in the weights whose gradients are nearly 0
    assert measured[0] <= 3e-7 and measured[1] <= 1e-4, measured
    assert_moved(lagged, sft_model, 1e-4)
