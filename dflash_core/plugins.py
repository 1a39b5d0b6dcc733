"""A typed facade over pluggy: load plugins, collect stage classes, report what failed.

Entry points are loaded one by one so that one broken plugin is reported (``dflash-pipe
plugins``) instead of taking the tool down; it only becomes an error when a pipeline uses a
stage that plugin would have provided.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Iterable

import pluggy

from dflash_core import hookspecs
from dflash_core.stage import Stage
from dflash_core.vocabulary import Executor, Link

ENTRY_POINT_GROUP = "dflash_pipe"
AUTOLOAD_ENV = "DFLASH_PIPE_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_PLUGIN = "builtin"


class PluginError(Exception):
    """A plugin broke the contract (duplicate stage, bad stage class, unknown hook name)."""

HOOK_PREFIX = f"{hookspecs.PROJECT}_"


def check_hook_names(module: Any, plugin: str) -> None:
    """Refuse ``dflash_pipe_*`` functions that name no hook: a misspelled hook would be
    registered (or, unmarked, ignored) and never called, silently. Checked by name rather than
    through pluggy's ``check_pending`` so that a typo is caught with or without ``@hookimpl``."""
    known = [n for n in dir(hookspecs) if n.startswith(HOOK_PREFIX)]
    for attr in sorted(dir(module)):
        if attr.startswith(HOOK_PREFIX) and attr not in known and callable(getattr(module, attr)):
            close = difflib.get_close_matches(attr, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; hooks are: {', '.join(known)}"
            raise PluginError(f"plugin {plugin!r} defines {attr!r}, which is no dflash-pipe hook{hint}")


@dataclass
class PluginInfo:
    """One plugin as ``dflash-pipe plugins`` shows it."""

    name: str
    module: str
    dist: str = ""
    version: str = ""
    status: str = "loaded"  # loaded | failed | disabled
    error: str = ""
    stages: list[str] = field(default_factory=list)


class StageRegistry:
    """What ``dflash_pipe_register_stages`` receives: ``registry.add(StageClass)``."""

    def __init__(self) -> None:
        self._stages: dict[tuple[str, str], type[Stage]] = {}
        self._owner: dict[tuple[str, str], str] = {}
        self._current_plugin = BUILTIN_PLUGIN

    def add(self, stage_cls: type[Stage]) -> None:
        """Register a stage class; a second class with the same (kind, name) is an error."""
        _check_stage_class(stage_cls)
        key = (stage_cls.kind, stage_cls.name)
        if key in self._stages:
            raise PluginError(
                f"stage {key[0]}:{key[1]} is registered twice: by plugin "
                f"'{self._owner[key]}' ({_qualname(self._stages[key])}) and by plugin "
                f"'{self._current_plugin}' ({_qualname(stage_cls)})")
        self._stages[key] = stage_cls
        self._owner[key] = self._current_plugin

    def get(self, kind: str, name: str) -> type[Stage] | None:
        return self._stages.get((kind, name))

    def owner(self, kind: str, name: str) -> str:
        return self._owner[(kind, name)]

    def items(self) -> list[tuple[tuple[str, str], type[Stage]]]:
        return sorted(self._stages.items())

    def kinds(self) -> list[str]:
        return sorted({k for k, _ in self._stages})

    def resolve(self, uses: str, kind_hint: str | None = None) -> list[type[Stage]]:
        """Stage classes matching ``uses`` (``kind:name`` or ``name``; ``kind_hint`` is the
        stage's key in the pipeline, preferred when a bare name is ambiguous)."""
        if ":" in uses:
            kind, name = uses.split(":", 1)
            cls = self.get(kind, name)
            return [cls] if cls else []
        matches = [cls for (k, n), cls in self._stages.items() if n == uses]
        if len(matches) > 1 and kind_hint:
            preferred = [cls for cls in matches if cls.kind == kind_hint]
            if preferred:
                return preferred
        return matches


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_stage_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise PluginError(f"{cls!r} is not a subclass of dflash_core.Stage")
    for attr in ("kind", "name"):
        value = getattr(cls, attr)
        if not value or not isinstance(value, str) or ":" in value:
            raise PluginError(f"{_qualname(cls)}.{attr} must be a non-empty string without ':'")
    if not dataclasses.is_dataclass(cls.Config):
        raise PluginError(f"{_qualname(cls)}.Config must be a dataclass")
    for attr, words in (("default_link", Link), ("default_executor", Executor)):
        if getattr(cls, attr) not in words.values():
            raise PluginError(f"{_qualname(cls)}.{attr} must be one of {', '.join(words.values())}")


class PluginManager:
    """Loads built-in and third-party plugins and answers questions about them."""

    def __init__(self, disabled: Iterable[str] = (), autoload: bool | None = None,
                 extra_plugins: Iterable[str] = ()) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self.registry = StageRegistry()
        self.plugins: list[PluginInfo] = []
        self._disabled = set(disabled)
        if autoload is None:
            autoload = os.environ.get(AUTOLOAD_ENV, "") not in ("1", "true", "yes")
        self._register("dflash_stages.plugin", BUILTIN_PLUGIN)
        if autoload:
            self._load_entry_points()
        for module in extra_plugins:
            self._register(module, module)

    @property
    def hook(self) -> Any:
        """The pluggy hook relay (``pm.hook.dflash_pipe_before_stage(...)``)."""
        return self._pm.hook

    def _load_entry_points(self) -> None:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in sorted(eps, key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            info_kw = {"dist": dist.name if dist else "", "version": dist.version if dist else ""}
            if ep.name in self._disabled or ep.name == BUILTIN_PLUGIN:
                self.plugins.append(PluginInfo(ep.name, ep.value, status="disabled", **info_kw))
                continue
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin is reported, never fatal here
                self.plugins.append(PluginInfo(ep.name, ep.value, status="failed",
                                               error=_one_line(exc), **info_kw))
                continue
            self._add_module(module, ep.name, ep.value, **info_kw)

    def _register(self, module_name: str, plugin_name: str) -> None:
        if plugin_name in self._disabled:
            self.plugins.append(PluginInfo(plugin_name, module_name, status="disabled"))
            return
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            self.plugins.append(PluginInfo(plugin_name, module_name, status="failed",
                                           error=_one_line(exc)))
            return
        self._add_module(module, plugin_name, module_name)

    def _add_module(self, module: ModuleType, name: str, value: str, **info_kw: str) -> None:
        info = PluginInfo(name, value, **info_kw)
        before = set(self.registry._stages)
        self.registry._current_plugin = name
        try:
            check_hook_names(module, name)
            self._pm.register(module, name=name)
            impl = getattr(module, "dflash_pipe_register_stages", None)
            if impl is not None:
                impl(registry=self.registry)
        except PluginError:
            if self._pm.is_registered(module):
                self._pm.unregister(name=name)
            raise
        except Exception as exc:
            if self._pm.is_registered(module):
                self._pm.unregister(name=name)
            info.status, info.error = "failed", _one_line(exc)
        finally:
            self.registry._current_plugin = BUILTIN_PLUGIN
        info.stages = sorted(f"{k}:{n}" for k, n in set(self.registry._stages) - before)
        self.plugins.append(info)

    def add_plugin(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, ``-p module``) like an entry point."""
        self._add_module(plugin, name, getattr(plugin, "__name__", name))

    def failed_plugins(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.status == "failed"]


def _one_line(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return " ".join(text.split())
