"""launch/wheelhouse.py's resolution for a GPU node, on the metadata of the packages installed here: the node's
markers (Python, machine), its wheels' platform tags, and the torch floors pip does not enforce."""

import os
import sys
from importlib import metadata

import pytest
from conftest import ROOT
from packaging.requirements import Requirement

sys.path.insert(0, os.path.join(ROOT, "launch"))
import wheelhouse  # noqa: E402  (launch/ is no package)

TRAINERS = wheelhouse.requirement_lines(os.path.join(ROOT, "requirements-trainers.txt"))


def installed_requires() -> dict[str, list[str]]:
    """What pip's report holds for requirements-trainers.txt here: each package of its closure for this Python, with
    its Requires-Dist lines (read from the installed metadata)."""
    requires, todo = {}, [Requirement(line).name for line in TRAINERS]
    while todo:
        name = todo.pop()
        if name in requires:
            continue
        requires[name] = metadata.distribution(name).requires or []
        todo += [r.name for r in map(Requirement, requires[name]) if r.marker is None or r.marker.evaluate(
            {"extra": "torch"}) or r.marker.evaluate({"extra": ""})]
    return requires


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the expected differences are those from Python 3.11")
def test_the_node_s_markers_decide_its_packages_not_this_python_s():
    """pip resolves markers for the Python that runs it: from 3.11, a 3.10 node's wheelhouse lacked tomli
    (huggingface_hub needs it below 3.11) and exceptiongroup (anyio's), and `pip install --no-index` failed there."""
    requires = installed_requires()
    _, missing = wheelhouse.node_packages(requires, TRAINERS, wheelhouse.node_environment("3.10", "aarch64"))
    assert {"tomli", "exceptiongroup"} <= missing, missing
    needed, missing = wheelhouse.node_packages(requires, TRAINERS, wheelhouse.node_environment("3.11", "x86_64"))
    assert not missing and needed == {wheelhouse.canonicalize_name(name) for name in requires}


def test_wheels_for_aarch64_nodes_too():
    """GH200/GB200 nodes are aarch64: the platform tags were x86_64 only, so pip found no wheel for them."""
    for arch in wheelhouse.ARCHES:
        tags = wheelhouse.platforms(arch)
        assert all(tag.endswith("_" + arch) for tag in tags) and f"manylinux2014_{arch}" in tags
        assert "manylinux_2_17_" + arch in tags and "manylinux_2_28_" + arch in tags


def test_the_node_s_torch_is_checked_against_every_torch_floor():
    """transformers asks for torch>=2.5 only under its "torch" extra, which pip does not install with it: a node
    with torch 2.4 installed the wheelhouse cleanly and transformers then found no torch at import."""
    requires = installed_requires()
    environment = wheelhouse.node_environment("3.12", "x86_64")
    needed, _ = wheelhouse.node_packages(requires, TRAINERS, environment)
    floors = wheelhouse.torch_floors(requires, needed, environment)
    assert {"transformers", "accelerate", "peft", "deepspeed"} <= set(floors), floors
    floor = next(spec.version for spec in floors["transformers"] if spec.operator == ">=")
    with pytest.raises(SystemExit, match=rf"^error: the node's torch 2\.4\.1 does not fit: .*transformers needs "
                                         rf"torch>={floor}.*\.$"):
        wheelhouse.check_node_torch(floors, "2.4.1")
    wheelhouse.check_node_torch(floors, f"{floor}.0+cu124")  # a CUDA build at the floor fits
