"""Models: `create_model("lenet5", num_classes=10)` builds one, in plain MindSpore (ampzoo.engine.network.build_model
builds a recipe's, and speeds it up for the CPU).

A new model is one file here with `@MODELS.register()` on its constructor (ampzoo/registry.py), imported in this file,
and one recipe; or a module of your own named in AMP_ZOO_PLUGINS (recipes/README.md). A constructor checks
its own hyper-parameters and raises ConfigError naming the bad one, before anything compiles.
"""
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path
from typing import List


from ampzoo.errors import ConfigError, choices_hint
from ampzoo.registry import CELLS, DATASETS, MODELS
from ampzoo.models import lenet, resnet, transformer  # noqa: F401  (the models register themselves)


ROOT = Path(__file__).resolve().parents[2]  # the checkout: its top-level packages and scripts


def check_model_params(name: str, params: dict) -> None:
    """Every key of model.params is an argument of the registered constructor."""
    accepted = inspect.signature(MODELS.get(name, "model.name")).parameters
    if any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        return
    for key in params:
        if key not in accepted or key == "num_classes":
            valid = [k for k in accepted if k != "num_classes"]
            raise ConfigError(f"model.params.{key} is not an argument of model {name!r}; "
                              + choices_hint(key, valid or ["(none)"]))


def model_args(cfg) -> dict:
    """The constructor's arguments for the recipe: its defaults, then model.params, then num_classes."""
    fn = MODELS.get(cfg.model.name, "model.name")
    args = {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}
    return {**args, **cfg.model.params, "num_classes": cfg.model.num_classes}


def check_model(cfg) -> None:
    """The registered model's own check of its hyper-parameters and of how they fit the data, run before
    anything is built or compiled (registered as `check=` beside the constructor, which runs it too)."""
    check_model_params(cfg.model.name, dict(cfg.model.params))
    args = model_args(cfg)
    check = MODELS.meta(cfg.model.name).get("check")
    if check is not None:
        check(args, cfg.dataset)


def create_model(name: str, num_classes: int, **params):
    check_model_params(name, params)
    return MODELS.get(name, "model.name")(num_classes=num_classes, **params)


def plugin_names() -> List[str]:
    return [n for n in (n.strip() for n in os.environ.get("AMP_ZOO_PLUGINS", "").split(",")) if n]


def import_plugins() -> None:
    """Models kept outside the repository: module names in AMP_ZOO_PLUGINS (comma-separated), which register
    themselves with @MODELS.register(). Set by the user in the environment, never by a recipe; looked for on
    sys.path and then in the current folder. Anything a plugin raises while importing is one ConfigError
    naming the plugin (ampzoo.engine.load.load_config calls this, inside every command's one-line error handling)."""
    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in ROOT.glob("*.py")}
    for name in plugin_names():
        if name.split(".")[0] in ours:  # the zoo's own module comes first on the path: yours would never load
            raise ConfigError(f"AMP_ZOO_PLUGINS names {name!r}, a module of amp-zoo itself "
                              f"({ROOT / name.split('.')[0]}), so a file of yours by that name is never imported; "
                              f"rename it (e.g. my_{name}.py) and set AMP_ZOO_PLUGINS=my_{name}")
        if name in sys.modules:
            continue
        if os.getcwd() not in sys.path and importlib.util.find_spec(name.split(".")[0]) is None:
            sys.path.append(os.getcwd())  # `python /path/to/train.py` from the plugin's folder
        before = registered()
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == "models":  # the package the old register_model lived in, now ampzoo.models
                raise ConfigError(f"plugin {name!r} (AMP_ZOO_PLUGINS) uses the old API (`from models import "
                                  f"register_model`): register models with `from ampzoo.registry import MODELS` and "
                                  f"`@MODELS.register()`") from None
            where = "the current folder" if e.name == name else f"{name!r}'s own imports"
            raise ConfigError(f"AMP_ZOO_PLUGINS names {name!r}, which cannot be imported: {e} (looked on "
                              f"PYTHONPATH and in {where}); give a module name such as my_models for "
                              f"my_models.py, or fix AMP_ZOO_PLUGINS") from None
        except ConfigError as e:
            raise ConfigError(f"plugin {name!r} (AMP_ZOO_PLUGINS): {e}") from None
        except Exception as e:  # noqa: BLE001  (a plugin's own bug: one line naming it, not a traceback)
            frame = traceback.extract_tb(e.__traceback__)[-1]
            hint = ("; register models with `from ampzoo.registry import MODELS` and `@MODELS.register()`"
                    if isinstance(e, ImportError) else "")
            raise ConfigError(f"plugin {name!r} (AMP_ZOO_PLUGINS) failed while importing: {type(e).__name__}: "
                              f"{e} ({frame.filename}:{frame.lineno}){hint}") from None
        if registered() == before:  # another module of that name (an installed package's) came first, or a plugin that
            # registers nothing: either way the user's models are not there
            raise ConfigError(f"plugin {name!r} (AMP_ZOO_PLUGINS) registered no model, dataset or Cell: the module "
                              f"imported is {getattr(module, '__file__', None) or name}; if that is not your file, "
                              f"another module of that name comes first: rename yours (e.g. my_{name}.py)")


def registered() -> int:
    """How many names the registries hold, overrides counted: what a plugin's import added."""
    return sum(len(r.names()) + len(r.overridden) for r in (MODELS, DATASETS, CELLS))


def plugins_hint() -> str:
    names = plugin_names()
    return (f"models of your own are registered by the modules named in AMP_ZOO_PLUGINS (now: {','.join(names)})"
            if names else "a model of your own is registered by a module named in AMP_ZOO_PLUGINS, which is "
            "not set (export AMP_ZOO_PLUGINS=my_models)")


MODELS.missing_hint = plugins_hint
