"""Plugin discovery and the registries that the ``register_*`` hooks fill.

Plugins are entry points in the group ``runtime``. They load once per process, in a
predictable order (built-ins first, then entry points sorted by name). The
environment variable ``RUNTIME_PLUGINS`` is an allow-list of entry-point names;
an empty value loads none. A plugin that fails to import is an error naming it.
"""

from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

import pluggy

from runtime import hookspecs
from runtime.registration import CONTRACTS, contract_error, make_callback, missing_members

ENTRY_POINT_GROUP = "runtime"
ALLOW_LIST_ENV = "RUNTIME_PLUGINS"
BUILTIN_PLUGIN_NAME = "runtime (built-in)"

# Which package of the runtime source tree provides a well-known component, to point
# users at it when the name is not registered here: (distribution, folder). Only packages
# that exist are named; feature plugins join as they land.
KNOWN_PROVIDERS: dict[str, dict[str, tuple[str, str]]] = {
    "platform": {
        "cpu": ("runtime-plugin-cpu", "hardware/cpu"),
        "cuda": ("runtime-plugin-cuda", "hardware/cuda"),
        "rocm": ("runtime-plugin-rocm", "hardware/rocm"),
        "xpu": ("runtime-plugin-xpu", "hardware/xpu"),
    },
    "attention_backend": {
        "cpu_paged": ("runtime-plugin-cpu", "hardware/cpu"),
        "triton": ("runtime-kernels", "kernels"),
    },
    "guided_backend": {
        "outlines": ("runtime-plugin-outlines", "plugins/outlines"),
    },
    "proposer": {
        name: ("runtime-plugin-spec-decode", "plugins/spec-decode") for name in ("ngram", "draft_model", "eagle", "eagle3", "medusa")
    },
    "quant_method": {
        name: ("runtime-plugin-quant", "plugins/quant") for name in ("fp8", "int8", "compressed-tensors", "gptq", "awq")
    },
    "kv_tier": {
        "cpu": ("runtime-plugin-kv-offload", "plugins/kv-offload"),
        "disk": ("runtime-plugin-kv-offload", "plugins/kv-offload"),
    },
    "kv_connector": {
        "OffloadingConnector": ("runtime-plugin-kv-offload", "plugins/kv-offload"),
        "TcpConnector": ("runtime-plugin-pd", "plugins/pd"),
    },
    "executor": {
        "ray": ("runtime-plugin-ray", "plugins/ray"),
    },
}


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


@dataclass(slots=True)
class Component:
    """One thing a plugin registered: a platform, a backend, a model class..."""

    kind: str
    name: str
    obj: Any
    plugin: str
    options: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Named components of one kind, with errors that list the valid names.

    Components are checked against the kind's contract (:mod:`runtime.registration`):
    objects given directly (a platform instance, a class as the factory) when added,
    objects a factory builds when :meth:`create` builds them.
    """

    def __init__(self, kind: str, distribution_of: Callable[[str], str] | None = None):
        self.kind = kind
        self._components: dict[str, Component] = {}
        # plugin name -> the distribution (package) that installed it, for error messages
        self._distribution_of = distribution_of or (lambda plugin: plugin)

    def add(self, name: str, obj: Any, plugin: str, **options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} with invalid name {name!r}")
        if self.kind == "platform" or (inspect.isclass(obj) and self.kind in CONTRACTS and self.kind != "model"):
            self._check(obj, self.kind, name, plugin)
        if name in self._components:
            other = self._components[name].plugin
            packages = f"{self._distribution_of(other)} and {self._distribution_of(plugin)}"
            raise PluginError(
                f"{self.kind} {name!r} is registered by two plugins: {other!r} and {plugin!r} "
                f"(packages {packages}); uninstall one of them or limit loading with {ALLOW_LIST_ENV}"
            )
        self._components[name] = Component(self.kind, name, obj, plugin, dict(options))

    def names(self) -> list[str]:
        return list(self._components)

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def __iter__(self):
        return iter(self._components.values())

    def __len__(self) -> int:
        return len(self._components)

    def component(self, name: str) -> Component:
        if name not in self._components:
            raise ValueError(self.unknown_message(name))
        return self._components[name]

    def get(self, name: str) -> Any:
        return self.component(name).obj

    def create(self, name: str, *args: Any, contract: str | None = None, **kwargs: Any) -> Any:
        """Build component ``name`` with its factory and check what it built.

        ``contract`` names the contract to check when it is not the kind's own (the two
        halves of a KV connector).
        """
        comp = self.component(name)
        obj = comp.obj(*args, **kwargs)
        self._check(obj, contract or self.kind, name, comp.plugin)
        return obj

    @staticmethod
    def _check(obj: Any, kind: str, name: str, plugin: str) -> None:
        if kind not in CONTRACTS:
            raise ValueError(f"no contract {kind!r} to check {name!r} against; contracts: {', '.join(CONTRACTS)}")
        missing = missing_members(obj, CONTRACTS[kind])
        if missing:
            raise PluginError(contract_error(plugin, kind, name, obj, missing))

    def unknown_message(self, name: str) -> str:
        label = self.kind.replace("_", " ")
        installed = ", ".join(sorted(self._components)) or "none"
        msg = f"unknown {label} {name!r}; installed: {installed}"
        hints = KNOWN_PROVIDERS.get(self.kind, {})
        missing = [f"{dist} provides {n!r}" for n, (dist, _) in sorted(hints.items()) if n not in self._components]
        if name in hints:
            dist, folder = hints[name]
            if _is_installed(dist):  # installed, but its plugin was left out of the allow-list
                msg += f" ({dist} provides {name!r}; it is installed but not loaded: add its plugin to {ALLOW_LIST_ENV} / --plugins)"
            else:
                msg += f" ({dist} provides {name!r}; install it from the runtime source tree with `pip install -e {folder}`)"
        elif missing:
            msg += " (" + "; ".join(missing) + ")"
        return msg


REGISTRY_KINDS = {
    "register_platforms": "platform",
    "register_attention_backends": "attention_backend",
    "register_quant_methods": "quant_method",
    "register_proposers": "proposer",
    "register_kv_connectors": "kv_connector",
    "register_kv_tiers": "kv_tier",
    "register_executors": "executor",
    "register_models": "model",
    "register_guided_backends": "guided_backend",
}


@dataclass
class PluginInfo:
    name: str
    version: str
    distribution: str
    registered: dict[str, list[str]] = field(default_factory=dict)


class PluginManager:
    """Wraps a pluggy manager and the registries its hooks fill."""

    def __init__(self, allow_list: list[str] | None = None, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.registries: dict[str, Registry] = {
            kind: Registry(kind, self._distribution_of) for kind in REGISTRY_KINDS.values()
        }
        self.infos: dict[str, PluginInfo] = {}
        from runtime import builtins

        self._register_plugin(builtins, BUILTIN_PLUGIN_NAME, _own_version(), "runtime")
        if load_entry_points:
            self._load_entry_points(allow_list)

    # ------------------------------------------------------------------ loading
    def _load_entry_points(self, allow_list: list[str] | None) -> None:
        eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
        names = {ep.name for ep in eps}
        if allow_list is not None:
            unknown = [n for n in allow_list if n not in names]
            if unknown:
                raise PluginError(
                    f"{ALLOW_LIST_ENV} names plugins that are not installed: {', '.join(unknown)}; "
                    f"installed: {', '.join(sorted(names)) or 'none'}"
                )
        for ep in eps:
            if allow_list is not None and ep.name not in allow_list:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # report, never skip silently
                raise PluginError(
                    f"plugin {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            dist = ep.dist.name if ep.dist is not None else ep.name
            version = ep.dist.version if ep.dist is not None else "?"
            self._register_plugin(module, ep.name, version, dist)

    def register(self, plugin: Any, name: str, version: str = "0", distribution: str | None = None) -> None:
        """Register a plugin object (a module or class with hookimpls) by hand."""
        self._register_plugin(plugin, name, version, distribution or name)

    def unregister(self, name: str) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is None:
            return
        self.pm.unregister(plugin, name=name)
        for registry in self.registries.values():
            for comp_name in [c.name for c in registry if c.plugin == name]:
                del registry._components[comp_name]
        self.infos.pop(name, None)

    def _register_plugin(self, plugin: Any, name: str, version: str, distribution: str) -> None:
        if self.pm.get_plugin(name) is not None:
            raise PluginError(f"plugin {name!r} is registered twice")
        self.pm.register(plugin, name=name)
        info = PluginInfo(name=name, version=version, distribution=distribution)
        self.infos[name] = info
        try:
            self._collect_registrations(name, info)
        except BaseException:
            self.unregister(name)  # nothing of a refused plugin stays registered
            raise

    def _collect_registrations(self, name: str, info: PluginInfo) -> None:
        for hook_name, kind in REGISTRY_KINDS.items():
            registry = self.registries[kind]
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                if impl.plugin_name != name:
                    continue

                def add(comp_name, obj, _registry=registry, **options):
                    _registry.add(comp_name, obj, name, **options)
                    info.registered.setdefault(_registry.kind, []).append(comp_name)

                try:
                    impl.function(register=make_callback(kind, add))
                except PluginError:
                    raise
                except Exception as exc:
                    raise PluginError(
                        f"plugin {name!r} failed in {hook_name}: {type(exc).__name__}: {exc}"
                    ) from exc

    def _distribution_of(self, plugin: str) -> str:
        info = self.infos.get(plugin)
        return info.distribution if info is not None else plugin

    # ------------------------------------------------------------------ access
    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    @property
    def hook(self):
        return self.pm.hook


def _is_installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def _own_version() -> str:
    try:
        return metadata.version("runtime")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def parse_allow_list(value: str | None) -> list[str] | None:
    """``None`` (unset) loads every plugin; ``""`` loads none; ``"a,b"`` loads a and b."""
    if value is None:
        return None
    return [n.strip() for n in value.split(",") if n.strip()]


_manager: PluginManager | None = None
_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = PluginManager(parse_allow_list(os.environ.get(ALLOW_LIST_ENV)))
        return _manager


def reset_plugin_manager(manager: PluginManager | None = None) -> None:
    """Drop (or replace) the process-wide manager; the next use loads again."""
    global _manager
    with _lock:
        _manager = manager


def get_registry(kind: str) -> Registry:
    return get_plugin_manager().registry(kind)

