"""Workloads (``WORKLOADS`` registry): ``sharegpt_replay``, ``rag_reorder``, ``accuracy``, ``batch``, ``musique``,
``needle``.

See ``base.py`` for the interface.
"""

from kvboost.registry import Registry

WORKLOADS = Registry(
    "workload",
    ("experiments.workloads.sharegpt_replay", "experiments.workloads.rag_reorder", "experiments.workloads.accuracy",
     "experiments.workloads.batch", "experiments.workloads.musique", "experiments.workloads.needle"),
)

__all__ = ["WORKLOADS"]
