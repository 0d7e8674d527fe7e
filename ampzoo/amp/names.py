"""Cell names a recipe may put in `amp.keep_fp32` / `amp.force_fp16`, resolved through an explicit registry.

The names are every Cell class of `mindspore.nn`, the project's own Cells (`@CELLS.register()` from
ampzoo/registry.py), and a few group names (`BatchNorm` means BatchNorm1d/2d/3d). MindSpore's precision lists
take Cells, not Primitives: a Primitive name is rejected with the Cell to use instead.
`amp.keep_fp32` also takes sub-module paths of the network (`fc3`, `decoder.layers.3.ffn`): a name that does
not start with a capital letter is a path, checked against the built network by ampzoo.amp.policy.apply_policy.
"""
import difflib
from typing import Dict, List, Tuple, Type

import mindspore.nn as nn
import mindspore.ops as ops
from mindspore.ops.primitive import Primitive

from ampzoo.errors import ConfigError
from ampzoo.registry import CELLS

NN_CELLS: Dict[str, Type[nn.Cell]] = {
    name: cls for name, cls in vars(nn).items() if isinstance(cls, type) and issubclass(cls, nn.Cell)
}
GROUPS: Dict[str, Tuple[str, ...]] = {
    "BatchNorm": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
    "Conv": ("Conv1d", "Conv2d", "Conv3d", "Conv1dTranspose", "Conv2dTranspose", "Conv3dTranspose"),
}
# Primitive name -> the Cell that owns it; the keep-list must name the Cell.
PRIMITIVE_TO_CELL = {
    "Conv2D": "Conv2d", "Conv3D": "Conv3d", "Conv2DTranspose": "Conv2dTranspose", "MatMul": "Dense",
    "BatchNorm": "BatchNorm2d", "BiasAdd": "Dense", "MaxPool": "MaxPool2d", "AvgPool": "AvgPool2d",
    "BatchMatMul": "BatchMatMul (ampzoo/models/transformer.py)", "Gather": "Embedding",
}


def _loaded_class(name: str):
    """The Cell class of that name among those loaded in this process (mindspore.nn's, the zoo's, the CPU kernels',
    a plugin's), or None."""
    stack = [nn.Cell]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub.__name__ == name:
                return sub
            stack.append(sub)
    return None


def _nameable(cls) -> bool:
    return NN_CELLS.get(cls.__name__) is cls or (cls.__name__ in CELLS and CELLS.get(cls.__name__) is cls)


def portable(cls) -> str:
    """The name a keep-list should use for a Cell of this class (a class, or a class name): the first class of its
    MRO a keep-list can name (CpuConv2d -> Conv2d, the Transformer's Dense -> Dense), else its first Cell class
    below nn.Cell (a kernel Cell of a zoo unit -> the unit), else itself. A device build of a layer (the CPU
    kernels' Cells) subclasses the Cell it stands for: that is the whole interface, no list here."""
    if isinstance(cls, str):
        if cell_class(cls) is not None:  # a name a keep-list takes (mint.nn has a Conv2d too: not that one)
            return cls
        found = _loaded_class(cls)
        if found is None:
            return cls
        cls = found
    mro = [c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, nn.Cell) and c is not nn.Cell]
    named = [c for c in mro if _nameable(c)]
    return (named or mro[-1:] or [cls])[0].__name__


PRIMITIVES = {name for name, cls in vars(ops).items() if isinstance(cls, type) and issubclass(cls, Primitive)}


def _device_build(name: str) -> bool:
    """Whether `name` is a loaded Cell class that stands for another a keep-list can name (the CPU kernels')."""
    try:
        import cpu_kernels.cells  # noqa: F401  (loads their classes; the extension need not be built)
    except ImportError:
        pass
    return _loaded_class(name) is not None and portable(name) != name and cell_class(portable(name)) is not None


def cell_class(name: str):
    """A nameable Cell class: a project Cell first, then mindspore.nn's; None if neither."""
    return CELLS.get(name) if name in CELLS else NN_CELLS.get(name)


def resolve(names: List[str], key: str) -> Tuple[Type[nn.Cell], ...]:
    classes = []
    for name in names:
        if name in GROUPS:
            classes.extend(NN_CELLS[n] for n in GROUPS[name])
        elif cell_class(name) is not None:
            classes.append(cell_class(name))
        elif _device_build(name):
            base, where = portable(name), _loaded_class(name).__module__.split(".")[0]
            raise ConfigError(f"{key}: {name!r} is the CPU build of {base} ({where}); name {base}, which matches it "
                              f"and {base} on every device")
        elif name in PRIMITIVES or name in PRIMITIVE_TO_CELL:
            cell = PRIMITIVE_TO_CELL.get(name, "the Cell that calls it")
            raise ConfigError(f"{key}: {name!r} is a Primitive; MindSpore's precision lists take Cell classes, "
                              f"use {cell}")
        else:
            close = difflib.get_close_matches(name, list(NN_CELLS) + CELLS.names() + list(GROUPS), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(f"{key}: {name!r} is not a known Cell; {hint}valid: a mindspore.nn Cell class "
                              f"(LayerNorm, Softmax, BatchNorm2d, Dense, ...), a project Cell "
                              f"({', '.join(CELLS.names() or ['none yet'])}) "
                              f"or a group ({', '.join(GROUPS)})" + ("; a sub-module path goes in amp.keep_fp32"
                                                                     if is_path(name) else ""))
    return tuple(dict.fromkeys(classes))


def is_path(name: str) -> bool:
    """Class names are capitalised (mindspore.nn's, ours); sub-module paths are not (`fc3`, `layers.0.norm`)."""
    return not name[:1].isupper()


def split_keep(names: List[str]) -> Tuple[List[str], List[str]]:
    """A keep-list as (Cell class names, sub-module paths)."""
    return [n for n in names if not is_path(n)], [n for n in names if is_path(n)]


def check_policy_names(amp_cfg) -> None:
    keep = resolve(split_keep(list(amp_cfg.keep_fp32 or []))[0], "amp.keep_fp32")
    force = resolve(list(amp_cfg.force_fp16), "amp.force_fp16")
    both = sorted({c.__name__ for c in keep} & {c.__name__ for c in force})
    if both:
        raise ConfigError(f"{', '.join(both)} is in both amp.keep_fp32 and amp.force_fp16; keep it in one")
