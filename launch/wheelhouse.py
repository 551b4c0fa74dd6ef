"""Gather the wheels a GPU node without internet needs to run the trainers: `make wheelhouse`.

sft.py, rm.py, dpo.py and kto.py need DeepSpeed and the Hugging Face stack (requirements-trainers.txt) on top of the
node's own CUDA build of torch. This resolves that list here, where a package index is reachable, builds DeepSpeed's
wheel (PyPI ships only its source; built without ops, which DeepSpeed compiles on the node when one is first used:
the trainers use one only with --offload_optimizer), downloads every other wheel for the node's Python and machine
(x86_64, or aarch64 for GH200/GB200 nodes), and leaves out torch, triton and the nvidia-* libraries (the node's CUDA
build of torch is what the trainers should run on, and pip counts it as installed).

pip evaluates environment markers for the Python that runs it, not the node's, so the dependencies are walked again
under the node's markers (node_packages): what only the node needs (tomli for huggingface_hub on Python 3.10) is
added, what only this Python needs is left out. Every torch floor among them (transformers' `torch>=2.5`, which pip
does not enforce: an older torch installs cleanly and transformers then finds no torch at import) is checked against
--node_torch, or printed without it. Copy the folder and requirements-trainers.txt to the node, then:

    pip install --no-index --find-links wheelhouse -r requirements-trainers.txt

    python launch/wheelhouse.py --out wheelhouse --python_version 3.12 --arch aarch64 --node_torch 2.9.0
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Wheels the node's torch brings with it; a node without torch needs its CUDA build from pytorch.org first.
NODE_HAS = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
ARCHES = ("x86_64", "aarch64")  # x86 nodes; GH200/GB200 (Grace) nodes
EXTRAS = ("", "torch")  # the trainers import transformers with torch: its "torch" extra's requirements count


def platforms(arch: str) -> list[str]:
    """The manylinux tags a Linux node of `arch` with glibc 2.17 or later installs, newest first."""
    legacy = {"x86_64": ["manylinux2014", "manylinux2010", "manylinux1"], "aarch64": ["manylinux2014"]}[arch]
    return [f"manylinux_2_{minor}_{arch}" for minor in range(39, 16, -1)] + [f"{tag}_{arch}" for tag in legacy]


def node_environment(python_version: str, arch: str) -> dict[str, str]:
    """The environment markers of a Linux node running CPython `python_version` on `arch`."""
    full = python_version if python_version.count(".") == 2 else python_version + ".0"
    return {"python_version": ".".join(python_version.split(".")[:2]), "python_full_version": full,
            "implementation_version": full, "platform_machine": arch, "sys_platform": "linux",
            "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython"}


def applies(requirement: Requirement, environment: dict[str, str]) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": extra})
                                             for extra in EXTRAS)


def node_packages(requires: dict[str, list[str]], roots: list[str], environment: dict[str, str]) -> tuple[set, set]:
    """(names of `requires` the node needs, names it needs that `requires` lacks): the dependency closure of `roots`
    under the node's markers. `requires` maps each resolved package to its Requires-Dist lines."""
    requires = {canonicalize_name(name): lines for name, lines in requires.items()}
    needed, missing, todo = set(), set(), [canonicalize_name(Requirement(r).name) for r in roots]
    while todo:
        name = todo.pop()
        if name in needed or name in missing:
            continue
        if name not in requires:
            missing.add(name)
            continue
        needed.add(name)
        todo += [canonicalize_name(r.name) for r in map(Requirement, requires[name]) if applies(r, environment)]
    return needed, missing


def torch_floors(requires: dict[str, list[str]], names: set, environment: dict[str, str]) -> dict[str, SpecifierSet]:
    """{package: the torch versions it asks for} among `names`, under the node's markers."""
    floors = {}
    for name, lines in requires.items():
        for r in map(Requirement, lines):
            if canonicalize_name(name) in names and r.name == "torch" and r.specifier and applies(r, environment):
                floors[name] = floors.get(name, SpecifierSet()) & r.specifier
    return floors


def check_node_torch(floors: dict[str, SpecifierSet], node_torch: str) -> None:
    """Exit with one sentence when the node's torch is older (or newer) than a package asks for."""
    wrong = [f"{name} needs torch{spec}" for name, spec in sorted(floors.items())
             if not spec.contains(Version(node_torch), prereleases=True)]
    if wrong:
        sys.exit(f"error: the node's torch {node_torch} does not fit: {'; '.join(wrong)}. Install a torch that does "
                 f"on the node (its CUDA build from pytorch.org), or pin older versions in requirements-trainers.txt.")


def pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env={**os.environ, **(env or {})})


def resolve(requirements: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({name: version}, {name: Requires-Dist lines}) of everything `requirements` pulls in, as pip resolves it for
    this Python (under the project's constraints)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", report, "-r", requirements,
            "-c", os.path.join(ROOT, "constraints.txt"))
        with open(report) as f:
            found = json.load(f)["install"]
    pins = {canonicalize_name(p["metadata"]["name"]): p["metadata"]["version"] for p in found}
    return pins, {canonicalize_name(p["metadata"]["name"]): p["metadata"].get("requires_dist", []) for p in found}


def requirement_lines(path: str) -> list[str]:
    with open(path) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wheelhouse", help="the folder the wheels go into")
    parser.add_argument("--python_version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the GPU node's Python (`python3 --version` there), e.g. 3.12; default: this one's")
    parser.add_argument("--arch", choices=ARCHES, default=platform.machine() if platform.machine() in ARCHES
                        else "x86_64", help="the GPU node's machine (`uname -m` there); default: this one's")
    parser.add_argument("--node_torch", help="the node's torch version (python -c 'import torch; "
                        "print(torch.__version__)' there), checked against every package's torch floor")
    parser.add_argument("--requirements", default=os.path.join(ROOT, "requirements-trainers.txt"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pins, requires = resolve(args.requirements)
    environment = node_environment(args.python_version, args.arch)
    needed, missing = node_packages(requires, requirement_lines(args.requirements), environment)
    floors = torch_floors(requires, needed, environment)
    if args.node_torch:
        check_node_torch(floors, args.node_torch)
    else:
        print("the node's torch must fit: " + "; ".join(f"{n} torch{s}" for n, s in sorted(floors.items())))
    pins = {name: version for name, version in pins.items() if name in needed and not NODE_HAS.match(name)}
    deepspeed = pins.pop("deepspeed")
    # DS_BUILD_OPS=0: a pure-Python wheel, whatever the node's CUDA; --no-build-isolation: its setup.py imports torch
    pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", args.out, f"deepspeed=={deepspeed}",
        env={"DS_BUILD_OPS": "0"})
    node = ["--only-binary=:all:", "--quiet", "-d", args.out, "--python-version",
            "".join(args.python_version.split(".")[:2]),
            "--implementation", "cp", *[f"--platform={p}" for p in platforms(args.arch)]]
    pip("download", "--no-deps", *node, *[f"{name}=={v}" for name, v in sorted(pins.items())])
    if missing - {name for name in missing if NODE_HAS.match(name)}:  # what only the node's Python or machine needs
        pip("download", *node, "-c", os.path.join(ROOT, "constraints.txt"),
            *sorted(name for name in missing if not NODE_HAS.match(name)))
    wheels = sorted(f for f in os.listdir(args.out) if f.endswith(".whl"))
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in wheels) / 2**20
    print(f"{len(wheels)} wheels ({size:.0f} MiB) in {args.out} for Python {args.python_version} on {args.arch}; on "
          f"the GPU node, beside its CUDA build of torch:\n  pip install --no-index --find-links {args.out} -r "
          f"requirements-trainers.txt")


if __name__ == "__main__":
    main()
