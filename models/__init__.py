"""Models: `build_model(cfg)` (or `create_model("lenet5", num_classes=10)`) is the only way the driver meets one.

A new model is one file here with `@MODELS.register()` on its constructor (zoo/registry.py), imported below,
and one recipe; or a module of your own named in AMP_ZOO_PLUGINS (recipes/README.md). A constructor checks
its own hyper-parameters and raises ConfigError naming the bad one, before anything compiles.
"""
import importlib
import inspect
import os

from zoo.errors import ConfigError, choices_hint
from zoo.registry import MODELS


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
    if "in_channels" in args and cfg.dataset.channels and cfg.dataset.channels != args["in_channels"]:
        raise ConfigError(f"dataset.channels={cfg.dataset.channels} does not fit model.params.in_channels="
                          f"{args['in_channels']}; make them equal")


def create_model(name: str, num_classes: int, **params):
    check_model_params(name, params)
    return MODELS.get(name, "model.name")(num_classes=num_classes, **params)


def build_model(cfg):
    """The recipe's model: `cfg.model` (name, num_classes, params), built in fp32."""
    return create_model(cfg.model.name, num_classes=cfg.model.num_classes, **cfg.model.params)


def import_plugins() -> None:
    """Models kept outside the repository: module names in AMP_ZOO_PLUGINS (comma-separated), which register
    themselves with @MODELS.register(). Set by the user in the environment, never by a recipe."""
    for name in filter(None, (n.strip() for n in os.environ.get("AMP_ZOO_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"AMP_ZOO_PLUGINS names {name!r}, which cannot be imported: {e}") from None


from models import lenet, resnet, transformer  # noqa: E402,F401  (registers their models)

import_plugins()
