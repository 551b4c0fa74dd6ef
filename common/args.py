"""Turn an `Args` dataclass into a command line, using the string under each field as its --help text.

Scripts declare their flags CleanRL-style, a dataclass whose fields carry a one-line docstring:

    @dataclass
    class Args:
        lr: float = 1e-5
        \"\"\"peak learning rate\"\"\"

and call `args = parse_args(Args)`. Booleans take `--flag`, `--flag true` or `--flag false`; `Literal[...]`
fields become choices; `list[...]` fields take several values. `--local_rank`, which the deepspeed launcher
passes, is accepted and ignored (the rank comes from the environment).
"""

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
import textwrap
import types
import typing


def check_model_path(path: str, flag: str = "--pretrain") -> None:
    """Fail early, in one sentence, on a model folder that is not there or holds no model ("org/name" is left to
    the hub, which reports its own errors)."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise UserError(f"{flag} {path} has no config.json; give a Hugging Face model folder.")
    elif not (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) and not path.startswith(".")):
        raise UserError(f"{flag} {path} does not exist; give a Hugging Face model folder or hub name.")


def field_docs(cls) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written right under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _to_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def build_parser(cls, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue  # computed at run time
        tp = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs = {"default": default, "help": f"{docs.get(f.name, '')} (default: {default})"}
        if tp is bool:
            kwargs.update(type=_to_bool, nargs="?", const=True, metavar="BOOL")
        elif typing.get_origin(tp) is typing.Literal:
            kwargs.update(choices=typing.get_args(tp), type=type(typing.get_args(tp)[0]))
        elif typing.get_origin(tp) is list:
            kwargs.update(nargs="+", type=typing.get_args(tp)[0])
        else:
            kwargs.update(type=tp)
        parser.add_argument(f"--{f.name}", **kwargs)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return parser


def parse_args(cls, argv: list[str] | None = None):
    """Parse the command line (or `argv`) into an instance of the dataclass `cls`."""
    description = inspect.getmodule(cls).__doc__ if inspect.getmodule(cls) else None
    namespace = build_parser(cls, description).parse_args(sys.argv[1:] if argv is None else argv)
    values = {k: v for k, v in vars(namespace).items() if k != "local_rank"}
    return cls(**values)


class UserError(ValueError):
    """A mistake in the user's flags, files or data; its message says what to change."""


def run_main(main, args) -> None:
    """Run main(args); a mistake in the user's flags or data ends the run with one sentence and exit code 2.

    Every rank hits the same mistake, so only rank 0 prints it. Anything else keeps its full traceback.
    """
    if not sys.stderr.isatty():  # in a log file, the "Loading weights" bars' redraws are noise
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        main(args)
    except UserError as e:
        from tqdm import tqdm

        for bar in list(tqdm._instances):  # end any progress bar's line, so the error starts a line of its own
            bar.close()
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()  # joins Ray's threads that print worker deaths, so that none writes into the error's line
        sys.stdout.flush()
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {e}\n")  # one write: a line no other thread can split
            sys.stderr.flush()
        sys.exit(2)
