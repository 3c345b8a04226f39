"""Does a token's arithmetic depend on how many tokens share the call? Kernel-level check on this machine.

    python -m experiments.checks.bf16_invariance --out experiments/results/bf16_exactness/kernel_invariance.json

For SmolLM2-135M's layer shapes, rows of a reference call over 512 tokens are recomputed in calls of other
lengths and starting positions (as a prefix hit's suffix prefill does), and the rows whose bits differ from the
reference are counted: plain ``F.linear`` and SDPA (what ``attn=sdpa`` runs) against the position-aligned tiles
of ``attn=batch_invariant`` (``kvboost/attention/batch_invariant.py``), its projection tiles multiplied both by
``F.linear`` and by the prepacked copies it uses where they are available (``packed_weights``). Random inputs; no
model is loaded.
Counts depend on the CPU (oneDNN picks its blocking by ISA: AMX differs from AVX-512), so the machine is
recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from kvboost.attention.batch_invariant import BatchInvariantBackend, invariant_attention, tiled_linear
from kvboost.lab.environment import describe_environment
from kvboost.models.compute import cpu_bf16_isa, matmul_path

#: (start, length) of the recomputed calls: suffixes after prefixes of ragged and aligned lengths.
CALLS = [(0, 1), (0, 31), (0, 200), (1, 1), (17, 3), (63, 64), (64, 64), (100, 157), (137, 375), (255, 1),
         (256, 256), (300, 212), (411, 101), (511, 1)]  # fmt: skip
LINEAR_SHAPES = {"q/o proj 576x576": (576, 576), "gate/up 576->1536": (1536, 576), "down 1536->576": (576, 1536)}


def _linear_rows(dtype: torch.dtype, tile: int) -> dict[str, dict[str, int]]:
    out = {}
    for label, (n_out, n_in) in LINEAR_SHAPES.items():
        torch.manual_seed(0)
        linear = torch.nn.Linear(n_in, n_out, bias=False).to(dtype)
        x = torch.randn(512, n_in, dtype=dtype)
        packed = BatchInvariantBackend(tile=tile)._packed(linear, x)  # None where packing does not run here
        with torch.inference_mode():
            plain_ref, tiled_ref = linear(x), tiled_linear(linear, x, 0, tile)
            packed_ref = tiled_linear(linear, x, 0, tile, packed) if packed is not None else None
            plain = tiled = tiled_packed = rows = 0
            for start, length in CALLS:
                part, span = x[start : start + length], slice(start, start + length)
                plain += int((linear(part) != plain_ref[span]).any(-1).sum())
                tiled += int((tiled_linear(linear, part, start, tile) != tiled_ref[span]).any(-1).sum())
                if packed is not None:
                    tiled_packed += int(
                        (tiled_linear(linear, part, start, tile, packed) != packed_ref[span]).any(-1).sum()
                    )
                rows += length
        out[label] = {"rows": rows, "plain_rows_differing": plain, "tiled_rows_differing": tiled,
                      "tiled_packed_rows_differing": tiled_packed if packed is not None else None}  # fmt: skip
    return out


def _attention_rows(dtype: torch.dtype, tile: int, key_block: int) -> dict[str, int]:
    torch.manual_seed(1)
    n, heads, kv_heads, dim = 512, 9, 3, 64
    q = torch.randn(1, heads, n, dim, dtype=dtype)
    k = torch.randn(1, kv_heads, n, dim, dtype=dtype)
    v = torch.randn(1, kv_heads, n, dim, dtype=dtype)

    def causal(q_len: int, k_len: int) -> torch.Tensor:
        return (torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None])[None, None]

    def sdpa(start: int, end: int) -> torch.Tensor:
        if end - start == end:  # a cold call: is_causal, as transformers passes it
            return F.scaled_dot_product_attention(q[:, :, :end], k[:, :, :end], v[:, :, :end], is_causal=True,
                                                  enable_gqa=True)  # fmt: skip
        return F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                              attn_mask=causal(end - start, end), enable_gqa=True)  # fmt: skip

    def invariant(start: int, end: int) -> torch.Tensor:
        return invariant_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], causal(end - start, end),
                                   front=start % tile, tile=tile, key_block=key_block, scaling=dim**-0.5)  # fmt: skip

    with torch.inference_mode():
        sdpa_ref, inv_ref = sdpa(0, n), invariant(0, n)
        plain = tiled = rows = 0
        for start, length in CALLS:
            end = start + length
            plain += int((sdpa(start, end) != sdpa_ref[:, :, start:end]).any(-1).any(1).sum())
            tiled += int((invariant(start, end) != inv_ref[:, start:end]).any(-1).any(-1).sum())
            rows += length
    return {"rows": rows, "sdpa_rows_differing": plain, "batch_invariant_rows_differing": tiled}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--tile", type=int, default=64, help="projection tile (attn.tile)")
    parser.add_argument("--query-tile", type=int, default=16, help="attention query tile (attn.query_tile)")
    parser.add_argument("--key-block", type=int, default=128, help="attention key block (attn.key_block)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = {
        "command": "python -m experiments.checks.bf16_invariance " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": describe_environment(),
        "cpu_bf16_isa": cpu_bf16_isa(),
        "matmul_path": {name: matmul_path(getattr(torch, name), "cpu") for name in args.dtypes},
        "calls": CALLS,
        "tile": args.tile,
        "query_tile": args.query_tile,
        "key_block": args.key_block,
        "by_dtype": {},
    }
    for name in args.dtypes:
        dtype = getattr(torch, name)
        result["by_dtype"][name] = {
            "linear": _linear_rows(dtype, args.tile),
            "attention": _attention_rows(dtype, args.query_tile, args.key_block),
        }
        print(name, json.dumps(result["by_dtype"][name], indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
