"""common/rewards.py: rule-based functions loaded from a file, reward-model scoring, the remote reward model over HTTP
(against a server on 127.0.0.1), and the errors a user can cause with each."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from common import data, rewards
from common.args import UserError
from common.deadlines import DeadlinePassed
from common.tiny_model import build_tokenizer
from conftest import ROOT, metrics, run_script

PROMPTS = ["What is 2+3?", "Add 10 and 4.", "Compute 7 plus 8.", "What is 40+2?", "Add 1 and 1."]
RESPONSES = ["5", "14 is the sum", "16", "42", ""]
LABELS = ["5", "14", "15", "42", "2"]


def write_reward_model(policy_dir: str, out: str, reward_mean=None, reward_std=None, tokenizer=None) -> str:
    """A reward model as rm.py saves it, with an untrained score head: the policy's backbone, one output."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
    if reward_mean is not None:
        model.config.reward_mean, model.config.reward_std = reward_mean, reward_std
    model.save_pretrained(out)
    (tokenizer or AutoTokenizer.from_pretrained(policy_dir)).save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------- rule-based functions
def test_reward_fn_from_a_file_scores_the_synthetic_task():
    fn = rewards.load_reward_fn(f"{ROOT}/common/synthetic_task.py:reward_fn")
    assert rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_reward_fn_mistakes_are_named(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def inverse_length(prompts, responses, labels):\n    return [1.0 / len(r) for r in responses]\n"
        "def one_short(prompts, responses, labels):\n    return [0.0] * (len(responses) - 1)\n"
        "def words(prompts, responses, labels):\n    return ['good' for r in responses]\n"
        "def nan(prompts, responses, labels):\n    return [float('nan') for r in responses]\n"
        "def by_index(prompts, responses, labels):\n    return {i: 0.5 for i in range(len(responses))}\n"
        "def text(prompts, responses, labels):\n    return '10110'\n")
    with pytest.raises(UserError, match="must be written path/to/file.py:function_name"):
        rewards.load_reward_fn(str(path))
    with pytest.raises(UserError, match="nowhere.py does not exist"):
        rewards.load_reward_fn(f"{tmp_path}/nowhere.py:inverse_length")
    with pytest.raises(UserError, match=r"has no function 'reward'; it defines \['by_index', 'inverse_length', 'nan', "
                                        r"'one_short', 'text', 'words'\]"):
        rewards.load_reward_fn(f"{path}:reward")
    cases = {
        "inverse_length": r"reward function inverse_length raised ZeroDivisionError: float division by zero on "
                          r"sample 4 of the batch \(prompt 'Add 1 and 1.', response '', label '2'\)",
        "one_short": "reward function one_short returned 4 rewards for 5 responses",
        "words": r"reward function words returned \['good', .*; it must return a list of numbers",
        "nan": "reward function nan returned nan for response 0 of the batch; rewards must be finite",
        # a dict or a string is iterable too, over its keys or characters: read as rewards, 5 plausible numbers
        "by_index": r"reward function by_index returned a dict, \{0: 0.5, .*; it must return a list of numbers",
        "text": "reward function text returned a str, '10110'; it must return a list of numbers",
    }
    for name, message in cases.items():
        fn = rewards.load_reward_fn(f"{path}:{name}")
        with pytest.raises(UserError, match=message):
            rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS)


# Reward functions as people write them for OpenRLHF and TRL, and other layouts nobody documented: each taken for
# what it plainly means, or refused at load or at its first answer when it would be read wrong.
LAYOUTS = """
import asyncio

import numpy as np
import torch


def right(response, label):
    return response.split()[:1] == [label]


def as_tensor(prompts, responses, labels):
    return torch.tensor([float(right(r, y)) for r, y in zip(responses, labels)])


def as_column(prompts, responses, labels):  # (n, 1), as a scoring head's logits come
    return as_tensor(prompts, responses, labels)[:, None]


def as_numpy(prompts, responses, labels):
    return np.array([right(r, y) for r, y in zip(responses, labels)], dtype=np.float32)


def as_bools(prompts, responses, labels):
    return [right(r, y) for r, y in zip(responses, labels)]


def as_generator(prompts, responses, labels):
    return (int(right(r, y)) for r, y in zip(responses, labels))


def openrlhf_dict(prompts, responses, labels):
    rewards = as_tensor(prompts, responses, labels)
    return {"rewards": rewards, "scores": rewards / 2, "extra_logs": {"length": torch.tensor([len(r) for r in
                                                                                          responses]), "one": 1}}


async def coroutine(prompts, responses, labels):
    await asyncio.sleep(0)
    return as_bools(prompts, responses, labels)


class Judge:
    def __init__(self, strict=True):
        self.strict = strict

    def __call__(self, prompts, responses, labels):
        return as_bools(prompts, responses, labels)


judge = Judge()


def reordered(labels, responses, prompts):
    return as_bools(prompts, responses, labels)


def by_name(responses, labels):
    return as_bools(None, responses, labels)


def rest_in_order(prompts, *rest):  # the responses and labels come in *rest, in the contract's order
    responses, labels = rest
    return as_bools(prompts, responses, labels)


def labels_after_rest(prompts, responses, *rest, labels):  # labels can come by name only
    return as_bools(prompts, responses, labels)


def rest_by_name(prompts, *rest, **named):  # as before *args were read in order: the rest by name
    return as_bools(prompts, named["responses"], named["labels"])


def trl_text(completions, solution, **kwargs):
    return [float(right(c, s)) for c, s in zip(completions, solution)]


def trl_chat(prompts, completions, **kwargs):
    assert all(p[-1]["role"] == "user" and c[0]["role"] == "assistant" for p, c in zip(prompts, completions))
    return [float(right(c[0]["content"], y)) for c, y in zip(completions, kwargs["label"])]


def openrlhf_signature(queries, prompts, labels):
    return torch.tensor([float(y in q) for q, y in zip(queries, labels)])


def trl_other_column(completions, solution, **kwargs):
    return [1.0] * len(completions)


def trl_reads_other_column(completions, **kwargs):
    return [float(right(c, s)) for c, s in zip(completions, kwargs["solution"])]


def two_unnamed(batch, answers):
    return [1.0] * len(batch)


def mixed_names(responses, gold, prompts):
    return [1.0] * len(responses)


def singular_reordered(response, prompt, label):  # called in order, it got the prompts as responses
    return [float(right(r, y)) for r, y in zip(response, label)]


def one_sample(prompts, responses, labels):  # written for one sample at a time
    return 1.0


class NeedsAServer:
    def __init__(self, url):
        self.url = url


def pairs(prompts, responses, labels):
    return np.ones((len(responses), 2))


def one_number(prompts, responses, labels):
    return torch.tensor(0.6)


def not_applicable(prompts, responses, labels):  # TRL's multi-reward convention
    return [float(right(r, y)) if y != "15" else None for r, y in zip(responses, labels)]


def misspelled_dict(prompts, responses, labels):
    return {"rewards": as_tensor(prompts, responses, labels), "extra_log": {}}


def text_to_log(prompts, responses, labels):
    return {"rewards": as_tensor(prompts, responses, labels), "extra_logs": {"verdict": ["yes"] * len(responses)}}


async def slow(prompts, responses, labels):
    await asyncio.sleep(3)
    return as_bools(prompts, responses, labels)
"""


def test_reward_functions_written_for_openrlhf_trl_or_otherwise_score_what_they_mean(tmp_path):
    """Every layout that means one number per response scores the same five samples the same; OpenRLHF's dict logs
    its scores and extra_logs through score_responses, as ppo_ray.py logs each source (rewards/rule/...)."""
    (tmp_path / "layouts.py").write_text(LAYOUTS)
    right = [1.0, 1.0, 0.0, 1.0, 0.0]
    for name in ("as_tensor", "as_column", "as_numpy", "as_bools", "as_generator", "openrlhf_dict", "coroutine",
                 "Judge", "judge", "reordered", "by_name", "rest_in_order", "labels_after_rest",
                 "rest_by_name"):
        fn = rewards.load_reward_fn(f"{tmp_path}/layouts.py:{name}", timeout=5.0)
        assert rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS) == right, name
    trl = rewards.load_reward_fn(f"{tmp_path}/layouts.py:trl_text", label_key="solution")
    assert rewards.call_reward_fn(trl, PROMPTS, RESPONSES, LABELS) == right
    chats = [[{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": p}] for p in PROMPTS]
    trl = rewards.load_reward_fn(f"{tmp_path}/layouts.py:trl_chat")
    assert rewards.call_reward_fn(trl, chats, RESPONSES, LABELS) == right
    fn = rewards.load_reward_fn(f"{tmp_path}/layouts.py:openrlhf_dict")
    total, sources = rewards.score_responses([[0.5] * 5], fn, None, [1.0, 2.0], PROMPTS, RESPONSES, LABELS)
    assert total.tolist() == [2.5, 2.5, 0.5, 2.5, 0.5]
    lengths = sum(map(len, RESPONSES)) / 5
    assert sources == {"rm0": [0.5] * 5, "rule": right, "rule/scores": pytest.approx(0.3), "rule/length":
                       pytest.approx(lengths), "rule/one": 1.0}


def test_reward_function_layouts_that_would_be_read_wrong_are_refused_in_one_sentence(tmp_path):
    """OpenRLHF's (queries, prompts, labels) would get the prompts as queries and the responses as prompts, and
    still return plausible numbers; TRL's columns other than --label_key's do not reach a reward function here."""
    (tmp_path / "layouts.py").write_text(LAYOUTS)
    at_load = {
        "openrlhf_signature": r"takes \(queries, prompts, labels\), as OpenRLHF's reward_func does, .*: rename its "
                              r"parameters so",
        "trl_other_column": r"takes \(completions, solution, \*\*kwargs\), and TRL passes solution by name, from its "
                            r"dataset's columns or its own state; .* --label_key's \(now 'label'\), .*: set "
                            r"--label_key to the column it reads .*, or give solution a default.$",
        "two_unnamed": r"takes \(batch, answers\); it is called as f\(prompts, responses, labels\): give it those",
        "mixed_names": r"takes \(responses, gold, prompts\), where gold is none of prompts, responses, labels; name",
        "singular_reordered": r"takes \(response, prompt, label\), where response is passed the prompts: it is "
                              r"called as f\(prompts, responses, labels\), in that order; name its parameters so",
        "NeedsAServer": r"the class NeedsAServer cannot be made without arguments \(.*url.*\); give its parameters "
                        r"defaults",
    }
    for name, message in at_load.items():
        with pytest.raises(UserError, match=message):
            rewards.load_reward_fn(f"{tmp_path}/layouts.py:{name}")
    at_call = {
        "trl_reads_other_column": r"raised KeyError 'solution': if that is a dataset column it reads from its "
                                  r"keyword arguments, as TRL passes them; .*: set --label_key to the column",
        "pairs": r"returned an array of shape \(5, 2\); it must return one number per response: a list, or an array "
                 r"of shape \(5,\)",
        "one_number": r"returned an array of shape \(\); it must return one number per response",
        "one_sample": r"returned 1.0; it must return a list of numbers, one per response",
        "not_applicable": r"returned None for response 2 of the batch; .*: return 0.0 where the function does not "
                          r"apply",
        "misspelled_dict": r"returned a dict, .*'extra_log'.*; it must return a list of numbers, one per response, "
                           r"or a dict \{'rewards'",
        "text_to_log": r"returned 'verdict' = \['yes', .* to log; it must be a number, or one number per response",
    }
    for name, message in at_call.items():
        fn = rewards.load_reward_fn(f"{tmp_path}/layouts.py:{name}", timeout=5.0)
        with pytest.raises(UserError, match=f"^reward function {name} {message}"):
            rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS)


def test_an_async_reward_function_is_held_to_its_deadline_while_it_runs(tmp_path):
    """The coroutine runs inside the deadline's thread: bounded while it awaits, not only while it is made."""
    (tmp_path / "layouts.py").write_text(LAYOUTS)
    fn = rewards.load_reward_fn(f"{tmp_path}/layouts.py:slow", timeout=0.5)
    start = time.time()
    with pytest.raises(DeadlinePassed, match="^reward function slow did not return within 0.5 s"):
        rewards.call_reward_fn(fn, PROMPTS, RESPONSES, LABELS)
    assert time.time() - start < 1.5


# -------------------------------------------------------------------------------------------------- reward models
def test_reward_model_scores_what_rm_py_trains_on_batched_and_normalised(tiny_model, tmp_path):
    path = write_reward_model(tiny_model, str(tmp_path / "rm"), reward_mean=0.5, reward_std=2.0)
    model, tokenizer = rewards.load_reward_model(path)
    assert rewards.reward_model_normalizes(model)
    for chat in (True, False):
        scores = rewards.reward_model_scores(model, tokenizer, PROMPTS, RESPONSES, apply_chat_template=chat,
                                             batch_size=2)  # padded batches of mixed lengths
        rows = [{"prompt": p, "chosen": r, "rejected": r + " x"} for p, r in zip(PROMPTS, RESPONSES)]
        pairs = data.build_preference_samples(rows, tokenizer, "pairs", "prompt", "chosen", "rejected", 64, chat,
                                              end_with_eos=True, log=lambda msg: None)
        for pair, prompt, response, score in zip(pairs, PROMPTS, RESPONSES, scores):
            ids = data.reward_model_input_ids(tokenizer, prompt, response, 64, chat)
            assert ids == pair["chosen"]["input_ids"] and ids[-1] == tokenizer.eos_token_id  # rm.py's tokens
            with torch.no_grad():
                raw = model(input_ids=torch.tensor([ids])).logits[0, 0].item()  # alone, no padding
            assert score == pytest.approx((raw - 0.5) / 2.0, abs=1e-5)
    assert len(set(scores)) == len(scores)  # the head is random, not constant


def test_a_reward_model_that_pads_with_its_eos_is_read_at_that_eos(tiny_model, tmp_path):
    """Many Llama-family tokenizers have no pad token, so a reward model trained elsewhere pads with its EOS:
    transformers' pooling, which reads the rightmost token that is not padding, read the token before it."""
    out = str(tmp_path / "rm")
    write_reward_model(tiny_model, out)
    config = json.load(open(f"{out}/config.json"))
    json.dump({**config, "pad_token_id": None}, open(f"{out}/config.json", "w"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(out)
    model, tokenizer = rewards.load_reward_model(out)
    assert model.config.pad_token_id == tokenizer.eos_token_id
    scores = rewards.reward_model_scores(model, tokenizer, PROMPTS, RESPONSES, batch_size=2)
    for prompt, response, score in zip(PROMPTS, RESPONSES, scores):
        ids = torch.tensor([data.reward_model_input_ids(tokenizer, prompt, response, 64)])
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state  # (1, seq, hidden)
            at_eos, before = model.score(hidden[0, -2:]).squeeze(-1).tolist()[::-1]
        assert ids[0, -1] == tokenizer.eos_token_id and abs(at_eos - before) > 1e-4
        assert score == pytest.approx(at_eos, abs=1e-5)


def test_reward_model_loading_and_tokenizer_mistakes(tiny_model, tmp_path):
    with pytest.raises(UserError, match="is a LlamaForCausalLM, not a reward model"):
        rewards.load_reward_model(tiny_model)
    with pytest.raises(UserError, match="does not exist"):
        rewards.load_reward_model(str(tmp_path / "no_rm"))
    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rewards.check_same_tokenizer(policy_tokenizer, AutoTokenizer.from_pretrained(tiny_model), "a", "b")
    other = build_tokenizer(vocab_size=300)
    with pytest.raises(UserError, match="--reward_pretrain rm has a different tokenizer from the policy --pretrain p"):
        rewards.check_same_tokenizer(policy_tokenizer, other, "--pretrain p", "--reward_pretrain rm")
    no_template = AutoTokenizer.from_pretrained(tiny_model)
    no_template.chat_template = None  # rm.py trained it without --apply_chat_template
    rewards.check_same_tokenizer(policy_tokenizer, no_template, "--pretrain p", "--reward_pretrain rm")
    with pytest.raises(UserError, match="--reward_pretrain rm has no chat template, so rm.py did not train it on "
                                        "chats"):
        rewards.check_same_tokenizer(policy_tokenizer, no_template, "--pretrain p", "--reward_pretrain rm", True)


def test_combine_rewards_is_a_weighted_sum():
    assert rewards.combine_rewards([[1.0, 2.0], torch.tensor([10.0, 0.0])], [0.5, 2.0]).tolist() == [20.5, 1.0]
    with pytest.raises(ValueError):
        rewards.combine_rewards([[1.0]], [1.0, 1.0])


def test_reward_weights_one_per_source_in_flag_order():
    assert rewards.reward_weights(None, ["a", "b"], "f.py:g", None) == [1.0, 1.0, 1.0]
    assert rewards.reward_weights([0.5, 2.0], ["a"], None, "http://rm") == [0.5, 2.0]
    with pytest.raises(UserError, match=r"^--reward_weights has 1 weights for 2 reward sources; give one per source"):
        rewards.reward_weights([1.0], ["a"], "f.py:g", None)
    with pytest.raises(UserError, match=r"^no reward source: give --reward_pretrain"):
        rewards.reward_weights(None, [], None, None)
    with pytest.raises(UserError, match=r"^--remote_rm_url reward_func.py is not an http:// or https:// URL; a Python "
                                        r"file goes to --reward_fn reward_func.py:reward_func, its parameters named"):
        rewards.reward_weights(None, [], None, "reward_func.py")  # OpenRLHF's place for a local reward function
    with pytest.raises(UserError, match=r"^--remote_rm_url localhost:5000/reward is not an http:// or https:// URL.$"):
        rewards.reward_weights(None, [], None, "localhost:5000/reward")


# ----------------------------------------------------------------------------------------- remote reward model
@pytest.fixture(scope="module")
def reward_server():
    """An HTTP reward model on 127.0.0.1: /len scores by response length, other paths misbehave on purpose."""
    calls = {"flaky": 0}
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            answer, status = {"rewards": [float(len(r)) for r in body["responses"]]}, 200
            if self.path == "/flaky":
                calls["flaky"] += 1
                status = 503 if calls["flaky"] == 1 else 200
            elif self.path == "/bad_request":
                answer, status = {"error": "missing field"}, 400
            elif self.path == "/by_index":  # what pandas' Series.to_dict() gives
                answer = {"rewards": {str(i): 0.5 for i in range(len(body["responses"]))}}
            elif self.path == "/short":
                answer = {"rewards": [1.0]}
            elif self.path == "/not_json":
                answer = "hello"
            text = answer if isinstance(answer, str) else json.dumps(answer)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests, calls
    server.shutdown()
    server.server_close()


def test_remote_reward_posts_json_and_reads_rewards(reward_server):
    url, requests, _ = reward_server
    labels = [None, "14", None, "42", "2"]
    assert rewards.remote_reward(url + "/len", PROMPTS, RESPONSES, labels) == [1.0, 13.0, 2.0, 2.0, 0.0]
    assert requests[-1] == {"prompts": PROMPTS, "responses": RESPONSES, "labels": labels}
    chat = [[{"role": "user", "content": p}] for p in PROMPTS]  # chat prompts travel as they are
    assert rewards.remote_reward(url + "/len", chat, RESPONSES, labels) == [1.0, 13.0, 2.0, 2.0, 0.0]
    assert requests[-1]["prompts"] == chat


def test_remote_reward_retries_server_errors_and_names_the_rest(reward_server):
    url, _, calls = reward_server
    assert rewards.remote_reward(url + "/flaky", PROMPTS, RESPONSES, LABELS, backoff=0.01) == [1.0, 13.0, 2.0, 2.0, 0.0]
    assert calls["flaky"] == 2
    with pytest.raises(UserError, match=r"refused the request \(HTTP 400: .*missing field"):
        rewards.remote_reward(url + "/bad_request", PROMPTS, RESPONSES, LABELS, backoff=0.01)
    with pytest.raises(UserError, match="returned 1 rewards for 5 responses"):
        rewards.remote_reward(url + "/short", PROMPTS, RESPONSES, LABELS, backoff=0.01)
    with pytest.raises(UserError, match=r"returned a dict, \{'0': 0.5, .*; it must return a list of numbers"):
        rewards.remote_reward(url + "/by_index", PROMPTS, RESPONSES, LABELS, backoff=0.01)
    with pytest.raises(UserError, match="answered 'hello', which is not JSON"):
        rewards.remote_reward(url + "/not_json", PROMPTS, RESPONSES, LABELS, backoff=0.01)
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/reward"
    with pytest.raises(UserError, match="did not answer after 2 tries .*; check that it is running"):
        rewards.remote_reward(closed, PROMPTS, RESPONSES, LABELS, retries=2, backoff=0.01)
    assert math.isfinite(sum(rewards.remote_reward(url + "/len", PROMPTS, RESPONSES, LABELS, timeout=5)))


@pytest.mark.extended
def test_ppo_ray_logs_what_an_openrlhf_style_reward_function_asks_to_log(tiny_model, task, tmp_path):
    """A TRL-style function returning OpenRLHF's dict, one GRPO step: its scores and extra_logs reach metrics.jsonl
    in training and in evaluation, where eval/rule stays the rule's mean (a split on every "/" once wrote
    rule/length's mean over it)."""
    (tmp_path / "mine.py").write_text(
        "import torch\n\nfrom common.synthetic_task import reward_fn\n\n\n"
        "def reward(prompts, completions, **kwargs):\n"
        "    right = torch.tensor(reward_fn(prompts, completions, kwargs['label']))\n"
        "    lengths = torch.tensor([len(c) for c in completions])\n"
        "    return {'rewards': right, 'scores': right / 2, 'extra_logs': {'length': lengths}}\n")
    out = str(tmp_path / "out")
    run_script("ppo_ray.py", ["--pretrain", tiny_model, "--prompt_data", task["prompts_train"], "--eval_prompt_data",
                              task["prompts_eval"], "--apply_chat_template", "--output_dir", out, "--generate_max_len",
                              "8", "--prompt_max_len", "64", "--reward_fn", f"{tmp_path}/mine.py:reward",
                              "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4", "--rollout_batch_size",
                              "8", "--train_batch_size", "32", "--micro_train_batch_size", "16", "--max_steps", "1"])
    step, evaluation = [m for m in metrics(out) if "rewards/rule" in m][0], metrics(out)[-1]
    for logged, prefix in ((step, "rewards/"), (evaluation, "eval/")):
        assert logged[prefix + "rule/scores"] == pytest.approx(logged[prefix + "rule"] / 2)
    with open(f"{out}/eval_samples.jsonl") as f:
        responses = [json.loads(line)["response"] for line in f]
    assert evaluation["eval/rule/length"] == pytest.approx(sum(map(len, responses)) / len(responses))
    assert evaluation["eval/rule"] == pytest.approx(evaluation["eval/reward"])
