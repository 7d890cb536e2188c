"""Reading a recipe (TOML, ``base =`` includes), dotted overrides, validation into a :class:`Config`
with messages that name the key, and writing the resolved config back as TOML.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ValidationError

from posttrain.config.moved import MOVED_KEYS
from posttrain.config.root import Config
from posttrain.errors import ConfigError
from posttrain.plugins import import_plugins, resolve


def _check_keys(model: type[BaseModel], data: object, prefix: str) -> None:
    """Reject unknown keys with the list of valid ones (pydantic only says 'extra inputs')."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in MOVED_KEYS:
            raise ConfigError(f"{dotted!r} has moved: use {MOVED_KEYS[dotted]}")
        if key not in fields:
            raise ConfigError(f"unknown key {dotted!r}; valid keys here: {sorted(fields)}")
        ann = fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _check_keys(ann, value, dotted + ".")
        elif getattr(ann, "__origin__", None) is list and isinstance(value, list):
            (inner,) = ann.__args__
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                for i, item in enumerate(value):
                    _check_keys(inner, item, f"{dotted}[{i}].")


def _parse_value(text: str) -> object:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: algorithm.loss=cispo


def apply_override(data: dict, override: str) -> None:
    """Apply one ``dotted.key=value`` override in place (value parsed as TOML, else a string)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
    node[parts[-1]] = _parse_value(text.strip())


def _format_validation(err: ValidationError, data: dict) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        given = f" (got {e['input']!r})" if loc and not isinstance(e.get("input"), dict) else ""
        lines.append(f"{loc + ': ' if loc else ''}{msg}{given}")
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict) -> Config:
    """Validate a plain dict (as read from TOML) into a :class:`Config`; its ``plugins`` are imported first
    (files still relative are taken from the working directory) and kept as absolute paths.
    """
    plugins = data.get("plugins", [])
    if not isinstance(plugins, list):
        raise ConfigError(f"plugins: expected a list of .py files or module names, got {plugins!r}")
    if plugins:
        data = {**data, "plugins": import_plugins(plugins)}
    _check_keys(Config, data, "")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, data)) from None


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        # sections merge; an entry's parameters (`*_params`) belong to the entry and are replaced whole
        mergeable = isinstance(v, dict) and isinstance(out.get(k), dict) and not k.endswith("params")
        out[k] = _deep_merge(out[k], v) if mergeable else v
    return out


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a TOML recipe; a top-level ``base = "other.toml"`` (relative to the recipe) is read
    first and this recipe's keys are merged over it, so presets state only what they change.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"recipe {str(p)!r} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"recipe {str(p)!r} includes itself through `base`")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {str(p)!r} is not valid TOML: {e}") from None
    if isinstance(data.get("plugins"), list):  # files are relative to the recipe that names them
        data["plugins"] = resolve(data["plugins"], p.parent)
    base = data.pop("base", None)
    if base is None:
        return data
    below = read_recipe(p.parent / str(base), (*_seen, p.resolve()))
    merged = _deep_merge(below, data)
    if isinstance(data.get("plugins"), list) and isinstance(below.get("plugins"), list):
        merged["plugins"] = resolve([*below["plugins"], *data["plugins"]])  # the base's names stay known
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML recipe (or the defaults when ``path`` is None) and apply dotted overrides."""
    data: dict = read_recipe(path) if path is not None else {}
    for o in overrides:
        apply_override(data, o)
    return config_from_dict(data)


def dump_toml(cfg: Config) -> str:
    """Write a config as TOML (the resolved config saved in every run directory)."""
    return _to_toml(cfg.model_dump(mode="json"))


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_fmt(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _to_toml(data: dict, prefix: str = "") -> str:
    # sub-sections become [tables]; parameter dicts (keys ending in "params") stay inline
    flat, tables, arrays = [], [], []
    for k, v in data.items():
        if v is None:
            continue
        if isinstance(v, dict) and not k.endswith("params"):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            flat.append(f"{k} = {_fmt(v)}")
    out = "\n".join(flat) + ("\n" if flat else "")
    for k, v in tables:
        out += f"\n[{prefix}{k}]\n" + _to_toml(v, f"{prefix}{k}.")
    for k, items in arrays:
        for item in items:
            out += f"\n[[{prefix}{k}]]\n" + _to_toml(item, f"{prefix}{k}.")
    return out
