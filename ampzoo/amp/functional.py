"""A jit-compiled AMP step for hand-written loops (PyNative debugging, custom steps).

    step = FunctionalAmpStep(net, loss_fn, optimizer, cfg.amp.loss_scale)   # net: after ampzoo.amp.policy
    loss, overflow, scale = step(images, labels)
    step.telemetry()   # same counters as AmpTrainStep

Built from `value_and_grad`, MindSpore's `DynamicLossScaler`/`StaticLossScaler` and `all_finite`; the same
`amp.loss_scale` config as train.py. Overflowed steps are skipped whenever a scale is in use.

Data parallel (msrun, after `init()` and `set_auto_parallel_context(parallel_mode=DATA_PARALLEL)`): the
gradients are all-reduced (MindSpore's DistributedGradReducer, as TrainOneStepCell does) before the finite check,
and the finite flag is all-reduced too, since on an Ascend in saturation mode all_finite reads each rank's own
status register: every rank skips the same steps and moves its scale alike.
"""
import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
from mindspore import Parameter, Tensor
from mindspore import dtype as mstype
from mindspore.amp import DynamicLossScaler, StaticLossScaler, all_finite
from mindspore.context import ParallelMode
from mindspore.parallel._utils import _get_device_num, _get_gradients_mean, _get_parallel_mode

from ampzoo.amp.loss_scale import TELEMETRY


class FunctionalAmpStep:
    def __init__(self, net: nn.Cell, loss_fn: nn.Cell, optimizer: nn.Optimizer, ls_cfg):
        kind = str(ls_cfg.type)
        self.kind = kind
        if kind == "dynamic":
            self.scaler = DynamicLossScaler(ls_cfg.init_scale, ls_cfg.factor, ls_cfg.window)
        else:
            self.scaler = StaticLossScaler(ls_cfg.scale if kind == "fixed" else 1.0)
        self.skip = kind != "none"
        self.net, self.loss_fn, self.optimizer = net, loss_fn, optimizer
        for name in TELEMETRY:
            setattr(self, name, Parameter(Tensor(0, mstype.int32), name=f"functional_{name}", requires_grad=False))

        def forward(x, y):
            loss = self.loss_fn(self.net(x), y)
            return self.scaler.scale(loss), loss

        grad_fn = ms.value_and_grad(forward, None, optimizer.parameters, has_aux=True)
        skip, dynamic = self.skip, kind == "dynamic"  # Python constants, folded at compile time
        parallel = _get_parallel_mode() in (ParallelMode.DATA_PARALLEL, ParallelMode.HYBRID_PARALLEL)
        reducer = nn.DistributedGradReducer(optimizer.parameters, _get_gradients_mean(), _get_device_num()) \
            if parallel else None
        all_reduce = ops.AllReduce() if parallel else None

        @ms.jit
        def step(x, y):
            (_, loss), grads = grad_fn(x, y)
            grads = self.scaler.unscale(grads)
            if parallel:
                grads = reducer(grads)
            finite = all_finite(grads)
            if parallel:  # a status register is each rank's own (saturation mode): every rank must agree
                finite = all_reduce(ops.cast(ops.logical_not(finite), mstype.float32)) < 0.5
            scale = self.scaler.scale_value * 1.0
            if dynamic:
                self.scaler.adjust(finite)
            if skip:
                if finite:
                    loss = ops.depend(loss, self.optimizer(grads))
            else:
                loss = ops.depend(loss, self.optimizer(grads))
            overflow = ops.logical_not(finite)
            ov = ops.cast(overflow, mstype.int32)
            ops.assign_add(self.amp_steps, Tensor(1, mstype.int32))
            ops.assign_add(self.amp_overflow_steps, ov)
            ops.assign_add(self.amp_skipped_steps, ov if skip else ov * 0)
            ops.assign(self.amp_steps_since_overflow, (self.amp_steps_since_overflow + 1) * (1 - ov))
            ops.assign_add(self.amp_nonfinite_losses, ops.cast(ops.logical_not(ops.isfinite(loss)), mstype.int32))
            return loss, overflow, scale

        self._step = step

    def __call__(self, x, y):
        return self._step(x, y)

    def telemetry(self) -> dict:
        out = {name: int(getattr(self, name).asnumpy()) for name in TELEMETRY}
        out["loss_scale"] = float(self.scaler.scale_value.asnumpy())
        return out
