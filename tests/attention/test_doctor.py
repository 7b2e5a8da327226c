"""What `mlxkv doctor` says of attention: the path, the kernels' self-check and the speed
gate's choice, on Llama-3-8B's shape. Both tests need the same real self-check in the
harness; in one module they run in one xdist worker (--dist loadfile), so `checked_once`
runs it once for both."""

from __future__ import annotations

import json

import mlxkv  # noqa: F401  (before mlx)
import pytest

from mlxkv.attention.dispatch import ATTENTION_ENV
from mlxkv.attention.doctor import attention_lines, attention_report
from test_self_check import broken_compiler, harness_run
from test_speed_gate import TIMES, FakeGPU


@pytest.mark.slow  # the self-check of Llama-3-8B's shape, in the harness
def test_doctor_reports_the_kernel_path_and_its_check(monkeypatch, checked_once):
    monkeypatch.setenv(ATTENTION_ENV, "kernel")  # as "auto" is on a Mac
    passed = attention_report(run=harness_run())
    assert passed["path"] == "kernel" and passed["check"]["ok"]
    failed = attention_report(run=broken_compiler)
    assert failed["path"] == "reference" and not failed["check"]["ok"]
    lines = dict(attention_lines(failed))
    assert "failed their self-check" in lines["attention"]
    assert lines["kernel check"].startswith("FAILED: float16, head dim 128, block 16, group 4: RuntimeError")


@pytest.mark.slow  # the same self-check: answered by the test above's
def test_doctor_shows_the_timings_and_the_choice(monkeypatch, checked_once):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)  # auto, as on a Mac
    report = attention_report(run=harness_run(), timer=FakeGPU(TIMES).timer, metal=True)
    json.dumps(report)  # what `mlxkv doctor --json` prints
    assert report["path"] == "kernel" and report["check"]["ok"]
    assert [(b["batch"], b["context"], b["path"]) for b in report["gate"]][:2] == [(1, 512, "reference"),
                                                                                   (1, 4096, "reference")]
    assert "the speed gate uses them in 8 of 12 (queries, batch, context) buckets" in report["why"]
    lines = attention_lines(report)
    assert ("speed gate", "batch 1, context 512: kernels 1.500 ms, reference 1.000 ms: reference") in lines
    assert ("speed gate", "batch 8, context 512: kernels 0.500 ms, reference 1.000 ms: kernel") in lines
    assert ("speed gate", "4 queries per row, batch 8, context 512: kernels 0.500 ms, reference 1.000 ms: "
                          "kernel") in lines
