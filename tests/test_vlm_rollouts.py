"""ppo_ray.py's multi-turn environments (--env_fn), agents (--agent_fn) and partial rollouts (--partial_rollouts) on a
vision-language policy, the tiny Idefics3 of common/tiny_vlm.py: every engine request of an episode or of a continued
sample gives vLLM the prompt's placeholders, the tokens after them and the prompt's images (common/vlm.py
`continued`), while the trainer scores the expanded prompt and the same tokens; the environment and the agent get
the prompt as its row wrote it, image parts included; replies stay text."""

import json
import os

import pytest
import torch
from conftest import SEED, run_script
from test_vlm_ppo import LENGTH_REWARD, ROUNDING_LEVEL, grpo, ppo_args
from transformers import AutoProcessor

from common import vlm
from common.agents import AgentEndpoint
from common.args import UserError
from common.data import load_prompts
from common.deepspeed_utils import load_tokenizer
from common.multi_turn import run_episodes
from common.partial_rollouts import Group
from common.synthetic_image_task import write_image_task
from common.tiny_vlm import write_tiny_vlm


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    return write_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=SEED)


@pytest.fixture(scope="module")
def image_task(tmp_path_factory) -> dict:
    return write_image_task(str(tmp_path_factory.mktemp("image_task")), seed=SEED, num_train=16, num_eval=4)


@pytest.fixture(scope="module")
def prompts(tiny_vlm, image_task) -> list[dict]:
    return load_prompts(ppo_args(tiny_vlm), load_tokenizer(tiny_vlm), image_task["prompts_train"], "train")[:3]


def recording_policy(answer: list[int]):
    """A stand-in for the engines (the runs below use them): each request is answered `answer` and recorded."""
    seen = []

    def generate(requests, limits, seeds=None):
        seen.extend(requests)
        return [{"token_ids": answer[:limit], "logprobs": [-0.5] * len(answer[:limit]), "finish_reason": "stop"}
                for limit in limits]

    return generate, seen


def assert_carries_its_images(request: dict, prompt: dict, tokens: list[int]):
    """vLLM's request: the prompt's placeholders and `tokens`, with the prompt's images; the trainer's ids: the
    processor's expansion and the same tokens."""
    assert request["engine_ids"] == prompt["engine_ids"] + tokens and request["images"] is prompt["images"]
    assert request["ids"] == prompt["ids"] + tokens
    ids, images = vlm.engine_prompts([request])
    assert ids == [prompt["engine_ids"] + tokens] and images == [prompt["images"]]


def test_a_continued_sample_asks_with_its_prompts_placeholders_and_images(prompts):
    """--partial_rollouts: a sample cut after 2 tokens goes on as a request of the placeholders, the 2 tokens and
    the image; the first request is the prompt's own."""
    group = Group(prompts[0], seed=7, n=2)
    [(first, *_)] = group.requests(lambda done: 4 - done)
    assert_carries_its_images(first, prompts[0], [])
    group.samples[0].update(token_ids=[40, 41])
    group.samples[1].update(token_ids=[42], finish_reason="stop")
    [(later, n, limit, *_)] = group.requests(lambda done: 4 - done)
    assert (n, limit) == (1, 2)
    assert_carries_its_images(later, prompts[0], [40, 41])


class ImageEnv:
    """Two turns; reset records the prompt it got, as the row wrote it."""
    seen: list = []

    def reset(self, prompt, label):
        self.seen.append(prompt)
        self.turn = 0

    def step(self, action_text):
        self.turn += 1
        return "Look again.", 1.0, self.turn >= 2


def test_every_turn_of_an_episode_asks_with_its_prompts_placeholders_and_images(tiny_vlm, prompts):
    """--env_fn: the second turn's request is the placeholders, the first turn and the environment's reply, with the
    image; the episode the trainer scores starts from the expanded prompt; reset got the row's messages, image part
    included."""
    tokenizer = load_tokenizer(tiny_vlm)
    generate, seen = recording_policy([40, 41, tokenizer.eos_token_id])
    ImageEnv.seen = []
    groups = run_episodes(generate, ImageEnv, tokenizer, prompts[:2], 1, max_turns=2, max_len=64, chat_template=True,
                          input_template=None, prompt_max_len=64, placeholders=[vlm.image_token_id(
                              AutoProcessor.from_pretrained(tiny_vlm))])
    assert ImageEnv.seen == [p["prompt"] for p in prompts[:2]] and ImageEnv.seen[0][0]["content"][0]["type"] == "image"
    for prompt, [episode] in zip(prompts, groups):
        assert episode["prompt_ids"] == prompt["ids"] and episode["turns"] == 2
        later = [r for r in seen if r["ids"][:len(prompt["ids"])] == prompt["ids"] and r["images"] is prompt["images"]]
        assert len(later) == 2
        assert_carries_its_images(later[0], prompt, [])
        first_turn = episode["token_ids"][: episode["env_mask"].index(0, 3)]
        reply = episode["token_ids"][len(first_turn): len(episode["token_ids"]) - 3]
        assert_carries_its_images(later[1], prompt, first_turn + reply)
        assert episode["env_mask"] == [1] * 3 + [0] * len(reply) + [1] * 3


class EchoingEnv(ImageEnv):
    def step(self, action_text):
        return "You see <image> here.", 0.0, False


class RenamingEnv(ImageEnv):
    def reset(self, prompt, label):
        return "Count the red squares."


@pytest.mark.parametrize("env, message", [
    (EchoingEnv, r"^the environment's step\(\) reply 'You see <image> here\.' holds the image placeholder token \d+ "
                 r".* keep replies and later messages text without it"),
    (RenamingEnv, r"^the environment's reset\(\) returned a first message for a prompt with images, which would "
                  r"start the episode without them; return None"),
])
def test_an_environment_that_would_put_an_image_placeholder_or_drop_the_images_is_refused(tiny_vlm, prompts, env,
                                                                                          message):
    tokenizer = load_tokenizer(tiny_vlm)
    generate, _ = recording_policy([40, tokenizer.eos_token_id])
    with pytest.raises(UserError, match=message):
        run_episodes(generate, env, tokenizer, prompts[:1], 1, max_turns=2, max_len=64, chat_template=True,
                     input_template=None, prompt_max_len=64,
                     placeholders=[vlm.image_token_id(AutoProcessor.from_pretrained(tiny_vlm))])


def test_an_agents_requests_carry_its_prompts_images_and_later_messages_stay_text(tiny_vlm, prompts):
    """--agent_fn: the agent sends its prompt's messages, image parts as the row wrote them (or as OpenAI's
    image_url); the first request gives vLLM the placeholder and the image, the trainer the processor's expansion;
    the second continues it with the same image. An image that is not the prompt's, one added later, or a later
    message holding the placeholder token is refused to the agent, in one sentence."""
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    tokenizer = load_tokenizer(tiny_vlm)
    endpoint = AgentEndpoint(tokenizer, max_len=64, prompt_max_len=64, timeout=30, processor=processor)
    generate, seen = recording_policy([40, 41, tokenizer.eos_token_id])
    errors = []

    def run_agent(base_url, prompt, label):
        key = base_url.split("/episodes/")[1].split("/")[0]
        messages = json.loads(json.dumps(prompt))
        if label != prompts[0]["label"]:  # the second prompt's agent sends OpenAI's form
            part = messages[0]["content"][0]
            messages[0]["content"][0] = {"type": "image_url", "image_url": {"url": part.pop("image")}}
        answer = endpoint.complete(key, {"messages": messages})
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "Look again."}]
        messages.append(endpoint.complete(key, {"messages": messages})["choices"][0]["message"])
        for wrong in ([{"type": "image", "image": "elsewhere.png"}], "What is <image>?"):
            try:
                endpoint.complete(key, {"messages": [*messages, {"role": "user", "content": wrong}]})
            except UserError as e:
                errors.append(str(e))
        return 1.0

    groups = endpoint.run_episodes(run_agent, prompts[:2], 1, generate)
    endpoint.close()
    for prompt, [episode] in zip(prompts, groups):
        assert episode["prompt_ids"] == prompt["ids"] and episode["images"] == prompt["images"]
        mine = [r for r in seen if r["images"] == prompt["images"]]
        assert len(mine) == 2
        assert_carries_its_images(mine[0], dict(prompt, images=mine[0]["images"]), [])
        assert mine[1]["engine_ids"] == prompt["engine_ids"] + episode["token_ids"][: len(mine[1]["ids"]) - len(
            prompt["ids"])]
        assert mine[1]["ids"] == (prompt["ids"] + episode["token_ids"])[: len(mine[1]["ids"])]
    assert len(errors) == 4  # each agent's two wrong requests, the two agents in threads of their own
    assert sum(e.startswith("the agent's request adds an image after its first request") for e in errors) == 2
    assert sum(e.startswith("the agent's later message holds the image placeholder token") for e in errors) == 2
    with pytest.raises(UserError, match=r"^the agent's request holds the image 'elsewhere\.png', which is none of "
                                        r"its prompt's images"):
        vlm.prompt_images_named(prompts[0], ["elsewhere.png"])


# ------------------------------------------------------------------------------------------ GRPO runs on the engines
# After LENGTH_REWARD, whose red_squares it calls.
IMAGE_ENV = '''

class CountingEnv:
    """Two turns, each worth 1 less its length in hundredths (a spread in every group, and a policy that keeps ending
    its first turn before the length limit); reset recounts the red squares of the prompt's own image."""

    def reset(self, prompt, label):
        image = prompt[0]["content"][0]["image"]
        assert str(red_squares(image)) == label, f"{image} holds {red_squares(image)} red squares, not {label}"
        self.turn = 0

    def step(self, action_text):
        self.turn += 1
        return "Look again.", 1.0 - len(action_text) / 100, self.turn >= 2


def run_agent(base_url, prompt, label):
    """Sends the prompt's messages, image part included, then asks again: two requests, the second continuing."""
    import openai

    image = prompt[0]["content"][0]["image"]
    assert str(red_squares(image)) == label, f"{image} holds {red_squares(image)} red squares, not {label}"
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages, reward = list(prompt), 0.0
    for _ in range(2):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        text = answer.choices[0].message.content
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Look again."}]
        reward += len(text) / 10  # within --reward_clip 10, so that every group has a spread
    return reward
'''


@pytest.fixture(scope="module")
def ending_vlm(tiny_vlm, prompts, tmp_path_factory) -> str:
    """The tiny VLM made to end its turns early: its head's EOS row along the mean of its final hidden states (which
    dominates them: 8.4 of their norm 11.3) gives the EOS a logit of about 3, a few tokens a turn. The untrained one
    runs every turn to the length limit, which ends an --env_fn episode after its first turn."""
    from transformers import AutoModelForImageTextToText

    folder = write_tiny_vlm(str(tmp_path_factory.mktemp("ending_vlm")), seed=SEED)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    ids = torch.tensor([prompts[0]["ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                    **vlm.image_inputs(processor, [{"images": prompts[0]["images"]}], packing=False))
        mean = model.model.text_model.norm(out.hidden_states[-1][0]).mean(0)  # (hidden,)
        model.lm_head.weight[processor.tokenizer.eos_token_id] = 3.0 * mean / mean.norm() ** 2
    model.save_pretrained(folder)
    return folder


def episodes_grpo(tiny_vlm: str, image_task: dict, tmp_path, flag: str, function: str) -> list[dict]:
    """Three GRPO steps of two-turn episodes (--env_fn or --agent_fn) on the image prompts, rewarded by the turns'
    lengths (a spread in every group, so that every update moves the weights); the environment and the agent stop
    the run where a prompt's image does not hold its label's red squares. Returns the metrics rows."""
    source = tmp_path / "image_env.py"
    source.write_text(LENGTH_REWARD.format(folder=os.path.dirname(image_task["prompts_train"])) + IMAGE_ENV)
    out = str(tmp_path / "ppo")
    run_script("ppo_ray.py", ["--pretrain", tiny_vlm, "--prompt_data", image_task["prompts_train"],
                              "--apply_chat_template", "--output_dir", out, "--generate_max_len", "48",
                              "--prompt_max_len", "64", flag, f"{source}:{function}", "--max_turns", "2",
                              "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4",
                              "--rollout_batch_size", "8", "--train_batch_size", "32", "--micro_train_batch_size",
                              "16", "--actor_learning_rate", "1e-2", "--init_kl_coef", "0.001", "--max_steps", "3"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "vllm/logprob_diff" in row]


def assert_vllm_follows_over_two_turns(rows: list[dict]):
    diffs = [row["vllm/logprob_diff"] for row in rows]
    print(f"vllm/logprob_diff {diffs}, env/turns {[row['env/turns'] for row in rows]}, "
          f"objective/kl {[row['objective/kl'] for row in rows]}")
    assert len(diffs) == 3 and max(diffs) < ROUNDING_LEVEL, f"vLLM drifts from the trainer: {diffs}"
    assert abs(rows[-1]["objective/kl"]) > 1e-4  # the updates moved the policy: the syncs had something to send
    assert all(row["env/turns"] > 1.5 for row in rows)  # most episodes' second turn asked with the image again
    assert all(row["env/failed_episodes"] == 0 for row in rows)


@pytest.mark.slow
@pytest.mark.extended
def test_grpo_with_an_environment_on_image_prompts_keeps_vllm_at_the_trainers_logprobs(ending_vlm, image_task,
                                                                                       tmp_path):
    assert_vllm_follows_over_two_turns(episodes_grpo(ending_vlm, image_task, tmp_path, "--env_fn", "CountingEnv"))


@pytest.mark.slow
@pytest.mark.extended
def test_grpo_with_an_agent_on_image_prompts_keeps_vllm_at_the_trainers_logprobs(tiny_vlm, image_task, tmp_path):
    assert_vllm_follows_over_two_turns(episodes_grpo(tiny_vlm, image_task, tmp_path, "--agent_fn", "run_agent"))


@pytest.mark.slow
@pytest.mark.extended
def test_grpo_with_partial_rollouts_on_image_prompts_continues_cut_samples_with_their_images(tiny_vlm, image_task,
                                                                                             tmp_path):
    """--partial_rollouts on the image prompts, chunks of 2 tokens under a bound of 1: samples the step boundary cut
    go on under the next policy, each continuation with its prompt's image, so the tokens the step's own policy
    sampled, continued ones included, have vLLM's log-probs at rounding level (partial/logprob_diff_0); the tokens
    one version old show the update since (vllm/logprob_diff averages both)."""
    out = str(tmp_path / "ppo")
    rows = grpo(tiny_vlm, image_task, out, "--generate_max_len", "24", "--async_rollouts", "--partial_rollouts",
                "--max_staleness", "1", "--partial_chunk_tokens", "2",
                "--reward_clip", "1000")  # the default 10 clips most lengths: a group without a spread, no update
    fresh = [row.get("partial/logprob_diff_0") for row in rows]  # None: the step's tokens were all sampled ahead
    print(f"partial/logprob_diff_0 {fresh}, partial/continued {[row['partial/continued'] for row in rows]}, "
          f"partial/logprob_diff_1 {[row.get('partial/logprob_diff_1') for row in rows]}, "
          f"vllm/logprob_diff {[row['vllm/logprob_diff'] for row in rows]}")
    assert len(rows) == 3 and max(d for d in fresh if d is not None) < ROUNDING_LEVEL, f"vLLM drifts: {fresh}"
    # a sample cut under a bound of 1 holds tokens of both versions: its continuation's are among those of staleness 0
    assert any(row["partial/continued"] > 0 for row in rows), "no sample was cut and continued"
    assert all(row["partial/staleness_0"] + row["partial/staleness_1"] == pytest.approx(1) for row in rows)
