"""The deployment files in deploy/ are checked against their formats (the Compose
specification's schema, pip-installed; ``systemd-analyze verify`` where the OS has it) and
structurally against the service's real settings, port and health path; the image's entry
command is run for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.files import (
    COMPOSE_FILES,
    DEPLOY,
    DOCKERFILE,
    MANIFESTS,
    ROOT,
    UNIT,
    UNIT_ENV,
    build_install,
    compose_reference_errors,
    compose_schema_errors,
    dockerfile_instructions,
    env_file,
    final_stage,
    image_command,
    image_environment,
    image_healthcheck,
    load_yaml_documents,
    timer_services,
    unit_sections,
)
from tests.timer_service.process import ServiceProcess, free_port
from tests.tools import require_tool
from timer_adapters_nats.embedded import NatsServerProcess
from timer_service.app import HEALTHY_POLL_AGE_S
from timer_service.settings import ENVIRONMENT, Settings

IMAGE_ENV = image_environment()
HTTP_PORT = int(IMAGE_ENV["TIMER_HTTP_PORT"])


def _settings(environment: dict[str, str]) -> Settings:
    """The settings the service would start with in that environment (raises if invalid)."""
    unknown = sorted(k for k in environment if k.startswith("TIMER_") and k not in ENVIRONMENT)
    assert unknown == [], f"not settings the service reads: {unknown}"
    return Settings.from_environment({k: v for k, v in environment.items() if k != "PATH"})


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


class TestImage:
    def test_image_runs_the_service_with_valid_settings(self) -> None:
        """The image's entry command is ``timer-service run`` and its ENV is valid settings."""
        assert image_command() == ["timer-service", "run"]
        settings = _settings(IMAGE_ENV)
        assert settings.http_host == "0.0.0.0"
        assert str(settings.db_path).startswith("/var/lib/timer/")

    def test_image_exposes_the_health_port_and_keeps_the_database_in_its_volume(self) -> None:
        """EXPOSE is the HTTP port, VOLUME holds the database, the healthcheck probes /healthz."""
        stage = dict(final_stage())
        assert stage["EXPOSE"] == str(HTTP_PORT)
        assert stage["VOLUME"] == str(Path(IMAGE_ENV["TIMER_DB_PATH"]).parent)
        assert f"127.0.0.1:{HTTP_PORT}/healthz" in " ".join(image_healthcheck())
        assert stage["USER"] != "root"

    def test_image_installs_from_the_locked_checkout(self) -> None:
        """The build installs the workspace's timer-service with the versions of uv.lock."""
        runs = " ".join(rest for keyword, rest in dockerfile_instructions() if keyword == "RUN")
        assert "uv sync --locked" in runs
        assert "--package timer-service" in runs


class TestCompose:
    @pytest.mark.parametrize("path", COMPOSE_FILES, ids=_name)
    def test_the_file_follows_the_compose_specification(self, path: Path) -> None:
        """The file validates against the Compose specification's schema and every service,
        volume and network it names is defined (what ``docker compose config`` checks)."""
        assert compose_schema_errors(path) == ""
        (compose,) = load_yaml_documents(path)
        assert compose_reference_errors(compose) == []

    def test_a_broken_compose_file_is_refused(self, tmp_path: Path) -> None:
        """The check refuses a file with a misspelt key, a wrong type, a dependency on a
        service that is not there and an undeclared volume, naming each."""
        broken = tmp_path / "compose.yaml"
        broken.write_text(
            "services:\n"
            "  timer:\n"
            "    image: timer-service:latest\n"
            "    ports: 8080\n"
            "    helthcheck: {test: [CMD, 'true']}\n"
            "    depends_on: {nats: {condition: service_healthy}}\n"
            "    volumes: [timer-data:/var/lib/timer]\n"
        )
        errors = compose_schema_errors(broken)
        assert "ports: 8080 is not of type 'array'" in errors
        assert "'helthcheck'" in errors
        (compose,) = load_yaml_documents(broken)
        assert compose_reference_errors(compose) == [
            "service 'timer' depends on undefined service 'nats'",
            "service 'timer' mounts undefined volume 'timer-data'",
        ]

    @pytest.mark.parametrize("path", COMPOSE_FILES, ids=_name)
    def test_timer_services_start_with_valid_settings(self, path: Path) -> None:
        """Each Timer service, image ENV plus its own environment, is a valid configuration
        reaching the compose file's NATS, publishing the health port, waiting for NATS healthy."""
        (compose,) = load_yaml_documents(path)
        services = timer_services(compose)
        assert services
        for name, service in services.items():
            environment = {**IMAGE_ENV, **{k: str(v) for k, v in service["environment"].items()}}
            settings = _settings(environment)
            assert settings.broker_url == "nats://nats:4222", name
            assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
            assert any(str(p).endswith(f":{settings.http_port}") for p in service["ports"]), name
            assert service["depends_on"]["nats"]["condition"] == "service_healthy"
            assert "healthcheck" in compose["services"]["nats"]

    def test_sqlite_compose_keeps_the_database_on_a_volume(self) -> None:
        """The single-instance file runs one Timer whose database directory is a named volume."""
        (compose,) = load_yaml_documents(DEPLOY / "compose.yaml")
        (service,) = timer_services(compose).values()
        settings = _settings({**IMAGE_ENV, **service["environment"]})
        assert settings.database_url is None
        mounts = dict(volume.split(":", 1) for volume in service["volumes"])
        assert mounts.get("timer-data") == str(settings.db_path.parent)
        assert "timer-data" in compose["volumes"]

    def test_postgres_compose_runs_three_instances_on_one_database(self) -> None:
        """Three Timer instances, each with its own instance id, all on the PostgreSQL service."""
        (compose,) = load_yaml_documents(DEPLOY / "compose.postgres.yaml")
        services = timer_services(compose)
        settings = [
            _settings({**IMAGE_ENV, **{k: str(v) for k, v in s["environment"].items()}})
            for s in services.values()
        ]
        assert len(settings) == 3
        assert len({s.owner_id for s in settings}) == 3
        assert all(s.database_url and "@postgres:5432/" in s.database_url for s in settings)
        assert all(
            s["depends_on"]["postgres"]["condition"] == "service_healthy" for s in services.values()
        )
        assert "healthcheck" in compose["services"]["postgres"]


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", []))


class TestKubernetes:
    @pytest.mark.parametrize("path", MANIFESTS, ids=_name)
    def test_probes_hit_the_health_endpoint_on_the_service_port(self, path: Path) -> None:
        """Every Timer container has readiness and liveness probes on GET /healthz at the port
        the service listens on (its configured TIMER_HTTP_PORT)."""
        documents = load_yaml_documents(path)
        config = {d["metadata"]["name"]: d["data"] for d in documents if d["kind"] == "ConfigMap"}
        workloads = [d for d in documents if d["kind"] in ("Deployment", "StatefulSet")]
        assert workloads
        for workload in workloads:
            for container in _containers(workload):
                environment = dict(IMAGE_ENV)
                for source in container.get("envFrom", []):
                    environment.update(config[source["configMapRef"]["name"]])
                for variable in container.get("env", []):
                    # Values from secrets or the pod's name: a plausible stand-in of each kind.
                    value = variable.get("value")
                    if value is None and "secretKeyRef" in variable.get("valueFrom", {}):
                        value = "postgresql://timer:secret@db:5432/timer"
                    environment[variable["name"]] = value or "timer-postgres-7d9f-abcde"
                settings = _settings(environment)
                ports = {port["name"]: port["containerPort"] for port in container["ports"]}
                for probe in ("readinessProbe", "livenessProbe"):
                    get = container[probe]["httpGet"]
                    assert get["path"] == "/healthz"
                    assert ports.get(get["port"], get["port"]) == settings.http_port

    @pytest.mark.parametrize("path", MANIFESTS, ids=_name)
    def test_liveness_allows_minutes_readiness_reacts_within_the_health_window(
        self, path: Path
    ) -> None:
        """Liveness tolerates failing health for minutes (the service recovers by itself);
        readiness drops the pod within seconds of /healthz turning 503."""
        for workload in load_yaml_documents(path):
            for container in _containers(workload):
                live, ready = container["livenessProbe"], container["readinessProbe"]
                assert live["periodSeconds"] * live["failureThreshold"] >= 4 * HEALTHY_POLL_AGE_S
                assert ready["periodSeconds"] * ready["failureThreshold"] <= HEALTHY_POLL_AGE_S

    def test_sqlite_workload_is_one_replica_with_its_own_volume(self) -> None:
        """SQLite is one writer per file: one replica, the database on its claimed volume."""
        (workload,) = [
            d
            for d in load_yaml_documents(DEPLOY / "kubernetes" / "sqlite.yaml")
            if d["kind"] == "StatefulSet"
        ]
        assert workload["spec"]["replicas"] == 1
        (container,) = _containers(workload)
        (mount,) = container["volumeMounts"]
        claims = [t["metadata"]["name"] for t in workload["spec"]["volumeClaimTemplates"]]
        assert mount["name"] in claims
        assert mount["mountPath"] == str(Path(IMAGE_ENV["TIMER_DB_PATH"]).parent)


class TestSystemdUnit:
    @pytest.mark.os_tool
    def test_systemd_analyze_verifies_the_unit(self, tmp_path: Path) -> None:
        """``systemd-analyze verify`` accepts the unit (its binary pointed at this checkout's)."""
        binary = Path(sys.executable).parent / "timer-service"
        unit = tmp_path / "timer.service"
        unit.write_text(UNIT.read_text().replace("/opt/timer/bin/timer-service", str(binary)))
        result = subprocess.run(
            [require_tool("systemd-analyze", "apt-get install -y systemd"), "verify", str(unit)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert result.stderr.strip() == "", result.stderr

    def test_unit_runs_the_service_with_valid_settings_and_stops_it_gracefully(self) -> None:
        """ExecStart is ``timer-service run``; its environment file and variables are valid
        settings; it stops with SIGTERM and does not restart on a configuration error."""
        service = unit_sections()["Service"]
        assert service["ExecStart"] == ["/opt/timer/bin/timer-service run"]
        assert service["KillSignal"] == ["SIGTERM"]
        assert service["RestartPreventExitStatus"] == ["2"]
        environment = env_file()
        for assignment in service.get("Environment", []):
            key, _, value = assignment.partition("=")
            environment[key] = value
        settings = _settings(environment)
        assert str(settings.db_path.parent) == "/var/lib/" + service["StateDirectory"][0]


class TestEntryCommand:
    def test_the_image_command_runs_healthy_and_stops_cleanly(
        self, tmp_path: Path, nats_server: NatsServerProcess
    ) -> None:
        """The image's build command installs timer-service from this checkout into a fresh
        environment; its ENTRYPOINT + CMD from there, with the image's environment (paths and
        port moved into this test's directory and loopback, NATS as compose gives it), reaches
        a healthy /healthz, passes the image's own HEALTHCHECK, and exits 0 on SIGTERM."""
        build_env, installs = build_install()
        image = tmp_path / "opt-timer"
        assert installs, "the Dockerfile installs nothing with uv"
        for command in installs:
            done = subprocess.run(
                command,
                cwd=ROOT,  # the build context: COPY . .
                env={**os.environ, **build_env, "UV_PROJECT_ENVIRONMENT": str(image)},
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, done.stderr
        environment = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        environment.update({k: v for k, v in IMAGE_ENV.items() if k != "PATH"})
        environment.update(
            TIMER_DB_PATH=str(tmp_path / "timer.db"),
            TIMER_HTTP_HOST="127.0.0.1",
            TIMER_HTTP_PORT=str(free_port()),
            TIMER_BROKER_URL=nats_server.url,
        )
        program, *arguments = image_command()
        command = [str(image / "bin" / program), *arguments]
        service = ServiceProcess(environment, tmp_path, tmp_path / "service.log", command)
        try:
            # The budget covers a cold start on a busy machine.
            service.start().wait_healthy(timeout=60)
            check = [
                str(image / "bin" / "python")
                if part == "python"
                else part.replace(str(HTTP_PORT), str(service.http_port))
                for part in image_healthcheck()
            ]
            assert subprocess.run(check, timeout=30).returncode == 0
            assert service.terminate(timeout=60) == 0, service.log()
        finally:
            service.kill_group()


class TestDeploymentPage:
    def test_every_deployment_file_is_included_in_the_docs(self) -> None:
        """Each file of deploy/ is shown in a docs page by inclusion from the repository (no
        copies) or linked for download from it (the site serves deploy/ as it is); the image,
        compose, Kubernetes and systemd files included on the Deployment page."""
        pages = "".join(page.read_text() for page in (ROOT / "docs").glob("*.md"))
        deployment = (ROOT / "docs" / "deployment.md").read_text()
        files = sorted(p for p in DEPLOY.rglob("*") if p.is_file())
        assert files
        missing = [
            _name(p)
            for p in files
            if f'--8<-- "{_name(p)}"' not in pages and f"]({_name(p)})" not in pages
        ]
        assert missing == []
        ours = [DOCKERFILE, *COMPOSE_FILES, *MANIFESTS, UNIT, UNIT_ENV]
        assert [_name(p) for p in ours if f'--8<-- "{_name(p)}"' not in deployment] == []
