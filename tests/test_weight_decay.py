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

from common.args import exit_if_distributed
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
    exit_if_distributed(0)  # as the scripts end a rank: the interpreter's own exit aborts now and then


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


def test_adamw_takes_torchs_fused_kernel_and_falls_back_on_a_device_without_one(monkeypatch):
    from common.deepspeed_utils import adamw

    model = torch.nn.Linear(4, 4)
    assert adamw(model, 1e-3, 0.1).defaults["fused"] is True
    real = torch.optim.AdamW

    def without_fused(*args, fused=None, **kwargs):  # torch's refusal on a device it has no fused kernel for
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported "
                               "devices: ['cuda', 'xpu', 'privateuseone'].")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", without_fused)
    optimizer = adamw(model, 1e-3, 0.1)
    assert not optimizer.defaults["fused"] and [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
