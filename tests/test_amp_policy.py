"""The precision policy gives each Cell the dtype the report claims: checked on real forward passes
(PyNative hooks on the Cells' outputs), not on the report."""
import mindspore as ms
import mindspore.nn as nn
import numpy as np
import pytest
from omegaconf import OmegaConf

from ampzoo.amp.policy import apply_policy
from ampzoo.amp.precision import precision_report

F16, F32 = "Float16", "Float32"


class Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Dense(4 * 8 * 8, 8)
        self.ln = nn.LayerNorm((8,))
        self.head = nn.Dense(8, 3)

    def construct(self, x):
        x = self.relu(self.bn(self.conv(x)))
        return self.head(self.ln(self.fc(self.flat(x))))


def observe(level, keep=None, force=()):
    net = Tiny()
    names = ["conv", "bn", "fc", "ln", "head"]
    seen = {}
    for name in names:
        getattr(net, name).register_forward_hook(lambda c, i, o, n=name: seen.__setitem__(n, str(o.dtype)))
    cfg = OmegaConf.create({"level": level, "dtype": "float16", "keep_fp32": keep, "force_fp16": list(force)})
    wrapped, policy = apply_policy(net, cfg)
    out = wrapped(ms.Tensor(np.random.randn(2, 1, 8, 8).astype(np.float32)))
    return net, wrapped, policy, seen, str(out.dtype)


EXPECTED = {
    ("O0", None, ()): dict(conv=F32, bn=F32, fc=F32, ln=F32, head=F32),
    ("O1", None, ()): dict(conv=F16, bn=F32, fc=F16, ln=F32, head=F16),
    ("O2", None, ()): dict(conv=F16, bn=F32, fc=F16, ln=F32, head=F16),
    ("O3", None, ()): dict(conv=F16, bn=F16, fc=F16, ln=F16, head=F16),
    ("O2", ("LayerNorm", "Dense"), ()): dict(conv=F16, bn=F16, fc=F32, ln=F32, head=F32),
    ("O1", None, ("LayerNorm",)): dict(conv=F16, bn=F32, fc=F16, ln=F16, head=F16),
    ("O1", ("Dense",), ()): dict(conv=F16, bn=F32, fc=F32, ln=F32, head=F32),
    # sub-module paths: that one Cell, not its class (amp.search writes them)
    ("O3", ("head",), ()): dict(conv=F16, bn=F16, fc=F16, ln=F16, head=F32),
    ("O3", ("LayerNorm", "conv"), ()): dict(conv=F32, bn=F16, fc=F16, ln=F32, head=F16),
    ("O1", ("fc",), ()): dict(conv=F16, bn=F32, fc=F32, ln=F32, head=F16),
}


@pytest.mark.parametrize("level,keep,force", list(EXPECTED), ids=[f"{a}-{b}-{c}" for a, b, c in EXPECTED])
def test_cells_compute_in_the_policy_dtype(pynative_mode, level, keep, force):
    net, wrapped, policy, seen, out_dtype = observe(level, list(keep) if keep else None, force)
    assert seen == EXPECTED[(level, keep, force)]
    assert out_dtype == F32, "logits come back fp32 so the loss is computed in fp32"
    assert {str(p.dtype) for p in wrapped.get_parameters()} == {F32}, "parameters stay fp32 at every level"
    report = {r["path"]: r for r in precision_report(wrapped, policy)["cells"]}
    for name, dtype in seen.items():
        assert report[name]["compute_dtype"] == dtype.lower(), (name, report[name])


def test_parameter_names_do_not_change_with_the_level(pynative_mode):
    names = {lvl: sorted(p.name for p in observe(lvl)[1].get_parameters()) for lvl in ("O0", "O1", "O2", "O3")}
    assert names["O0"] == names["O1"] == names["O2"] == names["O3"]


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_a_checkpoint_loads_into_the_network_under_its_policy(pynative_mode, tmp_path, level):
    """Scoring a run loads each epoch's checkpoint into the network as it was built for the run: under O2's
    wrappers the attribute paths gain `cell.`, the checkpoint's Parameter names do not, and every weight lands."""
    from ampzoo.engine.checkpoint import load_weights

    trained = Tiny()
    for p in trained.get_parameters():
        p.set_data(ms.Tensor(np.random.RandomState(len(p.name)).randn(*p.shape).astype(np.float32)))
    ms.save_checkpoint(trained, str(tmp_path / "tiny.ckpt"))
    cfg = OmegaConf.create({"level": level, "dtype": "float16", "keep_fp32": None, "force_fp16": []})
    wrapped, _ = apply_policy(Tiny(), cfg)
    load_weights(wrapped, tmp_path / "tiny.ckpt", "tiny")
    want = {p.name: p.asnumpy().tolist() for p in trained.get_parameters()}
    assert {p.name: p.asnumpy().tolist() for p in wrapped.get_parameters()} == want


def test_report_says_why(pynative_mode):
    _, wrapped, policy, _, _ = observe("O2", None, ())
    rows = {r["path"]: r for r in precision_report(wrapped, policy)["cells"]}
    assert rows["bn"]["why"] == "keep_fp32" and rows["conv"]["why"] == "O2 default"
    _, wrapped, policy, _, _ = observe("O1", None, ("LayerNorm",))
    rows = {r["path"]: r for r in precision_report(wrapped, policy)["cells"]}
    assert rows["ln"]["why"] == "force_fp16" and rows["fc"]["why"] == "O1 white list"
    assert rows["bn"]["why"] == "O1 default" and rows["bn"]["compute_dtype"] == "float32"


def test_a_keep_path_that_is_not_a_sub_module_names_the_close_ones(pynative_mode):
    from ampzoo.errors import ConfigError
    with pytest.raises(ConfigError,
                       match=r"'haed' is neither a Cell class nor a sub-module of Tiny; did you mean head"):
        observe("O3", ["haed"])
    with pytest.raises(ConfigError, match=r"did you mean LayerNorm"):
        observe("O3", ["layernorm"])


def test_a_low_precision_run_on_the_cpu_says_first_what_it_costs():
    """One line, on the CPU only and only where something runs in low precision: slower than O0 and why."""
    from omegaconf import OmegaConf

    from ampzoo.amp.policy import cpu_cost_note
    from cpu_kernels import has_ops
    o2 = OmegaConf.create({"level": "O2", "force_fp16": []})
    note = cpu_cost_note("CPU", o2)
    assert note.startswith("amp.level=O2 on the CPU") and "slower than O0" in note and "\n" not in note
    assert "on a quiet machine" in note or not has_ops(), "a speed claim is a quiet machine's (issue 78)"
    assert ("the project's kernels store fp16 and multiply in fp32 (" in note) == has_ops()
    assert cpu_cost_note("Ascend", o2) == "" and cpu_cost_note("CPU", OmegaConf.create({"level": "O0",
                                                                                       "force_fp16": []})) == ""


def test_a_run_with_bf16_convolutions_says_first_that_they_cost_accuracy(monkeypatch):
    """runtime.cpu_compute=bf16 where it runs: the first line says what it gained and what it lost."""
    from omegaconf import OmegaConf

    import cpu_kernels
    from ampzoo.amp.policy import cpu_cost_note
    if not cpu_kernels.has_ops():
        pytest.skip(cpu_kernels.why_not())
    monkeypatch.setattr(cpu_kernels, "cpu_compute", lambda flags=None, asked=None: "bf16")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx512f", "f16c", "avx512_bf16"})
    note = cpu_cost_note("CPU", OmegaConf.create({"level": "O2", "force_fp16": []}))
    assert "multiply in bf16 with fp32 sums (auto's choice in training: this CPU has AVX512-BF16)" in note, note
    assert "runtime.cpu_compute=fp32 multiplies in fp32" in note and "\n" not in note and len(note) < 400, note
    assert "on a quiet machine" in note
    explicit = cpu_cost_note("CPU", OmegaConf.create({"level": "O2", "force_fp16": []}), "bf16")
    assert "(runtime.cpu_compute=bf16)" in explicit, explicit
