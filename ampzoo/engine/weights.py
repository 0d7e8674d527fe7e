"""Shipped weights: `weights/<name>.ckpt`, inference weights only (no optimizer moments, no loss-scale state),
each with an entry in `weights/MANIFEST.json` that says where it came from and what it scores.

`eval.py weights=NAME` (or `weights=PATH/NAME.ckpt`, with its MANIFEST.json beside it) checks the file's full
sha256 before anything loads it, then evaluates it with the config it was trained with: its recipe and
overrides from the manifest, the command line's keys over them. A missing file, a changed or corrupt one, an
unknown name and a `recipe=` of another recipe are each one line.
"""
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

from ampzoo.compose import expand_home, hydra_flags
from ampzoo.engine.load import load_config, no_hydra_flags, user_keys, validate
from ampzoo.engine.rundir import load_run_config, run_config_for, run_of_checkpoint
from ampzoo.errors import ConfigError, choices_hint
from ampzoo.paths import check_writable

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"
MANIFEST = "MANIFEST.json"
FIELDS = ("file", "sha256", "bytes", "parameters", "dtype", "recipe", "overrides", "commit", "mindspore", "machine",
          "metric", "published", "command")


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path = WEIGHTS) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable weights manifest: {e}") from None


def find(spec: str) -> Tuple[str, dict, Path]:
    """(name, manifest entry, file) for `weights=NAME` (in weights/) or `weights=PATH/NAME.ckpt`, its sha256
    checked."""
    given = Path(spec).expanduser()
    if given.suffix == ".ckpt" or "/" in spec:
        folder, name = given.parent, given.stem
        entries = read_manifest(folder)
        if not entries:
            raise ConfigError(f"weights={spec}: no {MANIFEST} beside it; give a shipped weight's name "
                              f"({', '.join(sorted(read_manifest())) or 'none shipped'}) or its file in weights/")
    else:
        folder, name, entries = WEIGHTS, spec, read_manifest()
    if name not in entries:
        raise ConfigError(f"weights={spec} is not a shipped weight; " + choices_hint(name, entries))
    entry = entries[name]
    path = folder / entry["file"]
    shipped = [(path, entry["sha256"])]
    if "tokenizer" in entry:  # a translation weight's sentencepiece model
        shipped.append((folder / entry["tokenizer"]["file"], entry["tokenizer"]["sha256"]))
    for file, expected in shipped:
        if not file.is_file():
            raise ConfigError(f"weights={spec}: {file} is missing; restore it (git checkout -- {file.name} in "
                              f"{folder}) or train it again with the recipe {entry['recipe']}")
        actual = sha256(file)
        if actual != expected:
            raise ConfigError(f"weights={spec}: {file} fails its sha256 check (expected {expected[:16]}..., got "
                              f"{actual[:16]}...): the file is corrupt or was changed; restore it from the repository")
    return name, entry, path


def shipped_tokenizer(entry: dict, path: Path) -> Optional[Path]:
    """A translation weight's shipped sentencepiece model (beside its checkpoint), or None."""
    return path.parent / entry["tokenizer"]["file"] if "tokenizer" in entry else None


def tokenizer_override(entry: dict, path: Path) -> List[str]:
    """A translation weight's shipped sentencepiece model as the override that makes the run use it."""
    model = shipped_tokenizer(entry, path)
    return [f"++dataset.params.spm_model={model}"] if model else []


def shipped_file(checkpoint) -> Optional[str]:
    """The manifest name of a checkpoint path inside a weights folder (a MANIFEST.json beside it lists it)."""
    path = Path(str(checkpoint)).expanduser()
    entries = read_manifest(path.parent) if path.parent.is_dir() else {}
    return next((name for name, e in entries.items() if e["file"] == path.name), None)


def shipped_copy(checkpoint) -> Optional[str]:
    """The name of the shipped weight a checkpoint file is a copy of (same size and sha256 as its manifest entry),
    or None. A file that bears a shipped weight's file name but matches none was altered: one line, since it
    would evaluate to a plausible wrong number under the shipped weight's name."""
    path = Path(str(checkpoint)).expanduser()
    entries = read_manifest()
    if not path.is_file() or not entries:
        return None
    size = path.stat().st_size
    same_size = [name for name, e in entries.items() if e.get("bytes") == size]
    digest = sha256(path) if same_size else None
    match = next((name for name in same_size if entries[name]["sha256"] == digest), None)
    if match:
        return match
    named = next((name for name, e in entries.items() if e["file"] == path.name), None)
    if named:
        raise ConfigError(f"checkpoint={path} bears the shipped weight {named}'s file name but not its sha256 "
                          f"(expected {entries[named]['sha256'][:16]}...): it was changed; use weights={named}, or "
                          f"rename the file if it is a checkpoint of your own")
    return None


def weights_argv(argv: List[str]) -> Tuple[List[str], Optional[Path], str]:
    """amp.audit and amp.report: the command line to compose, the checkpoint to load (None: the network's initial
    weights) and what weights these are, in words. A shipped weight (see `shipped`): its manifest's recipe and
    overrides under the command line's other keys. A train.py checkpoint: its run's recipe unless recipe= is
    given (as_trained then reads its whole config). Any other: the command line's recipe."""
    no_hydra_flags(argv)
    weight = shipped(argv)
    if weight is not None:
        return weight.overrides, weight.path, f"shipped weights {weight.name} ({weight.path}, sha256 verified)"
    rest = [a for a in argv if not a.lstrip("+").startswith(("weights=", "checkpoint="))]
    checkpoint = _value(argv, "checkpoint")
    if checkpoint not in (None, "", "null"):
        path = Path(checkpoint).expanduser()
        run = run_of_checkpoint(path)
        if run is not None and _value(argv, "recipe") is None:
            rest = [f"recipe={load_run_config(run).recipe_name}", *rest]
        return rest, path, f"checkpoint {path}"
    return rest, None, "freshly initialised"


def search_argv(argv: List[str]) -> List[str]:
    """amp.search: a shipped weight (see `shipped`) is searched under its own recipe and manifest overrides, the
    command line's other keys over them, as eval.py evaluates it (not the default recipe), and every training run
    of the search starts from it (weights=NAME). Any other command line as it is."""
    weight = shipped(argv)
    if weight is None:
        return argv
    print(weight.note, file=sys.stderr)
    return [*weight.overrides, f"weights={weight.name}"]


def as_trained(cfg, checkpoint: Optional[Path], argv: List[str]):
    """amp.audit and amp.report: a train.py checkpoint's network is its run's (its config.yaml, the command line's
    keys over it, as eval.py reads it), not the recipe as written: a run's num_classes, model.params or smoke
    model differ. Any other weights: cfg as composed."""
    if checkpoint is None or run_of_checkpoint(checkpoint) is None:
        return cfg
    cfg.checkpoint = str(checkpoint)
    return run_config_for(cfg, user_keys(argv))[0]


def checkpoint_config(argv: List[str], suffix: str = ".eval.json"):
    """eval.py and export.py: the config a checkpoint is used with, and the smoke note (or None). A shipped
    weight: its manifest's recipe, sha256 checked first, the command line's keys over it (any key of that
    recipe); a train.py checkpoint: its run's config.yaml; any other: the command line's recipe. Notes go to
    stderr."""
    no_hydra_flags(argv)
    if "resume" in user_keys(argv):
        raise ConfigError("resume is train.py's (it continues a training run); give checkpoint=FILE or weights=NAME")
    cfg, note = weights_config(argv, suffix)
    smoke_note = None
    if cfg is None:
        cfg, smoke_note = load_config(argv)
        cfg, note = run_config_for(cfg, user_keys(argv))
        if note:  # the run's config.yaml with the command line's keys over it: not validated yet
            validate(cfg)
            smoke_note = None if cfg.dataset.path else smoke_note
    if note:
        print(note, file=sys.stderr)
    if smoke_note:
        print(smoke_note, file=sys.stderr)
    return cfg, smoke_note


def _value(argv: List[str], key: str) -> Optional[str]:
    """The last value the command line gives `key` (`key=`, `+key=` or `++key=`), or None."""
    return next((a.split("=", 1)[1] for a in reversed(argv) if a.lstrip("+").startswith(key + "=")), None)


def shipped_spec(overrides: List[str]) -> Optional[str]:
    """The shipped weight a command line's overrides ask for: `weights=NAME`, or a `checkpoint=` that is a shipped
    file. Read off the command line itself: the weight's recipe, not the default one, decides which keys are valid."""
    weights, checkpoint = _value(overrides, "weights"), _value(overrides, "checkpoint")
    if weights not in (None, "", "null"):
        if checkpoint not in (None, "", "null"):
            raise ConfigError(f"weights={weights} and checkpoint={checkpoint}: give one")
        return weights
    return str(Path(checkpoint).expanduser()) if checkpoint and shipped_file(checkpoint) else None


class Shipped(NamedTuple):
    name: str
    entry: dict
    path: Path
    overrides: List[str]  # the weight's recipe and manifest overrides, its tokenizer, the command line's keys over them
    note: str  # what was verified and which recipe, in one line


def shipped(argv: List[str]) -> Optional[Shipped]:
    """The shipped weight a command line asks for, sha256 checked: `weights=NAME`, a `checkpoint=` that is a
    shipped file, or a copy of one elsewhere (known by its content). None when it asks for none. A `recipe=`
    other than the weight's own is one line: the manifest gives the recipe."""
    mine = hydra_flags(expand_home(argv))[1]
    spec, copy_of = shipped_spec(mine), None
    given = _value(mine, "checkpoint")
    if not spec and given not in (None, "", "null"):
        spec = copy_of = shipped_copy(given)
    if not spec:
        return None
    name, entry, path = find(spec)
    recipe = _value(mine, "recipe")
    if recipe is not None and recipe != entry["recipe"]:
        raise ConfigError(f"recipe={recipe}, but weights {name} were trained with the recipe "
                          f"{entry['recipe']}; drop recipe= (the manifest gives it)")
    mine = [a for a in mine if not a.lstrip("+").startswith(("recipe=", "weights=", "checkpoint="))]
    copy = f"checkpoint={given} is a copy of the shipped weight {name} (same sha256): " if copy_of else ""
    recipe = f"recipe {entry['recipe']} {' '.join(entry['overrides'])}".rstrip()
    return Shipped(name, entry, path,
                   [f"recipe={entry['recipe']}", *entry["overrides"], *tokenizer_override(entry, path), *mine],
                   f"{copy}weights {name}: sha256 verified; {recipe}")


def weights_config(argv: List[str], suffix: str = ".eval.json"):
    """eval.py / export.py: the config for a shipped weight (see `shipped`): its recipe and overrides, the command
    line's other keys over them, checkpoint set to the verified file, and output (unless given) under
    runs/weights/ rather than beside the file in the repository.
    Returns (config, note), or (None, None) when no shipped weight is asked for."""
    weight = shipped(argv)
    if weight is None:
        return None, None
    out, smoke_note = load_config([*weight.overrides, f"checkpoint={weight.path}",
                                   "decode.average_last=1"])  # averaged already
    if smoke_note is not None:  # the recipe's data ships in no package: the smoke data would score nonsense
        raise ConfigError(f"weights={weight.name}: {weight.entry['recipe']} needs its data; give dataset.path=FOLDER, "
                          f"as in {weight.entry['command']}")
    if out.output is None:
        out.output = str(Path("runs", "weights", weight.name + suffix))
        check_writable(Path(out.output).parent, "output (default)", folder=True)  # made when eval.py writes
    return out, weight.note


# Keys that say where the data is or how a command runs, not what it evaluates or exports: no file name needs them.
# The runtime keys that change the arithmetic (runtime.device, runtime.mode, runtime.cpu_kernels,
# runtime.cpu_compute, runtime.onednn_isa) are not among them: runtime.cpu_compute=bf16 moves a top-1 by a few
# hundredths, and its result must not replace the weight's own.
NEUTRAL = ("dataset.path", "dataset.params.test_prefix", "dataset.num_workers", "dataset.eval_batch_size",
           "decode.batch_size", "runtime.device_id", "runtime.profile", "runtime.distributed", "runtime.seed",
           "runtime.deterministic", "runtime.cpu_threads", "runtime.cpu_pool_spin_us", "runtime.cpu_weight_grad",
           "runtime.cpu_half_isa")


def overrides(argv: List[str]) -> List[str]:
    """The command line's keys over the checkpoint's (or shipped weight's) config, as given (eval.py records them)."""
    return [a for a in argv if "=" in a and not a.startswith("-") and
            not a.lstrip("+").startswith(("weights=", "checkpoint=", "output=", "recipe="))]


def override_tag(argv: List[str]) -> str:
    """eval.py's and export.py's default file names: the overrides that change what is evaluated or exported
    (amp.level=O0 -> "amp.level-O0"; a long list -> "overrides-<hash>"), "" when none, so that a result or file
    under another setting never replaces the plain one (a shipped weight's own)."""
    changed = [a.lstrip("+") for a in overrides(argv) if not a.lstrip("+").startswith(NEUTRAL)]
    tag = re.sub(r"[^A-Za-z0-9._,-]+", "-", ",".join(changed))
    return tag if len(tag) <= 48 else "overrides-" + hashlib.sha1(",".join(sorted(changed)).encode()).hexdigest()[:8]
