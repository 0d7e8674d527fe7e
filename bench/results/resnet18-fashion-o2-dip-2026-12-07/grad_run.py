"""The gradients of resnet18_fashion_o2's network on the first two training batches of seed 1, under one precision
and one set of kernels, against each other (gradients.txt).

    python grad_run.py LEVEL KERNELS COMPUTE [CHECKPOINT]   # O0|O2  auto|off  fp32|bf16; from the checkout
    python grad_run.py --compare TAG NAME NAME ...          # TAG: init or ckpt; NAME: LEVEL_KERNELS_COMPUTE

Each variant runs in its own process (a network with MindSpore's convolutions caps oneDNN at AVX2 for the
process, which would turn the kernels' bf16 products into fp32 ones). The network starts from the seed's initial
weights, or CHECKPOINT's; the loss is scaled by 65536 (O2's initial dynamic scale) and the gradients unscaled in
float64. BatchNorm runs in training mode, as in a step."""
import itertools
import pickle
import sys

import numpy as np

S = 65536.0
OUT = "/tmp/grads_{}_{}.pkl"


def gradients(level: str, kernels: str, compute: str, checkpoint=None):
    import mindspore as ms
    from omegaconf import OmegaConf

    from ampzoo.amp.policy import apply_policy
    from ampzoo.data import create_dataset
    from ampzoo.engine.load import load_config
    from ampzoo.engine.metrics import NetWithLoss, create_loss
    from ampzoo.engine.network import build_model, set_cpu_compute
    from ampzoo.runtime import set_context

    cfg, _ = load_config(["recipe=resnet18_fashion_o2", "runtime.cpu_threads=1", f"runtime.cpu_kernels={kernels}",
                          f"runtime.cpu_compute={compute}"])
    set_context(cfg.runtime)
    ms.set_seed(1)
    batches = list(itertools.islice(create_dataset(cfg.dataset, "train", seed=1).create_tuple_iterator(), 2))
    set_cpu_compute(compute, training=True)
    net = build_model(cfg)
    if checkpoint:
        ms.load_checkpoint(checkpoint, net)
    net, _ = apply_policy(net, OmegaConf.merge(cfg.amp, {"level": level}))
    net.set_train(True)
    loss_net = NetWithLoss(net, create_loss(cfg.trainer))
    weights = ms.ParameterTuple(net.trainable_params())

    class Step(ms.nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.grad = ms.ops.GradOperation(get_by_list=True)

        def construct(self, x, y):
            return loss_net(x, y) * S, self.grad(lambda a, b: loss_net(a, b) * S, weights)(x, y)

    step = Step()
    out = []
    for x, y in batches:
        loss, grads = step(x, y)
        out.append((float(loss.asnumpy()) / S,
                    {w.name: g.asnumpy().astype(np.float64) / S for w, g in zip(weights, grads)}))
    return out


def compare(tag: str, names) -> None:
    res = {n: pickle.load(open(OUT.format(n, tag), "rb")) for n in names}
    for a, b in itertools.combinations(names, 2):
        print("==", a, "vs", b)
        for i, ((la, ga), (lb, gb)) in enumerate(zip(res[a], res[b])):
            errs = sorted(((np.linalg.norm(ga[k] - gb[k]) / max(np.linalg.norm(gb[k]), 1e-30), k) for k in ga),
                          reverse=True)
            total = (np.sqrt(sum(np.sum((ga[k] - gb[k]) ** 2) for k in ga))
                     / np.sqrt(sum(np.sum(gb[k] ** 2) for k in ga)))
            print(f" batch {i}: loss {la:.6f} vs {lb:.6f}; total {total:.2e}; median "
                  f"{np.median([e for e, _ in errs]):.2e}; top: " + ", ".join(f"{k} {e:.2e}" for e, k in errs[:3]))


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3:])
    else:
        level, kernels, compute = sys.argv[1:4]
        ckpt = sys.argv[4] if len(sys.argv) > 4 else None
        with open(OUT.format(f"{level}_{kernels}_{compute}", "ckpt" if ckpt else "init"), "wb") as f:
            pickle.dump(gradients(level, kernels, compute, ckpt), f)
