"""Build the CPU kernels:  python -m cpu_kernels.build   (make install runs it)

On x86-64, compiles the extension's sources (cpu_kernels.SOURCES) with g++ (or $CXX) against the oneDNN headers
of the `onednn-devel` package (requirements-data.txt) and links them to MindSpore's bundled libdnnl.so.3. The
library and build.json (what it was built against) go to cpu_kernels.build_dir(), inside the environment.
Warnings are on; under CI=true they are errors, and a failed build fails the command. Elsewhere a failed build is
one `note:` line and exit 0: the kernels are optional, and the networks then run MindSpore's own kernels. On
another machine (an Ascend server's aarch64 Kunpeng) it builds nothing: one note, exit 0.
"""
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from cpu_kernels import (CSRC, LIBRARY, OMP_LIBRARY, RECORD, SOURCES, build_dir, check, mindspore_lib, mismatch,
                         runtime_version, sources_digest, version_text)

FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra"]  # -O3: at -O2 g++ 12 leaves pool loops scalar


def headers() -> Optional[Path]:
    """The include folder holding oneapi/dnnl/dnnl.hpp in this environment (onednn-devel installs it there)."""
    for root in dict.fromkeys([sys.prefix, sysconfig.get_paths()["data"]]):
        path = Path(root) / "include"
        if (path / "oneapi" / "dnnl" / "dnnl.hpp").is_file():
            return path
    return None


def header_version(include: Path):
    text = (include / "oneapi" / "dnnl" / "dnnl_version.h").read_text()
    return tuple(int(re.search(rf"#define DNNL_VERSION_{part} (\d+)", text).group(1))
                 for part in ("MAJOR", "MINOR", "PATCH"))


def omp_onednn() -> Optional[Tuple[Path, str]]:
    """(libdnnl.so.3, its package version) of the onednn-cpu-gomp wheel (requirements-data.txt): oneDNN built on
    OpenMP, for omp_weights.cc; None when it is not installed. The wheel installs the library three times
    (libdnnl.so, .so.3 and .so.3.2: a wheel holds no symbolic links), 54 MB each; the two others become links to
    libdnnl.so.3, so the environment holds one copy."""
    try:
        dist = importlib.metadata.distribution("onednn-cpu-gomp")
    except importlib.metadata.PackageNotFoundError:
        return None
    copies = {f.name: Path(dist.locate_file(f)) for f in dist.files or [] if f.name.startswith("libdnnl.so")}
    main = copies.get("libdnnl.so.3")
    if main is None or not main.is_file():
        return None
    for name, path in copies.items():
        if name != main.name and path.is_file() and not path.is_symlink() and path.parent == main.parent \
                and path.stat().st_size == main.stat().st_size and path.read_bytes() == main.read_bytes():
            partial = path.with_name(f".{name}.link")
            partial.unlink(missing_ok=True)
            partial.symlink_to(main.name)
            os.replace(partial, path)
    return main.resolve(), dist.version


def build(out_dir: Path, werror: bool = False) -> Path:
    """Compile the library into out_dir with its build.json (atomically: parallel builds do not clash);
    raises RuntimeError with one line saying why not."""
    include = headers()
    if include is None:
        raise RuntimeError("the oneDNN headers are not installed (pip install --no-deps -r requirements-data.txt)")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    lib = mindspore_lib()
    if lib is None:
        raise RuntimeError("MindSpore is not installed")
    version = header_version(include)
    runtime, cpu_runtime = runtime_version()
    reason = mismatch(version, runtime, cpu_runtime)
    if reason:
        raise RuntimeError(reason)
    flags = FLAGS + (["-Werror"] if werror else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        # the wheel's dnnl_config.h is configured for SYCL; MindSpore's libdnnl runs the thread-pool runtime
        config = (include / "oneapi" / "dnnl" / "dnnl_config.h").read_text()
        for key in ("DNNL_CPU_THREADING_RUNTIME", "DNNL_CPU_RUNTIME"):
            config = re.sub(rf"#define {key} \S+", f"#define {key} DNNL_RUNTIME_THREADPOOL", config)
        config = re.sub(r"#define DNNL_GPU_RUNTIME \S+", "#define DNNL_GPU_RUNTIME DNNL_RUNTIME_NONE", config)
        (Path(tmp) / "oneapi" / "dnnl").mkdir(parents=True)
        (Path(tmp) / "oneapi" / "dnnl" / "dnnl_config.h").write_text(config)
        partial = Path(tmp) / LIBRARY
        # an RPATH, not a RUNPATH: LD_LIBRARY_PATH cannot swap in another libdnnl.so.3 (the venv's lib/ holds
        # onednn-cpu-gomp's)
        cmd = [compiler, *flags, f"-I{tmp}", f"-I{CSRC}", f"-I{include}", *map(str, SOURCES), "-o", str(partial),
               f"-L{lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib}", "-Wl,--disable-new-dtags", "-pthread"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.stderr.strip():
            print(done.stderr.strip(), file=sys.stderr)  # warnings, or the errors, in full
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed (its messages are above)")
        cxx = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()
        omp = omp_onednn()  # linked beside the library, where omp_weights.cc looks for it (none: it is not used)
        if omp:
            (Path(tmp) / OMP_LIBRARY).symlink_to(omp[0])
        record = {"onednn_omp": f"onednn-cpu-gomp {omp[1]}" if omp else None,
                  "onednn_headers": version_text(version), "onednn_runtime": version_text(runtime),
                  "mindspore_lib": str(lib), "compiler": cxx[0] if cxx else compiler, "flags": flags,
                  "machine": platform.machine(), "sources": sources_digest()}
        (Path(tmp) / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if omp:
            os.replace(Path(tmp) / OMP_LIBRARY, out_dir / OMP_LIBRARY)
        elif (out_dir / OMP_LIBRARY).is_symlink():
            (out_dir / OMP_LIBRARY).unlink()
        os.replace(partial, out_dir / LIBRARY)
        os.replace(Path(tmp) / RECORD, out_dir / RECORD)
    return out_dir / LIBRARY


def main() -> int:
    ci = os.environ.get("CI", "").lower() == "true"
    if platform.machine() not in ("x86_64", "AMD64"):  # an Ascend server's Kunpeng (aarch64), say
        print(f"note: the CPU kernels are built for x86-64 only; on {platform.machine()} the networks run "
              f"MindSpore's own kernels (on Ascend and GPU they are not used at all)", file=sys.stderr)
        return 0
    out_dir = build_dir()
    try:
        path = build(out_dir, werror=ci)
    except RuntimeError as e:
        print(f"{'error' if ci else 'note'}: the CPU kernels were not built: {e}; the networks run MindSpore's "
              f"own kernels (slower on the CPU)", file=sys.stderr)
        return 1 if ci else 0
    built = json.loads((out_dir / RECORD).read_text())
    omp = built.get("onednn_omp")
    print(f"CPU kernels: {path} (oneDNN {built['onednn_headers']} headers, MindSpore's oneDNN "
          f"{built['onednn_runtime']}; bf16 weight gradients "
          f"{f'on OpenMP: {omp}' if omp else 'on the thread pool (onednn-cpu-gomp not installed)'})")
    reason = check(out_dir)[1]
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
