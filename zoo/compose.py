"""Hydra composition of conf/ and recipes/ over the schema, outside @hydra.main too, and the one line a Hydra or
OmegaConf error is shown as. Imports Hydra, never MindSpore: zoo/runtime.py reads runtime.onednn_isa with it
before MindSpore loads."""
import dataclasses
from typing import List

from zoo.config import CONF_DIR, register_schema
from zoo.errors import choices_hint


def one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines; keep what names the bad value."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in chain:
        if isinstance(e, MissingConfigException):
            missing = (e.missing_cfg_file or "").split("/")
            group = missing[0] if len(missing) > 1 else "config"
            name = missing[-1]
            options = e.options or []
            if options:
                return f"{group}={name} not found; " + choices_hint(name, options)
            return str(e).splitlines()[0]
    for e in chain:
        if isinstance(e, ValidationError):
            key = getattr(e, "full_key", "") or "value"
            msg = str(getattr(e, "msg", e)).splitlines()[0]
            return f"{key}: {msg}"
        if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
            key = getattr(e, "full_key", "") or str(getattr(e, "key", ""))
            schema = getattr(e, "object_type", None)
            if dataclasses.is_dataclass(schema):
                section = key.rsplit(".", 1)[0] if "." in key else "the top level"
                return (f"unknown key {key}; "
                        + choices_hint(key.rsplit(".", 1)[-1], [f.name for f in dataclasses.fields(schema)])
                        .replace("valid:", f"valid keys of {section}:"))
            return f"unknown key {key} (a key the config does not have yet is added with +{key}=VALUE)"
        if isinstance(e, OmegaConfBaseException):
            return str(getattr(e, "msg", e)).splitlines()[0]
    return str(chain[0]).splitlines()[0]


def compose(overrides: List[str], config_name: str = "config"):
    """Compose the config outside @hydra.main (tests, eval.py, amp.report), with ${hydra:...} resolvable."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg
