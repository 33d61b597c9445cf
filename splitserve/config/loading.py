"""Reading a config: a YAML file or a parsed mapping to a `ClusterConfig`, or one `ConfigError`
that names the source, each offending key (as a dotted path) and what is wrong with it."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from splitserve.config.cluster import ClusterConfig


class ConfigError(ValueError):
    """A config file that cannot be served: the message names the file, the key and the fix."""


def default_config() -> ClusterConfig:
    """The embedded default: the tiny model, one prefill and one decode worker on CPUs."""
    return ClusterConfig()


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate one YAML file; raise `ConfigError` naming the file, key and problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (got {type(data).__name__})")
    return parse_config(data, source=str(path))


def parse_config(data: dict[str, Any], *, source: str = "<config>") -> ClusterConfig:
    """Validate an already-parsed mapping; errors are reported as coming from `source`."""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(error) for error in exc.errors()]
        if len(problems) == 1:
            raise ConfigError(f"{source}: {problems[0]}") from None
        listing = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"{source}: {len(problems)} problems:\n{listing}") from None


def with_gateway_address(config: ClusterConfig, *, host: str | None, port: int | None) -> ClusterConfig:
    """A validated copy of `config` whose gateway listens at `host`/`port` (None keeps the config's)."""
    if host is None and port is None:
        return config
    data = config.model_dump(mode="json")
    data["gateway"].update({k: v for k, v in (("host", host), ("port", port)) if v is not None})
    return parse_config(data, source="--host/--port")


def _describe(error: Any) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(part) for part in loc)
    if error["type"] == "extra_forbidden":
        known = _known_keys(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        return f"{key}: unknown key ({hint})"
    if error["type"] == "value_error":
        message = str(error["ctx"]["error"])
        return f"{key}: {message}" if key else message
    return f"{key}: {error['msg']} (got {error['input']!r})"


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = ClusterConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
