"""Helpers shared by the tests: tiny random models (``tiny``), Hydra composition (``compose``), server and Redis
processes (``server_process``, ``redis_server``, ``chaos_server``) and the sys.path shadowing check (``shadowing``).

One package with a name no other distribution uses, so that putting ``tests/`` on ``sys.path`` (pytest's
``pythonpath``) adds no generic top-level name such as ``tiny`` or ``compose``.
"""
