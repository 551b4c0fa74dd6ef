"""Agents as people write them: the policy behind an OpenAI-compatible endpoint, the user's agent unchanged.

ppo_ray.py --agent_fn path.py:run_agent loads `run_agent`, called once per episode in a thread of its own:

    def run_agent(base_url: str, prompt, label) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        ...  # any agent loop: client.chat.completions.create(model="policy", messages=..., tools=...)
        return reward

(an `async def` works too). Each episode gets a base URL of its own, so its requests are told apart from the other
episodes' that run at the same time. The endpoint (/v1/chat/completions, /v1/models; stdlib HTTP on 127.0.0.1) renders
a request's messages and tools with the policy's chat template, and queues the prompt ids for the vLLM engines, which
sample every request waiting at that moment in one batch. Sampling uses the run's --temperature and --top_p whatever
the request asks (the trainer divides by that temperature); a request's max_tokens is kept within the episode's budget.

Token ids end to end, as common/multi_turn.py keeps them: when a request continues the episode's conversation (its
messages are the last request's, the answer given, and new ones), its prompt is the ids the policy was given and
sampled before, followed by the template's rendering of the new messages alone; the sampled turns are never decoded
and encoded again, which can tokenize otherwise than the policy sampled. The episode is then one sequence: the first
prompt, the policy's turns (env_mask 1, with vLLM's log-probs) and the tools' and user's messages between them
(env_mask 0), trained as an --env_fn episode is. A request that does not continue it (the agent edited its history)
starts the sequence anew, and the episode trains on its last sequence.

Tool calls are written and read as the chat template renders them: the template is asked to render a known call, and
the text around it (Qwen's and Hermes' "<tool_call>" ... "</tool_call>", or a bare JSON object as Llama 3.1 writes
it) is looked for in each answer; what parses comes back as the answer's `tool_calls`. Each answer also carries the
ids (`prompt_token_ids`, and its choice's `token_ids`), which is what the episode recorded.

A vision-language policy's agent gets its prompt as the row wrote it (chat messages with image parts) and sends its
image parts on as they are ({"type": "image", "image": ...}, or OpenAI's {"type": "image_url", "image_url": {"url":
...}} with the same value): a request's images are its prompt's, found by that value, and one naming any other image
is refused. The first request's rendering holds one placeholder per image part, which vLLM gets with the images and
expands itself, while the episode records the ids expanded as the processor expands them (common/vlm.py
`image_request`), what the trainer scores; every later request of the episode carries the same images. The
messages after the first request (tools' results, the user's replies) stay text: an image part or an image
placeholder token among them is refused in one sentence.

An agent that raises, does not return within --agent_timeout seconds, or returns anything but a finite number fails
its episode only: it is counted (env/failed_episodes) and the rollout says why once; none of its tokens is trained
on, which also leaves it out of its group's baseline (as --overlong_filter's responses are), and its reward is its
group's mean, so that the logged rewards are the other episodes'. A rollout whose every episode failed
stops the run with the first failure's reason.
"""

import asyncio
import functools
import http.server
import inspect
import json
import math
import queue
import secrets
import threading
import time

from common import rewards
from common.args import UserError
from common.data import SENTINEL, DataError, chat_text, decode_response, end_of_turn_token
from common.multi_turn import continuation_ids, is_added_token
from common.vlm import check_text_tokens, continued, image_request, image_token_id, prompt_images_named

PROBE_NAME, PROBE_ARGUMENTS = "probe_tool", {"probe_argument": "probe value"}  # a call no model writes by itself


@functools.cache
def agent_function(spec: str):
    """--agent_fn's function, loaded once."""
    return rewards.load_from_file(spec, "--agent_fn")


def text_of(content) -> str:
    """A message's content as text: OpenAI clients may send a list of parts ({"type": "text", "text": ...})."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def image_name(part) -> str | None:
    """The image a content part names (a path or base64, as the prompt's row wrote it), None for a part of text."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image":
        return str(part.get("image", part.get("path")))
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return str(url.get("url") if isinstance(url, dict) else url)
    return None


def template_message(message: dict, images: bool = False) -> dict:
    """An OpenAI message as chat templates take it: text content (with `images`, a list of text and {"type": "image"}
    parts where it holds images, as a vision-language model's template renders them), and each tool call's arguments
    as a dict (OpenAI sends a JSON string, which a template's `tojson` would quote once more)."""
    content = message.get("content")
    out = {"role": message.get("role"), "content": text_of(content)}
    if images and isinstance(content, list) and any(image_name(part) for part in content):
        out["content"] = [{"type": "image"} if image_name(part) else {"type": "text", "text": part.get("text", "")}
                          for part in content if isinstance(part, dict)]
    calls = [call.get("function", call) for call in message.get("tool_calls") or []]
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.get("name"), "arguments": arguments(c)}}
                             for c in calls]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def arguments(call: dict) -> dict:
    """A tool call's arguments as a dict, whether sent as a JSON string or already parsed."""
    value = call.get("arguments", call.get("parameters", {}))
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return {"text": value}
    return value


def same_messages(a: list[dict], b: list[dict]) -> bool:
    """Whether two conversations say the same (role, text, tool calls), whatever else a client adds to a message."""
    def key(m):
        images = [image_name(part) for part in m.get("content") or [] if image_name(part)] if isinstance(
            m.get("content"), list) else []
        m = template_message(m)
        return m["role"], m["content"].strip(), json.dumps(m.get("tool_calls", []), sort_keys=True), images

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


@functools.cache
def tool_call_markers(template: str, tokenizer) -> tuple[str, str, str, str] | None:
    """(opening, closing, name key, arguments key) of a tool call as `template` writes it, found by rendering a
    known call after a known content: ("<tool_call>", "</tool_call>", "name", "arguments") for Qwen's and Hermes';
    ("", "", "name", "parameters") for Llama 3.1's bare JSON, which writes no content beside a call. None where the
    template writes no call (the tiny models' templates)."""
    call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": PROBE_ARGUMENTS}}
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL, "tool_calls": [call]}]
    try:
        text = chat_text(tokenizer, messages)
    except DataError:
        return None
    decoder, at = json.JSONDecoder(), text.find(PROBE_NAME)
    for start in (i for i in range(at, -1, -1) if text[i] == "{"):
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        name_key = next((k for k, v in obj.items() if v == PROBE_NAME), None)
        args_key = next((k for k, v in obj.items() if v == PROBE_ARGUMENTS), None)
        if name_key and args_key:
            content_end = text.find(SENTINEL) + len(SENTINEL) if SENTINEL in text[:start] else start
            end_of_turn = end_of_turn_token(tokenizer)
            after = text[end:].split(end_of_turn)[0] if end_of_turn else text[end:]
            opening = text[content_end:start].strip()
            return opening, after.strip() if opening else "", name_key, args_key
    return None


def parse_tool_calls(text: str, markers: tuple[str, str, str, str] | None) -> tuple[str, list[dict]]:
    """The answer's text before its tool calls, and the calls (OpenAI's shape) that the template's markers hold;
    a call whose JSON does not parse stays text."""
    if markers is None:
        return text, []
    opening, closing, name_key, args_key = markers
    pieces = text.split(opening) if opening else ["", text]
    found = []
    for piece in pieces[1:]:
        body = piece.strip()
        body = body[: body.rfind(closing)] if closing and closing in body else body
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get(name_key), str):
            found.append(obj)
    if not found:
        return text, []
    calls = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
              "function": {"name": c[name_key], "arguments": json.dumps(c.get(args_key, {}))}} for c in found]
    return pieces[0].rstrip(), calls


class Episode:
    """One agent's requests, stitched into the sequence the trainer scores (laid out as multi_turn's episodes)."""

    def __init__(self, index: int, prompt: dict):
        self.index, self.prompt, self.lock = index, prompt, threading.Lock()
        self.messages: list[dict] = []  # the conversation so far: the last request's messages and the answer
        self.start = None  # the request the sequence starts from (vlm.continued), set by the first
        self.prompt_ids, self.token_ids, self.logprobs, self.env_mask = [], [], [], []
        self.requests, self.restarts, self.full, self.closed = 0, 0, False, False
        self.finish_reason, self.reward, self.error = "stop", None, None

    def as_sample(self) -> dict:
        trained = self.env_mask if self.error is None else [0] * len(self.env_mask)  # a failed one: none of it
        return {"prompt_ids": self.prompt_ids or self.prompt["ids"], "token_ids": self.token_ids,
                "logprobs": self.logprobs, "env_mask": trained,
                "images": (self.start or self.prompt).get("images", []),  # what the trainer's forward reads
                "reward": self.reward, "turns": self.requests, "finish_reason": self.finish_reason,
                "failed": self.error is not None}


class Batcher:
    """Requests from many agents in as few engine calls as possible: each call samples every request waiting."""

    def __init__(self, generate):
        self.generate, self.waiting, self.failure = generate, queue.Queue(), None
        threading.Thread(target=self.serve, name="agent endpoint: batcher", daemon=True).start()

    def ask(self, request: dict, limit: int, seed: int | None) -> dict:
        done, answer = threading.Event(), {}
        self.waiting.put((request, limit, seed, done, answer))
        done.wait()
        if "out" not in answer:
            raise RuntimeError("the vLLM engines failed while sampling for the agents")
        return answer["out"]

    def stop(self) -> None:
        """End the serving thread once the requests queued before are answered (a rollout's batcher serves it alone)."""
        self.waiting.put(None)

    def serve(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            stopping = None in batch
            batch = [b for b in batch if b is not None]
            try:
                if not batch:
                    return
                seeds = [b[2] for b in batch]
                outs = self.generate([b[0] for b in batch], [b[1] for b in batch],
                                     None if None in seeds else seeds)
                for b, out in zip(batch, outs):
                    b[4]["out"] = out
            except Exception as e:  # an engine died: the rollout re-raises it
                self.failure = e
            for b in batch:
                b[3].set()
            if stopping:
                return


class AgentEndpoint:
    """The OpenAI-compatible server for one run. `generate(requests, limits, seeds)` samples one continuation of each
    request (common/vlm.py `continued`; common/vllm_engine.py's layout); `max_len` bounds an episode's tokens after
    its first prompt as --generate_max_len does, `prompt_max_len` its first prompt. `processor`: a vision-language
    policy's, which expands its requests' images (None for a text policy)."""

    def __init__(self, tokenizer, max_len: int, prompt_max_len: int, timeout: float, processor=None):
        self.tokenizer, self.max_len, self.prompt_max_len, self.timeout = tokenizer, max_len, prompt_max_len, timeout
        self.processor = processor
        self.episodes: dict[str, Episode] = {}
        self.batcher, self.seed_of = None, None
        handler = type("Handler", (EndpointHandler,), {"endpoint": self})
        self.server = EndpointServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, name="agent endpoint", daemon=True).start()

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/episodes/{key}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def run_episodes(self, run_agent, prompts: list[dict], n: int, generate, seed_of=None) -> list[list[dict]]:
        """`n` episodes of each prompt, all at once; samples[prompt][episode] as multi_turn.run_episodes lays them
        out, plus `failed`. `seed_of(episode, request)`: the request's vLLM seed (None: greedy, no seeds)."""
        self.batcher, self.seed_of = Batcher(generate), seed_of
        episodes = [Episode(i, p) for i, p in enumerate(p for p in prompts for _ in range(n))]
        keys = [secrets.token_hex(8) for _ in episodes]
        self.episodes = dict(zip(keys, episodes))
        threads = [threading.Thread(target=self.run_one, args=(run_agent, key, e), daemon=True,
                                    name=f"agent episode {i}") for i, (key, e) in enumerate(zip(keys, episodes))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        for t, e in zip(threads, episodes):
            t.join(max(0.0, deadline - time.monotonic()))
            e.closed = True  # a late request of a hung agent is refused
            if t.is_alive() and e.error is None:
                e.error = f"did not return within {self.timeout:g} s (--agent_timeout)"
        self.batcher.stop()
        if self.batcher.failure is not None:
            raise self.batcher.failure
        self.report(episodes)
        samples = [e.as_sample() for e in episodes]
        groups = [samples[i * n:(i + 1) * n] for i in range(len(prompts))]
        for group in groups:  # the logged rewards are those of the episodes trained on
            ok = [s["reward"] for s in group if not s["failed"]]
            for s in group:
                s["reward"] = s["reward"] if not s["failed"] else (sum(ok) / len(ok) if ok else 0.0)
        return groups

    def run_one(self, run_agent, key: str, episode: Episode) -> None:
        """The user's agent for one episode, its reward checked; any failure is the episode's, not the run's."""
        try:
            prompt = episode.prompt
            result = run_agent(self.base_url(key), prompt["prompt"], prompt["label"])
            if inspect.isawaitable(result):
                result = asyncio.run(result)
            if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
                raise UserError(f"returned {result!r}; it must return the episode's reward, a finite number")
            episode.reward = float(result)
        except Exception as e:  # the user's code: the episode fails, and the rollout says why
            if episode.error is None:
                episode.error = str(e) if isinstance(e, UserError) else f"raised {type(e).__name__}: {e}"

    @staticmethod
    def report(episodes: list[Episode]) -> None:
        failed = [e for e in episodes if e.error is not None]
        if len(failed) == len(episodes):
            raise UserError(f"every one of the {len(episodes)} agent episodes of this rollout failed; the first "
                            f"--agent_fn call {failed[0].error}. Fix the agent (or --agent_timeout) and rerun.")
        if failed:
            print(f"{len(failed)} of {len(episodes)} agent episodes failed and are not trained on; the first "
                  f"{failed[0].error}", flush=True)

    # ------------------------------------------------------------------------------------------- one request
    def complete(self, key: str, body: dict) -> dict:
        """One /v1/chat/completions request of episode `key`: the stitched prompt, sampled, recorded, answered."""
        episode = self.episodes.get(key)
        if episode is None or episode.closed:
            raise UserError("no episode under way at this base URL (it ended, or timed out)")
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages:
            raise UserError("the request has no 'messages'; send the conversation as a list of messages")
        if tools and tool_call_markers(self.tokenizer.chat_template, self.tokenizer) is None:
            raise UserError("the request sends tools but the policy's chat template writes no tool calls; give the "
                            "model a template that renders them (Qwen's, Llama 3.1's), or send no tools")
        with episode.lock:
            request, continues = self.request(episode, messages, tools)
            prompt = request["ids"]  # what the trainer scores (an image prompt's expanded)
            limit = self.max_len - (len(prompt) - len(episode.prompt_ids) if continues else 0)
            asked = body.get("max_completion_tokens") or body.get("max_tokens")
            limit = min(limit, int(asked)) if asked else limit
            if (continues and episode.full) or limit <= 0:  # no room for these messages and a turn after them
                episode.full, episode.finish_reason = True, "length"
                return self.answer(prompt, {"token_ids": [], "logprobs": [], "finish_reason": "length"}, tools)
            seed = self.seed_of(episode.index, episode.requests) if self.seed_of else None
            out = self.batcher.ask(request, limit, seed)
            if episode.closed:
                raise UserError("the episode ended (--agent_timeout) while this request was sampled")
            if not continues:
                episode.start = request
                episode.prompt_ids, episode.token_ids, episode.logprobs, episode.env_mask = prompt, [], [], []
                episode.full = False
            else:
                added = prompt[len(episode.prompt_ids) + len(episode.token_ids):]
                episode.token_ids += added
                episode.logprobs += [0.0] * len(added)
                episode.env_mask += [0] * len(added)
            sampled = out["token_ids"]
            episode.token_ids += sampled
            episode.logprobs += out["logprobs"] or [0.0] * len(sampled)
            episode.env_mask += [1] * len(sampled)
            episode.requests += 1
            episode.finish_reason = out["finish_reason"]
            response = self.answer(prompt, out, tools)
            episode.messages = [*messages, response["choices"][0]["message"]]
            return response

    def request(self, episode: Episode, messages: list[dict], tools) -> tuple[dict, bool]:
        """The request's prompt (vlm.continued's layout: `ids`, and with images `engine_ids` and `images`), and
        whether it continues the episode's sequence: the ids so far plus the new messages' rendering, or else the
        whole conversation rendered (a first request, or an edited history)."""
        known = episode.messages
        if known and len(messages) > len(known) and same_messages(messages[:len(known)], known):
            last = episode.token_ids[-1] if episode.token_ids else None
            closed_by = (self.tokenizer.convert_ids_to_tokens(last) if last is not None
                         and episode.finish_reason == "stop" and is_added_token(self.tokenizer, last) else None)
            new = [template_message(m) for m in messages[len(known):]]
            added = continuation_ids(self.tokenizer, new, closed_by, tools)
            if self.processor:  # the images are the first request's: what comes after is text
                if any(image_name(part) for m in messages[len(known):] if isinstance(m.get("content"), list)
                       for part in m["content"]):
                    raise UserError("the agent's request adds an image after its first request, and an episode's "
                                    "images are its first request's; send later messages as text")
                check_text_tokens(added, [image_token_id(self.processor)], "the agent's later message")
            return continued(episode.start, episode.token_ids + added), True
        if known:
            episode.restarts += 1
        text = chat_text(self.tokenizer, [template_message(m, bool(self.processor)) for m in messages],
                         add_generation_prompt=True, **({"tools": tools} if tools else {}))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        request = {"ids": ids}
        if self.processor:  # the prompt's images the request names, each placeholder expanded for the trainer
            names = [image_name(part) for m in messages if isinstance(m.get("content"), list)
                     for part in m["content"] if image_name(part)]
            request = image_request(self.processor, ids, prompt_images_named(episode.prompt, names),
                                    "the agent's rendered request")
        if len(request["ids"]) > self.prompt_max_len:
            raise UserError(f"the agent's first request is {len(request['ids'])} tokens, over --prompt_max_len "
                            f"{self.prompt_max_len}; raise it or send a shorter conversation")
        return request, False

    def answer(self, prompt: list[int], out: dict, tools) -> dict:
        """OpenAI's chat.completion for one sample, with the ids the episode recorded."""
        text = decode_response(self.tokenizer, prompt, out["token_ids"])
        markers = tool_call_markers(self.tokenizer.chat_template, self.tokenizer) if tools else None
        content, calls = parse_tool_calls(text, markers)
        message = {"role": "assistant", "content": content or (None if calls else ""),
                   **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls and out["finish_reason"] == "stop" else out["finish_reason"]
        sampled = len(out["token_ids"])
        return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                "model": "policy", "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                             "token_ids": out["token_ids"]}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": sampled,
                          "total_tokens": len(prompt) + sampled}}


class EndpointServer(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # a rollout's agents connect all at once
    daemon_threads = True  # a hung agent's connection does not hold the process up


class EndpointHandler(http.server.BaseHTTPRequestHandler):
    """HTTP for AgentEndpoint: /episodes/<key>/v1/chat/completions and /episodes/<key>/v1/models."""
    protocol_version = "HTTP/1.1"  # keep-alive: an OpenAI client reuses its connection
    endpoint: AgentEndpoint

    def log_message(self, format, *args):  # one line per request would drown the run's log
        pass

    def send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def route(self) -> tuple[str | None, str]:
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) >= 3 and parts[0] == "episodes" and parts[2] == "v1":
            return parts[1], "/".join(parts[3:])
        return None, ""

    def do_GET(self):
        key, what = self.route()
        if key and what == "models":
            return self.send(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "you"}]})
        self.send(404, {"error": {"message": f"no such endpoint: GET {self.path}", "type": "not_found"}})

    def do_POST(self):
        key, what = self.route()
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        except json.JSONDecodeError:
            return self.send(400, {"error": {"message": "the body is not JSON", "type": "invalid_request_error"}})
        if not key or what != "chat/completions":
            return self.send(404, {"error": {"message": f"no such endpoint: POST {self.path}", "type": "not_found"}})
        if body.get("stream"):
            return self.send(400, {"error": {"message": "streaming is not served; send stream=False",
                                             "type": "invalid_request_error"}})
        try:
            self.send(200, self.endpoint.complete(key, body))
        except (UserError, DataError) as e:  # the agent's client raises it, with this sentence
            self.send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
        except Exception as e:  # noqa: BLE001 (the engines failed: the rollout re-raises the batcher's error)
            self.send(500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
