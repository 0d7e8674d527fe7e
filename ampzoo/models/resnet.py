"""The ResNet family (He et al. 2016): BasicBlock and Bottleneck, resnet18/34/50.

ImageNet stem (7x7/2 conv and 3x3/2 max-pool) by default; `stem="cifar"` uses a 3x3/1 conv and no
max-pool for 32x32 inputs. He (fan-out) initialisation as in torchvision; `zero_init_residual` starts each
block's last BatchNorm at zero, so every residual block begins as the identity (Goyal et al. 2017).
`first_conv` names the layer that reads the image, as timm's model configs do.
"""
import math

import mindspore.nn as nn
import mindspore.ops as ops
from mindspore.common.initializer import HeNormal, HeUniform, Uniform

from ampzoo.errors import ConfigError
from ampzoo.registry import MODELS
from ampzoo.models.layers import AddReLU, conv2d, max_pool2d


def conv(in_ch, out_ch, k, stride=1):
    return conv2d(in_ch, out_ch, k, stride, k // 2, weight_init=HeNormal(mode="fan_out", nonlinearity="relu"))


def bn(ch, zero=False):
    return nn.BatchNorm2d(ch, eps=1e-5, momentum=0.9, gamma_init="zeros" if zero else "ones")


class Residual(nn.Cell):
    """A residual block: its input goes to its body and to its shortcut."""

    def split(self, x):
        """(the body's input, the shortcut's): the one place the block reads x twice, so that a build of the block
        for another device may sum the two gradients its own way (as the Transformer's Sublayer.split)."""
        return x, x


class BasicBlock(Residual):
    expansion = 1

    def __init__(self, in_ch, ch, stride=1, zero_init_residual=False):
        super().__init__()
        self.conv1, self.bn1 = conv(in_ch, ch, 3, stride), bn(ch)
        self.conv2, self.bn2 = conv(ch, ch, 3), bn(ch, zero_init_residual)
        self.relu, self.add_relu = nn.ReLU(), AddReLU()
        self.down = None
        if stride != 1 or in_ch != ch:
            self.down = nn.SequentialCell([conv(in_ch, ch, 1, stride), bn(ch)])

    def construct(self, x):
        x, shortcut = self.split(x)
        identity = shortcut if self.down is None else self.down(shortcut)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.add_relu(out, identity)  # relu(out + identity)


class Bottleneck(Residual):
    expansion = 4

    def __init__(self, in_ch, ch, stride=1, zero_init_residual=False):
        super().__init__()
        out_ch = ch * self.expansion
        self.conv1, self.bn1 = conv(in_ch, ch, 1), bn(ch)
        self.conv2, self.bn2 = conv(ch, ch, 3, stride), bn(ch)
        self.conv3, self.bn3 = conv(ch, out_ch, 1), bn(out_ch, zero_init_residual)
        self.relu, self.add_relu = nn.ReLU(), AddReLU()
        self.down = None
        if stride != 1 or in_ch != out_ch:
            self.down = nn.SequentialCell([conv(in_ch, out_ch, 1, stride), bn(out_ch)])

    def construct(self, x):
        x, shortcut = self.split(x)
        identity = shortcut if self.down is None else self.down(shortcut)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.add_relu(out, identity)  # relu(out + identity)


def check_resnet(args: dict, data=None) -> None:
    if args["stem"] not in ("imagenet", "cifar"):
        raise ConfigError(f"model.params.stem={args['stem']!r} is not valid; valid: imagenet, cifar")
    for key in ("width", "num_classes", "in_channels"):
        if args[key] < 1:
            raise ConfigError(f"{'model.' if key == 'num_classes' else 'model.params.'}{key}={args[key]} must be at "
                              f"least 1")


class ResNet(nn.Cell):
    first_conv = "stem.0"

    def __init__(self, block, layers, num_classes=1000, in_channels=3, stem="imagenet", width=64,
                 zero_init_residual=False):
        super().__init__()
        check_resnet({"stem": stem, "width": width, "num_classes": num_classes, "in_channels": in_channels})
        chans = [width, width * 2, width * 4, width * 8]
        if stem == "imagenet":
            self.stem = nn.SequentialCell([conv(in_channels, width, 7, 2), bn(width), nn.ReLU(),
                                           max_pool2d(3, 2, padding=1)])
        else:
            self.stem = nn.SequentialCell([conv(in_channels, width, 3), bn(width), nn.ReLU()])
        in_ch, stages = width, []
        for i, (ch, n) in enumerate(zip(chans, layers)):
            blocks = []
            for j in range(n):
                blocks.append(block(in_ch, ch, 2 if (j == 0 and i > 0) else 1, zero_init_residual))
                in_ch = ch * block.expansion
            stages.append(nn.SequentialCell(blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.flatten = nn.Flatten()
        bound = 1 / math.sqrt(in_ch)
        self.fc = nn.Dense(in_ch, num_classes, weight_init=HeUniform(math.sqrt(5)), bias_init=Uniform(bound))

    def construct(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.flatten(ops.mean(x, (2, 3), keep_dims=True))
        return self.fc(x)


@MODELS.register(check=check_resnet)
def resnet18(num_classes=1000, in_channels=3, stem="imagenet", width=64, zero_init_residual=False):
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels, stem, width, zero_init_residual)


@MODELS.register(check=check_resnet)
def resnet34(num_classes=1000, in_channels=3, stem="imagenet", width=64, zero_init_residual=False):
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, in_channels, stem, width, zero_init_residual)


@MODELS.register(check=check_resnet)
def resnet50(num_classes=1000, in_channels=3, stem="imagenet", width=64, zero_init_residual=False):
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_channels, stem, width, zero_init_residual)

