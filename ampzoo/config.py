"""The configuration schema: every key a recipe may set, with its type, its valid values and (RANGES) the
range of every number.

Hydra merges conf/ and recipes/ into `Config` (ampzoo/compose.py); OmegaConf then rejects unknown keys and
values outside an Enum before anything is imported from MindSpore; ampzoo/engine/load.py checks the rest.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import MISSING, OmegaConf

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"


@dataclass(frozen=True)
class Level:
    """One amp level: what runs in low precision by default. The schema, the policy (ampzoo/amp/policy.py), the
    fallback ladder (ampzoo/amp/fallback.py) and the report (amp/report/command.py) all read this table: a new level is
    a row."""
    low: str                        # "none": fp32; "white_list": MindSpore's O1 Cells (Conv, Dense, RNN cells);
                                    # "all": every Cell but the keep-list
    keep_fp32: Tuple[str, ...]      # the default keep-list (amp.keep_fp32=null)
    rank: int                       # how much runs in low precision: the fallback ladder only steps down


LEVELS: Dict[str, Level] = {
    "O0": Level("none", (), 0),                             # fp32 (force_fp16 Cells still run low)
    "O1": Level("white_list", (), 1),                       # fp32 but Conv, Dense, RNN cells (and force_fp16)
    "O2": Level("all", ("BatchNorm", "LayerNorm"), 2),      # low precision but the keep-list, which runs fp32
    "O3": Level("all", (), 3),                              # O2 with an empty default keep-list
}

AmpLevel = StrEnum("AmpLevel", {name: name for name in LEVELS})


class AmpDtype(StrEnum):
    float16 = "float16"
    bfloat16 = "bfloat16"


class LossScaleType(StrEnum):
    none = "none"
    fixed = "fixed"
    dynamic = "dynamic"


class Device(StrEnum):
    auto = "auto"
    CPU = "CPU"
    GPU = "GPU"
    Ascend = "Ascend"


class Mode(StrEnum):
    graph = "graph"
    pynative = "pynative"


class CpuKernels(StrEnum):  # ampzoo/engine/network.py
    auto = "auto"  # the cpu_kernels extension on the CPU where it is built, else MindSpore's kernels (one warning)
    on = "on"      # the extension, or an error where it cannot run
    off = "off"    # MindSpore's own kernels


class CpuCompute(StrEnum):  # ampzoo/engine/network.py set_cpu_compute; cpu_kernels.configure
    auto = "auto"                    # bf16 in training, fp32 in evaluation
    fp32 = "fp32"                    # an fp16 convolution or Dense computes in fp32 (what Cast + Conv2D gives)
    bf16 = "bf16"                    # it multiplies in bf16 on a CPU with AVX512-BF16 (oneDNN's bf16 kernels)
    bf16_backward = "bf16_backward"  # the same in the two backward passes only


class CpuWeightGrad(StrEnum):  # cpu_kernels.configure: a bf16 convolution's weight gradient
    auto = "auto"              # one matmul on small planes, else oneDNN's direct kernel (its OpenMP build if there),
                               # and between plain layers (LeNet's) the kernels' own
    direct = "direct"          # oneDNN's kernels only (never the matmul or the kernels' own)
    threadpool = "threadpool"  # never the OpenMP build: the matmul, or MindSpore's oneDNN on the kernels' pool


class CpuHalfIsa(StrEnum):  # cpu_kernels.configure: the fp16 <-> fp32 conversions (the same values either way)
    auto = "auto"          # AVX-512 or F16C where the CPU has them
    f16c = "f16c"          # at most F16C
    portable = "portable"  # portable code


class OptimizerName(StrEnum):
    momentum = "momentum"
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class ScheduleName(StrEnum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"
    step = "step"
    inverse_sqrt = "inverse_sqrt"


class LengthNorm(StrEnum):
    gnmt = "gnmt"         # score / ((5 + length) / 6) ** length_penalty (Wu et al. 2016; tensor2tensor)
    fairseq = "fairseq"   # score / length ** length_penalty, length counting EOS (fairseq --lenpen)


@dataclass
class ModelConfig:
    name: str = MISSING
    num_classes: int = 10
    params: Dict[str, Any] = field(default_factory=dict)  # extra constructor arguments, checked against its signature


@dataclass
class DatasetConfig:
    name: str = MISSING               # a registered dataset builder (ampzoo/data/__init__.py)
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
    eval_split: Optional[str] = None  # image folders: the folder evaluated (None: val/ for imagenet, test/ for cifar10)
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
    max_steps: int = 0                # > 0: stop after this many steps (batches; smoke runs, benchmarks)
    update_freq: int = 1              # batches whose gradients make one update (fairseq --update-freq)
    label_smoothing: float = 0.0
    ignore_index: int = -100          # label ignored by the loss (translation: 0, the padding id)
    eval_every: int = 1               # epochs; 0: only at the end
    ckpt_every: int = 1               # epochs; 0: only at the end
    save_every_steps: int = 0         # also a resume point every N steps inside an epoch (newest kept); 0: off
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


class ExportFormat(StrEnum):  # no AIR: deprecated by MindSpore (mindspore.export); convert a MINDIR for Ascend
    MINDIR = "MINDIR"
    ONNX = "ONNX"


@dataclass
class InferConfig:
    """eval.py and export.py."""
    fuse_conv_bn: bool = False        # fold Conv2d+BatchNorm2d pairs first (ampzoo/engine/fuse.py)
    format: ExportFormat = ExportFormat.MINDIR
    batch_size: int = 1               # export: the batch dimension of the exported inputs
    seq_len: int = 0                  # export, translation: the source and target length (0: the first test batch's)


@dataclass
class RuntimeConfig:
    device: Device = Device.auto
    device_id: Optional[int] = None  # None: MindSpore picks (0 alone; under msrun, each rank its own)
    mode: Mode = Mode.graph
    seed: int = 1
    deterministic: bool = False
    cpu_kernels: CpuKernels = CpuKernels.auto  # conv, batch norm and max-pool: the cpu_kernels extension or not
    cpu_compute: CpuCompute = CpuCompute.auto  # how the extension's fp16 convs and Dense layers multiply
    cpu_threads: int = 0              # the extension's threads; 0: the cores this process may use (msrun: shared)
    cpu_pool_spin_us: int = 200       # how long an idle thread of the extension spins before it sleeps
    cpu_weight_grad: CpuWeightGrad = CpuWeightGrad.auto  # how a bf16 convolution's weight gradient runs
    cpu_half_isa: CpuHalfIsa = CpuHalfIsa.auto  # the fp16 conversions' instructions (tests compare them)
    onednn_isa: str = "auto"          # auto: cap oneDNN at AVX2 on x86 CPUs unless the network has no MindSpore
                                      # convolution (see README); "none": leave it; or an ISA name (AVX2, ...)
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
class SearchConfig:
    """python -m amp.search: the most low precision a recipe takes within a tolerance of O0 (amp/search/command.py)."""
    tolerance: float = 0.5            # largest allowed drop against O0, in the metric's unit (top1: points)
    metric: str = ""                  # "": the recipe's target.metric; top1, top5, loss (lower is better), bleu...
    seeds: List[int] = field(default_factory=lambda: [1, 2])
    budget_epochs: int = 0            # every run's trainer.epochs; 0: the recipe's
    budget_steps: int = 0             # > 0: every run stops at this step (trainer.max_steps)
    pin_fp32: List[str] = field(default_factory=list)  # Cell classes or sub-module paths always in fp32
    pin_low: List[str] = field(default_factory=list)   # never kept in fp32 by the search
    out: str = ""                     # "": runs/search/<recipe>


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
    search: SearchConfig = field(default_factory=SearchConfig)
    smoke: Dict[str, Any] = field(default_factory=dict)  # merged over the config when dataset.path is unset
    recipe_name: str = ""
    description: str = ""
    resume: Optional[str] = None      # train.py: "auto" (newest good checkpoint of the run directory) or a path
    checkpoint: Optional[str] = None  # eval.py: the checkpoint to evaluate
    weights: Optional[str] = None     # eval.py/export.py: a shipped weight (weights/MANIFEST.json), sha256-checked
    output: Optional[str] = None      # eval.py: where to write metrics JSON


# The valid range of every number in the schema, checked before anything compiles: (low, high), either end
# None for unbounded; a low given as a float (0.0) is exclusive for floats that must be positive.
RANGES = {
    "model.num_classes": (1, None),
    "dataset.batch_size": (1, None), "dataset.max_tokens": (0, None), "dataset.eval_batch_size": (1, None),
    "dataset.image_size": (8, 4096), "dataset.channels": (0, 4), "dataset.num_workers": (1, 256),
    "dataset.test_fraction": (0.0, 1.0), "dataset.shift": (0, 64),
    "optimizer.lr": (0.0, None), "optimizer.reference_batch_size": (0, None), "optimizer.momentum": (0, 1),
    "optimizer.weight_decay": (0, None), "optimizer.eps": (0.0, None),
    "schedule.warmup_epochs": (0, None), "schedule.warmup_steps": (0, None), "schedule.min_lr": (0, None),
    "schedule.gamma": (0.0, 1),
    "amp.loss_scale.scale": (0.0, None), "amp.loss_scale.init_scale": (0.0, None), "amp.loss_scale.factor": (2, None),
    "amp.loss_scale.window": (1, None), "amp.loss_scale.min_scale": (0.0, None),
    "amp.fallback.overflow_rate": (0.0, 1), "amp.fallback.window": (1, None),
    "trainer.epochs": (1, None), "trainer.max_steps": (0, None), "trainer.update_freq": (1, None),
    "trainer.label_smoothing": (0, 1),
    "trainer.ignore_index": (-100, None), "trainer.eval_every": (0, None), "trainer.ckpt_every": (0, None),
    "trainer.save_every_steps": (0, None),
    "trainer.keep_last": (1, None), "trainer.sink_size": (-1, None), "trainer.log_every": (1, None),
    "decode.beam": (1, 64), "decode.length_penalty": (0, 10), "decode.average_last": (1, None),
    "decode.batch_size": (1, None),
    "infer.batch_size": (1, None), "infer.seq_len": (0, None),
    "runtime.device_id": (0, 63), "runtime.seed": (0, 2**31 - 1), "runtime.cpu_threads": (0, 1024),
    "runtime.cpu_pool_spin_us": (0, 1_000_000),
    "search.tolerance": (0, None), "search.budget_epochs": (0, None), "search.budget_steps": (0, None),
}
# Keys whose value may also be exactly this (outside the range): sink_size -1 is "a whole epoch".
SPECIAL = {"trainer.sink_size": (-1,)}


def register_schema() -> None:
    """The schema for conf/config.yaml's defaults, and the `${pid:}` its default run directory names: two runs
    started in the same second by different processes never share a directory."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid)
