"""The machine a result was measured on, recorded beside the result: absolute times compare only between
results from one kind of machine (the same CPU model and vector ISA)."""
import platform

from ampzoo.runtime import cpu_info


def vector_isa(flags) -> str:
    """The widest x86 vector instructions among /proc/cpuinfo's flags: two CPUs of one model name may differ
    in it, and their times do not compare."""
    flags = set(flags)
    for flag, name in (("amx_tile", "AVX-512, AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return ""


def cpu_family() -> str:
    """/proc/cpuinfo's "cpu family" (AMD's 25 is Zen 3 or Zen 4, 26 Zen 5; "AMD EPYC" alone names none), with its
    model number: "25/1"; "" where there is none."""
    found = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("cpu family", "model") and key not in found:
                    found[key] = line.split(":", 1)[1].strip()
                if len(found) == 2:
                    break
    except OSError:
        return ""
    return "/".join(found[k] for k in ("cpu family", "model") if k in found)


def machine() -> dict:
    """This machine: CPU model, family and vector ISA, cores, memory, MindSpore and Python versions."""
    import mindspore
    import psutil
    cpu, flags = cpu_info()
    return {"cpu": cpu or platform.processor() or platform.machine(), "family": cpu_family(), "isa": vector_isa(flags),
            "cores": psutil.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30),
            "mindspore": mindspore.__version__, "python": platform.python_version()}


def machine_kind(mach: dict) -> str:
    """What two results must share for their times to compare: 'CPU MODEL (AVX2)'. A record written before
    the ISA was kept names the CPU alone."""
    return f"{mach['cpu']} ({mach['isa']})" if mach.get("isa") else mach.get("cpu")
