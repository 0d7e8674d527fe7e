"""LeNet-5 (LeCun et al. 1998) for 32x32 single-channel images, as in MindSpore's model zoo."""
import mindspore.nn as nn
from mindspore.common.initializer import Normal

from ampzoo.errors import ConfigError
from ampzoo.registry import MODELS
from ampzoo.models.layers import Dense, conv2d, max_pool2d, relu


class LeNet5(nn.Cell):
    """Its layers are ampzoo.models.layers': on the CPU its convolutions, ReLUs, pooling and Dense layers run the CPU
    kernels, which take fp16 in and out at O2, so no Cast runs between them."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.conv1 = conv2d(in_channels, 6, 5, input_grad=False)
        self.conv2 = conv2d(6, 16, 5, plain=True)  # plain NCHW: fc1 reads its maps flattened in that order
        self.fc1 = Dense(16 * 5 * 5, 120, weight_init=Normal(0.02))
        self.fc2 = Dense(120, 84, weight_init=Normal(0.02))
        self.fc3 = Dense(84, num_classes, weight_init=Normal(0.02))
        self.relu = relu()
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
