"""Gather the wheels a GPU node without internet needs to run the trainers: `make wheelhouse`.

sft.py, rm.py, dpo.py and kto.py need DeepSpeed and the Hugging Face stack (requirements-trainers.txt) on top of the
node's own CUDA build of torch. This resolves that list here, where a package index is reachable, builds DeepSpeed's
wheel (PyPI ships only its source; built without ops, which DeepSpeed compiles on the node when one is first used:
the trainers use one only with --offload_optimizer), downloads every other wheel for the node's Python, and leaves out
torch, triton and the nvidia-* libraries (the node's CUDA build of torch is what the trainers should run on, and pip
counts it as installed). Copy the folder and requirements-trainers.txt to the node, then:

    pip install --no-index --find-links wheelhouse -r requirements-trainers.txt

    python launch/wheelhouse.py --out wheelhouse --python_version 3.12     # the node's Python
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Wheels the node's torch brings with it; a node without torch needs its CUDA build from pytorch.org first.
NODE_HAS = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64"]


def pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env={**os.environ, **(env or {})})


def resolve(requirements: str) -> dict[str, str]:
    """{name: version} of everything `requirements` pulls in, as pip resolves it for this Python (under the
    project's constraints), torch's own stack left out."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", report, "-r", requirements,
            "-c", os.path.join(ROOT, "constraints.txt"))
        with open(report) as f:
            found = json.load(f)["install"]
    pins = {p["metadata"]["name"].lower(): p["metadata"]["version"] for p in found}
    return {name: version for name, version in pins.items() if not NODE_HAS.match(name)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wheelhouse", help="the folder the wheels go into")
    parser.add_argument("--python_version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the GPU node's Python (`python3 --version` there), e.g. 3.12; default: this one's")
    parser.add_argument("--requirements", default=os.path.join(ROOT, "requirements-trainers.txt"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pins = resolve(args.requirements)
    deepspeed = pins.pop("deepspeed")
    # DS_BUILD_OPS=0: a pure-Python wheel, whatever the node's CUDA; --no-build-isolation: its setup.py imports torch
    pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", args.out, f"deepspeed=={deepspeed}",
        env={"DS_BUILD_OPS": "0"})
    version = args.python_version.replace(".", "")
    pip("download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", args.out, "--python-version", version,
        "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS],
        *[f"{name}=={v}" for name, v in sorted(pins.items())])
    wheels = sorted(f for f in os.listdir(args.out) if f.endswith(".whl"))
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in wheels) / 2**20
    print(f"{len(wheels)} wheels ({size:.0f} MiB) in {args.out} for Python {args.python_version}; on the GPU node, "
          f"beside its CUDA build of torch:\n  pip install --no-index --find-links {args.out} -r "
          f"requirements-trainers.txt")


if __name__ == "__main__":
    main()
