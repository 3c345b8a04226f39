"""Shared generate() pieces: the phase clock synchronises a CUDA device at every mark (issue: unsynchronised
phase timers on GPU), and never on CPU."""

from __future__ import annotations

import torch

from kvboost.generation import PhaseClock


def test_phase_clock_synchronises_cuda_at_every_mark(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    clock = PhaseClock("cuda")  # only the device type is read: no GPU needed
    clock.mark("tokenized")
    clock.mark("first")
    assert len(calls) == 3  # start, tokenized, first
    assert clock.ms("start", "first") >= clock.ms("start", "tokenized") >= 0.0


def test_phase_clock_does_not_synchronise_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    clock = PhaseClock(torch.device("cpu"))
    clock.mark("first")
    assert calls == []
