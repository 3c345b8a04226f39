"""Serving: the engine core (the one request loop of an engine), its thread (one engine thread, many clients) and
the OpenAI-compatible server.

``engine.core`` (``EngineCore``) steps requests on whichever thread drives it (``generate``, ``engine.step``);
``EngineLoop`` drives it from a thread of its own for servers; ``kvboost-server`` (``kvboost.serving.cli``) serves
it over HTTP. ``kvboost.serving.frontend`` keeps text on the callers' side.
"""

from kvboost.serving.core import EngineCore
from kvboost.serving.loop import EngineLoop
from kvboost.serving.requests import Completion, LoopStopped, QueueFull, RequestHandle, SamplingParams, TokenEvent

__all__ = ["Completion", "EngineCore", "EngineLoop", "LoopStopped", "QueueFull", "RequestHandle", "SamplingParams",
           "TokenEvent"]
