"""StepProfiler on a real tiny GPT training loop in one process (no Ray)."""

import json

import pytest
import torch
import torch.nn.functional as F

from raytrain_ext.config import load_config
from raytrain_ext.models import build_model
from raytrain_ext.train.profiler import TOOL_ENV, StepProfiler


def profile_cfg(tmp_path, steps, ranks=(0,)):
    overrides = [
        f"profile.steps=[{','.join(map(str, steps))}]",
        f"profile.ranks=[{','.join(map(str, ranks))}]",
        f"profile.dir={tmp_path}/prof",
        "model.n_layers=1",
        "model.d_model=32",
        "model.n_heads=2",
        "model.seq_len=16",
        "scaling.num_workers=2",
    ]
    return load_config(None, overrides)


def train(cfg, profiler, first_step, last_step):
    """The loop's contract: step_begin(step) / one optimizer step / step_end(step), then close()."""
    model = build_model(cfg.model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    try:
        for step in range(first_step, last_step + 1):
            profiler.step_begin(step)
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step_end(step)
    finally:
        profiler.close()


def trace_events(path):
    trace = json.loads(path.read_text())
    return trace["traceEvents"]


def test_trace_covers_exactly_the_configured_steps(tmp_path):
    cfg = profile_cfg(tmp_path, [2, 3])
    profiler = StepProfiler(cfg.profile, rank=0)
    train(cfg, profiler, 1, 5)
    path = tmp_path / "prof" / "rank0-steps2-3.json"
    assert profiler.trace_path == path and sorted(p.name for p in path.parent.iterdir()) == [
        "rank0-steps2-3.json"
    ]
    events = trace_events(path)
    steps = sorted(
        (e for e in events if e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"]
    )
    assert [e["name"] for e in steps] == ["ProfilerStep#2", "ProfilerStep#3"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    names = {e["name"] for e in ops}
    assert {"aten::mm", "aten::scaled_dot_product_attention", "aten::layer_norm"} <= names
    begin, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    assert all(begin <= e["ts"] <= end for e in ops)  # nothing from steps 1, 4 or 5
    per_step = [sum(1 for e in ops if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]) for s in steps]
    assert per_step[0] > 50 and per_step[0] == per_step[1]  # both steps ran the same ops


def test_unlisted_rank_and_empty_range_write_nothing(tmp_path):
    cfg = profile_cfg(tmp_path, [2, 3], ranks=(1,))
    rank0 = StepProfiler(cfg.profile, rank=0)
    train(cfg, rank0, 1, 4)
    off = StepProfiler(profile_cfg(tmp_path, []).profile, rank=0)
    train(cfg, off, 1, 4)
    assert not rank0.enabled and not off.enabled
    assert rank0.trace_path is None and off.trace_path is None
    assert not (tmp_path / "prof").exists()


def test_run_that_resumes_and_stops_inside_the_range_records_what_it_ran(tmp_path):
    cfg = profile_cfg(tmp_path, [2, 9], ranks=(0, 1))
    profiler = StepProfiler(cfg.profile, rank=1)
    train(cfg, profiler, 4, 6)  # resumed from a step-3 checkpoint, preempted after step 6
    assert profiler.trace_path == tmp_path / "prof" / "rank1-steps4-6.json"
    names = sorted(
        e["name"]
        for e in trace_events(profiler.trace_path)
        if e.get("name", "").startswith("ProfilerStep#")
    )
    assert names == ["ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"]


def test_nsys_mode_brackets_the_range_with_cuda_profiler_calls(tmp_path, monkeypatch):
    """The CUDA profiler API is replaced by a recorder (no GPU here); the gating is ours."""
    calls = []

    class Range:
        def __init__(self, label):
            self.label = label

        def __enter__(self):
            calls.append(f"push {self.label}")

        def __exit__(self, *exc):
            calls.append("pop")

    monkeypatch.setenv(TOOL_ENV, "nsys")
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range", Range)
    profiler = StepProfiler(profile_cfg(tmp_path, [2, 3]).profile, 0, torch.device("cuda"))
    for step in range(1, 6):
        profiler.step_begin(step)
        profiler.step_end(step)
    profiler.close()
    assert calls == ["start", "push ProfilerStep#2", "pop", "push ProfilerStep#3", "pop", "stop"]
    assert not (tmp_path / "prof").exists()


def test_bad_tool_choices_name_the_variable_and_the_fix(tmp_path, monkeypatch):
    cfg = profile_cfg(tmp_path, [2, 3])
    monkeypatch.setenv(TOOL_ENV, "perf")
    with pytest.raises(ValueError, match=r"RAYTRAIN_EXT_PROFILER='perf': choose one of torch, "):
        StepProfiler(cfg.profile, rank=0)
    monkeypatch.setenv(TOOL_ENV, "nsys")
    with pytest.raises(ValueError, match=r"profiles CUDA devices, but rank 0 trains on cpu; unset"):
        StepProfiler(cfg.profile, rank=0)
