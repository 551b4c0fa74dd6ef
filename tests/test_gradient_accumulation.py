"""A critic update under ZeRO-3 equals the same update under ZeRO-0, over a step that accumulates micro-batches.

ppo_ray.py's critic computed its values through the model's backbone, reached under the DeepSpeed engine, so its
forwards bypassed the engine's own forward, where DeepSpeed prepares ZeRO's gradient accumulation. Under ZeRO-3, with
two micro-batches per optimizer step, the update then came out different from ZeRO-0's (by 2 x the learning rate in
places, Adam's first step flipping sign), silently, while ZeRO-0 matched. common/modeling.py now calls the model
whole (final_hidden_states).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from common.args import exit_if_distributed
from common.modeling import scalar_head_parts, token_values
from common.net import free_port
from common.tiny_model import write_tiny_model


def _critic_step(rank: int, port: int, path: str, stage: int, out: str):
    """One rank: ppo_ray.CriticWorker, loaded as ppo_ray loads it, takes one step of 2 accumulated micro-batches."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu")
    import ppo_ray
    from common.deepspeed_utils import gathered_state_dict

    args = ppo_ray.Args(pretrain=path, zero_stage=stage, train_batch_size=8, micro_train_batch_size=4,
                        critic_learning_rate=1e-2, warmup_ratio=0.0, max_epochs=1, normalize_reward=False)
    worker = ppo_ray.CriticWorker()
    worker.setup(args, path, 10)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (8, 12), generator=g)
    experience = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "action_mask": torch.ones(8, 11, dtype=torch.long), "values": torch.zeros(8, 11),
                  "returns": torch.randn(8, 11, generator=g)}
    worker.fit(experience)
    if rank == 0:
        torch.save(gathered_state_dict(worker.engine.module, 0), out)
    exit_if_distributed(0)  # as the scripts end a rank: the interpreter's own exit aborts now and then


@pytest.mark.slow
def test_a_zero3_critic_step_over_two_micro_batches_matches_zero0(tiny_model, tmp_path):
    states = {}
    for stage in (3, 0):
        out = str(tmp_path / f"zero{stage}.pt")
        mp.spawn(_critic_step, args=(free_port(), tiny_model, stage, out), nprocs=1, join=True)
        states[stage] = torch.load(out)
    start = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).state_dict()
    moved = max((states[0][k] - start[k]).abs().max().item() for k in states[0])
    assert moved > 5e-3  # the step did something (Adam's first step moves each weight by about the learning rate)
    # Adam's first step divides each gradient by its own size, so float-rounding differences in the smallest
    # gradients show as up to ~3e-4 here; the bypassed forward differed by 2e-2 (twice the learning rate).
    for name, tensor in states[0].items():
        torch.testing.assert_close(states[3][name], tensor, atol=1e-3, rtol=0, msg=name)


@pytest.mark.parametrize("variant", [{}, {"architecture": "qwen2", "tie_word_embeddings": True}])
def test_token_values_read_the_final_normed_hidden_states(variant, tmp_path):
    """The values come from the last layer's states after the final norm, as the backbone's last_hidden_state."""
    path = write_tiny_model(str(tmp_path / "model"), seed=0, **variant)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    ids = torch.randint(3, 300, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    _, backbone, head = scalar_head_parts(model)
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        expected = head(backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state)
        torch.testing.assert_close(token_values(model, ids, mask), expected.squeeze(-1))


def _zero0_steps(rank: int, world_size: int, port: int, path: str, out: str):
    """One ZeRO-0 rank: two optimizer steps of 2 micro-batches per rank through init_train_engine; rank 0 also takes
    the same steps in plain torch over every rank's micro-batches, and saves both models and the engine's flag."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    from common.deepspeed_utils import adamw, cosine_schedule, ds_config, init_distributed, init_train_engine
    from common.modeling import next_token_logprobs

    init_distributed()
    g = torch.Generator().manual_seed(1)
    steps = [[torch.randint(3, 300, (4, 12), generator=g) for _ in range(2 * world_size)] for _ in range(2)]
    config = ds_config(0, 8 * world_size, 4, world_size)
    engine = init_train_engine(AutoModelForCausalLM.from_pretrained(path), config, lr=1e-3, weight_decay=0.1,
                               total_steps=2, warmup_ratio=0.0, min_lr_ratio=0.1)
    training = engine.module.training  # from_pretrained hands the model over in eval mode
    for micro_batches in steps:
        for ids in micro_batches[2 * rank: 2 * rank + 2]:
            engine.backward(-next_token_logprobs(engine, ids).mean())
            engine.step()
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(path)
        optimizer = adamw(plain, 1e-3, 0.1)
        schedule = cosine_schedule(optimizer, 2, 0.0, 0.1)
        for micro_batches in steps:
            for ids in micro_batches:
                (-next_token_logprobs(plain, ids).mean() / len(micro_batches)).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        torch.save({"reduces": engine.enable_backward_allreduce, "training": training,
                    "engine": engine.module.state_dict(),
                    "plain": plain.state_dict()}, out)
    exit_if_distributed(0)  # as the scripts end a rank: the interpreter's own exit aborts now and then


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_zero0_update_averages_over_the_ranks_and_skips_the_reduction_on_one(tiny_model, tmp_path, world_size):
    """init_train_engine turns DeepSpeed's gradient all-reduce off on one ZeRO-0 rank, where it only copies; on two
    ranks it must stay on, or each rank would step on its own gradients and the replicas drift apart.

    The engine starts in train mode: in the eval mode from_pretrained leaves a model in, SFT trained without its
    dropout and --gradient_checkpointing did nothing until the first evaluation switched the model over."""
    out = str(tmp_path / "states.pt")
    mp.spawn(_zero0_steps, args=(world_size, free_port(), tiny_model, out), nprocs=world_size, join=True)
    saved = torch.load(out)
    assert saved["training"]
    assert saved["reduces"] == (world_size > 1)
    start = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert max((saved["plain"][k] - start[k]).abs().max().item() for k in start) > 1e-3  # the steps moved it
    for name, tensor in saved["plain"].items():
        torch.testing.assert_close(saved["engine"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("total,ratio,expected", [
    (3, 0.03, [1.0, 0.55, 0.1]),  # a 1-step warmup: the peak at step 0, the floor at the last step
    (5, 0.4, [0.5, 1.0, 0.775, 0.325, 0.1]),
    (4, 0.0, [1.0, 0.775, 0.325, 0.1]),
])
def test_the_schedule_takes_the_peak_once_and_ends_at_the_floor(total, ratio, expected):
    """The decay ran to (total - 1 - warmup) / (total - warmup) of the way, so no run reached min_lr_ratio (3 steps:
    0.55 where 0.1 was asked for), and the step after the warmup repeated the peak."""
    from common.deepspeed_utils import cosine_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = cosine_schedule(optimizer, total, ratio, 0.1)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx(expected)


def test_a_run_resumed_with_more_steps_takes_its_own_schedule_from_the_first_resumed_step():
    """A run of 10 steps saved at step 4, resumed as a run of 40 (--max_steps raised): the optimizer's saved state
    brought back the 10-step schedule's rate for step 4, and only step 5 took the 40-step one's."""
    from common.checkpoint import follow_schedule
    from common.deepspeed_utils import cosine_schedule

    def run(total: int):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return optimizer, cosine_schedule(optimizer, total, 0.3, 0.1)

    optimizer, schedule = run(10)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    saved = optimizer.state_dict(), schedule.state_dict()
    extended, rates = run(40), []
    for _ in range(6):  # the 40-step run's own rates, steps 0-5
        rates.append(extended[0].param_groups[0]["lr"])
        extended[0].step()
        extended[1].step()
    optimizer, schedule = run(40)
    optimizer.load_state_dict(saved[0])
    schedule.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] != pytest.approx(rates[4])  # the 10-step schedule's rate came back
    follow_schedule(schedule)
    for step in (4, 5):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(rates[step]) == schedule.get_last_lr()[0], step
        optimizer.step()
        schedule.step()
