"""The layouts of public datasets people train on, a few rows each, read as the scripts read them: what is rendered
and which tokens the loss is taken on (SFT, preference pairs, KTO), or which prompt text and label a rollout gets.

Each layout runs with three chat templates: the project's own, ChatML with a newline after the end-of-turn token
(Qwen's), and ChatML that writes a default system prompt where a conversation has none (Qwen2.5's).
"""

import copy
import json

import pytest

from common import data
from common.tiny_model import CHATML_TEMPLATE, build_tokenizer

DEFAULT_SYSTEM_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
                           "{% endif %}" + CHATML_TEMPLATE)
# ChatML that writes an assistant's tool calls after its text, as Qwen2.5's and Llama-3.1's templates do.
TOOL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
                 "{% for call in m['tool_calls'] or [] %}<tool_call>{{ call['function']['name'] }} "
                 "{{ call['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_with(template: str):
    tokenizer = build_tokenizer(chat_format="chatml")
    tokenizer.chat_template = template
    return tokenizer


TOKENIZERS = {"default": lambda: build_tokenizer(), "chatml": lambda: build_tokenizer(chat_format="chatml"),
              "default system": lambda: chatml_with(DEFAULT_SYSTEM_TEMPLATE)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def trained(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


def text(tokenizer, sample) -> str:
    return tokenizer.decode(sample["input_ids"])


def sft(tokenizer, rows, **flags):
    flags = {"input_key": "prompt", "output_key": "response", "max_len": 256, "apply_chat_template": True, **flags}
    return data.build_sft_samples(copy.deepcopy(rows), tokenizer, "d.jsonl", log=lambda m: None, **flags)


def pairs(tokenizer, rows, **flags):
    flags = {"input_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected", "max_len": 256,
             "apply_chat_template": True, **flags}
    return data.build_preference_samples(copy.deepcopy(rows), tokenizer, "d.jsonl", log=lambda m: None, **flags)


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


SYSTEM = {"role": "system", "content": "Answer with a number."}

# layout: (rows, flags, the texts every sample must show, the assistant replies trained on)
SFT_LAYOUTS = {
    "alpaca": ([{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
                {"instruction": "Say hi.", "input": "", "output": "hi"}],
               {"input_key": "instruction,input", "output_key": "output"},
               [["Add the numbers.\n\n2 and 3"], ["Say hi."]], [["5"], ["hi"]]),
    "sharegpt": ([{"conversations": [{"from": "system", "value": "Answer with a number."},
                                     {"from": "human", "value": "What is 2+3?"}, {"from": "gpt", "value": "5"},
                                     {"from": "human", "value": "And 4+4?"}, {"from": "gpt", "value": "8"}]}],
                 {"input_key": "conversations"}, [["Answer with a number.", "What is 2+3?", "And 4+4?"]],
                 [["5", "8"]]),
    "openai messages": ([{"messages": [SYSTEM, user("What is 2+3?"), assistant("5"), user("And 4+4?"),
                                       assistant("8")]}],
                        {"input_key": "messages"}, [["Answer with a number.", "What is 2+3?", "And 4+4?"]],
                        [["5", "8"]]),
    "openai content parts": ([{"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "What is "},
                                                                                  {"type": "text", "text": "2+3?"}]},
                                            {"role": "assistant", "content": [{"type": "text", "text": "5"}]}]}],
                             {"input_key": "messages"}, [["Answer with a number.", "What is 2+3?"]], [["5"]]),
    "trl prompt-completion": ([{"prompt": [SYSTEM, user("What is 2+3?")], "completion": [assistant("5")]}],
                              {"output_key": "completion"}, [["Answer with a number.", "What is 2+3?"]], [["5"]]),
}


@pytest.mark.parametrize("layout", list(SFT_LAYOUTS))
def test_sft_layouts_train_on_the_assistant_s_replies_alone_and_keep_the_rest_as_context(tokenizer, layout):
    rows, flags, shown, replies = SFT_LAYOUTS[layout]
    end = data.end_of_turn_token(tokenizer)
    samples = sft(tokenizer, rows, **flags)
    assert len(samples) == len(rows)
    for sample, texts, answers in zip(samples, shown, replies):
        assert all(t in text(tokenizer, sample) for t in texts), text(tokenizer, sample)
        assert trained(tokenizer, sample) == "".join(answer + end for answer in answers)


def test_a_content_of_text_parts_is_rendered_as_its_text_where_a_template_prints_any_content():
    """Llama-3's template trims a message's content: a list of parts became its Python repr, which was trained on."""
    tokenizer = chatml_with("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rows, flags, _, _ = SFT_LAYOUTS["openai content parts"]
    (sample,) = sft(tokenizer, rows, **flags)
    assert text(tokenizer, sample) == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n"
                                       "What is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n")
    assert trained(tokenizer, sample) == "5<|im_end|>"


def test_pretraining_text_is_trained_whole(tokenizer):
    (sample,) = sft(tokenizer, [{"text": "The sum of 2 and 3 is 5."}], input_key="text", pretrain_mode=True,
                    apply_chat_template=False)
    assert text(tokenizer, sample) == (tokenizer.bos_token or "") + "The sum of 2 and 3 is 5." + tokenizer.eos_token
    assert sample["loss_mask"] == [0] + [1] * (len(sample["input_ids"]) - 1)  # the first is predicted from nothing


@pytest.mark.parametrize("part", ["input", "context"])
def test_a_second_part_of_the_prompt_that_no_flag_reads_is_refused(part):
    """Alpaca's instruction/input/output and Dolly's instruction/context/response: --input_key instruction trained
    every row without its input."""
    rows = [{"instruction": "Add the numbers.", part: "2 and 3", "output": "5"},
            {"instruction": "Say hi.", part: "", "output": "hi"}]
    with pytest.raises(data.DataError, match=rf"d.jsonl: 1 of 2 rows hold text under '{part}' beside the prompt under "
                                             rf"'instruction', .*give --input_key instruction,{part} "):
        sft(build_tokenizer(), rows, input_key="instruction", output_key="output")
    with pytest.raises(data.DataError, match=rf"sample 0: the keys of 'instruction,{part}' must all hold texts to "
                                             rf"join, got str, NoneType; write \"\" where a row has no text there.$"):
        sft(build_tokenizer(), [{**rows[0], part: None}], input_key=f"instruction,{part}", output_key="output")
    prompts = [{"instruction": "Add.", part: "2 and 3", "answer": "5"}]
    with pytest.raises(data.DataError, match=rf"hold text under '{part}'"):
        data.load_prompts(prompt_args(input_key="instruction", label_key="answer"), build_tokenizer(),
                          write_rows(prompts), "train")


def test_an_input_column_beside_a_conversation_is_no_part_of_its_prompt():
    """Joining needs texts: --input_key messages,input, which the refusal offered, failed on the conversation."""
    (sample,) = sft(build_tokenizer(), [{"messages": [user("What is 2+3?")], "input": "2+3", "output": "5"}],
                    input_key="messages", output_key="output")
    assert trained(build_tokenizer(), sample) == "5<eos>"


@pytest.mark.parametrize("turn, refused", [
    ({"from": "chatgpt", "value": "5"}, "ShareGPT's speaker 'chatgpt' is none of human, gpt, system, tool, user, "
                                        "assistant; rename it"),
    ({"role": "gpt", "content": "5"}, "a message has the role 'gpt', ShareGPT's name for 'assistant'; write "
                                      "'assistant'")], ids=["sharegpt speaker", "role"])
def test_a_speaker_no_chat_template_takes_is_refused_not_rendered_as_a_role_of_its_name(turn, refused):
    """ChatML rendered "<|im_start|>chatgpt": a model's turn that was never trained on, or a prompt's turn under a
    role the model never meets at inference."""
    first = {"from": "human", "value": "What is 2+3?"} if "from" in turn else user("What is 2+3?")
    with pytest.raises(data.DataError, match=rf"d.jsonl, sample 0: {refused}"):
        sft(build_tokenizer(chat_format="chatml"), [{"conversations": [first, turn]}], input_key="conversations")
    with pytest.raises(data.DataError, match=rf"sample 0: {refused}"):
        data.load_prompts(prompt_args(input_key="conversations", apply_chat_template=True), build_tokenizer(),
                          write_rows([{"conversations": [turn, first]}]), "train")


def test_a_tool_call_is_trained_as_the_assistant_s_and_the_tool_s_reply_is_not():
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages = [user("Weather in Paris?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}, assistant("It is sunny.")]
    tokenizer = chatml_with(TOOL_TEMPLATE)
    (sample,) = sft(tokenizer, [{"messages": messages}], input_key="messages")
    assert "<|im_start|>tool\nsunny<|im_end|>" in text(tokenizer, sample)
    assert trained(tokenizer, sample) == ('<tool_call>weather {"city": "Paris"}</tool_call><|im_end|>'
                                          "It is sunny.<|im_end|>")
    # a template that writes no tool calls trained the call's turn as an empty reply
    messages[1]["content"] = ""
    with pytest.raises(data.DataError, match="d.jsonl, sample 0: the chat template does not render the 'tool_calls' "
                                             "of assistant turn 1"):
        sft(build_tokenizer(chat_format="chatml"), [{"messages": messages}], input_key="messages")


def sharegpt(messages):
    return [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
            for m in messages]


PROMPT = [SYSTEM, user("What is 2+3?")]
PREFERENCE_LAYOUTS = {  # chosen "5", rejected "6"
    "ultrafeedback binarized": {"prompt": "What is 2+3?", "chosen": [user("What is 2+3?"), assistant("5")],
                                "rejected": [user("What is 2+3?"), assistant("6")]},
    "conversations without a prompt key": {"chosen": PROMPT + [assistant("5")], "rejected": PROMPT + [assistant("6")]},
    "trl conversational": {"prompt": PROMPT, "chosen": [assistant("5")], "rejected": [assistant("6")]},
    "sharegpt": {"prompt": sharegpt(PROMPT), "chosen": sharegpt(PROMPT + [assistant("5")]),
                 "rejected": sharegpt(PROMPT + [assistant("6")])},
    "texts": {"prompt": PROMPT, "chosen": "5", "rejected": "6"},
}


@pytest.mark.parametrize("layout", list(PREFERENCE_LAYOUTS))
def test_preference_layouts_compare_the_two_replies_after_one_prompt(tokenizer, layout):
    (pair,) = pairs(tokenizer, [PREFERENCE_LAYOUTS[layout]])
    end = data.end_of_turn_token(tokenizer)
    assert [trained(tokenizer, pair[side]) for side in ("chosen", "rejected")] == ["5" + end, "6" + end]
    prompts = {text(tokenizer, pair[side])[: text(tokenizer, pair[side]).rfind(answer + end)]
               for side, answer in (("chosen", "5"), ("rejected", "6"))}
    assert len(prompts) == 1 and "What is 2+3?" in prompts.pop()
    assert ("Answer with a number." in text(tokenizer, pair["chosen"])) == (layout != "ultrafeedback binarized")


def test_a_prompt_of_the_first_turn_runs_on_to_where_two_conversations_part(tokenizer):
    """Capybara-DPO's layout: the prompt is the first user message, chosen and rejected whole conversations that part
    at the last reply; the pair was refused as differing before its last turn."""
    head = [user("What is 2+3?"), assistant("5"), user("And 4+4?")]
    (pair,) = pairs(tokenizer, [{"prompt": "What is 2+3?", "chosen": head + [assistant("8")],
                                 "rejected": head + [assistant("9")]}])
    end = data.end_of_turn_token(tokenizer)
    assert [trained(tokenizer, pair[side]) for side in ("chosen", "rejected")] == ["8" + end, "9" + end]
    assert all("And 4+4?" in text(tokenizer, pair[side]) for side in ("chosen", "rejected"))


def test_pairs_that_differ_before_their_last_turn_are_refused():
    """Both replies are taken after one prompt: where the conversations part earlier, the old recipe in the docs
    (prompt = chosen[:-1]) put the rejected reply after the chosen conversation."""
    chosen = [user("What is 2+3?"), assistant("5"), user("And 4+4?"), assistant("8")]
    rejected = [user("What is 2+3?"), assistant("6"), user("And 4+4?"), assistant("8")]
    for row in ({"chosen": chosen, "rejected": rejected}, {"prompt": "What is 2+3?", "chosen": chosen,
                                                           "rejected": rejected}):
        with pytest.raises(data.DataError, match=r"d.jsonl, sample 0: 'chosen' holds 3 messages \(assistant, user, "
                                                 r"assistant\) after the prompt under 'prompt'.*keep only those that "
                                                 r"differ in the last"):
            pairs(build_tokenizer(), [row])


def test_a_pair_of_the_same_conversation_without_a_prompt_key_is_skipped_as_identical():
    rows = [PREFERENCE_LAYOUTS["conversations without a prompt key"],
            {"chosen": PROMPT + [assistant("5")], "rejected": PROMPT + [assistant("5")]}]
    assert len(pairs(build_tokenizer(), rows)) == 1


def test_a_null_prompt_beside_two_conversations_is_found_in_them():
    """A prompt column that other rows fill (parquet's null): it was taken as the prompt, and the sentence said the
    conversations held 2 messages after it."""
    row = {"prompt": None, **PREFERENCE_LAYOUTS["conversations without a prompt key"]}
    (pair,) = pairs(build_tokenizer(), [row])
    assert [trained(build_tokenizer(), pair[side]) for side in ("chosen", "rejected")] == ["5<eos>", "6<eos>"]


def test_whole_dialogues_without_a_prompt_are_refused_and_train_once_split():
    """Anthropic's HH-RLHF: chosen and rejected are whole "\\n\\nHuman: ... \\n\\nAssistant: ..." texts."""
    head = "\n\nHuman: What is 2+3?\n\nAssistant:"
    rows = [{"chosen": head + " 5", "rejected": head + " 6"}]
    with pytest.raises(data.DataError, match=r"d.jsonl, sample 0: no prompt under 'prompt' \(--input_key\), and "
                                             r"'chosen' and 'rejected' are whole texts .*split each pair"):
        pairs(build_tokenizer(), rows, apply_chat_template=False)
    split = [{"prompt": row["chosen"][: row["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:")],
              "chosen": row["chosen"][len(head):], "rejected": row["rejected"][len(head):]} for row in rows]
    (pair,) = pairs(build_tokenizer(), split, apply_chat_template=False)
    assert [trained(build_tokenizer(), pair[side]) for side in ("chosen", "rejected")] == [" 5<eos>", " 6<eos>"]


def kto(tokenizer, rows):
    return data.build_kto_samples(rows, tokenizer, "d.jsonl", "prompt", "completion", "label", 256,
                                  apply_chat_template=True, log=lambda m: None)


def test_trl_s_unpaired_layout_trains_the_completion_with_its_label(tokenizer):
    rows = [{"prompt": PROMPT, "completion": [assistant("5")], "label": True},
            {"prompt": "What is 2+3?", "completion": "6", "label": False}]
    end = data.end_of_turn_token(tokenizer)
    samples = kto(tokenizer, rows)
    assert [(trained(tokenizer, s), s["label"]) for s in samples] == [("5" + end, True), ("6" + end, False)]
    assert "Answer with a number." in samples[0]["prompt_text"]


@pytest.mark.parametrize("label", [1, 0, "true", "false", None])
def test_kto_labels_that_are_not_booleans_are_one_sentence(label):
    """A 0 read as a boolean is False, a "false" is True: only JSON booleans are taken."""
    with pytest.raises(data.DataError, match=rf"d.jsonl, sample 0: 'label' must be true or false \(a JSON boolean\), "
                                             rf"got {label!r}"):
        kto(build_tokenizer(), [{"prompt": "What is 2+3?", "completion": "5", "label": label}])


def prompt_args(**flags):
    import ppo_ray

    return ppo_ray.Args(**{"pretrain": "unused", "prompt_max_len": 256, "reward_fn": "r.py:f", **flags})


def write_rows(rows) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    return f.name


# layout: (rows, flags, the prompt text a rollout continues, the labels)
PROMPT_LAYOUTS = {
    "gsm8k": ([{"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}],
              {"input_key": "question", "label_key": "answer", "input_template": "Q: {} A: "},
              ["<bos>Q: Tom has 2 apples and buys 3. How many? A: "], ["2 + 3 = 5\n#### 5"]),
    "math": ([{"problem": "What is $\\frac{1}{2}+2$?", "solution": "$\\frac{1}{2}+2=\\boxed{\\frac{5}{2}}$"}],
             {"input_key": "problem", "label_key": "solution", "input_template": "Problem: {}\nSolution: "},
             ["<bos>Problem: What is $\\frac{1}{2}+2$?\nSolution: "], ["$\\frac{1}{2}+2=\\boxed{\\frac{5}{2}}$"]),
    "messages with a system message": ([{"prompt": PROMPT, "label": "5"}, {"prompt": sharegpt(PROMPT)}],
                                       {"apply_chat_template": True},
                                       ["<bos><|system|>\nAnswer with a number.<eos><|user|>\nWhat is 2+3?<eos>"
                                        "<|assistant|>\n"] * 2, ["5", None]),
}


@pytest.mark.parametrize("layout", list(PROMPT_LAYOUTS))
def test_prompt_layouts_give_the_rollout_its_prompt_and_the_reward_its_label(layout, capsys):
    rows, flags, prompt_texts, labels = PROMPT_LAYOUTS[layout]
    tokenizer = build_tokenizer()
    prompts = data.load_prompts(prompt_args(**flags), tokenizer, write_rows(rows), "train")
    assert [tokenizer.decode(p["ids"]) for p in prompts] == prompt_texts
    assert [p["label"] for p in prompts] == labels
    assert ("1 of 2 prompts have no 'label'" in capsys.readouterr().out) == (None in labels)


def test_a_prompt_that_ends_with_the_assistant_s_turn_is_refused_in_every_reader():
    """UltraChat's messages given as prompts: the rollout (or the pair's, or the completion's reply) was a second
    assistant turn after the answer."""
    conversation = [user("What is 2+3?"), assistant("5")]
    refused = r"sample 0: the prompt's conversation ends with an assistant turn"
    with pytest.raises(data.DataError, match=refused):
        data.load_prompts(prompt_args(input_key="messages", apply_chat_template=True), build_tokenizer(),
                          write_rows([{"messages": conversation}]), "train")
    with pytest.raises(data.DataError, match=refused):
        pairs(build_tokenizer(), [{"prompt": conversation, "chosen": "6", "rejected": "7"}])
    with pytest.raises(data.DataError, match=refused):
        kto(build_tokenizer(), [{"prompt": conversation, "completion": "6", "label": True}])
    with pytest.raises(data.DataError, match=refused):
        sft(build_tokenizer(), [{"prompt": conversation, "response": "6"}])
