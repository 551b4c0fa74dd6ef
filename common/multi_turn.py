"""Multi-turn rollouts: the policy and a user's environment take turns, kept as token ids from end to end.

ppo_ray.py --env_fn path.py:make_env loads `make_env`, which returns a fresh environment for one episode:

    class GuessingGame:
        def reset(self, prompt, label) -> str | None:
            '''The episode's first message to the policy (None: the prompt itself, rendered as usual).'''
        def step(self, action_text: str) -> tuple[str, float, bool]:
            '''The policy's turn, decoded; returns (the environment's reply, reward, done).'''

An episode is the prompt, then the policy's turn (sampled by vLLM), the environment's reply, the policy's next turn,
and so on, until the environment says done, --max_turns turns were taken, or the episode would outgrow
--generate_max_len tokens after the prompt. The rewards of its steps are summed into the episode's score.

Only the policy's own tokens are trained on: each episode carries an `env_mask`, 1 for the tokens vLLM sampled and
0 for the environment's. What vLLM sampled is kept as the ids it sampled (never decoded and encoded again), so the
trainer scores exactly the tokens the policy chose; only the environment's replies are tokenized. With a chat
template a reply becomes a user turn, rendered by the template itself (`reply_ids`); without one, its text is
appended as it is, and the environment formats it.

A vision-language policy's episode starts from its image prompt: reset and step get the prompt as its row wrote it
(the chat messages, image parts included), every turn's request gives vLLM the prompt's placeholders and images
followed by the episode's tokens (common/vlm.py `continued`), and the trainer scores the expanded prompt followed by
the same tokens. The replies stay text: one that holds an image placeholder token stops the run in one sentence, as
does a reset() that returns a first message for an image prompt (the episode would lose its images).
"""

from common import routing_replay
from common.args import UserError
from common.deadlines import REWARD_TIMEOUT_S, call_within
from common.data import SENTINEL, chat_text, decode_response, render_prompt  # SENTINEL: where a turn ends
from common.vlm import check_text_tokens, continued


def reply_ids(tokenizer, reply: str, chat_template: bool, closed_by: str | None) -> list[int]:
    """The tokens that follow a policy turn when the environment replies `reply`: with a chat template, the reply as a
    user message (continuation_ids); without one, its text as it is."""
    if not chat_template:
        return tokenizer(reply, add_special_tokens=False)["input_ids"]
    return continuation_ids(tokenizer, [{"role": "user", "content": reply}], closed_by)


def continuation_ids(tokenizer, messages: list[dict], closed_by: str | None, tools: list | None = None) -> list[int]:
    """The tokens that follow a policy turn when `messages` come after it (a user's reply, tools' results): whatever
    the chat template writes after an assistant message up to the next assistant turn's opening, i.e. the end-of-turn
    marker (and the newline some templates put after it), the messages, and the generation prompt. `closed_by`: the
    text of the special token that ended the policy's turn (vLLM stops at the end-of-turn token and keeps it), which
    is then not written twice, nor the whitespace a template writes before it (the policy's turn, up to its end
    token, is the policy's own). `tools`: the tool definitions the template is rendered with (common/agents.py).
    """
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}, *messages]
    text = chat_text(tokenizer, conversation, add_generation_prompt=True, **({"tools": tools} if tools else {}))
    after = text[text.index(SENTINEL) + len(SENTINEL):]
    if closed_by and after.lstrip().startswith(closed_by):  # Llama-2 writes " " + eos_token after the content
        after = after.lstrip()[len(closed_by):]
    return tokenizer(after, add_special_tokens=False)["input_ids"]


def is_added_token(tokenizer, token_id: int) -> bool:
    """Whether `token_id` is a special or added token, as end-of-turn tokens are. Some are not listed among the
    tokenizer's special tokens, though vLLM stops at them (through the model's generation_config): Phi-3's <|end|>,
    a Llama-3 base model's <|eot_id|>."""
    return token_id in tokenizer.all_special_ids or token_id in tokenizer.added_tokens_decoder


def first_request(tokenizer, env, prompt: dict, chat_template: bool, input_template: str | None,
                  prompt_max_len: int, timeout: float = REWARD_TIMEOUT_S) -> dict:
    """The episode's start, as a request (`ids`, and an image prompt's `engine_ids` and `images`): reset's first
    message rendered as a prompt, or the prompt itself when it gives None. A reset that takes more than `timeout`
    seconds stops the run (common/deadlines.py)."""
    first = call_within(timeout, "the environment's reset()", "--reward_timeout", env.reset, prompt["prompt"],
                        prompt["label"])
    if first is None:
        return prompt
    if not isinstance(first, str):
        raise UserError(f"the environment's reset() returned {type(first).__name__}; it must return the first "
                        f"message as a string, or None to start from the prompt itself.")
    if prompt.get("images"):
        raise UserError("the environment's reset() returned a first message for a prompt with images, which would "
                        "start the episode without them; return None to start from the prompt and its images.")
    ids = tokenizer(render_prompt(tokenizer, first, chat_template, input_template), add_special_tokens=False)
    if len(ids["input_ids"]) > prompt_max_len:
        raise UserError(f"the environment's first message is {len(ids['input_ids'])} tokens, over --prompt_max_len "
                        f"{prompt_max_len}; raise it or shorten the message.")
    return {"ids": ids["input_ids"]}


def checked_step(env, action_text: str, timeout: float = REWARD_TIMEOUT_S) -> tuple[str, float, bool]:
    """env.step, with its answer checked: one sentence naming what is wrong, not a failure deep in the trainer; a
    step that takes more than `timeout` seconds stops the run (common/deadlines.py)."""
    result = call_within(timeout, "the environment's step()", "--reward_timeout", env.step, action_text)
    if not (isinstance(result, tuple) and len(result) == 3):
        raise UserError(f"the environment's step() returned {result!r}; it must return (reply: str, reward: float, "
                        f"done: bool).")
    reply, reward, done = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise UserError(f"the environment's step() gave the reward {reward!r}; it must be a number.") from None
    if reward != reward or abs(reward) == float("inf"):
        raise UserError(f"the environment's step() gave the reward {reward}; it must be finite.")
    if not done and not isinstance(reply, str):
        raise UserError(f"the environment's step() replied {reply!r} without ending the episode; the reply must be "
                        f"a string.")
    return reply, reward, bool(done)


def run_episodes(generate, make_env, tokenizer, prompts: list[dict], n: int, max_turns: int, max_len: int,
                 chat_template: bool, input_template: str | None, prompt_max_len: int,
                 timeout: float = REWARD_TIMEOUT_S, placeholders: list[int] = ()) -> list[list[dict]]:
    """`n` episodes per prompt, all advanced a turn at a time together; returns samples[prompt][episode] laid out
    as vllm_engine.generate's, plus `prompt_ids` (the episode's start), `env_mask`, `reward` (summed) and `turns`.

    `generate(requests, max_tokens_list)` samples one continuation of each request (common/vlm.py `continued`: the
    sequence's `ids`, and an image prompt's engine ids and images), a dict with token_ids, logprobs and
    finish_reason. `max_len` bounds each episode's tokens after the prompt, the environment's included; `timeout`
    each call of the environment's reset and step (--reward_timeout); `placeholders`: a vision-language model's
    image placeholder tokens (vlm.image_token_id), which no reply may hold.
    """
    episodes = []
    for prompt in prompts:
        for _ in range(n):
            env = make_env()
            start = first_request(tokenizer, env, prompt, chat_template, input_template, prompt_max_len, timeout)
            episodes.append({"env": env, "start": start, "prompt_ids": start["ids"], "token_ids": [], "logprobs": [],
                             "env_mask": [], "reward": 0.0, "turns": 0, "done": False, "finish_reason": "stop"})
    for turn in range(max_turns):
        active = [e for e in episodes if not e["done"]]
        if not active:
            break
        outs = generate([continued(e["start"], e["token_ids"]) for e in active],
                        [max_len - len(e["token_ids"]) for e in active])
        for e, out in zip(active, outs):
            tokens, before = out["token_ids"], e["prompt_ids"] + e["token_ids"]
            e["token_ids"] += tokens
            e["logprobs"] += out["logprobs"] or [0.0] * len(tokens)
            e["env_mask"] += [1] * len(tokens)
            e["turns"] += 1
            e["finish_reason"] = out["finish_reason"]
            if "routes" in out:  # a mixture of experts: each turn's experts kept for the tokens it first computed
                e["routes"] = routing_replay.extend_routes(e.get("routes"), out["routes"])
            reply, reward, done = checked_step(e["env"], decode_response(tokenizer, before, tokens), timeout)
            e["reward"] += reward
            if done or turn == max_turns - 1 or out["finish_reason"] == "length":
                e["done"] = True
                continue
            closed_by = (tokenizer.convert_ids_to_tokens(tokens[-1]) if tokens and out["finish_reason"] == "stop"
                         and is_added_token(tokenizer, tokens[-1]) else None)
            more = reply_ids(tokenizer, reply, chat_template, closed_by)
            check_text_tokens(more, placeholders, f"the environment's step() reply {reply[:60]!r}")
            if len(e["token_ids"]) + len(more) >= max_len:  # no room for the reply and a turn after it
                e["done"], e["finish_reason"] = True, "length"
                continue
            e["token_ids"] += more
            e["logprobs"] += [0.0] * len(more)
            e["env_mask"] += [0] * len(more)
    fields = ("prompt_ids", "token_ids", "logprobs", "env_mask", "reward", "turns", "finish_reason")
    samples = [{k: e[k] for k in (*fields, "routes") if k in e} for e in episodes]
    return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]
