"""Reward sources shared by ppo_ray.py and rejection_sampling.py: rule-based functions from a file, reward models,
a remote reward model over HTTP.

Each source turns a batch of (prompt, response, label) into one float per response; `combine_rewards` adds the
sources up with weights. Prompts are the dataset's prompts (text, or a list of chat messages), responses the decoded
text the policy generated, labels whatever reference the dataset holds (None where it has none). Only plain
functions, so that a Ray worker can import this module and call them:

    fn = load_reward_fn("common/synthetic_task.py:reward_fn")
    rule = call_reward_fn(fn, prompts, responses, labels)
    model, tokenizer = load_reward_model("out/rm")
    check_same_tokenizer(policy_tokenizer, tokenizer, "--pretrain out/sft", "--reward_pretrain out/rm")
    learned = reward_model_scores(model, tokenizer, prompts, responses, apply_chat_template=True)  # its own template
    remote = remote_reward("http://127.0.0.1:5000/reward", prompts, responses, labels)
    rewards = combine_rewards([learned, rule, remote], [1.0, 0.5, 1.0])
"""

import importlib.util
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from common import data, vlm
from common.args import UserError, check_decoder_only
from common.deadlines import DeadlinePassed, within_deadline
from common.logging_utils import phase
from common.modeling import sequence_rewards


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_rewards(rewards, num_responses: int, source: str) -> list[float]:
    """`rewards` as a list of finite floats, one per response, or a UserError that says what `source` got wrong."""
    if isinstance(rewards, (str, bytes, Mapping, set)):  # iterable, but over keys or characters: never the rewards
        raise UserError(f"{source} returned a {type(rewards).__name__}, {_short(rewards)}; it must return a list of "
                        f"numbers, one per response, in the order of the responses.")
    try:
        rewards = [float(r) for r in rewards]
    except (TypeError, ValueError):
        raise UserError(f"{source} returned {_short(rewards)}; it must return a list of numbers, one per "
                        f"response.") from None
    if len(rewards) != num_responses:
        raise UserError(f"{source} returned {len(rewards)} rewards for {num_responses} responses; it must return "
                        f"one per response.")
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise UserError(f"{source} returned {rewards[bad[0]]} for response {bad[0]} of the batch; rewards must be "
                        f"finite numbers.")
    return rewards


# ------------------------------------------------------------------------------------------- rule-based functions
def load_reward_fn(spec: str, flag: str = "--reward_fn", timeout: float | None = None):
    """The function named by `path/to/file.py:function`, loaded from the file by its path; with `timeout`, each
    call that takes longer stops the run (--reward_timeout, common/deadlines.py)."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise UserError(f"{flag} {spec!r} must be written path/to/file.py:function_name.")
    if not os.path.isfile(path):
        raise UserError(f"{flag} file {path} does not exist; check the path.")
    module_name = "reward_fn_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        functions = sorted(k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", None)
                           == module_name)
        raise UserError(f"{flag} file {path} has no function {name!r}; it defines {functions}.")
    if timeout is not None:
        return within_deadline(fn, timeout, f"reward function {name}", "--reward_timeout")
    return fn


def call_reward_fn(fn, prompts: list, responses: list[str], labels: list) -> list[float]:
    """fn(prompts, responses, labels) checked: one finite float per response, or a UserError naming what failed.

    When the function raises, it is called again one sample at a time to find the sample that makes it fail.
    """
    name = f"reward function {getattr(fn, '__name__', repr(fn))}"
    try:
        rewards = fn(prompts, responses, labels)
    except DeadlinePassed:  # calling it again, one sample at a time, would hang as long again
        raise
    except Exception as batch_error:
        failing, error = None, batch_error
        for i in range(len(responses)):
            try:
                fn(prompts[i: i + 1], responses[i: i + 1], labels[i: i + 1])
            except DeadlinePassed:
                raise
            except Exception as e:
                failing, error = i, e
                break
        where = (f"on sample {failing} of the batch (prompt {_short(prompts[failing])}, response "
                 f"{_short(responses[failing])}, label {_short(labels[failing])})" if failing is not None
                 else f"on a batch of {len(responses)} samples, though on none of them alone")
        raise UserError(f"{name} raised {type(error).__name__}: {error} {where}; fix the function or that sample."
                        ) from error
    return check_rewards(rewards, len(responses), name)


# -------------------------------------------------------------------------------------------------- reward models
def load_reward_model(path: str, flag: str = "--reward_pretrain", device: str | None = None):
    """A reward model saved by rm.py (a ...ForSequenceClassification with one output) and its tokenizer, for scoring;
    for a vision-language one, common/vlm.py's scalar-head class and its processor, which reads the prompts' images.

    On the GPU when there is one (bf16 where supported), in eval mode.
    """
    if not os.path.isdir(os.path.expanduser(path)) and path.startswith((".", "/", "~")):
        raise UserError(f"{flag} {path} does not exist; give a reward model folder saved by rm.py.")
    vision_language = vlm.is_vision_language(path)
    if not vision_language:
        check_decoder_only(path, flag)
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = vlm.load_processor(path, flag) if vision_language else AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"{flag} {path}: no reward model could be loaded ({e}).") from None
    architecture = "/".join(config.architectures or []) or "model of unknown architecture"
    classifier = architecture.endswith("ForSequenceClassification")
    if not classifier or config.num_labels != 1:
        what = f"classifier with {config.num_labels} outputs" if classifier else architecture
        raise UserError(f"{flag} {path} is a {what}, not a reward model; give a model saved by rm.py (a sequence "
                        f"classifier with one output).")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False) \
        else torch.float32
    model_class = vlm.sequence_classification_class(config) if vision_language else AutoModelForSequenceClassification
    model = model_class.from_pretrained(path, dtype=dtype).to(device).eval()
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's (load_processor set its pad token)
    if text_tokenizer.pad_token is None:  # many tokenizers ship without one; padding is always masked out
        text_tokenizer.pad_token = text_tokenizer.eos_token
    if model.config.pad_token_id is None:  # transformers refuses a batch without one; sequence_rewards reads none
        model.config.pad_token_id = text_tokenizer.pad_token_id
    return model, tokenizer


def check_same_tokenizer(policy_tokenizer, reward_tokenizer, policy_name: str, reward_name: str,
                         apply_chat_template: bool = False) -> None:
    """A UserError unless the reward model's tokenizer is the policy's (same vocabulary, same EOS), and, with
    --apply_chat_template, has a chat template of its own: each reward model reads chats rendered with its own."""
    if (policy_tokenizer.get_vocab() != reward_tokenizer.get_vocab()
            or policy_tokenizer.eos_token != reward_tokenizer.eos_token):
        raise UserError(f"{reward_name} has a different tokenizer from the policy {policy_name}; use a reward model "
                        f"trained (rm.py) from the policy's base model, so both read the same tokens.")
    if apply_chat_template and not reward_tokenizer.chat_template:
        raise UserError(f"{reward_name} has no chat template, so rm.py did not train it on chats, and with "
                        f"--apply_chat_template it would score text in a format it never saw; give a reward model "
                        f"trained with --apply_chat_template, or leave that flag out.")


def reward_model_normalizes(model) -> bool:
    """True when the model's config holds the reward mean and std rm.py stores, which scores are normalised with."""
    config = model.config
    return getattr(config, "reward_mean", None) is not None and bool(getattr(config, "reward_std", None))


@torch.no_grad()
def reward_model_scores(model, tokenizer, prompts: list, responses: list[str], apply_chat_template: bool = False,
                        input_template: str | None = None, batch_size: int = 16, max_len: int = 4096,
                        images: list[list] | None = None) -> list[float]:
    """The reward model's score of each (prompt, response), normalised when its config has reward_mean/std.

    Each pair is rendered and tokenized as rm.py trained on it: prompt + response ended by EOS, with the same chat
    template or input template, read at that EOS. Batches are grouped by length, so padding costs little. With a
    vision-language reward model's processor as `tokenizer`, each row reads its prompt's `images` (read already, one
    list per prompt), as rm.py's pairs do (common/vlm.py reward_model_batch).
    """
    if getattr(tokenizer, "image_processor", None) is not None:
        images = images or [[] for _ in prompts]
        order = list(range(len(prompts)))  # a row's length is known only once the processor expands its images
        rows = lambda chunk: vlm.reward_model_batch(tokenizer, [prompts[i] for i in chunk],
                                                    [responses[i] for i in chunk], [images[i] for i in chunk],
                                                    model.name_or_path)
    else:
        ids = [data.reward_model_input_ids(tokenizer, p, r, max_len, apply_chat_template, input_template)
               for p, r in zip(prompts, responses)]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        rows = lambda chunk: data.pad_collate([{"input_ids": ids[i]} for i in chunk], tokenizer.pad_token_id,
                                              keys=("input_ids",))
    device = next(model.parameters()).device
    normalize = reward_model_normalizes(model)
    scores = [0.0] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        batch = {key: value.to(device) for key, value in rows(chunk).items()}
        rewards = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], normalize,
                                   **vlm.forward_images(model, batch))  # (batch,)
        for i, reward in zip(chunk, rewards.tolist()):
            scores[i] = reward
    return scores


# ----------------------------------------------------------------------------------------- remote reward model
def remote_reward(url: str, prompts: list, responses: list[str], labels: list, timeout: float = 60.0,
                  retries: int = 3, backoff: float = 1.0) -> list[float]:
    """POST {"prompts", "responses", "labels"} as JSON to `url`; the answer must be {"rewards": [one per response]}.

    Connection failures, timeouts and 5xx answers are retried `retries` times in all, waiting backoff x 1, 2, 4 s.
    """
    body = json.dumps({"prompts": prompts, "responses": responses, "labels": labels}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    problem = "no attempt made"
    for attempt in range(retries):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                text = answer.read().decode("utf-8", errors="replace")
            break
        except urllib.error.HTTPError as e:
            problem = f"HTTP {e.code}: {e.read().decode('utf-8', errors='replace')[:200]}"
            if e.code < 500:  # the server understood and refused: asking again will not help
                raise UserError(f"remote reward model {url} refused the request ({problem}).") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            problem = str(getattr(e, "reason", e))
    else:
        raise UserError(f"remote reward model {url} did not answer after {retries} tries of up to {timeout:g} s each "
                        f"({problem}); check that it is running and the URL is right.")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        raise UserError(f"remote reward model {url} answered {_short(text)}, which is not JSON; it must answer "
                        f'{{"rewards": [...]}}.') from None
    if not isinstance(payload, dict) or "rewards" not in payload:
        raise UserError(f'remote reward model {url} answered {_short(payload)}; it must answer {{"rewards": [...]}}.')
    return check_rewards(payload["rewards"], len(responses), f"remote reward model {url}")


# ------------------------------------------------------------------------------------------------------ combining
def reward_weights(weights: list[float] | None, reward_pretrain: list[str] | None, reward_fn: str | None,
                   remote_rm_url: str | None) -> list[float]:
    """One weight per reward source, in the order --reward_weights lists them: each --reward_pretrain, then
    --reward_fn, then --remote_rm_url. The flag's weights, or 1.0 each; a run without any source, or with a weight
    count that does not match, is refused here, before anything loads."""
    num_sources = len(reward_pretrain or []) + bool(reward_fn) + bool(remote_rm_url)
    if num_sources == 0:
        raise UserError("no reward source: give --reward_pretrain, --reward_fn or --remote_rm_url (or several).")
    if weights and len(weights) != num_sources:
        raise UserError(f"--reward_weights has {len(weights)} weights for {num_sources} reward sources; give one "
                        f"per source, in the order --reward_pretrain..., --reward_fn, --remote_rm_url.")
    return list(weights) if weights else [1.0] * num_sources


def combine_rewards(scores: list, weights: list[float], dtype: torch.dtype = torch.float) -> torch.Tensor:
    """The weighted sum over sources for each response, sum_k weights[k] * scores[k][i], in `dtype`; `scores` holds
    one sequence (list or tensor) of rewards per source. Rejection sampling asks for float64: in float32 a rule's 0.7
    became 0.69999999 and fell below --min_reward 0.7."""
    if len(scores) != len(weights) or not scores:
        raise ValueError(f"need one weight per reward source, got {len(weights)} weights for {len(scores)} sources")
    total = torch.zeros(len(scores[0]), dtype=dtype)
    for weight, source in zip(weights, scores):
        total += weight * torch.as_tensor(source, dtype=dtype)
    return total


def score_responses(model_scores: list, reward_fn, remote_rm_url: str | None, weights: list[float], prompts: list,
                    responses: list[str], labels: list, dtype: torch.dtype = torch.float) -> tuple[torch.Tensor, dict]:
    """The weighted sum (combine_rewards) of every reward source's score of each response, and each source's scores
    by name (rm0, rm1, ..., rule, remote). `model_scores`: the reward models' scores, computed by the caller."""
    sources = {f"rm{i}": scores for i, scores in enumerate(model_scores)}
    with phase("reward"):
        if reward_fn:
            sources["rule"] = call_reward_fn(reward_fn, prompts, responses, labels)
        if remote_rm_url:
            sources["remote"] = remote_reward(remote_rm_url, prompts, responses, labels)
    return combine_rewards(list(sources.values()), weights, dtype), sources


def reward_model_batch(tokenizer, prompts: list, responses: list[str], apply_chat_template: bool,
                       input_template: str | None, images: list[list] | None = None, path: str = "") -> dict:
    """What a reward model scores, right-padded: each prompt + response rendered and tokenized as rm.py renders its
    pairs (data.reward_model_input_ids), not the policy's own tokens, which can differ at the seam (an input
    template's trailing space) and at the end (a chat template's newline after its end-of-turn token). Given a
    vision-language reward model's processor (`path`), each row holds its prompt's `images` too (common/vlm.py)."""
    if getattr(tokenizer, "image_processor", None) is not None:
        return vlm.reward_model_batch(tokenizer, prompts, responses, images or [[] for _ in prompts], path)
    rows = [{"input_ids": data.reward_model_input_ids(tokenizer, prompt, response, sys.maxsize, apply_chat_template,
                                                      input_template)} for prompt, response in zip(prompts, responses)]
    return data.pad_collate(rows, tokenizer.pad_token_id, keys=("input_ids",))
