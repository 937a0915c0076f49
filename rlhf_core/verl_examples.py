"""What ``rlhf config`` says of verl's own example run scripts (docs/verl-examples.md;
``scripts/verl_examples.py`` records their argument lists, ``tests/test_verl_examples.py``
checks each is taken)."""

from __future__ import annotations

from rlhf_core.config import ConfigError, RunConfig, apply_overrides


def examples_text(scripts: dict[str, list[str]], commit: str) -> str:
    """What ``rlhf config`` says of each of verl's example scripts' argument lists (the
    notes it prints, or the one line refusing it), as docs/verl-examples.md lists them."""
    lines = [f"verl {commit[:12]}: {len(scripts)} example scripts", ""]
    for path, arguments in scripts.items():
        notes: list[str] = []
        try:
            apply_overrides(RunConfig(), arguments, notes=notes).validate()
            lines.append(f"{path}: taken ({len(arguments)} arguments, {len(notes)} notes)")
        except ConfigError as exc:
            lines.append(f"{path}: REFUSED: {exc}")
        lines += [f"    note: {note}" for note in notes]
    return "\n".join(lines)
