"""Conv+BatchNorm folding for inference and export.

Pairs are found on the network graph with `mindspore.rewrite` (a BatchNorm2d whose only input is a Conv2d
used nowhere else); where rewrite cannot parse a Cell, consecutive Conv2d -> BatchNorm2d inside a
SequentialCell are taken instead. Each pair is folded by weight arithmetic into one Conv2d with a bias,
and the BatchNorm replaced by an Identity, in the network itself (eval mode only: BatchNorm's running
statistics are frozen into the weights).
"""
import logging
from typing import Dict, List, Tuple

import numpy as np

import mindspore as ms
import mindspore.nn as nn

from ampzoo.cells import replace_child

log = logging.getLogger("amp_zoo")


def _parents(net: nn.Cell) -> Dict[int, Tuple[nn.Cell, str]]:
    out = {}
    for _, cell in net.cells_and_names():
        for name, child in cell.name_cells().items():
            out[id(child)] = (cell, name)
    return out


def find_pairs(net: nn.Cell) -> Tuple[List[Tuple[nn.Conv2d, nn.BatchNorm2d]], str]:
    """(conv, bn) pairs and how they were found ("rewrite" or "sequential")."""
    cells = {id(c) for _, c in net.cells_and_names()}
    sequential = []
    for _, cell in net.cells_and_names():
        if isinstance(cell, nn.SequentialCell):
            seq = list(cell.cell_list)
            sequential += [(a, b) for a, b in zip(seq, seq[1:])
                           if isinstance(a, nn.Conv2d) and isinstance(b, nn.BatchNorm2d)]
    try:
        from mindspore.rewrite import NodeType, SymbolTree
        pairs = []
        for node in SymbolTree.create(net).nodes(all_nodes=True):
            # a Cell of the project (CpuBatchNorm2d) is a Tree node: rewrite parses its construct too
            if (node.get_node_type() not in (NodeType.CallCell, NodeType.Tree)
                    or not isinstance(node.get_instance(), nn.BatchNorm2d)):
                continue
            inputs = node.get_inputs()
            if len(inputs) == 1 and isinstance(inputs[0].get_instance(), nn.Conv2d) and len(inputs[0].get_users()) == 1:
                conv, bn = inputs[0].get_instance(), node.get_instance()
                if id(conv) in cells and id(bn) in cells:  # rewrite saw the network's own Cells
                    pairs.append((conv, bn))
        found = {id(bn) for _, bn in pairs}  # rewrite does not look inside SequentialCells: add those
        return pairs + [(c, b) for c, b in sequential if id(b) not in found], "rewrite"
    except Exception as e:  # noqa: BLE001  (rewrite cannot parse every construct; fall back to what is certain)
        log.info("rewrite could not parse %s (%s); folding Conv2d->BatchNorm2d in SequentialCells only",
                 type(net).__name__, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return sequential, "sequential"


def fold(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    w = conv.weight.asnumpy().astype(np.float64)
    b = conv.bias.asnumpy().astype(np.float64) if conv.has_bias else np.zeros(w.shape[0])
    gamma, beta = bn.gamma.asnumpy().astype(np.float64), bn.beta.asnumpy().astype(np.float64)
    mean, var = bn.moving_mean.asnumpy().astype(np.float64), bn.moving_variance.asnumpy().astype(np.float64)
    scale = gamma / np.sqrt(var + bn.eps)
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                      pad_mode=conv.pad_mode, padding=conv.padding, dilation=conv.dilation, group=conv.group,
                      has_bias=True, weight_init=ms.Tensor((w * scale[:, None, None, None]).astype(np.float32)),
                      bias_init=ms.Tensor(((b - mean) * scale + beta).astype(np.float32)))
    fused.weight.name, fused.bias.name = conv.weight.name, conv.weight.name.rsplit(".", 1)[0] + ".bias"
    return fused


def fuse_conv_bn(net: nn.Cell) -> Tuple[nn.Cell, Dict]:
    """Fold every Conv2d+BatchNorm2d pair of `net` in place; returns the network and what was done."""
    net.set_train(False)
    pairs, how = find_pairs(net)
    parents = _parents(net)
    for conv, bn in pairs:
        conv_parent, conv_name = parents[id(conv)]
        bn_parent, bn_name = parents[id(bn)]
        for parent, name, new in ((conv_parent, conv_name, fold(conv, bn)), (bn_parent, bn_name, nn.Identity())):
            replace_child(parent, name, new)
    return net, {"fused_pairs": len(pairs), "found_by": how}
