"""A received run directory is data: it never runs code (docs/trust.md).

``repro evaluate``, ``predict``, ``rerun`` and ``confirm`` compose a config from a run's
``.hydra/overrides.yaml`` -- a file whoever sent the directory wrote -- and then build every
``_target_`` in it (or hand it to ``python train.py``). :func:`check_received` looks at that
config before anything is imported from it, built or launched, and refuses, in one line
naming the file, the key and the target:

- a ``_target_`` outside this checkout's ``src/`` packages (the template's extension points,
  :data:`REPRO_TARGETS`, and a fork's own package whole) and :data:`LIBRARIES`, unless this
  checkout's ``conf/`` or the user's own command line names it; a name under an allowed one
  must also *be* one of its objects (``torchvision.transforms.v2.functional.torch.load`` is
  torch's ``load``);
- Hydra's own settings (``hydra.callbacks``, ``hydra.searchpath``, ``hydra.job.env_set``,
  logging), which Hydra never records among a run's overrides, and a ``hydra.*`` target the
  checkout's ``conf/`` does not give Hydra;
- an interpolation that calls a resolver (``${oc.env:...}``; ``${a.b}`` is a node and fine);

unless the user passes ``--trust`` (as transformers' ``trust_remote_code``). A loader that
runs the code a file holds (:data:`LOADERS`: ``torch.load`` without ``weights_only=true``,
``numpy.load`` with ``allow_pickle``, ``pickle.*``...) is refused even then, unless named
one by one (``--trust-loader torch.load``). Hydra's own instantiate blocklist (hydra-core
1.3.4 and later, the project's floor) is not relied on: a blocklist is not an allow-list.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hydra._internal.utils import _locate
from omegaconf import DictConfig, ListConfig, OmegaConf

from repro import MOVED
from repro.base.errors import ConfigError, Untrusted
from repro.defense.config import check_overrides, find_conf_dir

# Libraries whose objects a received config may name (and everything under them): those the
# shipped conf/ and the docs use -- optimizers and their schedules, torchvision's v2
# transforms, the model zoos of docs/extending.md, albumentations (through
# repro.components.data.augment.albumentations). A fork's zoo named in its own conf/ needs no entry.
LIBRARIES = (
    "torch.optim",
    "torchvision.transforms.v2",
    "torchvision.models",
    "timm.create_model",
    "albumentations",
)
# The template's own modules a received config may name: its extension points. Not its
# tools: repro.cli.main runs any command, repro.tools.testing launches runs, repro.defense.config.locate
# turns a string into any callable. A fork's own package under src/ is allowed whole.
REPRO_TARGETS = tuple(
    path
    for module in ("data", "models", "tasks", "ops", "schedules", "loggers")
    # the path conf/ names (repro/__init__.py keeps it working) and the module's home
    for path in (f"repro.{module}", MOVED[f"repro.{module}"])
)
# Loaders that run the code a file holds (unpickling), refused even under --trust unless
# named with --trust-loader: a dotted name, or a module (all of it). torch.load only without
# weights_only=true, numpy.load only with allow_pickle, timm.create_model only with a
# checkpoint file of its own (:func:`_loads_code`).
LOADERS = (
    "torch.load",
    "torch.serialization.load",
    "torch.jit.load",
    "torch.jit._serialization.load",
    "torch.hub",
    "torch.package",
    "numpy.load",
    "numpy.lib.format.read_array",
    "pickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "shelve",
    "marshal",
    "joblib.load",
    "joblib.numpy_pickle",
    "yaml.load",
    "yaml.load_all",
    "yaml.unsafe_load",
    "yaml.unsafe_load_all",
    "yaml.full_load",
    "yaml.full_load_all",
    "pandas.read_pickle",
    "pandas.io.pickle",
    "timm.create_model",
    "timm.models._factory.create_model",
    "runpy",  # run_path, run_module: a file's or module's code, as __main__ or not
)
DOC = "docs/trust.md"
TRUST = (
    "a received run directory does not run code: pass --trust if you wrote it or trust its sender"
)
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check_received(
    overrides: list[str],
    source: Path,
    user: Iterable[str] = (),
    *,
    trust: bool = False,
    loaders: Iterable[str] = (),
    conf_dir: Path | None = None,
) -> None:
    """Refuse, in one line (:class:`~repro.base.errors.Untrusted`), the ``overrides`` read from
    ``source`` (a received ``.hydra/overrides.yaml``) when the config they compose with this
    checkout's ``conf/`` and the user's own ``user`` overrides would run code that neither
    holds. ``trust``: the user trusts the sender (only the loaders stay refused);
    ``loaders``: the loaders named with ``--trust-loader``. Nothing is imported from a
    target before it passes, and nothing is built."""
    conf_dir = Path(conf_dir) if conf_dir else find_conf_dir()
    user = list(user)
    for text in overrides:
        _check_override(text, source, trust)
    composable = _composable(user)
    cfg = _compose([*overrides, *composable], conf_dir)
    # what this checkout gives Hydra: its conf/ with the user's own Hydra overrides alone
    base = _base(conf_dir, tuple(o for o in composable if _is_hydra(_parse(o))))
    Check(
        source=str(source),
        user_keys=[_parse(o).key_or_group for o in composable],
        trust=trust,
        loaders=set(loaders),
        named={*conf_targets(conf_dir), *_user_targets(user)},
        hydra_named={*conf_targets(conf_dir), *targets_in(base.hydra, "hydra")},
        own=own_packages(conf_dir.parent),
    ).config(cfg, base)


@dataclasses.dataclass
class Check:
    """What is allowed, and the walk over a composed config that refuses the rest."""

    source: str  # the received file, as the messages name it
    user_keys: list[str]  # what the user's own overrides set (the messages say so)
    trust: bool
    loaders: set[str]
    named: set[str]  # targets this checkout's conf/ or the user's command line names
    hydra_named: set[str]  # targets this checkout gives Hydra
    own: tuple[str, ...]  # the packages under src/ allowed whole (a fork's own)

    def config(self, cfg: DictConfig, base: DictConfig) -> None:
        for name, what in (("callbacks", "callbacks"), ("searchpath", "search path")):
            now, then = cfg.hydra.get(name), base.hydra.get(name)
            extra = [k for k in (now or []) if k not in (then or [])]
            if extra and not self.trust:
                entry = f"hydra.{name}.{extra[0]}" if name == "callbacks" else extra[0]
                raise Untrusted(
                    f"{self.source} adds {entry} to Hydra's {what}, which this checkout's "
                    f"conf/ does not ({DOC}); {TRUST}."
                )
        for path, node in _nodes(cfg, ""):
            if "_target_" in node:
                self.target(path, node)

    def target(self, path: str, node: DictConfig) -> None:
        key = f"{path}._target_" if path else "_target_"
        setter = self._setter(key)
        try:
            target = node["_target_"]
        except Exception as err:
            raw = node._get_node("_target_")._value()
            raise Untrusted(
                f"{setter} sets {key}={raw}, which does not resolve ({type(err).__name__}), "
                f"so what it would run cannot be checked ({DOC}); restore the record or drop "
                "the override."
            ) from None
        if not isinstance(target, str) or not DOTTED.fullmatch(target):
            raise Untrusted(
                f"{setter} sets {key}={target!r}, which is not a dotted name, so what it "
                f"would run cannot be checked ({DOC}); restore the record or drop the override."
            )
        hydra = path == "hydra" or path.startswith("hydra.")
        if hydra:
            listed = target in self.hydra_named
        else:
            listed = target in self.named or _within(target, self._namespaces())
        identity = None
        if listed or self.trust:
            try:  # as instantiate will find it; trusted code, so its module may be imported
                identity = _identity(_locate(target))
            except Exception:
                pass  # nothing there to run: building it names the target
        if listed and not hydra and target not in self.named and target not in LIBRARIES:
            # a name under an allowed one must be one of its objects, not an alias of
            # another's (torchvision.transforms.v2.functional.torch.load)
            listed = identity is None or _within(identity, self._namespaces())
        loader = _matches(target, LOADERS) or _matches(identity, LOADERS)
        why = None if loader is None else _loads_code(loader, node)
        if why is not None and not {target, identity, loader} & self.loaders:
            raise Untrusted(
                f"{setter} sets {key}={target}{why}, a loader that runs the code the file "
                f"it reads may hold, refused even with --trust ({DOC}): pass --trust-loader "
                f"{target} only if you trust that file."
            )
        if listed or self.trust:
            return
        if hydra:
            where = "not what this checkout's conf/ gives Hydra"
        else:
            alias = f"{identity}, " if identity not in (None, target) else ""
            where = f"{alias}not in this checkout's src/ nor in the listed libraries"
        raise Untrusted(f"{setter} sets {key}={target}, which is {where} ({DOC}); {TRUST}.")

    def _namespaces(self) -> tuple[str, ...]:
        return (*self.own, *REPRO_TARGETS, *LIBRARIES)

    def _setter(self, key: str) -> str:
        """Who set ``key``: the user's command line, or the received file."""
        for k in self.user_keys:
            if key == k or key.startswith(k + ".") or k.startswith(key + "."):
                return "the command line"
        return self.source


def _loads_code(loader: str, node: DictConfig) -> str | None:
    """How ``node`` (whose target is the loader ``loader``) would run the code a file holds
    (" without weights_only=true"; "" for a loader that always may), or None: it would not."""
    try:
        args = node.get("_args_") or []
        if loader in ("torch.load", "torch.serialization.load"):
            # torch < 2.6 (torch>=2.4 is allowed) loads anything when weights_only is absent
            return None if node.get("weights_only") is True else " without weights_only=true"
        if loader in ("numpy.load", "numpy.lib.format.read_array"):
            at = 2 if loader == "numpy.load" else 1  # allow_pickle's position
            value = node.get("allow_pickle", args[at] if len(args) > at else False)
            return f" with allow_pickle={value}" if value else None
        if loader in ("timm.create_model", "timm.models._factory.create_model"):
            # a checkpoint file of its own: timm reads it with torch.load
            files = ("checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay")
            given = [k for k in files if node.get(k)]
            return f" with {given[0]}" if given else None
    except Exception:
        return " with arguments that cannot be checked"
    return ""


def _check_override(text: str, source: Path, trust: bool) -> None:
    """One received override: no command-line flag, no Hydra setting, no resolver."""
    if text.lstrip().startswith("-"):  # train.py would read it as a flag of Hydra's
        raise ConfigError(
            f"{source}: {text!r} is a command-line option, not an override; a run's record "
            "never holds one: restore it."
        )
    o = _parse(text, source)
    if _is_hydra(o) and not trust:
        raise Untrusted(
            f"{source} sets {text}, one of Hydra's own settings (callbacks, search path, "
            f"environment, logging), which Hydra never records among a run's overrides "
            f"({DOC}); {TRUST}."
        )
    for s in _strings(o.value()):
        resolver = _resolver(s)
        if resolver is not None and not trust:
            raise Untrusted(
                f"{source} sets {text}, whose ${{{resolver}:...}} calls a resolver when the "
                f"config is read ({DOC}); {TRUST}."
            )


def _parse(text: str, source: Path | None = None) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(text)
    except Exception:
        raise ConfigError(
            f"{source or 'the command line'}: {text!r} is not an override Hydra can read; "
            "restore the run's record of its launch."
        ) from None


def _is_hydra(o: Any) -> bool:
    """An override that reaches Hydra's own node: ``hydra.x``, ``hydra/launcher``, with
    ``+`` or ``++``, a group placed under it (``g@hydra.x``) or reaching it from the root
    package (``g@_global_.hydra.x``, ``_global_.hydra.x``)."""
    names = (o.key_or_group, o.package or "")
    return any(
        name == "hydra" or name.startswith(("hydra.", "hydra/"))
        for name in (*names, *(n.removeprefix("_global_.") for n in names))
    )


def _composable(user: list[str]) -> list[str]:
    """The user's overrides one config can take (a sweep of ``repro confirm``'s is its
    own business, and a typo is Hydra's to report)."""
    out = []
    for text in user:
        try:
            o = _parse(text)
        except ConfigError:
            continue
        if not o.is_sweep_override():
            out.append(text)
    return out


def _strings(value: Any) -> Iterator[str]:
    """Every string in an override's value: lists, dicts (keys too), sweeps."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif dataclasses.is_dataclass(value):  # a sweep: choice(...), glob(...)
        for f in dataclasses.fields(value):
            yield from _strings(getattr(value, f.name))


def _resolver(text: str) -> str | None:
    """The first resolver an interpolation in ``text`` calls (``oc.env``), else None;
    ``"?"`` for a string OmegaConf cannot parse."""
    if "${" not in text:
        return None
    from omegaconf import grammar_parser
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

    try:
        tree = grammar_parser.parse(text)
    except Exception:
        return "?"
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            return node.resolverName().getText()
        stack.extend(getattr(node, "children", None) or [])
    return None


def _compose(overrides: list[str], conf_dir: Path) -> DictConfig:
    """``train.yaml`` with ``overrides``, Hydra's node included, neither validated nor
    resolved (validation imports every target)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    check_overrides(overrides, conf_dir)  # one line for a value that is not an option
    try:
        with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
            return hydra_compose("train", overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"config error: {first}") from None


@functools.lru_cache(maxsize=8)
def _base(conf_dir: Path, hydra_user: tuple[str, ...]) -> DictConfig:
    return _compose(list(hydra_user), conf_dir)


def _nodes(node: Any, path: str, depth: int = 0) -> Iterator[tuple[str, DictConfig]]:
    """Every dict node under ``node`` with its dotted path, lists included; a value that is an
    interpolation is followed to what it resolves to (a node it names, or a resolver's)."""
    if depth > 100:  # an interpolation that names its own parent
        return
    if isinstance(node, DictConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return
        yield path, node
        keys = list(node.keys())
    elif isinstance(node, ListConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return
        keys = list(range(len(node)))
    else:
        return
    for key in keys:
        sub = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_interpolation(node, key):
            try:
                child = node[key]
            except Exception:
                continue  # resolves to nothing: a _target_ so is refused by its own node
        else:
            child = node._get_node(key)
        yield from _nodes(child, sub, depth + 1)


def targets_in(node: Any, path: str = "") -> set[str]:
    """The plain ``_target_`` strings under ``node`` (interpolations left out)."""
    found = set()
    for _, n in _nodes(node, path):
        if "_target_" in n and not OmegaConf.is_interpolation(n, "_target_"):
            value = n._get_node("_target_")._value()
            if isinstance(value, str):
                found.add(value)
    return found


@functools.cache
def conf_targets(conf_dir: Path) -> frozenset[str]:
    """Every plain ``_target_`` the YAML files of this checkout's ``conf/`` name."""
    found: set[str] = set()
    for path in sorted(Path(conf_dir).rglob("*.yaml")):
        try:
            found |= targets_in(OmegaConf.load(path))
        except Exception:
            continue  # not this check's to report
    return frozenset(found)


def _user_targets(user: list[str]) -> set[str]:
    """The ``_target_`` strings the user's own overrides give."""
    found = set()
    for text in user:
        try:
            o = _parse(text)
        except ConfigError:
            continue
        value = o.value()
        if o.key_or_group.split(".")[-1] == "_target_" and isinstance(value, str):
            found.add(value)
        elif isinstance(value, (dict, list)):
            found |= targets_in(OmegaConf.create(value))
    return found


@functools.cache
def own_packages(root: Path) -> tuple[str, ...]:
    """The packages (and modules) directly under ``root/src`` other than the template's:
    a fork's own (``repro new mylab``: src/mylab), allowed whole."""
    src = Path(root) / "src"
    names = []
    for p in sorted(src.iterdir()) if src.is_dir() else []:
        name = p.stem if p.suffix == ".py" else p.name
        if (p.is_dir() or p.suffix == ".py") and name.isidentifier() and name != "repro":
            names.append(name)
    return tuple(names)


def _identity(obj: Any) -> str | None:
    """Where ``obj`` really comes from: ``module.qualname`` (a module: its name)."""
    if inspect.ismodule(obj):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return None
    qualname = getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(qualname, str) else module


def _within(name: str | None, spaces: Iterable[str]) -> bool:
    return name is not None and any(name == s or name.startswith(s + ".") for s in spaces)


def _matches(name: str | None, spaces: Iterable[str]) -> str | None:
    """The entry of ``spaces`` that ``name`` is or lies under, else None."""
    return next((s for s in spaces if _within(name, [s])), None)
