"""A run directory belongs to one run.

- One process at a time: `claim` takes an exclusive lock on `.run.lock` in the directory (ampzoo.locks: flock on
  the file opened for writing, as NFSv4 needs; an O_EXCL lock file where the file system has no flock). The
  kernel drops an flock when the process ends, however it ends, so a killed run never leaves a stale lock; a
  fallback lock file left on this host by a dead process is taken over. A second process gets one line naming
  the process that holds it.
- A fresh start never overwrites a run: `refuse_fresh_start` stops a run without `resume` in a directory that
  holds a run's checkpoints or its metrics.json.
- The run's own config rules a resume (`resume_config`) and an evaluation of its checkpoints (`run_config_for`):
  a command-line key that would change the run is refused, naming the run's value.
- A translation run keeps the sentencepiece model its token ids come from (`keep_tokenizer`), and everything
  after its start uses that copy: a tokenizer trained again from changed data or a cleared cache would give its
  checkpoints other ids, and a plausible wrong BLEU.
"""
import dataclasses
import filecmp
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import OmegaConf, open_dict

from ampzoo import locks
from ampzoo.config import Config
from ampzoo.data import task
from ampzoo.data.translation import tokenizer_file
from ampzoo.engine.checkpoint import CHECKPOINT_NAME, checkpoints
from ampzoo.errors import ConfigError

HELD: Dict[Path, locks.Lock] = {}  # directory -> the lock this process holds until it ends

# What a resume may change: how long the run goes on, how it logs, where its data now is and the machine it runs
# on (a CPU run continued on an Ascend server, which refuses runtime.cpu_kernels=on, or on a CPU without bf16: the
# kernels and their products do not change what a checkpoint holds). Everything else (model, data, precision,
# loss scale, optimizer, schedule, batch) is the run's.
MAY_CHANGE = ("trainer.epochs", "trainer.max_steps", "trainer.eval_every", "trainer.ckpt_every",
              "trainer.save_every_steps", "trainer.keep_last", "trainer.log_every", "logger", "resume", "checkpoint",
              "output", "dataset.path", "runtime.profile", "runtime.device", "runtime.device_id", "runtime.onednn_isa",
              "runtime.cpu_kernels", "runtime.cpu_compute", "runtime.cpu_threads", "runtime.cpu_pool_spin_us",
              "runtime.cpu_weight_grad", "runtime.cpu_half_isa")
TOKENIZER = "tokenizer.model"  # a translation run's own copy of its sentencepiece model (keep_tokenizer)
SPM_MODEL = "dataset.params.spm_model"


def resume_configs(run_dir) -> List[Path]:
    """The config.resume-N.yaml a run's resumes wrote beside its config.yaml, oldest first (N as a number)."""
    found = [p for p in Path(run_dir).glob("config.resume-*.yaml") if p.stem.removeprefix("config.resume-").isdigit()]
    return sorted(found, key=lambda p: int(p.stem.removeprefix("config.resume-")))


def load_run_config(run_dir, latest: bool = False):
    """A run directory's config.yaml over the current schema (keys added since the run get their defaults, keys
    removed since are dropped); a missing, empty or unreadable one is one ConfigError naming it. `latest`: the
    config its last process ran with (a resume writes config.resume-N.yaml beside config.yaml, with the keys it
    may change, such as trainer.epochs, as it ran). A run that keeps its tokenizer reads it from its own copy,
    wherever the run directory is now (config.yaml names the copy where the run was)."""
    path = Path(run_dir) / "config.yaml"
    if latest and path.is_file():
        path = (resume_configs(run_dir) or [path])[-1]
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: not a train.py run directory (give the folder that "
                          f"holds config.yaml, checkpoints/ and train.log)")
    try:
        saved = OmegaConf.load(path)
        if not OmegaConf.is_dict(saved) or len(saved) == 0:
            raise ValueError("it holds no settings")
        schema = OmegaConf.structured(Config)
        cfg = OmegaConf.merge(schema, still_known(OmegaConf.to_container(saved), schema))
    except Exception as e:  # noqa: BLE001  (YAML, OmegaConf and schema errors alike)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path} cannot be read as the run's config ({msg}); it is written by train.py: "
                          f"restore it, or start a new run in another hydra.run.dir") from None
    kept = kept_tokenizer(run_dir)
    if kept is not None:
        OmegaConf.update(cfg, SPM_MODEL, str(kept), force_add=True)
    return cfg


def still_known(saved: dict, schema) -> dict:
    """`saved` without the keys the schema no longer has; free-form blocks (model.params, smoke) stay whole."""
    if not OmegaConf.is_config(schema) or not dataclasses.is_dataclass(OmegaConf.get_type(schema)):
        return saved
    known = set(schema.keys())  # `in` on a DictConfig is False for a key whose default is MISSING
    return {k: still_known(v, schema[k]) if isinstance(v, dict) else v for k, v in saved.items() if k in known}


LOCK_FILE = ".run.lock"  # in the run directory: the file `claim` locks (ampzoo.locks)


def claim(directory, what: str = "run directory") -> Path:
    """Create `directory` if need be and hold it for this process; a directory another process holds is a
    ConfigError naming that process. Claiming one directory twice in a process is a no-op. The lock is
    ampzoo.locks's: flock on a file opened for writing (NFSv4 refuses it on a read-only descriptor), or an O_EXCL
    lock file where the file system has no flock (Lustre without -o flock, NFS without a lock manager)."""
    path = Path(directory).expanduser().resolve()
    if path in HELD:
        return path
    path.mkdir(parents=True, exist_ok=True)
    try:
        HELD[path] = locks.acquire(path / LOCK_FILE)
    except locks.LockHeld as e:
        stale = (f"; if that run has ended (a killed process leaves this file), remove {e.path}" if e.fallback
                 else "")
        raise ConfigError(f"{what} {directory} is in use by {e.holder}: a directory holds one run at a time; wait "
                          f"for it to end, or give another directory{stale}") from None
    except locks.LockFailed as e:  # not a full disk: the file system takes no lock of either kind here
        raise ConfigError(f"{what} {directory} cannot be locked ({e.strerror}); give a hydra.run.dir on a file "
                          f"system that takes locks (NFS with its lock manager, Lustre mounted with -o flock, a local "
                          f"disk)") from None
    return path


def claim_by_rank0(directory, rank: int, agree) -> None:
    """Under msrun: rank 0 holds the run directory for the whole run, and every rank learns whether it could
    (`agree(flag)`: whether any rank's flag is set, an all-reduce), so a refused run ends on every rank with one
    line instead of leaving the others waiting in their first collective."""
    error = None
    if rank == 0:
        try:
            claim(directory)
        except ConfigError as e:
            error = e
    if agree(error is not None):
        raise error or ConfigError(f"run directory {directory} is in use by another run (rank 0's log names the "
                                   f"process); wait for it to end, or give another hydra.run.dir")


def release(directory) -> None:
    held = HELD.pop(Path(directory).expanduser().resolve(), None)
    if held is not None:
        held.release()


def describe(directory: Path) -> Optional[str]:
    """'lenet_o0, step 2,811, finished' for a directory that holds a run; None for one that does not."""
    found = checkpoints(directory / "checkpoints") if (directory / "checkpoints").is_dir() else []
    finished = (directory / "metrics.json").exists()
    if not found and not finished:
        return None
    recipe = None
    if (directory / "config.yaml").exists():
        try:
            recipe = OmegaConf.load(directory / "config.yaml").get("recipe_name")
        except Exception:  # noqa: BLE001  (an unreadable config still leaves a run worth keeping)
            recipe = None
    parts = [str(recipe or "recipe unknown")]
    if found:
        parts.append(f"step {int(CHECKPOINT_NAME.fullmatch(found[-1].name).group(2)):,} in {len(found)} checkpoint(s)")
    parts.append("finished" if finished else "not finished")
    return ", ".join(parts)


def refuse_fresh_start(directory) -> None:
    """A run started without `resume` in a directory that already holds a run would prune its checkpoints and
    replace its metrics: refuse, and say the two ways on."""
    directory = Path(directory).expanduser()
    held = describe(directory)
    if held:
        raise ConfigError(f"{directory} already holds a run ({held}); continue it with resume=auto, or give another "
                          f"hydra.run.dir to start anew")


def may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def _with_given(run, cfg, keys: List[str]):
    """The run's config with the command line's values of `keys`."""
    out = OmegaConf.create(OmegaConf.to_container(run, resolve=True))
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        OmegaConf.update(out, key, _plain(value), force_add=True, merge=False)
    return out


def resume_config(cfg, given: List[str], run_dir) -> tuple:
    """The config a resume runs with: the run's own config.yaml, with the command line's keys that may change
    (MAY_CHANGE). A key that would change the run is refused, naming the run's value. Returns (config, the keys
    taken from the command line)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        return cfg, []
    run = load_run_config(run_dir)
    if "recipe" in given and cfg.recipe_name != run.recipe_name:
        raise ConfigError(f"resume: recipe={cfg.recipe_name}, but {run_dir} holds a {run.recipe_name} run; resume "
                          f"it without recipe= (its own config.yaml is used), or give another hydra.run.dir")
    taken = []
    keeps = kept_tokenizer(run_dir) is not None  # a tokenizer given is compared by content (keep_tokenizer), not path
    for key in given:
        if key == "recipe":
            continue
        mine, theirs = _plain(OmegaConf.select(cfg, key)), _plain(OmegaConf.select(run, key))
        if keeps and SPM_MODEL.startswith(key + "."):  # `dataset=GROUP` again: the run's copy is its spm_model
            mine, theirs = _without(mine, SPM_MODEL[len(key) + 1:]), _without(theirs, SPM_MODEL[len(key) + 1:])
        if may_change(key) or (keeps and key == SPM_MODEL):
            taken.append(key)
        elif mine != theirs:
            raise ConfigError(f"resume: {key}={mine} would change the run, which has {key}={theirs} "
                              f"({run_dir / 'config.yaml'}); a resume continues a run as it was started: drop "
                              f"{key}, or start a new run in another hydra.run.dir")
    out = _with_given(run, cfg, taken + ["resume"])
    return OmegaConf.merge(run, out), taken


def _without(tree, path: str):
    """A plain config tree without the key at the dotted `path` in it."""
    head, _, rest = path.partition(".")
    if not isinstance(tree, dict) or head not in tree:
        return tree
    if not rest:
        return {k: v for k, v in tree.items() if k != head}
    return {**tree, head: _without(tree[head], rest)}


def _plain(value):
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return str(value) if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)) else value


def run_of_checkpoint(checkpoint) -> Optional[Path]:
    """The run directory a train.py checkpoint lives in (<run>/checkpoints/<name>.ckpt), if it has a config."""
    run = Path(str(checkpoint)).expanduser().resolve().parent.parent
    return run if (run / "config.yaml").exists() else None


def kept_tokenizer(run_dir) -> Optional[Path]:
    """The run's own copy of its tokenizer (`keep_tokenizer`), or None (not a translation run, or one from before
    runs kept it)."""
    kept = Path(run_dir) / TOKENIZER
    return kept.resolve() if kept.is_file() else None


def find_tokenizer(cfg, run_dir, resuming: bool) -> None:
    """Before init(), under msrun: a translation run finds or builds its tokenizer on every host (the cache's lock
    makes the ranks of one host build it once), so that no rank then waits in a collective while another trains
    sentencepiece single-threaded (WMT14: minutes to an hour, past HCCL's timeout). A resume that keeps its copy
    needs none; a single process finds it where it keeps it (keep_tokenizer)."""
    kept = resuming and (Path(run_dir) / TOKENIZER).is_file()
    if cfg.runtime.distributed and task(cfg) == "translation" and not kept:
        tokenizer_file(cfg.dataset)


def keep_tokenizer(cfg, run_dir, rank: int, resuming: bool, wait=None) -> None:
    """Point `cfg.dataset.params.spm_model` at the run's own copy of its tokenizer (run_dir/tokenizer.model).
    A new run (no checkpoint to continue): rank 0 copies in the model `tokenizer_file(cfg.dataset)` gives (the one
    given, or the cached one trained on the data), over any copy a start that saved nothing left. A resume uses
    the copy (a run from before runs kept one: rank 0 copies it in); a different spm_model given with it is
    refused (`check_tokenizer`). Under msrun, `wait(False)` (an all-reduce every rank calls) holds every rank until
    rank 0's copy is in place, and every rank then reads that copy: on several servers each has its own cache
    (~/.cache/amp_zoo), and a tokenizer trained again on each would give the ranks the same ids only by luck.
    Every rank found its tokenizer before init() (find_tokenizer), so that wait is a copy's, not a build's."""
    kept = Path(run_dir) / TOKENIZER
    if resuming and kept.is_file():
        check_tokenizer(cfg.dataset, kept)
    elif rank == 0:
        source = tokenizer_file(cfg.dataset)
        tmp = kept.with_name(f".{TOKENIZER}.tmp{os.getpid()}")
        shutil.copyfile(source, tmp)
        os.replace(tmp, kept)  # atomic: a half-copied tokenizer is never the run's
    if wait is not None:
        wait(False)
    if not kept.is_file():
        if wait is None:  # a rank of a launcher other than msrun's: the model it builds itself
            return
        raise ConfigError(f"rank {rank} cannot see {kept}, the tokenizer rank 0 keeps for the run: every rank must "
                          f"see the run directory (a file system shared by every server)")
    with open_dict(cfg):
        cfg.dataset.params.spm_model = str(kept.resolve())


def same_tokenizer(model, kept: Path) -> bool:
    """Whether the sentencepiece model file `model` is `kept`, by content (a copy elsewhere is the same model)."""
    return filecmp.cmp(Path(str(model)).expanduser(), kept, shallow=False)


def check_tokenizer(dataset_cfg, kept: Path) -> None:
    """A spm_model given for a run that keeps its tokenizer: refused unless it is the same model, since another
    would change the token ids the checkpoints were trained on (a plausible wrong BLEU)."""
    given = dataset_cfg.params.get("spm_model")
    if given and not same_tokenizer(tokenizer_file(dataset_cfg), kept):
        raise ConfigError(f"dataset.params.spm_model={given} is not the tokenizer this run was trained with "
                          f"({kept}); drop it (the run's own is used), or train a new run with it")


def run_config_for(cfg, given: List[str]) -> tuple:
    """eval.py and export.py: a checkpoint written by train.py is evaluated with its run's config.yaml, and the
    command line's keys over it. A `recipe=` that contradicts the run, or a tokenizer other than the one it kept,
    is refused. Returns (config, note or None)."""
    run_dir = run_of_checkpoint(cfg.checkpoint) if cfg.checkpoint else None
    if run_dir is None:
        return cfg, None
    run = load_run_config(run_dir)
    if "recipe" in given and cfg.recipe_name != run.recipe_name:
        raise ConfigError(f"recipe={cfg.recipe_name}, but checkpoint={cfg.checkpoint} belongs to a {run.recipe_name} "
                          f"run ({run_dir / 'config.yaml'}); drop recipe= to use it as it was trained")
    out = OmegaConf.merge(run, _with_given(run, cfg, [k for k in given if k != "recipe"] + ["checkpoint", "output"]))
    if "runtime.distributed" not in given and "runtime" not in given:  # eval.py and export.py are one process,
        OmegaConf.update(out, "runtime.distributed", False)  # whatever the run trained on (runtime.device_id holds)
    kept = kept_tokenizer(run_dir)
    if kept is not None:  # the run's own, though a `dataset=` group is given; another one given is refused
        check_tokenizer(out.dataset, kept)
        OmegaConf.update(out, SPM_MODEL, str(kept), force_add=True)
    return out, f"using the config of the run it belongs to: {run.recipe_name} ({run_dir / 'config.yaml'})"
