"""`load_config(argv)`: the one way every entry point (train.py, eval.py, export.py, amp.report, amp.audit,
amp.search, bench) gets its run: compose recipe and overrides, apply the recipe's smoke block under the
user's own keys, and check every value before anything compiles. Any failure is a ConfigError: one line.
"""
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from omegaconf import OmegaConf, open_dict

from ampzoo.amp.names import check_policy_names
from ampzoo.amp.policy import check_device_dtype, keep_fp32_names
from ampzoo import data  # (and registers the datasets)
from ampzoo.compose import check_shadowed, check_slips, compose, expand_home, hydra_flags, one_line, sweep
from ampzoo.config import Config, RANGES, SPECIAL
from ampzoo.errors import ConfigError, fail
from ampzoo.paths import check_writable
from ampzoo.registry import DATASETS, MODELS
from ampzoo.runtime import msrun_env, pick_device
from ampzoo.models import check_model, import_plugins, model_args  # (and registers the models)


def load_config(argv: List[str], composed=None, smoke: bool = True,
                needs_data: bool = True) -> Tuple[object, Optional[str]]:
    """(config, smoke note or None) for the command line `argv` (Hydra overrides); `composed`: the config
    @hydra.main already composed from the same overrides; smoke=False: the recipe as written even without
    dataset.path (benchmarks of the full-size network on synthetic batches); needs_data=False: a tool that
    only builds the network (amp.report) accepts a dataset.path that is not on this machine."""
    argv = expand_home(argv)
    if composed is None:
        no_hydra_flags(argv)
    check_slips(argv)
    import_plugins()
    try:
        cfg = composed if composed is not None else compose(argv)
    except Exception as e:  # noqa: BLE001  (Hydra/OmegaConf composition errors)
        raise ConfigError(one_line(e, argv)) from None
    if composed is not None:  # compose() checks its own; @hydra.main's choices are in its HydraConfig
        from hydra.core.hydra_config import HydraConfig
        hydra = HydraConfig.get()  # its task overrides leave out hydra.searchpath, which says where yours are
        check_shadowed(dict(hydra.runtime.choices), [*argv, *hydra.overrides.hydra])
    cfg, note, kept = apply_smoke(cfg, user_keys(argv)) if smoke else (cfg, None, [])
    try:
        validate(cfg, needs_data)
    except ConfigError as e:
        if kept:
            raise ConfigError(f"{e}; this run is {cfg.recipe_name}'s smoke block (dataset.path unset) with your "
                              f"{', '.join(kept)} kept over the block's own value") from None
        raise
    cfg.description = describe(cfg, argv) + overrides_note(cfg)
    return cfg, note


def overrides_note(cfg) -> str:
    """A plugin's model or dataset registered over a shipped one's name (`override=True`): the description, which
    the log's first lines and config.yaml carry, says whose runs."""
    replaced = [(kind, name, registry.overridden[name]) for kind, name, registry in
                (("model", cfg.model.name, MODELS), ("dataset", cfg.dataset.name, DATASETS))
                if name in registry.overridden]
    return "".join(f" [{kind} {name!r} is {where}, registered with override=True over the shipped one]"
                   for kind, name, where in replaced)


def no_hydra_flags(argv: List[str]) -> None:
    """The commands that are not Hydra applications (eval.py, export.py, the amp tools) take key=value overrides
    only: a Hydra flag there is one line, not silently dropped."""
    flags = hydra_flags(argv)[0]
    if flags:
        raise ConfigError(f"{flags[0]}: this command takes key=value overrides only (Hydra's flags, such as --cfg "
                          f"job, are train.py's)")


# Keys that say how a run is driven, not what it trains: a description need not name them.
DRIVING = ("trainer.", "logger.", "runtime.", "search.", "decode.", "infer.", "hydra.", "resume", "checkpoint",
           "output", "weights", "description", "recipe", "dataset.path")


def describe(cfg, argv: List[str]) -> str:
    """The description a user reads (the first log line, config.yaml) for what runs: the recipe's own, with its
    precision and loss-scale parts derived from the config when the command line changes `amp`, and the other
    keys that change what is trained named after it (the description the user gave stays as given)."""
    given = [a.lstrip("+") for a in argv if "=" in a and not a.startswith(("-", "~"))]
    keys = [a.split("=", 1)[0] for a in given]
    text = str(cfg.description or cfg.recipe_name)
    if "description" in keys:
        return text
    if any(k == "amp" or k.startswith("amp.") for k in keys):
        amp = cfg.amp
        level, low = str(amp.level), "fp16" if str(amp.dtype) == "float16" else "bf16"
        keep = [] if level in ("O0", "O1") else (keep_fp32_names(amp))
        precision = "O0 fp32" if level == "O0" else f"{level} {low}" + (f" ({', '.join(keep)} fp32)" if keep else "")
        kind = str(amp.loss_scale.type)
        scale = {"none": [], "fixed": [f"fixed loss scale {amp.loss_scale.scale:g}"],
                 "dynamic": ["dynamic loss scale"]}[kind]
        parts = text.split(" / ")
        text = " / ".join(parts[:2] + [precision] + scale) if len(parts) >= 3 else " / ".join([text, precision] + scale)
    other = [a for a, k in zip(given, keys) if not k.startswith("amp") and not k.startswith(DRIVING)]
    return text + (f" (with {' '.join(other)})" if other else "")


def user_keys(argv: List[str]) -> List[str]:
    """The config keys a command line sets (`key=value`, `+key=value`, `++key=value`; a group choice such as
    `model=resnet34` sets the whole `model` section)."""
    keys = []
    for arg in argv:
        if "=" in arg and not arg.startswith(("-", "~", "hydra.")):
            keys.append(arg.split("=", 1)[0].lstrip("+"))
    return keys


def flatten(tree: Dict, prefix: str = "") -> Dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def apply_smoke(cfg, given: List[str] = ()) -> Tuple[object, Optional[str], List[str]]:
    """With no dataset.path, a recipe whose real data is not embedded runs its `smoke` block instead: a short
    run on the embedded data that proves the recipe works, not the benchmark. Keys the user gave win over the
    block. Returns (config, note listing what the block changed, the user's keys kept over it)."""
    ignored = [u for u in given if u == "smoke" or u.startswith("smoke.")]
    if cfg.dataset.path is not None and ignored:  # nothing on the command line is silently ignored
        raise ConfigError(f"{ignored[0]} applies only to the smoke run (dataset.path unset); with "
                          f"dataset.path={cfg.dataset.path} set the key itself ({ignored[0].removeprefix('smoke.')})")
    if cfg.dataset.path is not None or not cfg.smoke:
        return cfg, None, []
    smoke = flatten(OmegaConf.to_container(cfg.smoke))
    kept = sorted({u for u in given for k in smoke if overlaps(k, u)})
    applied = {k: v for k, v in smoke.items() if not any(overlaps(k, u) for u in kept)}
    nested: Dict = {}
    for key, value in applied.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        merged = OmegaConf.merge(cfg, nested)
    except Exception as e:  # noqa: BLE001  (an OmegaConf merge error of any kind)
        raise ConfigError(f"smoke: {one_line(e)}") from None
    with open_dict(merged):
        merged.smoke = {}
    changes = ", ".join(f"{k}={v}" for k, v in applied.items())
    note = (f"SMOKE RUN: dataset.path is unset, so {cfg.recipe_name} runs on embedded {merged.dataset.name} data; "
            f"the recipe's smoke block set {changes}" + (f" (your {', '.join(kept)} kept)" if kept else "")
            + f". This proves the recipe works, it is not the benchmark: set dataset.path to the "
            f"{cfg.dataset.name} files for the published schedule")
    return merged, note, kept


def overlaps(a: str, b: str) -> bool:
    """Whether two dotted keys name the same setting, or one holds the other (`model` and `model.params.d_model`)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def check_ranges(cfg) -> None:
    """Every number of the schema within its range (ampzoo/config.py RANGES), and finite: NaN compares false with
    any bound, so `optimizer.lr=nan` passed and the run then diverged as if precision were the cause."""
    for key, (low, high) in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is None or value in SPECIAL.get(key, ()):
            continue
        exclusive = isinstance(low, float) and low == 0.0
        too_low = low is not None and (value <= low if exclusive else value < low)
        if too_low or (high is not None and value > high) or not math.isfinite(value):
            if exclusive:
                valid = "positive" + (f" and at most {high}" if high is not None else "")
            elif high is None:
                valid = f"at least {low}"
            else:
                valid = f"from {low} to {high}"
            also = f" (or {', '.join(map(str, SPECIAL[key]))})" if key in SPECIAL else ""
            finite = "" if math.isfinite(value) else "a finite number, "
            raise ConfigError(f"{key}={value} must be {finite}{valid}{also}")
    for key, (valid, words) in LIST_RANGES.items():
        values = list(OmegaConf.select(cfg, key) or [])
        if not all(map(valid, values)):  # NaN fails every comparison
            raise ConfigError(f"{key}={values}: each value must be {words}")
    check_finite(cfg)


# Lists of numbers: what each value must be, and that in words.
LIST_RANGES = {"optimizer.betas": (lambda v: 0 <= v < 1, "from 0 to below 1"),
               "dataset.std": (lambda v: v > 0, "positive (the images are divided by it)")}


def check_finite(cfg) -> None:
    """Every other number a config holds (model.params, a plugin's keys, target) is finite: one line naming it."""
    for key, value in flatten(OmegaConf.to_container(cfg, resolve=False)).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key}={value} is not a finite number; give one")


def validate(cfg, needs_data: bool = True) -> None:
    """Checks a type cannot express: ranges, registered names, sizes, paths, keep-list names."""
    try:  # keys appended with "+key=value" escape Hydra's struct check
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg, resolve=False))
    except Exception as e:  # noqa: BLE001  (OmegaConf's validation errors of any kind)
        raise ConfigError(one_line(e)) from None
    check_ranges(cfg)
    check_cpu_compute(cfg)
    DATASETS.get(cfg.dataset.name, "dataset.name")
    check_model(cfg)  # the registered name first, then the model's own check
    meta = DATASETS.meta(cfg.dataset.name)
    if needs_data:
        check_image_folder(cfg, meta)
    check_channels(cfg)
    classes = meta.get("classes") or len(cfg.dataset.params.get("classes") or [])
    if classes and cfg.model.num_classes != classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} does not match the {classes} classes of "
                          f"dataset {cfg.dataset.name}; set model.num_classes={classes}")
    on_disk = meta.get("classes_on_disk")  # an image folder: its class sub-folders are the labels
    found = on_disk(cfg.dataset.path) if needs_data and on_disk and cfg.dataset.path is not None else []
    if found and cfg.model.num_classes != len(found):
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} does not match the {len(found)} class folders "
                          f"of {Path(cfg.dataset.path).expanduser() / 'train'} ({', '.join(found[:3])}"
                          f"{', ...' if len(found) > 3 else ''}); set model.num_classes={len(found)}")
    if needs_data and cfg.dataset.path is not None and Path(cfg.dataset.path).expanduser().is_file():
        raise ConfigError(f"dataset.path={cfg.dataset.path!r} is a file; give the folder that holds the "
                          f"{cfg.dataset.name} files")
    if needs_data and cfg.dataset.path is not None and not Path(cfg.dataset.path).expanduser().exists():
        if cfg.dataset.params.get("install"):  # data a system package provides (dataset.params.install says how)
            raise ConfigError(f"dataset.path={cfg.dataset.path!r} does not exist: install "
                              f"{cfg.dataset.params.install}, or set dataset.path to a folder with its files")
        raise ConfigError(f"dataset.path={cfg.dataset.path!r} does not exist; give a folder with the "
                          f"{cfg.dataset.name} files, or leave it unset for the embedded data")
    check_devices(cfg)
    check_policy_names(cfg.amp)
    check_device_dtype(pick_device(str(cfg.runtime.device)), cfg.amp)


def check_cpu_compute(cfg) -> None:
    """An explicit runtime.cpu_compute the run cannot honour is not dropped without a word: bf16 products are the
    project's CPU kernels', which runtime.cpu_kernels=off turns off (train.py warns where the CPU lacks bf16)."""
    choice = str(cfg.runtime.cpu_compute)
    if choice in ("bf16", "bf16_backward") and str(cfg.runtime.cpu_kernels) == "off":
        raise ConfigError(f"runtime.cpu_compute={choice} asks the project's CPU kernels for bf16 products, but "
                          f"runtime.cpu_kernels=off runs MindSpore's kernels, which multiply fp16 in fp32; drop one "
                          f"of the two")


def check_image_folder(cfg, meta: dict) -> None:
    """A folder of images in class sub-folders given to a reader of another format (a Fashion-MNIST recipe's
    idx reader, say) is one line naming the reader that reads it, not an error about its idx files or classes."""
    folder_reader = next((n for n in DATASETS if DATASETS.meta(n).get("classes_on_disk")), None)
    if cfg.dataset.path is None or meta.get("classes_on_disk") or meta.get("reads_folders") or folder_reader is None:
        return
    found = DATASETS.meta(folder_reader)["classes_on_disk"](cfg.dataset.path)
    if found:
        raise ConfigError(f"dataset.path={cfg.dataset.path} is a folder of images in class sub-folders (train/"
                          f"{found[0]}/, ...), which dataset {cfg.dataset.name} does not read; add "
                          f"dataset={folder_reader} (the image-folder reader) and model.num_classes={len(found)}")


def check_channels(cfg) -> None:
    """The data's channels (data.channels) are the ones the network's first convolution takes: a mismatch is one
    line before anything compiles, not a shape error at the first step."""
    data.check_channels(cfg)
    given, args = data.channels(cfg), model_args(cfg)
    if given is None or "in_channels" not in args or args["in_channels"] == given:
        return
    how = f"dataset.channels={cfg.dataset.channels}" if cfg.dataset.channels else f"dataset {cfg.dataset.name}"
    fix = (f"set model.params.in_channels={given} (a weight's first convolution is adapted to it when a run starts "
           f"from one)")
    if args["in_channels"] in (1, 3):
        fix += f", or read the images with dataset.channels={args['in_channels']}"
    raise ConfigError(f"model.params.in_channels={args['in_channels']} does not fit the {given}-channel images of "
                      f"{how}; {fix}")


def check_devices(cfg) -> None:
    """Settings that would go wrong only on a device (and so never show on a CPU test machine)."""
    if cfg.trainer.sink and cfg.trainer.sink_size != -1:
        raise ConfigError(f"trainer.sink_size={cfg.trainer.sink_size}: MindSpore counts each sink as an epoch, so "
                          f"epochs, evaluation, checkpoints, resume and the schedule would all change units; leave "
                          f"it at -1 (one sink per epoch), or set trainer.sink=false to feed steps one by one")
    launched = msrun_env()
    if launched and not cfg.runtime.distributed:
        raise ConfigError(f"msrun started this process ({', '.join(f'{k}={v}' for k, v in launched.items())}) but "
                          f"runtime.distributed=false: every worker (and msrun's scheduler) would train alone as rank "
                          f"0 of 1 into the same run directory; add runtime.distributed=true")
    if cfg.runtime.distributed and cfg.runtime.device_id is not None:
        raise ConfigError(f"runtime.device_id={cfg.runtime.device_id} with runtime.distributed=true would put every "
                          f"rank on device {cfg.runtime.device_id}; leave runtime.device_id unset (msrun gives each "
                          f"rank its own device)")


def check_command_line(argv: List[str], single: bool = True) -> None:
    """Check train.py's command line: its slips, where its runs will write, and every run it asks for, composed
    (each run of a -m sweep, before the first starts); on any error print one line and exit 2, before Hydra
    creates a run directory. single=False: a command line of one run is composed by Hydra alone, and checked
    there (train.py's main), so that it is composed once."""
    try:
        check_slips(argv)
    except ConfigError as e:
        fail(str(e))
    flags, overrides = hydra_flags(expand_home(argv))
    if any(f not in ("-m", "--multirun", "-r", "--run") for f in flags):
        return  # Hydra's own flags that print or change the config (--cfg, --info, -cn, ...): Hydra handles them
    dirs = [a.split("=", 1) for a in overrides if a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    if msrun_env() and not dirs:  # the default directory names the process id: no two ranks would share it
        fail("msrun started this process, but no hydra.run.dir is given: each process's default run directory "
             "(runs/<recipe>/<time>-<pid>) is its own, so the ranks would not share their checkpoints; give "
             "hydra.run.dir=DIR")
    try:  # where the run will write, before anything is composed or compiled
        for key, value in dirs:
            check_writable(value, key, folder=True)
        if not dirs:
            check_writable("runs", "runs", folder=True)
    except ConfigError as e:
        fail(f"{e} (the default run directory is under runs/; or give hydra.run.dir=DIR)" if not dirs else str(e))
    try:
        multirun = "-m" in flags or "--multirun" in flags
        for run in sweep(overrides) if multirun else [overrides] if single else []:
            load_config(run)
    except ConfigError as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001  (Hydra's override grammar)
        fail(one_line(e))
