"""Workloads (``WORKLOADS`` registry): ``sharegpt_replay``, ``rag_reorder``, ``accuracy``, ``batch``, ``musique``,
``needle``.

See ``base.py`` for the interface.
"""

from kvboost.registry import Registry

WORKLOADS = Registry(
    "workload",
    ("kvboost.lab.workloads.sharegpt_replay", "kvboost.lab.workloads.rag_reorder", "kvboost.lab.workloads.accuracy",
     "kvboost.lab.workloads.batch", "kvboost.lab.workloads.musique", "kvboost.lab.workloads.needle"),
)

__all__ = ["WORKLOADS"]
