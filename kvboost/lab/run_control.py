"""What a long run owes the person waiting for it: an estimate after the first request, records as they finish,
and the summary of what finished when it is interrupted.

- :class:`RecordSink`: ``records.jsonl`` written (and flushed) record by record, so a killed run keeps them;
- :func:`interruptible`: SIGTERM raises :class:`RunInterrupted` like Ctrl-C does (main thread only);
- :class:`RunEstimate`: times the first request of every mode and prints the whole run's estimate and, when it is
  long, the smaller command (fewer requests, or ``attn=sdpa`` where Triton runs under its CPU interpreter).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvboost.lab.report import write_records

#: an estimate above this (seconds) prints how to shrink the run
HINT_ABOVE_S = 600.0
#: what the shrunk command aims at (seconds)
TARGET_S = 300.0


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM after writing the records and summary of what finished."""

    def __init__(self, signal_name: str = "SIGINT", out_dir: str | os.PathLike | None = None) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.out_dir = out_dir


def exit_code(exc: RunInterrupted) -> int:
    """The shell's convention: 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + int(getattr(signal, exc.signal_name, signal.SIGINT))


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While active, SIGTERM raises RunInterrupted("SIGTERM") in the main thread (Ctrl-C raises KeyboardInterrupt
    as always); the previous handler is restored after. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise RunInterrupted("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class RecordSink:
    """``records.jsonl``, emptied at the start and appended (and flushed) one request at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = write_records([], path)
        self.count = 0

    def write(self, records: list[Mapping[str, Any]]) -> None:
        """Append ``records`` now (each line flushed: a killed run keeps what was written)."""
        write_records(records, self.path, append=True)
        self.count += len(records)


def fmt_duration(seconds: float) -> str:
    """``42 s``, ``7 min 12 s``, ``6 h 18 min``."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec} s" if sec else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


class RunEstimate:
    """Times the first request and prints what the whole run will take, once.

    Args:
        requests: requests in the run (an upper bound), each served by every mode ``repeats`` times.
        modes: the run's modes.
        repeats: measurements per request and mode.
        smaller: ``fraction -> {workload field: value}`` that keeps about that share of the requests.
        overrides: the command's overrides (``run.py``'s), to print the smaller command from.
        interpreted_triton: Triton runs under its CPU interpreter (suggest ``attn=sdpa``).
        emit: where lines go (``tqdm.write`` in the runner, so the progress bar stays whole).
    """

    def __init__(self, *, requests: int, modes: list[str], repeats: int, smaller: Callable[[float], dict[str, Any]],
                 overrides: list[str] | None, interpreted_triton: bool, emit: Callable[[str], None] = print) -> None:  # fmt: skip
        self.requests, self.modes, self.repeats = requests, list(modes), repeats
        self.smaller, self.overrides, self.interpreted_triton = smaller, list(overrides or []), interpreted_triton
        self.emit = emit
        self.first: dict[str, float] = {}
        self.done = False
        self.estimate_s: float | None = None

    def warmup(self, seconds: dict[str, float]) -> None:
        """The warm-up requests' times (a short prompt, 4 new tokens, one per mode): a lower bound of the run,
        printed before the first measured request (which may take minutes where Triton is interpreted)."""
        if not seconds:
            return
        per_request = sum(seconds.values())
        total = per_request * self.requests * self.repeats
        parts = ", ".join(f"{m} {fmt_duration(s)}" for m, s in seconds.items())
        text = (f"warm-up request (short prompt, 4 new tokens): {parts}; the run's {self.requests} request(s) x "
                f"{len(self.modes)} mode(s) have longer prompts: at least ~{fmt_duration(total)}")  # fmt: skip
        if total > HINT_ABOVE_S:
            text += "\n" + self.hint(total)
        self.emit(text + "\n(an estimate follows the first measured request)")

    def add(self, mode: str, seconds: float, prompt_tokens: int | None = None) -> None:
        """One timed call of the first request; after the first call a provisional estimate, after the last mode
        the estimate (the first request's time x the run's requests)."""
        if self.done or mode in self.first:
            return
        self.first[mode] = seconds
        if len(self.first) == 1 and len(self.modes) > 1:
            self.emit(f"first request, mode {mode}: {fmt_duration(seconds)}"
                      + (f" ({prompt_tokens} prompt tokens)" if prompt_tokens else "")
                      + f"; if every mode takes as long: {self._line(seconds * len(self.modes))}")  # fmt: skip
        if len(self.first) == len(self.modes):
            self.done = True
            per_request = sum(self.first.values())
            parts = ", ".join(f"{m} {fmt_duration(s)}" for m, s in self.first.items())
            self.emit(f"first request: {fmt_duration(per_request)} over {len(self.modes)} mode(s) ({parts})")
            self.emit(self._line(per_request))

    def _line(self, per_request_s: float) -> str:
        total = per_request_s * self.requests * self.repeats
        self.estimate_s = total
        text = (f"estimated run: ~{fmt_duration(total)} for {self.requests} request(s) x {len(self.modes)} mode(s)"
                + (f" x {self.repeats} repeats" if self.repeats > 1 else "")
                + " (from the first request alone: longer prompts, e.g. later turns of a chat, take longer)")  # fmt: skip
        if total > HINT_ABOVE_S:
            text += "\n" + self.hint(total)
        return text

    def hint(self, total_s: float) -> str:
        """How to make the run shorter: the command with fewer requests, and ``attn=sdpa`` under the interpreter."""
        lines = []
        fields = self.smaller(min(1.0, TARGET_S / total_s)) if total_s > 0 else {}
        if fields:
            changed = {f"workload.{k}": v for k, v in fields.items()}
            kept = [o for o in self.overrides if o.split("=", 1)[0].lstrip("+~") not in changed]
            command = " ".join(["python run.py", *kept, *(f"{k}={v}" for k, v in changed.items())])
            lines.append(f"  to shrink it, fewer requests (aiming at {fmt_duration(TARGET_S)}): {command}")
        if self.interpreted_triton:
            kept = [o for o in self.overrides if o.split("=", 1)[0].lstrip("+~") != "attn"]
            lines.append("  attn=triton has no GPU here and runs under Triton's interpreter (TRITON_INTERPRET=1), "
                         "orders of magnitude slower than torch: " + " ".join(["python run.py", *kept, "attn=sdpa"]))  # fmt: skip
        lines.append("  Ctrl-C stops the run and writes the summary of what finished (records.jsonl is written as "
                     "requests finish)")  # fmt: skip
        return "\n".join(lines)
