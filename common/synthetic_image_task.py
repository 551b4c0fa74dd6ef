"""A synthetic visual task with a checkable answer ("How many red squares?"), drawn with PIL, for the VLM paths.

Each image is a 3 x 3 grid of cells on white, each cell empty or holding one shape: a red square (what is counted), a
red circle or a blue square (what a model that reads only colour, or only shape, miscounts). The answer, 0 to 3, is a
number, so the text task's rule reward (common/synthetic_task.py reward_fn: the response's first number against the
label) scores it. The images are 56 x 56 pixels, the tiny VLM's size (common/tiny_vlm.py), and are written as PNG
files beside the JSONL rows that name them by relative path.

    python -m common.synthetic_image_task --out /tmp/image_task     # the files listed in write_image_task()

With --refusal_rate 0.7 the SFT of `make demo-vlm` answers about half the held-out scenes and GRPO removes the habit
(seeds 0-3: 53% -> 93%, 59% -> 84%, 51% -> 81%, 54% -> 73% after 40 GRPO steps; docs/vlm.md).
"""

import argparse
import json
import os
import random

from PIL import Image, ImageDraw

from common.synthetic_task import REFUSAL

QUESTION = "How many red squares?"
GRID, CELL = 3, 18  # 3 x 3 cells of 18 pixels, drawn from pixel 1: a 56 x 56 image
SHAPES = ("red square", "red circle", "blue square")
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def draw_scene(shapes: list[str | None]) -> Image.Image:
    """The image of one grid: shapes[i] is the shape in cell i (row-major), or None for an empty cell."""
    image = Image.new("RGB", (GRID * CELL + 2, GRID * CELL + 2), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i, shape in enumerate(shapes):
        if shape is None:
            continue
        colour, kind = shape.split()
        left, top = 1 + (i % GRID) * CELL + 3, 1 + (i // GRID) * CELL + 3
        box = (left, top, left + CELL - 7, top + CELL - 7)
        (draw.rectangle if kind == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image


def sample_scene(rng: random.Random) -> list[str | None]:
    """A grid with 0-3 red squares and 0-3 distractors, in random cells."""
    red_squares, distractors = rng.randint(0, 3), rng.randint(0, 3)
    shapes = ["red square"] * red_squares + [rng.choice(SHAPES[1:]) for _ in range(distractors)]
    shapes += [None] * (GRID * GRID - len(shapes))
    rng.shuffle(shapes)
    return shapes


def prompt(image_path: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image_path}, {"type": "text", "text": QUESTION}]}]


def write_image_task(out: str, seed: int = 0, num_train: int = 256, num_eval: int = 64,
                     refusal_rate: float = 0.0) -> dict:
    """Write the task into `out` and return the paths: images/*.png; sft_train.jsonl and sft_eval.jsonl ({"prompt",
    "response"}: the count); prompts_train.jsonl and prompts_eval.jsonl ({"prompt", "label"}, for rejection sampling
    and GRPO); preference_train.jsonl ({"prompt", "chosen", "rejected"}: the count against a wrong one, for dpo.py
    and rm.py) and preference_eval.jsonl (each held-out scene's count against every wrong one: a reward model's
    ranking is read over all four counts, where one that ignores the image can only order the counts).

    `refusal_rate`: the share of SFT responses to scenes of 2 or 3 red squares that are the text task's REFUSAL
    instead of the count, as a hurried annotator leaves the harder scenes. SFT copies the habit (it refuses most such
    scenes while having seen their counts), and GRPO, rewarded for right counts alone, is there to remove it. The
    scenes, labels and preference pairs are the same at any rate."""
    rng, refusals = random.Random(seed), random.Random(f"{seed}/refusals")
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    files = {}
    for split, count in (("train", num_train), ("eval", num_eval)):
        rows = []
        for i in range(count):
            shapes = sample_scene(rng)
            name = os.path.join("images", f"{split}_{i:05d}.png")
            draw_scene(shapes).save(os.path.join(out, name))
            answer = str(shapes.count("red square"))
            wrong = str(rng.choice([n for n in range(4) if str(n) != answer]))
            refused = int(answer) >= 2 and refusals.random() < refusal_rate
            rows.append({"prompt": prompt(name), "response": REFUSAL if refused else answer, "label": answer,
                         "rejected": wrong})
        for kind, keys in (("sft", ("prompt", "response")), ("prompts", ("prompt", "label"))):
            files[f"{kind}_{split}"] = path = os.path.join(out, f"{kind}_{split}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps({k: row[k] for k in keys}) + "\n" for row in rows)
        files[f"preference_{split}"] = path = os.path.join(out, f"preference_{split}.jsonl")
        with open(path, "w") as f:
            for row in rows:  # the count is preferred, whatever the demonstration said
                wrongs = [row["rejected"]] if split == "train" else [str(n) for n in range(4) if str(n) != row["label"]]
                f.writelines(json.dumps({"prompt": row["prompt"], "chosen": row["label"], "rejected": wrong}) + "\n"
                             for wrong in wrongs)
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the images and JSONL files to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenes")
    parser.add_argument("--num_train", type=int, default=256, help="training images")
    parser.add_argument("--num_eval", type=int, default=64, help="held-out images")
    parser.add_argument("--refusal_rate", type=float, default=0.0,
                        help="share of the SFT responses to scenes of 2 or 3 red squares that refuse to count")
    args = parser.parse_args()
    files = write_image_task(args.out, args.seed, args.num_train, args.num_eval, args.refusal_rate)
    print(f"wrote {args.num_train + args.num_eval} images and {', '.join(sorted(files))} to {args.out}")


if __name__ == "__main__":
    main()
