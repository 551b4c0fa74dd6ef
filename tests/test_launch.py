"""The launch recipes and the docs use only flags the scripts really have.

Every top-level script run by python, deepspeed or torchrun (`deepspeed --num_gpus 8 sft.py ...`) in
launch/*.sh, launch/*.sbatch, the shell blocks of launch/*.md and of docs/*.md is read like a shell would read it
(`\\` continuations joined, comments dropped, quotes removed, the command ending at `;`, `&&`, `|`, `>` or a newline).
Each `--flag` after the script must be one its parser has: the parser the script builds from its `Args` dataclass,
the one that prints `--help`. Literal values must fit the flag's type, choices and number of values; a value that is
a shell variable (`"$MODEL"`) fits anything, and `"$@"` passes the caller's extra flags through. The `--train_args`
of rejection_sampling.py are checked against sft.py, or dpo.py with `--mode dpo_pairs`.

A flag kept in a variable or an array is invisible here: write flags on the command line, where this test sees them.
"""

import functools
import glob
import importlib
import os
import re
import shlex
import subprocess

import pytest

from common.args import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_EXTENSIONS = (".sh", ".sbatch", ".md")
SHELL_FENCES = ("", "bash", "sh", "shell", "console")  # fenced blocks read as shell; ```python and ```json are not
PUNCTUATION = ";&|()<>\n"  # a token made of these ends the command
PASS_THROUGH = ("$@", "$*")


def script_names() -> list[str]:
    """Top-level scripts with an `Args` dataclass: the ones a recipe can invoke."""
    names = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py"))):
        with open(path) as f:
            if re.search(r"^class Args\b", f.read(), re.M):
                names.append(os.path.basename(path)[:-3])
    return names


SCRIPTS = script_names()
SCRIPT_TOKEN = re.compile(r"(?:^|/)(" + "|".join(map(re.escape, SCRIPTS)) + r")\.py$")
SCRIPT_MENTION = re.compile(r"(?:^|[\s/])(?:" + "|".join(map(re.escape, SCRIPTS)) + r")\.py\s")
LAUNCHER = re.compile(r"(?:^|/|\$\{?)(?:python[0-9.]*|deepspeed|torchrun)\}?$", re.I)  # what runs a script
FLAG = re.compile(r"^--([A-Za-z_][A-Za-z0-9_-]*)(?:=(.*))?$", re.S)


@functools.cache
def parser_for(script: str):
    """The script's own argparse parser (importing it runs nothing: main() runs only under __main__)."""
    return build_parser(importlib.import_module(script).Args)


# ------------------------------------------------------------------------------------------------ reading shell
def shell_text(path: str) -> str:
    """The shell code of a file: all of a .sh / .sbatch, the shell-fenced code blocks of a .md."""
    with open(path) as f:
        text = f.read()
    if not path.endswith(".md"):
        return text
    blocks = re.findall(r"^```[ \t]*([\w-]*)[^\n]*\n(.*?)^```", text, re.M | re.S)
    lines = [line for lang, body in blocks if lang.lower() in SHELL_FENCES for line in body.splitlines()]
    return "\n".join(line[2:] if line.startswith("$ ") else line for line in lines)


def strip_comment(line: str) -> str:
    """The line without a `#` comment (a `#` that starts a word outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def commands(text: str) -> list[list[str]]:
    """The shell commands of `text`, each a list of words with the quotes removed."""
    text = re.sub(r"\\\r?\n", " ", text)
    text = "\n".join(strip_comment(line) for line in text.splitlines())
    lexer = shlex.shlex(text, posix=True, punctuation_chars=PUNCTUATION)
    lexer.whitespace, lexer.whitespace_split, lexer.commenters = " \t\r", True, ""
    found, current = [], []
    for token in lexer:
        if token and all(c in PUNCTUATION for c in token):
            found.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in found + [current] if c]


def invocations(text: str) -> list[tuple[str, list[str]]]:
    """(script, the words after it) for every script a launcher runs, also inside quoted commands (`bash -c "..."`).

    A script name with no python / deepspeed / torchrun before it in its command (`cp dpo.py my_dpo.py`) is not run.
    """
    found = []
    for words in commands(text):
        starts = [i for i, w in enumerate(words)
                  if SCRIPT_TOKEN.search(w) and any(LAUNCHER.search(x) for x in words[:i])]
        for n, i in enumerate(starts):
            end = starts[n + 1] if n + 1 < len(starts) else len(words)
            found.append((SCRIPT_TOKEN.search(words[i]).group(1), words[i + 1: end]))
        found += [inv for w in words if " " in w and SCRIPT_MENTION.search(w + " ") for inv in invocations(w)]
    return found


# ------------------------------------------------------------------------------------------------ checking flags
def literal(value: str) -> bool:
    return "$" not in value and "*" not in value


def check_invocation(script: str, words: list[str]) -> list[str]:
    """What is wrong with `script words...`, one sentence per problem; [] when the parser accepts it."""
    actions = parser_for(script)._option_string_actions
    problems, i = [], 0
    while i < len(words):
        word = words[i]
        i += 1
        if word in PASS_THROUGH:
            continue
        match = FLAG.match(word)
        if not match:
            problems.append(f"{script}.py: {word!r} follows no flag")
            continue
        flag, inline = "--" + match.group(1), match.group(2)
        values = [inline] if inline is not None else []
        while inline is None and i < len(words) and not FLAG.match(words[i]) and words[i] not in PASS_THROUGH:
            values.append(words[i])
            i += 1
        if flag not in actions:
            problems.append(f"{script}.py has no flag {flag}")
            continue
        action = actions[flag]
        wanted = {None: (1, 1), "?": (0, 1), "+": (1, None), "*": (0, None)}.get(action.nargs, (0, 0))
        if flag in ("-h", "--help"):
            wanted = (0, 0)
        if len(values) < wanted[0] or (wanted[1] is not None and len(values) > wanted[1]):
            problems.append(f"{script}.py {flag} takes {action.nargs or 'one'} value(s), got {values}")
            continue
        for value in filter(literal, values):
            try:
                converted = action.type(value) if action.type else value
            except Exception:
                problems.append(f"{script}.py {flag} {value!r} is not a valid {action.type.__name__}")
                continue
            if action.choices and converted not in action.choices:
                problems.append(f"{script}.py {flag} {value!r} is not one of {list(action.choices)}")
        if script == "rejection_sampling" and flag == "--train_args" and values and literal(values[0]):
            trainer = "dpo" if re.search(r"--mode(=|\s+)dpo_pairs\b", " ".join(words)) else "sft"
            problems += [f"--train_args: {p}" for p in check_invocation(trainer, shlex.split(values[0]))]
    return problems


def check_file(path: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The invocations in a file and the problems in them."""
    try:
        found = invocations(shell_text(path))
    except ValueError as e:  # shlex: unbalanced quotes
        return [], [f"cannot read it as shell: {e}"]
    return found, [p for script, words in found for p in check_invocation(script, words)]


LAUNCH_FILES = sorted(glob.glob(os.path.join(ROOT, "launch", "*")))
RECIPES = [p for p in LAUNCH_FILES if p.endswith(RECIPE_EXTENSIONS)]
# Python programs in launch/, not recipes: the demos and the real demo's reward, the GPU checks (test_gpu_paths reads
# gpu_smoke's stages; gpu_trainers and wheelhouse run for a GPU node, docs/gpu.md).
PROGRAMS = ("demo.py", "demo_vlm.py", "demo_real.py", "right_answer_reward.py", "gpu_smoke.py", "gpu_trainers.py",
            "wheelhouse.py")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


# ------------------------------------------------------------------------------------------------ tests
def test_every_launch_file_is_checked():
    others = [os.path.basename(p) for p in LAUNCH_FILES
              if p not in RECIPES and os.path.isfile(p)
              and os.path.basename(p) not in PROGRAMS]
    assert not others, f"launch/ files this test cannot read: {others}; give them one of {RECIPE_EXTENSIONS}"
    assert RECIPES, "no launch recipes found"


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_launch_recipe_uses_real_flags(path):
    found, problems = check_file(path)
    assert found, f"{path} invokes none of {SCRIPTS}: nothing in it was checked"
    assert not problems, f"{path}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", [p for p in RECIPES if not p.endswith(".md")], ids=os.path.basename)
def test_launch_script_is_valid_bash(path):
    result = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", DOCS, ids=os.path.basename)
def test_docs_commands_use_real_flags(path):
    _, problems = check_file(path)
    assert not problems, f"{path}:\n  " + "\n  ".join(problems)


def test_every_script_has_a_recipe():
    used = {script for path in RECIPES for script, _ in check_file(path)[0]}
    assert set(SCRIPTS) <= used, f"scripts with no launch recipe: {sorted(set(SCRIPTS) - used)}"


def test_the_checker_catches_stale_flags(tmp_path):
    """The reader itself: continuations, comments, variables, quoted commands, and the problems it must report."""
    recipe = tmp_path / "recipe.sh"
    recipe.write_text(
        'MODEL=${MODEL:-meta-llama/Llama-3.1-8B}  # --not_checked, a comment\n'
        'deepspeed --num_gpus 8 "$ROOT/sft.py" \\\n'
        '    --pretrain "$MODEL" --apply_chat_template \\\n'
        '    --no_such_flag 1 \\\n'
        '    --zero_stage three "$@"\n'
        'python ppo_ray.py --advantage_estimator ppo --reward_pretrain a b && echo --done\n'
        'srun bash -c "python kto.py --beta=0.1 --stale_kto_flag" > log\n'
        'python rejection_sampling.py --mode dpo_pairs --train_args "--beta 0.1 --stale_dpo_flag"\n'
        'cp dpo.py my_dpo.py --not_run\n'
    )
    found, problems = check_file(str(recipe))
    assert [script for script, _ in found] == ["sft", "ppo_ray", "kto", "rejection_sampling"]
    assert problems == [
        "sft.py has no flag --no_such_flag",
        "sft.py --zero_stage 'three' is not a valid int",
        "ppo_ray.py --advantage_estimator 'ppo' is not one of ['gae', 'reinforce++', 'reinforce++-baseline', 'grpo', "
        "'dr_grpo', 'rloo']",
        "kto.py has no flag --stale_kto_flag",
        "--train_args: dpo.py has no flag --stale_dpo_flag",
    ]
