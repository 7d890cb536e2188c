"""A user's own code in a run: plugins named by a recipe, and the decorators that register its entries.

A recipe's top-level ``plugins = ["my_rewards.py", "my_pkg.envs"]`` names Python files (relative to the
recipe's folder; anything ending in ``.py`` or holding a ``/``) or importable modules. The config loader
(``config/load.py``) imports them before it validates, so a plugin's reward, estimator or loss names are
known to the validation, and writes their absolute paths into the resolved config, so that a run directory's
``config.toml`` finds them again (``--resume``, ``compare``). Every process that looks entries up by name
imports them too: reward workers are forked after the import (they inherit it), and the learner ranks
(spawned processes or Ray actors) import ``cfg.plugins`` when they start (``learn/distributed/fsdp.py``).

A plugin registers with the decorators exported from ``posttrain`` (``register_reward``, ``register_env``,
``register_task``, ``register_advantage``, ``register_loss``, ``register_shaper``, ...). Each registry
records the plugin an entry came from (``posttrain algorithms`` marks it) and refuses a name that is taken,
naming the built-in it would hide. A plugin that fails to import is a :class:`ConfigError` naming the file
and line of the user's code, raised before any model loads.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import linecache
import sys
import sysconfig
import tomllib
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from posttrain.algorithms.registry import ALL, LOADING, Registry, clash_message, origin_of
from posttrain.errors import ConfigError

T = TypeVar("T")
_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_STDLIB_DIRS = tuple({sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")})
_LOADED: dict[str, str] = {}  # resolved entry -> module name, imported in this process
TASK_ORIGINS: dict[str, str] = {}  # user tasks (the task table is a dict, not a Registry): name -> origin


def is_file_entry(entry: str) -> bool:
    """Whether a ``plugins`` entry names a file (``.py`` or a path) rather than an importable module."""
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def resolve(entries: Iterable[str], base: Path | str | None = None) -> list[str]:
    """The entries with files made absolute (relative ones against ``base``, default the working directory),
    duplicates dropped; a file that does not exist is a :class:`ConfigError` saying where it was looked for.
    """
    root = Path(base) if base is not None else Path.cwd()
    out: list[str] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(f"plugins[{i}]: expected a .py file or a module name, got {entry!r}")
        if is_file_entry(entry):
            path = (root / Path(entry).expanduser()).resolve()
            if not path.is_file():
                raise ConfigError(f"plugins[{i}]: plugin file {entry!r} not found (looked for {path})")
            entry = str(path)
        if entry not in out:
            out.append(entry)
    return out


def recipe_plugins(path: str | Path) -> list[str]:
    """The plugins a recipe and its ``base`` chain name, resolved, read with ``tomllib`` alone: the command line
    imports them (and reports a broken one) before the config's own imports, which take seconds. What this
    cannot read it leaves to ``config/load.py``, which says what is wrong.
    """
    parts: list[list[str]] = []
    p, seen = Path(path), set()
    while p.is_file() and p.resolve() not in seen:
        seen.add(p.resolve())
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
            break
        if isinstance(data.get("plugins"), list):
            parts.insert(0, resolve(data["plugins"], p.parent))
        if "base" not in data:
            break
        p = p.parent / str(data["base"])
    return resolve(e for part in parts for e in part)


def import_plugins(entries: Iterable[str], base: Path | str | None = None) -> list[str]:
    """Import every plugin once per process (again is a no-op) and return the resolved entries.

    Raises:
        ConfigError: a missing file or module, or a plugin whose import raised: the message names the file
            and line of the user's code and the exception, with no traceback to read.

    """
    resolved = resolve(entries, base)
    for entry in resolved:
        if entry not in _LOADED:
            _LOADED[entry] = _import_one(entry)
    return resolved


def loaded_plugins() -> dict[str, str]:
    """The plugins imported in this process so far: resolved entry -> the module name it was imported as."""
    return dict(_LOADED)


def unload_plugins(entries: Iterable[str]) -> None:
    """Forget plugins imported in this process (resolved entries, as :func:`loaded_plugins` names them): every
    entry they registered is removed and a later :func:`import_plugins` runs their module again. For a process
    that loads several recipes in turn (a test session) and must not carry one recipe's entries into the next.
    """
    for entry in entries:
        module = _LOADED.pop(entry, None)
        _forget(entry)
        if module is not None and is_file_entry(entry):
            sys.modules.pop(module, None)


def _module_name(path: Path) -> str:
    """The file's stem when no other module has it (a plugin's functions then read as ``my_rewards.fn``)."""
    taken = sys.modules.get(path.stem)
    if taken is None and path.stem.isidentifier():
        return path.stem
    return f"posttrain_plugin_{path.stem}_{hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()}"


def _import_one(entry: str) -> str:
    LOADING.append(entry)
    try:
        return _run_import(entry)
    except BaseException:
        _forget(entry)  # what it registered before it failed: fixed and imported again, it must not clash
        raise
    finally:
        LOADING.pop()


def _exec(entry: str) -> str:
    """Run the plugin's module (a file under its own module name, or an importable module)."""
    if not is_file_entry(entry):
        importlib.import_module(entry)
        return entry
    path = Path(entry)
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"plugin {entry}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return name


def _forget(origin: str) -> None:
    """Remove every entry that ``origin`` registered."""
    for registry in ALL:
        for name in [n for n in registry.names() if registry.origin(n) == origin]:
            registry.unregister(name)
    from posttrain.tasks import TASKS

    for name in [n for n, o in TASK_ORIGINS.items() if o == origin]:
        TASKS.pop(name, None)
        TASK_ORIGINS.pop(name)


def _run_import(entry: str) -> str:
    """Import one plugin; its failures become a :class:`ConfigError` naming the user's file and line."""
    try:
        return _exec(entry)
    except ConfigError:
        raise
    except ModuleNotFoundError as e:
        if e.name and (entry == e.name or entry.startswith(e.name + ".")):
            raise ConfigError(f"plugin {entry!r}: no module named {e.name!r} (entries ending in .py are files "
                              "relative to the recipe's folder; others are importable module names)") from None
        raise ConfigError(_failure(entry, e)) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the user's module raises is a config error
        raise ConfigError(_failure(entry, e)) from None


def _is_user_frame(filename: str) -> bool:
    return not (filename.startswith(_PACKAGE_DIR) or filename.startswith("<") or filename.startswith(_STDLIB_DIRS))


def _failure(entry: str, error: BaseException) -> str:
    """``plugin X failed to import: FILE:LINE: Type: message`` and the source line, at the user's deepest
    frame (a syntax error at its own file and line).
    """
    if isinstance(error, SyntaxError) and error.filename:
        where, line, code = error.filename, error.lineno or 0, (error.text or "").strip()
        what = f"SyntaxError: {error.msg}"
    else:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if _is_user_frame(f.filename)]
        frame = frames[-1] if frames else None
        where, line = (frame.filename, frame.lineno or 0) if frame else (entry, 0)
        code = (frame.line or "").strip() if frame else ""
        code = code or linecache.getline(where, line).strip()
        what = f"{type(error).__name__}: {error}"
    return f"plugin {entry} failed to import: {where}:{line}: {what}" + (f"\n    {code}" if code else "")


def _registry_decorator(registry: Callable[[], Registry], name: str, doc: str) -> Callable[..., Callable[[T], T]]:
    """``register_X(name, **traits)`` for one registry, imported when first used (they load torch); the
    traits are :class:`~posttrain.algorithms.registry.Traits` fields.
    """

    def register(entry: str, **traits: object) -> Callable[[T], T]:
        return registry().register(entry, **traits)

    register.__name__ = register.__qualname__ = name
    register.__doc__ = doc
    return register


def _rewards() -> Registry:
    import posttrain.rewards  # every built-in reward registered first, so that a clash is seen

    return posttrain.rewards.REGISTRY


def _envs() -> Registry:
    import posttrain.envs

    return posttrain.envs.ENVS


def _advantages() -> Registry:
    from posttrain.algorithms import advantages

    return advantages.REGISTRY


def _losses() -> Registry:
    from posttrain.algorithms import losses

    return losses.REGISTRY


def _shapers() -> Registry:
    from posttrain.algorithms import shaping

    return shaping.REGISTRY


def _aggregations() -> Registry:
    from posttrain.algorithms import aggregation

    return aggregation.REGISTRY


def _kl() -> Registry:
    from posttrain.algorithms import kl

    return kl.REGISTRY


register_reward = _registry_decorator(_rewards, "register_reward",
                                 "Register ``(prompt, completion, **fields) -> float | None`` as reward ``name``.")
register_env = _registry_decorator(_envs, "register_env",
                                 "Register an environment class (``posttrain.envs.Environment``) as ``task.env.name``.")
register_advantage = _registry_decorator(_advantages, "register_advantage",
                                 "Register ``(rewards [P, G], *, inputs...) -> advantages`` as an estimator.")
register_loss = _registry_decorator(_losses, "register_loss",
                                 "Register ``(logprobs, old_logprobs, advantages, mask, *, ...) -> [N, T]`` as a loss.")
register_shaper = _registry_decorator(_shapers, "register_shaper",
                                 "Register ``(rewards [P, G], *, inputs...) -> rewards [P, G]`` as a reward shaper.")
register_aggregation = _registry_decorator(_aggregations, "register_aggregation",
                                 "Register ``(loss [N, T], mask [N, T], *, ...) -> scalar`` as a loss aggregation.")
register_kl = _registry_decorator(_kl, "register_kl",
                                 "Register ``(logprobs, ref_logprobs) -> [N, T]`` as a KL estimator.")


def register_task(name: str) -> Callable[[T], T]:
    """Register a task class (the ``posttrain.tasks.Task`` protocol) as ``task.name = name``; its ``name``
    attribute is set to ``name``. A taken name is refused, naming the task that has it.
    """
    from posttrain.tasks import TASKS

    def deco(cls: T) -> T:
        origin = origin_of(cls)
        if name in TASKS or name in ("dataset", "env"):
            old = TASKS.get(name)
            raise ValueError(clash_message("task", name, origin, TASK_ORIGINS.get(name), old))
        cls.name = name  # type: ignore[attr-defined]
        TASKS[name] = cls  # type: ignore[assignment]
        if origin is not None:
            TASK_ORIGINS[name] = origin
        return cls

    return deco
