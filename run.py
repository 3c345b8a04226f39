"""Hydra entry point: ``python run.py [group=name ...] [key=value ...]``; ``-m`` sweeps.

    python run.py                                             # ShareGPT replay, bundled SmolLM2, CPU
    python run.py workload.num_conversations=8 workload.max_turns=6 logger=none
    python run.py -m recompute=none,full chunker.chunk_size=32,64
"""

from __future__ import annotations

import logging
import os

# The attention backend may need the Triton interpreter on a machine without a GPU; it must be chosen
# before anything imports triton. kvboost.attention handles that itself when attn=triton.
import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.runner import run_experiment


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_experiment(cfg, out_dir=HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
