"""--partial_rollouts (common/partial_rollouts.py): generations cut at the step boundary go on under the new policy,
each token tagged with the version that sampled it, none older than --max_staleness in a loss.

The run below is ppo_ray.py's, on the real stack. test_equivalence.py checks that --max_staleness 0 is the
synchronous run bit for bit."""

import os

import pytest
import torch
from conftest import SEED, metrics, run_script

from common.partial_rollouts import Group, continuation_seed, logprob_diff_by_staleness, staleness_metrics

# A reward that differs between the untrained model's samples, so that every update moves the policy.
DIGIT_SHARE = '''
def reward_fn(prompts, responses, labels):
    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]
'''


def test_a_group_asks_one_request_until_it_has_tokens_then_one_per_unfinished_sample():
    """Nothing generated: the synchronous loop's n-sample request with the prompt's seed. Then one request per
    unfinished sample, its prompt the prompt and its tokens so far; a sample emptied again draws from seed + j."""
    group = Group({"ids": [5, 6]}, seed=100, n=3)
    [(request, n, limit, seed, indices)] = group.requests(lambda done: 4 - done)
    assert (request, n, limit, seed, list(indices)) == ({"ids": [5, 6]}, 3, 4, 100, [0, 1, 2])
    group.samples[0].update(token_ids=[7], finish_reason=None)
    group.samples[1].update(token_ids=[8, 9], finish_reason="stop")
    assert group.requests(lambda done: 4 - done) == [({"ids": [5, 6, 7]}, 1, 3, continuation_seed(100, 0, 1), [0]),
                                                     ({"ids": [5, 6]}, 1, 4, 102, [2])]
    assert len({continuation_seed(100, 0, 1), continuation_seed(100, 0, 2), continuation_seed(100, 1, 1)}) == 3


def test_staleness_metrics_worked_by_hand():
    """Two prompts of two samples: 3 + 1 + 2 + 2 tokens of staleness 0, 1 and 2."""
    samples = [[{"staleness": [1, 1, 0]}, {"staleness": [0]}], [{"staleness": [2, 1]}, {"staleness": [0, 0]}]]
    got = staleness_metrics(samples, 2)
    assert got == pytest.approx({"partial/staleness_0": 4 / 8, "partial/staleness_1": 3 / 8,
                                 "partial/staleness_2": 1 / 8, "partial/staleness_mean": 5 / 8,
                                 "partial/continued": 2 / 4})
    # build_batch's layout: prompt of 2 tokens, so response token t sits at column 1 + t; the second row is masked
    prompts, rows = [[1, 2]], [[{"staleness": [0, 1, 1]}, {"staleness": [0]}]]
    vllm, old = torch.zeros(2, 4), torch.tensor([[0.0, 0.1, 0.2, 0.4], [0.0, 9.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 0, 0, 0]])
    gaps = logprob_diff_by_staleness(prompts, rows, vllm, old, mask)
    assert gaps.keys() == {"partial/logprob_diff_0", "partial/logprob_diff_1"}
    assert gaps["partial/logprob_diff_0"].item() == pytest.approx(0.1)
    assert gaps["partial/logprob_diff_1"].item() == pytest.approx(0.3)


@pytest.mark.slow
def test_cut_samples_go_on_under_the_new_policy_and_no_token_is_staler_than_the_bound(tiny_model, task, tmp_path):
    """GRPO on the untrained tiny model, whose samples mostly run to the 48-token limit, generated ahead in chunks
    of 4 tokens under a bound of 2: the step boundary cuts samples, which go on under the next policy. Every step
    trains only on tokens at most 2 versions old; the tokens the step's own policy sampled have vLLM's log-probs
    of that policy (float rounding), while older ones show the updates since."""
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_SHARE)
    out = str(tmp_path / "partial")
    run_script("ppo_ray.py", [
        "--pretrain", tiny_model, "--prompt_data", task["prompts_train"], "--apply_chat_template", "--output_dir", out,
        "--generate_max_len", "48", "--prompt_max_len", "64", "--rollout_batch_size", "16", "--n_samples_per_prompt",
        "2", "--train_batch_size", "32", "--micro_train_batch_size", "16", "--max_steps", "4", "--warmup_ratio", "0",
        "--actor_learning_rate", "1e-3", "--advantage_estimator", "grpo", "--reward_fn", f"{reward}:reward_fn",
        "--seed", str(SEED), "--async_rollouts", "--partial_rollouts", "--max_staleness", "2",
        "--partial_chunk_tokens", "4"])
    log = [m for m in metrics(out) if "partial/staleness_mean" in m]
    assert len(log) == 4
    for m in log:
        assert sum(m[f"partial/staleness_{k}"] for k in range(3)) == pytest.approx(1, abs=1e-6), m  # none older
        assert m["partial/logprob_diff_0"] < 1e-4, m  # sampled by the policy the step trains
    stale = [m[key] for m in log for key in ("partial/logprob_diff_1", "partial/logprob_diff_2") if key in m]
    assert stale and max(stale) > 1e-3, log  # the updates moved the policy, and the older tokens' tags say so
    assert max(m["partial/continued"] for m in log) > 0, log  # a boundary cut samples that went on
    assert "vllm/is_capped" in log[-1]  # decoupled PPO's per-token weights against each token's sampler
    assert os.path.exists(os.path.join(out, "model.safetensors"))
