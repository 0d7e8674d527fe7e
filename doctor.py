"""Check a machine before training on it:  python doctor.py   (or make doctor; under msrun: msrun ... doctor.py)

One line per check, `ok`, `fails: ...; <what to do>` or `skipped: ...`, and exit 1 when any check fails:
  device       the device MindSpore can use, its SoC, and why not (CANN/CUDA environment, plugin load errors)
  overflow     which overflow check the loss-scale step uses on this device (910A saturation, INF/NaN, isfinite)
  inf forward  the loss-scale step sees an inf injected in the forward pass: the step is skipped, the scale lowered
  inf backward the same for an inf that appears only in the backward pass (a scaled gradient beyond fp16)
  kernels      fp16 and bf16 forward and backward kernels for Conv2d, Dense (MatMul), BatchNorm and LayerNorm
  cpu kernels  on the CPU: which low-precision path the project's CPU kernels run here, and a conv + BatchNorm +
               ReLU step in fp16 against the same step in fp32
  sinking      two epochs of recipe lenet_o2 on its embedded data through train.py, sinking on a device: the
               epoch lines, an evaluation and a checkpoint show that the callbacks fired
  profiler     runtime.profile=true: the profiler's output for this device is found and summarised
  msrun        under msrun: every rank runs the same code and MindSpore on its own device, and an all-reduce
               returns the sum of the ranks
On a CPU the device checks say "skipped: no device". Send the whole output when a line fails.

It installs nothing (an Ascend cluster is often offline): a Python without the zoo's packages gets one line naming
the missing ones and the command that installs them (ampzoo.needs), before anything else runs.
"""
import ampzoo.entry  # first: a command's start-up, before MindSpore loads (and a Python without the zoo's
                     # packages gets one line naming them: ampzoo.needs)

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Tuple

import numpy as np

import mindspore as ms
from mindspore import nn
from omegaconf import OmegaConf

from ampzoo.amp.loss_scale import AmpTrainStep, plan_loss_scale, saturation_mode
from ampzoo.amp.policy import CastOutput
from ampzoo.engine.metrics import NetWithLoss
from ampzoo.errors import fail
from ampzoo.runtime import device_hardware, msrun_env, pick_device, plugin_errors, source_commit

ROOT = Path(__file__).resolve().parent
OK, FAILS, SKIPPED = "ok", "fails", "skipped"


class Failed(Exception):
    """A check that failed: the message says what, then what to do."""


def first_line(error: BaseException) -> str:
    return next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)


# ---- device --------------------------------------------------------------------------------------------------

def soc() -> str:
    from mindspore._c_expression import MSContext
    context = MSContext.get_instance()
    name = context.get_ascend_soc_version()
    kind = ("910A" if context.ascend_soc_supports_feature("amp_loss_scale_train_classic_target") else
            "910B or later" if context.ascend_soc_supports_feature("train_hq_dtype_line") else "unknown kind")
    return f"{name} ({kind})"


def check_device() -> Tuple[str, str]:
    device = pick_device("auto")
    hardware = device_hardware()
    if device == "CPU" and hardware:
        env = ("ASCEND_HOME_PATH" if hardware == "Ascend" else "CUDA_HOME")
        raise Failed(f"this machine has {hardware} devices but MindSpore {ms.__version__} cannot use them "
                     f"({plugin_errors() or 'a CPU-only wheel'}; {env}={os.environ.get(env, 'unset')}); install the "
                     + ("Ascend wheel matching your CANN and source CANN's set_env.sh (e.g. "
                        "/usr/local/Ascend/ascend-toolkit/set_env.sh)" if hardware == "Ascend" else
                        "GPU wheel matching your CUDA, with CUDA and cuDNN on LD_LIBRARY_PATH"))
    if device == "CPU":
        return SKIPPED, (f"no device: CPU only (MindSpore {ms.__version__}: "
                         f"{plugin_errors() or 'a CPU-only wheel'})")
    if device == "Ascend":
        return OK, f"Ascend, SoC {soc()}, MindSpore {ms.__version__}, CANN at {os.environ.get('ASCEND_HOME_PATH', '?')}"
    return OK, f"GPU, MindSpore {ms.__version__}, CUDA_HOME={os.environ.get('CUDA_HOME', 'unset')}"


# ---- overflow ------------------------------------------------------------------------------------------------

def overflow_mode(device: str) -> str:
    if device == "CPU":
        return "CPU: an isfinite check of the gradients in the graph (amp.loss_scale.finite_sum)"
    if device == "GPU":
        return "GPU: MindSpore's INF/NaN check of the gradients"
    from mindspore._c_expression import MSContext
    context = MSContext.get_instance()
    a, b = (context.ascend_soc_supports_feature(f) for f in ("amp_loss_scale_train_classic_target",
                                                               "train_hq_dtype_line"))
    if saturation_mode(device, a, b):
        return ("Ascend saturation mode (" + ("910A" if a else "MS_ASCEND_CHECK_OVERFLOW_MODE=SATURATION_MODE") +
                "): the NPU float-status register, read after the backward")
    return "Ascend INF/NaN mode: MindSpore's check of the gradients (MS_ASCEND_CHECK_OVERFLOW_MODE unset)"


def loss_scale_step(device: str, scale: float):
    """An fp16 Dense whose output is cast to fp32, in the project's loss-scale step with a dynamic scale."""
    net = CastOutput(nn.Dense(4, 4, weight_init="ones", bias_init="zeros").to_float(ms.float16), ms.float32)
    cfg = OmegaConf.create({"type": "dynamic", "init_scale": scale, "factor": 2.0, "window": 1000, "scale": scale,
                            "drop_overflow_update": True, "min_scale": 1.0})
    loss = NetWithLoss(net, nn.MSELoss())
    return net, AmpTrainStep(loss, nn.SGD(net.trainable_params(), 0.01), plan_loss_scale(cfg), device)


def injected(device: str, x: float, scale: float) -> str:
    """One step on inputs of value x at loss scale `scale`: it must be skipped (weights unchanged, scale halved)."""
    net, step = loss_scale_step(device, scale)
    before = net.cell.weight.asnumpy().copy()
    _, overflow, _ = step(ms.Tensor(np.full((4, 4), x, np.float32)), ms.Tensor(np.zeros((4, 4), np.float32)))
    after, new_scale = net.cell.weight.asnumpy(), float(step.scale_sense.asnumpy())
    if not bool(overflow.asnumpy()):
        raise Failed(f"an overflow went unseen (x={x:g}, scale {scale:g}; overflow check: {overflow_mode(device)}); "
                     f"fp16 training would apply inf/NaN updates: send this output")
    if not np.array_equal(before, after) or new_scale != scale / 2:
        raise Failed(f"the overflow was seen but the step was not skipped (weights changed: "
                     f"{not np.array_equal(before, after)}, scale {scale:g} -> {new_scale:g}): send this output")
    return f"step skipped, scale {scale:,.0f} -> {new_scale:,.0f}"


def check_clean_step(device: str) -> str:
    net, step = loss_scale_step(device, 1024.0)
    before = net.cell.weight.asnumpy().copy()
    _, overflow, _ = step(ms.Tensor(np.full((4, 4), 0.5, np.float32)), ms.Tensor(np.zeros((4, 4), np.float32)))
    if bool(overflow.asnumpy()) or np.array_equal(before, net.cell.weight.asnumpy()):
        raise Failed(f"a clean fp16 step was taken for an overflow ({overflow_mode(device)}): every step would be "
                     f"skipped; send this output")
    return "a clean step updates the weights"


# ---- kernels -------------------------------------------------------------------------------------------------

KERNELS = {"Conv2d": (lambda: nn.Conv2d(3, 4, 3), (2, 3, 8, 8)), "Dense": (lambda: nn.Dense(8, 4), (2, 8)),
           "BatchNorm": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)), "LayerNorm": (lambda: nn.LayerNorm((8,)), (2, 8))}


def kernel_runs(build: Callable, shape, dtype) -> str:
    """'' when the Cell runs forward and backward in `dtype` here, else MindSpore's reason."""
    cell = build().to_float(dtype)
    cell.set_train(True)
    x = ms.Tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).astype(dtype)
    try:
        ms.grad(lambda t: cell(t).astype(ms.float32).sum())(x).asnumpy()
        return ""
    except Exception as e:  # noqa: BLE001  (MindSpore raises RuntimeError, TypeError or ValueError for a kernel)
        return first_line(e)


def check_kernels(device: str) -> Tuple[str, str]:
    ms.set_context(mode=ms.PYNATIVE_MODE)  # one op at a time: each is a kernel of this device
    try:
        missing = {dt: [f"{name} ({why})" for name, (build, shape) in KERNELS.items()
                        for why in [kernel_runs(build, shape, getattr(ms, dt))] if why]
                   for dt in ("float16", "bfloat16")}
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    if missing["float16"]:
        raise Failed(f"no {device} float16 kernel for {'; '.join(missing['float16'])}: amp.level O1-O3 cannot run "
                     f"here; send this output")
    bf16_expected = device in ("CPU", "GPU") or (device == "Ascend" and "910A" in soc())
    if missing["bfloat16"] and not bf16_expected:
        raise Failed(f"no {device} bfloat16 kernel for {'; '.join(missing['bfloat16'])}: use amp.dtype=float16; "
                     f"send this output")
    bf16 = ("bf16 too" if not missing["bfloat16"] else
            f"bf16 absent, as expected on {device if device != 'Ascend' else 'a 910A'} (amp.dtype=bfloat16 is refused "
            f"there)")
    return OK, f"fp16 forward and backward for {', '.join(KERNELS)}; {bf16}"


class MeanOf(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x):
        return self.net(x).mean()


def check_cpu_kernels(device: str) -> Tuple[str, str]:
    """The CPU kernels' low-precision path on this CPU (cpu_kernels.low_precision), where a bf16 weight gradient
    runs (cpu_kernels.weight_gradients), and what an fp16 step of conv + BatchNorm + ReLU costs against fp32, each
    the median of 7 steps taken in turns; on a CPU that runs bf16 (runtime.cpu_compute=bf16: AVX512-BF16, oneDNN
    not capped below it) the fp16 step with bf16 products too."""
    from cpu_kernels import configure, cpu_compute, has_ops, low_precision, settings, weight_gradients, why_not
    if device != "CPU":
        return SKIPPED, "the project's CPU kernels run on the CPU only"
    if not has_ops():
        return SKIPPED, f"{why_not()}; MindSpore's own CPU kernels run, fp16 slower than fp32"
    from cpu_kernels.cells import CpuBatchNorm2d, CpuConv2d, CpuReLU
    x = ms.Tensor(np.random.RandomState(0).randn(16, 64, 32, 32).astype(np.float32))
    steps = {}
    for dtype in (ms.float32, ms.float16):
        body = nn.SequentialCell([CpuConv2d(64, 64, 3, 1, 1), CpuBatchNorm2d(64), CpuReLU()])
        if dtype == ms.float16:  # as ampzoo.amp.policy's O2 has it: conv and ReLU in fp16, BatchNorm fp32 inside
            body.to_float(dtype)
            body[1].add_flags_recursive(fp16=False, fp32=False, bf16=False)
        net = CastOutput(body, ms.float32)
        net.set_train()
        grad = ms.value_and_grad(MeanOf(net), None, net.trainable_params())
        grad(x)  # compile
        steps[dtype] = grad
    # (name, step, products): the kernels read cpu_kernels.configure's settings where they run
    variants = [("fp32", steps[ms.float32], "fp32"), ("fp16", steps[ms.float16], "fp32")]
    if cpu_compute(asked="bf16") == "bf16":
        variants.append(("fp16 with bf16 products", steps[ms.float16], "bf16"))
    before = settings().compute
    times = {name: [] for name, _, _ in variants}
    try:
        for _ in range(7):
            for name, step, products in variants:
                configure(compute=products)
                t0 = time.perf_counter()
                step(x)[0].asnumpy()
                times[name].append(time.perf_counter() - t0)
    finally:
        configure(compute=before)
    ms_of = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    parts = [f"{name} {ms_of[name]:.1f} ms ({ms_of['fp32'] / ms_of[name]:.2f}x fp32's speed)"
             for name, _, _ in variants if name != "fp32"]
    auto = ("runtime.cpu_compute=auto trains O1-O3 with bf16 products here (AVX512-BF16); a run's own evaluations "
            "keep them, eval.py computes fp32" if cpu_compute(asked="bf16") == "bf16" else
            "runtime.cpu_compute=auto computes fp32 products here (no AVX512-BF16)")
    return OK, (f"{low_precision()}; {auto}; bf16 weight gradients: {weight_gradients()}; conv+BatchNorm+ReLU fp32 "
                f"{ms_of['fp32']:.1f} ms, {', '.join(parts)}")


# ---- a recipe through train.py -------------------------------------------------------------------------------

def train(run_dir: Path, *overrides: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AMP_ZOO_ONEDNN_AUTO"}
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=lenet_o2", f"hydra.run.dir={run_dir}",
           "logger.progress_bar=false", *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")] or result.stderr.splitlines()
        raise Failed(f"{' '.join(cmd[1:])} exited {result.returncode}: {(errors or ['no output'])[-1][:400]}; send "
                     f"{run_dir / 'train.log'}")
    return json.loads((run_dir / "metrics.json").read_text())


def check_sinking(device: str, folder: Path) -> Tuple[str, str]:
    run_dir = folder / "sink"
    done = train(run_dir, "trainer.epochs=2", "trainer.eval_every=1", "trainer.ckpt_every=1")
    log = (run_dir / "train.log").read_text()
    epochs = [ln for ln in log.splitlines() if " epoch " in ln and "/2: step " in ln]
    saved = list((run_dir / "checkpoints").glob("*.ckpt"))
    want_steps = 2 * done["steps_per_epoch"]
    if done["steps"] != want_steps or len(epochs) != 2 or len(done["eval_history"]) < 2 or not saved:
        raise Failed(f"callbacks did not fire as they should: {done['steps']} of {want_steps} steps, {len(epochs)} "
                     f"epoch lines of 2, {len(done['eval_history'])} evaluations of 2, {len(saved)} checkpoints; "
                     f"send {run_dir / 'train.log'}")
    if device != "CPU" and not done["sink"]:
        raise Failed(f"train.py did not sink on {device}; send {run_dir / 'train.log'}")
    how = "sinking" if done["sink"] else "not sinking: MindSpore's CPU backend does not sink"
    return OK, (f"2 epochs of lenet_o2 ({want_steps} steps, {how}): 2 epoch lines, evaluations, "
                f"{len(saved)} checkpoints")


def check_profiler(device: str, folder: Path) -> Tuple[str, str]:
    run_dir = folder / "profile"
    train(run_dir, "trainer.epochs=1", "trainer.max_steps=8", "runtime.profile=true")
    summary = run_dir / "profile.json"
    if not summary.exists():
        raise Failed(f"the profiler wrote nothing this project can read under {run_dir / 'profiler'}; send the "
                     f"list of its files (find {run_dir / 'profiler'}) and {run_dir / 'train.log'}")
    found = json.loads(summary.read_text())
    if found["steps"] < 5 or abs(sum(found["share"].values()) - 1) > 1e-6:
        raise Failed(f"the profile of {run_dir} is incomplete ({found['steps']} steps, shares sum to "
                     f"{sum(found['share'].values()):.3f}); send {summary}")
    return OK, f"{found['steps']} steps profiled on {device}, {found['total_ms_per_step']:.2f} ms of op time a step"


# ---- msrun ---------------------------------------------------------------------------------------------------

def check_msrun(device: str) -> Tuple[str, str]:
    from mindspore.communication import get_group_size, get_rank
    from mindspore.ops.communication import all_reduce

    def reduce(x: float, op: str) -> float:
        value = ms.Tensor([x], ms.float32)
        out = all_reduce(value, op=op)  # (result, handle), or in place
        return float((out[0] if isinstance(out, tuple) else value).asnumpy()[0])

    rank, world = get_rank(), get_group_size()
    total = reduce(float(rank), "sum")
    if total != world * (world - 1) / 2:
        raise Failed(f"an all-reduce over {world} ranks returned {total:g}, not {world * (world - 1) // 2}: the "
                     f"collective ({'HCCL' if device == 'Ascend' else 'NCCL' if device == 'GPU' else 'MCCL'}) is "
                     f"broken; send every worker log")
    # 20 bits of a hash are exact in float32: the ranks agree when its largest and smallest value are equal
    mine = int(hashlib.sha1(f"{ms.__version__} {source_commit()} {device}".encode()).hexdigest()[:5], 16)
    if reduce(float(mine), "max") != -reduce(-float(mine), "max"):
        raise Failed(f"the ranks run different code, MindSpore or device (rank {rank}: MindSpore {ms.__version__}, "
                     f"commit {source_commit()}, {device}); install the same on every server")
    return OK, f"rank {rank} of {world}: an all-reduce is right, and every rank runs the same code and MindSpore"


# ---- the report ----------------------------------------------------------------------------------------------

def run(name: str, check: Callable[[], Tuple[str, str]], lines: List[str]) -> str:
    try:
        status, detail = check()
    except Failed as e:
        status, detail = FAILS, str(e)
    except Exception as e:  # noqa: BLE001  (a check that crashed is a failed check, reported in its line)
        status, detail = FAILS, f"{type(e).__name__}: {first_line(e)}; send this output"
    print(f"{name:<13}{status}: {detail}", flush=True)
    lines.append(status)
    return status


def main(argv: List[str]) -> None:
    """Every check; exit 1 when any fails."""
    if argv:
        fail(f"doctor.py takes no arguments; got {argv[0]!r}")
    if checks():
        raise SystemExit(1)


def checks() -> int:
    if msrun_env():  # before any Tensor, as MindSpore asks; msrun's scheduler runs this command too, to schedule
        from mindspore.communication import init
        ms.set_device(pick_device("auto"))
        init()
        if os.environ.get("MS_ROLE") == "MS_SCHED":
            return 0
    lines: List[str] = []
    device = ["CPU"]

    def device_check():
        status, detail = check_device()
        device[0] = pick_device("auto") if status == OK else "CPU"
        return status, detail

    if run("device", device_check, lines) == FAILS:  # every other check would only repeat it
        print("doctor: the device check failed: fix it first, then run make doctor again", flush=True)
        return 1
    dev, on_device = device[0], device[0] != "CPU"
    if not msrun_env():  # under msrun it was set before init()
        ms.set_device(dev)
    ms.set_context(mode=ms.GRAPH_MODE)
    run("overflow", lambda: (OK, overflow_mode(dev)), lines)
    run("clean step", lambda: (OK, check_clean_step(dev)), lines)
    run("inf forward", lambda: (OK, injected(dev, 3e4, 1024.0)), lines)  # 4 x 3e4 is beyond fp16's 65504
    run("inf backward", lambda: (OK, injected(dev, 0.5, 2.0 ** 24)), lines)  # the forward is fine; the scaled
    run("kernels", lambda: check_kernels(dev), lines)                          # gradient is not
    run("cpu kernels", lambda: check_cpu_kernels(dev), lines)
    if msrun_env():
        run("msrun", lambda: check_msrun(dev), lines)
        for name in ("sinking", "profiler"):
            run(name, lambda: (SKIPPED, "under msrun (run make doctor on one device first)"), lines)
    else:
        run("msrun", lambda: (SKIPPED, "not under msrun (msrun --worker_num=N --local_worker_num=N "
                                       "--master_port=PORT --join=True doctor.py checks the ranks)"), lines)
        with tempfile.TemporaryDirectory(prefix="amp-zoo-doctor-") as folder:
            run("sinking", lambda: check_sinking(dev, Path(folder)), lines)
            run("profiler", lambda: check_profiler(dev, Path(folder)), lines)
    if not on_device:
        print("skipped: no device: the overflow, kernel, sinking and profiler checks ran on the CPU only; run "
              "make doctor on the Ascend or GPU machine", flush=True)
    failed = lines.count(FAILS)
    print(f"doctor: {failed} of {len(lines)} checks failed; send this whole output" if failed else
          f"doctor: {len(lines)} checks, none failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    ampzoo.entry.run(main)  # (doctor's own `run` runs one check)
