"""--packing_samples in rm.py, dpo.py and kto.py: a packed micro-batch gives the padded batch's per-sequence rewards
or log-probs, loss and gradients, on the default tiny model and on a tied-embedding Qwen2 with ChatML; a packed row
whose samples can see each other does not, which shows these comparisons can fail."""

import json
import math

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import dpo
import kto
import rm
from common import data
from common.args import PACKING_IGNORED
from common.modeling import packed_sample_ends, scalar_head_parts, sequence_rewards, sequence_sums
from common.net import free_port
from common.tiny_model import write_tiny_model

MAX_LEN = 64


@pytest.fixture(scope="module", params=["llama", "qwen2 tied, chatml"])
def model_dir(request, tiny_model, tmp_path_factory) -> str:
    if request.param == "llama":
        return tiny_model
    # A Qwen2 always has q/k/v biases (build_model refuses attention_bias for it).
    return write_tiny_model(str(tmp_path_factory.mktemp("tied_model")), seed=0, architecture="qwen2",
                            tie_word_embeddings=True, chat_format="chatml")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def pair_rows(n: int = 5) -> list[dict]:
    """Preference rows whose prompts and responses all differ in length."""
    return [{"prompt": f"What is {a}+{2 * a + 1}?" + " Think it over." * (a % 4),
             "chosen": f"{3 * a + 1}" + " is the sum" * (a % 3), "rejected": "No idea" + "!" * (5 * a % 7)}
            for a in range(n)]


def policy_and_reference(model_dir):
    """The reference as saved and a policy moved away from it, so that the log-ratios are not all 0."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, reference


def gradients(model) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return grads


def leaky(packed: dict) -> dict:
    """The packed row with a causal mask over all of it: each sample attends to the samples before it."""
    return {**packed, "attention_mask": torch.ones_like(packed["input_ids"])}


class EngineLike(torch.nn.Module):
    """Stands in for a DeepSpeed engine: the model under `.module`, and a forward that counts its calls. An engine
    does its gradient-accumulation bookkeeping in its forward; under ZeRO-3 a forward that bypasses it (the backbone
    called directly) makes each micro-batch's gradient replace the one before instead of adding to it."""

    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def assert_leaks(leaked: torch.Tensor, expected: torch.Tensor) -> None:
    """The first sample of the row has nothing before it to see; the others are clearly off."""
    assert (leaked[0] - expected[0]).abs() < 1e-5
    assert (leaked[1:] - expected[1:]).abs().median() > 1e-3


def assert_packed_row(padded: dict, packed: dict) -> None:
    """One row holding exactly the padded batch's real tokens, each sample's first token out of the loss mask (so
    that nothing is trained on a prediction made across a boundary)."""
    assert packed["input_ids"].shape == (1, padded["attention_mask"].sum())
    assert (packed["loss_mask"][0, packed["position_ids"][0] == 0] == 0).all()


# ---------------------------------------------------------------------------------------------------- helpers
def test_sequence_sums_cut_a_packed_row_at_each_restart_and_drop_the_boundary_entry():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    values = torch.arange(1.0, 9.0)[None]  # entry t is for token t + 1: 3 and 5 predict across a boundary
    assert sequence_sums(values, position_ids).tolist() == [1 + 2, 4, 6 + 7 + 8]
    assert sequence_sums(values.view(2, 4)).tolist() == [10, 26]  # padded rows: one sequence each
    assert packed_sample_ends(position_ids).tolist() == [2, 4, 8]


# --------------------------------------------------------------------------------------------------------- rm
def test_rm_packed_rewards_loss_and_gradients_equal_padded(model_dir, tokenizer, tmp_path):
    dataset = tmp_path / "pairs.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in pair_rows()))
    args = rm.Args(pretrain=model_dir, dataset=str(dataset), apply_chat_template=True, max_len=MAX_LEN)
    samples = rm.load_pairs(args, tokenizer, str(dataset), "train", log=lambda msg: None)
    torch.manual_seed(0)  # the score head is new weights
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                               pad_token_id=tokenizer.pad_token_id)
    padded, packed = (rm.collate(samples, tokenizer, packing, "cpu") for packing in (False, True))
    assert_packed_row(padded, packed)
    ends = packed["input_ids"][0, packed_sample_ends(packed["position_ids"])]
    assert (ends == tokenizer.eos_token_id).all()  # each sequence is read at its own EOS

    rewards, losses, grads = [], [], []
    for batch in (padded, packed):
        chosen, rejected = rm.forward_rewards(model, batch)
        loss = rm.pairwise_loss(chosen, rejected, batch["margin"]).mean()
        loss.backward()
        rewards.append(torch.cat([chosen, rejected]).detach())
        losses.append(loss.item())
        grads.append(gradients(model))
    torch.testing.assert_close(rewards[1], rewards[0], rtol=0, atol=1e-5)
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    engine = EngineLike(model)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(rm.forward_rewards(engine, packed)), rewards[0], rtol=0, atol=1e-5)
    assert engine.calls == 1  # through the engine's forward, not around it

    # The same row and read-out with a causal mask over the whole row: every sample but the first scores differently.
    _, backbone, head = scalar_head_parts(model)
    with torch.no_grad():
        hidden = backbone(input_ids=packed["input_ids"], attention_mask=leaky(packed)["attention_mask"],
                          position_ids=packed["position_ids"], use_cache=False).last_hidden_state
        leaked = head(hidden[0, packed_sample_ends(packed["position_ids"])]).squeeze(-1)
    assert_leaks(leaked, rewards[0])


def test_rm_packed_rewards_through_an_engine_over_a_peft_lora_model_equal_padded(tiny_model):
    """LoRA (peft) wraps the model and its score head (ModulesToSaveWrapper), and DeepSpeed wraps that: the packed
    path reaches through both."""
    from peft import LoraConfig, get_peft_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    samples = data.build_preference_samples(pair_rows(), tokenizer, "pairs.jsonl", "prompt", "chosen", "rejected",
                                            MAX_LEN, apply_chat_template=True, end_with_eos=True, log=lambda m: None)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32,
                                                              pad_token_id=tokenizer.pad_token_id)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="SEQ_CLS"))
    with torch.no_grad():  # adapters and a head as after training (fresh B matrices are 0)
        for name, p in model.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                p.add_(0.05 * torch.randn_like(p))
    padded, packed = (rm.collate(samples, tokenizer, packing, "cpu") for packing in (False, True))
    with torch.no_grad():
        expected = sequence_rewards(model, padded["input_ids"], padded["attention_mask"])  # peft's own forward
        with model.disable_adapter():
            unadapted = sequence_rewards(model, padded["input_ids"], padded["attention_mask"])
        got = torch.cat(rm.forward_rewards(EngineLike(model), packed))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got - unadapted).abs().max() > 1e-3  # the adapters and the trained head took part


# -------------------------------------------------------------------------------------------------------- dpo
def test_dpo_packed_logps_loss_and_gradients_equal_padded(model_dir, tokenizer):
    samples = data.build_preference_samples(pair_rows(), tokenizer, "pairs.jsonl", "prompt", "chosen", "rejected",
                                            MAX_LEN, apply_chat_template=True, log=lambda m: None)
    policy, reference = policy_and_reference(model_dir)
    padded, packed = (dpo.collate(samples, tokenizer, packing, "cpu") for packing in (False, True))
    assert_packed_row(padded, packed)

    logps, losses, grads, chosen_tokens = [], [], [], []
    for batch in (padded, packed):
        with torch.no_grad():
            ref_chosen, ref_rejected = dpo.forward_logps(reference, batch)
        chosen, rejected = dpo.forward_logps(policy, batch)
        step_losses, _, _ = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
        step_losses.mean().backward()
        logps.append(torch.cat([chosen, rejected, ref_chosen, ref_rejected]).detach())
        losses.append(step_losses.detach())
        grads.append(gradients(policy))
        # the NLL term's token count, as dpo.py's main() takes it
        chosen_tokens.append(sequence_sums(batch["loss_mask"][:, 1:], batch.get("position_ids"))[: len(samples)])
    torch.testing.assert_close(logps[1], logps[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    assert chosen_tokens[1].tolist() == chosen_tokens[0].tolist() == [sum(s["chosen"]["loss_mask"]) for s in samples]
    assert (losses[0] - losses[0].mean()).abs().max() > 1e-3  # the pairs differ: the comparison is not of constants

    with torch.no_grad():
        leaked = torch.cat(dpo.forward_logps(policy, leaky(packed)))
    assert_leaks(leaked, logps[0][: 2 * len(samples)])


# -------------------------------------------------------------------------------------------------------- kto
@pytest.fixture
def one_rank_group():
    """kl_reference_point averages across ranks: a world of one."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_kto_packed_logps_loss_and_gradients_equal_padded(model_dir, tokenizer, one_rank_group):
    rows = [{"prompt": r["prompt"], "response": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
            for i, r in enumerate(pair_rows(6))]
    samples = data.build_kto_samples(rows, tokenizer, "kto.jsonl", "prompt", "response", "label", MAX_LEN,
                                     apply_chat_template=True, log=lambda m: None)
    policy, reference = policy_and_reference(model_dir)
    padded, packed = (kto.collate(samples, tokenizer, MAX_LEN, packing, "cpu") for packing in (False, True))
    assert_packed_row(padded, packed)  # the mismatched pairs' first tokens too

    logps, losses, grads = [], [], []
    for batch in (padded, packed):
        with torch.no_grad():
            ref_logps, ref_kl_logps = kto.forward_logps(reference, batch)
        policy_logps, kl_logps = kto.forward_logps(policy, batch)
        kl = kto.kl_reference_point(kl_logps, ref_kl_logps)
        step_losses, _ = kto.kto_loss(policy_logps, ref_logps, batch["labels"], kl, beta=0.1)
        step_losses.mean().backward()
        logps.append(torch.cat([policy_logps, kl_logps, ref_logps, ref_kl_logps]).detach())
        losses.append(torch.cat([step_losses.detach(), kl[None]]))
        grads.append(gradients(policy))
    torch.testing.assert_close(logps[1], logps[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)

    with torch.no_grad():
        leaked = torch.cat(kto.forward_logps(policy, leaky(packed)))
    assert_leaks(leaked, logps[0][: 2 * len(samples)])


def test_kto_evaluation_never_pairs_a_lone_sample_with_its_own_response(model_dir, tokenizer, one_rank_group,
                                                                          monkeypatch):
    """An eval chunk of one sample (9 samples, micro-batch 8) made the sample its own "next sample": z0 was its own
    log-ratio, and eval/loss moved with it. Every mismatched row is now another sample's response."""
    rows = [{"prompt": r["prompt"], "response": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
            for i, r in enumerate(pair_rows(9))]
    samples = data.build_kto_samples(rows, tokenizer, "kto.jsonl", "prompt", "response", "label", MAX_LEN,
                                     apply_chat_template=True, log=lambda m: None)
    policy, reference = policy_and_reference(model_dir)
    collate, seen = kto.collate, []

    def recording(chunk, *args, **kwargs):
        batch = collate(chunk, *args, **kwargs)
        seen.append((len(chunk), batch["input_ids"]))
        return batch

    monkeypatch.setattr(kto, "collate", recording)
    args = kto.Args(pretrain=model_dir, dataset="unused", micro_train_batch_size=8, max_len=MAX_LEN)
    metrics = kto.evaluate(policy, reference, samples, args, tokenizer, rank=0, world_size=1)
    assert [n for n, _ in seen] == [8, 1] and math.isfinite(metrics["eval/loss"])
    for n, input_ids in seen:
        for own, mismatched in zip(input_ids[:n], input_ids[n:]):
            assert not torch.equal(own, mismatched)


def test_kto_mismatched_pairs_never_pair_a_prompt_with_a_response_to_it(model_dir, tokenizer, one_rank_group,
                                                                         monkeypatch):
    """docs/kto.md builds KTO data from preference pairs, chosen then rejected on consecutive lines. Evaluated in
    file order, each prompt was paired with the next line's response: half the "mismatched" pairs were the other
    side of the same prompt, and z0 (so eval/loss) moved with the file's order. Now no pair shares a prompt where
    the micro-batch holds another."""
    rows = [{"prompt": r["prompt"], "response": r[side], "label": side == "chosen"}
            for r in pair_rows(8) for side in ("chosen", "rejected")]
    samples = data.build_kto_samples(rows, tokenizer, "kto.jsonl", "prompt", "response", "label", MAX_LEN,
                                     apply_chat_template=True, log=lambda m: None)
    assert samples[0]["prompt_text"] == samples[1]["prompt_text"], "the layout's neighbours differ: no test"
    partners, seen = kto.mismatched_partners, []
    monkeypatch.setattr(kto, "mismatched_partners", lambda chunk: seen.append((chunk, partners(chunk))) or seen[-1][1])
    policy, reference = policy_and_reference(model_dir)
    args = kto.Args(pretrain=model_dir, dataset="unused", micro_train_batch_size=4, max_len=MAX_LEN)
    kto.evaluate(policy, reference, samples, args, tokenizer, rank=0, world_size=1)
    assert len(seen) == 4
    for chunk, others in seen:
        assert sorted(map(id, others)) == sorted(map(id, chunk)), "each response once"
        assert all(s["prompt_text"] != o["prompt_text"] for s, o in zip(chunk, others))
    assert partners(samples[:4])[0] is samples[2], "not the next pair's sample: the smallest shift that works"
    one_prompt = samples[:2]  # no other prompt to pair with: the rotation by one, as before
    assert partners(one_prompt) == [samples[1], samples[0]]


# ------------------------------------------------------------------------------------- families that cannot pack
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2}
SMALL_BY_FAMILY = {"opt": {"ffn_dim": 128, "word_embed_proj_dim": 64}, "mpt": {"d_model": 64, "n_layers": 2,
                                                                                "n_heads": 4}}


def packed_drift(model_type: str) -> float:
    """How far a sequence's last hidden state moves when it is packed after another one (position_ids restarting,
    no attention_mask), relative to its size, in a tiny random model of this type: 0 where the row is cut."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **SMALL, **SMALL_BY_FAMILY.get(model_type, {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    first, second = (torch.arange(8) * 7 + 3)[None] % 300, (torch.arange(4) * 11 + 5)[None] % 300
    hidden = lambda ids, pos=None: model(input_ids=ids, position_ids=pos, use_cache=False,
                                         output_hidden_states=True).hidden_states[-1]
    with torch.no_grad():
        alone = hidden(second)
        packed = hidden(torch.cat([first, second], 1), torch.cat([torch.arange(8), torch.arange(4)])[None])[:, 8:]
    return ((packed - alone).abs().max() / alone.abs().max()).item()


@pytest.mark.parametrize("model_type", [t for t in PACKING_IGNORED if t not in ("mamba2", "falcon_mamba", "rwkv")])
def test_the_families_refused_with_packing_mix_a_packed_rows_sequences(model_type):
    """Each model type --packing_samples refuses still reads a packed row as one sequence (drop it from
    PACKING_IGNORED once transformers cuts its rows), and the ones it allows do not (the next test)."""
    assert packed_drift(model_type) > 0.01


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma2", "gpt2", "gpt_neox", "phi", "qwen3"])
def test_the_families_that_pack_keep_a_packed_rows_sequences_apart(model_type):
    assert packed_drift(model_type) < 1e-5


def test_a_hub_name_in_the_local_cache_is_checked_as_its_folder_would_be(tmp_path, monkeypatch):
    """`--pretrain facebook/opt-125m` (a hub name, its files in the local hub cache) skipped every config check:
    packing an OPT model was accepted, and its packed samples attended to each other."""
    from huggingface_hub import constants

    from common.args import UserError, check_packing, config_file, model_max_len

    snapshot = tmp_path / "hub" / "models--someone--tiny-opt" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "opt", "max_position_embeddings": 2048}))
    (tmp_path / "hub" / "models--someone--tiny-opt" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-opt" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert config_file("someone/tiny-opt") == str(snapshot / "config.json")
    with pytest.raises(UserError, match=r"--pretrain someone/tiny-opt is a 'opt' model"):
        check_packing("someone/tiny-opt")
    assert model_max_len("someone/tiny-opt") == 2048
    assert config_file("someone/not-cached") is None and config_file("not a / valid name") is None


@pytest.mark.parametrize("script", ["sft", "rm", "dpo", "kto", "ppo_ray"])
def test_packing_a_family_that_cannot_is_refused_before_anything_loads(script, tmp_path):
    """An OPT model with --packing_samples: one sentence, before any model loads (the config alone tells)."""
    import importlib

    from common.args import UserError, parse_args

    model_dir = tmp_path / "opt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "opt", "architectures": ["OPTForCausalLM"]}))
    module = importlib.import_module(script)
    data_flag = {"ppo_ray": ["--prompt_data", "unused.jsonl", "--reward_fn", "unused.py:f"]}.get(
        script, ["--dataset", "unused.jsonl"])
    args = parse_args(module.Args, ["--pretrain", str(model_dir), *data_flag, "--packing_samples",
                                    "--output_dir", str(tmp_path / "out")])
    check = module.check_args if script == "ppo_ray" else module.main
    with pytest.raises(UserError, match=r"is a 'opt' model, whose attention does not restart at each sequence of a "
                                        r"packed row: .* Leave out --packing_samples\.$"):
        check(args)
    assert not (tmp_path / "out").exists()


def test_ppo_packing_checks_the_critic_where_it_starts_from_the_reward_model(tiny_model, tmp_path):
    """With gae and no --critic_pretrain the critic starts from --reward_pretrain's model and trains packed: that
    model's family was never checked, and an OPT reward model's packed samples would attend to each other."""
    import ppo_ray
    from common.args import UserError, parse_args

    reward_model = tmp_path / "opt_rm"
    reward_model.mkdir()
    (reward_model / "config.json").write_text(json.dumps({"model_type": "opt",
                                                          "architectures": ["OPTForSequenceClassification"]}))
    argv = ["--pretrain", tiny_model, "--prompt_data", "unused.jsonl", "--reward_pretrain", str(reward_model),
            "--packing_samples", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(UserError, match=r"--reward_pretrain \(where the critic starts\) .* is a 'opt' model"):
        ppo_ray.check_args(parse_args(ppo_ray.Args, argv))
