"""specwire.step_profiler: off by default; with SPECWIRE_PROFILE_DIR it records the window of steps it was
told to, once, and writes a Chrome trace and an op table that name what ran in those steps."""

import json

import torch

from specwire.step_profiler import StepProfiler


def test_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECWIRE_PROFILE_DIR", raising=False)
    profiler = StepProfiler("verifier")
    for _ in range(5):
        profiler.step()
    assert profiler.out_dir is None and not list(tmp_path.iterdir())


def test_records_the_window_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECWIRE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECWIRE_PROFILE_SKIP", "2")
    monkeypatch.setenv("SPECWIRE_PROFILE_STEPS", "3")
    profiler = StepProfiler("verifier")
    x = torch.randn(64, 64)
    for i in range(12):
        (x @ x) if 2 <= i < 5 else (x + x)  # matmuls only inside the window (steps 3..5)
        profiler.step()
    traces, tables = list(tmp_path.glob("verifier-*.json")), list(tmp_path.glob("verifier-*.txt"))
    assert len(traces) == 1 and len(tables) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert "aten::mm" in names and "aten::add" not in names
    assert tables[0].read_text().startswith("3 steps") and "aten::mm" in tables[0].read_text()
