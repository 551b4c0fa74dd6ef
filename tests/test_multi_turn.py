"""common/multi_turn.py: episodes of the policy and an environment, as token ids, on both chat formats."""

import pytest
from sum_env import make_env

from common.args import UserError
from common.multi_turn import run_episodes
from common.tiny_model import build_tokenizer


def scripted_policy(tokenizer, answers: list[str], truncate_at: int | None = None):
    """A stand-in for vLLM: turn k of every episode answers answers[k], ended by the end-of-turn (EOS) token the way
    vLLM returns it, unless cut at `truncate_at` tokens; records the sequences and limits it was given."""
    calls = []

    def generate(ids_list, limits):
        calls.append((ids_list, limits))
        turn = len(calls) - 1
        outs = []
        for limit in limits:
            tokens = tokenizer(answers[turn], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            reason = "stop"
            if len(tokens) > min(limit, truncate_at or limit):
                tokens, reason = tokens[:min(limit, truncate_at or limit)], "length"
            outs.append({"token_ids": tokens, "logprobs": [-0.5] * len(tokens), "finish_reason": reason})
        return outs

    return generate, calls


@pytest.mark.parametrize("chat_format", ["default", "chatml"])
def test_an_episode_is_the_conversation_the_chat_template_writes(chat_format):
    """Two wrong answers, then the right one: the episode's tokens are exactly the template's rendering of that
    conversation (ChatML puts a newline after each end-of-turn token, the default template does not), and only the
    policy's own tokens are marked as trainable."""
    tokenizer = build_tokenizer(chat_format=chat_format)
    question = "What is 2+3?"
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as ppo_ray.py's load_prompts
    prompt = {"prompt": question, "ids": prompt_ids, "label": "5"}
    generate, calls = scripted_policy(tokenizer, ["4", "7", "5"])

    [[episode]] = run_episodes(generate, make_env, tokenizer, [prompt], 1, max_turns=4, max_len=64,
                               chat_template=True, input_template=None, prompt_max_len=64)

    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "higher"}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "lower"}, {"role": "assistant", "content": "5"}]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    whole = whole[: whole.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]  # the episode ends at the EOS
    assert episode["prompt_ids"] + episode["token_ids"] == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert episode["reward"] == 1.0 and episode["turns"] == 3 and len(calls) == 3
    policy = [t for t, m in zip(episode["token_ids"], episode["env_mask"]) if m]
    assert tokenizer.decode(policy) == "4" + tokenizer.eos_token + "7" + tokenizer.eos_token + "5" + tokenizer.eos_token
    assert [lp for lp, m in zip(episode["logprobs"], episode["env_mask"]) if not m] == [0.0] * (
        len(episode["env_mask"]) - sum(episode["env_mask"]))
    # each turn continued the sequence so far, with the tokens left of the budget as its limit
    assert calls[1][0][0] == prompt_ids + episode["token_ids"][: len(calls[1][0][0]) - len(prompt_ids)]
    assert [c[1][0] for c in calls] == [64 - (len(c[0][0]) - len(prompt_ids)) for c in calls]


def test_episodes_end_at_max_turns_at_the_budget_and_without_a_chat_template():
    tokenizer = build_tokenizer()
    prompt = {"prompt": "What is 2+3?", "ids": tokenizer("Q: What is 2+3? A:")["input_ids"], "label": "5"}
    # never right: the episode ends after max_turns with reward 0; n episodes per prompt, each with its own env
    generate, calls = scripted_policy(tokenizer, ["1", "2", "3", "4"])
    [episodes] = run_episodes(generate, make_env, tokenizer, [prompt], 3, max_turns=2, max_len=64,
                              chat_template=False, input_template=None, prompt_max_len=64)
    assert len(episodes) == 3 and len(calls) == 2 and all(len(c[0]) == 3 for c in calls)
    for e in episodes:  # without a template the reply's text is appended as it is
        assert e["turns"] == 2 and e["reward"] == 0.0
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
