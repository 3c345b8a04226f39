"""How well the bundled SmolLM2 answers the ``rag_reorder`` queries, with plain transformers (no kvboost engine).

Prompts are tokenized segment-wise exactly like kvboost's ``separator`` chunker (each piece between separators
and each separator on its own, ``add_special_tokens=False``), prefilled in one forward with a ``DynamicCache``,
then decoded greedily for ``--max-new-tokens`` tokens and scored with ``rag_corpus.is_correct``. Also recorded:
the teacher-forced log-probability of the answer (`` 4817``, the tokens the answer continues the prefilled answer
start with) and the distribution of the first generated token.

Modes (``--modes``, comma-separated):

- ``full``: plain full prefill (the reference).
- ``no_docs``: the same question without the documents: accuracy must be ~0 (the answer comes from the context).
- ``standalone``: a cheap simulation of content reuse without repair: every document's KV computed alone from
  position 0 (no history, computed once per document and reused across queries), its keys re-rotated to the
  document's prompt position (``k' = k cos(d theta) + rotate_half(k) sin(d theta)``, ``theta = inv_freq``); the
  text before the first document computed exactly; only the separators and the text after the last document
  prefilled on top (each separator after the KV before it). Compared against ``full`` per query: first-token
  KL(full || standalone), the KL at the answer's second token (the first digit: the answer `` 4817`` starts with
  a lone space token, so the first-token KL says little), greedy match of the outputs, and the answer log-prob
  drop.
- ``prefixed``: the same, except that every document's KV is computed after the text all prompts share before
  their first document (system prompt and chat-template head, then a separator) and only the document's rows are
  kept: the reused rows no longer carry the attention sinks a document computed from position 0 grows on its
  own first tokens (the shared-prefix idea of APE, Yang et al., ICLR 2025). Compared with ``full`` the same way.

Example (about 4 minutes for full on 2 CPU cores)::

    python -m experiments.checks.rag_layout_check --num-queries 60 --modes full,no_docs
    python -m experiments.checks.rag_layout_check --num-queries 60 --modes full,standalone --out /tmp/reuse.json

Writes a JSON (default ``experiments/results/rag_layout/baseline_accuracy.json``) with the command, the
configuration, per mode the accuracy / mean answer log-prob / accuracy by target position / seconds, and per query
the prompt length and each mode's output, correctness and answer log-prob.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvboost.lab import rag_corpus
from kvboost.runtime.hf_generic import cache_kwarg  # past_key_values before transformers 5.24, cache after

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "rag_layout" / "baseline_accuracy.json"


def load_model() -> tuple[Any, Any, str]:
    """The bundled SmolLM2 (fp32, CPU); falls back to the converted folder if kvboost cannot be imported."""
    try:
        from kvboost.models.loading import load_model_and_tokenizer

        model, tok, path = load_model_and_tokenizer(None, dtype="float32")
    except Exception as exc:  # kvboost mid-edit: load the converted folder directly
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folders = sorted((Path.home() / ".cache" / "kvboost" / "models").glob("SmolLM2-135M-Instruct-*/config.json"))
        if not folders:
            raise RuntimeError(f"kvboost import failed ({exc}) and no converted model folder found") from exc
        path = str(folders[-1].parent)
        print(f"kvboost import failed ({exc!r}); loading {path} directly", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tok, path


def segment_ids(tokenizer: Any, text: str, separator: str) -> list[list[int]]:
    """The separator chunker's tokenization, kept per segment: ``[piece_0, sep, piece_1, sep, ...]`` (empty
    pieces are dropped, their separators kept). Concatenated, these are the prompt ids."""
    parts: list[str] = []
    for i, piece in enumerate(text.split(separator)):
        if i:
            parts.append(separator)
        if piece:
            parts.append(piece)
    return [ids for ids in tokenizer(parts, add_special_tokens=False)["input_ids"] if ids]


def new_cache(model: Any):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def forward(model: Any, ids: list[int], cache: Any) -> torch.Tensor:
    """Append ``ids`` to ``cache`` (positions continue after it); the logits of the last token, fp32."""
    out = model(input_ids=torch.tensor([ids]), **{cache_kwarg(model.forward): cache}, use_cache=True)
    return out.logits[0, -1].float()


@torch.no_grad()
def score_and_decode(model: Any, tok: Any, cache: Any, last_logits: torch.Tensor, answer_ids: list[int],
                     max_new_tokens: int) -> dict[str, Any]:
    """Teacher-forced log-prob of ``answer_ids`` after the prompt, then greedy decoding (the cache is cropped
    back to the prompt in between)."""
    prompt_len = cache.get_seq_length()
    logp0 = torch.log_softmax(last_logits, -1)
    lp = float(logp0[answer_ids[0]])
    second = None
    if len(answer_ids) > 1:
        out = model(input_ids=torch.tensor([answer_ids[:-1]]), **{cache_kwarg(model.forward): cache}, use_cache=True)
        logps = torch.log_softmax(out.logits[0].float(), -1)
        lp += float(sum(logps[i, answer_ids[i + 1]] for i in range(len(answer_ids) - 1)))
        second = logps[0]
        cache.crop(-(len(answer_ids) - 1))
        assert cache.get_seq_length() == prompt_len
    generated: list[int] = []
    logits = last_logits
    eos = {tok.eos_token_id} | ({tok.convert_tokens_to_ids("<|im_end|>")} if "<|im_end|>" in tok.get_vocab() else set())
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax())
        generated.append(nxt)
        if nxt in eos:
            break
        logits = forward(model, [nxt], cache)
    return {"answer_logprob": lp, "output_ids": generated,
            "output": tok.decode(generated, skip_special_tokens=True), "first_logp": logp0, "second_logp": second}


# ---------------------------------------------------------------------------------- standalone (reuse) mode
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move keys ``[batch, heads, seq, head_dim]`` computed at positions p to p + delta (HF rotate_half layout)."""
    if delta == 0:
        return keys
    angles = (delta * inv_freq.double()).float()  # [head_dim / 2]
    emb = torch.cat((angles, angles))
    return (keys.float() * emb.cos() + rotate_half(keys.float()) * emb.sin()).to(keys.dtype)


class StandaloneKV:
    """Each document's KV computed alone (no history), cached per token sequence.

    ``prefix`` (token ids) empty: the document at positions 0..n-1. Otherwise the document is computed after
    ``prefix`` (the text every prompt shares before its first document: system prompt and chat-template head)
    and only its own rows are kept, at positions len(prefix).. (the ``prefixed`` mode): its first tokens then do
    not become attention sinks of their own, as they are not in a full prefill.
    """

    def __init__(self, model: Any, prefix: list[int] | None = None) -> None:
        self.model = model
        self.prefix = list(prefix or [])
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().float()
        self._kv: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @torch.no_grad()
    def get(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = tuple(ids)
        if key not in self._kv:
            cache = new_cache(self.model)
            self.model(input_ids=torch.tensor([self.prefix + ids]), **{cache_kwarg(self.model.forward): cache}, use_cache=True)
            n = len(self.prefix)
            self._kv[key] = [(layer.keys[:, :, n:].clone(), layer.values[:, :, n:].clone()) for layer in cache.layers]
        return self._kv[key]

    @torch.no_grad()
    def prefill(self, segments: list[list[int]], doc_segments: set[int]) -> tuple[Any, torch.Tensor]:
        """The prompt cache with ``doc_segments`` (segment indices) reused standalone; everything else computed
        in order on top of what precedes it. Returns the cache and the last token's logits."""
        cache = new_cache(self.model)
        pending: list[int] = []
        logits = None
        for i, seg in enumerate(segments):
            if i in doc_segments:
                if pending:
                    logits = forward(self.model, pending, cache)
                    pending = []
                start = cache.get_seq_length()
                for layer_idx, (k, v) in enumerate(self.get(seg)):
                    cache.update(rerotate(k, start - len(self.prefix), self.inv_freq), v, layer_idx)
            else:
                pending.extend(seg)
        if not pending:
            raise ValueError("the prompt must end with text after the last document")
        logits = forward(self.model, pending, cache)
        return cache, logits


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-documents", type=int, default=24)
    parser.add_argument("--num-queries", type=int, default=60)
    parser.add_argument("--docs-per-query", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=280)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--separator", default=rag_corpus.DEFAULT_SEPARATOR)
    parser.add_argument("--system-prompt", default=rag_corpus.DEFAULT_SYSTEM_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--modes", default="full,no_docs",
                        help="comma-separated: full, no_docs, standalone, prefixed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--show-prompt", action="store_true", help="print the first rendered prompt")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"full", "no_docs", "standalone", "prefixed"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    from experiments.common import set_threads

    set_threads(args.threads)

    model, tok, model_path = load_model()

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    t0 = time.perf_counter()
    docs = rag_corpus.build_corpus(num_documents=args.num_documents, seed=args.seed, doc_tokens=args.doc_tokens,
                                   count_tokens=count)
    queries = rag_corpus.build_queries(docs, num_queries=args.num_queries, docs_per_query=args.docs_per_query,
                                       seed=args.seed)
    build_s = time.perf_counter() - t0
    by_id = {d.doc_id: d for d in docs}
    standalone = StandaloneKV(model) if "standalone" in modes else None
    prefixed: StandaloneKV | None = None  # built from the first prompt's shared head (below)
    sep = args.separator

    per_mode_s = {m: 0.0 for m in modes}
    rows = []
    for qi, q in enumerate(queries):
        answer_ids = tok(" " + q.answer, add_special_tokens=False)["input_ids"]
        text = rag_corpus.render_prompt(tok, q, by_id, separator=sep, system_prompt=args.system_prompt)
        if args.show_prompt and qi == 0:
            print(text)
        segs = segment_ids(tok, text, sep)
        target = by_id[q.target_doc]
        row: dict[str, Any] = {
            "query_id": q.query_id, "target_position": q.target_position, "answer": q.answer,
            "prompt_tokens": sum(map(len, segs)),
            # other documents of the query whose fact has the target's relation (only the subject differs)
            "same_relation_distractors": sum(by_id[d].relation == target.relation for d in q.doc_ids) - 1,
        }  # fmt: skip
        results: dict[str, dict[str, Any]] = {}
        for mode in modes:
            t = time.perf_counter()
            if mode == "full":
                cache = new_cache(model)
                logits = forward(model, [i for s in segs for i in s], cache)
            elif mode == "no_docs":
                nd_text = rag_corpus.render_prompt(tok, q, by_id, separator=sep, system_prompt=args.system_prompt,
                                                   include_documents=False)
                nd_ids = [i for s in segment_ids(tok, nd_text, sep) for i in s]
                row["no_docs_prompt_tokens"] = len(nd_ids)
                cache = new_cache(model)
                logits = forward(model, nd_ids, cache)
            else:
                store = standalone
                if mode == "prefixed":
                    if prefixed is None:  # the text before the question: system prompt + template head
                        head = text[: text.index(q.question)]
                        prefixed = StandaloneKV(model, [i for s in segment_ids(tok, head + sep, sep) for i in s])
                        row["prefixed_prefix_tokens"] = len(prefixed.prefix)
                    store = prefixed
                pieces = [p for p in text.split(sep)]
                # segment index of each non-empty piece / separator, as segment_ids lays them out
                doc_texts = {by_id[d].text for d in q.doc_ids}
                seg_index, doc_segs = 0, set()
                for i, piece in enumerate(pieces):
                    if i:
                        seg_index += 1  # the separator
                    if piece:
                        if piece in doc_texts:
                            doc_segs.add(seg_index)
                        seg_index += 1
                cache, logits = store.prefill(segs, doc_segs)
            res = score_and_decode(model, tok, cache, logits, answer_ids, args.max_new_tokens)
            per_mode_s[mode] += time.perf_counter() - t
            res["correct"] = rag_corpus.is_correct(res["output"], q.answer)
            results[mode] = res
            row[mode] = {"correct": res["correct"], "output": res["output"],
                         "answer_logprob": round(res["answer_logprob"], 4)}
        for reused in ("standalone", "prefixed"):
            if "full" not in results or reused not in results:
                continue
            p, s = results["full"]["first_logp"], results[reused]["first_logp"]
            row[reused]["first_token_kl"] = round(float((p.exp() * (p - s)).sum()), 6)
            p, s = results["full"]["second_logp"], results[reused]["second_logp"]
            if p is not None:  # the answer's second token (its first digit, after the space), teacher-forced
                row[reused]["answer_token2_kl"] = round(float((p.exp() * (p - s)).sum()), 6)
            row[reused]["greedy_match"] = results["full"]["output_ids"] == results[reused]["output_ids"]
        rows.append(row)
        status = " ".join(f"{m}={'Y' if row[m]['correct'] else 'n'}({row[m]['answer_logprob']:.2f})" for m in modes)
        print(f"[{qi + 1}/{len(queries)}] {q.query_id} pos={q.target_position} tokens={row['prompt_tokens']} "
              f"{status} | {results[modes[0]]['output']!r}", flush=True)

    n = len(rows)
    summary: dict[str, Any] = {}
    for mode in modes:
        acc = sum(r[mode]["correct"] for r in rows) / n if n else math.nan
        by_pos: dict[int, list[bool]] = {}
        by_rel: dict[int, list[bool]] = {}
        for r in rows:
            by_pos.setdefault(r["target_position"], []).append(r[mode]["correct"])
            by_rel.setdefault(r["same_relation_distractors"], []).append(r[mode]["correct"])
        summary[mode] = {
            "accuracy": round(acc, 4),
            "n": n,
            "mean_answer_logprob": round(sum(r[mode]["answer_logprob"] for r in rows) / n, 4) if n else None,
            "accuracy_by_target_position": {str(k): round(sum(v) / len(v), 3) for k, v in sorted(by_pos.items())},
            "accuracy_by_same_relation_distractors": {
                str(k): {"n": len(v), "accuracy": round(sum(v) / len(v), 3)} for k, v in sorted(by_rel.items())},
            "seconds": round(per_mode_s[mode], 1),
        }
        if mode in ("standalone", "prefixed") and "full" in modes and n:
            summary[mode]["mean_first_token_kl_vs_full"] = round(sum(r[mode]["first_token_kl"] for r in rows) / n, 6)
            kl2 = [r[mode]["answer_token2_kl"] for r in rows if "answer_token2_kl" in r[mode]]
            if kl2:
                summary[mode]["mean_answer_token2_kl_vs_full"] = round(sum(kl2) / len(kl2), 6)
            summary[mode]["greedy_match_vs_full"] = round(sum(r[mode]["greedy_match"] for r in rows) / n, 4)
            summary[mode]["mean_answer_logprob_drop_vs_full"] = round(
                sum(r["full"]["answer_logprob"] - r[mode]["answer_logprob"] for r in rows) / n, 4)
    cli = sys.argv[1:] if argv is None else argv
    report = {
        "command": "python -m experiments.checks.rag_layout_check " + " ".join(map(shlex.quote, cli)),
        "model": model_path,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "accuracy": summary.get("full", summary[modes[0]])["accuracy"],
        "n": n,
        "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in rows) / n, 1) if n else None,
        "corpus_build_seconds": round(build_s, 3),
        "modes": summary,
        "queries": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "queries"}, indent=1))
    return report


if __name__ == "__main__":
    main()
