"""The argument lists of verl's example run scripts, as the user's shell expands them.

    python scripts/verl_examples.py VERL_CHECKOUT [--commit SHA]   # record, then write the doc
    python scripts/verl_examples.py --doc-only                      # the doc, from the recording

Also records verl's fully-async scripts (``verl/experimental/fully_async_policy/shell/*.sh``
calling ``verl.experimental.fully_async_policy.fully_async_main``, the same engines left
out) under ``"fully_async_scripts"``: here they run as ``rlhf run --direct
async_training.enable=true`` with the same arguments.

Selects every ``examples/**/*.sh`` of a verl checkout that calls ``verl.trainer.main_ppo``,
leaving out scripts for engines and hardware this trainer does not run (Megatron, SGLang,
NPUs, TensorRT-LLM, vision models, profiling, Slurm), and runs each with ``bash`` and a
stand-in ``python3`` on PATH that records its arguments (stand-ins for the other tools the
scripts call do nothing). What ``python3 -m verl.trainer.main_ppo`` would have received is
written as JSON: ``{"verl_commit": ..., "scripts": {path: [arg, ...]}, "ppo_trainer_yaml": [key=value,
...]}`` (the last: verl's trainer config with every default, flattened).
``tests/test_verl_examples.py`` reads that file (the test suite needs no verl checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

#: verl's example scripts for what this trainer does not run (path, case-insensitive).
LEFT_OUT_PATHS = re.compile(r"megatron|npu|sglang|sgl_|trtllm|_vl|vl-|vl_|glm41v|minicpmo|mimo|router_replay|slurm|"
                            r"nsys|prof", re.I)
LEFT_OUT_TEXT = re.compile(r"megatron|sglang", re.I)
ENTRY = "verl.trainer.main_ppo"
#: verl's fully-async entry point and where its scripts are.
ASYNC_ENTRY = "verl.experimental.fully_async_policy.fully_async_main"
ASYNC_SHELL = "verl/experimental/fully_async_policy/shell"
#: verl's trainer config with every default, as its trainer writes it.
TRAINER_YAML = "verl/trainer/config/_generated_ppo_trainer.yaml"
#: Opens the generated listing in docs/verl-examples.md (everything above it is prose).
FENCE = "```text"
#: Tools the scripts call besides python3; their stand-ins do nothing and succeed.
QUIET_TOOLS = ("python", "huggingface-cli", "hf", "nvidia-smi", "modelscope", "wget", "pip", "pip3", "ray", "git",
               "conda", "ls", "mkdir")

#: What a job launcher sets (one script reads Slurm's node count under ``set -u``).
LAUNCHER_ENV = {"SLURM_JOB_NUM_NODES": "1"}
#: ``$HOME`` in the recorded arguments.
HOME = "/home/user"

RECORDER = """#!/bin/bash
# stand-in python3: records the arguments of `python3 -m {entry} ...`, does nothing else
for ((i = 1; i < $#; i++)); do
  if [ "${{!i}}" = "-m" ]; then
    j=$((i + 1))
    if [ "${{!j}}" = "{entry}" ]; then
      "{python}" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${{@:$((j + 1))}}" >> "$VERL_ARGS_OUT"
    fi
  fi
done
exit 0
"""


def selected(root: pathlib.Path) -> list[str]:
    """The scripts' paths relative to the checkout, sorted."""
    chosen = []
    for path in sorted((root / "examples").rglob("*.sh")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(errors="replace")
        if ENTRY in text and not LEFT_OUT_PATHS.search(rel) and not LEFT_OUT_TEXT.search(text):
            chosen.append(rel)
    return chosen


def selected_fully_async(root: pathlib.Path) -> list[str]:
    """verl's fully-async scripts for the engines this trainer runs, sorted."""
    return [path.relative_to(root).as_posix() for path in sorted((root / ASYNC_SHELL).glob("*.sh"))
            # by name only: each says "sglang or vllm" beside its choice of vllm
            if ASYNC_ENTRY in path.read_text(errors="replace") and not LEFT_OUT_PATHS.search(path.name)]


def arguments(root: pathlib.Path, rel: str, entry: str = ENTRY) -> list[str]:
    """What the script passes to ``python3 -m <entry>`` (its first call; ``python`` and a
    ``ray job submit`` of it too)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        recorders = ("python3", "python", "ray")  # ray: `ray job submit ... -- python3 -m <entry> ...`
        for name in recorders:
            (bin_dir / name).write_text(RECORDER.format(entry=entry, python=sys.executable))
        for tool in QUIET_TOOLS:
            if tool not in recorders:
                (bin_dir / tool).write_text("#!/bin/bash\nexit 0\n")
        for stand_in in bin_dir.iterdir():
            stand_in.chmod(0o755)
        out = tmp / "args.jsonl"
        home = tmp / "home"
        home.mkdir()
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home), "VERL_ARGS_OUT": str(out),
               **LAUNCHER_ENV}
        # from a scratch home: a script may write where it runs
        run = subprocess.run(["bash", str(root / rel)], cwd=str(home), env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60)
        if not out.exists():
            raise SystemExit(f"{rel}: python3 -m {entry} was never called (exit {run.returncode}: "
                             f"{run.stderr.strip().splitlines()[-1:]})")
        # the scripts' $HOME paths as a user's home would give them, not this scratch folder
        return [arg.replace(str(home), HOME) for arg in json.loads(out.read_text().splitlines()[0])]


def trainer_yaml_items(root: pathlib.Path) -> list[str]:
    """verl's whole trainer config as its trainer writes it (every default), flattened to
    ``key=value`` items, interpolations left as written."""
    import yaml

    from rlhf_core.verl_keys import flatten

    return flatten(yaml.safe_load((root / TRAINER_YAML).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=pathlib.Path, nargs="?", help="a verl checkout (its work tree)")
    parser.add_argument("--doc-only", action="store_true", help="only write --doc from the recorded --out file")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("tests/data/verl_examples.json"))
    parser.add_argument("--doc", type=pathlib.Path, default=pathlib.Path("docs/verl-examples.md"),
                        help="where to write what `rlhf config` says of each (from --out's file)")
    parser.add_argument("--commit", help="the checkout's verl commit (default: git rev-parse HEAD in it)")
    args = parser.parse_args()
    if args.doc_only or args.checkout is None:
        write_doc(args.out, args.doc)
        return
    commit = args.commit or subprocess.run(["git", "-C", str(args.checkout), "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or "unknown"
    scripts = {rel: arguments(args.checkout, rel) for rel in selected(args.checkout)}
    fully_async = {rel: arguments(args.checkout, rel, ASYNC_ENTRY) for rel in selected_fully_async(args.checkout)}
    args.out.write_text(json.dumps({"verl_commit": commit, "scripts": scripts,
                                    "ppo_trainer_yaml": trainer_yaml_items(args.checkout),
                                    "fully_async_scripts": fully_async}, indent=1) + "\n")
    print(f"{len(scripts)} scripts -> {args.out}")
    write_doc(args.out, args.doc)


def write_doc(recorded: pathlib.Path, doc: pathlib.Path) -> None:
    """docs/verl-examples.md: its prose kept, its listing made anew from ``recorded``."""
    from rlhf_core.verl_examples import examples_text

    data = json.loads(recorded.read_text())
    head = doc.read_text().split(FENCE, 1)[0] if doc.exists() else "# verl's example scripts here\n\n"
    doc.write_text(f"{head}{FENCE}\n{examples_text(data['scripts'], data['verl_commit'])}\n```\n")
    print(f"-> {doc}")


if __name__ == "__main__":
    main()
