"""CPU kernels for MindSpore: oneDNN's direct convolutions, max-pooling and a training BatchNorm as AOT custom ops
(csrc/: conv.cc, pool.cc, norm.cc, ... on runtime.cc; their Cells in cpu_kernels.cells). An optional extension:
`make install` builds it (`python -m cpu_kernels.build`) into this environment, never into the sources and never
on import.

    from cpu_kernels import configure, has_ops, why_not
    has_ops()    # True: built for this environment, and the oneDNN it links is one its headers fit
    why_not()    # otherwise, why, in one line
    configure(compute="bf16", threads=2)  # the kernels' settings (the runtime.cpu_* keys), in one call
    low_precision()  # what the kernels do with fp16 and bf16 on this CPU, in one line
    cpu_compute()    # how fp16 convolutions and Dense layers multiply here: "fp32", "bf16", "bf16_backward"
    weight_gradients()  # where a bf16 convolution's weight gradient runs: oneDNN on OpenMP, or why not

The library links MindSpore's bundled oneDNN (libdnnl.so.3) and is compiled against oneDNN headers of a release
not newer than it: oneDNN keeps its ABI backward compatible within a major version, so headers newer than the
runtime are what breaks (a virtual function the runtime's thread-pool interface lacks, enum values it does not
know). The build records what it was built against (build.json beside the library); loading reads the runtime's
version through dnnl_version() and refuses a mismatch. cpu_kernels.accelerate applies them to a finished network
(ampzoo.engine.network decides whether a network gets them: runtime.cpu_kernels); nothing in this file imports
MindSpore.
"""
import ctypes
import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

CSRC = Path(__file__).with_name("csrc")  # runtime.cc and its header, the AOT entry macro, one file per op family
SOURCES = sorted(CSRC.glob("*.cc"))
HEADERS = sorted(CSRC.glob("*.h"))
LIBRARY, RECORD = "libcpu_kernels.so", "build.json"
OMP_LIBRARY = "libdnnl_omp.so"  # oneDNN on OpenMP (onednn-cpu-gomp), beside LIBRARY: omp_weights.cc loads it
THREADPOOL = 0x8  # dnnl_runtime_threadpool: the CPU runtime MindSpore's oneDNN is built with, and Pool implements


def build_dir() -> Path:
    """Where make install puts the library: inside this environment (the venv), outside the sources."""
    return Path(sys.prefix) / "lib" / "amp-zoo-cpu-kernels"


def mindspore_lib() -> Optional[Path]:
    """MindSpore's lib folder (its bundled libdnnl.so.3), found without importing MindSpore."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve() / "lib"


class _Version(ctypes.Structure):  # dnnl_version_t
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


def runtime_version() -> Tuple[Tuple[int, int, int], int]:
    """((major, minor, patch), cpu runtime) of MindSpore's bundled oneDNN, from its dnnl_version();
    raises OSError when the library is not there."""
    lib_dir = mindspore_lib()
    if lib_dir is None:
        raise OSError("MindSpore is not installed")
    dnnl = ctypes.CDLL(str(lib_dir / "libdnnl.so.3"))
    dnnl.dnnl_version.restype = ctypes.POINTER(_Version)
    v = dnnl.dnnl_version().contents
    return (v.major, v.minor, v.patch), v.cpu_runtime


def version_text(version) -> str:
    return ".".join(map(str, version))


def mismatch(headers, runtime, cpu_runtime: int = THREADPOOL) -> Optional[str]:
    """Why a library compiled against oneDNN `headers` (major, minor, patch) cannot run on the oneDNN `runtime`
    MindSpore bundles, or None: the same major version, headers not newer, and the thread-pool runtime."""
    headers, runtime = tuple(headers), tuple(runtime)
    if headers[0] != runtime[0] or headers > runtime:
        return (f"built against oneDNN {version_text(headers)} headers, but MindSpore's oneDNN is "
                f"{version_text(runtime)}: rebuild with headers of {runtime[0]}.x not newer than "
                f"{version_text(runtime)} (make install)")
    if cpu_runtime != THREADPOOL:
        return f"MindSpore's oneDNN uses CPU runtime {cpu_runtime:#x}, not the thread pool these kernels drive"
    return None


def sources_digest() -> str:
    return hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:16]


def check(directory: Path) -> Tuple[Optional[Path], str]:
    """(the library in `directory`, "") when it can run here, else (None, why in one line)."""
    library, record = directory / LIBRARY, directory / RECORD
    if not library.is_file() or not record.is_file():
        return None, f"the CPU kernels are not built (no {library}); make install builds them (needs g++)"
    try:
        built = json.loads(record.read_text())
        headers = tuple(int(x) for x in str(built["onednn_headers"]).split("."))
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{record} is not a build record of the CPU kernels; make install rebuilds them"
    if built.get("sources") != sources_digest():
        return None, f"the CPU kernels in {directory} were built from other sources; make install rebuilds them"
    try:
        runtime, cpu_runtime = runtime_version()
    except (OSError, AttributeError) as e:
        return None, f"MindSpore's oneDNN (libdnnl.so.3) cannot be read: {e}"
    reason = mismatch(headers, runtime, cpu_runtime)
    return (None, f"the CPU kernels are off: {reason}") if reason else (library, "")


@lru_cache(maxsize=1)
def _installed() -> Tuple[Optional[Path], str]:
    return check(build_dir())


def has_ops() -> bool:
    """Whether the extension is built for this environment and fits MindSpore's oneDNN (torchvision's
    extension.py has the same probe)."""
    return _installed()[0] is not None


def why_not() -> str:
    """Why has_ops() is False, in one line ("" when it is True)."""
    return _installed()[1]


def library() -> Path:
    """The built library, for ops.Custom; raises RuntimeError (with why_not) when there is none."""
    path, reason = _installed()
    if path is None:
        raise RuntimeError(reason)
    return path


@lru_cache(maxsize=1)
def loaded() -> ctypes.CDLL:
    """The built library, loaded into this process (the same handle MindSpore's custom ops use: one pool, one
    set of settings); raises RuntimeError (with why_not) when there is none."""
    return ctypes.CDLL(str(library()))


def pool_threads() -> int:
    """The threads the kernels' pool runs (Settings.threads, or auto_threads() where configure gave 0; the cores
    this process may run on where nothing configured it)."""
    return int(loaded().AmpZooPoolThreads())


POOL_WINDOW_S = 0.2  # how often the pool measures what other processes take of its cores (runtime.cc's kWindow)


def pool_busy() -> int:
    """How often the kernels' pool found the machine busy so far: the 0.2 s windows in which other processes took a
    core or more of the cores this process may use (its own threads never count). In such a window only the
    threads the cores left over work, the caller at least. 0 where the library is not built."""
    return int(loaded().AmpZooPoolBusy()) if has_ops() else 0


def weight_gradients() -> str:
    """Where a bf16 convolution's direct weight gradient runs, in a clause: "oneDNN 3.2.0 (OpenMP)" when
    omp_weights.cc loaded the OpenMP build beside the library (onednn-cpu-gomp, requirements-data.txt), else why
    not (then MindSpore's threadpool oneDNN runs it). Loads the library; raises RuntimeError without one."""
    status = loaded().AmpZooOmpWeightsStatus
    status.restype = ctypes.c_char_p
    return status().decode()


def cpu_flags() -> set:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


AUTO_CAP = "AMP_ZOO_ONEDNN_AUTO"  # the process id that set ONEDNN_MAX_CPU_ISA itself (ampzoo.runtime.cap_onednn_isa)


def onednn_runs_avx512() -> bool:
    """Whether oneDNN will run AVX-512 kernels for a network without MindSpore convolutions: the CPU has them and
    no cap below them was set by the user (the zoo's own auto cap, marked by AUTO_CAP, is lifted for such a
    network: ampzoo.runtime.cap_onednn_isa)."""
    if "avx512f" not in cpu_flags():
        return False
    isa = "" if os.environ.get(AUTO_CAP) else os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not isa or isa == "ALL" or "AVX512" in isa or "AMX" in isa


NO_BF16_ISA = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}  # caps


@dataclass(frozen=True)
class Settings:
    """What the kernels run with (the runtime.cpu_* keys of the schema, ampzoo.config.RuntimeConfig), passed to the
    library by `configure` in one call: never through the environment."""
    compute: str = "fp32"       # fp32, bf16 or bf16_backward: how fp16 convolutions and Dense layers multiply, where
                                # the CPU can (cpu_compute says what runs)
    threads: int = 0            # the pool's threads; 0: the cores this process may run on (auto_threads)
    spin_us: int = 200          # how long an idle pool thread spins before it sleeps (0: it sleeps at once)
    weight_grad: str = "auto"   # a bf16 convolution's weight gradient: auto (one matmul on small planes, oneDNN's
                                # direct kernel in its OpenMP build where installed, the kernels' own between plain
                                # layers), direct (oneDNN's kernels only), threadpool (never the OpenMP build)
    half_isa: str = "auto"      # the fp16 conversions: auto (AVX-512 or F16C where the CPU has them), f16c, portable


COMPUTE = {"fp32": 0, "bf16": 1, "bf16_backward": 2}
WEIGHT_GRAD = {"auto": (1, 1), "direct": (0, 1), "threadpool": (1, 0)}  # (the matmul and own, the OpenMP build)
HALF_ISA = {"auto": 2, "f16c": 1, "portable": 0}
_settings = Settings()


def auto_threads() -> int:
    """The cores this process may run on (its affinity mask: msrun's core binding, taskset), shared among msrun's
    workers when they are not bound to cores of their own (MS_WORKER_NUM, msrun's variable)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = int(os.environ.get("MS_WORKER_NUM", "1") or 1) if os.environ.get("MS_ROLE") else 1
    if workers > 1 and n >= (os.cpu_count() or n):
        n //= min(workers, n)
    return max(n, 1)


def configure(**changes) -> Settings:
    """The kernels' settings from now on: `changes` over the current ones (Settings' fields), checked, and passed
    to the library in one call (AmpZooConfigure) where it is built. A network's kernels read them where they run,
    so two compute modes compare by calling this between steps. Returns the settings in force. Raises ValueError
    naming a value that is not valid."""
    global _settings
    new = replace(_settings, **changes)
    for name, valid in (("compute", COMPUTE), ("weight_grad", WEIGHT_GRAD), ("half_isa", HALF_ISA)):
        if getattr(new, name) not in valid:
            raise ValueError(f"{name}={getattr(new, name)} is not valid; valid: {', '.join(valid)}")
    if new.threads < 0 or new.spin_us < 0:
        raise ValueError(f"threads={new.threads}, spin_us={new.spin_us}: each is 0 or more")
    if has_ops():
        matmul, openmp = WEIGHT_GRAD[new.weight_grad]
        loaded().AmpZooConfigure(COMPUTE[new.compute], new.threads or auto_threads(),
                                 new.spin_us, HALF_ISA[new.half_isa], matmul, openmp)
    _settings = new
    return new


def settings() -> Settings:
    """The settings `configure` last passed (the defaults before it)."""
    return _settings


def cpu_compute(flags: Optional[set] = None, asked: Optional[str] = None) -> str:
    """How fp16 convolutions and Dense layers (matmul.cc) multiply on this CPU (runtime.cc's Bf16Compute, the same
    rule): "fp32"; "bf16" or "bf16_backward" (the backward passes only) where asked (`asked`, else the
    configured Settings.compute: runtime.cpu_compute through ampzoo.engine.network.set_cpu_compute), each only on a CPU
    with AVX512-BF16 and not under an ONEDNN_MAX_CPU_ISA cap below it (AVX2, for MindSpore's own convolutions).
    bf16 runs oneDNN's bf16 kernels (fp32 sums, each output rounded once to fp16)."""
    flags = cpu_flags() if flags is None else flags
    asked = _settings.compute if asked is None else asked
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    bf16 = {"avx512_bf16", "avx512f", "f16c"} <= flags and cap not in NO_BF16_ISA
    return asked if bf16 and asked in ("bf16", "bf16_backward") else "fp32"


def low_precision(flags: Optional[set] = None) -> str:
    """What the kernels do with low precision on this CPU, in one line: fp16 tensors are stored in fp16 between
    the kernels and computed in fp32 inside them (the conversions: AVX-512, F16C, else portable code), or the
    convolutions and Dense layers in bf16 where asked (cpu_compute); native fp16 arithmetic (AVX512-FP16) is not
    used, and amp.dtype=bfloat16 is refused (MindSpore's CPU build has no bf16 Conv2D or MatMul for the layers
    around them). make doctor measures what this costs against fp32."""
    flags = cpu_flags() if flags is None else flags
    native = ("present, not used: the kernels compute fp32" if "avx512_fp16" in flags
              else "absent (no AVX512-FP16)")
    return (f"{fp16_path(flags)}; native fp16 arithmetic {native}; amp.dtype=bfloat16 refused on the CPU")


def fp16_path(flags: Optional[set] = None) -> str:
    """How the kernels hold and compute fp16 on this CPU, in a clause (low_precision's first)."""
    flags = cpu_flags() if flags is None else flags
    convert = ("AVX-512" if {"avx512f", "f16c"} <= flags else "F16C" if {"avx2", "f16c"} <= flags
               else "portable code")
    mode = cpu_compute(flags)
    conv = ("" if mode == "fp32" else f"; the convolutions and Dense layers"
            f"{' in their backward passes' if mode == 'bf16_backward' else ''} multiply fp16 rounded to bf16 "
            f"(AVX512-BF16, oneDNN's bf16 kernels) and sum in fp32")
    return f"fp16 stored in fp16 between the kernels and computed in fp32 inside them ({convert} conversions){conv}"
