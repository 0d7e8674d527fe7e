"""Loading checkpoints with errors that say which file is wrong and how."""
from pathlib import Path

import mindspore as ms
import mindspore.nn as nn

from zoo.config import ConfigError


def read_checkpoint(path) -> dict:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"checkpoint={str(path)!r} does not exist; give a .ckpt file written by train.py "
                          f"(runs/<recipe>/<time>/checkpoints/)")
    try:
        return ms.load_checkpoint(str(path))
    except Exception as e:  # MindSpore raises ValueError or RuntimeError on a corrupt file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"checkpoint={str(path)!r} is not a readable MindSpore checkpoint "
                          f"(truncated or corrupt?): {reason}") from None


def load_weights(net: nn.Cell, path, model_name: str, params: dict = None) -> dict:
    """Load the network's parameters (from `path`, or `params` already read); each must be there, same shape."""
    params = read_checkpoint(path) if params is None else params
    missing = [name for name, _ in net.parameters_and_names() if name not in params]
    if missing:
        raise ConfigError(f"checkpoint={str(path)!r} does not fit model {model_name!r}: {len(missing)} of its "
                          f"parameters are missing (e.g. {', '.join(missing[:3])}); was it written by another "
                          f"model or recipe?")
    for name, p in net.parameters_and_names():
        if tuple(params[name].shape) != tuple(p.shape):
            raise ConfigError(f"checkpoint={str(path)!r} does not fit model {model_name!r}: {name} has shape "
                              f"{tuple(params[name].shape)} in the file, {tuple(p.shape)} in the model "
                              f"(another num_classes or width?)")
    ms.load_param_into_net(net, {n: params[n] for n, _ in net.parameters_and_names()}, strict_load=True)
    return params


AMP_STATE = ("scale_sense", "current_iterator_step", "last_overflow_iterator_step")


def restore_weights(step_cell: nn.Cell, path, with_amp_state: bool = False) -> int:
    """Load weights and optimizer state into a train step; returns the checkpoint's epoch.

    Without `with_amp_state`, the loss-scale state and AMP counters are left as the new step set them
    (a lower fallback rung starts its own scale)."""
    params = read_checkpoint(path)
    if not with_amp_state:
        params = {k: v for k, v in params.items() if k not in AMP_STATE and not k.startswith("amp_")}
    ms.load_param_into_net(step_cell, params)
    return int(params["epoch_num"].asnumpy()) if "epoch_num" in params else 0


def average_checkpoints(paths) -> dict:
    """Element-wise mean of the float parameters of several checkpoints (Vaswani et al. average the last 5
    or 20); integer state (steps, counters) comes from the newest."""
    import numpy as np

    params = [read_checkpoint(p) for p in paths]
    out = dict(params[-1])
    for name, value in params[-1].items():
        if value.dtype in (ms.float32, ms.float16):
            if any(name not in p or p[name].shape != value.shape for p in params):
                raise ConfigError(f"cannot average {name}: it is missing or differs in shape among {paths}")
            mean = np.mean([p[name].asnumpy().astype(np.float64) for p in params], axis=0)
            out[name] = ms.Parameter(ms.Tensor(mean.astype(value.asnumpy().dtype)), name=name)
    return out


def last_checkpoints(path, n: int):
    """The checkpoint `path` and the n-1 written before it in its folder (by modification time)."""
    from pathlib import Path
    path = Path(path).expanduser()
    siblings = sorted(path.parent.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if path not in siblings:
        read_checkpoint(path)  # names the missing file
    upto = siblings[: siblings.index(path) + 1]
    if len(upto) < n:
        raise ConfigError(f"decode.average_last={n} but {path.parent} holds only {len(upto)} checkpoints up to "
                          f"{path.name}")
    return upto[-n:]
