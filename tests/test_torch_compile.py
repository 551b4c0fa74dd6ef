"""--torch_compile: each decoder layer's forward compiled (common/deepspeed_utils.py compile_blocks), and the training
the same as without it.

Compiling changes how a layer's arithmetic is grouped into kernels, not what it computes: a ZeRO-3 step on two
ranks, with gradient checkpointing recomputing each compiled layer, gives the losses and weights of the eager one.
Every layer must share the compiled graph: past torch's recompilation limit the remaining layers would run eagerly
with a warning only, the flag's speed silently gone.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from common.args import UserError, exit_if_distributed
from common.deepspeed_utils import compile_blocks
from common.net import free_port
from conftest import metrics, run_script


def test_a_model_naming_no_blocks_is_refused():
    class NoBlocks(torch.nn.Module):
        _no_split_modules = None

    with pytest.raises(UserError, match="names none; leave --torch_compile out"):
        compile_blocks(NoBlocks(), "--pretrain m")


def _steps(rank: int, world_size: int, port: int, path: str, compiled: bool, out: str):
    """Two ZeRO-3 optimizer steps of two micro-batches of changing lengths, left padding in one row; rank 0 saves the
    losses, the updated weights and how many graphs torch compiled."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch._dynamo

    from common.deepspeed_utils import ds_config, gathered_state_dict, init_distributed, init_train_engine, load_model
    from common.modeling import next_token_logprobs

    init_distributed()
    torch.manual_seed(0)
    config = ds_config(stage=3, train_batch_size=4 * world_size, micro_batch_size=2, world_size=world_size)
    model = load_model(path, config, gradient_checkpointing=True, torch_compile=compiled)
    engine = init_train_engine(model, config, lr=1e-2, weight_decay=0.0, total_steps=2, warmup_ratio=0.0,
                               min_lr_ratio=1.0)
    losses = []
    for step in range(2):
        for micro in range(2):
            seed = rank * 100 + step * 10 + micro
            ids = torch.randint(3, 300, (2, 12 + 3 * step + micro), generator=torch.Generator().manual_seed(seed))
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            loss = -next_token_logprobs(engine, ids, mask).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    state = gathered_state_dict(engine.module, rank)
    if rank == 0:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch.save({"losses": losses, "state": state, "graphs": graphs, "layers": len(model.model.layers)}, out)
    exit_if_distributed(0)


@pytest.mark.extended  # two processes compiling: about a minute on two cores with a cold compile cache
def test_compiled_layers_train_as_eager_ones_under_zero3_with_checkpointing(tiny_model, tmp_path):
    runs = {}
    for compiled in (False, True):
        out = str(tmp_path / f"{compiled}.pt")
        mp.spawn(_steps, args=(2, free_port(), tiny_model, compiled, out), nprocs=2, join=True)
        runs[compiled] = torch.load(out)
    eager, compiled = runs[False], runs[True]
    assert eager["graphs"] == 0
    # one graph for the first length, one that takes any length after: shared by every layer, forward and recompute
    assert 1 <= compiled["graphs"] <= 2 < compiled["layers"], compiled["graphs"]
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)
    # Adam's step is lr x the sign of a gradient near zero: a rounding there moves an element by up to lr (1e-2), so
    # the weights are compared element by element, a few such elements allowed (beyond 1e-5: at most 6 in 10,000 seen)
    for name, tensor in eager["state"].items():
        apart = ((compiled["state"][name] - tensor).abs() > 1e-4).float().mean().item()
        assert apart < 1e-3, (name, apart)


@pytest.mark.extended
def test_sft_with_lora_logs_the_same_losses_compiled(tiny_model, task, tmp_path):
    """The script end to end at its one-rank default (ZeRO-1), with a LoRA adapter inside the compiled layers."""
    losses = {}
    for extra in ([], ["--torch_compile"]):
        out = str(tmp_path / (extra[0][2:] if extra else "eager"))
        run_script("sft.py", ["--pretrain", tiny_model, "--dataset", task["sft_train"], "--apply_chat_template",
                              "--max_steps", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
                              "--learning_rate", "1e-3", "--lora_rank", "4", "--save_steps", "0", "--output_dir",
                              out, *extra])
        losses[bool(extra)] = [row["train/loss"] for row in metrics(out) if "train/loss" in row]
    assert len(losses[False]) == 4
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)


def _loss_and_grads(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    from common.modeling import next_token_logprobs

    logprobs = next_token_logprobs(model, ids, mask)
    loss = -(logprobs * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# What real models vary inside a block: GPT-2's Conv1D layers, a mixture of experts (fused, routed by the data),
# sliding and full attention layers (Gemma 3, gpt-oss), convolution and attention layers of a hybrid (LFM2).
FAMILIES = ["llama", "gpt2", "qwen3_moe", "gemma3_text", "gpt_oss", "lfm2"]


@pytest.mark.extended  # a compilation of 10-25 s per family on two cores
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_computes_the_same_compiled(family):
    """Loss and every gradient of a padded batch at three lengths, compiled and eager; the graphs stay few (the
    routed experts' token counts change shapes, hence more than a dense model's two)."""
    import torch._dynamo
    from model_family_table import tiny_config
    from transformers import AutoModelForCausalLM

    from common.deepspeed_utils import disable_dropout
    from common.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, build_tokenizer())).float().train()
    model.config.use_cache = False
    disable_dropout(model)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    lengths = (16, 20, 24)
    eager = [_loss_and_grads(model, ids[:, :n], mask[:, :n]) for n in lengths]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_blocks(model, family)
    compiled = [_loss_and_grads(model, ids[:, :n], mask[:, :n]) for n in lengths]
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 8
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for (loss, grads), (compiled_loss, compiled_grads) in zip(eager, compiled):
        assert compiled_loss == pytest.approx(loss, abs=1e-5)
        assert compiled_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5 * grad.abs().max().item() + 1e-7,
                                       rtol=1e-4, msg=name)
