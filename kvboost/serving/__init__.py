"""Serving: the scheduler and engine loop (one engine thread, many clients) and the OpenAI-compatible server.

``EngineCore`` steps requests on the calling thread (``engine.add_request`` / ``engine.step``); ``EngineLoop`` runs
it on its own thread for servers; ``kvboost-server`` (``kvboost.serving.cli``) serves it over HTTP.
"""

from kvboost.serving.core import EngineCore
from kvboost.serving.loop import EngineLoop
from kvboost.serving.requests import Completion, LoopStopped, QueueFull, RequestHandle, SamplingParams, TokenEvent

__all__ = ["Completion", "EngineCore", "EngineLoop", "LoopStopped", "QueueFull", "RequestHandle", "SamplingParams",
           "TokenEvent"]
