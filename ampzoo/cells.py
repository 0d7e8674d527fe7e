"""Swapping a sub-Cell in place: the precision policy wraps Cells, Conv+BN folding replaces them."""
import mindspore.nn as nn


def replace_child(parent: nn.Cell, name: str, new: nn.Cell) -> None:
    """parent.<name> becomes `new` (a SequentialCell's list of Cells too, which its construct iterates)."""
    parent._cells[name] = new  # pylint: disable=protected-access
    if isinstance(parent, nn.SequentialCell):
        parent.cell_list = list(parent.cells())
