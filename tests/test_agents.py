"""common/agents.py: OpenAI-client agents against the policy's endpoint, their requests stitched into episodes as ids.

The fast tests put a scripted policy behind the endpoint (as tests/test_multi_turn.py does) and talk to it with the
`openai` package; the slow one runs ppo_ray.py --agent_fn on the tiny model, the engines behind the endpoint."""

import json
import os
import random
import re
import threading
import time

import openai
import pytest
from conftest import SEED, expect, mean, metrics, run_script

from common.agents import AgentEndpoint, parse_tool_calls, tool_call_markers
from common.args import UserError
from common.tiny_model import build_tokenizer

# Qwen2.5's (and Hermes') way with tools, on the tiny ChatML tokenizer: the tools in a system turn, a call as JSON
# between <tool_call> tags after the content, a tool's result as a user turn in <tool_response> tags.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Llama 3.1's: a call is a bare JSON object with "parameters", and no content beside it.
LLAMA31_TOOLS_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "evaluates a sum",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}


def tools_tokenizer(template: str = QWEN_TOOLS_TEMPLATE):
    tokenizer = build_tokenizer(chat_format="chatml")
    tokenizer.chat_template = template
    return tokenizer


def scripted_policy(tokenizer, answer, delay: float = 0.0):
    """A stand-in for the engines: each request is answered answer(prompt text), ended by <|im_end|> as vLLM returns
    it; records every batch it was given."""
    batches, end_id = [], tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(requests, limits, seeds):
        ids_list = [r["ids"] for r in requests]
        batches.append((ids_list, limits, seeds))
        time.sleep(delay)
        outs = []
        for ids, limit in zip(ids_list, limits):
            tokens = tokenizer(answer(tokenizer.decode(ids)), add_special_tokens=False)["input_ids"] + [end_id]
            outs.append({"token_ids": tokens[:limit], "logprobs": [-0.25] * len(tokens[:limit]),
                         "finish_reason": "stop" if len(tokens) <= limit else "length"})
        return outs

    return generate, batches


def calculator_policy(text: str) -> str:
    """Calls the calculator on the question's sum, then answers with the tool's result."""
    if "<tool_response>" in text:
        return "It is " + re.findall(r"<tool_response>\n(.*)\n</tool_response>", text)[-1]
    question = re.findall(r"What is (.*)\?", text)[-1]
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % question


def calculator_agent(seen: list):
    """An OpenAI-client agent with a calculator; `seen` gets each answer as its client read it."""
    def run_agent(base_url, prompt, label):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        for _ in range(3):
            answer = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            seen.append(answer)
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return float(message.content.strip().endswith(label))
            for call in message.tool_calls:
                result = str(eval(json.loads(call.function.arguments)["expression"]))  # the toy task's sums only
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

    return run_agent


def prompt(question: str, label: str) -> dict:
    return {"prompt": question, "label": label, "ids": []}


def test_an_episode_is_the_ids_each_request_was_given_and_sampled():
    """Two requests, a tool call and an answer: the ids each answer carries are those the policy was given and
    sampled, the episode is the first prompt with both turns and the tool's turn between them, exactly as the
    template renders the whole conversation, and only the sampled tokens are trained on."""
    tokenizer = tools_tokenizer()
    endpoint = AgentEndpoint(tokenizer, max_len=200, prompt_max_len=200, timeout=30)
    generate, batches = scripted_policy(tokenizer, calculator_policy)
    seen = []
    [[episode]] = endpoint.run_episodes(calculator_agent(seen), [prompt("What is 2+3?", "5")], 1, generate)
    endpoint.close()

    assert episode["reward"] == 1.0 and episode["turns"] == 2 and not episode["failed"]
    call = seen[0].choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2+3"})
    assert seen[0].choices[0].finish_reason == "tool_calls" and seen[1].choices[0].message.content == "It is 5"
    given = [ids for ids_list, _, _ in batches for ids in ids_list]
    for answer, ids in zip(seen, given):  # the client's ids are those the policy was given
        assert answer.model_extra["prompt_token_ids"] == ids
    first, second = (a.choices[0].model_extra["token_ids"] for a in seen)
    tool_turn = given[1][len(given[0]) + len(first):]
    assert given[1] == given[0] + first + tool_turn  # the second prompt continues the first's ids
    assert episode["prompt_ids"] == given[0] and episode["token_ids"] == first + tool_turn + second
    assert episode["env_mask"] == [1] * len(first) + [0] * len(tool_turn) + [1] * len(second)
    assert episode["logprobs"] == [-0.25] * len(first) + [0.0] * len(tool_turn) + [-0.25] * len(second)
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "calculator", "arguments": {"expression": "2+3"}}}]},
         {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5"}],
        tools=[CALCULATOR], tokenize=False)
    whole = whole[: whole.rindex("<|im_end|>") + len("<|im_end|>")]  # the episode ends at the end-of-turn token
    assert episode["prompt_ids"] + episode["token_ids"] == tokenizer(whole, add_special_tokens=False)["input_ids"]


def test_an_edited_history_starts_the_sequence_anew():
    """A request that does not continue the conversation (the agent rewrote the answer it got) is rendered whole;
    the episode trains on that last sequence, whose tokens are again the ids the policy saw."""
    tokenizer = tools_tokenizer()
    endpoint = AgentEndpoint(tokenizer, max_len=200, prompt_max_len=200, timeout=30)
    generate, batches = scripted_policy(tokenizer, lambda text: "7")

    def run_agent(base_url, question, label):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": question}]
        client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": "8"}, {"role": "user", "content": "sure?"}]  # not what it said
        client.chat.completions.create(model="policy", messages=messages)
        return 0.5

    [[episode]] = endpoint.run_episodes(run_agent, [prompt("What is 3+4?", "7")], 1, generate)
    endpoint.close()
    second = batches[1][0][0]
    assert tokenizer.decode(second).count("8") == 1 and episode["prompt_ids"] == second
    assert episode["env_mask"] == [1] * len(episode["token_ids"]) and episode["reward"] == 0.5


def test_many_agents_at_once_share_the_engines_batches():
    """Sixteen episodes whose requests wait together are sampled in a few engine calls, not one each, and each
    request draws from the seed of its (episode, request)."""
    tokenizer = tools_tokenizer()
    endpoint = AgentEndpoint(tokenizer, max_len=200, prompt_max_len=200, timeout=60)
    generate, batches = scripted_policy(tokenizer, calculator_policy, delay=0.2)
    seen = []
    questions = [prompt(f"What is {a}+{a + 1}?", str(2 * a + 1)) for a in range(8)]
    groups = endpoint.run_episodes(calculator_agent(seen), questions, 2, generate,
                                   seed_of=lambda episode, request: 1000 * episode + request)
    endpoint.close()
    assert [s["reward"] for group in groups for s in group] == [1.0] * 16
    assert len(seen) == 32 and len(batches) <= 16, [len(b[0]) for b in batches]
    assert sorted(seed for _, _, seeds in batches for seed in seeds) == sorted(
        1000 * e + r for e in range(16) for r in range(2))


def test_an_agent_that_fails_ends_its_episode_and_not_the_run(capsys):
    """An agent that raises, hangs past --agent_timeout or returns no finite number fails its episode alone: it is
    counted and said once, none of its tokens is trained on, and its reward is its group's mean; a rollout whose
    every episode failed stops with the first reason."""
    tokenizer = tools_tokenizer()
    generate, _ = scripted_policy(tokenizer, lambda text: "5")
    behaviours = {"good": 1.0, "raises": None, "hangs": None, "malformed": "good", "nan": float("nan")}

    def run_agent(base_url, question, label):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
        if label == "raises":
            raise ValueError("the sandbox is down")
        if label == "hangs":
            threading.Event().wait(60)
        return behaviours[label]

    endpoint = AgentEndpoint(tokenizer, max_len=64, prompt_max_len=64, timeout=3)
    start = time.monotonic()
    groups = endpoint.run_episodes(run_agent, [prompt("What is 1+1?", label) for label in behaviours], 2, generate)
    endpoint.close()
    assert time.monotonic() - start < 20  # the hung agents were left behind at --agent_timeout
    good, *failed = groups
    assert [s["failed"] for s in good] == [False, False] and all(s["failed"] for g in failed for s in g)
    assert all(sum(s["env_mask"]) == 0 and s["reward"] == 0.0 for g in failed for s in g)  # no good one beside them
    assert all(len(s["token_ids"]) > 0 for g in failed for s in g)  # what they sampled is kept, masked
    said = capsys.readouterr().out
    assert "8 of 10 agent episodes failed and are not trained on; the first raised ValueError: the sandbox" in said

    endpoint = AgentEndpoint(tokenizer, max_len=64, prompt_max_len=64, timeout=3)
    with pytest.raises(UserError, match=re.escape("every one of the 2 agent episodes of this rollout failed; the "
                                                  "first --agent_fn call returned 'good'; it must return the "
                                                  "episode's reward, a finite number.")):
        endpoint.run_episodes(run_agent, [prompt("What is 1+1?", "malformed")], 2, generate)
    endpoint.close()


def test_a_failed_episode_takes_its_groups_mean():
    tokenizer = tools_tokenizer()
    generate, _ = scripted_policy(tokenizer, lambda text: "5")
    rewards = iter([1.0, "x", 0.0, 2.0])
    lock = threading.Lock()

    def run_agent(base_url, question, label):
        with lock:  # one at a time, so that the episodes take the rewards in order
            openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": question}])
            return next(rewards)

    endpoint = AgentEndpoint(tokenizer, max_len=64, prompt_max_len=64, timeout=30)
    groups = endpoint.run_episodes(run_agent, [prompt("What is 1+1?", "2")], 4, generate)
    endpoint.close()
    assert sorted(s["reward"] for s in groups[0]) == [0.0, 1.0, 1.0, 2.0]  # the failed one: (1 + 0 + 2) / 3


@pytest.mark.parametrize("template,markers", [
    (QWEN_TOOLS_TEMPLATE, ("<tool_call>", "</tool_call>", "name", "arguments")),
    (LLAMA31_TOOLS_TEMPLATE, ("", "", "name", "parameters")),
    (None, None)])
def test_tool_calls_are_read_as_the_chat_template_writes_them(template, markers):
    """Each template's own calls, rendered by the template, parse back to the calls (Llama 3.1 writes one at a
    time); a template that writes no calls (the tiny models') reads none."""
    tokenizer = tools_tokenizer(template) if template else build_tokenizer(chat_format="chatml")
    assert tool_call_markers(tokenizer.chat_template, tokenizer) == markers
    if markers is None:
        return
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 * (3+4)"}}}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                          {"role": "assistant", "content": "",
                                           "tool_calls": [call, call] if markers[0] else [call]}],
                                         tokenize=False)
    answer = text[text.rindex("assistant\n") + len("assistant\n"): text.rindex("<|im_end|>")]
    content, calls = parse_tool_calls(answer, markers)
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calculator", {"expression": "2 * (3+4)"})] * (2 if markers[0] else 1)
    assert parse_tool_calls("no call here", markers) == ("no call here", [])


def test_tools_on_a_template_that_writes_no_calls_get_one_sentence():
    tokenizer = build_tokenizer(chat_format="chatml")
    generate, _ = scripted_policy(tokenizer, lambda text: "5")
    errors = []

    def run_agent(base_url, question, label):
        try:
            openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": question}], tools=[CALCULATOR])
        except openai.BadRequestError as e:
            errors.append(e.body["message"])
        return 0.0

    endpoint = AgentEndpoint(tokenizer, max_len=64, prompt_max_len=64, timeout=30)
    endpoint.run_episodes(run_agent, [prompt("What is 1+1?", "2")], 1, generate)
    endpoint.close()
    assert errors == ["the request sends tools but the policy's chat template writes no tool calls; give the model a "
                      "template that renders them (Qwen's, Llama 3.1's), or send no tools"]


# ----------------------------------------------------------------------------------------------- on the real stack
@pytest.mark.slow  # a ppo_ray run of its own: 30 s on 2 cores at load 4 (107 s at load 8)
def test_ppo_ray_trains_on_an_openai_client_agents_episodes(tiny_model, task, tmp_path):
    """ppo_ray.py --agent_fn with the engines behind the endpoint: the trainer's log-probs of the episodes' sampled
    tokens are vLLM's own (a token shifted by one would differ by whole nats), over two requests an episode; the
    episodes whose agent failed are counted, and the run trains on the others."""
    out = str(tmp_path / "ppo")
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT_FILE)
    run_script("ppo_ray.py", [
        "--pretrain", tiny_model, "--prompt_data", task["prompts_train"], "--apply_chat_template", "--output_dir", out,
        "--prompt_max_len", "64", "--generate_max_len", "24", "--agent_fn", f"{agent}:run_agent",
        "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
        "--train_batch_size", "8", "--micro_train_batch_size", "8", "--max_steps", "2"])
    log = [m for m in metrics(out) if "objective/scores" in m]
    assert len(log) == 2 and all(m["env/turns"] > 1 for m in log), log
    assert sum(m["env/failed_episodes"] for m in log) > 0, log
    assert max(m["vllm/logprob_diff"] for m in log) < 1e-4, [m["vllm/logprob_diff"] for m in log]
    assert os.path.exists(os.path.join(out, "config.json"))


AGENT_FILE = '''
import itertools

import openai

EPISODES = itertools.count()


def run_agent(base_url, prompt, label):
    """Asks, then asks to check: two requests, the second continuing the first; every other episode fails."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "check it"}]
    if next(EPISODES) % 2:
        raise RuntimeError("the grader is down")
    return float(label in answer.choices[0].message.content)
'''


# ---------------------------------------------------------------------------------- a policy learns to use a tool
# The tiny ChatML model with Qwen's way of calling tools, made short: <tool_call> and its kin are added tokens (as
# in Qwen2.5's vocabulary), a call is its JSON between them, a tool's result a user turn in <tool_response> tags.
# The definitions are not rendered: the model knows its one tool from its SFT, and they would triple its prompt.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SHORT_TOOLS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tool_model(out: str, seed: int) -> str:
    """The tiny model (untrained) with SHORT_TOOLS_TEMPLATE and the tool tokens in its vocabulary."""
    from common.tiny_model import build_model

    tokenizer = build_tokenizer(chat_format="chatml")
    tokenizer.add_tokens(TOOL_TOKENS)
    tokenizer.chat_template = SHORT_TOOLS_TEMPLATE
    model = build_model(tokenizer, seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_sum_problems(folder, seed: int, n_sft: int, n_prompts: int, tool_share: float) -> dict:
    """Sums of two-digit numbers, which a ~1M model trained on a few thousand of them cannot do in its head: SFT
    transcripts of which `tool_share` call the calculator and answer with its result, the others answering directly
    with a guessed number (never the sum), and prompts for ppo_ray.py with the sum as label."""
    rng = random.Random(seed)
    sft, prompts = [], []
    for i in range(n_sft + n_prompts):
        a, b = rng.randrange(50, 100), rng.randrange(50, 100)  # every sum three digits: one layout to copy from
        question, answer = f"What is {a}+{b}?", str(a + b)
        if i >= n_sft:
            prompts.append({"prompt": question, "label": answer})
            continue
        messages = [{"role": "user", "content": question}]
        if rng.random() < tool_share:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
        else:
            guess = a + b
            while guess == a + b:
                guess = rng.randrange(100, 199)
            messages.append({"role": "assistant", "content": str(guess)})
        sft.append({"messages": messages})
    files = {"sft": str(folder / "tool_sft.jsonl"), "prompts": str(folder / "tool_prompts.jsonl")}
    for name, rows in (("sft", sft), ("prompts", prompts)):
        with open(files[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return files


def calculator_warm_start(folder, seed: int) -> tuple[str, dict]:
    """The tool model after 500 SFT steps at a peak learning rate of 1e-3 on the sum transcripts, half of them calling
    the calculator. Copying (the question's operands into the call, the tool's result into the answer) is what it
    must learn, and a tiny model learns it in a jump at a step that varies with the seed. Teacher-forced on 64 held-out
    transcripts (the same optimizer and schedule in one process, 1 thread), under seeds 1, 2 and 3 both copies went
    from under 10% right to 100% between steps 175 and 300, the operands first. The former warm start, 300 steps at
    5e-3, jumped between steps 200 and 300 under seed 0 only; seed 1 had not by step 300, nor by step 600 of a
    600-step run (41% of the results, 5% of the operands). After this SFT under seed 1, the model answered the tool's
    result in 128 of 128 greedy answers and called the tool in 48 of 128 sampled first turns, 46 of them with the
    question's operands."""
    files = write_sum_problems(folder, seed, n_sft=3000, n_prompts=1000, tool_share=0.5)
    sft = str(folder / "sft")
    run_script("sft.py", ["--pretrain", write_tool_model(str(folder / "tiny"), seed), "--dataset", files["sft"],
                          "--input_key", "messages", "--apply_chat_template", "--max_len", "128", "--max_steps", "500",
                          "--train_batch_size", "32", "--micro_train_batch_size", "32", "--learning_rate", "1e-3",
                          "--warmup_ratio", "0.05", "--logging_steps", "50", "--seed", str(seed), "--output_dir", sft])
    return sft, files


def grpo_with_the_calculator_agent(sft: str, files: dict, folder, seed: int) -> list[dict]:
    """10 GRPO steps of 16 prompts x 8 episodes of TOOL_AGENT_FILE's agent; the run's metrics, a row a step. The
    learning rate is 3e-4: at 1e-3, Adam's first full-size steps broke the warm start's copying under seed 1 (0.51
    right at step 1, 0.15 at step 3), and with 3 steps of warmup they broke it once the rate reached 1e-3 (0.77 at
    step 4, 0.37 at step 5)."""
    out, agent = str(folder / "ppo"), folder / "agent.py"
    agent.write_text(TOOL_AGENT_FILE)
    run_script("ppo_ray.py", [
        "--pretrain", sft, "--prompt_data", files["prompts"], "--apply_chat_template", "--output_dir", out,
        "--prompt_max_len", "32", "--generate_max_len", "96", "--agent_fn", f"{agent}:run_agent",
        "--advantage_estimator", "grpo", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16",
        "--train_batch_size", "128", "--micro_train_batch_size", "64", "--actor_learning_rate", "3e-4",
        "--init_kl_coef", "0.001", "--max_steps", "10", "--seed", str(seed)])
    return [m for m in metrics(out) if "objective/scores" in m]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.learning
def test_an_agent_learns_to_call_its_calculator(tmp_path):
    """An OpenAI-client agent offers a calculator; the reward is the final answer's being right, nothing else. The
    sums (two numbers of 50-99) are beyond the tiny model's head; after an SFT in which half the transcripts call
    the tool and copy its result and the others answer with a guess, the policy calls it in about half the episodes,
    and GRPO through the endpoint makes it call the tool in (nearly) every one.

    Measured on 2 cores shared with other jobs (load 6-66), 1 thread (RLHF_TEST_THREADS=1), 10 steps, right answers
    a step: seed 1 0.51 -> 0.66 -> 0.68 -> 0.75 -> 0.81 -> 0.81 -> 0.80 -> 0.84 -> 0.90 -> 0.87 (1.51 requests an
    episode at step 1, 1.92 over the last 3 steps); seed 2 0.59 -> 0.60 -> 0.64 -> 0.57 -> 0.80 -> 0.74 ->
    0.84 -> 0.77 -> 0.77 -> 0.78 (1.59 requests, then 1.82); seed 3 0.40 -> 0.54 -> 0.67 -> 0.63 -> 0.77 -> 0.72 ->
    0.79 -> 0.86 -> 0.83 -> 0.79 (1.40 requests, then 1.87); seed 0 0.49 -> 0.45 -> 0.66 -> 0.73 -> 0.80 -> 0.80 ->
    0.80 -> 0.88 -> 0.88 -> 0.83 (1.52 requests, then 1.91). Each run took 4-5 minutes."""
    log = grpo_with_the_calculator_agent(*calculator_warm_start(tmp_path, SEED), tmp_path, SEED)
    right, requests = [m["objective/scores"] for m in log], [m["env/turns"] for m in log]
    print("right:", [round(r, 3) for r in right], "requests per episode:", [round(r, 3) for r in requests])
    # Each episode's requests are the ids vLLM sampled: the trainer scores them as vLLM did.
    assert max(m["vllm/logprob_diff"] for m in log) < 1e-4, [m["vllm/logprob_diff"] for m in log]
    # Step 1's episodes are the SFT model's own: where it has not learned to copy, GRPO finds no reward to follow.
    # With the agent's calculator off by one, seed 1's warm start was 0.01 right at step 1 and 0.01-0.03 after it.
    expect("calculator: right answers at step 1 (the warm start copies)", right[0], ">=", 0.2)
    # Seed 2 gained 0.19 right and 0.23 requests, seeds 0, 1, 3 0.36-0.43 and 0.39-0.47; a step's share of 128
    # episodes varies by ~0.04.
    expect("calculator: right answers, last 3 steps - step 1", mean(right[-3:]) - right[0], ">=", 0.1)
    expect("calculator: requests per episode, last 3 steps - step 1", mean(requests[-3:]) - requests[0], ">=", 0.1)


TOOL_AGENT_FILE = '''
import json

import openai

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "evaluates a sum",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


def run_agent(base_url, prompt, label):
    """Up to three requests; a call of the calculator gets its result; the reward is the final answer's being right."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(3):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                 max_tokens=96).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == label)
        for call in message.tool_calls:
            try:
                a, b = json.loads(call.function.arguments)["expression"].split("+")
                result = str(int(a) + int(b))
            except (ValueError, KeyError, TypeError):
                result = "error"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
'''
