"""--weight_decay under ZeRO-3: the optimizer's decayed group must hold the weight matrices, on 1 and 2 ranks.

Under ZeRO-3 a partitioned parameter's `.data` is an empty 1-D tensor, so a "matrices decay, vectors do not" rule
that reads p.ndim sent every weight to the undecayed group and --weight_decay did nothing. Each rank builds a real
training engine (common.deepspeed_utils.init_train_engine) and reports which parameters the wrapped optimizer
decays.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from common.net import free_port

WEIGHT_DECAY = 0.1


def _report_groups(rank: int, world_size: int, port: int, path: str, out: str):
    """One ZeRO-3 rank: load the tiny model partitioned, build the training engine, save {name: weight decay}."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    from common.deepspeed_utils import ds_config, init_distributed, init_train_engine, load_model

    init_distributed()
    config = ds_config(stage=3, train_batch_size=world_size, micro_batch_size=1, world_size=world_size)
    model = load_model(path, config)
    engine = init_train_engine(model, config, lr=1e-3, weight_decay=WEIGHT_DECAY, total_steps=10, warmup_ratio=0,
                               min_lr_ratio=0.1)
    zero = engine.optimizer  # DeepSpeed's ZeRO-3 optimizer; its sub-groups point back to the torch optimizer's groups
    names = {id(p): name for name, p in engine.module.named_parameters()}
    decay = {}
    for index, sub_group in enumerate(zero.fp16_groups):
        group = zero.optimizer.param_groups[zero.sub_group_to_group_id[index]]
        for p in sub_group:
            decay[names[id(p)]] = (group["weight_decay"], list(p.ds_shape), p.ds_tensor.numel() < p.ds_numel)
    if rank == 0:
        torch.save(decay, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_zero3_optimizer_decays_the_matrices(tiny_model, tmp_path, world_size):
    out = str(tmp_path / "groups.pt")
    mp.spawn(_report_groups, args=(world_size, free_port(), tiny_model, out), nprocs=world_size, join=True)
    decay = torch.load(out)
    matrices = {name for name, (_, shape, _) in decay.items() if len(shape) == 2}
    assert len(matrices) > 10, f"the tiny model should have many matrices, found {sorted(matrices)}"
    if world_size == 2:
        assert any(partitioned for *_, partitioned in decay.values()), "ZeRO-3 partitioned nothing: no test"
    wrong = {name: wd for name, (wd, shape, _) in decay.items()
             if wd != (WEIGHT_DECAY if name in matrices and "norm" not in name else 0.0)}
    assert not wrong, f"parameters in the wrong weight-decay group: {wrong}"


def test_adamw_is_torch_fused_kernel_and_steps_as_the_per_tensor_loop_does():
    """common.deepspeed_utils.adamw takes torch's fused kernel on CPU; its steps match the default loop's, decay
    groups included (the fused kernel is 5x faster on a 21M model: bench numbers in docs/ppo.md)."""
    from common.deepspeed_utils import adamw

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = [p.detach().clone() for p in models[0].parameters()]
    fused = adamw(models[0], lr=1e-2, weight_decay=WEIGHT_DECAY)
    loop = adamw(models[1], lr=1e-2, weight_decay=WEIGHT_DECAY)
    loop.defaults["fused"] = False
    for group in loop.param_groups:
        group["fused"] = False
    assert fused.defaults["fused"] and all(g["fused"] for g in fused.param_groups)
    for _ in range(5):
        x = torch.randn(8, 16)
        for model, optimizer in zip(models, (fused, loop)):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(models[0].parameters(), start))  # both really stepped
