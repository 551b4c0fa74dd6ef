"""Datasets for every script: load records, render them with a template, tokenize with a loss mask, batch them.

Sources: a .json / .jsonl / .parquet file, a folder of such files (or one saved with `datasets.save_to_disk`),
or a `datasets` hub name (offline runs need it cached). Keys are configurable (`--input_key`, `--output_key`, ...).

A sample becomes text plus the character spans the loss is taken on, then tokens plus a 0/1 `loss_mask`:
  - chat template: the prompt is a user message (or a list of messages), the response an assistant message;
    a list of messages under the input key is a multi-turn conversation where every assistant turn is trained on;
  - `--input_template "Q: {} A: "`: the prompt is formatted into the template, the response follows;
  - neither: prompt and response are concatenated; pretrain mode trains on the whole text.
Assistant spans are found by rendering each conversation prefix and checking it is a text prefix of the whole,
which works for any chat template that renders history stably. Public datasets' layouts are read as they come
(ShareGPT's turns, OpenAI's text parts, a response given as the assistant's messages, Alpaca's instruction and input
joined by `--input_key instruction,input`); those that would train on the wrong text are refused in one sentence.
"""

import contextlib
import io
import json
import os
import random
import re
import string
import weakref

import torch

from common.args import UserError

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")


class DataError(UserError):
    """A problem with the user's data; the message says what to change."""


# ----------------------------------------------------------------------------------------------- loading records
def _read_text(path: str) -> str:
    """The file's text, read as UTF-8; a byte that is not is named by its line."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: byte 0x{raw[e.start]:02x} is not UTF-8 text; save the file as UTF-8, "
                        f"or fix or remove that line.") from None


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with io.StringIO(_read_text(path), newline=None) as f:  # newline=None: lines end as open()'s text mode ends them
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not valid JSON ({e.msg}); fix or remove that line.") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}.")
            rows.append(row)
    return rows


def _read_file(path: str, split: str | None = None) -> list[dict]:
    """The rows of one file. A .json holds a list of objects, or a dict with one list ({"data": [...]}) or one list
    per split ({"train": [...], "test": [...]}, read at `split`), or, as datasets' to_json writes it, one object a
    line."""
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".json"):
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # one object a line under a .json name (datasets' Dataset.to_json)
                return _read_jsonl(path)
            raise DataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}).") from None
        if isinstance(data, dict):
            data = _list_of(data, path, split)
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise DataError(f"{path}: a .json dataset must be a list of objects (or use .jsonl, one object a line).")
        return data
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DataError(f"{path}: unsupported file type; use one of {', '.join(DATA_EXTENSIONS)}.")


def _list_of(data: dict, path: str, split: str | None):
    """The rows of a .json holding a dict: its only list, or the list of `split` where its keys name splits."""
    lists = {key: value for key, value in data.items() if isinstance(value, list)}
    if split in lists:
        return lists[split]
    named = sorted(key for key in lists if _names_a_split(key))
    if named:
        raise DataError(f"{path} holds the splits {', '.join(named)}, not {split!r}; name one of them with the split "
                        f"flag (e.g. --dataset_split).")
    return next(iter(lists.values())) if len(lists) == 1 else data


# Words that mark a split in a file name (train.jsonl, test-00000-of-00002.parquet, train_prefs-00000-of-00001.parquet,
# my_valid.json) and in the keys of a .json dict.
SPLIT_NAMES = ("train", "test", "validation", "valid", "eval", "dev")
SHARD_SUFFIX = re.compile(r"-\d+-of-\d+(-[0-9a-f]{6,})?$")  # and the hub's older content-hash tail


def _words(name: str) -> list[str]:
    return re.split(r"[-_. ]", name.lower())


def _names_a_split(name: str) -> bool:
    return any(word in SPLIT_NAMES for word in _words(name))


def _split_of(file_name: str) -> str | None:
    """The split a file of a dataset folder is named for: its name without extension and shard suffix, when that
    holds a split word (train.jsonl: "train", train_prefs-00000-of-00001.parquet: "train_prefs",
    ultrafeedback.test.jsonl: "ultrafeedback.test"); else None."""
    stem = file_name[: -len(next(ext for ext in DATA_EXTENSIONS if file_name.endswith(ext)))]
    stem = SHARD_SUFFIX.sub("", stem)
    return stem if _names_a_split(stem) else None


def _holding(splits: set[str], split: str) -> list[str]:
    """The file splits whose names hold `split`'s words in a row: train, my_train and train_extra for train;
    train_prefs only for train_prefs."""
    words = _words(split)
    return sorted(name for name in splits if any(_words(name)[i:i + len(words)] == words
                                                 for i in range(len(_words(name)))))


def load_records(source: str, split: str = "train") -> list[dict]:
    """Read a dataset into a list of dicts: a file, a folder of files, a saved `datasets` dataset or a `datasets`
    name. `split` picks the split of the last two, of a .json whose keys name splits, and of a folder whose file
    names carry splits (train.jsonl and test.jsonl, train-00000-of-00002.parquet, train_prefs-00000-of-00001.parquet,
    my_train.jsonl; _split_of): only that split's files are read, a file named for no split beside them is refused
    rather than left out, and a split that names none of them, or several (train for train_prefs and train_sft, or
    for train and train_extra), is refused too. A folder without such names is one dataset, all its files."""
    if os.path.isfile(source):
        return _read_file(source, split)
    if os.path.isdir(source):
        if os.path.exists(os.path.join(source, "dataset_dict.json")) or os.path.exists(
            os.path.join(source, "dataset_info.json")
        ):
            import datasets

            ds = datasets.load_from_disk(source)
            if isinstance(ds, datasets.DatasetDict) and split not in ds:
                raise DataError(f"dataset {source} has no split {split!r}; its splits are {sorted(ds)}. Name one "
                                f"with the split flag (e.g. --dataset_split), or give that split's own dataset.")
            return list(ds[split] if isinstance(ds, datasets.DatasetDict) else ds)
        files = sorted(f for f in os.listdir(source) if f.endswith(DATA_EXTENSIONS))
        if not files:
            raise DataError(f"dataset folder {source} has no {', '.join(DATA_EXTENSIONS)} files.")
        splits = {f: _split_of(f) for f in files}
        if any(splits.values()):
            unnamed = [f for f, name in splits.items() if name is None]
            if unnamed:
                raise DataError(f"dataset folder {source} mixes files named for a split ("
                                f"{', '.join(f for f in files if splits[f])}) with others ({', '.join(unnamed)}); "
                                f"name every file for its split, or give the file you mean in place of the folder.")
            holding = _holding(set(splits.values()), split)
            if not holding:
                raise DataError(f"dataset folder {source} has no file of split {split!r} (its files are named for "
                                f"{', '.join(sorted(set(splits.values())))}); name one of its splits with the split "
                                f"flag (e.g. --dataset_split), or give that split's file.")
            if len(holding) > 1:  # train beside train_extra, or train_prefs beside train_sft: which is meant?
                raise DataError(f"dataset folder {source} has files of several splits that {split!r} could mean "
                                f"({', '.join(holding)}); name one of them whole with the split flag (e.g. "
                                f"--dataset_split {holding[-1]}), or give the file you mean in place of the folder.")
            files = [f for f in files if splits[f] == holding[0]]
        return [row for f in files for row in _read_file(os.path.join(source, f), split)]
    if source.endswith(DATA_EXTENSIONS) or source.startswith((".", "/", "~")):
        raise DataError(f"dataset file {source} does not exist; check the path.")
    import datasets

    try:
        return list(datasets.load_dataset(source, split=split))
    except Exception as e:  # hub or cache miss: say what was tried
        raise DataError(f"could not load dataset {source!r} (split {split!r}) with `datasets`: {e}") from None


def get_key(row: dict, key: str, index: int, source: str):
    """row[key], or a DataError that names the key, the sample and the keys that are there. A key of several names
    ("instruction,input") gives their texts joined by a blank line, empty ones left out (Alpaca's input is often "")."""
    if key not in row and "," in key:
        parts = [get_key(row, name.strip(), index, source) for name in key.split(",")]
        if not all(isinstance(part, str) for part in parts):
            raise DataError(f"{source}, sample {index}: the keys of {key!r} must all hold texts to join, got "
                            f"{', '.join(type(part).__name__ for part in parts)}; write \"\" where a row has no text "
                            f"there.")
        return "\n\n".join(part for part in parts if part.strip())
    if key not in row:
        raise DataError(
            f"{source}, sample {index}: no key {key!r}; the keys present are {sorted(row)}. "
            f"Pass the right name with the matching --*_key flag."
        )
    return row[key]


# Keys under which public datasets keep a second part of the prompt: Alpaca's "input" (beside "instruction"), Dolly's
# "context". An --input_key that names only the first would train every such row without it.
PROMPT_PARTS = ("input", "context")


def check_prompt_parts(rows: list[dict], input_key: str, other_keys: tuple[str, ...], source: str) -> None:
    """A DataError where rows hold text under one of PROMPT_PARTS that no key flag reads."""
    read = {name.strip() for name in input_key.split(",")} | set(other_keys)
    for part in PROMPT_PARTS:  # a conversation under input_key holds its whole prompt, and joins with no text
        holding = sum(isinstance(row.get(part), str) and bool(row[part].strip()) and not isinstance(
            row.get(input_key), list) for row in rows)
        if part not in read and holding:
            raise DataError(f"{source}: {holding} of {len(rows)} rows hold text under {part!r} beside the prompt "
                            f"under {input_key!r}, which would leave it out (Alpaca's and Dolly's layouts); give "
                            f"--input_key {input_key},{part} to join the two into the prompt, or drop the "
                            f"{part!r} column.")


def get_labels(rows: list[dict], key: str, source: str, log=print) -> list:
    """row[key] of every row, None where a row has none: the labels a reward function gets. Rows without one are
    reported, with the keys they have, since a reward function that compares with the label would score them all
    alike (a mistyped --label_key gives every prompt None)."""
    missing = sum(key not in row for row in rows)
    if missing:
        example = next(row for row in rows if key not in row)
        log(f"warning: {source}: {missing} of {len(rows)} prompts have no {key!r} (--label_key), and the reward "
            f"function gets None as their label; the keys of the first are {sorted(example)}.")
    return [row.get(key) for row in rows]


def get_response(row: dict, key: str, index: int, source: str, input_key: str) -> str:
    """row[key] as a response text: a string, a number written as one ("42"), or the assistant's reply given as
    messages (reply_of). Anything else (a null, a boolean, a conversation) is a DataError: str() would have trained on
    the text "None" or "['...']"."""
    value = get_key(row, key, index, source)
    if isinstance(value, list):
        with sample_context(source, index):
            value = reply_of(value, row.get(input_key), key, input_key)
    if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return str(value)
    where = f"; put the conversation before it under {input_key!r}" if isinstance(value, dict) else ""
    raise DataError(f"{source}, sample {index}: {key!r} must be a response text, got {type(value).__name__} "
                    f"{str(value)[:40]!r}{where}.")


def reply_of(messages: list, prompt, key: str, input_key: str) -> str:
    """The text of a response given as messages: the assistant's one reply, alone (TRL's conversational layout) or
    after a copy of the prompt's messages (UltraFeedback-binarized's chosen and rejected)."""
    messages = as_messages(messages)
    if prompt is not None:
        with contextlib.suppress(DataError):  # a prompt that is no conversation repeats nothing
            shared = as_messages(prompt)
            if _turns(messages[: len(shared)]) == _turns(shared):
                messages = messages[len(shared):]
    if len(messages) == 1 and messages[0]["role"] == "assistant" and isinstance(messages[0]["content"], str) and \
            not any(messages[0].get(field) for field in ASSISTANT_OUTPUT_FIELDS):
        return messages[0]["content"]
    raise DataError(f"{key!r} holds {len(messages)} messages ({', '.join(m['role'] for m in messages)}) after the "
                    f"prompt under {input_key!r}, where a response given as messages must be the assistant's one "
                    f"text reply; put the turns before it under {input_key!r} (pairs that differ before their last "
                    f"turn are no replies to one prompt: keep only those that differ in the last).")


def _turns(messages: list[dict]) -> list[tuple]:
    """Messages as (role, content): what makes two renderings of a conversation the same."""
    return [(m["role"], m["content"]) for m in messages]


def pair_prompt(row: dict, input_key: str, chosen_key: str, rejected_key: str, index: int, source: str):
    """A preference pair's prompt: row[input_key], or, where the row has none and both sides are conversations
    (UltraFeedback-binarized's chosen and rejected without its prompt), the messages they both begin with; where the
    row's prompt is only the first turns of two conversations that go on alike (Capybara-DPO's first message), those
    shared turns. Two whole texts without a prompt (Anthropic's HH-RLHF) are refused: where the prompt ends in them
    is the data's own convention."""
    chosen, rejected = row.get(chosen_key), row.get(rejected_key)
    given = row.get(input_key) is not None  # a null prompt (a column that other rows fill) is none
    if not given and isinstance(chosen, str) and isinstance(rejected, str):
        raise DataError(f"{source}, sample {index}: no prompt under {input_key!r} (--input_key), and "
                        f"{chosen_key!r} and {rejected_key!r} are whole texts (as Anthropic's HH-RLHF stores its "
                        f"dialogues); split each pair into its prompt, up to the last reply's start, under "
                        f"{input_key!r} and the two replies under {chosen_key!r} and {rejected_key!r} "
                        f"(docs/custom_dataset.md shows how).")
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        return get_key(row, input_key, index, source)
    chosen, rejected = as_messages(chosen), as_messages(rejected)
    # the last message of each is its reply, even where the two are the same (a pair skipped as identical)
    shared = min(len(os.path.commonprefix([_turns(chosen), _turns(rejected)])), len(chosen) - 1, len(rejected) - 1)
    if given:
        prompt = row[input_key]
        with contextlib.suppress(DataError):  # a prompt that is no conversation begins none
            begins = len(as_messages(prompt))
            if begins < shared and _turns(chosen[:begins]) == _turns(as_messages(prompt)):
                return chosen[:shared]
        return prompt
    if not shared:
        raise DataError(f"{source}, sample {index}: no prompt under {input_key!r} (--input_key), and the "
                        f"conversations under {chosen_key!r} and {rejected_key!r} share no first message to take as "
                        f"the prompt; give the prompt under {input_key!r}.")
    return chosen[:shared]


def check_responses_exclude_prompts(rows: list[dict], input_key: str, response_keys: tuple[str, ...], source: str):
    """A DataError where most rows' responses begin with their own prompt: the dataset holds whole texts under the
    response keys (as Anthropic's HH-RLHF does under chosen and rejected), and prompt + response would show the
    prompt twice in every sample."""
    def repeats(row) -> bool:
        prompt = row.get(input_key)
        return isinstance(prompt, str) and bool(prompt.strip()) and all(
            isinstance(row.get(key), str) and row[key].lstrip().startswith(prompt.strip()) for key in response_keys)

    repeated = sum(repeats(row) for row in rows)
    if repeated * 2 > len(rows):
        keys = " and ".join(repr(key) for key in response_keys)
        raise DataError(f"{source}: in {repeated} of {len(rows)} rows, {keys} begin with the prompt under "
                        f"{input_key!r}, which would be rendered twice (prompt, then prompt + response). Keep only "
                        f"the response under {keys}, with the prompt cut off.")


# --------------------------------------------------------------------------------------------------- rendering
def as_messages(prompt) -> list[dict]:
    """A prompt given as text becomes one user message; a list of messages is taken as it is, with ShareGPT's
    {"from", "value"} turns as {"role", "content"} messages (SHAREGPT_ROLES) and a content of text parts alone
    ([{"type": "text", "text": ...}], OpenAI's) as its text: templates that trim or print a content (Llama-3's) wrote
    the list's Python repr and trained on it."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "from" in m and "value" in m and
                                                   "role" not in m for m in prompt):
        unknown = [m["from"] for m in prompt if m["from"] not in SHAREGPT_ROLES]
        if unknown:  # rendered as a role of that name, a model's turn ("chatgpt", "bing") was never trained on
            raise DataError(f"ShareGPT's speaker {unknown[0]!r} is none of {', '.join(SHAREGPT_ROLES)}; rename it to "
                            f"the one it stands for (gpt for the model's turns).")
        prompt = [{"role": SHAREGPT_ROLES[m["from"]], "content": m["value"],
                   **{field: value for field, value in m.items() if field not in ("from", "value")}} for m in prompt]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        speaker = next((m["role"] for m in prompt if m["role"] in ("human", "gpt")), None)
        if speaker:  # a template renders it as a role of that name, which the model never meets at inference
            raise DataError(f"a message has the role {speaker!r}, ShareGPT's name for {SHAREGPT_ROLES[speaker]!r}; "
                            f"write {SHAREGPT_ROLES[speaker]!r}, the role chat templates take.")
        return [{**m, "content": "".join(part["text"] for part in m["content"])} if _text_parts(m["content"]) else m
                for m in prompt]
    raise DataError(f"expected text or a list of {{'role', 'content'}} messages (or ShareGPT's {{'from', 'value'}}), "
                    f"got {str(prompt)[:80]!r}.")


def _text_parts(content) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content)


# ShareGPT's speakers under the roles chat templates take; any other speaker is refused.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool", "user": "user",
                  "assistant": "assistant"}
# What an assistant message may hold besides its text, all of it the model's output: a chat template that renders
# none of it would train the turn as the text alone (an empty turn, where the model should have called a tool).
ASSISTANT_OUTPUT_FIELDS = ("tool_calls", "function_call", "reasoning_content", "thinking")


def check_chat_template(tokenizer) -> None:
    """A DataError unless the tokenizer has a chat template to render conversations with."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template to render conversations and --apply_chat_template "
                        "with; give --input_template instead, or a model whose tokenizer_config.json has one.")


def check_input_template(template: str) -> None:
    """A DataError unless `template` holds the prompt's place as exactly one `{}`: str.format would silently drop a
    prompt from a template without one, and fail on other braces."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError:
        fields = None
    if fields != [""]:
        raise DataError(f"--input_template {template!r} must hold the prompt's place as one {{}}, as in "
                        f"'Question: {{}} Answer: ' (write {{{{ and }}}} for a literal brace).")


def check_one_template(apply_chat_template: bool, input_template: str | None) -> None:
    """A DataError when both are given: the chat template would render the prompt and the input template be dropped."""
    if apply_chat_template and input_template is not None:
        raise DataError("--apply_chat_template and --input_template both say how to render a prompt; give one.")


def chat_text(tokenizer, messages: list[dict], **kwargs) -> str:
    """The tokenizer's chat template rendered as text. What the template itself raises (a Jinja `raise_exception`
    on roles it does not take, a TypeError on a content that is None or a list of parts) becomes a DataError, which
    the builders put the sample's number on (sample_context)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja2.TemplateError, or any error the template's code meets in these messages
        raise DataError(f"the chat template could not render these messages ({type(e).__name__}: {e}); give them "
                        f"the roles and the text contents it takes.") from None


@contextlib.contextmanager
def sample_context(source: str, index: int):
    """Put the source and the sample's number in front of a DataError raised while reading one sample (rendering
    errors do not know which sample they met)."""
    try:
        yield
    except DataError as e:
        if str(e).startswith(f"{source}, "):
            raise
        raise DataError(f"{source}, sample {index}: {e}") from None


def render_chat(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return the text and the character spans of the assistant turns.

    A span runs from the end of the generation prompt to the turn's end-of-turn token: what a template writes after
    that token (ChatML's "<|im_end|>\n", Gemma's "<end_of_turn>\n", Phi-3's "<|end|>\n<|endoftext|>" after the last
    turn) is left out, since generation stops at the token and the policy never writes what follows it.
    """
    check_chat_template(tokenizer)
    text = chat_text(tokenizer, messages)
    end_token = end_of_turn_token(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        rendered = chat_text(tokenizer, messages[: i + 1])
        _check_renders_output(tokenizer, messages[: i + 1], rendered)
        before = chat_text(tokenizer, messages[:i], add_generation_prompt=True) if i else _opening(tokenizer, messages,
                                                                                                  text)
        through = without_closing_eos(tokenizer, rendered, text)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(
                "the chat template does not render a conversation's history as a prefix of the whole, so "
                "assistant turns cannot be located; use --input_template instead of --apply_chat_template."
            )
        end = max(len(before), len(through.rstrip()))  # after the turn's last character that is not whitespace
        last = through.rfind(end_token, len(before), closing_tail_at(tokenizer, messages[: i + 1], through)) \
            if end_token else -1
        spans.append((len(before), min(end, last + len(end_token)) if last >= 0 else end))
    return text, spans


def _check_renders_output(tokenizer, messages: list[dict], rendered: str) -> None:
    """A DataError where the chat template leaves out what the last (assistant) message holds besides its text (its
    tool calls, its reasoning): the turn would be trained as the text alone. `rendered`: the messages rendered."""
    last = messages[-1]
    for field in ASSISTANT_OUTPUT_FIELDS:
        if last.get(field) and rendered == chat_text(
                tokenizer, messages[:-1] + [{key: value for key, value in last.items() if key != field}]):
            raise DataError(f"the chat template does not render the {field!r} of assistant turn {len(messages) - 1}, "
                            f"which would be trained as its text alone; give a model whose chat template renders "
                            f"{field!r}, or leave such turns out of the data.")


def _opening(tokenizer, messages: list[dict], text: str) -> str:
    """What the template writes before a conversation's first message when that is the assistant's: a BOS, a default
    system prompt, the role's header. Found where a sentinel in place of the message's content lands; the span of a
    leading assistant turn starts after it, not at the conversation's first character. "" where that is no prefix of
    the conversation's `text` (a template that changes what comes before with the content)."""
    first = {**messages[0], "content": SENTINEL}
    try:
        marked = chat_text(tokenizer, [first] + messages[1:])
    except DataError:
        return ""
    opening = marked[: marked.find(SENTINEL)] if SENTINEL in marked else ""
    return opening if text.startswith(opening) else ""


def closing_tail_at(tokenizer, messages: list[dict], rendered: str) -> int:
    """Where what the template writes only to close a conversation begins in `rendered` (Phi-3's EOS after the last
    turn): the end of the part it shares with the same messages followed by a generation prompt. A template whose
    EOS is also its end-of-turn token (Phi-3 with eos_token <|end|>) writes "5<|end|>\n<|end|>", and the turn ends at
    the first of the two."""
    try:
        continued = chat_text(tokenizer, messages, add_generation_prompt=True)
    except DataError:  # a template that asks for no generation prompt after an assistant turn
        return len(rendered)
    return len(os.path.commonprefix([rendered, continued]))


SENTINEL = "\x00reply\x00"  # an assistant message whose end the template shows
_end_tokens = weakref.WeakKeyDictionary()  # tokenizer -> {chat template: its end-of-turn token}


def end_of_turn_token(tokenizer) -> str | None:
    """The special or added token the chat template writes first after an assistant message (not a whitespace one):
    "<|im_end|>", "<|eot_id|>", "<end_of_turn>", Phi-3's "<|end|>", the EOS of Llama-2 and Mistral. None when the
    template writes no such token, or does not render a user message and a reply."""
    known = _end_tokens.setdefault(tokenizer, {})
    if tokenizer.chat_template not in known:
        try:
            text = chat_text(tokenizer, [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}])
        except DataError:
            text = ""
        after = text.find(SENTINEL) + len(SENTINEL) if SENTINEL in text else len(text)
        markers = {t for t in tokenizer.all_special_tokens if t.strip()} | {
            t.content for t in tokenizer.added_tokens_decoder.values() if t.content.strip()}
        found = [(i, -len(m), m) for m in markers if (i := text.find(m, after)) >= 0]
        known[tokenizer.chat_template] = min(found)[2] if found else None  # the first; of two there, the longer
    return known[tokenizer.chat_template]


def without_closing_eos(tokenizer, history: str, whole: str) -> str:
    """A conversation's history as the whole conversation renders it. Some templates (Phi-3's) close a conversation
    with the EOS: a history that ends at an earlier assistant turn has it, the whole conversation has it only at the
    end. Such a history is taken without its EOS (and the whitespace before it)."""
    eos = tokenizer.eos_token
    if whole.startswith(history) or not eos or not history.endswith(eos):
        return history
    return history[: -len(eos)].rstrip() if whole.startswith(history[: -len(eos)].rstrip()) else history


def prompt_messages(prompt) -> list[dict]:
    """A prompt as the messages a new assistant turn follows. One that ends with the assistant's turn (a whole
    conversation, as UltraChat's messages are) is refused: the response would be a second reply after the answer."""
    messages = as_messages(prompt)
    if messages and messages[-1]["role"] == "assistant":
        raise DataError("the prompt's conversation ends with an assistant turn, after which the response would be a "
                        "second reply; end each prompt with the turn the response answers (cut the last reply off).")
    return messages


def render_prompt(tokenizer, prompt, apply_chat_template: bool, input_template: str | None) -> str:
    """The text a model is asked to continue: used by generation and by every prompt/response pair."""
    check_one_template(apply_chat_template, input_template)
    if apply_chat_template:
        check_chat_template(tokenizer)
        return chat_text(tokenizer, prompt_messages(prompt), add_generation_prompt=True)
    if isinstance(prompt, list):
        raise DataError("a prompt given as a list of messages needs --apply_chat_template.")
    if not isinstance(prompt, str):
        raise DataError(f"a prompt must be text (or, with --apply_chat_template, a list of messages), got "
                        f"{type(prompt).__name__} {str(prompt)[:40]!r}.")
    if input_template is not None:
        check_input_template(input_template)
    text = input_template.format(prompt) if input_template else prompt
    return (tokenizer.bos_token or "") + text


def render_pair(tokenizer, prompt, response: str, apply_chat_template: bool, input_template: str | None):
    """Render prompt + response (ended by EOS); return the text and the response's character span.

    A prompt given as a conversation may hold earlier assistant turns: they are context, and only the new response's
    span is returned."""
    check_one_template(apply_chat_template, input_template)
    if apply_chat_template:
        text, spans = render_chat(tokenizer, prompt_messages(prompt) + [{"role": "assistant", "content": response}])
        return text, spans[-1:]
    prompt_text = render_prompt(tokenizer, prompt, False, input_template)
    text = prompt_text + response + tokenizer.eos_token
    return text, [(len(prompt_text), len(text))]


def tokenize_with_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokenize `text`; a token is in the loss mask when any of its characters lies inside one of the spans.

    A token may straddle a span's start: byte-level BPE merges a template's trailing space into the response's first
    word (" seven" after "A: " is one token that starts at the space). It belongs to the response, which would
    otherwise lose its first word from the loss.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start < e and end > s for s, e in spans)) for start, end in enc["offset_mapping"]]
    return enc["input_ids"], mask


# ------------------------------------------------------------------------------------------------ SFT samples
def build_sft_samples(rows, tokenizer, source, input_key, output_key, max_len, apply_chat_template=False,
                      input_template=None, pretrain_mode=False, log=print) -> list[dict]:
    """Tokenize records for SFT into {"input_ids", "loss_mask"} lists, truncated to max_len.

    Samples longer than max_len are truncated and counted; a sample left with no trained token is dropped and
    counted; both counts are reported. An empty result is an error that says which limit to change.
    """
    if not rows:
        raise DataError(f"dataset {source} is empty.")
    if pretrain_mode and (apply_chat_template or input_template is not None):
        raise DataError(f"--pretrain_mode trains on the text under {input_key!r} as it is, which "
                        f"{'--apply_chat_template' if apply_chat_template else '--input_template'} would not change; "
                        f"leave that flag out, or leave out --pretrain_mode to train on prompt/response pairs.")
    if not pretrain_mode:
        check_prompt_parts(rows, input_key, (output_key,), source)
        check_responses_exclude_prompts(rows, input_key, (output_key,), source)
    samples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        with sample_context(source, i):
            text, spans = _sft_text(row, i, tokenizer, source, input_key, output_key, apply_chat_template,
                                    input_template, pretrain_mode)
        ids, mask = tokenize_with_spans(tokenizer, text, spans)
        mask[0] = 0  # the first token has nothing before it to be predicted from
        if len(ids) > max_len:
            truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
        if sum(mask) == 0:
            dropped += 1
            continue
        samples.append({"input_ids": ids, "loss_mask": mask})
    return checked_samples(samples, source, max_len, log, truncated, dropped, f"of {len(rows)} samples")


def _sft_text(row, i, tokenizer, source, input_key, output_key, apply_chat_template, input_template,
              pretrain_mode) -> tuple[str, list[tuple[int, int]]]:
    """One SFT record rendered: the text and the character spans trained on.

    A conversation under input_key with no output_key trains on its assistant turns, when it ends with one; a
    conversation that ends with another turn is a prompt, and its response must be under output_key (TRL's
    prompt/completion layout names it "completion"): training its history would drop the real target.
    """
    if pretrain_mode:
        document = get_key(row, input_key, i, source)
        if not isinstance(document, str):  # str() would have trained on the text "None" or "['a', 'b']"
            raise DataError(f"{source}, sample {i}: {input_key!r} must be the text to train on, got "
                            f"{type(document).__name__} {str(document)[:40]!r}.")
        if output_key in row:  # a prompt/response row: its response would be left out
            raise DataError(f"{source}, sample {i}: the row has {output_key!r} (--output_key) beside {input_key!r}, "
                            f"and --pretrain_mode trains on {input_key!r} alone; give the key of the whole text "
                            f"with --input_key, or leave out --pretrain_mode to train on prompt/response pairs.")
        text = (tokenizer.bos_token or "") + document + tokenizer.eos_token
        spans = [(0, len(text))]
    elif isinstance(row.get(input_key), list) and output_key not in row:
        if not _ends_with_assistant(as_messages(row[input_key])):
            raise DataError(f"the conversation under {input_key!r} does not end with an assistant turn to train on, "
                            f"and the row has no {output_key!r}; give the response under --output_key (e.g. "
                            f"--output_key completion), or end the conversation with the assistant's turn. The keys "
                            f"present are {sorted(row)}.")
        if input_template is not None:
            raise DataError(f"{input_key!r} holds a conversation, which is rendered with the tokenizer's chat "
                            f"template; use --apply_chat_template instead of --input_template.")
        text, spans = render_chat(tokenizer, as_messages(row[input_key]))
    else:
        prompt, response = get_key(row, input_key, i, source), get_response(row, output_key, i, source, input_key)
        text, spans = render_pair(tokenizer, prompt, response, apply_chat_template, input_template)
    return text, spans


def _ends_with_assistant(messages: list) -> bool:
    return bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"


def checked_samples(samples: list, source: str, max_len: int, log, truncated: int, dropped: int,
                    truncated_what: str, dropped_what: str = "") -> list:
    """The end of every build_*_samples: refuse a source with nothing left, say what --max_len cut, return samples.

    "<source>: <truncated> <truncated_what> truncated to --max_len N; <dropped> [<dropped_what>] dropped because no
    response token was left", when either count is not 0.
    """
    if not samples:
        raise DataError(f"every sample of {source} is longer than --max_len {max_len} before its response starts; "
                        f"raise --max_len.")
    if truncated or dropped:
        log(f"{source}: {truncated} {truncated_what} truncated to --max_len {max_len}; "
            f"{' '.join(filter(None, [str(dropped), dropped_what]))} dropped because no response token was left.")
    return samples


# --------------------------------------------------------------------------------------------------- batching
def pad_collate(samples: list[dict], pad_id: int, keys=("input_ids", "loss_mask")) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into (batch, seq) tensors plus an attention_mask."""
    length = max(len(s["input_ids"]) for s in samples)
    batch = {}
    for key in keys:
        fill = pad_id if key == "input_ids" else 0
        batch[key] = torch.tensor([s[key] + [fill] * (length - len(s[key])) for s in samples])
    batch["attention_mask"] = torch.tensor([[1] * len(s["input_ids"]) + [0] * (length - len(s["input_ids"]))
                                            for s in samples])
    return batch


def pack_collate(samples: list[dict], keys=("input_ids", "loss_mask")) -> dict[str, torch.Tensor]:
    """Concatenate samples into one (1, total) row with position_ids restarting at 0 for each sample.

    With no attention_mask, transformers reads the restarts in position_ids as sequence boundaries and lets each
    sample attend only to itself (block-diagonal causal mask with sdpa/eager, varlen kernels with flash attention).
    """
    batch = {key: torch.tensor([sum((s[key] for s in samples), [])]) for key in keys}
    batch["position_ids"] = torch.tensor([sum((list(range(len(s["input_ids"]))) for s in samples), [])])
    return batch


def report_leftover(num_samples: int, train_batch_size: int, source: str, what: str, log=print) -> None:
    """Say how many samples each epoch leaves out when they do not fill a last batch (micro_batches' order is
    reshuffled every epoch, so a run of several epochs leaves out different ones each time)."""
    left = num_samples % train_batch_size
    if left:
        log(f"{source}: each epoch trains on {num_samples - left} of the {num_samples} {what} and leaves {left} "
            f"out, too few for another batch of --train_batch_size {train_batch_size}; the order is reshuffled every "
            f"epoch, so each one leaves out others.")


def steps_per_epoch(num_samples: int, train_batch_size: int, source: str, what: str, log=print) -> int:
    """Optimizer steps in one pass over `num_samples` usable samples (`what`: "samples", "pairs"); a DataError when
    they fill no batch, and report_leftover's note when they do not fill the last one."""
    steps = num_samples // train_batch_size
    if steps == 0:
        raise DataError(f"{source} has {num_samples} usable {what}, fewer than one batch; lower --train_batch_size "
                        f"below {train_batch_size}.")
    report_leftover(num_samples, train_batch_size, source, what, log)
    return steps


def micro_batches(num_samples: int, train_batch_size: int, micro_batch_size: int, world_size: int, rank: int,
                  seed: int, epoch: int, lengths: list[int] | None = None) -> list[list[list[int]]]:
    """Sample indices for one epoch: a list of steps, each a list of this rank's micro-batches.

    A step consumes `train_batch_size` samples across all ranks; the order is a fixed function of (seed, epoch),
    so a resumed run sees exactly the batches it would have seen. The last incomplete global batch is left for
    the next epoch's shuffle. With `lengths` (each sample's padded width), a rank's share of each step is sorted
    by length before it is cut, so that samples of alike length pad together. Pass it only where a step's loss does
    not depend on which of its samples share a micro-batch (a mean over the step's tokens or pairs).
    """
    order = list(range(num_samples))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    per_rank = train_batch_size // world_size
    steps = []
    for start in range(0, num_samples - train_batch_size + 1, train_batch_size):
        mine = order[start + rank * per_rank: start + (rank + 1) * per_rank]
        if lengths is not None:
            mine.sort(key=lengths.__getitem__)
        steps.append([mine[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
    return steps


def padded_width(sample: dict) -> int:
    """The columns a sample takes in a padded micro-batch: its tokens, or a pair's longer side (micro_batches'
    lengths)."""
    if "input_ids" in sample:
        return len(sample["input_ids"])
    return max(len(sample["chosen"]["input_ids"]), len(sample["rejected"]["input_ids"]))


def stream_indices(num_samples: int, count: int, seed: int, start: int) -> list[int]:
    """Positions start .. start + count - 1 of an endless stream of sample indices, mapped into range(num_samples).

    Each pass over the data is a fresh shuffle fixed by (seed, pass), so consecutive draws walk through the whole
    set before any sample repeats, and any position can be computed again: a caller that derives `start` from its
    step and rank draws disjoint rows on every rank and continues exactly where it left off after a resume.
    """
    orders = {}
    indices = []
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_samples)
        if epoch not in orders:
            orders[epoch] = list(range(num_samples))
            random.Random(seed * 100_003 + epoch).shuffle(orders[epoch])
        indices.append(orders[epoch][offset])
    return indices


# ------------------------------------------------------------------------------------ preference and KTO samples
def _tokenize_response(tokenizer, prompt, response, max_len: int, apply_chat_template: bool,
                       input_template: str | None, end_with_eos: bool, unfinished: bool = False) -> tuple[dict, bool]:
    """One prompt + response as {"input_ids", "loss_mask"} (the mask covers the response), and whether it was cut.
    An `unfinished` response (cut at a sampler's length limit) is trained without the end the template gives it."""
    text, spans = render_pair(tokenizer, prompt, str(response), apply_chat_template, input_template)
    span = without_the_end(text, spans[0], str(response)) if unfinished else spans[0]
    return _tokenize_span(tokenizer, text, span, max_len, end_with_eos)


def without_the_end(text: str, span: tuple[int, int], response: str) -> tuple[int, int]:
    """The span of a response that a length limit cut, ending at its last character instead of at the end-of-turn
    token or EOS the rendering closed it with. The sampler never wrote that token: a loss on it would teach a model
    to stop where the limit cut (a chosen response) or never to stop there (a rejected one)."""
    body = response.strip()  # templates may trim a message's whitespace
    at = text.find(body, span[0], span[1])
    if at < 0:
        raise DataError("the chat template rewrites this response's text, so the end of a response cut at the length "
                        "limit cannot be found in it; drop the pair, or train with --input_template.")
    return span[0], at + len(body)


def unfinished_flag(row: dict, key: str, index: int, source: str) -> bool:
    """row[key + "_truncated"]: true where the response under `key` was cut at a length limit (rejection_sampling.py
    writes it), so it has no end to train; absent means false."""
    flag = row.get(f"{key}_truncated", False)
    if not isinstance(flag, bool):
        raise DataError(f"{source}, sample {index}: {key + '_truncated'!r} must be true or false, got {flag!r}.")
    return flag


def _tokenize_span(tokenizer, text: str, span: tuple[int, int], max_len: int,
                   end_with_eos: bool) -> tuple[dict, bool]:
    """`text` as {"input_ids", "loss_mask"} with the mask on the tokens of its response `span`, truncated to max_len
    (end_with_eos: cut after the response's EOS, and end a truncated row with one), and whether it was cut."""
    ids, mask = tokenize_with_spans(tokenizer, text, [span])
    mask[0] = 0  # the first token has nothing before it to be predicted from
    return truncated_sample(ids, mask, max_len, tokenizer.eos_token_id if end_with_eos else None)


def truncated_sample(ids: list[int], mask: list[int], max_len: int, eos_id: int | None = None) -> tuple[dict, bool]:
    """{"input_ids", "loss_mask"} cut to max_len, and whether it was cut. With `eos_id` (a reward model's rows) the
    response ends at its EOS, where the reward is read: cut right after it, and a truncated row ends with one."""
    if eos_id is not None:  # a reward is read at an EOS, even after truncation
        ids, mask = _end_at_response_eos(ids, mask, eos_id)
        if ids[-1] != eos_id:
            ids, mask = ids + [eos_id], mask + [1]
    truncated = len(ids) > max_len
    ids, mask = ids[:max_len], mask[:max_len]
    if eos_id is not None and ids[-1] != eos_id:
        ids, mask = ids[: max_len - 1] + [eos_id], mask[: max_len - 1] + [1]
        if not any(mask[:-1]):  # none of the response is left, only the EOS after the prompt: nothing to score
            mask = [0] * len(mask)
    return {"input_ids": ids, "loss_mask": mask}, truncated


def _end_at_response_eos(ids: list[int], mask: list[int], eos_id: int) -> tuple[list[int], list[int]]:
    """Cut a rendered prompt + response right after the response's first EOS, or, where it has none, right after
    the response (a chat template's span ends at its end-of-turn token: Gemma's "5<end_of_turn>").

    A reward model is read at the EOS that ends the response, and PPO scores what the policy generated: the prompt,
    the response and the EOS at which generation stopped. Chat templates that write more after the end-of-turn
    token (ChatML's "<|im_end|>\n", Gemma's "<end_of_turn>\n") would otherwise leave that tail in the training
    rows, and the appended EOS after it would be read in a context the policy's rollouts never have; and a row that
    just fit --max_len would lose the tail's last token to the EOS where shorter rows keep it. The response is the
    last run of masked tokens (earlier assistant turns of a conversation are runs of their own).
    """
    end = max((i for i, m in enumerate(mask) if m), default=-1)
    if end < 0:
        return ids, mask
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    cut = next((i for i in range(start, end + 1) if ids[i] == eos_id), end)
    return ids[: cut + 1], mask[: cut + 1]


DEFAULT_MARGIN_KEY = "margin"  # rm.py's --margin_key: a dataset without margins lacks it, which is no mistake


def check_margin_key(rows: list[dict], margin_key: str | None, source: str, log=print) -> None:
    """Refuse a --margin_key no pair has (a mistyped key would read as margin 0); warn of pairs without one."""
    without_margin = sum(margin_key not in row for row in rows) if margin_key else 0
    if without_margin == len(rows) and margin_key != DEFAULT_MARGIN_KEY:
        raise DataError(f"no pair of {source} has {margin_key!r} (--margin_key); the keys of the first are "
                        f"{sorted(rows[0])}. Give the key that holds the margins, or leave --margin_key out.")
    if 0 < without_margin < len(rows):
        log(f"warning: {source}: {without_margin} of {len(rows)} pairs have no {margin_key!r} (--margin_key); their "
            f"margin is 0.")


def row_margin(row: dict, margin_key: str | None, source: str, index: int) -> float:
    """A pair's margin, row[margin_key], 0 where the row has none."""
    margin = row.get(margin_key, 0.0) if margin_key else 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise DataError(f"{source}, sample {index}: {margin_key!r} must be a number, got {margin!r}.")
    return float(margin)


def build_preference_samples(rows, tokenizer, source, input_key, chosen_key, rejected_key, max_len,
                             apply_chat_template=False, input_template=None, margin_key=None, end_with_eos=False,
                             log=print) -> list[dict]:
    """Tokenize preference pairs into {"chosen": sample, "rejected": sample, "margin": float} (rm.py, dpo.py).

    Each side is {"input_ids", "loss_mask"} with the mask on its response tokens. `margin` is row[margin_key] when
    the row has it, else 0. A pair whose chosen and rejected texts are identical teaches nothing and is skipped;
    so is a pair left with no response token after truncation to max_len. Both counts are reported.
    """
    if not rows:
        raise DataError(f"dataset {source} is empty.")
    check_margin_key(rows, margin_key, source, log)
    check_prompt_parts(rows, input_key, (chosen_key, rejected_key), source)
    check_responses_exclude_prompts(rows, input_key, (chosen_key, rejected_key), source)
    samples, truncated, identical, dropped = [], 0, 0, 0
    for i, row in enumerate(rows):
        with sample_context(source, i):
            prompt = pair_prompt(row, input_key, chosen_key, rejected_key, i, source)
        row = {**row, input_key: prompt}  # a prompt found in the conversations: their replies follow it (reply_of)
        chosen = get_response(row, chosen_key, i, source, input_key)
        rejected = get_response(row, rejected_key, i, source, input_key)
        if chosen == rejected:
            identical += 1
            continue
        pair = {"margin": row_margin(row, margin_key, source, i)}
        for side, key, response in (("chosen", chosen_key, chosen), ("rejected", rejected_key, rejected)):
            with sample_context(source, i):
                pair[side], cut = _tokenize_response(tokenizer, prompt, response, max_len, apply_chat_template,
                                                     input_template, end_with_eos, unfinished_flag(row, key, i, source))
            truncated += cut
        if sum(pair["chosen"]["loss_mask"]) == 0 or sum(pair["rejected"]["loss_mask"]) == 0:
            dropped += 1
            continue
        if pair["chosen"] == pair["rejected"]:  # they differed only in what --max_len cut off
            identical += 1
            continue
        samples.append(pair)
    if identical:
        log(f"warning: {source}: skipped {identical} of {len(rows)} pairs whose {chosen_key!r} and "
            f"{rejected_key!r} are identical (or differ only past --max_len {max_len}).")
    if not samples:
        raise DataError(f"{source} has no usable pair: every pair is identical or longer than --max_len {max_len} "
                        f"before its responses start.")
    return checked_samples(samples, source, max_len, log, truncated, dropped, "responses", "pairs")


def build_kto_samples(rows, tokenizer, source, input_key, output_key, label_key, max_len, apply_chat_template=False,
                      input_template=None, log=print) -> list[dict]:
    """Tokenize unpaired feedback into {"input_ids", "loss_mask", "label", "prompt_text", "response_text",
    "response_chars"} (kto.py).

    `label` must be a JSON boolean (true: a desirable response). The rendered text split where the response starts
    (what the template writes after the response included, the response's own `response_chars` characters first)
    lets kto.py put a response after another sample's prompt for KTO's KL reference point (mismatched_pair).
    """
    if not rows:
        raise DataError(f"dataset {source} is empty.")
    check_prompt_parts(rows, input_key, (output_key, label_key), source)
    check_responses_exclude_prompts(rows, input_key, (output_key,), source)
    samples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        prompt, response = get_key(row, input_key, i, source), get_response(row, output_key, i, source, input_key)
        label = get_key(row, label_key, i, source)
        if not isinstance(label, bool):
            raise DataError(f"{source}, sample {i}: {label_key!r} must be true or false (a JSON boolean), "
                            f"got {label!r}.")
        with sample_context(source, i):
            text, [(start, end)] = render_pair(tokenizer, prompt, response, apply_chat_template, input_template)
        sample, cut = _tokenize_span(tokenizer, text, (start, end), max_len, end_with_eos=False)
        truncated += cut
        if sum(sample["loss_mask"]) == 0:
            dropped += 1
            continue
        samples.append({**sample, "label": label, "prompt_text": text[:start], "response_text": text[start:],
                        "response_chars": end - start})
    return checked_samples(samples, source, max_len, log, truncated, dropped, f"of {len(rows)} samples")


def mismatched_pair(tokenizer, sample: dict, other: dict, max_len: int) -> dict:
    """`sample`'s prompt followed by `other`'s response (build_kto_samples' samples), as {"input_ids", "loss_mask"}.

    The two texts are joined and tokenized as one, as the pair would be rendered: splicing token ids would lose or
    double the characters of a token that merges the prompt's end with the response's start (a template's trailing
    space and a response's first word). Assumes, as KTO's reference point does, that an assistant turn renders the
    same after any prompt.
    """
    start = len(sample["prompt_text"])
    text = sample["prompt_text"] + other["response_text"]
    pair, _ = _tokenize_span(tokenizer, text, (start, start + other["response_chars"]), max_len, end_with_eos=False)
    return pair


def reward_model_input_ids(tokenizer, prompt, response: str, max_len: int, apply_chat_template: bool = False,
                           input_template: str | None = None) -> list[int]:
    """The tokens a reward model scores: prompt + response ended by EOS, rendered as rm.py renders its pairs."""
    sample, _ = _tokenize_response(tokenizer, prompt, response, max_len, apply_chat_template, input_template,
                                   end_with_eos=True)
    return sample["input_ids"]


def generation_stop_ids(tokenizer, apply_chat_template: bool) -> list[int]:
    """What vLLM must stop at besides the EOS and the model's generation_config: with a chat template, its
    end-of-turn token where that is another token. A base model's EOS and generation_config name <|endoftext|>
    (Qwen2.5) or <|end_of_text|> (Llama-3) while its template ends a turn with <|im_end|> or <|eot_id|>: a policy
    fine-tuned on the template writes that token, and without this stop ran on past it into a made-up next turn."""
    end = end_of_turn_token(tokenizer) if apply_chat_template else None
    return [tokenizer.convert_tokens_to_ids(end)] if end and end != tokenizer.eos_token else []


def merged_eos_ids(eos, tokenizer, extra: list[int]) -> list[int]:
    """A generation_config's eos_token_id (an id, a list of ids, or None: the tokenizer's EOS) with `extra` ids
    added, each once, in order."""
    eos = eos if isinstance(eos, list) else [tokenizer.eos_token_id if eos is None else eos]
    return list(dict.fromkeys(eos + list(extra)))


def decode_response(tokenizer, prompt_ids: list[int], response_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of a sampled response as it reads after its prompt.

    Decoded alone, a response can lose its first character: SentencePiece decoders (Llama-2, Mistral) drop the
    leading space of a sequence's first token ("▁The"), so the text a reward read, or that rejection sampling handed
    SFT, was "Answer:The" where the policy wrote "Answer: The". Decoding after the prompt and cutting the prompt's
    text off keeps it; where the prompt's text is not a prefix of the whole (a character split between the two), the
    response is decoded alone. With skip_special_tokens, the token the sample stopped at (the EOS, or the chat
    template's end-of-turn token) is left out even where the tokenizer adds it without marking it special: a text
    ending "<|im_end|>" would be written twice by the template that SFT renders it with.
    """
    if skip_special_tokens and response_ids and response_ids[-1] in generation_stop_ids(tokenizer, True) + [
            tokenizer.eos_token_id]:
        response_ids = list(response_ids)[:-1]
    prefix = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    whole = tokenizer.decode(list(prompt_ids) + list(response_ids), skip_special_tokens=skip_special_tokens)
    if whole.startswith(prefix):
        return whole[len(prefix):]
    return tokenizer.decode(response_ids, skip_special_tokens=skip_special_tokens)


def load_prompts(args, tokenizer, source: str, split_name: str) -> list[dict]:
    """ppo_ray.py's prompts, tokenized, with their labels: {"prompt", "ids", "label"}, and for a vision-language
    policy their images (common/vlm.py with_images); prompts over --prompt_max_len are skipped and counted."""
    rows = load_records(source, split_name)
    if not rows:
        raise DataError(f"prompt dataset {source} is empty.")
    prompts, skipped = [], 0
    read = args.reward_fn or args.remote_rm_url or args.env_fn  # what gets the labels: said when they are missing
    check_prompt_parts(rows, args.input_key, (args.label_key,), source)
    labels = get_labels(rows, args.label_key, source, print if read else lambda message: None)
    from common import vlm  # (it builds on this module)
    processor = vlm.prompt_processor(args, rows, source)  # a vision-language policy's: its prompts' images
    for i, row in enumerate(rows):
        prompt = get_key(row, args.input_key, i, source)
        with sample_context(source, i):
            text = render_prompt(tokenizer, prompt, args.apply_chat_template, args.input_template)
            entry = {"prompt": prompt, "ids": tokenizer(text, add_special_tokens=False)["input_ids"],
                     "label": labels[i]}
            entry = vlm.with_images(entry, processor, source) if processor else entry
        if len(entry["ids"]) > args.prompt_max_len:  # an image's tokens count: vLLM's context holds them
            skipped += 1
            continue
        prompts.append(entry)
    if not prompts:
        raise DataError(f"every prompt in {source} is longer than --prompt_max_len {args.prompt_max_len}; raise it.")
    if skipped:
        print(f"{source}: skipped {skipped} of {len(rows)} prompts longer than --prompt_max_len {args.prompt_max_len}")
    return prompts
