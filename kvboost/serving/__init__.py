"""Serving: the OpenAI-compatible HTTP server over the engine (``kvboost-server``, ``kvboost.serving.cli``), its
protocol, API keys and tenancy, Prometheus metrics, and the Ray Serve app with its KV-event router.

The engine it serves lives in :mod:`kvboost.engine` (``EngineLoop`` drives the engine core from a thread of its own;
``kvboost.engine.frontend`` keeps text on the callers' side); this package depends on it, never the reverse.
"""
