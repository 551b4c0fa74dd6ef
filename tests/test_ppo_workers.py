"""ppo_ray.py's workers on one CPU process, with a plain model standing in for the DeepSpeed engine: which
pretraining (ptx) rows the actor trains on, and on which scale the critic starts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo_ray
from common import data
from common.model_worker import ModelWorker, split

PAD_COLLATE = data.pad_collate  # the real one, which the ptx test wraps


class FakeEngine:
    """The part of a DeepSpeed engine the workers use, around a plain model: forward, backward, step, lr."""

    def __init__(self, model, accumulation: int = 1):
        self.module, self.accumulation, self.micro_steps, self.gradients = model, accumulation, 0, []

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def gradient_accumulation_steps(self):
        return self.accumulation

    def backward(self, loss):  # DeepSpeed's mean over the micro-batches of an optimizer step
        (loss / self.accumulation).backward()

    def step(self):  # at each optimizer step, keep the accumulated gradients, then clear them
        self.micro_steps += 1
        if self.micro_steps % self.accumulation == 0:
            self.gradients.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
            self.module.zero_grad()

    def get_lr(self):
        return [0.0]


def worker(cls, args, engine, tokenizer, rank=0, world_size=1):
    """A worker object as its Ray actor holds it after setup(), without Ray or DeepSpeed."""
    w = object.__new__(cls)
    w.args, w.engine, w.tokenizer, w.rank, w.world_size, w.ptx = args, engine, tokenizer, rank, world_size, None
    return w


def experience_batch(tokenizer, lengths: list[int]) -> dict:
    """One prompt token and responses of the given lengths (each ended by EOS), as ppo_ray.build_batch lays them."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    samples = [[{"token_ids": [40 + i] * (n - 1) + [eos], "logprobs": None}] for i, n in enumerate(lengths)]
    batch = ppo_ray.build_batch([[bos]] * len(lengths), samples, tokenizer.pad_token_id)
    zeros = torch.zeros_like(batch["action_mask"])
    return {**batch, "old_logprobs": zeros, "ref_logprobs": zeros, "advantages": zeros + 1, "values": zeros,
            "returns": zeros}


# ------------------------------------------------------------------------------------------------------- ptx
def ptx_rows_drawn(policy, ptx, experience, step, monkeypatch) -> list[int]:
    """The ptx rows (their indices) one fit() of the actor trains on at `step`."""
    drawn = []

    def recording(samples, *args, **kwargs):
        drawn.extend(next(i for i, row in enumerate(ptx) if row is s) for s in samples)
        return PAD_COLLATE(samples, *args, **kwargs)

    monkeypatch.setattr(ppo_ray, "pad_collate", recording)
    policy.fit(experience, 0.0, step)
    return drawn


def test_ptx_rows_walk_the_whole_set_across_steps_and_ranks_and_resume(tiny_model, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = FakeEngine(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    args = ppo_ray.Args(micro_train_batch_size=2, max_epochs=1, advantage_estimator="rloo", ptx_coef=0.05, seed=3)
    ptx = [{"input_ids": [tokenizer.bos_token_id, 10 + i, tokenizer.eos_token_id], "loss_mask": [0, 1, 1]}
           for i in range(24)]
    experience = experience_batch(tokenizer, [3, 2, 4, 3])  # 2 micro-batches of 2 rows per fit
    ranks = [worker(ppo_ray.ActorWorker, args, engine, tokenizer, rank, world_size=2) for rank in range(2)]
    for policy in ranks:
        policy.set_ptx_data(ptx)

    # 2 ranks x 2 micro-batches x 2 rows = 8 rows a step: three steps make one pass over the 24 rows.
    drawn = {(step, rank): ptx_rows_drawn(policy, ptx, experience, step, monkeypatch)
             for step in range(3) for rank, policy in enumerate(ranks)}
    one_pass = [i for rows in drawn.values() for i in rows]
    assert sorted(one_pass) == list(range(24)), f"rows repeated before the set was used up: {drawn}"

    resumed = worker(ppo_ray.ActorWorker, args, engine, tokenizer, rank=1, world_size=2)
    resumed.set_ptx_data(ptx)
    assert ptx_rows_drawn(resumed, ptx, experience, 1, monkeypatch) == drawn[(1, 1)]
    next_pass = ptx_rows_drawn(ranks[0], ptx, experience, 3, monkeypatch)
    assert next_pass != drawn[(0, 0)], "the second pass repeats the first pass's order"


# ---------------------------------------------------------------------------------------------- loss options
@pytest.mark.parametrize("flags,handed", [
    ({}, {}),
    ({"eps_clip": 0.1}, {"clip": (0.1, 0.1)}),
    ({"eps_clip_low": 0.1, "eps_clip_high": 0.28}, {"clip": (0.1, 0.28)}),
    ({"dual_clip": 3.0}, {"dual_clip": 3.0}),
    ({"loss_agg": "seq-mean-token-mean"}, {"agg": "seq-mean-token-mean"}),
    ({"advantage_estimator": "dr_grpo"}, {"agg": "seq-mean-token-sum-norm"}),
    ({"vllm_is_correction": True}, {"weighted": True}),
    # each --policy_loss named alone gets its paper's clip range and aggregation; a flag the user gives wins
    ({"policy_loss": "gspo"}, {"kind": "gspo", "clip": (3e-4, 4e-4), "agg": "seq-mean-token-mean"}),
    ({"policy_loss": "gspo", "eps_clip": 0.1, "loss_agg": "token-mean"}, {"kind": "gspo", "clip": (0.1, 0.1)}),
    ({"policy_loss": "gmpo"}, {"kind": "gmpo", "clip": (0.4, 0.4), "agg": "seq-mean-token-mean"}),
    ({"policy_loss": "cispo"}, {"kind": "cispo", "clip": (0.2, 4.0)}),
    ({"policy_loss": "sapo", "sapo_tau_pos": 0.5, "sapo_tau_neg": 2.0},
     {"kind": "sapo", "sapo_tau": (0.5, 2.0), "agg": "seq-mean-token-mean"}),
    ({"off_policy_seq_mask": 0.5}, {"weighted": True}),
])
def test_the_actor_update_hands_each_loss_option_to_the_loss(tiny_model, monkeypatch, flags, handed):
    """Each flag of the clipped objective reaches policy_loss from ActorWorker.fit. The loss's own tests (worked by
    hand, and the toy problem in test_ppo_tricks.py) call it directly: a flag that fit dropped would pass them all."""
    real, seen = ppo_ray.policy_loss, []

    def recording(logprobs, old, advantages, mask, clip_low, clip_high, dual_clip=None, weights=None,
                  agg="token-mean", max_len=1, count=None, kind="ppo", sapo_tau=(1.0, 1.05)):
        seen.append({"clip": (clip_low, clip_high), "dual_clip": dual_clip, "weighted": weights is not None,
                     "agg": agg, "max_len": max_len, "kind": kind, "sapo_tau": sapo_tau})
        return real(logprobs, old, advantages, mask, clip_low, clip_high, dual_clip, weights, agg, max_len, count,
                    kind, sapo_tau)

    monkeypatch.setattr(ppo_ray, "policy_loss", recording)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = FakeEngine(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    args = ppo_ray.Args(**{"micro_train_batch_size": 2, "max_epochs": 1, "advantage_estimator": "grpo",
                           "generate_max_len": 8, **flags})
    experience = experience_batch(tokenizer, [3, 2])
    del experience["old_logprobs"]  # on policy: fit computes them, and with --vllm_is_correction the IS weights
    worker(ppo_ray.ActorWorker, args, engine, tokenizer).fit(experience, 0.0, 0)
    default = {"clip": (0.2, 0.2), "dual_clip": None, "weighted": False, "agg": "token-mean", "max_len": 8,
               "kind": "ppo", "sapo_tau": (1.0, 1.05)}
    assert seen == [{**default, **handed}]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_an_optimizer_steps_gradient_does_not_depend_on_how_its_batch_is_cut_into_micro_batches(tiny_model, agg):
    """Each micro-batch was aggregated on its own and DeepSpeed averaged them: with one response a micro-batch,
    token-mean weighed each response alike (GRPO's mean, not DAPO's), and a micro-batch whose responses
    --overlong_filter all took out counted as a loss of 0, shrinking the step. Now four responses of 2, 6, 3 and 9
    tokens, one of them filtered out, give the same gradient in 1 micro-batch of 4, 2 of 2 or 4 of 1."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    experience = experience_batch(tokenizer, [2, 6, 3, 9])
    experience["action_mask"][1] = 0  # --overlong_filter's doing
    experience["advantages"] = torch.tensor([1.0, -2.0, -0.5, 0.7])[:, None] * experience["action_mask"]
    gradients, metrics = {}, {}
    for micro in (4, 2, 1):
        torch.manual_seed(0)
        engine = FakeEngine(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), 4 // micro)
        args = ppo_ray.Args(micro_train_batch_size=micro, max_epochs=1, advantage_estimator="rloo", loss_agg=agg,
                            generate_max_len=16)
        batch = {k: v.clone() for k, v in experience.items() if k != "old_logprobs"}  # on policy, ratio 1
        metrics[micro] = worker(ppo_ray.ActorWorker, args, engine, tokenizer).fit(batch, 0.0, 0)
        (gradients[micro],) = engine.gradients
    for micro in (2, 1):
        for name, grad in gradients[4].items():
            torch.testing.assert_close(gradients[micro][name], grad, rtol=1e-4, atol=1e-7, msg=f"{agg} {micro} {name}")
        # the logged means too: per token (entropy, vLLM's error), per response (the KL to the reference)
        for name in ("objective/entropy", "vllm/logprob_diff", "objective/kl", "policy/clipfrac_avg",
                     "loss/policy_avg"):
            assert float(metrics[micro][name]) == pytest.approx(float(metrics[4][name]), rel=1e-4), (micro, name)


def test_a_critic_steps_gradient_does_not_depend_on_how_its_batch_is_cut_into_micro_batches(tiny_model):
    """The value loss too is the mean over the train batch's tokens: a micro-batch of one short response no longer
    weighs as much as one of a long response, nor an emptied one (--overlong_filter) as a loss of 0."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    experience = experience_batch(tokenizer, [2, 6, 3, 9])
    experience["action_mask"][1] = 0
    experience["returns"] = torch.tensor([1.0, -2.0, -0.5, 0.7])[:, None] * experience["action_mask"]
    gradients = {}
    for micro in (4, 2, 1):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)
        engine = FakeEngine(model, 4 // micro)
        args = ppo_ray.Args(micro_train_batch_size=micro, max_epochs=1, normalize_reward=False)
        worker(ppo_ray.CriticWorker, args, engine, tokenizer).fit({k: v.clone() for k, v in experience.items()})
        (gradients[micro],) = engine.gradients
    for micro in (2, 1):
        for name, grad in gradients[4].items():
            torch.testing.assert_close(gradients[micro][name], grad, rtol=1e-4, atol=1e-7, msg=f"{micro} {name}")


def test_an_optimizer_steps_rows_are_cut_shortest_first_and_no_row_crosses_into_another_step(tiny_model):
    """split() sorts each optimizer step's rows by length before cutting them, so that rows of alike length pad
    together (the gradient tests above show the cut changes nothing else), and keeps each step's rows its own."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lengths = [9, 2, 6, 3, 8, 2, 7, 4]  # response tokens; every row has one prompt token more
    batch = experience_batch(tokenizer, lengths)
    batch["row"] = torch.arange(len(lengths))
    steps = [[0, 1, 2, 3], [4, 5, 6, 7]]  # without a shuffle, an optimizer step of 4 rows takes 4 rows in turn
    micro = split(batch, 2, sort_rows=4)
    assert [sorted(mb["row"].tolist()) for mb in micro] == [[1, 3], [0, 2], [5, 7], [4, 6]]
    padded = sum(mb["input_ids"].numel() for mb in micro)
    unsorted = sum(mb["input_ids"].numel() for mb in split(batch, 2))
    assert (padded, unsorted) == (2 * (4 + 10 + 5 + 9), 2 * (10 + 7 + 9 + 8))
    shuffled = split(batch, 2, shuffle_seed=1, sort_rows=4)
    rows = [mb["row"].tolist() for mb in shuffled]
    assert sorted(sum(rows, [])) == list(range(8)), "a row was dropped or repeated"
    for mb in shuffled:  # trimmed to its own longest row, and that row whole
        assert mb["input_ids"].shape[1] == max(lengths[r] for r in mb["row"].tolist()) + 1
    picked = [set(sum(rows[:2], [])), set(sum(rows[2:], []))]
    assert picked != [set(s) for s in steps], "the seed did not shuffle the rows between the steps: no test"
    for step in rows[:2], rows[2:]:  # each step's two micro-batches: the shorter rows first
        assert max(lengths[r] for r in step[0]) <= min(lengths[r] for r in step[1])


def test_experience_forwards_in_length_order_give_each_row_its_own_result(tiny_model):
    """The reference, reward and critic forwards run micro-batches of rows sorted by length; each row's result
    must come back to its own place: equal to that row run alone (within its response: log-probs and values)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)
    batch = experience_batch(tokenizer, [9, 2, 6, 3, 8])
    results = {}
    for micro in (2, 1):
        args = ppo_ray.Args(micro_train_batch_size=micro, normalize_reward=False)
        results[micro] = (worker(ModelWorker, args, FakeEngine(policy), tokenizer).logprobs(batch),
                          worker(ppo_ray.CriticWorker, args, FakeEngine(critic), tokenizer).values(batch),
                          worker(ModelWorker, args, FakeEngine(critic), tokenizer).scores(batch))
    assert results[1][0].shape == batch["action_mask"].shape and results[1][2].shape == (5,)
    assert results[1][2].unique().numel() == 5, "the rows score alike: a mix-up would not show"
    mask = batch["action_mask"]  # beyond its end a row holds what its micro-batch's padding gave
    for together, alone in zip(results[2], results[1]):
        if together.dim() == 2:
            together, alone = together * mask, alone * mask
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


LENGTHS, ADVANTAGES = [2, 6, 3, 9], [1.0, -2.0, -0.5, 0.7]  # the second response: taken out by --overlong_filter


def fit_gradient(model_dir: str, rows: list[int], world_size: int = 1, rank: int = 0) -> dict:
    """The gradient of one token-mean optimizer step of fit() over these rows of the batch, on one rank of
    world_size (DeepSpeed's mean over ranks left to the caller)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    experience = experience_batch(tokenizer, LENGTHS)
    experience["action_mask"][1] = 0
    experience["advantages"] = torch.tensor(ADVANTAGES)[:, None] * experience["action_mask"]
    batch = {k: v[rows].clone() for k, v in experience.items() if k != "old_logprobs"}
    torch.manual_seed(0)
    engine = FakeEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    args = ppo_ray.Args(micro_train_batch_size=len(rows), max_epochs=1, advantage_estimator="rloo")
    worker(ppo_ray.ActorWorker, args, engine, tokenizer, rank, world_size).fit(batch, 0.0, 0)
    return engine.gradients[0]


def _rank_fit(rank: int, model_dir: str, port: int, out: str):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gradients = fit_gradient(model_dir, [2 * rank, 2 * rank + 1], 2, rank)
    for grad in gradients.values():
        torch.distributed.all_reduce(grad)
        grad /= 2  # DeepSpeed's mean over ranks
    if rank == 0:
        torch.save(gradients, out)
    torch.distributed.destroy_process_group()


def test_two_ranks_weigh_each_token_of_the_train_batch_as_one_rank_does(tiny_model, tmp_path):
    """The train batch's token count is summed over the ranks: rank 0 holds 2 of its 14 tokens (its other response
    filtered out), rank 1 holds 12; a mean per rank would weigh rank 0's tokens 6 times as much as rank 1's."""
    import torch.multiprocessing as mp

    from common.net import free_port

    out = str(tmp_path / "gradients.pt")
    mp.spawn(_rank_fit, args=(tiny_model, free_port(), out), nprocs=2, join=True)
    for name, grad in fit_gradient(tiny_model, [0, 1, 2, 3]).items():
        torch.testing.assert_close(torch.load(out)[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_metrics_of_ranks_with_unequal_tokens_weigh_each_token_alike(tiny_model):
    """Rank 0 holds 2 response tokens (its other response filtered out), rank 1 holds 12: the logged token means
    over both ranks must be those of one rank holding all four rows, not the mean of the two ranks' means."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    experience = experience_batch(tokenizer, LENGTHS)
    experience["action_mask"][1] = 0
    experience["advantages"] = torch.tensor(ADVANTAGES)[:, None] * experience["action_mask"]
    del experience["old_logprobs"]

    def fit(rows):
        torch.manual_seed(0)
        engine = FakeEngine(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
        args = ppo_ray.Args(micro_train_batch_size=len(rows), max_epochs=1, advantage_estimator="rloo")
        return worker(ppo_ray.ActorWorker, args, engine, tokenizer).fit(
            {k: v[rows].clone() for k, v in experience.items()}, 0.0, 0)

    whole = ppo_ray.mean_over_ranks([fit([0, 1, 2, 3])])
    ranks = ppo_ray.mean_over_ranks([fit([0, 1]), fit([2, 3])])
    for name in ("objective/entropy", "vllm/logprob_diff", "objective/kl"):
        assert float(ranks[name]) == pytest.approx(float(whole[name]), rel=1e-4), name
    plain = (float(fit([0, 1])["objective/entropy"]) + float(fit([2, 3])["objective/entropy"])) / 2
    assert abs(plain - float(whole["objective/entropy"])) > 1e-3, "the ranks' means agree: no test"


def test_rollout_throughput_counts_every_sampled_token_and_no_environment_token():
    """perf/rollout_tokens_per_sec counted the trained action mask: the responses --overlong_filter took out (the
    longest) were generated but not counted, and a multi-turn episode's environment tokens were never generated."""
    samples = [[{"token_ids": [5] * 8, "finish_reason": "length"}, {"token_ids": [5] * 3, "finish_reason": "stop"}],
               [{"token_ids": [5] * 6, "env_mask": [1, 1, 0, 0, 0, 1], "finish_reason": "stop"}]]
    assert ppo_ray.generated_tokens(samples) == 8 + 3 + 3


# ---------------------------------------------------------------------------------------------------- critic
def test_critic_from_reward_model_starts_on_the_normalised_reward_scale(tiny_model):
    """At step 0 a critic initialised from the reward model values a finished sequence at its normalised score,
    the scale of the rewards PPO trains on (rm.py stores the mean and std)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)
    rm.config.reward_mean, rm.config.reward_std = 0.7, 2.5
    args = ppo_ray.Args(micro_train_batch_size=4, normalize_reward=True)
    reward_model = worker(ModelWorker, args, FakeEngine(rm), tokenizer)
    critic = worker(ppo_ray.CriticWorker, args, FakeEngine(rm), tokenizer)
    batch = experience_batch(tokenizer, [3, 6])  # row 0 is shorter, so its last token has a value in the batch

    scores = reward_model.scores(batch)  # (batch,), normalised
    values = critic.values(batch)  # (batch, seq - 1): entry t is the value of the sequence up to token t
    last = int(batch["attention_mask"][0].sum()) - 1  # row 0's EOS
    raw_score = (scores[0] * 2.5 + 0.7).item()
    assert abs(scores[0].item() - raw_score) > 0.1, "mean and std leave the score unchanged: no test"
    assert values[0, last].item() == pytest.approx(scores[0].item(), abs=1e-5)
