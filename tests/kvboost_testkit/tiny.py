"""Tiny random decoder-only models built from configs in code, and a toy tokenizer (no network, no files)."""

from __future__ import annotations

import torch

VOCAB = 128


class ToyTokenizer:
    """Characters -> ids (enough for engines on tiny random models; no network, no files)."""

    eos_token_id = None
    pad_token_id = 0

    def __call__(self, text, add_special_tokens: bool = False):
        if isinstance(text, list):  # batched, like HF tokenizers
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    def __len__(self) -> int:
        return VOCAB

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )
        return self(text)["input_ids"] if tokenize else text

    def decode(self, ids, skip_special_tokens=True):
        # The inverse of __call__ on printable ASCII (ids 35..127 <- chars 32..124); other ids print as "?".
        return "".join(chr(i - 3) if 35 <= i < VOCAB else "?" for i in ids)


ARCHS = ("llama", "qwen2", "mistral", "phi3", "gemma")


def tiny_config(arch: str, **overrides):
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "phi3":
        return Phi3Config(**common, sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gemma":
        return GemmaConfig(**{**common, "head_dim": 16}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation="sdpa")
    return model.float().eval()


def make_engine(arch: str = "llama", *, layers: int | None = None, **options):
    """An engine on a tiny random model (``layers`` overrides the architecture's layer count)."""
    from kvboost import KVBoost

    options.setdefault("chunker", {"name": "fixed", "chunk_size": 16})
    model = tiny_model(arch, **({"num_hidden_layers": layers} if layers else {}))
    return KVBoost(model, ToyTokenizer(), model_identity=f"tiny-{arch}", **options)


def random_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def hf_greedy_reference(model, prompt: list[int], steps: int):
    """HF's own decode of ``steps`` greedy tokens after ``prompt`` on the model's device: (the tokens fed, fp32
    logits per step, the final DynamicCache)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        fed, logits = [], []
        for _ in range(steps):
            fed.append(token)
            ids = torch.tensor([[token]], device=device)
            step = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            logits.append(step.float())
            token = int(step.argmax())
    return fed, logits, cache


GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}  # fmt: skip


def write_gguf(model, path, arch: str, types: dict | None = None) -> None:
    """Write ``model``'s linears into a GGUF (rows as llama.cpp stores them: q/k permuted for llama), each in
    ``types[gguf name]`` (default Q4_1), and set the model's weights to what transformers would load from it."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from kvboost.models.gguf_weights import llama_row_order

    types = types or {}
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    names = {f"blk.{i}.{k}.weight": f"model.layers.{i}.{v}" for i in range(cfg.num_hidden_layers)
             for k, v in GGUF_LINEARS.items()}  # fmt: skip
    names["output.weight"] = "lm_head"
    for gguf_name, hf_name in names.items():
        linear = model.get_submodule(hf_name)
        w = linear.weight.detach().float().numpy()
        order = None
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = cfg.num_attention_heads if ".attn_q." in gguf_name else cfg.num_key_value_heads
            order = llama_row_order(w.shape[0], heads)
            stored = np.empty_like(w)
            stored[order] = w  # llama.cpp's permutation: HF row r is stored at row order[r]
            w = stored
        kind = types.get(gguf_name, T.Q4_1)
        raw = quantize(w, kind)
        writer.add_tensor(gguf_name, raw, raw_dtype=kind)
        loaded = dequantize(raw, kind)
        if order is not None:
            loaded = loaded[order]  # transformers' reverse permutation
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(loaded)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
