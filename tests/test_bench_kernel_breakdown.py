"""benchmarks/kernel_breakdown.py's arithmetic over a trace, on a synthetic one (the trace itself needs
a GPU): the critical-path charges and one layer's time line."""

import pytest

from flint_sched.benchmarks import kernel_breakdown as kb

# two steps of two layers each: norm, attention (overlapping the norm), moe; times in ns
STEP = [(0, 1000, "norm"), (500, 3000, "attn"), (3000, 9000, "moe"),
        (9000, 10000, "norm"), (9500, 12000, "attn"), (12500, 18000, "moe")]
TRACE = STEP + [(start + 100_000, end + 100_000, name) for start, end, name in STEP]


@pytest.fixture
def fake_trace(monkeypatch):
    monkeypatch.setattr(kb, "_traced", lambda step, num_steps: None)
    monkeypatch.setattr(kb, "_kernels", lambda prof: sorted(TRACE))


def test_critical_path_charges_each_kernel_what_it_adds_to_the_end(fake_trace):
    rows = {name: (us, count) for name, us, count in kb.critical_path(lambda: None, num_steps=2)}
    # a step: norm 1 + 1, attention 2 + 2 (each only past the norm's end), moe 6 + 5.5 (the second
    # starts after a 0.5 µs idle gap, which nobody is charged with)
    assert rows["norm"] == (pytest.approx(2.0), 2)
    assert rows["attn"] == (pytest.approx(4.0), 2)
    assert rows["moe"] == (pytest.approx(11.5), 2)


def test_layer_timeline_shows_one_layer_of_the_last_step(fake_trace):
    text = kb.layer_timeline(lambda: None, "norm", 0, num_steps=2)
    lines = text.splitlines()
    assert "from norm of layer 0" in lines[0]
    starts = [float(line.split()[0]) for line in lines[1:]]
    assert starts == [0.0, 0.5, 3.0, 9.0]                # the last step's layer 0, up to layer 1's norm
    assert lines[2].split()[3] == "-0.50"                 # attention started 0.5 µs before the norm ended
    with pytest.raises(ValueError, match="no layer 1"):
        kb.layer_timeline(lambda: None, "norm", 1, num_steps=2)
