"""The reward model is read at the same token sequence where it is trained (rm.py) and where it is used
(ppo_ray.py, rejection_sampling.py), whatever the template writes around the response.

ChatML (Qwen's template) writes "<|im_end|>\\n" after every turn; training rows used to end "<|im_end|> \\n <|im_end|>"
while PPO scored rows ending at the generated <|im_end|>, so the score was read in a context the model never saw
in training. And an input template that ends in a space ("A: ") leaves that space a token of its own after the
prompt's tokens, where rm.py's pairs, tokenized as one text, merge it into the response's first word. Each test
renders one prompt and response the way each script does and compares the token ids whose last position the reward
model reads.
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import ppo_ray
import rejection_sampling
import rm
from common import rewards
from common.placement import Cluster
from common.tiny_model import write_tiny_model

# A response that starts with a word: byte-level BPE merges the space that ends the input template ("A: ") into it
# (" the") when prompt and response are tokenized as one text, as rm.py does, but not after the prompt's own tokens.
PROMPT, RESPONSE, OTHER = "What is 3+4?", "the answer is 7", "8"


@pytest.fixture(scope="module", params=["chatml", "default"])
def reward_model(request, tmp_path_factory) -> str:
    """A reward model folder (a fresh score head on a tiny model) whose tokenizer has the chat format asked for; the
    tiny causal LM it was made from, the policy, is in its folder `policy`."""
    out = str(tmp_path_factory.mktemp(f"rm_{request.param}"))
    policy = os.path.join(out, "policy")
    write_tiny_model(policy, seed=0, chat_format=request.param, hidden_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1)
    model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def read_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The tokens of each row that the reward model reads (its score is taken at the last of them)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]


def rm_training_sequence(path, tmp_path, apply_chat_template) -> list[int]:
    """What rm.py trains and evaluates on: its own loading and collation of a pair."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = tmp_path / "pairs.jsonl"
    dataset.write_text(json.dumps({"prompt": PROMPT, "chosen": RESPONSE, "rejected": OTHER}) + "\n")
    args = rm.Args(pretrain=path, dataset=str(dataset), apply_chat_template=apply_chat_template,
                   input_template=None if apply_chat_template else "Q: {} A: ", max_len=64)
    samples = rm.load_pairs(args, tokenizer, str(dataset), "train", log=lambda msg: None)
    batch = rm.collate(samples, tokenizer, False, "cpu")  # chosen rows first
    return read_sequences(batch["input_ids"], batch["attention_mask"])[0]


def ppo_sequence(path, tmp_path, apply_chat_template) -> list[int]:
    """What ppo_ray.py's reward workers read for the response the policy generated after the prompt's tokens, as it
    is sent to vLLM, up to the EOS vLLM stops at."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    args = ppo_ray.Args(pretrain=path, apply_chat_template=apply_chat_template,
                        input_template=None if apply_chat_template else "Q: {} A: ")
    prompt = ppo_ray.load_prompts(args, tokenizer, str(prompts), "train")[0]
    generated = tokenizer(RESPONSE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # vLLM stops here
    sequence = prompt["ids"] + generated  # what the policy is trained on: the same text, other tokens after "A: "
    trained = rm_training_sequence(path, tmp_path, apply_chat_template)
    assert tokenizer.decode(sequence) == tokenizer.decode(trained)
    assert (sequence == trained) == apply_chat_template, tokenizer.convert_ids_to_tokens(sequence)
    response = tokenizer.decode(generated, skip_special_tokens=True)  # as ppo_ray.score decodes it
    batch = rewards.reward_model_batch(tokenizer, [PROMPT], [response], args.apply_chat_template, args.input_template)
    return read_sequences(batch["input_ids"], batch["attention_mask"])[0]


def rejection_sampling_sequence(path, monkeypatch, apply_chat_template) -> list[int]:
    """What rejection_sampling.py's scoring feeds the reward model, caught at the call that reads the score."""
    seen = []

    def recording(model, input_ids, attention_mask, normalize=False):
        seen.extend(read_sequences(input_ids, attention_mask))
        return torch.zeros(len(input_ids))

    monkeypatch.setattr(rewards, "sequence_rewards", recording)
    args = rejection_sampling.Args(pretrain=os.path.join(path, "policy"), reward_pretrain=[path],
                                   apply_chat_template=apply_chat_template,
                                   input_template=None if apply_chat_template else "Q: {} A: ",
                                   n_samples_per_prompt=1, generate_max_len=16)
    rejection_sampling.check_args(args)  # as main() does: fills in --max_model_len from the model
    rejection_sampling.score(args, [PROMPT], [None], [[RESPONSE]], None, "score")
    return seen[0]


@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_reward_is_read_at_the_same_tokens_in_training_and_use(reward_model, tmp_path, monkeypatch,
                                                               apply_chat_template):
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    trained = rm_training_sequence(reward_model, tmp_path, apply_chat_template)
    assert trained[-1] == tokenizer.eos_token_id
    # One EOS ends the response; a chat template also ends the user's turn with it.
    assert trained.count(tokenizer.eos_token_id) == (2 if apply_chat_template else 1), tokenizer.decode(trained)
    assert ppo_sequence(reward_model, tmp_path, apply_chat_template) == trained, tokenizer.decode(trained)
    assert rejection_sampling_sequence(reward_model, monkeypatch, apply_chat_template) == trained


class ScoringGroup:
    """A reward model's worker group as ppo_ray.score uses it, one rank, scoring here: the rows it is sent."""

    def __init__(self):
        self.rows = []

    def __len__(self):
        return 1

    def call_sharded(self, method, shards):
        self.rows += [read_sequences(part["input_ids"], part["attention_mask"]) for part in shards]
        return [torch.zeros(len(part["input_ids"])) for part in shards]

    def get(self, refs):
        return refs


def test_each_reward_model_reads_its_own_templates_rendering_not_the_policys(tmp_path):
    """A reward model whose chat template is not the policy's (same vocabulary and EOS, which both scripts check)
    was read at the policy's rendering, a format rm.py never trained it on. Now ppo_ray.py and rejection
    sampling render each pair with the reward model's own tokenizer, as rm.py did."""
    chatml, default = str(tmp_path / "chatml"), str(tmp_path / "default")
    for path, chat_format in ((chatml, "chatml"), (default, "default")):
        write_tiny_model(os.path.join(path, "policy"), seed=0, chat_format=chat_format, hidden_size=64,
                         num_layers=1, num_heads=2, num_kv_heads=1)
        AutoModelForSequenceClassification.from_pretrained(os.path.join(path, "policy"), num_labels=1).save_pretrained(
            path)
        AutoTokenizer.from_pretrained(os.path.join(path, "policy")).save_pretrained(path)
    policy_args = ppo_ray.Args(pretrain=os.path.join(default, "policy"), apply_chat_template=True,
                               reward_pretrain=[chatml, default])
    groups = [ScoringGroup(), ScoringGroup()]  # in --reward_pretrain's order
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(default, "policy"))
    response = [{"token_ids": tokenizer(RESPONSE, add_special_tokens=False)["input_ids"]}]
    ppo_ray.score(policy_args, Cluster(rewards=groups), [{"prompt": PROMPT, "ids": [], "label": None}], [response],
                  tokenizer, None)
    for group, path in zip(groups, (chatml, default)):  # (the one rank's share is padded with copies of the row)
        assert group.rows[0][0] == rm_training_sequence(path, tmp_path, True), path
    assert groups[0].rows != groups[1].rows, "the two templates render alike: no test"


def test_rm_offers_no_loss_choice_that_is_not_one(capsys):
    """OpenRLHF's logexp loss log(1 + exp(-d)) is -log sigmoid(d), rm.py's only loss: a flag choosing between the
    two names would promise a difference that does not exist."""
    from common.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(rm.Args, ["--loss", "logexp"])
    assert "--loss" in capsys.readouterr().err
    d = torch.linspace(-30, 30, 61)
    torch.testing.assert_close(rm.pairwise_loss(d, torch.zeros_like(d)), torch.log1p(torch.exp(-d)))
