"""The deployment files of deploy/, read the way their tools read them (for the deploy tests)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE_FILES = [DEPLOY / "compose.yaml", DEPLOY / "compose.postgres.yaml"]
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
UNIT = DEPLOY / "systemd" / "timer.service"
UNIT_ENV = DEPLOY / "systemd" / "timer.env"


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of every instruction, continuation lines joined, comments out."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, rest = whole.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def final_stage(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """The instructions of the last build stage: what the image that runs is made of."""
    instructions = dockerfile_instructions(path)
    start = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[start:]


def build_install(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[list[str]]]:
    """The build stage's ``ENV`` and its ``uv`` commands (those installing Timer)."""
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    environment: dict[str, str] = {}
    commands: list[list[str]] = []
    for keyword, rest in instructions[:last_from]:
        if keyword == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                environment[key] = value
        elif keyword == "RUN" and rest.startswith("uv "):
            commands.append(shlex.split(rest))
    return environment, commands


def image_environment(path: Path = DOCKERFILE) -> dict[str, str]:
    """The ``ENV`` variables the runtime image sets (``KEY=value`` form)."""
    environment: dict[str, str] = {}
    for keyword, rest in final_stage(path):
        if keyword == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                environment[key] = value
    return environment


def image_command(path: Path = DOCKERFILE) -> list[str]:
    """ENTRYPOINT + CMD of the runtime image (exec form, as JSON arrays)."""
    stage = dict(final_stage(path))
    return [*json.loads(stage["ENTRYPOINT"]), *json.loads(stage.get("CMD", "[]"))]


def image_healthcheck(path: Path = DOCKERFILE) -> list[str]:
    """The exec-form command of the image's ``HEALTHCHECK``."""
    rest = dict(final_stage(path))["HEALTHCHECK"]
    return list(json.loads(rest[rest.index("CMD") + len("CMD") :].strip()))


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every YAML document of the file (anchors and merge keys resolved)."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def timer_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The compose services that run the Timer image."""
    return {
        name: service
        for name, service in compose["services"].items()
        if service.get("image", "").startswith("timer-service")
    }


def compose_schema_errors(path: Path) -> str:
    """What the Compose specification's JSON schema (as shipped by ``check-jsonschema``, a dev
    dependency) finds wrong with the file; empty when it conforms."""
    command = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    result = subprocess.run(
        [*command, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return "" if result.returncode == 0 else (result.stdout + result.stderr).strip()


def compose_reference_errors(compose: dict[str, Any]) -> list[str]:
    """Names a compose file uses but does not define (what ``docker compose config`` checks
    beyond the schema): services in ``depends_on``, named volumes, networks."""
    services = compose.get("services", {})
    volumes, networks = compose.get("volumes") or {}, compose.get("networks") or {}
    errors: list[str] = []
    for name, service in services.items():
        for other in service.get("depends_on", []):  # a list, or a mapping of conditions
            if other not in services:
                errors.append(f"service {name!r} depends on undefined service {other!r}")
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):  # long syntax
                source = volume.get("source", "") if volume.get("type") == "volume" else ""
            else:  # SOURCE:TARGET[:MODE]; a lone TARGET is an anonymous volume
                source = volume.split(":")[0] if ":" in volume else ""
            named = source and not source.startswith((".", "/", "~", "$"))
            if named and source not in volumes:
                errors.append(f"service {name!r} mounts undefined volume {source!r}")
        for network in service.get("networks", []):
            if network not in networks and network != "default":
                errors.append(f"service {name!r} joins undefined network {network!r}")
    return errors


def unit_sections(path: Path = UNIT) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (a key may repeat) of a systemd unit file."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def env_file(path: Path = UNIT_ENV) -> dict[str, str]:
    """``KEY=value`` lines of an environment file (comments and blank lines skipped)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values
