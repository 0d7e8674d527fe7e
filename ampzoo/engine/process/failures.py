"""The one line for what model.train raised: data the pipeline cannot read, a failure of the device, or a model
that does not compile. The full trace goes into train.log (ampzoo.engine.process.logs), never onto the console."""
import os
import re
import time
from pathlib import Path

from ampzoo.engine.process.directory import continue_with
from ampzoo.engine.process.logs import log_trace
from ampzoo.errors import DeviceError, device_failure
from ampzoo.runtime import mindspore_log

STARTED = time.time()  # files MindSpore wrote since are this process's


def step_error(run, error: Exception, ran_before: bool) -> str:
    """The one line for what model.train raised: data the pipeline cannot read (a broken image, say), a failure
    of the device at any step (a DeviceError: exit 1), or, before any step ran, a model that does not compile.
    Anything else is raised as it is. `run`: train.py's Run."""
    if "dataset pipeline" in str(error):
        return pipeline_error(run, error)
    if run.device != "CPU" and device_failure(str(error)):
        raise DeviceError(device_error(run, error)) from error
    if ran_before:
        raise error
    return compile_error(run, error)


def trace_file(run) -> str:
    return str(run.run_dir / "train.log") if run.is_main else f"rank {run.rank}'s msrun worker log"


OUT_OF_MEMORY = re.compile(r"[Oo]ut of [Mm]emory|[Mm]emory isn't enough|[Ff]ailed to allocate memory|"
                           r"[Aa]vailable memory is insufficient|aclrtMalloc|cudaMalloc")


def device_error(run, error: Exception) -> str:
    """One line for a failure of the device or the software under it (driver, CANN/CUDA, collectives, device
    memory), told apart from a model that does not compile by the words only a device runtime uses. Out of
    device memory is named as the batch's (the recipe's dataset.batch_size), not as a fault of the device."""
    log_trace(error)
    step = run.timer.steps[-1] if run.timer.steps else 0
    if OUT_OF_MEMORY.search(str(error)):
        batch = run.cfg.dataset.get("batch_size") if hasattr(run.cfg, "dataset") else None
        return (f"the {run.device} ran out of memory {f'after step {step}' if step else 'in the first step'} (rank "
                f"{run.rank} of {run.world}): {device_failure(str(error)) or str(error).splitlines()[0]}; at "
                f"dataset.batch_size={batch} a device this network does not fit its memory: lower "
                f"dataset.batch_size (optimizer.reference_batch_size scales the learning rate with it) or "
                f"dataset.image_size, or free the device (npu-smi info / nvidia-smi lists its processes) (full trace "
                f"in {trace_file(run)})")
    return (f"the {run.device} failed {f'after step {step}' if step else 'in the first step'} (rank {run.rank} of "
            f"{run.world}): {device_failure(str(error))}; this is the device or its software, not the recipe: run "
            f"make doctor on this machine; MindSpore's own error lines: {mindspore_log()} (full trace in "
            f"{trace_file(run)})")


def pipeline_error(run, error: Exception) -> str:
    """One line for data the pipeline cannot read, naming the file where MindSpore's message does; the
    checkpoints written before it are intact."""
    log_trace(error)
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip().startswith("[ERROR]")]
    reason = lines[0].removeprefix("[ERROR]").strip() if lines else str(error).splitlines()[0]
    step = run.timer.steps[-1] if run.timer.steps else 0
    then = continue_with(run.run_dir, run.cfg.recipe_name) if step else "run the command again"
    return (f"the data pipeline failed at step {step}: {reason}; fix or remove that file, then {then} (full trace "
            f"in {trace_file(run)})")


def compile_error(run, error: Exception) -> str:
    """One line for a network that does not compile or fails its first step (typically a forked model's
    shape bug); the full trace goes to train.log only."""
    log_trace(error)
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip() and not ln.strip().startswith("-")]
    reason = next((ln for ln in lines if ln.startswith("For ")), lines[0] if lines else type(error).__name__)
    analysis = Path(os.environ.get("MS_OM_PATH", ".")) / f"rank_{run.rank}" / "om" / "analyze_fail.ir"
    written = analysis.is_file() and analysis.stat().st_mtime >= STARTED  # not one an earlier process left there
    graph = f"; MindSpore's account of the graph: {analysis}" if written else ""
    return (f"model {run.cfg.model.name!r} (recipe {run.cfg.recipe_name}) does not compile or fails its first "
            f"step: {reason} (full trace in {trace_file(run)}{graph})")
