"""LeNet-5 (LeCun et al. 1998) for 32x32 single-channel images, as in MindSpore's model zoo."""
import mindspore.nn as nn
from mindspore.common.initializer import Normal

from ampzoo.errors import ConfigError
from ampzoo.registry import MODELS
from ampzoo.models.layers import conv2d, max_pool2d


class LeNet5(nn.Cell):
    first_conv = "conv1"  # the layer that reads the image (as timm's model configs name it)

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.conv1 = conv2d(in_channels, 6, 5)
        self.conv2 = conv2d(6, 16, 5)
        self.fc1 = nn.Dense(16 * 5 * 5, 120, weight_init=Normal(0.02))
        self.fc2 = nn.Dense(120, 84, weight_init=Normal(0.02))
        self.fc3 = nn.Dense(84, num_classes, weight_init=Normal(0.02))
        self.relu = nn.ReLU()
        self.pool = max_pool2d(2, 2)
        self.flatten = nn.Flatten()

    def construct(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def check_lenet5(args: dict, data=None) -> None:
    """LeNet-5's fully connected layers fix its input at 32x32 (16 maps of 5x5 after two conv+pool)."""
    if args["num_classes"] < 1 or args["in_channels"] < 1:
        raise ConfigError(f"model.num_classes={args['num_classes']} and model.params.in_channels="
                          f"{args['in_channels']} must be at least 1")
    if data is not None and data.image_size != 32:
        raise ConfigError(f"dataset.image_size={data.image_size} does not fit model lenet5, which takes 32x32 "
                          f"inputs; set dataset.image_size=32")


@MODELS.register(check=check_lenet5)
def lenet5(num_classes: int = 10, in_channels: int = 1) -> LeNet5:
    check_lenet5({"num_classes": num_classes, "in_channels": in_channels})
    return LeNet5(num_classes=num_classes, in_channels=in_channels)
