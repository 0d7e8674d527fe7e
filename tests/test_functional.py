"""The functional AMP path trains LeNet-5 at O2 with a dynamic loss scale, in a hand-written loop."""
import numpy as np

import mindspore as ms
import mindspore.nn as nn

from ampzoo.amp.functional import FunctionalAmpStep
from ampzoo.amp.policy import apply_policy
from ampzoo.compose import compose
from ampzoo.data import create_dataset
from ampzoo.models import create_model


def test_functional_step_trains_lenet_with_dynamic_scale(graph_mode):
    cfg = compose(["recipe=lenet_o2", "amp.loss_scale.type=dynamic", "amp.loss_scale.window=40"])
    ms.set_seed(0)
    net, _ = apply_policy(create_model("lenet5", num_classes=10), cfg.amp)
    optimizer = nn.Adam(net.trainable_params(), learning_rate=2e-3)
    step = FunctionalAmpStep(net, nn.CrossEntropyLoss(), optimizer, cfg.amp.loss_scale)
    net.set_train()
    losses = []
    for epoch in range(2):
        for images, labels in create_dataset(cfg.dataset, "train").create_tuple_iterator():
            loss, overflow, scale = step(images, labels)
            losses.append(float(loss.asnumpy()))
    t = step.telemetry()
    assert t["amp_steps"] == 250 and t["loss_scale"] != 65536.0, "the dynamic scale moved"
    assert t["amp_overflow_steps"] == t["amp_skipped_steps"]
    assert np.mean(losses[-25:]) < 0.5 < np.mean(losses[:25])
    net.set_train(False)
    correct = total = 0
    for images, labels in create_dataset(cfg.dataset, "test").create_tuple_iterator():
        pred = net(images).asnumpy().argmax(1)
        correct += int((pred == labels.asnumpy()).sum())
        total += len(pred)
    assert correct / total > 0.9
