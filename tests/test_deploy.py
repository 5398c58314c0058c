"""docker-compose.yml and deploy/ refer only to things that exist: no Docker daemon runs
here, so the files are read and cross-checked instead of started.

Each service's command is parsed by the `tokenq` command's own parser; Prometheus scrapes
services of the compose file on the ports their commands serve; every file a service
mounts is in the repository; Grafana's datasource is the Prometheus service, its dashboard
provider reads the mounted folder, and every metric the dashboard queries is one the code
defines."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenq.cli import dispatch as cli
from tokenq.cli import serve as serve_cli
from tokenq.cli import worker as worker_cli
from tokenq.engine.outputs import EngineStats
from tokenq.ops.fleet import FLEET_METRICS
from tokenq.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
# The port each service serves, from the flag of its command that sets it.
PORT_FLAGS = {"worker": "--metrics-port", "exporter": "--port", "serve": "--port"}


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short syntax."""
    return [tuple(v.split(":")[:2]) for v in service.get("volumes", [])]  # type: ignore[misc]


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def served_port(service: str) -> int:
    """The port a tokenq service listens on, as its command says."""
    command = SERVICES[service]["command"]
    port = flag(command, PORT_FLAGS[command[0]])
    assert port is not None, f"{service}: {command} sets no port"
    return int(port)


def known(command: str) -> bool:
    """Whether the `tokenq` command has this subcommand: its --help exits with 0."""
    quiet = io.StringIO()
    with pytest.raises(SystemExit) as exited, redirect_stdout(quiet), redirect_stderr(quiet):
        cli.build_parser().parse_args([command, "--help"])
    return exited.value.code == 0


def test_every_tokenq_command_in_the_compose_file_parses() -> None:
    checked = set()
    for name, service in SERVICES.items():
        if "build" not in service:
            continue
        assert (ROOT / service["build"] / "Dockerfile").is_file()
        command = service["command"]
        if command[0] in cli.WORKER_COMMANDS:
            worker_cli.build_parser().parse_args(command)
        elif command[0] == "serve":  # parsed once the command runs (tokenq/cli/serve.py)
            serve_cli.serve_parser().parse_args(command[1:])
        else:
            assert known(command[0]), f"{name}: unknown tokenq command {command[0]}"
            cli.build_parser().parse_args(command)
        checked.add(command[0])
    assert checked == {"worker", "serve"}


def test_the_image_installs_what_each_command_needs() -> None:
    """`tokenq worker` needs the worker extra (torch), `tokenq serve` the serve extra
    (FastAPI, uvicorn): the services built from the Dockerfile run both."""
    (extras,) = re.findall(r"pip install '\.\[([a-z,]+)\]'", (ROOT / "Dockerfile").read_text())
    needed = {"worker": "worker", "serve": "serve"}
    for name, service in SERVICES.items():
        if "build" in service and service["command"][0] in needed:
            assert needed[service["command"][0]] in extras.split(","), name


def test_services_volumes_and_dependencies_exist() -> None:
    assert set(SERVICES) == {"redis", "worker", "gateway", "prometheus", "grafana"}
    assert "--appendonly" in SERVICES["redis"]["command"]
    assert flag(SERVICES["redis"]["command"], "--appendonly") == "yes"
    assert SERVICES["worker"]["deploy"]["replicas"] >= 2
    declared = set(COMPOSE.get("volumes") or {})
    for name, service in SERVICES.items():
        for dep in service.get("depends_on", []):
            assert dep in SERVICES, f"{name} depends on a missing service {dep}"
        for source, _ in mounts(service):
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts a missing {source}"
            else:
                assert source in declared, f"{name} uses an undeclared volume {source}"
        for env in service.get("environment", {}).values():
            if isinstance(env, str) and env.startswith("redis://"):
                assert env.split("//")[1].split(":")[0] == "redis"


def test_prometheus_scrapes_services_on_the_ports_they_serve() -> None:
    targets: dict[str, int] = {}
    for job in PROMETHEUS["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.split(":")
                targets[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A"
            for host in dns["names"]:
                targets[host] = int(dns["port"])
    assert set(targets) == {"worker", "gateway"}
    for host, port in targets.items():
        assert host in SERVICES
        assert port == served_port(host), host
    prometheus = SERVICES["prometheus"]
    (config,) = [t for s, t in mounts(prometheus) if s == "./deploy/prometheus.yml"]
    assert f"--config.file={config}" in prometheus["command"]


def grafana_files() -> dict[str, Path]:
    """Container path -> repository path of each folder Grafana mounts from the repo."""
    return {t: ROOT / s for s, t in mounts(SERVICES["grafana"]) if s.startswith(".")}


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard() -> None:
    folders = grafana_files()
    provisioning = folders["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    match = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"])
    assert match is not None, source["url"]
    host, port = match.groups()
    assert host in SERVICES and f"{port}:{port}" in SERVICES[host]["ports"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "tokenq.yml").read_text())[
        "providers"
    ]
    dashboards = folders[provider["options"]["path"]]
    (dashboard,) = [json.loads(p.read_text()) for p in dashboards.glob("*.json")]
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).name).is_file()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]


def defined_metrics() -> set[str]:
    """Every sample name the code exposes: a worker's registry and the fleet's gauges."""
    stats = EngineStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=1, num_blocks=1
    )
    names = set(FLEET_METRICS)
    for family in WorkerMetrics("m", lambda: stats).registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        for suffix in suffixes.get(family.type, [""]):
            names.add(family.name + suffix)
    return names


@pytest.mark.parametrize(
    "needed",
    [
        "tokenq:generation_tokens_total",  # tokens/s
        "tokenq:time_to_first_token_seconds_bucket",  # TTFT
        "tokenq:queue_waiting",  # queue depth per lane
        "tokenq:num_requests_running",
        "tokenq:num_requests_waiting",
        "tokenq:kv_cache_usage_perc",
        "tokenq:dead_letters",
    ],
)
def test_the_dashboard_queries_only_metrics_the_code_defines(needed: str) -> None:
    (path,) = (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")
    exprs = [t["expr"] for p in json.loads(path.read_text())["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"tokenq:[A-Za-z0-9_:]+", expr)}
    assert used <= defined_metrics(), used - defined_metrics()
    assert needed in used
