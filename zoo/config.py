"""The configuration schema: every key a recipe may set, with its type and its valid values.

Hydra merges conf/ and recipes/ into `Config`; OmegaConf then rejects unknown keys and values outside
an Enum before anything is imported from MindSpore. `validate` adds the checks a type cannot express
(registered names, positive sizes) and `check_command_line` turns any failure into one line and exit 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"


class AmpLevel(str, Enum):
    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"


class AmpDtype(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"


class LossScaleType(str, Enum):
    none = "none"
    fixed = "fixed"
    dynamic = "dynamic"


class Device(str, Enum):
    auto = "auto"
    CPU = "CPU"
    GPU = "GPU"
    Ascend = "Ascend"


class Mode(str, Enum):
    graph = "graph"
    pynative = "pynative"


class OptimizerName(str, Enum):
    momentum = "momentum"
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class ScheduleName(str, Enum):
    constant = "constant"
    cosine = "cosine"
    step = "step"
    inverse_sqrt = "inverse_sqrt"


class LengthNorm(str, Enum):
    gnmt = "gnmt"         # score / ((5 + length) / 6) ** length_penalty (Wu et al. 2016; tensor2tensor)
    fairseq = "fairseq"   # score / length ** length_penalty, length counting EOS (fairseq --lenpen)


@dataclass
class ModelConfig:
    name: str = MISSING
    num_classes: int = 10
    params: Dict[str, Any] = field(default_factory=dict)  # extra constructor arguments, checked against its signature


@dataclass
class DatasetConfig:
    name: str = MISSING               # a registered dataset builder (data/__init__.py)
    path: Optional[str] = None        # None: the embedded data that ships in a package
    batch_size: int = 32
    max_tokens: int = 0               # translation: > 0 batches by tokens (fairseq --max-tokens), not batch_size
    eval_batch_size: int = 256
    image_size: int = 32
    channels: int = 0                 # 0: the data's own; 3: grey images replicated to RGB
    num_workers: int = 2
    mean: List[float] = field(default_factory=list)
    std: List[float] = field(default_factory=list)
    test_fraction: float = 0.2        # embedded data only: share held out as the test split
    hflip: bool = False               # idx images, training split: flip left-right with probability 1/2
    shift: int = 0                    # idx images, training split: translate by up to this many pixels
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.momentum
    lr: float = 0.01                  # at the reference batch size below
    reference_batch_size: int = 0     # 0: use lr as is; else lr * global_batch / reference_batch_size
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    decay_norm_and_bias: bool = True  # False: no weight decay on BatchNorm/LayerNorm parameters and biases
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    name: ScheduleName = ScheduleName.constant
    warmup_epochs: float = 0.0
    warmup_steps: int = 0             # overrides warmup_epochs when > 0
    min_lr: float = 0.0
    milestones: List[int] = field(default_factory=list)  # step schedule: epochs at which lr *= gamma
    gamma: float = 0.1


@dataclass
class LossScaleConfig:
    type: LossScaleType = LossScaleType.none
    scale: float = 1024.0             # fixed scale
    drop_overflow_update: bool = False  # fixed scale: skip steps whose gradients overflow
    init_scale: float = 65536.0       # dynamic scale
    factor: int = 2
    window: int = 2000
    min_scale: float = 1.0            # dynamic: stop (or fall back) when an overflow happens at this scale


@dataclass
class FallbackConfig:
    enabled: bool = False
    overflow_rate: float = 0.5        # overflow share over `window` steps that counts as diverging
    window: int = 50


@dataclass
class AmpConfig:
    level: AmpLevel = AmpLevel.O0
    dtype: AmpDtype = AmpDtype.float16
    keep_fp32: Optional[List[str]] = None   # None: the level's default (BatchNorm and LayerNorm at O2)
    force_fp16: List[str] = field(default_factory=list)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)


@dataclass
class TrainerConfig:
    epochs: int = 1
    max_steps: int = 0                # > 0: stop after this many steps (smoke runs, benchmarks)
    label_smoothing: float = 0.0
    ignore_index: int = -100          # label ignored by the loss (translation: 0, the padding id)
    eval_every: int = 1               # epochs; 0: only at the end
    ckpt_every: int = 1               # epochs; 0: only at the end
    keep_last: int = 3
    sink: bool = True                 # data sinking where the device supports it
    sink_size: int = -1               # steps per sink; -1: a whole epoch
    log_every: int = 10               # steps between TensorBoard points


@dataclass
class DecodeConfig:
    """Translation: how eval.py (and the end of train.py) decode the test set for BLEU."""
    beam: int = 4                     # 1: greedy
    length_penalty: float = 0.6       # GNMT alpha, or fairseq's lenpen (see length_norm)
    length_norm: LengthNorm = LengthNorm.gnmt
    average_last: int = 1             # eval.py: average the last N checkpoints of the run first
    batch_size: int = 256             # sentences decoded together (x beam rows), sorted by length


class ExportFormat(str, Enum):
    MINDIR = "MINDIR"
    ONNX = "ONNX"
    AIR = "AIR"


@dataclass
class InferConfig:
    """eval.py and export.py."""
    fuse_conv_bn: bool = False        # fold Conv2d+BatchNorm2d pairs first (zoo/fuse.py)
    format: ExportFormat = ExportFormat.MINDIR
    batch_size: int = 1               # export: the batch dimension of the exported inputs


@dataclass
class RuntimeConfig:
    device: Device = Device.auto
    device_id: int = 0
    mode: Mode = Mode.graph
    seed: int = 1
    deterministic: bool = False
    onednn_isa: str = "auto"          # auto: cap oneDNN at AVX2 on x86 CPUs (see README); "none": leave it
    distributed: bool = False
    profile: bool = False


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class TargetConfig:
    """The published number a recipe aims at, and what it reaches on the embedded data."""
    metric: str = "top1"
    published: Optional[float] = None
    published_setting: str = ""
    source: str = ""
    embedded: Optional[float] = None  # measured on the embedded smoke data, stated in the recipe card


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    smoke: Dict[str, Any] = field(default_factory=dict)  # merged over the config when dataset.path is unset
    recipe_name: str = ""
    description: str = ""
    resume: Optional[str] = None      # train.py: "auto" (newest good checkpoint of the run directory) or a path
    checkpoint: Optional[str] = None  # eval.py: the checkpoint to evaluate
    output: Optional[str] = None      # eval.py: where to write metrics JSON


def apply_smoke(cfg):
    """With no dataset.path, a recipe whose real data is not embedded runs its `smoke` block instead:
    a short run on the embedded data that proves the recipe works, not the benchmark."""
    if cfg.dataset.path is not None or not cfg.smoke:
        return cfg, None
    from omegaconf import OmegaConf, open_dict
    smoke = OmegaConf.to_container(cfg.smoke)
    try:
        merged = OmegaConf.merge(cfg, smoke)
    except Exception as e:
        raise ConfigError(f"smoke: {_one_line(e)}") from None
    with open_dict(merged):
        merged.smoke = {}
    note = (f"SMOKE RUN: dataset.path is unset, so {cfg.recipe_name} runs on embedded {merged.dataset.name} data "
            f"with {smoke}; this proves the recipe works, it is not the benchmark. Set dataset.path to the "
            f"{cfg.dataset.name} files for the published schedule")
    return merged, note


def load_run_config(run_dir):
    """A run directory's config.yaml over the current schema (keys added since the run get their defaults)."""
    from omegaconf import OmegaConf
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(Path(run_dir) / "config.yaml"))


def register_schema() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


class ConfigError(ValueError):
    """A bad value in the configuration: the message names it and what would be valid."""


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def choices_hint(value: str, valid) -> str:
    valid = sorted(valid)
    close = difflib.get_close_matches(str(value), valid, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"


def validate(cfg) -> None:
    """Checks a type cannot express: registered names, sizes, paths, keep-list names."""
    from omegaconf import OmegaConf

    from amp.names import check_policy_names
    from amp.policy import check_device_dtype
    from data import DATASETS
    from models import MODELS, check_model_params
    from zoo.runtime import pick_device

    cfg, _ = apply_smoke(cfg)
    try:  # keys appended with "+key=value" escape Hydra's struct check
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg, resolve=False))
    except Exception as e:
        raise ConfigError(_one_line(e)) from None

    if cfg.model.name not in MODELS:
        raise ConfigError(f"model.name={cfg.model.name!r} is not a registered model; "
                          + choices_hint(cfg.model.name, MODELS))
    check_model_params(cfg.model.name, dict(cfg.model.params))
    if cfg.dataset.name not in DATASETS:
        raise ConfigError(f"dataset.name={cfg.dataset.name!r} is not a registered dataset; "
                          + choices_hint(cfg.dataset.name, DATASETS))
    for key in ("dataset.batch_size", "dataset.eval_batch_size", "trainer.epochs", "model.num_classes"):
        section, name = key.split(".")
        if cfg[section][name] < 1:
            raise ConfigError(f"{key}={cfg[section][name]} must be at least 1")
    if cfg.dataset.path is not None and not Path(cfg.dataset.path).expanduser().exists():
        if cfg.dataset.params.get("install"):  # data a system package provides (dataset.params.install says how)
            raise ConfigError(f"dataset.path={cfg.dataset.path!r} does not exist: install {cfg.dataset.params.install}, "
                              f"or set dataset.path to a folder with its files")
        raise ConfigError(f"dataset.path={cfg.dataset.path!r} does not exist; give a folder with the "
                          f"{cfg.dataset.name} files, or leave it unset for the embedded data")
    check_policy_names(cfg.amp)
    check_device_dtype(pick_device(str(getattr(cfg.runtime.device, "value", cfg.runtime.device))), cfg.amp)
    ls = cfg.amp.loss_scale
    for name in ("scale", "init_scale", "min_scale"):
        if ls[name] <= 0:
            raise ConfigError(f"amp.loss_scale.{name}={ls[name]} must be positive")
    if ls.factor < 2:
        raise ConfigError(f"amp.loss_scale.factor={ls.factor} must be at least 2")
    if ls.window < 1:
        raise ConfigError(f"amp.loss_scale.window={ls.window} must be at least 1")


def _one_line(exc: BaseException) -> str:
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


def check_command_line(argv: List[str], config_name: str = "config") -> None:
    """Compose and validate every run the command line asks for; on any error print one line, exit 2."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.startswith("-")]
    for a in overrides:
        if a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")):
            out = Path(a.split("=", 1)[1]).expanduser()
            existing = next((p for p in [out, *out.parents] if p.exists()), None)
            if out.exists() and not out.is_dir():
                fail(f"{a.split('=', 1)[0]}={out} is a file; give a directory for the run's files")
            if existing is not None and not os.access(existing, os.W_OK):
                fail(f"{a.split('=', 1)[0]}={out}: {existing} is not writable; give a directory you can write to")
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return  # Hydra's own flags (--help, --cfg, ...): let Hydra handle them
    try:
        if "-m" in argv or "--multirun" in argv:
            parsed = OverridesParser.create().parse_overrides(overrides)
            runs = [run for batch in BasicSweeper.split_arguments(parsed, None) for run in batch]
        else:
            runs = [overrides]
        for run in runs:
            validate(compose(run, config_name))
    except ConfigError as e:
        fail(str(e))
    except Exception as e:  # Hydra/OmegaConf composition errors
        fail(_one_line(e))
