"""verl's own example run scripts: each one's argument list, as the user's shell expands
it, is taken by ``rlhf config`` (recorded from verl's examples/ by
``scripts/verl_examples.py``; see docs/verl-examples.md for the notes each prints)."""

import json
from pathlib import Path

import pytest

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.verl_examples import examples_text

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "data" / "verl_examples.json").read_text())
SCRIPTS = RECORDED["scripts"]


def test_the_recorded_set_is_verls_fsdp_vllm_text_scripts():
    assert len(SCRIPTS) == 40, sorted(SCRIPTS)
    assert all(path.startswith("examples/") and path.endswith(".sh") for path in SCRIPTS)
    assert all(len(args) >= 4 and args[0] for args in SCRIPTS.values())


@pytest.mark.parametrize("path", sorted(SCRIPTS))
def test_each_example_script_is_taken_whole(path):
    notes: list[str] = []
    cfg = apply_overrides(RunConfig(), SCRIPTS[path], notes=notes).validate()
    keys = {arg.split("=", 1)[0].lstrip("+") for arg in SCRIPTS[path] if "=" in arg}
    assert cfg.to_dict() != RunConfig().to_dict()
    # every note names a key the script set, or the empty argument it passed
    assert all(note.split("=", 1)[0] in keys or note.startswith("an empty argument") for note in notes), notes


def test_docs_list_what_rlhf_config_says_of_each():
    doc = (ROOT / "docs" / "verl-examples.md").read_text()
    listing = doc.split("```text\n", 1)[1].split("\n```", 1)[0]
    assert listing == examples_text(SCRIPTS, RECORDED["verl_commit"]), \
        "docs/verl-examples.md is stale: python scripts/verl_examples.py --doc-only"
