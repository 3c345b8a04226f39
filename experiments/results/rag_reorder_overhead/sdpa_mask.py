"""SDPA at a rag_reorder prefill's shape (SmolLM2: 9 query heads, 3 KV heads, head_dim 64), bf16 on CPU:
a cold prefill (q = kv = 1500, is_causal, no mask) vs a prefill after a 40-token cache (q = 1460, kv = 1500, the
bottom-right causal mask HF builds as a boolean tensor)."""
import sys, time, torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
dt = torch.bfloat16
kv, head = 1500, 40
q = torch.randn(1, 9, kv, 64, dtype=dt); k = torch.randn(1, 9, kv, 64, dtype=dt); v = torch.randn(1, 9, kv, 64, dtype=dt)
qs = q[:, :, head:].contiguous()
mask = torch.ones(kv - head, kv, dtype=torch.bool).tril(diagonal=head)[None, None]
def cold(): F.scaled_dot_product_attention(q, k, v, is_causal=True)
def warm(): F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
for f in (cold, warm): f()
tc, tw = [], []
for _ in range(15):
    t = time.perf_counter(); cold(); tc.append(time.perf_counter() - t)
    t = time.perf_counter(); warm(); tw.append(time.perf_counter() - t)
tc.sort(); tw.sort()
c, w = tc[len(tc)//2]*1e3, tw[len(tw)//2]*1e3
print(f"sdpa per layer: cold is_causal {c:.1f} ms, after a {head}-token cache with a bool mask {w:.1f} ms ({w/c:.2f}x); x30 layers: {30*c:.0f} vs {30*w:.0f} ms")
