"""What Compose would make of a service: its command line, environment and volumes.

- Interpolation (compose-spec "Interpolation"): ``${VAR}``, ``${VAR:-default}``,
  ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``,
  ``$VAR`` and ``$$`` in every string of the file, against the given environment.
- YAML anchors and merge keys (``<<: *orchestrator``) are the YAML loader's.
- ``argv``: ``entrypoint`` (else the image's ENTRYPOINT) then ``command`` (else the image's
  CMD only when ``entrypoint`` is not overridden either), as the Docker engine combines them.
- ``environment``: the image's, then the service's (mapping or list form).
- ``volumes`` (short syntax): a path (``./certs``) is a bind mount of the directory beside
  the file, a name a named volume (one directory, shared by the services that mount it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.pods import Mount

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("named") or match.group("braced")
        op, arg = match.group("op"), match.group("arg") or ""
        current = env.get(name)
        unset_or_empty = current is None or (op is not None and op.startswith(":") and not current)
        if op in (":-", "-"):
            return arg if unset_or_empty else str(current)
        if op in (":?", "?"):
            if unset_or_empty:
                raise AssertionError(f"compose: required variable {name}: {arg}")
            return str(current)
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return current or ""

    return _VAR.sub(one, value)


def load(path: Path, env: dict[str, str]) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return dict(interpolate(data, env))


def service_argv(service: dict[str, Any], entrypoint: list[str], cmd: list[str]) -> list[str]:
    def as_list(value: Any) -> list[str]:
        return [str(v) for v in value] if isinstance(value, list) else str(value).split()

    if "entrypoint" in service:
        head = as_list(service["entrypoint"])
        tail = as_list(service.get("command", []))
    else:
        head = entrypoint
        tail = as_list(service["command"]) if "command" in service else cmd
    return head + tail


def service_env(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        pairs = [item.split("=", 1) for item in raw]
        return {k: v for k, v in pairs}
    return {k: "" if v is None else str(v) for k, v in raw.items()}


def service_mounts(
    service: dict[str, Any], compose_dir: Path, binds: dict[str, Path], named: Path
) -> list[Mount]:
    """``binds`` maps a relative source (``./certs``) to the directory that stands for it."""
    mounts: list[Mount] = []
    for spec in service.get("volumes", []):
        assert isinstance(spec, str), f"long-syntax volume {spec} is not emulated"
        parts = spec.split(":")
        source, target = parts[0], parts[1]
        read_only = len(parts) > 2 and "ro" in parts[2].split(",")
        if source.startswith((".", "/")):
            directory = binds.get(source, (compose_dir / source).resolve())
        else:
            directory = named / source
            directory.mkdir(parents=True, exist_ok=True)
        mounts.append(Mount(target, directory, read_only))
    return mounts


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Each dependency and its condition (the short form means ``service_started``)."""
    raw = service.get("depends_on", {})
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: spec.get("condition", "service_started") for name, spec in raw.items()}
