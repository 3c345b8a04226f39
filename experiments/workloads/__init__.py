"""Workloads (``WORKLOADS`` registry): ``sharegpt_replay``, ``rag_reorder``. See ``base.py`` for the interface."""

from kvboost.registry import Registry

WORKLOADS = Registry(
    "workload", ("experiments.workloads.sharegpt_replay", "experiments.workloads.rag_reorder")
)

__all__ = ["WORKLOADS"]
