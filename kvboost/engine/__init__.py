"""The engine: the public class that composes the plugins (``KVBoost`` / ``InferenceEngine``), its one request loop
and everything the loop schedules. The HTTP server (``kvboost.serving``) is a client of this package, never the
reverse.

- :mod:`kvboost.engine.inference`: ``InferenceEngine`` (``KVBoost``): ``generate``, ``generate_batch``, ``warm``...
- :mod:`kvboost.engine.core`: ``EngineCore``, one per engine: steps requests on whichever thread drives it
  (``generate``, ``engine.step``);
- :mod:`kvboost.engine.scheduler` and :mod:`kvboost.engine.budget`: the waiting order, admission, preemption and
  the step's token budget;
- :mod:`kvboost.engine.sequences`: ``Request``, the core's unit of work; :mod:`kvboost.engine.pipeline`: a request's
  steps that are not the scheduler's (lookup, the prefill of a plan, storing, the result);
- :mod:`kvboost.engine.requests`: what callers hold (``SamplingParams``, ``RequestHandle``, ``Completion``,
  ``TokenEvent``, ``QueueFull``, ``LoopStopped``);
- :mod:`kvboost.engine.frontend`: text on the callers' side (tokenize, detokenize, stop strings);
- :mod:`kvboost.engine.loop`: ``EngineLoop``, the core driven from a thread of its own (one engine thread, many
  clients), as servers use it.
"""

from kvboost.engine.core import EngineCore
from kvboost.engine.inference import InferenceEngine, KVBoost
from kvboost.engine.loop import EngineLoop
from kvboost.engine.requests import Completion, LoopStopped, QueueFull, RequestHandle, SamplingParams, TokenEvent
from kvboost.original_api import GenerationMode, RecomputeStrategy

__all__ = ["Completion", "EngineCore", "EngineLoop", "GenerationMode", "InferenceEngine", "KVBoost", "LoopStopped",
           "QueueFull", "RecomputeStrategy", "RequestHandle", "SamplingParams", "TokenEvent"]
