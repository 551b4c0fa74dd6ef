"""--gradient_checkpointing under ZeRO-3, as every 8B and 70B recipe of launch/ runs it: each decoder layer's forward
runs again in the backward pass, and the update is the one without checkpointing.

transformers checkpoints only in train mode, and from_pretrained hands a model over in eval mode: until
init_train_engine switched the engine to train mode, sft.py, rm.py, dpo.py and kto.py checkpointed nothing before
their first evaluation, and the memory the flag was given for went unsaved.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from common.args import exit_if_distributed
from common.net import free_port


def _one_step(rank: int, world_size: int, port: int, path: str, checkpointing: bool, out: str):
    """One ZeRO-3 rank: one optimizer step on a micro-batch; rank 0 saves how often layer 0 ran forward, the loss and
    the updated weights."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    from common.deepspeed_utils import ds_config, gathered_state_dict, init_distributed, init_train_engine, load_model
    from common.modeling import next_token_logprobs

    init_distributed()
    config = ds_config(stage=3, train_batch_size=4 * world_size, micro_batch_size=4, world_size=world_size)
    model = load_model(path, config, gradient_checkpointing=checkpointing)
    engine = init_train_engine(model, config, lr=1e-2, weight_decay=0.0, total_steps=1, warmup_ratio=0.0,
                               min_lr_ratio=1.0)
    forwards = []
    # A pre-hook: the recomputation stops once it has what backward needs, before the layer's post-hooks would run.
    model.model.layers[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    ids = torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(rank))
    loss = -next_token_logprobs(engine, ids).mean()
    engine.backward(loss)
    engine.step()
    state = gathered_state_dict(engine.module, rank)
    if rank == 0:
        torch.save({"forwards": len(forwards), "loss": loss.item(), "state": state}, out)
    exit_if_distributed(0)


@pytest.mark.slow
def test_a_checkpointed_zero3_step_recomputes_each_layer_and_updates_as_without(tiny_model, tmp_path):
    runs = {}
    for checkpointing in (False, True):
        out = str(tmp_path / f"{checkpointing}.pt")
        mp.spawn(_one_step, args=(2, free_port(), tiny_model, checkpointing, out), nprocs=2, join=True)
        runs[checkpointing] = torch.load(out)
    assert runs[False]["forwards"] == 1 and runs[True]["forwards"] == 2, {k: v["forwards"] for k, v in runs.items()}
    assert runs[True]["loss"] == pytest.approx(runs[False]["loss"], abs=1e-6)
    for name, tensor in runs[False]["state"].items():
        torch.testing.assert_close(runs[True]["state"][name], tensor, atol=1e-6, rtol=0, msg=name)
