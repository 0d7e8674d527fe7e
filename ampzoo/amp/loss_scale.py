"""Loss scaling that works on every device, with AMP telemetry counted inside the graph.

MindSpore's `Model` refuses a dynamic loss-scale manager on CPU, and `TrainOneStepWithLossScaleCell` checks
overflow with an NPU-only status op there. `AmpTrainStep` subclasses it, checks overflow with `finite_sum`
below on CPU (MindSpore's own check on GPU/Ascend), skips the update on overflow, and
updates the scale with MindSpore's update cells (from its LossScaleManagers). It is handed to `Model`
as the train network, so the same recipe trains with a dynamic scale on CPU, GPU and Ascend.

Counters are Parameters updated in the graph, so they are exact in sink mode (where callbacks see only
every N-th step) and saved in every checkpoint with the scale itself.

What is checked every step depends on whether the step can skip an update. With a dynamic scale, or a fixed
one that drops overflowed updates, the graph checks the inputs and gradients every step (it must, to skip).
Without skipping (no scale, or a fixed scale that keeps every update, the bare-MindSpore setting), the step
is exactly MindSpore's TrainOneStepCell and counts nothing: every in-graph check or counter is a kernel more in
every step, a cost a small model feels (docs/amp.md and docs/benchmarks.md measure it), and an
update with inf/NaN in it leaves the weights non-finite for good, so `telemetry()` finds it by checking the
weights when it is read (every log_every steps). Its `amp_steps` stays 0: callbacks count steps on the host.

Gradient accumulation (`update_freq` k > 1, fairseq's --update-freq): every batch adds its unscaled gradients
to `amp_accum.*` (Parameters, so a checkpoint taken mid-update resumes exactly); every k-th batch the optimizer
takes their mean and they are zeroed. With several ranks each accumulates its own gradients, and the mean is
all-reduced once an update, not once a batch (a gradient all-reduce is the size of the model; the overflow flag
each batch all-reduces is one number). An update is skipped when any of its k batches overflowed or had
non-finite inputs. The loss scale moves once per update, as fairseq's does: every batch of an update uses the
same scale, it steps down at the end of an update in which a batch overflowed, and the dynamic scale's growth
window counts updates. Steps and the AMP counters count batches; the learning rate (the optimizer's own step)
counts updates. Overflow and non-finite-input counters count the batches that had them; skipped steps count
every batch of a dropped update (its clean batches are not trained on either), at the update's end.

Ascend in saturation mode (the 910A; a 910B with MS_ASCEND_CHECK_OVERFLOW_MODE=SATURATION_MODE) computes an
overflow as the largest finite value and a NaN as 0, so no isfinite check sees one there: not the input check
(a batch with inf/NaN then shows as an overflowed step, still skipped), not the non-finite loss counter, not the
weight check of a step without skipping. Only the NPU's float status register sees them. So on such a device
the step reads that register after the backward and clears it after the read, exactly where MindSpore 2.10's
own TrainOneStepWithLossScaleCell does (it no longer clears it after the forward pass): the read covers the
input check, the forward and the backward, so a saturated forward and a batch with inf/NaN count as an
overflow. A step without skipping counts a non-finite update from it in the graph: the divergence watch reads
that counter. (Read against MindSpore 2.10's sources; not run on a device.)

With several ranks, a step's overflow and bad-input flags are all-reduced: every rank skips the same steps and
moves its loss scale and counters alike.
"""
import os
from dataclasses import dataclass
from typing import Optional

import mindspore.nn as nn
import mindspore.ops as ops
from mindspore import Parameter, Tensor
from mindspore import dtype as mstype
from mindspore.amp import DynamicLossScaleManager, FixedLossScaleManager
import mindspore.nn.wrap.loss_scale as ms_loss_scale
from mindspore.nn.wrap.loss_scale import _grad_scale

TELEMETRY = ("amp_steps", "amp_overflow_steps", "amp_skipped_steps", "amp_steps_since_overflow",
             "amp_floor_overflows", "amp_nonfinite_losses", "amp_nonfinite_inputs", "amp_nonfinite_updates")


@dataclass
class LossScalePlan:
    """How a loss-scale config maps onto MindSpore's pieces."""
    kind: str
    scale: float                   # the initial scale
    update_cell: Optional[nn.Cell]  # MindSpore's Dynamic/FixedLossScaleUpdateCell, or None
    skip_on_overflow: bool
    optimizer_loss_scale: float    # MindSpore optimizers unscale by this when the step does not
    min_scale: float


def plan_loss_scale(ls_cfg) -> LossScalePlan:
    kind = str(ls_cfg.type)
    if kind == "none":
        return LossScalePlan(kind, 1.0, None, False, 1.0, ls_cfg.min_scale)
    if kind == "fixed" and not ls_cfg.drop_overflow_update:
        # Gradients come back multiplied by the scale; the optimizer divides them (as Model does).
        return LossScalePlan(kind, float(ls_cfg.scale), None, False, float(ls_cfg.scale), ls_cfg.min_scale)
    if kind == "fixed":
        cell = FixedLossScaleManager(ls_cfg.scale, drop_overflow_update=True).get_update_cell()
        return LossScalePlan(kind, float(ls_cfg.scale), cell, True, 1.0, ls_cfg.min_scale)
    cell = DynamicLossScaleManager(ls_cfg.init_scale, ls_cfg.factor, ls_cfg.window).get_update_cell()
    cell.minimum_loss_scale = Tensor(min(ls_cfg.min_scale, 1.0), mstype.float32)  # MindSpore floors at 1.0
    return LossScalePlan(kind, float(ls_cfg.init_scale), cell, True, 1.0, ls_cfg.min_scale)


def zero() -> Tensor:
    """A step counter's start: an int32 0."""
    return Tensor(0, mstype.int32)


class AmpTrainStep(nn.TrainOneStepWithLossScaleCell):
    """One training step: input check, forward, scaled backward, unscale, overflow check, (skipped) update,
    telemetry.

    Returns (loss, overflow, loss scale used for this step)."""

    def __init__(self, net_with_loss: nn.Cell, optimizer: nn.Optimizer, plan: LossScalePlan, device: str,
                 update_freq: int = 1):
        sense = plan.update_cell if plan.update_cell is not None else Tensor(plan.scale, mstype.float32)
        super().__init__(net_with_loss, optimizer, sense)
        self.skip_on_overflow = plan.skip_on_overflow
        self.sens = plan.scale
        self.no_overflow = Tensor(False)
        self.on_cpu = device == "CPU"  # MindSpore's overflow check is NPU/GPU-only
        # on the CPU, one process: the unscale and the overflow check in one pass of the CPU kernels (a Python
        # constant), where MindSpore runs a Mul and a ReduceSum per gradient
        self.unscale_sum = fused_unscale_op(device, self.reducer_flag, net_with_loss)
        # and where the optimizer unscales as it updates (ampzoo.engine.optim.Momentum on the kernels, one update
        # a batch), the check only reads the gradients: no unscaled copy of them is written
        self.unscale_in_update = (self.unscale_sum is not None and update_freq == 1
                                  and getattr(optimizer, "unscales_in_update", False))
        self.unscaled_sum = fused_check_op() if self.unscale_in_update else None
        self.saturation_mode = saturation_mode(device, self.ascend_910a_target, self.ascend_910b_target)
        self.min_scale = Tensor(plan.min_scale, mstype.float32)
        self.amp_steps = Parameter(zero(), name="amp_steps", requires_grad=False)
        self.amp_overflow_steps = Parameter(zero(), name="amp_overflow_steps", requires_grad=False)
        self.amp_skipped_steps = Parameter(zero(), name="amp_skipped_steps", requires_grad=False)
        self.amp_steps_since_overflow = Parameter(zero(), name="amp_steps_since_overflow", requires_grad=False)
        self.amp_floor_overflows = Parameter(zero(), name="amp_floor_overflows", requires_grad=False)
        self.amp_nonfinite_losses = Parameter(zero(), name="amp_nonfinite_losses", requires_grad=False)
        self.amp_nonfinite_inputs = Parameter(zero(), name="amp_nonfinite_inputs", requires_grad=False)
        # non-finite gradients or loss that were applied to the weights (no overflow skipping): divergence
        self.amp_nonfinite_updates = Parameter(zero(), name="amp_nonfinite_updates", requires_grad=False)
        self.update_freq = update_freq
        if update_freq > 1:
            self.amp_accum = self.weights.clone(prefix="amp_accum", init="zeros")
            self.amp_micro_steps = Parameter(zero(), name="amp_micro_steps", requires_grad=False)
            self.amp_accum_skip = Parameter(zero(), name="amp_accum_skip", requires_grad=False)  # 1: drop this update

    def any_rank(self, flag):
        if self.is_distributed:  # a Python constant
            return ops.cast(self.allreduce(ops.cast(flag, mstype.float32)), mstype.bool_)
        return flag

    def overflow_of(self, grads, status):
        if self.on_cpu:
            return self.any_rank(ops.logical_not(finite_sum(grads)))
        return self.get_overflow_status(status, grads)  # MindSpore's check: all-reduced across ranks

    def unscaled_and_finite(self, grads, scale):
        """The gradients unscaled, and whether every element of them is finite (float32 gradients through
        unscale_sum; others, if any, as _grad_scale and finite_sum have them)."""
        unscaled, sums = (), ()
        scale32 = ops.cast(scale, mstype.float32).reshape((1,))  # once, not once a gradient
        for g in grads:
            if ops.dtype(g) == mstype.float32:
                out, total = self.unscale_sum(g, scale32)
            else:
                out = _grad_scale(scale, g)
                total = ops.cast(out, mstype.float32).sum().reshape((1,))
            unscaled = unscaled + (out,)
            sums = sums + (total,)
        return unscaled, ops.isfinite(ops.addn(sums)).all()

    def scaled_finite(self, grads, scale):
        """Whether every element of the float32 gradients, unscaled, is finite: unscaled_and_finite's verdict
        from the same sums, without the unscaled gradients (the optimizer unscales them: update)."""
        scale32 = ops.cast(scale, mstype.float32).reshape((1,))
        sums = ()
        for g in grads:
            sums = sums + (self.unscaled_sum(g, scale32),)
        return ops.isfinite(ops.addn(sums)).all()

    def update(self, grads, scale):
        """The optimizer's step on grads: unscaled by the optimizer itself when unscale_in_update (times
        1 / scale, the Reciprocal and Mul of MindSpore's own unscale), else as they are."""
        if self.unscale_in_update:  # a Python constant
            return self.optimizer.update(grads, ops.reciprocal(ops.cast(scale, mstype.float32).reshape((1,))))
        return self.optimizer(grads)

    def construct(self, *inputs):
        if not self.skip_on_overflow:  # a Python constant: the graph holds one branch or the other
            return self.plain_step(*inputs)
        weights = self.weights
        # A batch with NaN/Inf in its inputs is a data problem: never trained on, and no reason to move the scale.
        bad_input = self.any_rank(ops.logical_not(finite_sum(inputs)))
        loss = self.network(*inputs)
        scale = self.scale_sense * 1.0  # the scale this step uses, before the update cell changes it
        # MindSpore's own step: the NPU status is read after the backward and cleared after that read, never in
        # between, so saturation anywhere in the step (inputs, forward, backward) counts as an overflow
        status = Tensor([0] * 8, mstype.int32)
        sens = ops.ones_like(loss) * ops.cast(scale, ops.dtype(loss))
        grads = self.grad(self.network, weights)(*inputs, sens)
        if self.unscale_in_update:  # a Python constant
            finite = self.scaled_finite(grads, scale)
            overflow = ops.logical_and(ops.logical_not(finite), ops.logical_not(bad_input))
        elif self.unscale_sum is not None:  # one process only: no all-reduce between the unscale and the check
            grads, finite = self.unscaled_and_finite(grads, scale)
            overflow = ops.logical_and(ops.logical_not(finite), ops.logical_not(bad_input))
        else:
            grads = self.hyper_map(ops.partial(_grad_scale, scale), grads)
            if self.update_freq == 1:  # a Python constant; with accumulation, the update's mean is all-reduced once
                grads = self.grad_reducer(grads)
            # with accumulation each rank checks its own gradients: the flag itself is all-reduced (any_rank, or
            # MindSpore's check on a device), so every rank skips the same updates
            overflow = ops.logical_and(self.overflow_of(grads, status), ops.logical_not(bad_input))
        if self.update_freq > 1:  # a Python constant
            # 2: an fp16 overflow (skip, and the scale steps down at the update), 1: bad input (skip only)
            loss = self.accumulate(loss, grads,
                                   ops.cast(overflow, mstype.int32) * 2 + ops.cast(bad_input, mstype.int32))
        else:
            overflow = self.process_loss_scale(overflow)
            if not ops.logical_or(overflow, bad_input):
                loss = ops.depend(loss, self.update(grads, scale))
        ov = ops.cast(overflow, mstype.int32)
        bad = ops.cast(bad_input, mstype.int32)
        at_floor = ops.cast(ops.logical_and(overflow, scale.reshape(()) <= self.min_scale), mstype.int32)
        ops.assign_add(self.amp_steps, Tensor(1, mstype.int32))
        ops.assign_add(self.amp_overflow_steps, ov)
        if self.update_freq == 1:  # with accumulation, `accumulate` counts a dropped update's batches
            ops.assign_add(self.amp_skipped_steps, ov + bad)
        ops.assign(self.amp_steps_since_overflow, (self.amp_steps_since_overflow + 1) * (1 - ov))
        ops.assign_add(self.amp_floor_overflows, at_floor)
        ops.assign_add(self.amp_nonfinite_losses,
                       ops.cast(ops.logical_not(ops.isfinite(loss)), mstype.int32) * (1 - bad))
        ops.assign_add(self.amp_nonfinite_inputs, bad)
        return loss, overflow, scale

    def plain_step(self, *inputs):
        """No skipping: forward, backward with the scale as sensitivity, update (the optimizer unscales). In
        saturation mode the NPU status counts a non-finite update (the host's weight check cannot see one)."""
        loss = self.network(*inputs)
        sens = ops.fill(ops.dtype(loss), ops.shape(loss), self.sens)
        status = Tensor([0] * 8, mstype.int32)  # as in construct: read (then cleared) after the backward only
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        if self.update_freq == 1:  # a Python constant; with accumulation, the update's mean is all-reduced once
            grads = self.grad_reducer(grads)
        if self.saturation_mode:
            bad = ops.cast(self.get_overflow_status(status, grads), mstype.int32)
            loss = ops.depend(loss, ops.assign_add(self.amp_nonfinite_updates, bad))
        if self.update_freq > 1:
            return self.accumulate(loss, grads, Tensor(0, mstype.int32)), self.no_overflow, self.scale_sense
        return ops.depend(loss, self.optimizer(grads)), self.no_overflow, self.scale_sense

    def accumulate(self, loss, grads, skip):
        """Add this batch's gradients; on every update_freq-th batch, step the loss scale once for the whole
        update (down if any of its batches overflowed: skip 2), update with the mean of the gradients unless a
        batch of it was skipped (skip 1 or 2; then all update_freq batches count as skipped), and start again
        from zero."""
        loss = ops.depend(loss, self.hyper_map(ops.assign_add, self.amp_accum, grads))
        loss = ops.depend(loss, ops.assign(self.amp_accum_skip, ops.maximum(self.amp_accum_skip, skip)))
        loss = ops.depend(loss, ops.assign_add(self.amp_micro_steps, Tensor(1, mstype.int32)))
        if self.amp_micro_steps % self.update_freq == 0:
            if self.skip_on_overflow:  # a Python constant
                loss = ops.depend(loss, self.process_loss_scale(self.amp_accum_skip == 2))
            if self.amp_accum_skip == 0:
                mean = self.hyper_map(ops.partial(_scaled, 1.0 / self.update_freq), self.amp_accum)
                loss = ops.depend(loss, self.optimizer(self.grad_reducer(mean)))  # across ranks: once an update
            else:
                loss = ops.depend(loss, ops.assign_add(self.amp_skipped_steps, Tensor(self.update_freq, mstype.int32)))
            loss = ops.depend(loss, self.hyper_map(_zero, self.amp_accum))
            loss = ops.depend(loss, ops.assign(self.amp_accum_skip, Tensor(0, mstype.int32)))
        return loss

    def clear_status(self) -> bool:
        """In saturation mode: whether the NPU float status was set between steps (by an fp16 evaluation that
        saturated, say), then cleared, so that the next step counts only its own overflow; False elsewhere. The
        step reads the status after its backward, so without this a saturated evaluation counts as the next
        step's overflow: a skipped step and a halved scale, or with a fixed scale a non-finite update that stops
        the run."""
        if not self.saturation_mode:
            return False
        if "npu_status" not in self.__dict__:  # kept out of the Cell tree: a graph of its own, run from the host
            self.__dict__["npu_status"] = NpuStatusReset()
        return bool(self.__dict__["npu_status"]().asnumpy().any())

    def weights_finite(self) -> bool:
        if "finite_check" not in self.__dict__:  # kept out of the Cell tree: it holds the same Parameters
            self.__dict__["finite_check"] = FiniteCheck(self.weights)
        return bool(self.__dict__["finite_check"]().asnumpy())

    def telemetry(self) -> dict:
        """Host-side snapshot of the in-graph counters and the current scale. Without skipping, it first checks
        the weights: non-finite weights mean a non-finite update was applied since the last check."""
        out = {name: int(getattr(self, name).asnumpy()) for name in TELEMETRY}
        if not self.skip_on_overflow and not out["amp_nonfinite_updates"] and not self.weights_finite():
            self.amp_nonfinite_updates.set_data(Tensor(1, mstype.int32))
            out["amp_nonfinite_updates"] = 1
        out["loss_scale"] = float(self.scale_sense.asnumpy().reshape(()))
        return out


class NpuStatusReset(nn.Cell):
    """The NPU float status read, then cleared: MindSpore's own pair of ops (NPUGetFloatStatusV2 and
    NPUClearFloatStatusV2, as its loss-scale cell runs them), in a graph of their own between steps."""

    def __init__(self):
        super().__init__()
        self.read, self.clear = ms_loss_scale.NPUGetFloatStatusV2(), ms_loss_scale.NPUClearFloatStatusV2()

    def construct(self):
        status = Tensor([0] * 8, mstype.int32)
        got = self.read(status)
        cleared = self.clear(ops.depend(status, got))
        return ops.depend(got, cleared)


def saturation_mode(device: str, ascend_910a: bool, ascend_910b: bool) -> bool:
    """Whether the device computes overflows as saturated values (MindSpore's TrainOneStepWithLossScaleCell
    decides the same way): the 910A always, a 910B only when MS_ASCEND_CHECK_OVERFLOW_MODE says so."""
    if device != "Ascend":
        return False
    return bool(ascend_910a) or (bool(ascend_910b) and
                                 os.environ.get("MS_ASCEND_CHECK_OVERFLOW_MODE") == "SATURATION_MODE")


def fused_unscale_op(device: str, distributed: bool, net: nn.Cell):
    """The CPU kernels' unscale-and-sum op where the step can use it (the CPU, one process, a network that runs the
    kernels: cpu_kernels.accelerate), else None. With several ranks the gradients are all-reduced between the
    unscale and the check, so the two stay apart there."""
    if device != "CPU" or distributed:
        return None
    from cpu_kernels.accelerate import runs_kernels
    if not runs_kernels(net):
        return None
    from cpu_kernels.cells import unscale_sum_op
    return unscale_sum_op()


def fused_check_op():
    """The CPU kernels' overflow check that only reads the gradients (UnscaledSum), for a step whose optimizer
    unscales as it updates (AmpTrainStep.unscale_in_update; fused_unscale_op says where the kernels run)."""
    from cpu_kernels.cells import unscaled_sum_op
    return unscaled_sum_op()


def _scaled(factor, x):
    return x * ops.cast(factor, x.dtype)


def _zero(x):
    return ops.assign(x, ops.zeros_like(x))


def finite_sum(tensors) -> Tensor:
    """True when every element of every tensor is finite: one sum per tensor, in fp32 (an inf or NaN anywhere
    makes the sum inf or NaN; finite fp16-range values cannot add up to fp32's 3.4e38). Integer tensors (labels,
    token ids) cannot hold inf/NaN and are left out. Fewer kernels than `mindspore.amp.all_finite`, which runs
    three per tensor."""
    sums = [ops.cast(t, mstype.float32).sum() for t in tensors if ops.is_floating_point(t)]
    if not sums:
        return Tensor(True)
    return ops.isfinite(ops.addn(sums))


class FiniteCheck(nn.Cell):
    """A graph of its own, run every log_every steps, not every step."""

    def __init__(self, tensors):
        super().__init__(auto_prefix=False)
        self.tensors = tensors

    def construct(self):
        return finite_sum(self.tensors)
