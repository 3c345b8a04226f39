"""The paged attention kernel's cost of row-invariance (issue 61): ``paged_forward(row_invariant=False)`` (prompt tiles
of more than 48 rows on MKL's GEMMs: the 4-bit step before) against ``row_invariant=True`` (every tile on the direct
path: the 4-bit step now), the bundled SmolLM2's shapes (9 heads over 3 KV heads, head dim 64, blocks of 16), one
layer. CPU time of the calling thread (``time.thread_time``, 1 torch thread, best of 11 alternating calls): measured
on a 2-core machine shared by several sessions, where wall-clock times of a 2-thread call varied 100x.

    TORCH_EXTENSIONS_DIR=... python experiments/bench/bench_paged_row_invariant.py > experiments/results/exactness/paged_attention_ab.json
"""
import json, os, sys, time, torch
from kvboost.attention.cpu_ext import load_cpu_extension
ext = load_cpu_extension(); torch.set_num_threads(1)
hq, hkv, d, bs = 9, 3, 64, 16
g = torch.Generator().manual_seed(0)
k = torch.randn(hkv, 8192, d, generator=g); v = torch.randn(hkv, 8192, d, generator=g)
table = torch.arange(8192 // bs, dtype=torch.int32)[None]
res = {}
for n, ctx in ((64, 0), (256, 0), (1024, 0), (32, 1024), (1, 1024)):
    q = torch.randn(n, hq, d, generator=g)
    out = torch.empty_like(q)
    args = (q, k, v, table, torch.tensor([ctx + n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
            torch.arange(ctx, ctx + n, dtype=torch.int32), bs, d ** -0.5, out, 32)
    best = {False: [], True: []}
    for rnd in range(11):
        for inv in ((False, True) if rnd % 2 == 0 else (True, False)):
            t = time.thread_time(); ext.paged_forward(*args, row_invariant=inv); best[inv].append(time.thread_time() - t)
    a, b = min(best[False]) * 1e3, min(best[True]) * 1e3
    res[f"{n} queries over {ctx} cached"] = {"gemm_ms": round(a, 3), "row_invariant_ms": round(b, 3), "ratio": round(b / a, 2)}
    print(n, ctx, res[f"{n} queries over {ctx} cached"], flush=True)
print(json.dumps({"threads": torch.get_num_threads(), "load": os.getloadavg(), "results": res}))
