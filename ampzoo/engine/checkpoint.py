"""Checkpoints: atomic writes, resume points, loading with errors that say which file is wrong and how."""
import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

import mindspore as ms
import mindspore.nn as nn
import numpy as np
from mindspore.train import Callback

from ampzoo.amp.policy import apply_policy, check_device_dtype
from ampzoo.amp.telemetry import crossed
from ampzoo.engine.fuse import fuse_conv_bn
from ampzoo.errors import ConfigError, write_error
from ampzoo.runtime import set_context
from ampzoo.engine.network import build_model, set_cpu_compute

log = logging.getLogger("amp_zoo")


def read_checkpoint(path) -> dict:
    path = Path(path).expanduser()
    if path.is_dir():
        found = checkpoints(path) or checkpoints(path / "checkpoints")
        newest = f" (the newest there: {found[-1]})" if found else ""
        raise ConfigError(f"checkpoint={str(path)!r} is a directory; give a .ckpt file{newest}")
    if not path.is_file():
        raise ConfigError(f"checkpoint={str(path)!r} does not exist; give a .ckpt file written by train.py "
                          f"(runs/<recipe>/<time>/checkpoints/)")
    if path.stat().st_size == 0:  # MindSpore would say its parameter dict is empty "after filter or specify"
        raise ConfigError(f"checkpoint={str(path)!r} is empty (0 bytes): a copy or a save that did not finish; take "
                          f"another checkpoint of the run")
    crc = has_crc(path)
    try:
        params = ms.load_checkpoint(str(path), crc_check=crc)
    except Exception as e:  # noqa: BLE001  (MindSpore raises ValueError or RuntimeError on a corrupt file)
        if crc and "crc check" in str(e.__cause__ or e):
            raise ConfigError(f"checkpoint={str(path)!r} fails its CRC32 check: a byte changed after train.py wrote "
                              f"it (a damaged disk or copy); it cannot be evaluated or trained from: take an earlier "
                              f"checkpoint of the run") from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"checkpoint={str(path)!r} is not a readable MindSpore checkpoint "
                          f"(truncated or corrupt?): {reason}") from None
    check_finite(params, path)
    return params


CRC_TRAILER = b"crc_num"  # what MindSpore's save_checkpoint(crc_check=True) ends a file with, before 10 bytes of CRC


def has_crc(path) -> bool:
    """Whether a checkpoint carries MindSpore's CRC32 (train.py's own do; a shipped weight is sha256-checked
    instead, and a checkpoint written before train.py saved one has none): then loading checks it."""
    try:
        with open(path, "rb") as f:
            f.seek(-17, os.SEEK_END)
            return f.read(7) == CRC_TRAILER
    except OSError:
        return False


class NonFinite(ConfigError):
    """A checkpoint that reads but holds NaN or inf: the run diverged before it was written."""


def check_finite(params: dict, path) -> None:
    """Every float value of a checkpoint is finite: NaN or inf weights would evaluate to a plausible wrong
    number, or train on from garbage. One line naming the file and the first bad parameter."""
    for name, value in params.items():
        if value.dtype in (ms.float16, ms.float32, ms.float64, ms.bfloat16):
            array = value.asnumpy() if value.dtype != ms.bfloat16 else value.float().asnumpy()
            if not np.isfinite(array).all():
                bad = int(np.size(array) - np.isfinite(array).sum())
                raise NonFinite(f"checkpoint={str(path)!r} holds non-finite values: {name} has {bad} NaN or inf "
                                  f"of {np.size(array)} (the first such parameter); it cannot be evaluated or "
                                  f"trained from: take an earlier checkpoint of the run")


def load_weights(net: nn.Cell, path, model_name: str, params: dict = None) -> dict:
    """Load the network's parameters (from `path`, or `params` already read); each must be there, same shape.
    Matched by Parameter name, as checkpoints store them: a network under an AMP policy's wrappers (O2's
    CastOutput) keeps those names, while its attribute paths gain a `cell.` prefix."""
    params = read_checkpoint(path) if params is None else params
    own = list(net.get_parameters())
    missing = [p.name for p in own if p.name not in params]
    if missing:
        raise ConfigError(f"checkpoint={str(path)!r} does not fit model {model_name!r}: {len(missing)} of its "
                          f"parameters are missing (e.g. {', '.join(missing[:3])}); was it written by another "
                          f"model or recipe?")
    for p in own:
        if tuple(params[p.name].shape) != tuple(p.shape):
            raise ConfigError(f"checkpoint={str(path)!r} does not fit model {model_name!r}: {p.name} has shape "
                              f"{tuple(params[p.name].shape)} in the file, {tuple(p.shape)} in the model "
                              f"(another num_classes or width?)")
    ms.load_param_into_net(net, {p.name: as_dtype(params[p.name], p) for p in own}, strict_load=True)
    return params


def initial_weights(net: nn.Cell, path, model_name: str, num_classes: int) -> List[str]:
    """train.py weights=NAME / checkpoint=FILE: a new run starts from a checkpoint's network parameters (no
    optimizer moments, step, schedule or loss scale: not a resume). A parameter whose shape differs only where
    the file has another class count (the head) keeps its fresh initialisation; returns those names. The first
    convolution of a network for another number of input channels (a shipped 1-channel Fashion-MNIST weight
    fine-tuned on RGB images) is adapted to it (adapt_input_conv), in one log line. Any other difference is one
    error line (another model or width)."""
    params = read_checkpoint(path)
    own = list(net.get_parameters())
    missing = [p.name for p in own if p.name not in params]
    if missing:
        raise ConfigError(f"{path} does not fit model {model_name!r}: {len(missing)} of its parameters are missing "
                          f"(e.g. {', '.join(missing[:3])}); start from a weight of the same model")
    first_conv = next((p.name for p in own if len(p.shape) == 4), None)
    fresh, adapted = [], {}
    for p in own:
        theirs, ours = tuple(params[p.name].shape), tuple(p.shape)
        if theirs == ours:
            continue
        axes = [i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b] if len(theirs) == len(ours) else [-1]
        if p.name == first_conv and axes == [1]:
            adapted[p.name] = ms.Parameter(ms.Tensor(adapt_input_conv(params[p.name].asnumpy(), ours[1])),
                                           name=p.name)
            log.info("%s: %s adapted from %d to %d input channels (the data's), as timm's adapt_input_conv does",
                     path, p.name, theirs[1], ours[1])
            continue
        if len(axes) != 1 or ours[axes[0]] != num_classes:
            raise ConfigError(f"{path} does not fit model {model_name!r}: {p.name} has shape {theirs} in the file, "
                              f"{ours} in the model; only a head for another class count is re-initialised (and a "
                              f"first convolution adapted to another number of input channels)")
        fresh.append(p.name)
    ms.load_param_into_net(net, {p.name: as_dtype(adapted.get(p.name, params[p.name]), p) for p in own
                                 if p.name not in fresh}, strict_load=False)
    return fresh


def adapt_input_conv(weight: np.ndarray, channels: int) -> np.ndarray:
    """A first convolution's weight (out, in, kh, kw) for `channels` input channels, after timm's
    adapt_input_conv: to 1 channel, the sum over the file's channels (a grey image gives the response its RGB
    copy gave); from 1 channel, the filter repeated and divided by `channels` (an RGB copy of a grey image gives
    the response the grey image gave); from 3 channels to another count, the RGB filters repeated and scaled by
    3 / channels."""
    have = weight.shape[1]
    if channels == 1:
        return weight.sum(axis=1, keepdims=True)
    if have == 1:
        return np.repeat(weight, channels, axis=1) / channels
    if have == 3:
        return np.tile(weight, (1, -(-channels // 3), 1, 1))[:, :channels] * (3 / channels)
    raise ConfigError(f"a first convolution of {have} input channels cannot be adapted to {channels}: only one of 1 "
                      f"or 3 channels, or to 1 channel; set model.params.in_channels={have}")


def as_dtype(value, like):
    """A checkpoint's float value in its network parameter's float type (a weight shipped in fp16 loads into an
    fp32 network, as MindSpore's own loader would refuse)."""
    floats = (ms.float16, ms.float32)
    if value.dtype == like.dtype or value.dtype not in floats or like.dtype not in floats:
        return value
    return ms.Parameter(ms.Tensor(value.asnumpy().astype(ms.dtype_to_nptype(like.dtype))), name=like.name)


AMP_STATE = ("scale_sense", "current_iterator_step", "last_overflow_iterator_step")
RUN_TIMES = ("train_time_s", "wall_time_s")  # a train.py checkpoint's run times so far (AtomicCheckpoint's clock)
# what a train.py checkpoint's global step means: the workers that trained it, and what an update took over all
# of them (samples, or padded tokens with token batching, times trainer.update_freq)
RUN_SHAPE = ("world_size", "global_batch")


def check_same_shape(params: dict, path, world_size: int, global_batch: int) -> None:
    """A resume on another number of workers would silently reinterpret the checkpoint's position: its global
    step counts updates of the old global batch, while steps per epoch come from this run's shards and the
    learning rate from this run's world size. Refused in one line saying what would change. A checkpoint from
    before the shape was recorded passes (nothing to compare)."""
    if not all(k in params for k in RUN_SHAPE):
        return
    was_world, was_batch = (int(params[k].asnumpy().reshape(-1)[0]) for k in RUN_SHAPE)
    if (was_world, was_batch) == (world_size, global_batch):
        return
    raise ConfigError(f"resume: {path} was trained by {was_world} worker(s) with a global batch of {was_batch}, this "
                      f"run has {world_size} with {global_batch}: its step {step_of(params):,} would stand for "
                      f"another number of samples, shifting epochs, evaluations and the learning rate; resume it "
                      f"with {was_world} worker(s) (msrun --worker_num={was_world}), or start a new run from its "
                      f"weights with checkpoint={path}")


def is_amp_state(name: str) -> bool:
    """A loss-scale or AMP counter parameter of a train step, not a weight or the optimizer's state."""
    return name in AMP_STATE or name.startswith("amp_")


def accumulates(keys) -> bool:
    """Whether a train step's parameter names hold gradient accumulation's buffers (update_freq > 1)."""
    return any(k.startswith("amp_accum.") for k in keys)


def restore_weights(step_cell: nn.Cell, path, with_amp_state: bool = False, model_name: str = "",
                    params: Optional[dict] = None) -> int:
    """Load weights and optimizer state (from `path`, or `params` already read from it) into a train step;
    returns the checkpoint's global step.

    Without `with_amp_state`, the loss-scale state and AMP counters are left as the new step set them
    (a lower fallback rung starts its own scale)."""
    params = dict(read_checkpoint(path) if params is None else params)
    params.pop("learning_rate", None)  # the schedule comes from the config; its position is global_step
    if not with_amp_state:
        params = {k: v for k, v in params.items() if not is_amp_state(k)}
    names = [p.name for p in step_cell.get_parameters() if p.name != "learning_rate"]
    if with_amp_state and accumulates(params) != accumulates(names):
        given = "update_freq > 1" if accumulates(names) else "update_freq=1"
        raise ConfigError(f"{path} was written {'with' if accumulates(params) else 'without'} gradient accumulation "
                          f"but this run has trainer.{given}: resume with the trainer.update_freq it was trained with")
    missing = [n for n in names if n not in params and (with_amp_state or not is_amp_state(n))]
    if missing:
        raise ConfigError(f"{path} does not fit model {model_name!r}: {len(missing)} parameters are missing "
                          f"(e.g. {', '.join(missing[:3])}); was it written by another model or recipe?")
    try:
        ms.load_param_into_net(step_cell, params)
    except RuntimeError as e:
        raise ConfigError(f"{path} does not fit this recipe: {str(e).splitlines()[0]}") from None
    return int(params["step_num"].asnumpy()) if "step_num" in params else 0


def average_checkpoints(paths) -> dict:
    """Element-wise mean of the float parameters of several checkpoints (Vaswani et al. average the last 5
    or 20); integer state (steps, counters) and the run's times come from the newest."""
    params = [read_checkpoint(p) for p in paths]
    out = dict(params[-1])
    for name, value in params[-1].items():
        if value.dtype in (ms.float32, ms.float16) and name not in RUN_TIMES:
            if any(name not in p or p[name].shape != value.shape for p in params):
                raise ConfigError(f"cannot average {name}: it is missing or differs in shape among {paths}")
            mean = np.mean([p[name].asnumpy().astype(np.float64) for p in params], axis=0)
            out[name] = ms.Parameter(ms.Tensor(mean.astype(value.asnumpy().dtype)), name=name)
    return out


def last_checkpoints(path, n: int):
    """The checkpoint `path` and the n-1 before it in its folder (by global step)."""
    path = Path(path).expanduser()
    siblings = checkpoints(path.parent)
    if path not in siblings:
        read_checkpoint(path)  # names the missing file
    upto = siblings[: siblings.index(path) + 1]
    if len(upto) < n:
        raise ConfigError(f"decode.average_last={n} but {path.parent} holds only {len(upto)} checkpoints up to "
                          f"{path.name}")
    return upto[-n:]


def _fsync_dir(path) -> None:
    """Make a rename in `path` durable. Some file systems refuse fsync on a directory (EINVAL, EBADF, ENOTSUP:
    FUSE mounts, some network ones) though the rename itself is done and visible: not a failed save."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise
    finally:
        os.close(fd)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (a write of another process), or gone
        pass


class AtomicCheckpoint(Callback):
    """Checkpoints of the whole train step (weights, optimizer moments, LR position, loss-scale state, AMP
    counters) with the completed epochs and global step and MindSpore's CRC32 (checked on every load), written
    atomically: to a temporary file, fsynced, then renamed. A process killed mid-save leaves the previous
    checkpoint the newest complete one. `clock` gives the run's training and wall seconds so far, kept in the
    checkpoint so that a resumed run's times count every process.

    `every_steps` (> 0) also saves a resume point inside an epoch every that many steps, so that a killed
    process (a session's end, a preempted node) loses at most that many steps of a long epoch (the driver turns
    data sinking off with it: a sink would reach the host, and this callback, only at the epoch's end). Only the newest
    resume point is kept; `keep_last` counts the epoch-end checkpoints (what evaluation and averaging read)."""

    def __init__(self, directory, prefix: str, every_epochs: int, keep_last: int, steps_per_epoch: int,
                 on_save=None, clock=None, every_steps: int = 0, shape: Optional[dict] = None):
        self.dir, self.prefix, self.on_save, self.clock = Path(directory), prefix, on_save, clock
        self.shape = shape or {}  # RUN_SHAPE: the workers and global batch its steps count (check_same_shape)
        self.every, self.keep_last, self.steps_per_epoch = every_epochs, keep_last, steps_per_epoch
        self.every_steps, self.seen = every_steps, None
        self.latest: Optional[Path] = None
        self.saved_step = -1
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, train_network, step: int) -> Path:
        """Write the checkpoint of `step`; a failed write (disk full, no permission) removes its partial file and
        raises a WriteError: the checkpoints already written stay complete."""
        epochs_done = step // self.steps_per_epoch
        final = self.dir / checkpoint_name(self.prefix, step, self.steps_per_epoch)
        tmp = self.dir / ".partial" / final.name  # same filesystem: the rename below is atomic
        try:
            tmp.parent.mkdir(exist_ok=True)
            times = self.clock() if self.clock else {}  # RUN_TIMES
            ms.save_checkpoint(train_network, str(tmp), append_dict={"epoch_num": epochs_done, "step_num": step,
                                                                     **times, **self.shape},
                               crc_check=True)  # a byte flipped later is refused on load (read_checkpoint)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except Exception as e:  # noqa: BLE001  (MindSpore reports a failed write as RuntimeError, Python as OSError)
            for partial in (tmp, tmp.with_suffix(".tmp")):  # ours, and the one MindSpore writes first
                partial.unlink(missing_ok=True)
            _remove_if_empty(tmp.parent)
            raise write_error(final, e) from None
        _remove_if_empty(tmp.parent)  # nothing of a write is left beside the checkpoints
        self.latest, self.saved_step = final, step
        if self.on_save is not None:  # e.g. flush TensorBoard: whatever a resume will not redo is on disk
            self.on_save()
        # prune this run's older checkpoints only: none newer than this one (after a fallback restart from an
        # earlier checkpoint, the later ones are removed by the ladder itself). A resume point inside an epoch
        # is superseded by any newer checkpoint; the epoch ends keep the last `keep_last`.
        older = [p for p in checkpoints(self.dir) if int(CHECKPOINT_NAME.fullmatch(p.name).group(2)) < step]
        inside = [p for p in older if not self._at_epoch_end(p)]
        ends = [p for p in older if self._at_epoch_end(p)] + ([final] if step % self.steps_per_epoch == 0 else [])
        for old in inside + ends[: -self.keep_last]:
            old.unlink()
        return final

    def _at_epoch_end(self, path: Path) -> bool:
        epoch, step = map(int, CHECKPOINT_NAME.fullmatch(path.name).groups())
        return step == epoch * self.steps_per_epoch

    def on_train_begin(self, run_context):
        self.seen = run_context.original_args().cur_step_num  # the global step (StepOffset runs first)

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        previous, self.seen = self.seen, cb.cur_step_num
        if not self.every_steps or previous is None or not crossed(previous, cb.cur_step_num, self.every_steps):
            return
        epoch_end = cb.cur_step_num % self.steps_per_epoch == 0
        if not (epoch_end and self.every and (cb.cur_step_num // self.steps_per_epoch) % self.every == 0):
            self.save(cb.train_network, cb.cur_step_num)  # an epoch end that on_train_epoch_end saves is left to it

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        if self.every and cb.cur_epoch_num % self.every == 0 and cb.cur_step_num != self.saved_step:
            self.save(cb.train_network, cb.cur_step_num)

    def on_train_end(self, run_context):
        cb = run_context.original_args()
        if cb.cur_step_num != self.saved_step:
            self.save(cb.train_network, cb.cur_step_num)


CHECKPOINT_NAME = re.compile(r".+-e(\d+)-s(\d+)\.ckpt")  # <model>-e<epochs done>-s<global step>.ckpt


def checkpoint_name(prefix: str, step: int, steps_per_epoch: int) -> str:
    return f"{prefix}-e{step // steps_per_epoch:04d}-s{step:08d}.ckpt"


def checkpoints(directory) -> List[Path]:
    """Complete checkpoints written by train.py (partial ones live in .partial/), oldest first by global step;
    other files ignored. The one listing of checkpoints every tool uses."""
    named = {p: CHECKPOINT_NAME.fullmatch(p.name) for p in Path(directory).glob("*.ckpt")}
    return sorted((p for p, m in named.items() if m), key=lambda p: int(named[p].group(2)))


def epoch_checkpoints(directory, steps_per_epoch: int) -> dict:
    """{epoch: path} of the checkpoints written at epoch ends (a stop mid-epoch writes others)."""
    found = {}
    for path in checkpoints(directory):
        epoch, step = map(int, CHECKPOINT_NAME.fullmatch(path.name).groups())
        if step == epoch * steps_per_epoch:
            found[epoch] = path
    return found


def resume_point(directory) -> Tuple[Optional[Path], Optional[dict]]:
    """The newest checkpoint in `directory` that reads and fits; corrupt ones, and ones that hold an overflowed
    update (holds_overflowed_update), are skipped and named.
    (None, None): the directory holds no checkpoint yet."""
    found = checkpoints(directory)
    if not found:
        return None, None
    for path in reversed(found):
        try:
            params = read_checkpoint(path)
        except ConfigError as e:
            log.warning("resume: skipping %s: %s", path.name, e)
            continue
        if "step_num" not in params:
            raise ConfigError(f"resume: {path} has no step_num: it was not written by train.py")
        if holds_overflowed_update(params):  # a 910A's saturated overflow: finite weights, but not good ones
            log.warning("resume: skipping %s: it holds an update that overflowed (amp_nonfinite_updates > 0)",
                        path.name)
            continue
        return path, params
    raise ConfigError(f"resume: no checkpoint in {directory} can be resumed (each is corrupt or holds an overflowed "
                      f"update): {', '.join(p.name for p in found)}; start a new run in another hydra.run.dir")


def holds_overflowed_update(params: dict) -> bool:
    """Whether a checkpoint holds an update that overflowed (no overflow skipping), by its in-graph counter
    amp_nonfinite_updates. On a GPU or CPU such an update leaves the weights non-finite, which read_checkpoint
    refuses; on an Ascend in saturation mode (the 910A) the overflow saturates instead, and the weights stay
    finite while holding it: only the counter tells. A rung's counters start at 0 and the divergence watch stops
    at the first one, so any count above 0 marks a checkpoint written after the update."""
    value = params.get("amp_nonfinite_updates")
    return value is not None and int(value.asnumpy().reshape(-1)[0]) > 0


def step_of(params: Optional[dict]) -> int:
    """A train.py checkpoint's global step (0 without one)."""
    return int(params["step_num"].asnumpy().reshape(-1)[0]) if params and "step_num" in params else 0


def last_good_checkpoint(ckpt_dir: Path, remove: bool = True) -> Tuple[Optional[Path], Optional[dict]]:
    """The newest checkpoint whose weights are all finite and hold no overflowed update
    (holds_overflowed_update), and its parameters (read once); non-finite or overflowed ones (the divergence's
    own) are removed, never resumed, when `remove` (rank 0 alone: ranks may share the folder). One that does not
    read (damaged, a failed CRC) is passed over and kept, with a warning: it is not the divergence's to delete.
    (None, None): start from the initial weights."""
    for path in reversed(checkpoints(ckpt_dir)):
        try:
            params = read_checkpoint(path)
        except NonFinite:
            params, why = None, "its weights are not finite"
        except ConfigError as e:
            log.warning("passing over %s (kept): %s", path.name, e)
            continue
        else:
            why = "it holds an update that overflowed" if holds_overflowed_update(params) else None
        if why is None:
            return path, params
        if remove:
            log.info("removing %s: %s", path.name, why)
            path.unlink(missing_ok=True)
    return None, None


def restart_checkpoint(ckpt_dir: Path, prefix: str, steps_per_epoch: int, is_main: bool = True,
                       agree=None) -> Tuple[Optional[Path], Optional[dict]]:
    """Where the fallback ladder's next rung starts, the same checkpoint on every rank. Rank 0 picks it
    (last_good_checkpoint, removing the bad ones) and `agree(step)` (ampzoo.runtime.rank0_value: rank 0's step on
    every rank, -1 for the initial weights) gives it to the others, which read that file by its name. The
    others wait in that all-reduce until rank 0 has picked, so rank 0's checkpoint at the stop step (written as
    its Model.train ended) is on disk before any rank looks; and no rank depends on its own, possibly stale,
    listing of a shared folder. `agree` None: a single process."""
    if agree is None or is_main:
        path, params = last_good_checkpoint(ckpt_dir, remove=is_main)
        if agree is not None:
            agree(step_of(params) if path else -1)
        return path, params
    step = agree(-1)
    if step < 0:
        return None, None
    path = Path(ckpt_dir) / checkpoint_name(prefix, step, steps_per_epoch)
    try:
        return path, read_checkpoint(path)
    except ConfigError as e:
        raise ConfigError(f"rank 0 restarts the fallback ladder from {path}, which this rank cannot read ({e}); "
                          f"every rank must see the run directory (a file system shared by every server)") from None


def agree_on_resume(path: Optional[Path], params: Optional[dict], ckpt_dir: Path, prefix: str, is_main: bool,
                    agree) -> Tuple[Optional[Path], Optional[dict]]:
    """A resume under msrun: each rank picked its checkpoint (resume_point) from its own listing of the shared
    folder, and a network file system's cache can show one server an older listing than another. Rank 0's pick
    is the run's: `agree(value)` (ampzoo.runtime.rank0_value, an all-reduce every rank calls) gives every rank rank
    0's step and epoch, and a rank whose own pick differs reads rank 0's by its name, with a warning."""
    mine = (step_of(params), int(params["epoch_num"].asnumpy().reshape(-1)[0])) if path is not None else (-1, -1)
    theirs = (agree(mine[0]), agree(mine[1]))
    if is_main or theirs == mine:
        return path, params
    if theirs[0] < 0:
        raise ConfigError(f"resume: rank 0 found no checkpoint in {ckpt_dir}, this rank found {path}: every rank "
                          f"must see the same run directory (a file system shared by every server)")
    chosen = Path(ckpt_dir) / f"{prefix}-e{theirs[1]:04d}-s{theirs[0]:08d}.ckpt"
    log.warning("resume: rank 0 resumes from %s, this rank's listing of %s showed %s: taking rank 0's (a shared "
                "file system's cache may lag)", chosen.name, ckpt_dir, path.name if path else "none")
    try:
        return chosen, read_checkpoint(chosen)
    except ConfigError as e:
        raise ConfigError(f"resume: rank 0 resumes from {chosen}, which this rank cannot read ({e}); every rank "
                          f"must see the run directory (a file system shared by every server)") from None


def inference_network(cfg, script: str, cpu_kernels: Optional[str] = None):
    """eval.py and export.py: the recipe's network under its policy, in eval mode, with the checkpoint's
    weights (averaged over decode.average_last checkpoints, Conv+BN folded when infer.fuse_conv_bn), built with
    runtime.cpu_kernels or `cpu_kernels` (ampzoo.engine.network.build_model). Returns (network, the effective
    config, notes for the user, fused pairs or None)."""
    if not cfg.checkpoint:
        raise ConfigError(f"checkpoint is not set; run: python {script} recipe=NAME checkpoint=PATH/TO/model.ckpt")
    notes = []
    check_device_dtype(set_context(cfg.runtime), cfg.amp)
    set_cpu_compute(cfg.runtime.cpu_compute, training=False)
    # folding makes Conv2d with a bias, over NCHW: then MindSpore's own layers throughout
    net = build_model(cfg, "off" if cfg.infer.fuse_conv_bn else cpu_kernels)
    averaged = None
    if cfg.decode.average_last > 1:
        paths = last_checkpoints(cfg.checkpoint, cfg.decode.average_last)
        averaged = average_checkpoints(paths)
        notes.append(f"averaged {len(paths)} checkpoints: {', '.join(p.name for p in paths)}")
    load_weights(net, cfg.checkpoint, cfg.model.name, averaged)
    fused = None
    if cfg.infer.fuse_conv_bn:
        net, fused = fuse_conv_bn(net)
        notes.append(f"Conv+BN folding: {fused['fused_pairs']} pairs fused (found by {fused['found_by']})")
    net, _ = apply_policy(net, cfg.amp)
    net.set_train(False)
    return net, cfg, notes, fused


def check_disk_space(directory, step_cell: nn.Cell) -> None:
    """Refuse to start when the disk cannot hold two checkpoints (the new one is written beside the last)."""
    need = 2 * sum(p.size * p.itemsize for p in step_cell.get_parameters())
    where = Path(directory)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConfigError(f"not enough disk space for checkpoints in {directory}: {free / 2**20:.0f} MiB free, "
                          f"two checkpoints of this run need {need / 2**20:.0f} MiB; free space or set "
                          f"hydra.run.dir elsewhere")
