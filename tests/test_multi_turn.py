"""common/multi_turn.py: episodes of the policy and an environment, as token ids, on both chat formats."""

import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, SEED, expect, mean, metrics, run_script
from sum_env import make_env
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from common.args import UserError
from common.data import load_records, render_prompt
from common.multi_turn import run_episodes
from common.tiny_model import build_tokenizer


def scripted_policy(tokenizer, answers: list[str], truncate_at: int | None = None, end: str | None = None):
    """A stand-in for vLLM: turn k of every episode answers answers[k], ended by the end-of-turn token `end` (default
    the EOS) the way vLLM returns it, unless cut at `truncate_at` tokens; records the sequences and limits it was
    given."""
    calls = []
    end_id = tokenizer.convert_tokens_to_ids(end or tokenizer.eos_token)

    def generate(requests, limits):
        ids_list = [r["ids"] for r in requests]
        calls.append((ids_list, limits))
        turn = len(calls) - 1
        outs = []
        for limit in limits:
            tokens = tokenizer(answers[turn], add_special_tokens=False)["input_ids"] + [end_id]
            reason = "stop"
            if len(tokens) > min(limit, truncate_at or limit):
                tokens, reason = tokens[:min(limit, truncate_at or limit)], "length"
            outs.append({"token_ids": tokens, "logprobs": [-0.5] * len(tokens), "finish_reason": reason})
        return outs

    return generate, calls


# Llama-2-chat's shape: the assistant's turn is " " + content + " " + EOS, each user turn opens with BOS
LLAMA2_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}"
                   "{{ bos_token + '[INST] ' + m['content'].strip() + ' [/INST]' }}"
                   "{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}")


def unlisted_end_of_turn_tokenizer():
    """ChatML whose end-of-turn token is in the vocabulary but not among the tokenizer's special tokens: Phi-3's
    <|end|>, or a Llama-3 base model's <|eot_id|> under its chat template (vLLM stops at them through the model's
    generation_config)."""
    chatml = build_tokenizer(chat_format="chatml")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer, pad_token="<pad>",
                                        eos_token="<|endoftext|>", chat_template=chatml.chat_template)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in tokenizer.all_special_ids
    return tokenizer


@pytest.mark.parametrize("chat_format", ["default", "chatml", "llama-2", "unlisted end of turn"])
def test_an_episode_is_the_conversation_the_chat_template_writes(chat_format):
    """Two wrong answers, then the right one: the episode's tokens are exactly the template's rendering of that
    conversation (ChatML puts a newline after each end-of-turn token, the default template does not, Llama-2 a space
    before it, which wrote the EOS a second time, as did an end-of-turn token the tokenizer does not list as
    special), and only the policy's own tokens are marked as trainable."""
    if chat_format == "unlisted end of turn":
        tokenizer = unlisted_end_of_turn_tokenizer()
    else:
        tokenizer = build_tokenizer(chat_format="default" if chat_format == "llama-2" else chat_format)
    if chat_format == "llama-2":
        tokenizer.chat_template = LLAMA2_TEMPLATE
    end = "<|im_end|>" if chat_format == "unlisted end of turn" else tokenizer.eos_token
    turn = " {} " if chat_format == "llama-2" else "{}"  # what the policy writes before its end-of-turn token
    question = "What is 2+3?"
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as common/data.load_prompts
    prompt = {"prompt": question, "ids": prompt_ids, "label": "5"}
    generate, calls = scripted_policy(tokenizer, [turn.format(answer) for answer in "475"], end=end)

    [[episode]] = run_episodes(generate, make_env, tokenizer, [prompt], 1, max_turns=4, max_len=64,
                               chat_template=True, input_template=None, prompt_max_len=64)

    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "higher"}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "lower"}, {"role": "assistant", "content": "5"}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    whole = whole[: whole.rindex(end) + len(end)]  # the episode ends at the end-of-turn token
    assert episode["prompt_ids"] + episode["token_ids"] == tokenizer(whole, add_special_tokens=False)["input_ids"]
    # 4, told higher: 7 (followed, 1), told lower: 5 (followed and right, 2)
    assert episode["reward"] == 3.0 and episode["turns"] == 3 and len(calls) == 3
    policy = [t for t, m in zip(episode["token_ids"], episode["env_mask"]) if m]
    assert tokenizer.decode(policy) == "".join(turn.format(answer) + end for answer in "475")
    assert [lp for lp, m in zip(episode["logprobs"], episode["env_mask"]) if not m] == [0.0] * (
        len(episode["env_mask"]) - sum(episode["env_mask"]))
    # each turn continued the sequence so far, with the tokens left of the budget as its limit
    assert calls[1][0][0] == prompt_ids + episode["token_ids"][: len(calls[1][0][0]) - len(prompt_ids)]
    assert [c[1][0] for c in calls] == [64 - (len(c[0][0]) - len(prompt_ids)) for c in calls]


def test_each_turn_s_experts_are_kept_for_the_tokens_it_fed_first():
    """--routing_replay on a mixture of experts: vLLM hands back the experts of every token a turn fed (the episode
    so far and its response but the last token); the episode keeps each token's from the turn that first fed it."""
    tokenizer = build_tokenizer()
    prompt = {"prompt": "What is 2+3?", "ids": tokenizer("Q: What is 2+3? A:")["input_ids"], "label": "5"}
    scripted, calls = scripted_policy(tokenizer, ["4", "7", "5"])

    def generate(requests, limits):  # each turn routes every token it feeds to "expert" = the turn's number
        outs = scripted(requests, limits)
        for request, out in zip(requests, outs):
            fed = len(request["ids"]) + len(out["token_ids"]) - 1
            out["routes"] = np.full((fed, 1, 1), len(calls) - 1, dtype=np.int16)
        return outs

    [[e]] = run_episodes(generate, make_env, tokenizer, [prompt], 1, max_turns=4, max_len=64, chat_template=False,
                         input_template=None, prompt_max_len=64)
    assert e["turns"] == 3
    fed = [len(ids[0]) + len(tokenizer(answer, add_special_tokens=False)["input_ids"])
           for (ids, _), answer in zip(calls, "475")]  # each turn's fed tokens: its input and its response less one
    expected = np.concatenate([np.full(b - a, turn) for turn, (a, b) in enumerate(zip([0, *fed], fed))])
    assert len(e["routes"]) == len(e["prompt_ids"]) + len(e["token_ids"]) - 1
    assert (e["routes"][:, 0, 0] == expected).all()


def test_episodes_end_at_max_turns_at_the_budget_and_without_a_chat_template():
    tokenizer = build_tokenizer()
    prompt = {"prompt": "What is 2+3?", "ids": tokenizer("Q: What is 2+3? A:")["input_ids"], "label": "5"}
    # never right: the episode ends after max_turns, with 1 for moving up as told; n episodes per prompt, each
    # with its own environment
    generate, calls = scripted_policy(tokenizer, ["1", "2", "3", "4"])
    [episodes] = run_episodes(generate, make_env, tokenizer, [prompt], 3, max_turns=2, max_len=64,
                              chat_template=False, input_template=None, prompt_max_len=64)
    assert len(episodes) == 3 and len(calls) == 2 and all(len(c[0]) == 3 for c in calls)
    for e in episodes:  # without a template the reply's text is appended as it is
        assert e["turns"] == 2 and e["reward"] == 1.0
        assert tokenizer.decode(e["token_ids"]) == "1" + tokenizer.eos_token + "higher2" + tokenizer.eos_token
    # a turn cut at its limit ends the episode, with the finish reason that --overlong_filter looks for
    generate, _ = scripted_policy(tokenizer, ["123456789"], truncate_at=2)
    [[e]] = run_episodes(generate, make_env, tokenizer, [prompt], 1, max_turns=4, max_len=64, chat_template=False,
                         input_template=None, prompt_max_len=64)
    assert e["turns"] == 1 and e["finish_reason"] == "length" and len(e["token_ids"]) == 2
    # a reply that leaves no room for another turn ends the episode before it is appended
    generate, _ = scripted_policy(tokenizer, ["1", "2"])
    first_turn = len(tokenizer("1", add_special_tokens=False)["input_ids"]) + 1
    [[e]] = run_episodes(generate, make_env, tokenizer, [prompt], 1, max_turns=4, max_len=first_turn + 2,
                         chat_template=False, input_template=None, prompt_max_len=64)
    assert e["turns"] == 1 and e["finish_reason"] == "length" and sum(e["env_mask"]) == len(e["token_ids"])


def test_the_overlong_penalty_counts_the_environments_tokens_as_the_budget_does():
    """--generate_max_len bounds an episode's tokens, the environment's replies included: an episode that used all
    of them gets the whole --overlong_penalty_factor, though fewer of its tokens are the policy's."""
    import ppo_ray

    tokenizer = build_tokenizer()
    prompt = {"prompt": "What is 2+3?", "ids": tokenizer("Q: What is 2+3? A:")["input_ids"], "label": "5"}
    generate, _ = scripted_policy(tokenizer, ["1", "2"])
    [[e]] = run_episodes(generate, make_env, tokenizer, [prompt], 1, max_turns=2, max_len=64, chat_template=False,
                         input_template=None, prompt_max_len=64)
    budget = len(e["token_ids"])  # "1<eos>higher2<eos>": the episode filled it
    assert sum(e["env_mask"]) < budget and e["reward"] == 1.0
    args = SimpleNamespace(env_fn="sum_env.py:make_env", n_samples_per_prompt=1, reward_clip=10.0,
                           generate_max_len=budget, overlong_buffer_len=4, overlong_penalty_factor=1.0)
    scores, metrics = ppo_ray.score(args, None, [prompt], [[e]], tokenizer, None)
    assert scores.tolist() == [0.0] and metrics["rewards/overlong_penalty"].item() == -1.0
    assert metrics["objective/reward_clipped"].item() == 0.0
    e["reward"] = 12.5  # past --reward_clip: cut to 10 and counted
    scores, metrics = ppo_ray.score(args, None, [prompt], [[e]], tokenizer, None)
    assert scores.tolist() == [9.0] and metrics["objective/reward_clipped"].item() == 1.0


@pytest.mark.parametrize("flags", [{"env_fn": "sum_env.py:make_env", "reward_fn": None},
                                   {"reward_fn": "r.py:f"}, {"reward_pretrain": ["rm"], "reward_fn": None}])
def test_prompts_keep_their_labels_for_whatever_reads_them(tmp_path, capsys, flags):
    """The environment's reset gets each prompt's label, as a reward function does; prompts that lack one are
    reported only where something reads them (the first version of the report dropped them for --env_fn)."""
    import ppo_ray

    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "What is 2+3?", "label": "5"}) + "\n"
                      + json.dumps({"prompt": "What is 1+1?"}) + "\n")
    args = ppo_ray.Args(**{"pretrain": "unused", "prompt_max_len": 64, **flags})
    prompts = ppo_ray.load_prompts(args, build_tokenizer(), str(source), "train")
    assert [p["label"] for p in prompts] == ["5", None]
    assert ("1 of 2 prompts have no 'label'" in capsys.readouterr().out) == ("reward_pretrain" not in flags)


def test_the_environment_pays_for_the_direction_of_the_next_guess():
    env = make_env()
    assert env.reset("What is 2+3?", "5") is None
    assert env.step("9") == ("lower", 0.0, False)  # a first guess has no reply to follow
    assert env.step("12") == ("lower", -1.0, False)  # told lower, went up
    assert env.step("12") == ("lower", 0.0, False)  # the same guess again: no direction
    assert env.step("no idea") == ("a number, please", 0.0, False)
    assert env.step("3") == ("higher", 0.0, False)  # after "a number, please" there is no direction to follow
    assert env.step("5") == ("", 2.0, True)  # right, and up as told


class Broken:
    def __init__(self, result):
        self.result = result

    def reset(self, prompt, label):
        return None

    def step(self, action_text):
        return self.result


@pytest.mark.parametrize("result,says", [
    (("ok", 1.0), "must return (reply: str, reward: float, done: bool)"),
    (("ok", "good", False), "gave the reward 'good'; it must be a number"),
    (("ok", float("nan"), False), "it must be finite"),
    ((None, 1.0, False), "without ending the episode; the reply must be a string"),
])
def test_an_environment_that_answers_wrongly_gets_one_sentence(result, says):
    tokenizer = build_tokenizer()
    prompt = {"prompt": "x", "ids": tokenizer("x")["input_ids"], "label": None}
    generate, _ = scripted_policy(tokenizer, ["1"])
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
        run_episodes(generate, lambda: Broken(result), tokenizer, [prompt], 1, 2, 64, False, None, 64)


# ----------------------------------------------------------------------------------------------- on the real stack
@torch.no_grad()
def following_the_reply(model_dir: str, prompts_file: str, limit: int = 200, samples: int = 8) -> float:
    """How the policy acts on the reply, measured on held-out sums with sampling (the way it acts in training), from
    a fixed seed: each sum gets a first answer; where that is a wrong number, the environment's reply follows, and
    `samples` next answers are drawn. Returns the share of them that move the way they were told minus the share that
    move the other way (repeats and answers without a number count as neither)."""
    def number(text):
        found = re.findall(r"-?\d+", text)
        return int(found[0]) if found else None

    def sample(conversations, n):
        texts = [render_prompt(tokenizer, c, True, None) for c in conversations]
        outs = []
        for i in range(0, len(texts), 64):
            enc = tokenizer(texts[i: i + 64], return_tensors="pt", padding=True, add_special_tokens=False)
            ids = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                                 num_return_sequences=n, pad_token_id=tokenizer.pad_token_id)
            outs += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [outs[j * n: (j + 1) * n] for j in range(len(texts))]

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = load_records(prompts_file)[:limit]
    first = [number(a) for [a] in sample([[{"role": "user", "content": r["prompt"]}] for r in rows], 1)]
    wrong = [(r, a, "higher" if a < int(r["label"]) else "lower")
             for r, a in zip(rows, first) if a is not None and a != int(r["label"])]
    told = sample([[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": str(a)},
                    {"role": "user", "content": reply}] for r, a, reply in wrong], samples)
    moves = [(guess > a) == (reply == "higher") for (_, a, reply), nexts in zip(wrong, told)
             for guess in map(number, nexts) if guess is not None and guess != a]
    return (sum(moves) - (len(moves) - sum(moves))) / max(1, len(wrong) * samples)


@pytest.mark.slow
@pytest.mark.learning
def test_grpo_in_a_multi_turn_environment_learns_to_act_on_its_replies(sft_model, task, tmp_path):
    """tests/sum_env.py: the policy answers a sum, hears "higher" or "lower" and tries again, up to 3 turns. The
    trainer scores exactly the tokens vLLM sampled in every turn, and the policy learns to move its guess the way it
    was told.

    The sums are held-out ones, which the SFT model often gets wrong at its first try (the training pairs' sums it
    may know by heart, and then a reply is rare): those with an even sum to train on, the odd ones to measure."""
    held_out = load_records(task["prompts_eval"])
    files = {name: str(tmp_path / f"{name}.jsonl") for name in ("even", "odd")}
    for name, parity in (("even", 0), ("odd", 1)):
        with open(files[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in held_out if int(r["label"]) % 2 == parity)
    out = str(tmp_path / "ppo")
    run_script("ppo_ray.py", [
        "--pretrain", sft_model, "--prompt_data", files["even"], "--eval_prompt_data", files["odd"],
        "--apply_chat_template", "--output_dir", out, "--prompt_max_len", "64", "--generate_max_len", "32",
        "--env_fn", f"{ROOT}/tests/sum_env.py:make_env", "--max_turns", "3", "--advantage_estimator", "grpo",
        "--n_samples_per_prompt", "8", "--rollout_batch_size", "64", "--train_batch_size", "128",
        "--micro_train_batch_size", "64", "--actor_learning_rate", "1e-3", "--init_kl_coef", "0.001",
        "--max_steps", "8", "--seed", str(SEED)])
    log = [m for m in metrics(out) if "objective/scores" in m]
    assert log[0]["env/turns"] > 1.5, log[0]  # most episodes took more than one turn
    # Token ids end to end: the trainer's log-probs of the policy's tokens, with the environment's replies between
    # them, are vLLM's own (a token shifted by one would differ by whole nats).
    assert max(m["vllm/logprob_diff"] for m in log) < 1e-4, [m["vllm/logprob_diff"] for m in log]
    scores = [m["objective/scores"] for m in log]
    expect("multi-turn: episode reward, last 3 steps - first 2", mean(scores[-3:]) - mean(scores[:2]), ">=", 0.2)
    # The replies are true, so moving as told is also moving towards the sum: this cannot tell reading the reply from
    # a better second try. The SFT models' second tries moved as told about as often as not (-0.21 to +0.20).
    before, after = (following_the_reply(m, files["odd"]) for m in (sft_model, out))
    expect("multi-turn: moving as told, trained - SFT", after - before, ">=", 0.2)
    episodes = [s["response"] for s in map(json.loads, open(os.path.join(out, "eval_samples.jsonl")))]
    assert any("higher" in e or "lower" in e for e in episodes), episodes[:3]


def test_a_wrong_env_fn_is_named_by_its_flag():
    import ppo_ray

    with pytest.raises(UserError, match=re.escape("--env_fn file missing/env.py does not exist; check the path.")):
        ppo_ray.env_factory("missing/env.py:make_env")
    names = "has no function 'make_world'; it defines ['HigherOrLower', 'make_env']"
    with pytest.raises(UserError, match=re.escape(names)):
        ppo_ray.env_factory(f"{ROOT}/tests/sum_env.py:make_world")
