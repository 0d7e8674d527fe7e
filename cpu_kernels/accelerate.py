"""accelerate(net): the CPU kernels applied to a finished network, as Intel's ipex.optimize(model) is to a PyTorch one.

The model is written once, in plain MindSpore Cells. accelerate

1. swaps each Cell it has a kernel Cell for (a table by exact class: mindspore.nn's own below, a model's own units
   given as `units`) for that kernel Cell, built around the same Parameter objects under the same names, so the
   optimizer sees one set and a checkpoint of either network loads into the other;
2. computes no input gradient in the convolution at `first_conv` (the path of the layer that reads the data, as
   timm's `first_conv`): its input takes none;
3. makes every SequentialCell whose layers all take the blocked layout (kernel Cells with `layout`, and the
   classes named in `stages`, whose construct is element-wise between their Cells) a BlockedSequentialCell: one
   reorder on the way in, one on the way out, plain NCHW everywhere else.

It needs the built library (cpu_kernels.has_ops()) and runs where MindSpore's device is the CPU; nothing here
knows a model of the zoo.
"""
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Optional, Tuple, Type

import mindspore.nn as nn

from cpu_kernels import Settings, configure
from cpu_kernels.cells import (BlockedSequentialCell, CpuBatchNorm2d, CpuConv2d, CpuDense, CpuDropout, CpuLayerNorm,
                               CpuReLU, CpuSoftmax, KernelCell, block, block_for, max_pool_from_cell)

# mindspore.nn's Cells and the kernel Cell each becomes (a function of the Cell: the kernel Cell, or None where its
# configuration is one the kernels do not run). Exact classes: a subclass may compute something else.
MINDSPORE_CELLS: Dict[Type[nn.Cell], Callable[[nn.Cell], Optional[nn.Cell]]] = {
    nn.Conv2d: CpuConv2d.from_cell, nn.BatchNorm2d: CpuBatchNorm2d.from_cell, nn.MaxPool2d: max_pool_from_cell,
    nn.ReLU: CpuReLU.from_cell, nn.Dropout: CpuDropout.from_cell, nn.Dense: CpuDense.from_cell,
    nn.LayerNorm: CpuLayerNorm.from_cell, nn.Softmax: CpuSoftmax.from_cell,
}


def accelerate(net: nn.Cell, settings: Optional[Settings] = None,
               units: Optional[Dict[type, Callable[[nn.Cell], Optional[nn.Cell]]]] = None,
               stages: Iterable[type] = (), first_conv: Optional[str] = None) -> nn.Cell:
    """`net` with its Cells swapped for the kernels' (see the module's docstring), in place; returns it.
    settings: passed to configure() first (None: the settings in force). units: a model's own Cell classes ->
    the function building each one's kernel Cell. stages: a model's Cell classes that may run inside a blocked
    stage. first_conv: the path of the convolution that reads the network's input (default: net.first_conv)."""
    if settings is not None:
        configure(**vars(settings))
    table = {**MINDSPORE_CELLS, **(units or {})}
    first_conv = first_conv if first_conv is not None else getattr(net, "first_conv", None)
    names = {id(p): p.name for p in net.get_parameters()}
    _swap(net, "", table, first_conv, set())
    _block_stages(net, tuple(stages))
    for p in net.get_parameters():  # the names the plain network gave them (a swap re-prefixes its Cell's)
        p.name = names[id(p)]
    return net


def runs_kernels(net: nn.Cell) -> bool:
    """Whether `net` holds a Cell of these kernels (accelerate swapped some in)."""
    return any(isinstance(cell, KernelCell) for _, cell in net.cells_and_names())


def _swap(parent: nn.Cell, prefix: str, table: dict, first_conv: Optional[str], seen: set) -> None:
    """Swap every Cell below `parent` (paths from `prefix`) that `table` has a kernel Cell for, parents before
    their children (a kernel Cell's own Cells too); a Cell held twice is swapped once."""
    for name, cell in list(parent.name_cells().items()):
        if cell is None or id(cell) in seen:
            continue
        seen.add(id(cell))
        path = f"{prefix}.{name}" if prefix else name
        make = table.get(type(cell))
        if make is not None:
            new = CpuConv2d.from_cell(cell, input_grad=False) if path == first_conv and type(cell) is nn.Conv2d \
                else make(cell)
            if new is not None:
                new.set_train(cell.training)
                _put(parent, name, new)
                cell = new
                seen.add(id(cell))
        _swap(cell, path, table, first_conv, seen)


def _put(parent: nn.Cell, name: str, new: nn.Cell) -> None:
    parent.insert_child_to_cell(name, new)
    if isinstance(parent, nn.SequentialCell):
        parent.cell_list = list(parent._cells.values())  # what its construct runs
    elif isinstance(parent, nn.CellList):
        pass  # CellList iterates _cells


def _takes_blocks(cell: nn.Cell, stages: Tuple[type, ...]) -> bool:
    """Whether `cell` may run inside a blocked stage: a kernel Cell with a layout, or a SequentialCell or a class in
    `stages` all of whose Cells may."""
    if isinstance(cell, KernelCell):
        return cell.layout is not None
    if type(cell) in (nn.SequentialCell, BlockedSequentialCell) or isinstance(cell, stages):
        children = [c for c in cell.name_cells().values() if c is not None]
        return bool(children) and all(_takes_blocks(c, stages) for c in children)
    return False


def _block_stages(net: nn.Cell, stages: Tuple[type, ...]) -> None:
    """Every outermost SequentialCell that may run blocked becomes a BlockedSequentialCell, and the kernel Cells
    inside are told their block."""
    for name, child in list(net.name_cells().items()):
        if child is None:
            continue
        if type(child) is nn.SequentialCell and _takes_blocks(child, stages):
            for _, cell in child.cells_and_names():
                if isinstance(cell, (CpuConv2d, CpuBatchNorm2d)):
                    cell.set_block(block_for(cell.out_channels if isinstance(cell, CpuConv2d)
                                             else cell.num_features))
            blocked = BlockedSequentialCell(OrderedDict(child.name_cells()), block())
            blocked.set_train(child.training)
            _put(net, name, blocked)
        else:
            _block_stages(child, stages)
