"""common/rewards.py: rule-based functions loaded from a file, reward-model scoring, the remote reward model over HTTP
(against a server on 127.0.0.1), and the errors a user can cause with each."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from common import data, rewards
from common.args import UserError
from common.tiny_model import build_tokenizer
from conftest import ROOT

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
