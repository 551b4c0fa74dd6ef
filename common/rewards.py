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

import asyncio
import importlib.util
import inspect
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
from common.deadlines import within_deadline
from common.logging_utils import phase
from common.modeling import sequence_rewards


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_rewards(rewards, num_responses: int, source: str) -> list[float]:
    """`rewards` as a list of finite floats, one per response, or a UserError that says what `source` got wrong.

    Any sequence of numbers will do (a generator, bools, ints), and a tensor or array of one number per response:
    shape (n,), or (n, 1) as a scoring head gives it."""
    if isinstance(rewards, (str, bytes, Mapping, set)):  # iterable, but over keys or characters: never the rewards
        raise UserError(f"{source} returned a {type(rewards).__name__}, {_short(rewards)}; it must return a list of "
                        f"numbers, one per response, in the order of the responses.")
    shape = getattr(rewards, "shape", None)  # a torch tensor or numpy array
    if shape is not None:
        if len(shape) == 0 or sum(size != 1 for size in shape) > 1:  # one number for all, or several per response
            raise UserError(f"{source} returned an array of shape {tuple(shape)}; it must return one number per "
                            f"response: a list, or an array of shape ({num_responses},).")
        rewards = (rewards.reshape(-1) if len(shape) > 1 else rewards).tolist()
    try:  # one number for the whole batch (a function written for one sample), or None, is no sequence
        rewards = list(rewards)
        absent = [i for i, r in enumerate(rewards) if r is None]
        if absent:
            raise UserError(f"{source} returned None for response {absent[0]} of the batch; every response "
                            f"needs a number (TRL adds a None to the summed reward as 0): return 0.0 where the "
                            f"function does not apply.")
        rewards = [float(r) for r in rewards]
    except UserError:
        raise
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
CONTRACT = ("prompts", "responses", "labels")  # what a reward function is called with, in this order
OPENRLHF_KEYS = {"rewards", "scores", "extra_logs"}  # the dict an OpenRLHF reward_func may return
# Parameter names, singular, that say which of the contract's arguments a parameter expects (TRL's completion too)
CONTRACT_WORDS = {"prompt": "prompts", "response": "responses", "completion": "responses", "label": "labels"}


def load_from_file(spec: str, flag: str):
    """The callable named by `path/to/file.py:name` (a function, a class, an object), loaded from the file by its
    path: --reward_fn, --env_fn and --agent_fn name the user's code this way."""
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
    return fn


def load_reward_fn(spec: str, timeout: float | None = None, label_key: str = "label"):
    """--reward_fn's function, as a function of (prompts, responses, labels) whatever way it was written: a class
    named there is made once, without arguments; an `async def` is run to its answer; a function written for TRL or
    in another order is called by its parameters' names (reward_fn_caller). With `timeout`, each call that takes
    longer stops the run (--reward_timeout, common/deadlines.py)."""
    fn, name = load_from_file(spec, "--reward_fn"), spec.rpartition(":")[2]
    if inspect.isclass(fn):
        try:
            fn = fn()
        except TypeError as e:
            raise UserError(f"--reward_fn {spec}: the class {name} cannot be made without arguments ({e}); give its "
                            f"parameters defaults, or name an object the file makes, or a function.") from None
    call = reward_fn_caller(fn, f"reward function {name}", label_key)

    def reward_fn(prompts: list, responses: list[str], labels: list):
        result = call(prompts, responses, labels)
        return asyncio.run(result) if inspect.iscoroutine(result) else result  # in the deadline's thread: bounded

    reward_fn.__name__ = name
    if timeout is not None:
        return within_deadline(reward_fn, timeout, f"reward function {name}", "--reward_timeout")
    return reward_fn


def reward_fn_caller(fn, what: str, label_key: str):
    """fn as a function of (prompts, responses, labels), decided once from its parameters' names, so that no layout
    is read in the wrong order: (prompts, responses, labels), (prompt, response, label), unnamed ones (a, b, c) or
    (prompts, *rest) positionally; the three names in another order, or some of them, by name; TRL's (prompts,
    completions, **columns) by name, with chat completions as messages and --label_key's column under its name.
    OpenRLHF's (queries, prompts, labels), where a query is the rendered prompt and response in one text, singular
    names in another order, and anything else, is refused in one sentence."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a readable signature: the contract's order is all there is
        return fn
    kinds = {p.kind for p in parameters.values()}
    positional = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = required_names(parameters)
    written = f"{what} takes {inspect.signature(fn)}"
    if "queries" in parameters:
        raise UserError(f"{written}, as OpenRLHF's reward_func does, where each query is the prompt and response "
                        f"rendered as one text; here it is called as f(prompts, responses, labels) with each "
                        f"response alone: rename its parameters so, and read the response from responses instead of "
                        f"cutting it out of a query.")
    if "completions" in parameters:
        return trl_caller(fn, what, parameters, label_key)
    # (prompts, *args) reads the rest from *args, in the contract's order; (prompts, *args, labels) takes labels by
    # name, and (prompts, *args, **kwargs) the rest by name, as it was
    in_order = positional[:3] == list(CONTRACT[: len(positional[:3])]) and set(CONTRACT) & set(parameters) <= set(
        positional) and (len(positional) >= 3 or (inspect.Parameter.VAR_POSITIONAL in kinds and
                                                  inspect.Parameter.VAR_KEYWORD not in kinds))
    if in_order or not set(CONTRACT) & set(parameters):
        if (len(positional) < 3 and inspect.Parameter.VAR_POSITIONAL not in kinds) or set(required) - set(
                positional[:3]):
            raise UserError(f"{written}; it is called as f(prompts, responses, labels): give it those three "
                            f"parameters (others with defaults).")
        for name, passed in zip(positional, CONTRACT):  # (response, prompt, label) would get the prompts as responses
            meant = CONTRACT_WORDS.get(name.lower().removesuffix("s"))
            if meant not in (None, passed):
                raise UserError(f"{written}, where {name} is passed the {passed}: it is called as f(prompts, "
                                f"responses, labels), in that order; name its parameters so, or put them in that "
                                f"order.")
        return fn
    unknown = [n for n in required if n not in CONTRACT]
    if unknown:
        raise UserError(f"{written}, where {', '.join(unknown)} is none of prompts, responses, labels; name its "
                        f"parameters (prompts, responses, labels), in that order.")
    names = [n for n in CONTRACT if n in parameters or inspect.Parameter.VAR_KEYWORD in kinds]
    return lambda prompts, responses, labels: fn(**{n: v for n, v in zip(CONTRACT, (prompts, responses, labels))
                                                    if n in names})


def required_names(parameters) -> list[str]:
    """The names of a signature's parameters that a call must fill: no default, not *args or **kwargs."""
    return [n for n, p in parameters.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                                          p.VAR_KEYWORD)]


def trl_caller(fn, what: str, parameters, label_key: str):
    """A function written for TRL's GRPOTrainer, fn(prompts=, completions=, **columns), called as TRL calls it but
    for the columns: only --label_key's reaches a reward function here. Completions are text after a text prompt,
    [{"role": "assistant", "content": text}] after a chat prompt, as TRL gives them."""
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    missing = [n for n in required_names(parameters) if n not in ("prompts", "completions", label_key)]
    needs_column = (f"; here a function written for TRL gets prompts, completions and one dataset column, "
                    f"--label_key's (now {label_key!r}), under that column's name: set --label_key to the column it "
                    f"reads (a column of dicts carries several fields)")
    if missing:  # a dataset column, or TRL's own completion_ids or trainer_state, which nothing here has
        raise UserError(f"{what} takes {inspect.signature(fn)}, and TRL passes {', '.join(missing)} by name, from "
                        f"its dataset's columns or its own state{needs_column}, or give {missing[0]} a default.")

    def call(prompts: list, responses: list[str], labels: list):
        completions = [[{"role": "assistant", "content": r}] if isinstance(p, list) else r
                       for p, r in zip(prompts, responses)]
        given = {"prompts": prompts, "completions": completions, label_key: labels}
        try:
            return fn(**{k: v for k, v in given.items() if k in parameters or any_keyword})
        except KeyError as e:  # TRL's columns arrive in **kwargs: a read of one absent here names the column
            column = e.args[0] if len(e.args) == 1 else None
            if not any_keyword or not isinstance(column, str) or column in given:
                raise
            raise UserError(f"{what} raised KeyError {column!r}: if that is a dataset column it reads from its "
                            f"keyword arguments, as TRL passes them{needs_column}.") from e

    return call


def reward_fn_result(result, num_responses: int, what: str) -> tuple[list[float], dict]:
    """A reward function's answer as its rewards (check_rewards) and the means of what it asks to log: a list or
    array of rewards logs nothing; OpenRLHF's dict {"rewards", "scores", "extra_logs": {name: values}} logs its
    scores (OpenRLHF filters on them; here --dynamic_sampling reads the rewards) and each extra_logs entry."""
    if not isinstance(result, Mapping):
        return check_rewards(result, num_responses, what), {}
    if "rewards" not in result or set(result) - OPENRLHF_KEYS or not isinstance(result.get("extra_logs", {}),
                                                                                 Mapping):
        raise UserError(f"{what} returned a dict, {_short(result)}; it must return a list of numbers, one per "
                        f"response, or a dict {{'rewards': ..., 'scores': ..., 'extra_logs': {{name: values}}}} as "
                        f"OpenRLHF's reward_func may.")
    logs = {"scores": result["scores"]} if "scores" in result else {}
    means = {}
    for key, values in {**logs, **(result.get("extra_logs") or {})}.items():
        try:
            means[str(key)] = torch.as_tensor(values, dtype=torch.float).mean().item()
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"{what} returned {key!r} = {_short(values)} to log; it must be a number, or one number "
                            f"per response.") from None
    return check_rewards(result["rewards"], num_responses, what), means


def call_reward_fn(fn, prompts: list, responses: list[str], labels: list, logs: dict | None = None) -> list[float]:
    """fn(prompts, responses, labels) checked: one finite float per response, or a UserError naming what failed;
    the means it asks to log (reward_fn_result) go into `logs` when given.

    When the function raises, it is called again one sample at a time to find the sample that makes it fail.
    """
    name = f"reward function {getattr(fn, '__name__', repr(fn))}"
    try:
        rewards = fn(prompts, responses, labels)
    except UserError:  # a deadline passed (calling again, one sample at a time, would hang as long), or a sentence
        raise
    except Exception as batch_error:
        failing, error = None, batch_error
        for i in range(len(responses)):
            try:
                fn(prompts[i: i + 1], responses[i: i + 1], labels[i: i + 1])
            except UserError:
                raise
            except Exception as e:
                failing, error = i, e
                break
        where = (f"on sample {failing} of the batch (prompt {_short(prompts[failing])}, response "
                 f"{_short(responses[failing])}, label {_short(labels[failing])})" if failing is not None
                 else f"on a batch of {len(responses)} samples, though on none of them alone")
        raise UserError(f"{name} raised {type(error).__name__}: {error} {where}; fix the function or that sample."
                        ) from error
    rewards, means = reward_fn_result(rewards, len(responses), name)
    if logs is not None:
        logs.update(means)
    return rewards


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
    --reward_fn, then --remote_rm_url. The flag's weights, or 1.0 each; a run without any source, with a weight
    count that does not match, or with a --remote_rm_url that is no http(s) URL, is refused here, before anything
    loads."""
    num_sources = len(reward_pretrain or []) + bool(reward_fn) + bool(remote_rm_url)
    if num_sources == 0:
        raise UserError("no reward source: give --reward_pretrain, --reward_fn or --remote_rm_url (or several).")
    if remote_rm_url and not remote_rm_url.startswith(("http://", "https://")):
        # OpenRLHF takes a file of Python there: it would fail at the first rollout's scoring, minutes in
        local = (f"; a Python file goes to --reward_fn {remote_rm_url}:reward_func, its parameters named (prompts, "
                 f"responses, labels) (docs/custom_reward.md)" if remote_rm_url.endswith(".py") else "")
        raise UserError(f"--remote_rm_url {remote_rm_url} is not an http:// or https:// URL{local}.")
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
    by name (rm0, rm1, ..., rule, remote), beside the means the reward function asks to log, as rule/<name>
    (OpenRLHF's extra_logs). `model_scores`: the reward models' scores, computed by the caller."""
    sources, logs = {f"rm{i}": scores for i, scores in enumerate(model_scores)}, {}
    with phase("reward"):
        if reward_fn:
            sources["rule"] = call_reward_fn(reward_fn, prompts, responses, labels, logs)
        if remote_rm_url:
            sources["remote"] = remote_reward(remote_rm_url, prompts, responses, labels)
    total = combine_rewards(list(sources.values()), weights, dtype)
    return total, {**sources, **{f"rule/{name}": mean for name, mean in logs.items()}}


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
