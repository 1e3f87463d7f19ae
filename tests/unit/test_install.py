"""What installing xsp brings: the CPU install stays lean, the GPU levels come with an extra."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
CUDA_PACKAGES = ("cupti", "nvidia-cuda")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_a_plain_install_pulls_no_cuda_package():
    """``pip install -e .`` on a CPU-only machine: no cupti-python, no nvidia-cuda-cupti (NVTX's
    85 kB library stays: ``xsp.trace(nvtx=True)`` uses it wherever CUDA builds run)."""
    pulled = [requirement for requirement in project()["dependencies"]
              if any(package in requirement.lower() for package in CUDA_PACKAGES)]
    assert pulled == []


def test_the_gpu_levels_come_with_the_extra_of_pytorchs_cuda_and_the_readme_says_so():
    extras = project()["optional-dependencies"]
    assert any(requirement.startswith("cupti-python>=12.6,<13") for requirement in extras["cuda12"])
    assert any(requirement.startswith("cupti-python>=13,<14") for requirement in extras["cuda13"])
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`pip install -e .` installs no CUDA package" in readme and 'pip install "xsp[cuda12]"' in readme


def test_the_gpu_levels_name_the_extra_where_cupti_is_missing():
    from xsp.tracers.cuda.source import probe

    def not_installed() -> object:
        raise ImportError("No module named 'cupti'")

    assert 'pip install "xsp[cuda12]"' in (probe(not_installed) or "")
