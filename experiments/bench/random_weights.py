"""A model folder with another model's architecture, tokenizer and chat template, and random weights.

    python -m experiments.bench.random_weights --like ~/.cache/kvboost/models/SmolLM2-135M-Instruct-<tag> \\
        --out /tmp/smollm2-random [--dtype bfloat16] [--seed 0]
    python -m experiments.bench.random_weights --config-only --like <model dir> --out <small dir>   # no weights

For timing-only runs where the weights cannot travel (a remote GPU reached through a small file transfer): the
same shapes give the same kernels and the same time per token, and a replay that takes its history from the
dataset feeds the same prompts. What such a run cannot report is anything that depends on the weights' values
(greedy agreement, answers, accuracy): say so beside its figures. ``--config-only`` copies the small files
(config, generation config, tokenizer, chat template); running the script again on that folder, without
``--config-only``, writes the random weights next to them. (``model=tiny_random`` differs: a shrunk random model
built from the bundled model's converted folder, for smoke tests; this keeps the full size and needs only the
small files.)
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

#: The small files of a model folder that describe it without its weights.
DESCRIPTION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def copy_description(like: Path, out: Path) -> list[str]:
    """Copy the description files of ``like`` into ``out``; returns their names."""
    if not (like / "config.json").is_file():
        raise FileNotFoundError(f"{like} has no config.json: pass a model folder with --like")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in DESCRIPTION_FILES:
        if (like / name).is_file():
            if (like / name).resolve() != (out / name).resolve():
                shutil.copyfile(like / name, out / name)
            copied.append(name)
    return copied


def write_random_model(like: Path, out: Path, *, dtype: str = "bfloat16", seed: int = 0, device: str = "cpu") -> Path:
    """``out`` holding ``like``'s description and a model of its config with random weights (``dtype``), drawn
    on ``device`` (a GPU draws a 7B model's weights in seconds where a CPU takes minutes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    copy_description(like, out)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", type=Path, required=True, help="model folder whose architecture and tokenizer to copy")
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to draw the weights (cpu, cuda)")
    p.add_argument("--config-only", action="store_true", help="copy the small description files only")
    args = p.parse_args(argv)
    if args.config_only:
        print("copied", ", ".join(copy_description(args.like, args.out)), "into", args.out)
    else:
        print("random weights written to", write_random_model(args.like, args.out, dtype=args.dtype, seed=args.seed,
                                                                       device=args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
