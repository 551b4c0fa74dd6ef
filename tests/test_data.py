"""Data plumbing: loading, templates, loss masks, truncation, packing, batching and argument parsing."""

import copy
import json
import random
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import data
from common.args import build_parser, parse_args


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def masked_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


def build(tokenizer, rows, **kw):
    kw = {"input_key": "prompt", "output_key": "response", "max_len": 128, **kw}
    return data.build_sft_samples(rows, tokenizer, "test.jsonl", log=lambda m: None, **kw)


def test_chat_template_masks_everything_but_the_response(tokenizer):
    (sample,) = build(tokenizer, [{"prompt": "What is 2+3?", "response": "5"}], apply_chat_template=True)
    assert masked_text(tokenizer, sample) == "5<eos>"
    assert tokenizer.decode(sample["input_ids"]) == "<bos><|user|>\nWhat is 2+3?<eos><|assistant|>\n5<eos>"


def test_input_template_and_plain_concatenation(tokenizer):
    rows = [{"prompt": "2+3", "response": " 5"}]
    (templated,) = build(tokenizer, rows, input_template="Q: {} A:")
    assert tokenizer.decode(templated["input_ids"]) == "<bos>Q: 2+3 A: 5<eos>"
    assert masked_text(tokenizer, templated) == " 5<eos>"
    (plain,) = build(tokenizer, rows)
    assert masked_text(tokenizer, plain) == " 5<eos>"


def test_a_template_s_trailing_space_merged_into_the_first_word_is_trained_on(tokenizer):
    """Byte-level BPE makes " s" one token of "A: seven": it starts in the prompt, but the word is the response's."""
    (sample,) = build(tokenizer, [{"prompt": "What is 3+4?", "response": "seven"}], input_template="Q: {} A: ")
    assert "Ġs" in tokenizer.convert_ids_to_tokens(sample["input_ids"]), "no merge to test: pick another word"
    assert masked_text(tokenizer, sample) == " seven<eos>"


def test_chatml_s_newline_after_the_end_of_turn_token_is_not_trained_on():
    """Generation stops at <|im_end|>: the policy never writes the newline ChatML puts after it."""
    from common.tiny_model import build_tokenizer

    chatml = build_tokenizer(chat_format="chatml")
    (sample,) = build(chatml, [{"prompt": "What is 2+3?", "response": "5"}], apply_chat_template=True)
    assert chatml.decode(sample["input_ids"]).endswith("5<|im_end|>\n")
    assert masked_text(chatml, sample) == "5<|im_end|>"
    messages = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "Add 4 and 5."}, {"role": "assistant", "content": "9"}]
    (conversation,) = build(chatml, [{"messages": messages}], input_key="messages")
    assert masked_text(chatml, conversation) == "3<|im_end|>9<|im_end|>"
    # a conversation that opens with the assistant's greeting: its span started at the text's first character, and
    # the role header (with Qwen's template, the default system prompt too) was trained on
    (greeting,) = build(chatml, [{"messages": [{"role": "assistant", "content": "Hi"}] + messages}],
                        input_key="messages")
    assert chatml.decode(greeting["input_ids"]).startswith("<|im_start|>assistant\nHi")
    assert masked_text(chatml, greeting) == "Hi<|im_end|>3<|im_end|>9<|im_end|>"


# Phi-3's shape: every turn ends with its end-of-turn token and a newline, and the conversation with the EOS, which
# is another token (<|endoftext|>); generation stops at the end-of-turn token.
PHI3_LIKE_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                      "{% else %}{{ eos_token }}{% endif %}")


def test_what_a_template_writes_after_the_last_end_of_turn_token_is_not_trained_on():
    """Phi-3 writes "<|end|>\\n<|endoftext|>" after the last assistant turn: the policy stops at <|end|> and never
    writes the rest, so SFT trains on the turn up to its end-of-turn token, as it does on the earlier turns."""
    from transformers import PreTrainedTokenizerFast

    from common.tiny_model import build_tokenizer

    chatml = build_tokenizer(chat_format="chatml")
    phi3 = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer, pad_token="<pad>",
                                   eos_token="<|endoftext|>", chat_template=PHI3_LIKE_TEMPLATE)
    (sample,) = build(phi3, [{"prompt": "What is 2+3?", "response": "5"}], apply_chat_template=True)
    assert phi3.decode(sample["input_ids"]).endswith("5<|im_end|>\n<|endoftext|>")
    assert masked_text(phi3, sample) == "5<|im_end|>"
    messages = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "Add 4 and 5."}, {"role": "assistant", "content": "9"}]
    (conversation,) = build(phi3, [{"messages": messages}], input_key="messages")
    assert masked_text(phi3, conversation) == "3<|im_end|>9<|im_end|>"
    # Phi-3 checkpoints whose EOS is the end-of-turn token: "5<|end|>\n<|end|>", and the turn ends at the first
    phi3.eos_token = "<|im_end|>"
    (sample,) = build(phi3, [{"prompt": "What is 2+3?", "response": "5"}], apply_chat_template=True)
    assert phi3.decode(sample["input_ids"]).endswith("5<|im_end|>\n<|im_end|>")
    assert masked_text(phi3, sample) == "5<|im_end|>"
    (conversation,) = build(phi3, [{"messages": messages}], input_key="messages")
    assert masked_text(phi3, conversation) == "3<|im_end|>9<|im_end|>"


# Qwen2.5's shape for tool calls: the call follows the content, inside added tokens that are not special.
TOOL_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
                 "{% for call in m.get('tool_calls', []) %}{{ '\\n<tool_call>\\n' + call + '\\n</tool_call>' }}"
                 "{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_span_ends_at_the_end_of_turn_token_not_at_other_added_tokens():
    """A tool call after the content sits between added tokens, and some tokenizers add runs of whitespace as
    tokens: the span still runs to the turn's own end-of-turn token, the one the template writes after a reply."""
    from common.tiny_model import build_tokenizer

    tok = build_tokenizer(chat_format="chatml")
    tok.chat_template = TOOL_TEMPLATE
    tok.add_tokens(["<tool_call>", "</tool_call>", "\n", "  "])
    assert data.end_of_turn_token(tok) == "<|im_end|>"
    call = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    for reply, trained in ({"content": "Let me add.", "tool_calls": [call]},
                           f"Let me add.\n<tool_call>\n{call}\n</tool_call><|im_end|>"), \
                          ({"content": "def f():\n  "}, "def f():\n  <|im_end|>"):
        text, spans = data.render_chat(tok, [{"role": "user", "content": "What is 2+3?"},
                                             {"role": "assistant", **reply}])
        assert [text[a:b] for a, b in spans] == [trained]


def test_a_conversation_s_earlier_assistant_turns_are_context_for_its_response(tokenizer):
    """A prompt given as messages may hold assistant turns: only the response after them is trained on (SFT, DPO,
    KTO) or scored."""
    prompt = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"},
              {"role": "user", "content": "Add 4 and 5."}]
    (sample,) = build(tokenizer, [{"prompt": prompt, "response": "9"}], apply_chat_template=True)
    assert masked_text(tokenizer, sample) == "9<eos>"
    (pair,) = data.build_preference_samples([{"prompt": prompt, "chosen": "9", "rejected": "8"}], tokenizer, "t",
                                            "prompt", "chosen", "rejected", 128, apply_chat_template=True)
    assert masked_text(tokenizer, pair["rejected"]) == "8<eos>"


@pytest.mark.parametrize("template", ["Q: {} A: ", "Q: {} A:"])
def test_kto_s_mismatched_pairs_read_as_the_prompt_followed_by_the_other_response(tokenizer, template):
    """KTO's reference point pairs each prompt with the next sample's response; a token that merges the template's
    trailing space with the first word must not be lost or doubled in the splice."""
    import kto

    rows = [{"prompt": "What is 3+4?", "response": "seven", "label": True},
            {"prompt": "What is 1+1?", "response": "two", "label": False}]
    samples = data.build_kto_samples(rows, tokenizer, "t", "prompt", "response", "label", 64,
                                     input_template=template, log=lambda m: None)
    batch = kto.collate(samples, tokenizer, 64, False, "cpu")
    texts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert texts[2:] == [f"<bos>{template.format('What is 3+4?')}two<eos>",
                         f"<bos>{template.format('What is 1+1?')}seven<eos>"]
    answers = [tokenizer.decode(ids[mask.bool()]).strip() for ids, mask in zip(batch["input_ids"], batch["loss_mask"])]
    assert answers == ["seven<eos>", "two<eos>", "two<eos>", "seven<eos>"]


def test_templates_and_rows_that_would_train_on_the_wrong_text_are_one_sentence(tokenizer):
    """A template without {} dropped every prompt ("Answer: ".format(p) is "Answer: "); --pretrain_mode trained on
    str(None); a conversation without an assistant turn was blamed on --max_len; a tokenizer without a chat template
    raised transformers' own error."""
    rows = [{"prompt": "What is 2+3?", "response": "5"}]
    for template in ("Answer: ", "None", "Q: {} A: {}", '{"a": 1} Q: {}', "Q: {question} A:"):
        with pytest.raises(data.DataError, match="--input_template .* must hold the prompt's place as one {}"):
            build(tokenizer, rows, input_template=template)
    (braces,) = build(tokenizer, rows, input_template='{{"q": "{}"}} A:')
    assert tokenizer.decode(braces["input_ids"]).startswith('<bos>{"q": "What is 2+3?"} A:')
    with pytest.raises(data.DataError, match=r"test.jsonl, sample 1: 'text' must be the text to train on, got "
                                             r"NoneType 'None'"):
        build(tokenizer, [{"text": "a"}, {"text": None}], input_key="text", pretrain_mode=True)
    # --pretrain_mode trained on the prompt alone of a prompt/response row, and ignored the rendering flags
    with pytest.raises(data.DataError, match=r"test.jsonl, sample 0: the row has 'response' \(--output_key\) beside "
                                             r"'prompt', and --pretrain_mode trains on 'prompt' alone"):
        build(tokenizer, rows, pretrain_mode=True)
    for flags, name in (({"apply_chat_template": True}, "--apply_chat_template"),
                        ({"input_template": "Q: {} A:"}, "--input_template")):
        with pytest.raises(data.DataError, match=f"--pretrain_mode trains on the text under 'text' as it is, which "
                                                 f"{name} would not change"):
            build(tokenizer, [{"text": "a"}], input_key="text", pretrain_mode=True, **flags)
    with pytest.raises(data.DataError, match="sample 0: the conversation under 'messages' does not end with an "
                                             "assistant turn to train on, and the row has no 'response'"):
        build(tokenizer, [{"messages": [{"role": "user", "content": "hi"}]}], input_key="messages")
    with pytest.raises(data.DataError, match="a prompt must be text .*got int '7'"):
        build(tokenizer, [{"prompt": 7, "response": "5"}])
    with pytest.raises(data.DataError, match="--apply_chat_template and --input_template both say how to render"):
        build(tokenizer, rows, apply_chat_template=True, input_template="Q: {} A:")
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(data.DataError, match="the tokenizer has no chat template .* give --input_template instead"):
        build(bare, rows, apply_chat_template=True)


def test_pretrain_mode_trains_on_every_token_after_the_first(tokenizer):
    (sample,) = build(tokenizer, [{"text": "What is 2+3? 5"}], input_key="text", pretrain_mode=True)
    assert sample["loss_mask"][0] == 0 and all(sample["loss_mask"][1:])


def test_multi_turn_trains_on_every_assistant_turn_only(tokenizer):
    messages = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "Add 4 and 5."}, {"role": "assistant", "content": "9"}]
    (sample,) = build(tokenizer, [{"messages": messages}], input_key="messages")
    assert masked_text(tokenizer, sample) == "3<eos>9<eos>"


def test_truncation_and_dropping_are_counted_and_all_too_long_is_an_error(tokenizer):
    logs = []
    rows = [{"prompt": "What is 2+3?", "response": "5" * 40}, {"prompt": "What is 12+30? " * 20, "response": "42"}]
    samples = data.build_sft_samples(rows, tokenizer, "t.jsonl", "prompt", "response", 16, log=logs.append)
    assert len(samples) == 1 and len(samples[0]["input_ids"]) == 16
    assert "1 of 2 samples truncated" not in logs[0] and "2 of 2 samples truncated" in logs[0]
    assert "1 dropped" in logs[0]
    with pytest.raises(data.DataError, match="raise --max_len"):
        data.build_sft_samples(rows[1:], tokenizer, "t.jsonl", "prompt", "response", 16, log=logs.append)


def test_responses_must_be_texts_in_every_builder(tokenizer):
    """A conversation, a null or a boolean where a response should be is refused by name, not trained on as the
    text "['...']", "None" or "True"; a number is a response written as one. (The assistant's reply given as
    messages is a text: tests/test_data_layouts.py.)"""
    turns = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    pairs = [{"prompt": "What is 2+3?", "chosen": 5, "rejected": "6"}, {"prompt": "hi", "chosen": turns,
                                                                        "rejected": "6"}]
    assert len(data.build_preference_samples(pairs[:1], tokenizer, "p.jsonl", "prompt", "chosen", "rejected", 64,
                                             log=lambda m: None)) == 1
    with pytest.raises(data.DataError, match=r"p.jsonl, sample 1: 'chosen' holds 2 messages \(user, assistant\) "
                                             r"after the prompt under 'prompt'"):
        data.build_preference_samples(pairs, tokenizer, "p.jsonl", "prompt", "chosen", "rejected", 64)
    rows = [{"prompt": "hi", "completion": turns, "label": True}]
    with pytest.raises(data.DataError, match="k.jsonl, sample 0: 'completion' holds 2 messages"):
        data.build_kto_samples(rows, tokenizer, "k.jsonl", "prompt", "completion", "label", 64)
    for value, kind in ((None, "NoneType"), (True, "bool"), ({"role": "assistant", "content": "5"}, "dict")):
        rows = [{"prompt": "What is 2+3?", "response": "5"}, {"prompt": "What is 2+3?", "response": value}]
        with pytest.raises(data.DataError, match=f"s.jsonl, sample 1: 'response' must be a response text, got {kind}"):
            data.build_sft_samples(rows, tokenizer, "s.jsonl", "prompt", "response", 64)


def test_responses_that_hold_their_prompt_too_are_refused_in_every_builder(tokenizer):
    """HH-RLHF's chosen and rejected are whole conversations: beside a prompt key, every sample showed the prompt
    twice, and DPO or the reward model learned from texts no policy writes."""
    human = "\n\nHuman: What is 2+3?\n\nAssistant:"
    pairs = [{"prompt": human, "chosen": human + " 5", "rejected": human + " 6"}] * 3
    with pytest.raises(data.DataError, match=r"p.jsonl: in 3 of 3 rows, 'chosen' and 'rejected' begin with the "
                                             r"prompt under 'prompt', which would be rendered twice"):
        data.build_preference_samples(pairs, tokenizer, "p.jsonl", "prompt", "chosen", "rejected", 64)
    with pytest.raises(data.DataError, match=r"in 3 of 3 rows, 'response' begin with the prompt"):
        build(tokenizer, [{"prompt": human, "response": human + " 5"}] * 3)
    with pytest.raises(data.DataError, match=r"in 3 of 3 rows, 'completion' begin with the prompt"):
        data.build_kto_samples([{"prompt": human, "completion": human + " 5", "label": True}] * 3, tokenizer,
                               "k.jsonl", "prompt", "completion", "label", 64)
    # one response in three that happens to repeat its prompt is taken as written
    rows = [{"prompt": "Say hi.", "response": "Say hi. Hi!"}] + [{"prompt": "Add 1 and 2.", "response": "3"}] * 2
    assert len(build(tokenizer, rows)) == 3


def test_margins_are_read_from_their_key_and_a_mistyped_key_is_refused(tokenizer):
    """A --margin_key no pair holds gave every pair a margin of 0 without a word, as if the data had none."""
    rows = [{"prompt": "What is 2+3?", "chosen": "5", "rejected": "6", "score_diff": 4.0},
            {"prompt": "What is 2+4?", "chosen": "6", "rejected": "7", "score_diff": 1.5}]
    build = lambda rows, key, log=print: data.build_preference_samples(
        rows, tokenizer, "p.jsonl", "prompt", "chosen", "rejected", 64, margin_key=key, log=log)
    assert [p["margin"] for p in build(rows, "score_diff")] == [4.0, 1.5]
    with pytest.raises(data.DataError, match=r"no pair of p.jsonl has 'score_dif' \(--margin_key\); the keys of the "
                                             r"first are \['chosen', 'prompt', 'rejected', 'score_diff'\]"):
        build(rows, "score_dif")
    assert [p["margin"] for p in build(rows, "margin")] == [0.0, 0.0]  # rm.py's default: data without margins
    logs = []
    del rows[1]["score_diff"]
    assert [p["margin"] for p in build(rows, "score_diff", logs.append)] == [4.0, 0.0]
    assert "1 of 2 pairs have no 'score_diff' (--margin_key); their margin is 0" in logs[0], logs


def test_reward_pairs_cut_before_their_responses_are_dropped_not_scored_at_the_prompt(tokenizer):
    """rm.py reads a reward at the EOS it appends after truncation; a pair with no response token left would put
    that EOS right after the prompt on both sides, and train on two identical inputs with opposite labels."""
    short = {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}
    long = {**short, "prompt": "What is 2+3? " * 20}
    logs = []
    pairs = data.build_preference_samples([short, long], tokenizer, "p.jsonl", "prompt", "chosen", "rejected", 24,
                                          end_with_eos=True, log=logs.append)
    assert len(pairs) == 1 and "1 pairs dropped because no response token was left" in logs[0], logs
    for side in ("chosen", "rejected"):  # the kept pair: its response, then the EOS the reward is read at
        ids, mask = pairs[0][side]["input_ids"], pairs[0][side]["loss_mask"]
        assert ids[-1] == tokenizer.eos_token_id and sum(mask) >= 2
    with pytest.raises(data.DataError, match="has no usable pair"):
        data.build_preference_samples([long], tokenizer, "p.jsonl", "prompt", "chosen", "rejected", 24,
                                      end_with_eos=True)


def test_packed_loss_and_gradients_equal_padded(tiny_model, tokenizer):
    from sft import forward_logprobs, sft_loss

    rows = [{"prompt": f"What is {a}+{a * 3}?" + " please" * (a % 3), "response": str(a * 4)} for a in range(6)]
    samples = build(tokenizer, rows, apply_chat_template=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    losses, grads = [], []
    for batch in (data.pad_collate(samples, tokenizer.pad_token_id), data.pack_collate(samples)):
        model.zero_grad()
        loss = sft_loss(forward_logprobs(model, batch), batch["loss_mask"])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert data.pack_collate(samples)["input_ids"].shape[0] == 1
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    # Without the restarting position_ids the samples would see each other and the loss would change.
    packed = data.pack_collate(samples)
    leaky = sft_loss(forward_logprobs(model, {"input_ids": packed["input_ids"]}), packed["loss_mask"])
    assert abs(leaky.item() - losses[0]) > 1e-3


def test_loading_formats_and_their_errors(tmp_path):
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.json", "d.parquet"):
        assert data.load_records(str(tmp_path / name)) == rows
    assert len(data.load_records(str(tmp_path))) == 6  # a folder: every data file in it

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    with pytest.raises(data.DataError, match=r"bad.jsonl, line 2: not valid JSON"):
        data.load_records(str(tmp_path / "bad.jsonl"))
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(data.DataError, match=r"no key 'question'.*\['prompt', 'response'\]"):
        data.get_key(rows[0], "question", 0, "d.jsonl")


def test_a_folder_of_per_split_files_is_read_one_split_at_a_time(tmp_path):
    """train.jsonl and test.jsonl in one folder: reading both for --dataset and --eval_dataset alike trained on the
    held-out rows and evaluated on the training ones."""
    import datasets

    for name, rows in (("train.jsonl", [{"p": "a"}, {"p": "b"}]), ("test.jsonl", [{"p": "c"}]),
                       ("train-00001-of-00002.jsonl", [{"p": "d"}])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["p"] for r in data.load_records(str(tmp_path), "train")] == ["d", "a", "b"]
    assert [r["p"] for r in data.load_records(str(tmp_path), "test")] == ["c"]
    with pytest.raises(data.DataError, match="has no file of split 'validation' .*--dataset_split"):
        data.load_records(str(tmp_path), "validation")
    (tmp_path / "extra.jsonl").write_text(json.dumps({"p": "e"}) + "\n")
    with pytest.raises(data.DataError, match=r"mixes files named for a split \(test.jsonl, .*\) with others "
                                             r"\(extra.jsonl\)"):
        data.load_records(str(tmp_path), "train")
    saved = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"p": "a"}])}).save_to_disk(saved)
    with pytest.raises(data.DataError, match=r"has no split 'test'; its splits are \['train'\]"):
        data.load_records(saved, "test")


def test_split_names_beyond_the_bare_word_are_split_names(tmp_path):
    """UltraFeedback-binarized ships train_prefs-00000-of-00001.parquet beside test_prefs-...; users write
    my_train.jsonl and my_test.jsonl. Neither was taken for a split, so the folder was read whole: the test rows were
    trained on."""
    write = lambda folder, name, rows: (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    hub, own = tmp_path / "hub", tmp_path / "own"
    hub.mkdir(), own.mkdir()
    for split in ("train_prefs", "test_prefs", "train_sft"):
        write(hub, f"{split}-00000-of-00001.jsonl", [{"p": split}])
    assert data.load_records(str(hub), "test_prefs") == [{"p": "test_prefs"}]
    with pytest.raises(data.DataError, match=r"has files of several splits that 'train' could mean \(train_prefs, "
                                             r"train_sft\); name one of them whole"):
        data.load_records(str(hub), "train")  # two names hold "train": the user must say which
    write(own, "my_train.jsonl", [{"p": "a"}])
    write(own, "my_test.jsonl", [{"p": "b"}])
    assert data.load_records(str(own), "train") == [{"p": "a"}] and data.load_records(str(own), "test") == [{"p": "b"}]


def test_split_names_after_a_dot_and_splits_that_share_a_word(tmp_path):
    """ultrafeedback.train.jsonl beside ultrafeedback.test.jsonl was cut at its first dot to "ultrafeedback", named no
    split, and the folder was read whole for both flags: the test rows were trained on. train.jsonl beside
    train_extra.jsonl gave only train.jsonl's rows for train, leaving train_extra's out without a word."""
    write = lambda folder, name, rows: (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dotted, shared, hashed = tmp_path / "dotted", tmp_path / "shared", tmp_path / "hashed"
    for folder in (dotted, shared, hashed):
        folder.mkdir()
    write(dotted, "ultrafeedback.train.jsonl", [{"p": "a"}, {"p": "b"}])
    write(dotted, "ultrafeedback.test.jsonl", [{"p": "c"}])
    assert [r["p"] for r in data.load_records(str(dotted), "train")] == ["a", "b"]
    assert [r["p"] for r in data.load_records(str(dotted), "test")] == ["c"]
    write(shared, "train.jsonl", [{"p": "a"}])
    write(shared, "train_extra.jsonl", [{"p": "b"}])
    with pytest.raises(data.DataError, match=r"several splits that 'train' could mean \(train, train_extra\)"):
        data.load_records(str(shared), "train")
    assert data.load_records(str(shared), "train_extra") == [{"p": "b"}]
    write(hashed, "train-00000-of-00002-3f2a9c1e.jsonl", [{"p": "a"}])  # the hub's older parquet shard names
    write(hashed, "train-00001-of-00002-77b0d4aa.jsonl", [{"p": "b"}])
    write(hashed, "test-00000-of-00001-5e6f7a8b.jsonl", [{"p": "c"}])
    assert [r["p"] for r in data.load_records(str(hashed), "train")] == ["a", "b"]


def test_a_json_of_splits_and_a_json_of_lines(tmp_path):
    """{"train": [...], "test": [...]} was refused and {"test": [...]} read as training data; datasets'
    Dataset.to_json writes one object a line under a .json name, which was refused as invalid JSON."""
    import datasets

    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": [{"p": "a"}], "test": [{"p": "b"}]}))
    assert data.load_records(str(splits), "test") == [{"p": "b"}]
    only_test = tmp_path / "only_test.json"
    only_test.write_text(json.dumps({"test": [{"p": "b"}]}))
    with pytest.raises(data.DataError, match=r"holds the splits test, not 'train'; name one of them with the split"):
        data.load_records(str(only_test), "train")
    lines = str(tmp_path / "lines.json")
    datasets.Dataset.from_list([{"p": "a"}, {"p": "b"}]).to_json(lines)
    assert data.load_records(lines) == [{"p": "a"}, {"p": "b"}]


def test_a_conversation_that_ends_before_its_response_needs_the_response_key(tokenizer):
    """TRL's prompt/completion layout: a conversation prompt and its response under "completion". Without
    --output_key completion, SFT trained on the history's assistant turn and dropped the completion, silently."""
    row = {"prompt": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "HISTORY"},
                      {"role": "user", "content": "q2"}], "completion": "TARGET"}
    with pytest.raises(data.DataError, match=r"test.jsonl, sample 0: the conversation under 'prompt' does not end "
                                             r"with an assistant turn to train on, and the row has no 'response'"):
        build(tokenizer, [row])
    (sample,) = build(tokenizer, [row], output_key="completion", apply_chat_template=True)
    assert masked_text(tokenizer, sample) == "TARGET<eos>"
    with pytest.raises(data.DataError, match="use --apply_chat_template instead of --input_template"):
        build(tokenizer, [{"prompt": row["prompt"][:2]}], input_template="Q: {} A:")


def test_what_a_chat_template_raises_is_one_sentence_naming_the_sample(tokenizer):
    """A content of None (tool calls) or a template's raise_exception surfaced as a Jinja traceback."""
    rows = [{"prompt": "fine", "response": "5"}, {"prompt": [{"role": "user", "content": None}], "response": "5"}]
    with pytest.raises(data.DataError, match=r"^test.jsonl, sample 1: the chat template could not render these "
                                             r"messages \(TypeError: .*\); give them the roles"):
        build(tokenizer, rows, apply_chat_template=True)


def test_pairs_that_differ_only_past_max_len_are_skipped_as_identical(tokenizer):
    rows = [{"prompt": "What is 2+3?", "chosen": "5 " + "a" * 40 + " yes", "rejected": "5 " + "a" * 40 + " no"},
            {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}]
    logged = []
    samples = data.build_preference_samples(rows, tokenizer, "pairs.jsonl", "prompt", "chosen", "rejected", 24,
                                            log=logged.append)
    assert len(samples) == 1 and "skipped 1 of 2 pairs" in logged[0] and "past --max_len 24" in logged[0]


def test_prompts_without_their_label_are_reported():
    logged = []
    rows = [{"question": "2+3?", "answer": "5"}, {"question": "1+1?", "label": "2"}]
    assert data.get_labels(rows, "label", "p.jsonl", logged.append) == [None, "2"]
    assert logged == ["warning: p.jsonl: 1 of 2 prompts have no 'label' (--label_key), and the reward function gets "
                      "None as their label; the keys of the first are ['answer', 'question']."]


def test_the_samples_an_epoch_leaves_out_are_reported():
    logs = []
    data.report_leftover(63, 32, "d.jsonl", "samples", log=logs.append)
    data.report_leftover(64, 32, "d.jsonl", "samples", log=logs.append)
    assert len(logs) == 1 and "each epoch trains on 32 of the 63 samples and leaves 31 out" in logs[0]
    assert len(data.micro_batches(63, 32, 8, 1, 0, seed=0, epoch=0)) == 1  # what it reports: one batch of 32


def test_micro_batches_split_a_global_batch_across_ranks_deterministically():
    world, steps = 2, []
    for rank in range(world):
        steps.append(data.micro_batches(50, 8, 2, world, rank, seed=1, epoch=3))
    assert len(steps[0]) == 6  # 50 // 8 full global batches
    for step in range(6):
        both = [i for r in range(world) for mb in steps[r][step] for i in mb]
        assert len(both) == len(set(both)) == 8 and all(len(mb) == 2 for mb in steps[0][step])
    assert steps[0] == data.micro_batches(50, 8, 2, world, 0, seed=1, epoch=3)
    assert steps[0] != data.micro_batches(50, 8, 2, world, 0, seed=1, epoch=4)


def test_with_lengths_each_ranks_share_of_a_step_is_cut_shortest_first_and_holds_the_same_samples():
    """sft.py, dpo.py and rm.py pass each sample's padded width: samples of alike length share a micro-batch and pad
    less, while each step and rank keep the samples they had (their losses are means over the whole step)."""
    lengths = [random.Random(i).randint(5, 500) for i in range(50)]
    pairs = [{"chosen": {"input_ids": [1] * n}, "rejected": {"input_ids": [1] * (n // 2)}} for n in lengths]
    assert [data.padded_width(p) for p in pairs] == lengths == [data.padded_width(p["chosen"]) for p in pairs]
    for rank in range(2):
        plain = data.micro_batches(50, 16, 2, 2, rank, seed=1, epoch=3)
        cut = data.micro_batches(50, 16, 2, 2, rank, seed=1, epoch=3, lengths=lengths)
        assert [sorted(sum(step, [])) for step in cut] == [sorted(sum(step, [])) for step in plain]
        for step in cut:
            widths = [lengths[i] for mb in step for i in mb]
            assert widths == sorted(widths)
        padding = lambda steps: sum(len(mb) * max(lengths[i] for i in mb) - sum(lengths[i] for i in mb)
                                    for step in steps for mb in step)
        assert padding(cut) < 0.5 * padding(plain), (padding(cut), padding(plain))


@dataclass
class _Args:
    lr: float = 1e-5
    """peak learning rate"""
    packing: bool = False
    """pack samples"""
    name: str | None = None
    """optional name"""


def test_reward_model_rows_end_alike_whatever_their_length_where_the_end_of_turn_token_is_not_the_eos():
    """Gemma writes "<end_of_turn>\n" after each turn and its EOS is another token: the row was the template's text
    with the EOS after the newline, except a row that just fit --max_len, whose newline the EOS replaced; the reward
    model read its score in two contexts for one response. Now every row ends "<end_of_turn><eos>", and a row is
    counted as cut only when the response lost a token."""
    from transformers import PreTrainedTokenizerFast

    from common.tiny_model import build_tokenizer

    chatml = build_tokenizer(chat_format="chatml")
    gemma_like = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer, pad_token="<pad>",
                                         eos_token="<|endoftext|>", chat_template=TOOL_TEMPLATE)
    ids = data.reward_model_input_ids(gemma_like, "What is 2+3?", "5", max_len=128, apply_chat_template=True)
    assert gemma_like.decode(ids).endswith("5<|im_end|><|endoftext|>")
    for max_len in (len(ids), len(ids) + 1):  # the row just fits: the same row
        assert data.reward_model_input_ids(gemma_like, "What is 2+3?", "5", max_len, apply_chat_template=True) == ids
    sample, cut = data._tokenize_response(gemma_like, "What is 2+3?", "5", len(ids) - 1, True, None, True)
    assert cut and gemma_like.decode(sample["input_ids"]).endswith("5<|endoftext|>")  # its end-of-turn token lost


def test_args_docstrings_become_help_and_booleans_parse():
    assert "peak learning rate" in build_parser(_Args).format_help()
    assert parse_args(_Args, ["--packing"]).packing is True
    assert parse_args(_Args, ["--packing", "false", "--lr", "3e-4", "--local_rank=1"]) == _Args(3e-4, False, None)


def test_reward_model_rows_end_at_the_response_eos_with_chatml():
    """ChatML writes "<|im_end|>\\n" after every turn: the reward model's row ends at the response's <|im_end|>,
    where the policy stops generating, not at the newline or at an earlier assistant turn's <|im_end|>."""
    from common.tiny_model import build_tokenizer

    chatml = build_tokenizer(chat_format="chatml")
    conversation = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"},
                    {"role": "user", "content": "And 2+2?"}]
    ids = data.reward_model_input_ids(chatml, conversation, "4", max_len=128, apply_chat_template=True)
    assert chatml.decode(ids) == chatml.apply_chat_template(
        conversation + [{"role": "assistant", "content": "4"}], tokenize=False).removesuffix("\n")
    cut = data.reward_model_input_ids(chatml, "What is 1+1?", "2" * 40, max_len=16, apply_chat_template=True)
    assert len(cut) == 16 and cut[-1] == chatml.eos_token_id  # truncated: the EOS is put back at the end
    (pair,) = data.build_preference_samples([{"prompt": conversation, "chosen": "4", "rejected": "5"}], chatml, "t",
                                            "prompt", "chosen", "rejected", 128, apply_chat_template=True)
    assert chatml.decode(pair["chosen"]["input_ids"]).endswith("<|im_end|>\n"), "DPO keeps the template's rows"


def test_values_no_run_means_and_abbreviated_flags_are_refused_by_the_parser(capsys):
    import ppo_ray
    import sft

    cases = {("--min_lr_ratio", "-1"): "--min_lr_ratio -1.0 must be between 0 and 1.",
             ("--warmup_ratio", "5"): "--warmup_ratio 5.0 must be between 0 and 1.",
             ("--learning_rate", "nan"): "--learning_rate nan must be a positive number.",
             ("--max_epochs", "0"): "--max_epochs 0 must be 1 or more.",
             ("--max_steps", "-5"): "--max_steps -5 must be 0 or more.",
             ("--logging_steps", "0"): "--logging_steps 0 must be 1 or more.",
             ("--max_step", "10"): "unrecognized arguments: --max_step 10"}
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as stop:
            parse_args(sft.Args, ["--pretrain", "p", "--dataset", "d", *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        parse_args(ppo_ray.Args, ["--pretrain", "p", "--prompt_data", "d", "--micro_rollout_batch_size", "0"])
    assert "--micro_rollout_batch_size 0 must be 1 or more." in capsys.readouterr().err
    assert parse_args(ppo_ray.Args, ["--pretrain", "p", "--prompt_data", "d"]).micro_rollout_batch_size is None


def test_a_missing_relative_model_path_that_looks_like_a_hub_name_is_one_sentence_offline(monkeypatch, tmp_path):
    """'out/sft' is also a valid hub name: offline, with nothing of that name in the cache, it is a missing folder."""
    from common.args import UserError, check_model_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="--pretrain out/sft does not exist, and no model of that name is in the "
                                        "Hugging Face cache"):
        check_model_path("out/sft")
    (tmp_path / "out" / "sft").mkdir(parents=True)
    (tmp_path / "out" / "sft" / "config.json").write_text("{}")
    check_model_path("out/sft")


def test_stream_indices_walk_every_sample_once_per_pass_and_can_be_recomputed():
    first_pass = data.stream_indices(10, 10, seed=1, start=0)
    assert sorted(first_pass) == list(range(10))
    pieces = data.stream_indices(10, 4, seed=1, start=0) + data.stream_indices(10, 6, seed=1, start=4)
    assert pieces == first_pass  # any stretch of the stream is the same, however it is asked for
    second_pass = data.stream_indices(10, 10, seed=1, start=10)
    assert sorted(second_pass) == list(range(10)) and second_pass != first_pass
    assert data.stream_indices(10, 10, seed=2, start=0) != first_pass
    assert data.stream_indices(3, 7, seed=0, start=0)[:3] == data.stream_indices(3, 3, seed=0, start=0)


def sentencepiece_style_tokenizer(decoder):
    """A Metaspace BPE tokenizer as Llama-2 and Mistral ship (their decoders drop a sequence's first space)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoder
    corpus = ["Question: what is two plus two? Answer: The answer is four", "The cat sat"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                                          special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("kind", ["metaspace", "llama-2"])
def test_a_sampled_response_reads_as_it_does_after_its_prompt(kind, tokenizer):
    """Rejection sampling writes, and rewards read, the response's text: decoded alone, a SentencePiece response
    lost its first space ("Answer:The"), and SFT on that text trained on other tokens than the policy sampled."""
    from tokenizers import decoders

    decoder = (decoders.Metaspace(replacement="▁", prepend_scheme="first") if kind == "metaspace" else
               decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                  decoders.Strip(" ", 1, 0)]))
    spm = sentencepiece_style_tokenizer(decoder)
    template, prompt = "Question: {} Answer:", "what is two plus two?"
    prompt_ids = spm(template.format(prompt), add_special_tokens=False)["input_ids"]
    whole = spm(template.format(prompt) + " The answer is four", add_special_tokens=False)["input_ids"]
    assert whole[: len(prompt_ids)] == prompt_ids
    sampled = whole[len(prompt_ids):] + [spm.eos_token_id]
    assert spm.decode(sampled, skip_special_tokens=True) == "The answer is four"  # the loss this guards against

    text = data.decode_response(spm, prompt_ids, sampled)
    assert text == " The answer is four"
    sample = data.build_sft_samples([{"prompt": prompt, "response": text}], spm, "rows", "prompt", "response", 64,
                                    input_template=template)[0]
    assert [i for i, m in zip(sample["input_ids"], sample["loss_mask"]) if m] == sampled
    # byte-level BPE (the fixtures, Llama-3, Qwen) loses nothing either way
    ids = tokenizer("Q: 2+2? A:", add_special_tokens=False)["input_ids"]
    answer = tokenizer(" four", add_special_tokens=False)["input_ids"]
    assert data.decode_response(tokenizer, ids, answer) == tokenizer.decode(answer) == " four"


TRIMMING_TEMPLATE = ("{% for m in messages %}"
                     "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("render", ["default chat", "chatml", "phi3-like", "trimming", "input template", "plain"])
def test_a_pair_side_cut_at_the_length_limit_is_trained_without_an_end(tokenizer, render):
    """rejection_sampling.py marks a rejected (or, with --keep_truncated, chosen) response that the length limit
    cut: it never wrote the end-of-turn token the rendering closes it with, so no side of the pair is trained on one
    it lacks, whatever the template writes after the response; the other side keeps its end."""
    from transformers import PreTrainedTokenizerFast

    from common.tiny_model import build_tokenizer

    chatml = build_tokenizer(chat_format="chatml")
    other = {"phi3-like": PHI3_LIKE_TEMPLATE, "trimming": TRIMMING_TEMPLATE}
    tok = {"chatml": chatml}.get(render, tokenizer)
    if render in other:
        tok = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer, pad_token="<pad>",
                                      eos_token="<|endoftext|>", chat_template=other[render])
    kw = {"apply_chat_template": render not in ("input template", "plain"),
          "input_template": "Q: {} A: " if render == "input template" else None}
    row = {"prompt": "What is 2+3?", "chosen": "5", "rejected": "Let me think about it ", "rejected_truncated": True}
    (pair,) = data.build_preference_samples([row], tok, "t", "prompt", "chosen", "rejected", 128, **kw)
    end = {"chatml": "<|im_end|>", "phi3-like": "<|im_end|>", "trimming": "<|im_end|>"}.get(render, "<eos>")
    assert masked_text(tok, pair["chosen"]).strip() == "5" + end
    assert masked_text(tok, pair["rejected"]).strip() == "Let me think about it"
    (swapped,) = data.build_preference_samples([{**row, "chosen_truncated": True, "rejected_truncated": False}], tok,
                                               "t", "prompt", "chosen", "rejected", 128, **kw)
    assert masked_text(tok, swapped["chosen"]).strip() == "5"
    assert masked_text(tok, swapped["rejected"]).strip().replace(" " + end, end) == "Let me think about it" + end
    with pytest.raises(data.DataError, match="'rejected_truncated' must be true or false, got 'yes'"):
        data.build_preference_samples([{**row, "rejected_truncated": "yes"}], tok, "t", "prompt", "chosen", "rejected",
                                      128, **kw)
