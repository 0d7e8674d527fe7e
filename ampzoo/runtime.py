"""Process set-up: MindSpore's log level, the oneDNN cap, device choice, context, seeds."""
import logging
import os
import platform
import random
from typing import Optional

log = logging.getLogger("amp_zoo")


def set_here(marker: str, key: str) -> bool:
    """Whether this process set the environment variable `key` itself (its process id in `marker`). A value an
    amp-zoo parent process set is dropped with its marker, so this process decides afresh."""
    by = os.environ.get(marker)
    if by and by != str(os.getpid()):
        os.environ.pop(marker)
        os.environ.pop(key, None)
        return False
    return bool(by)


def cap_onednn_isa(choice: str, needs_cap: bool, device: str = "CPU") -> Optional[str]:
    """Set oneDNN's ISA cap for a network just built, before its first step, and return the note a run records.
    On x86, MindSpore's own CPU convolutions hand oneDNN plain NCHW tensors, for which oneDNN picks a reference
    kernel on AVX-512/AMX CPUs that is far slower than its AVX2 gemm kernel (docs/benchmarks.md); capping the
    ISA fixes them.
    oneDNN reads ONEDNN_MAX_CPU_ISA when it creates its first primitive, not when MindSpore is imported, so the
    networks built before the first step decide (`needs_cap`: this one runs a MindSpore convolution,
    ampzoo.engine.network.runs_mindspore_conv). `choice` is runtime.onednn_isa: auto caps at AVX2 while any network
    built in this process needs it and sets ALL otherwise (the CPU kernels and matmuls run oneDNN's AVX-512
    kernels as fast as PyTorch's); an ISA name sets that; "none" sets nothing. A value the user set is left
    alone. Off the CPU (`device` Ascend or GPU) oneDNN runs none of the network: nothing is set, and there is no
    note (None)."""
    from cpu_kernels import AUTO_CAP  # the kernels' block size reads it (imported here: entry's checks first)
    if device != "CPU":
        return None
    ours = set_here(AUTO_CAP, "ONEDNN_MAX_CPU_ISA")
    if "ONEDNN_MAX_CPU_ISA" in os.environ and not ours:
        return f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} (set by the user)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "ONEDNN_MAX_CPU_ISA not set (not an x86 CPU)"
    if str(choice).lower() == "none":
        return "ONEDNN_MAX_CPU_ISA not set (runtime.onednn_isa=none)"
    if str(choice).lower() != "auto":
        os.environ["ONEDNN_MAX_CPU_ISA"] = str(choice)
        return f"ONEDNN_MAX_CPU_ISA={choice} (runtime.onednn_isa)"
    want = "AVX2" if needs_cap or os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "ALL"
    os.environ["ONEDNN_MAX_CPU_ISA"], os.environ[AUTO_CAP] = want, str(os.getpid())
    return f"ONEDNN_MAX_CPU_ISA={want} (set by amp-zoo: " + (
        "a network runs MindSpore's own convolutions, whose AVX-512 path is 20-130x slower)" if want == "AVX2" else
        "no MindSpore convolution in the network, so oneDNN runs at the CPU's full ISA)")


def onednn_note(device: str = "CPU") -> Optional[str]:
    """The oneDNN cap in force, for a run's records; None off the CPU (oneDNN runs none of the network)."""
    from cpu_kernels import AUTO_CAP  # the kernels' block size reads it (imported here: entry's checks first)
    if device != "CPU":
        return None
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if isa is None:
        return "ONEDNN_MAX_CPU_ISA not set"
    return f"ONEDNN_MAX_CPU_ISA={isa} ({'set by amp-zoo' if os.environ.get(AUTO_CAP) else 'set by the user'})"


def quiet_mindspore() -> None:
    """MindSpore's C++ [WARNING] and [ERROR] lines drown the console (a compile error prints its whole trace
    there; the driver reports it in one line and keeps the trace in train.log), so a single process sets GLOG_v=4.
    An msrun worker's console is its own log file (msrun's worker_N.log): there MindSpore's error lines are kept
    (GLOG_v=3), so a device failure on any rank leaves MindSpore's own account beside the driver's line. MindSpore
    writes a CRITICAL line to a log file's stderr as well, so GLOG_log_dir cannot keep the console clean instead.
    A GLOG_v the user set is left alone. MindSpore reads GLOG_v once, when it loads: ampzoo.entry calls this before."""
    os.environ.setdefault("GLOG_v", "3" if msrun_env() else "4")


def mindspore_log() -> str:
    """Where MindSpore's own error lines are, for a message that sends the user there."""
    if os.environ.get("GLOG_v", "2") in ("0", "1", "2", "3"):
        return "this process's console" + (" (msrun's worker log)" if msrun_env() else "")
    return "hidden by GLOG_v=4: run again with GLOG_v=3 to see them"


def plugin_errors() -> str:
    """Why MindSpore could not load its device plugins ('' when it loaded them all): a missing CANN or CUDA
    library, typically. MindSpore records it at import (MSContext.load_plugin_error)."""
    try:
        from mindspore._c_expression import MSContext
        return " ".join(MSContext.get_instance().load_plugin_error().split())
    except Exception:  # noqa: BLE001  (an older or partial build without the probe)
        return ""


def pick_device(requested: str) -> str:
    import mindspore as ms
    from ampzoo.errors import ConfigError

    def available(target: str) -> bool:  # mindspore.device_context (hal.is_available is deprecated)
        try:
            return bool(getattr(ms.device_context, target.lower()).is_available())
        except Exception:  # noqa: BLE001  (an older or partial build without the probe)
            return target == "CPU"

    if requested == "auto":
        return next(t for t in ("Ascend", "GPU", "CPU") if available(t))
    if not available(requested):
        have = [t for t in ("Ascend", "GPU", "CPU") if available(t)]
        why = plugin_errors()
        raise ConfigError(f"runtime.device={requested} is not available in this MindSpore build "
                          f"(mindspore {ms.__version__}{': ' + why if why else ''}); available here: "
                          f"{', '.join(have)} or auto")
    return requested


def device_hardware() -> str:
    """Device hardware this machine shows whatever MindSpore finds: Ascend's /dev/davinci*, NVIDIA's /dev/nvidia*."""
    from pathlib import Path
    if any(Path("/dev").glob("davinci[0-9]*")):
        return "Ascend"
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return "GPU"
    return ""


def check_rank_device(requested: str, device: str) -> None:
    """Under msrun, runtime.device=auto is decided in each process: a host whose environment lacks CANN (or CUDA)
    would train on the CPU with MCCL while the other ranks use HCCL, and their first collective would hang far
    from the cause. That rank stops before init(), with one line naming it (msrun then ends the others)."""
    from ampzoo.errors import DeviceError
    hardware = device_hardware()
    if requested != "auto" or device != "CPU" or not hardware or not msrun_env():
        return
    import socket
    rank = os.environ.get("MS_NODE_ID") or os.environ.get("RANK_ID") or "?"
    raise DeviceError(f"rank {rank} on host {socket.gethostname()}: runtime.device=auto found no usable {hardware} "
                      f"({plugin_errors() or 'a CPU-only MindSpore'}), though this host has {hardware} devices: it "
                      f"would train on the CPU while the other ranks use the {hardware}s, and their first collective "
                      f"would hang; on this host, "
                      + ("source CANN's set_env.sh in the environment msrun starts" if hardware == "Ascend" else
                         "put CUDA and cuDNN on LD_LIBRARY_PATH")
                      + f" (make doctor says what is missing), or set runtime.device={hardware}")


def set_context(runtime_cfg) -> str:
    """Device, execution mode and determinism; returns the device target in use.

    The device id is passed only when the user set runtime.device_id: with none, MindSpore uses device 0 in a
    single process and, under msrun, gives each rank its own device (mindspore.set_device's documentation); an
    explicit id would put every rank on the same device."""
    import mindspore as ms

    device = pick_device(str(runtime_cfg.device))
    if runtime_cfg.get("distributed", False):
        check_rank_device(str(runtime_cfg.device), device)
    mode = str(runtime_cfg.mode)
    if runtime_cfg.device_id is None:
        ms.set_device(device)
    else:
        ms.set_device(device, runtime_cfg.device_id)
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    if runtime_cfg.deterministic:
        ms.set_deterministic(True)  # set_context(deterministic=...) is deprecated
    return device


def device_notes(runtime_cfg, device: str) -> list:
    """The lines a run logs about its device (once its rank is known: msrun's scheduler and other ranks keep
    them out of train.log): why runtime.device=auto fell back to the CPU, and where MindSpore's errors go."""
    import mindspore as ms
    notes = []
    if device == "CPU" and str(runtime_cfg.device) == "auto":
        notes.append(f"runtime.device=auto: CPU, as neither Ascend nor GPU is usable in this MindSpore "
                     f"{ms.__version__} ({plugin_errors() or 'a CPU-only build'})")
    return notes + [f"MindSpore's own error lines: {mindspore_log()}"]


def seed_everything(seed: int, rank: int = 0) -> None:
    """Every random draw from `seed`. The network's initialisation must be the same on every rank (MindSpore's
    data parallelism does not broadcast the initial weights), so `ms.set_seed` takes the seed itself; the data
    pipeline's random augmentations (crops, flips) should differ between ranks, which read different samples, so
    the dataset seed is seed + rank (rank 0, and a single process, draw what they always drew)."""
    import mindspore as ms
    import mindspore.dataset as msds
    import numpy as np

    ms.set_seed(seed)  # it sets the dataset seed too
    msds.config.set_seed(seed + rank)  # which seeds Python's and numpy's global generators: they are reset below
    random.seed(seed)
    np.random.seed(seed)


def sink_mode(device: str, requested: bool, shapes_vary: bool = False, max_steps: int = 0, profile: bool = False,
              save_every_steps: int = 0, mode: str = "graph"):
    """Whether to sink, and the one log line that says why. A sink is always a whole epoch (trainer.sink_size
    -1; ampzoo.engine.load refuses other sizes), so an epoch stays a pass over the data. Sinking stays off where it
    cannot be right:
    - on CPU, MindSpore silently runs non-sink when asked to sink, and still reports sink_size to callbacks;
    - for data whose batches change shape (translation buckets): a sink graph's GetNext is compiled for the
      first batch's shapes (MindSpore's own Transformer trains without sinking);
    - with trainer.max_steps, which stops mid-epoch: a sink returns to the host only at the epoch's end;
    - with runtime.profile, which profiles a few steps: a sink would make the profiled window a whole epoch;
    - with trainer.save_every_steps, a resume point every N steps inside an epoch: a sink would save it only at
      the epoch's end, so a killed process would lose up to an epoch, not N steps;
    - in PyNative mode, where MindSpore 2.10's Model.train, asked to sink, still runs every step from the host
      (its PyNative dataset iterator: a step and its callbacks at a time, no sink of an epoch), through a device
      queue and dynamic-shape inputs that graph mode does not use."""
    if not requested:
        return False, "data sinking off (trainer.sink=false)"
    if device == "CPU":
        return False, ("data sinking off: MindSpore's CPU backend does not sink datasets "
                       "(it would fall back to non-sink silently); steps are fed one by one")
    if mode == "pynative":
        return False, (f"data sinking off on {device}: in PyNative mode MindSpore runs every step from the host "
                       f"anyway (no sink of an epoch); steps are fed one by one")
    if shapes_vary:
        return False, (f"data sinking off on {device}: this data's batches change shape (length buckets), and a "
                       f"sink graph is compiled for one shape; steps are fed one by one")
    if max_steps:
        return False, (f"data sinking off on {device}: trainer.max_steps={max_steps} stops mid-epoch, and a sink "
                       f"returns to the host only at an epoch's end; steps are fed one by one")
    if profile:
        return False, (f"data sinking off on {device}: runtime.profile=true profiles a few steps, and a sink is a "
                       f"whole epoch; steps are fed one by one")
    if save_every_steps:
        return False, (f"data sinking off on {device}: trainer.save_every_steps={save_every_steps} saves a resume "
                       f"point inside an epoch, and a sink returns to the host only at an epoch's end; steps are fed "
                       f"one by one (trainer.save_every_steps=0 sinks, with resume points at epoch ends)")
    return True, (f"data sinking on ({device}): one sink per epoch, so step callbacks (logging every log_every "
                  f"steps, TensorBoard, AMP telemetry, the divergence watch, a stop signal) act at epoch ends")


# What msrun exports to every process it starts (mindspore/parallel/cluster/process_entity/_api.py, 2.10): its
# workers and its scheduler, which runs the same command with MS_ROLE=MS_SCHED.
MSRUN_VARIABLES = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT")


def msrun_env() -> dict:
    """msrun's variables in this process's environment: empty when msrun did not start it."""
    return {k: os.environ[k] for k in MSRUN_VARIABLES if k in os.environ}


def msrun_rank() -> Optional[int]:
    """This process's rank as msrun names it before init(): MS_NODE_ID, which msrun sets for every worker of a
    single host and of a host given --node_rank; -1 for msrun's scheduler (MS_ROLE=MS_SCHED, which runs the same
    command, and whose RANK_ID msrun sets to 0); None without msrun, or where msrun assigns ranks at init()."""
    if not msrun_env():
        return None
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return -1
    node = os.environ.get("MS_NODE_ID", "")
    return int(node) if node.isdigit() else None


def init_distributed():
    """Data parallel across the processes msrun started: gradients averaged over ranks, each rank reading its
    own shard. Returns (rank, world size)."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    return get_rank(), get_group_size()


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (an all-reduce of one number; every rank must call it)."""
    import mindspore as ms
    from mindspore.ops.communication import all_reduce

    value = ms.Tensor([1.0 if flag else 0.0], ms.float32)
    out = all_reduce(value, op="max")
    out = out[0] if isinstance(out, tuple) else value  # (result, handle), or in place
    return bool(out.asnumpy()[0] > 0)


def rank0_value(value: int, is_main: bool) -> int:
    """Rank 0's `value` (a non-negative integer below 2**36, or -1), on every rank: an all-reduce (max) in which
    the other ranks give -1; every rank must call it, and none returns before rank 0 has called it. Sent as two
    float32 halves of 18 bits (float32 holds integers exactly up to 2**24 only; every backend reduces float32)."""
    import mindspore as ms
    from mindspore.ops.communication import all_reduce

    mine = value if is_main else -1
    parts = [float(mine >> 18), float(mine & (2**18 - 1))] if mine >= 0 else [-1.0, -1.0]
    tensor = ms.Tensor(parts, ms.float32)
    out = all_reduce(tensor, op="max")
    out = out[0] if isinstance(out, tuple) else tensor  # (result, handle), or in place
    high, low = (int(x) for x in out.asnumpy())
    return -1 if high < 0 else (high << 18) + low


def parameter_checksum(net) -> str:
    """sha1 of every trained parameter's bytes, in name order: equal on every rank after data-parallel training.
    BatchNorm's moving statistics are left out: each rank keeps its own, from its own shard (DATA_PARALLEL
    all-reduces gradients only), so a ResNet's differ between ranks while its weights agree."""
    import hashlib
    digest = hashlib.sha1()
    for p in sorted(net.trainable_params(), key=lambda p: p.name):
        digest.update(p.name.encode())
        digest.update(p.asnumpy().tobytes())
    return digest.hexdigest()


def source_commit():
    """The commit of the code that runs (with "+modified" when tracked files differ from it); None outside a
    git checkout. Recorded with every run, so shipped weights name the code that trained them."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, timeout=10).returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+modified" if dirty else "")


def cpu_info():
    """The CPU's model name and its flags, from /proc/cpuinfo (None and [] where there is none)."""
    cpu, flags = None, []
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name") and cpu is None:
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    break
    except OSError:  # not Linux
        pass
    return cpu, flags
