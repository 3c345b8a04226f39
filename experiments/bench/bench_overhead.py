"""Where kvboost's per-request overhead goes, next to what hf_prefix pays for the same reuse.

For prompts of several lengths whose first ``length`` tokens are cached (stored by an earlier request, not by
this measurement), it times the pieces of kvboost's TTFT that a carried HF cache does not have:

- ``chunk_hash_ms``: chunking and SHA-256 prefix/segment keys of the whole prompt;
- ``lookup_ms``: the walk over the store (exact hits + frontier match) and the plan's placements;
- ``assemble_ms``: the exact hit put in place for the suffix prefill. With the paged KV pool
  (``kvboost.reuse.assemble``) that is the block table taking references to the cached blocks and copying the
  partial last block (copy on write); before the pool (``--kvboost-root`` of an older checkout) it was a copy of
  every reused row into a preallocated buffer;
- ``copied_bytes``: the bytes that assembly moved (the pool's counters; before the pool, the reused rows);

and, for hf_prefix, ``hf_crop_ms`` (views of the carried cache) plus ``hf_concat_ms`` (the copy of the past that
``DynamicLayer.update`` makes when the suffix is appended). Medians over ``--repeats`` runs.

    python -m experiments.bench.bench_overhead                 # bundled SmolLM2, CPU
    python -m experiments.bench.bench_overhead --lengths 1024 4096 16384 --max-positions 32768 \
        --out experiments/results/overhead/overhead_cpu.json
    python -m experiments.bench.bench_overhead --kvboost-root /tmp/kvboost-before ...   # the same on an older checkout

``--max-positions`` raises the model's context in its config (timing only: RoPE extends past the trained range;
nothing here reads the outputs) so that prefixes longer than the bundled model's 8k can be cached.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def _select_root(argv: list[str]) -> Path:
    """The checkout whose ``kvboost`` is measured (``--kvboost-root``, default this one), first on the path."""
    root = ROOT
    if "--kvboost-root" in argv:
        root = Path(argv[argv.index("--kvboost-root") + 1]).resolve()
    from experiments.common import use_checkout  # this checkout's experiments (run with -m from ROOT)

    return use_checkout(root)


KVBOOST_ROOT = _select_root(sys.argv)

import torch  # noqa: E402

from experiments.common import median_ms as _median_ms  # noqa: E402
from kvboost import KVBoost  # noqa: E402
from kvboost.lab.environment import describe_environment  # noqa: E402
from kvboost.lookup import chunk_prompt, lookup  # noqa: E402


def _hf_prefill(model, ids: list[int]):
    """HF's DynamicCache of ``ids`` (what hf_prefix carries)."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{kw: cache})
    return cache


def _assembler(engine: KVBoost, plan, prompt_len: int):
    """``(assemble_once, bytes it copies)`` for this engine's code: the block table over the pool, or (an older
    checkout) the copy into a preallocated buffer."""
    if hasattr(engine, "pool"):
        from kvboost.kv.block_table import BlockTable
        from kvboost.reuse.assemble import assemble_exact

        pool = engine.pool

        def assemble_once() -> None:
            table = BlockTable(pool)
            assemble_exact(plan, table, engine.quantizer)
            table.prepare_write(plan.exact_prefix, prompt_len)  # the copy on write the suffix prefill makes
            table.release()

        stats = pool.stats
        before = stats.copied_bytes + stats.written_bytes
        assemble_once()
        return assemble_once, stats.copied_bytes + stats.written_bytes - before

    def assemble_legacy() -> None:
        kv = engine.adapter.allocate(prompt_len + 32)
        for p in plan.placements:
            if p.kind == "exact":
                kv.write(p.start, p.keys, p.values)
        kv.set_length(plan.exact_prefix)

    return assemble_legacy, plan.exact_prefix * engine.adapter.kv_bytes_per_token()


def measure(engine: KVBoost, length: int, new_tokens: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(length)
    vocab = engine.model.config.vocab_size
    ids = torch.randint(100, vocab - 100, (length + new_tokens,), generator=g).tolist()
    engine.reset_cache()
    with torch.inference_mode():
        # An earlier request stores the first `length` tokens (what a previous chat turn leaves behind).
        engine.generate(ids[:length], max_new_tokens=1)
        hf_cache = _hf_prefill(engine.model, ids[:length])

        prompt = ids
        spans, keys = chunk_prompt(prompt, engine.chunker, engine.hasher, engine.fingerprint)
        plan = lookup(prompt, spans, keys, engine.store, engine.quantizer, max_reuse=len(prompt) - 1)
        reused = plan.reused_tokens

        chunk_hash = _median_ms(
            lambda: chunk_prompt(prompt, engine.chunker, engine.hasher, engine.fingerprint), repeats
        )
        lookup_ms = _median_ms(
            lambda: lookup(prompt, spans, keys, engine.store, engine.quantizer, max_reuse=len(prompt) - 1),
            repeats,
        )
        assemble_once, copied = _assembler(engine, plan, len(prompt))
        assemble = _median_ms(assemble_once, repeats)

        def crop_all_layers() -> list:
            return [(lay.keys[:, :, :reused], lay.values[:, :, :reused]) for lay in hf_cache.layers]

        crop = _median_ms(crop_all_layers, repeats)
        layer = hf_cache.layers[0]
        new_k = torch.zeros_like(layer.keys[:, :, :new_tokens])

        def concat_all_layers() -> list[torch.Tensor]:
            # The concatenated tensors are kept, as the DynamicCache keeps them for the rest of the request:
            # dropping each one at once lets the allocator hand the same cache-hot block to the next layer,
            # timing a copy that never reaches memory (4k tokens, standalone: 8.5 ms dropped vs 14 ms kept).
            kept = []
            for lay in hf_cache.layers:
                kept.append(torch.cat([lay.keys[:, :, :reused], new_k], dim=-2))
                kept.append(torch.cat([lay.values[:, :, :reused], new_k], dim=-2))
            return kept

        concat = _median_ms(concat_all_layers, repeats)
    return {
        "prompt_tokens": len(prompt),
        "reused_tokens": reused,
        "chunk_hash_ms": chunk_hash,
        "lookup_ms": lookup_ms,
        "assemble_ms": assemble,
        "lookup_assemble_ms": lookup_ms + assemble,
        "kvboost_total_ms": chunk_hash + lookup_ms + assemble,
        "copied_bytes": copied,
        "hf_crop_ms": crop,
        "hf_concat_ms": concat,
        "hf_total_ms": crop + concat,
        "kv_bytes_reused": reused * engine.adapter.kv_bytes_per_token(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF id or folder; default: the bundled SmolLM2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64, help="uncached tokens after the cached prefix")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="auto", help="model dtype (auto, float32, bfloat16)")
    parser.add_argument("--max-positions", type=int, default=None,
                        help="raise the model's context in its config (timing only) to cache longer prefixes")
    parser.add_argument("--kvboost-root", default=None, help="measure the kvboost of another checkout (a worktree)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="experiments/results/overhead_cpu.json")
    args = parser.parse_args()

    from experiments.common import set_threads


    set_threads(args.threads)
    from kvboost.models.loading import load_model_and_tokenizer

    model, tokenizer, path = load_model_and_tokenizer(args.model, dtype=args.dtype)
    if args.max_positions:
        model.config.max_position_embeddings = args.max_positions
    # The public constructor, not kvboost.build.build_engine: --kvboost-root measures older checkouts, which
    # may have no kvboost.build; every checkout has KVBoost(model, tokenizer, ...).
    engine = KVBoost(model, tokenizer, model_identity=path, cache={"name": "memory", "capacity": "8GiB"})
    rows = [measure(engine, n, args.new_tokens, args.repeats) for n in args.lengths]
    print(f"kvboost from {KVBOOST_ROOT}")
    print(f"{'prompt':>7} {'reused':>7} | {'hash':>7} {'lookup':>7} {'assemble':>8} {'kvboost':>8} {'copied':>10} | "
          f"{'hf crop':>7} {'hf cat':>7} {'hf':>7}   (ms, median of {args.repeats})")  # fmt: skip
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['reused_tokens']:>7} | {r['chunk_hash_ms']:7.2f} {r['lookup_ms']:7.2f} "
              f"{r['assemble_ms']:8.2f} {r['kvboost_total_ms']:8.2f} {r['copied_bytes']:>10} | {r['hf_crop_ms']:7.2f} "
              f"{r['hf_concat_ms']:7.2f} "
              f"{r['hf_total_ms']:7.2f}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    options = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None
    )
    payload = {
        "command": f"python -m experiments.bench.bench_overhead {options}",
        "environment": describe_environment(),
        "kvboost_root": str(KVBOOST_ROOT),
        "rows": rows,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
