"""Method policies driven by the real QuestionLoop over a scripted engine (CPU, no model).

The scripted engine answers each prompt from a "world": after the last "Answer:" of the prompt it finds how much
of the scripted answer the prompt already holds and generates the rest, token by token, with the probabilities
and entropies the script gives each piece. Expected triggers, queries and prompts are derived by hand from the
script in each test, never from the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from fastrag.config import ConfigError, method_config
from fastrag.engine import Generation
from fastrag.loop import QuestionLoop, SyncEngineBase
from fastrag.retrieval.base import Doc


@dataclass
class Ex:
    qid: str
    question: str
    answers: list = field(default_factory=lambda: ["Lyon"])


@pytest.fixture(scope="module")
def tok():
    from fastrag.model.loading import load_tokenizer

    return load_tokenizer("smollm2")


@dataclass
class Seq:
    tokens: list = field(default_factory=list)
    out: Generation | None = None


def scripted(tok, pieces, n):
    """(ids, p, H, ended by EOS) of the first n tokens of a script's pieces (each piece's p and H on its tokens)."""
    gen, p, h = [], [], []
    eos = False
    for piece in pieces:
        if piece is None:
            eos = True
            break
        t, prob, ent = piece
        pid = tok.encode(t)
        gen += pid
        p += [prob] * len(pid)
        h += [ent] * len(pid)
    return gen[:n], p[:n], h[:n], eos and len(gen) <= n


class ScriptEngine(SyncEngineBase):
    """Generations from `world(prompt) -> [(text piece, p, H), ...]` (None ends with EOS); LCP accounting as the
    real engine does it (a restarted sequence prefills only what differs from its own cached tokens, >= 1)."""

    def __init__(self, tok, world, steps=1):
        self.tok, self.world = tok, world
        self.waiting, self.running, self.prompts, self._q = [], [], [], []
        self.attn_calls, self.tracked = [], []

    def new_sequence(self):
        return Seq()

    def release(self, s):
        pass

    def start(self, s, ids, n, track_from=None, stop_ids=None, hidden_layer=None, **sampling):
        prompt = self.tok.decode(ids)
        self.prompts.append((prompt, n))
        if hidden_layer is not None:  # a hidden-state feed (seakr): no text, a vector of the last tokens' ids
            s.tokens = list(ids)
            s.out = Generation(ids=[], entropy=[], logprob=[], prompt_tokens=len(ids), prefilled=1,
                               hidden=torch.tensor([float(t) for t in ids[-4:]]))
            self._q.append(s)
            return
        gen, p, h, eos = scripted(self.tok, self.world(prompt), n)
        if stop_ids:  # (a stop token is kept and ends the generation)
            cut = next((i + 1 for i, t in enumerate(gen) if t in stop_ids), len(gen))
            gen, p, h, eos = gen[:cut], p[:cut], h[:cut], eos and cut == len(gen)
        lcp = 0
        while lcp < min(len(s.tokens), len(ids) - 1) and s.tokens[lcp] == ids[lcp]:
            lcp += 1
        s.tokens = list(ids) + gen
        s.out = Generation(ids=gen, entropy=h, logprob=[math.log(x) for x in p], prompt_tokens=len(ids),
                           prefilled=len(ids) - lcp, ended_by_eos=eos)
        if track_from is not None:  # uniform in-context attention over the tracked span (suffix + new tokens)
            self.tracked.append(len(ids) - track_from)
            s.out.attn = [1.0] * (len(ids) - track_from + len(gen))
        self._q.append(s)

    @property
    def has_work(self):
        return bool(self._q)

    def step(self):
        done, self._q = self._q, []
        return done

    def attention_passes(self, seqs, kind):
        self.attn_calls.append((kind, [len(x) for x in seqs]))
        if kind == "colmax":
            return [[1.0] * len(x) for x in seqs]
        return [torch.full((len(x), len(x)), 1.0 / len(x), dtype=torch.float64) for x in seqs]


class Retriever:
    def __init__(self, n=None):
        self.queries, self.n = [], n

    def search(self, queries, k):
        self.queries += queries
        n = k if self.n is None else self.n
        return [[Doc(id=f"{q[:12]}#{i}", title="", text=f"doc {i} about {q}") for i in range(n)] for q in queries]


def listed(query, n=3):
    """The passages Retriever finds for `query` as a prompt's context lists them ("[1] ...\n" each)."""
    return "".join(f"[{i + 1}] doc {i} about {query}\n" for i in range(n))


def continuation(prompt, pieces):
    """The script after what the prompt already holds past its last 'Answer:' (a piece may be cut part-way)."""
    tail = prompt[prompt.rindex("Answer:") + len("Answer:"):]
    pos = 0
    for i, piece in enumerate(pieces):
        if piece is None:
            break
        t = piece[0]
        if len(tail) < pos + len(t):
            assert t.startswith(tail[pos:]), f"the prompt holds text the script never produced: {tail!r}"
            rest = t[len(tail) - pos:]
            return ([(rest, *piece[1:])] if rest else []) + pieces[i + 1:]
        assert tail[pos:pos + len(t)] == t, f"the prompt holds text the script never produced: {tail!r}"
        pos += len(t)
    assert pos == len(tail), f"the prompt holds text the script never produced: {tail!r}"
    return [None]


def run(method, tok, world, ret=None, **over):
    cfg = method_config(method, "2wikimultihopqa", overrides={"fewshot": 0, **over})
    from fastrag.methods.registry import get_method

    policy = get_method(method).make_policy(cfg, tok)
    eng, ret = ScriptEngine(tok, world), ret or Retriever()
    out = []
    QuestionLoop(eng, ret, policy, max_inflight=4).run([Ex("1", "Where is Paris?")], out.append)
    assert len(out) == 1
    return out[0], eng, ret


HIGH, LOW = 0.95, 0.3
ANSWER = [(" Paris", HIGH, 0.1), (" is in France.", HIGH, 0.1), (" So the answer is France.", HIGH, 0.1), None]


# ---------------------------------------------------------------------------------------------- baselines


def test_wo_rag_one_generation_no_retrieval(tok):
    r, eng, ret = run("wo-rag", tok, lambda p: continuation(p, ANSWER))
    assert r.error is None and ret.queries == []
    assert len(eng.prompts) == 1 and r.text == "Paris is in France. So the answer is France."
    assert r.prediction == r.text  # "the answer is" present: no extra answer generation
    assert len(r.rounds) == 1 and r.retrievals == 0  # one round, without a query


def test_sr_rag_retrieves_once_with_the_question(tok):
    r, eng, ret = run("sr-rag", tok, lambda p: continuation(p, ANSWER))
    assert ret.queries == ["Where is Paris?"]
    assert eng.prompts[0][0].startswith("Context:\n[1] doc 0 about Where is Paris?\n")
    assert "Answer in the same format as before.\nQuestion: Where is Paris?\nAnswer:" in eng.prompts[0][0]
    _, _, ret = run("sr-rag", tok, lambda p: continuation(p, ANSWER), max_query_tokens=3)
    assert ret.queries == ["is Paris?"]  # the question's last 3 tokens: " is", " Paris", "?"


def test_fl_rag_retrieves_every_n_tokens_with_the_last_chunk(tok):
    pieces = [(" Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu.", HIGH, 0.1),
              (" So the answer is Lyon.", HIGH, 0.1), None]
    n = 5
    r, eng, ret = run("fl-rag", tok, lambda p: continuation(p, pieces), fix_length=n)
    full = tok.encode("".join(p[0] for p in pieces[:-1]))
    chunks = [tok.decode(full[i:i + n]).strip() for i in range(0, len(full), n)]
    assert ret.queries == ["Where is Paris?"] + chunks[:-1]
    assert all(m == n for _, m in eng.prompts)  # every generation is one chunk of n tokens
    assert r.text == " ".join(chunks)
    assert r.retrievals == len(chunks)


def test_fl_rag_stops_once_the_answer_is_longer_than_l_tokens(tok):
    """No "the answer is" and no end: the whole answer's length stops FL-RAG, at the first chunk that takes it past
    L tokens (each chunk alone stays under L)."""
    pieces = [(" Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho.", HIGH, 0.1),
              None]
    n, limit = 5, 12

    def world(p):  # (then the evaluator's answer generation)
        return [(" rho.", HIGH, 0.1), None] if p.endswith(" So the answer is ") else continuation(p, pieces)

    r, _, _ = run("fl-rag", tok, world, fix_length=n, generate_max_length=limit)
    full = tok.encode(pieces[0][0])
    chunks = [tok.decode(full[i:i + n]).strip() for i in range(0, len(full), n)]
    m = next(m for m in range(1, len(chunks) + 1) if len(tok.encode(" ".join(chunks[:m]))) > limit)
    assert m < len(chunks) and r.retrievals == m and r.text == " ".join(chunks[:m])


def test_fs_rag_retrieves_every_sentence_with_the_last_sentence(tok):
    r, eng, ret = run("fs-rag", tok, lambda p: continuation(p, ANSWER))
    assert ret.queries == ["Where is Paris?", "Paris is in France."]
    assert r.text == "Paris is in France. So the answer is France."
    assert all(n == 64 for _, n in eng.prompts)  # L = 64 for 2Wiki, one sentence kept per generation


def test_fs_rag_stops_when_a_generation_has_no_sentence(tok):
    """A generation that ends at once keeps no sentence: FS-RAG answers with what it has instead of retrieving
    again with an empty query."""
    r, eng, ret = run("fs-rag", tok, lambda p: [None])
    assert r.error is None and ret.queries == ["Where is Paris?"]
    assert r.text == "" and r.retrievals == 1


def test_fl_rag_typo_switch(tok):
    r, eng, _ = run("fl-rag", tok, lambda p: continuation(p, ANSWER), flrag_typo=True)
    assert "Answer in t he same format as before.\n" in eng.prompts[0][0]


# ---------------------------------------------------------------------------------------------- token-rag


def test_token_rag_triggers_on_the_uncertain_sentence(tok):
    # sentence 1: 1 - p = 0.05 on every token (mean 0.05 <= 0.08); sentence 2: its " 9 million" tokens have
    # 1 - p = 0.7, which lifts the mean well above 0.08
    answer = [(" Paris is in France.", HIGH, 0.1), (" It", HIGH, 0.1), (" has", HIGH, 0.1),
              (" 9 million", LOW, 2.0), (" people.", HIGH, 0.1), None]
    after = [(" It has 2 million people. So the answer is France.", HIGH, 0.1), None]

    def world(p):
        return continuation(p, answer) if "Context:" not in p else \
            after

    r, eng, ret = run("token-rag", tok, world)
    # the query is the trigger sentence without its tokens of 1 - p > threshold (" 9 million")
    assert ret.queries == ["It has people."]
    assert r.rounds[0].trigger_sentence == "It has 9 million people."
    rag = [p for p, _ in eng.prompts if "Context:" in p]
    assert len(rag) == 1 and rag[0].endswith("Answer: Paris is in France.")  # kept text before the trigger
    assert r.text == "Paris is in France. It has 2 million people. So the answer is France."


def test_token_rag_scores_a_sentence_by_the_mean_uncertainty_of_its_tokens(tok):
    """One uncertain token (1 - p = 0.2) among ten at 0.05: the mean, (10 * 0.05 + 0.2) / 11 = 0.064, stays under
    2WikiMultihopQA's 0.08, so the default solver (avg) does not retrieve; with the solver max it does."""
    answer = [(" Paris is in the north of France and", 0.95, 0.1), (" old", 0.8, 0.1), (" today.", 0.95, 0.1),
              (" So the answer is France.", 0.95, 0.1), None]
    sure = [(t, 0.95, h) for t, _, h in answer[:-1]] + [None]

    def world(p):  # (with documents, every token is sure)
        return continuation(p, sure if "Context:" in p else answer)

    assert len(tok.encode(" Paris is in the north of France and old today.")) == 11
    r, _, ret = run("token-rag", tok, world)
    assert ret.queries == [] and r.text == "Paris is in the north of France and old today. So the answer is France."
    r, _, ret = run("token-rag", tok, world, sentence_solver="max")
    assert r.rounds[0].trigger_sentence == "Paris is in the north of France and old today." and ret.queries


def test_token_rag_whitespace_between_sentences_counts_with_the_earlier_one(tok):
    """A whitespace-only token between two sentences is scored with the sentence before it (the published code
    takes the token after a sentence's last one into its probabilities too). Here the newline (1 - p = 0.7) after
    five sure tokens lifts "Paris is in France." to (5 * 0.05 + 0.7) / 6 = 0.16 > 0.08; with the next sentence it
    would lift "It has 9 million people." instead. The query leaves the newline out (1 - p > threshold); the new
    prompt carries the documents under the instruction without the paper-era typo."""
    answer = [(" Paris is in France.", HIGH, 0.1), ("\n", LOW, 2.0), ("It has 9 million people.", HIGH, 0.1),
              (" So the answer is France.", HIGH, 0.1), None]
    after = [(" Paris is in France. So the answer is France.", HIGH, 0.1), None]
    assert len(tok.encode(" Paris is in France.")) == 5 and len(tok.encode("\n")) == 1

    r, eng, ret = run("token-rag", tok, lambda p: after if "Context:" in p else continuation(p, answer))
    assert r.rounds[0].trigger_sentence == "Paris is in France." and ret.queries == ["Paris is in France."]
    rag = [p for p, _ in eng.prompts if "Context:" in p]
    assert len(rag) == 1
    assert "Context:\n" + listed("Paris is in France.") + "Answer in the same format as before.\n" in rag[0]
    assert r.text == "Paris is in France. So the answer is France."


def test_the_stop_rule():
    """The published rule shared by FLARE, token-rag and the baselines: stop when the answer has more than L
    tokens, when a round added no text, or when it says "the answer is" (lowercase unless asked otherwise)."""
    from fastrag.methods.common import stop

    assert not stop("Paris is big.", 5, 64, 64) and stop("Paris is big.", 5, 65, 64)
    assert stop("Paris is big.", 13, 3, 64) and stop("Paris is big.", 20, 3, 64)  # no text added
    assert stop("So the answer is Paris.", 0, 3, 64)
    assert not stop("So The Answer Is Paris.", 0, 3, 64) and stop("So The Answer Is Paris.", 0, 3, 64, True)


def test_the_explicit_query_prompt():
    """FLARE's explicit queries ask for a question whose answer is the uncertain span (docs/methods.md); the engine
    and the oracle share this helper, so only a test of the text itself can tell it changed."""
    from fastrag.methods.flare import explicit_question_prompt

    assert explicit_question_prompt("Question: Where is Paris?\nAnswer:", "Paris is a city.", "It is in France.",
                                    "France") == ('Question: Where is Paris?\nAnswer: Paris is a city. It is in France.'
                                                  '\n\nAsk a question to which the answer is "France".\nQuestion:')


# ---------------------------------------------------------------------------------------------- FLARE


def test_flare_confident_sentences_never_retrieve_and_never_reprefill(tok):
    r, eng, ret = run("flare", tok, lambda p: continuation(p, ANSWER), retrieve_first=False, theta=0.8)
    assert ret.queries == [] and r.retrievals == 0
    assert r.text == "Paris is in France. So the answer is France."
    # every look-ahead after the first continues the previous prompt: the engine re-feeds one token only
    assert len(eng.prompts) >= 2
    assert r.counters["generate_calls"] == len(eng.prompts)
    first_prompt = len(tok.encode(eng.prompts[0][0]))
    assert r.prefill_tokens == first_prompt + (len(eng.prompts) - 1)


def test_flare_trigger_implicit_query_and_docs_persist(tok):
    answer = [(" Paris", LOW, 2.0), (" is in France.", HIGH, 0.1), (" So the answer is France.", HIGH, 0.1), None]
    rag = [(" Lyon", HIGH, 0.1), (" is in France.", HIGH, 0.1), (" So the answer is Lyon.", HIGH, 0.1), None]

    def world(p):
        return continuation(p, rag if "about is in France." in p else answer)

    r, eng, ret = run("flare", tok, world, theta=0.8, beta=0.4)
    # step 1 retrieves with the question; its docs are in the first look-ahead's prompt; " Paris" (p = 0.3 <= 0.8)
    # triggers; the implicit query drops it (0.3 <= beta)
    assert ret.queries[:2] == ["Where is Paris?", "is in France."]
    assert r.rounds[1].trigger_sentence == "Paris is in France."
    prompts = [p for p, _ in eng.prompts]
    assert "doc 0 about Where is Paris?" in prompts[0]
    # the rebuilt prompt replaces the documents; later look-aheads keep them (no new query)
    assert "doc 0 about is in France." in prompts[-1] and "about Where is Paris?" not in prompts[-1]
    assert r.text == "Lyon is in France. So the answer is Lyon."


@pytest.mark.parametrize("field_, value", [("theta", 1.5), ("beta", -0.1), ("look_ahead_tokens", 0),
                                           ("query_formulation", "magic"), ("retrieve_topk", 0)])
def test_flare_bad_values_name_the_field(field_, value):
    with pytest.raises(ConfigError, match=field_):
        method_config("flare", "hotpotqa", overrides={field_: value})


def test_flare_explicit_questions_interleaved_and_deduplicated(tok):
    answer = [(" Paris", LOW, 2.0), (" is in", HIGH, 0.1), (" France", LOW, 2.0), (".", HIGH, 0.1), None]
    rag = [(" So the answer is Lyon.", HIGH, 0.1), None]

    def world(p):
        if p.endswith("Question:"):  # question generation for a span
            span = p.rsplit('answer is "', 1)[1].split('"')[0]
            return [(f" What is {span}?\nMore", HIGH, 0.1), None]
        return continuation(p, rag if "Context:" in p else answer)

    class Overlap(Retriever):
        def search(self, queries, k):
            self.queries += queries
            return [[Doc(id=f"d{j}", title="", text=f"t{j}") for j in ([1, 2, 3] if "Paris" in q else [2, 4, 5])]
                    for q in queries]

    ret = Overlap()
    r, eng, _ = run("flare-explicit", tok, world, ret=ret, retrieve_first=False)
    assert ret.queries == ["What is Paris?", "What is France?"]
    assert r.rounds[0].query == "What is Paris? || What is France?"
    # round robin over ranks: d1 (q1), d2 (q2), d2 dropped (seen), d4 (q2) -> top 3
    assert r.rounds[0].doc_ids == ["d1", "d2", "d4"]


def test_flare_instruct_pauses_at_search_call(tok):
    answer = [(" The capital is [Search(capital of France)]", HIGH, 0.1), (" Paris.", HIGH, 0.1), None]
    after = [(" Paris. So the answer is Paris.", HIGH, 0.1), None]

    def world(p):
        if "Context:" in p:
            return after
        return continuation(p, answer)

    r, eng, ret = run("flare-instruct", tok, world)
    assert ret.queries == ["capital of France"]
    resumed = [p for p, _ in eng.prompts if "Context:" in p]
    assert resumed and resumed[0].endswith("Answer: The capital is [Search(capital of France)]")
    assert r.prediction == "The capital is Paris. So the answer is Paris."


@pytest.mark.parametrize("n_docs", [0, 1, 2])
def test_short_or_empty_retrieval_is_defined(tok, n_docs):
    """Fewer documents than the k = 3 asked for: every search counts as short, and the prompt lists those found."""
    answer = [(" Paris", LOW, 2.0), (" is in France.", HIGH, 0.1), (" So the answer is France.", HIGH, 0.1), None]
    for method in ("flare", "sr-rag", "fs-rag", "token-rag"):
        r, eng, ret = run(method, tok, lambda p: continuation(p, answer), ret=Retriever(n=n_docs))
        assert r.error is None, (method, r.error)
        assert r.counters["short_retrievals"] == r.counters["searches"] >= 1
        ctx = [p for p, _ in eng.prompts if "Context:" in p]
        if n_docs == 0:
            assert ctx == []  # no documents: the prompt carries no context block
        else:
            assert ctx and all(f"[{n_docs}] doc {n_docs - 1}" in p and f"[{n_docs + 1}]" not in p for p in ctx)


# ---------------------------------------------------------------------------------------------- DRAGIN streaming


@pytest.mark.parametrize("attention", ["in-context", "pass"])
def test_dragin_streaming_cuts_at_the_trigger_sentence(tok, attention):
    # uniform attention: a word's score is its entropy share; " Marseille" (H = 5) in sentence 2 hits (theta 0.6)
    answer = [(" Paris is in France.", HIGH, 0.05), (" Its mayor lives in", HIGH, 0.05), (" Marseille", LOW, 5.0),
              (" today.", HIGH, 0.05), (" More words that reference mode would decode anyway.", HIGH, 0.05), None]
    rag = [(" Paris is in France.", HIGH, 0.05), (" Its mayor lives in Paris.", HIGH, 0.05),
           (" Next sentence never kept.", HIGH, 0.05), None]
    final = [(" So the answer is France.", HIGH, 0.05), None]

    def world(p):
        if "Context:" in p:
            return continuation(p, rag)
        tail = p[p.rindex("Answer:") + 7:]
        if tail.startswith(" Paris is in France. Its mayor lives in Paris."):
            return continuation(p, [(" Paris is in France. Its mayor lives in Paris.", HIGH, 0.05)] + final)
        return continuation(p, answer)

    from fastrag.config import DraginStreamingConfig
    from fastrag.methods.dragin_streaming import DraginStreaming

    cfg = DraginStreamingConfig(dataset="2wikimultihopqa", generate_max_length=64, hallucination_threshold=0.6,
                                retrieve_keep_top_k=5, fewshot=0, mode="streaming", stream_chunk_tokens=4,
                                stream_attention=attention)
    eng, ret = ScriptEngine(tok, world), Retriever()
    out = []
    QuestionLoop(eng, ret, DraginStreaming(cfg, tok), max_inflight=2).run([Ex("1", "Where is Paris?")], out.append)
    r = out[0]
    assert r.error is None, r.error
    assert [x.trigger_sentence for x in r.rounds if x.query] == ["Its mayor lives in Marseille today."]
    assert r.text == "Paris is in France. Its mayor lives in Paris. So the answer is France."
    assert all(n <= 4 for _, n in eng.prompts)  # decoded in chunks of stream_chunk_tokens
    # nothing of the plain round after the trigger sentence's end was decoded beyond one chunk
    full = len(tok.encode("".join(x[0] for x in answer[:-1])))
    upto = len(tok.encode("".join(x[0] for x in answer[:4])))
    assert r.decode_tokens < full + len(tok.encode(rag[1][0])) + len(tok.encode(final[0][0])) + 8
    assert upto < full
    if attention == "in-context":  # a_i from the decode itself: no attention pass; each chunk resumes the span
        assert not any(kind == "colmax" for kind, _ in eng.attn_calls)
        assert eng.tracked[0] == 0 and any(n > 0 for n in eng.tracked)
    else:
        assert any(kind == "colmax" for kind, _ in eng.attn_calls) and not eng.tracked


# ---------------------------------------------------------------------------------------------- configs


def test_published_flare_config_is_token_rag(tmp_path):
    import json

    # oneal2000/DRAGIN config/Llama2-13b-chat/2WikiMultihopQA/FLARE.json (the paper's "FLARE" baseline)
    path = tmp_path / "FLARE.json"
    path.write_text(json.dumps({
        "model_name_or_path": "/x/llama2-13b-chat", "method": "token", "dataset": "2wikimultihop",
        "data_path": "../data/2wikimultihopqa", "generate_max_length": 64, "query_formulation": "direct",
        "output_dir": "../result/x", "retriever": "BM25", "retrieve_topk": 3, "hallucination_threshold": 0.08,
        "sentence_solver": "avg", "fewshot": 6, "sample": 1000, "shuffle": False, "es_index_name": "34216_wiki",
        "config_path": "../config/2wikimultihop/token.json", "use_counter": True}))
    cfg = method_config("token-rag", "2wikimultihopqa", path)
    assert (cfg.hallucination_threshold, cfg.sentence_solver, cfg.generate_max_length) == (0.08, "avg", 64)
    assert cfg.extra["model_name_or_path"] == "/x/llama2-13b-chat"
    with pytest.raises(ConfigError, match="token-rag"):
        method_config("flare", "2wikimultihopqa", path)
    path.write_text(json.dumps({"method": "attn_entropy", "hallucination_threshold": 1.2}))
    with pytest.raises(ConfigError, match=r"'attn_entropy', which is not wo-rag \(that is fastrag's --method dragin\)"):
        method_config("wo-rag", "hotpotqa", path)


@pytest.mark.parametrize("method, over, msg", [
    ("fl-rag", {"fix_length": "32"}, "fix_length must be an int"),
    ("fl-rag", {"fix_length": 0}, "fix_length must be an int >= 1"),
    ("token-rag", {"hallucination_threshold": 1.2}, "hallucination_threshold must be a number in"),
    ("token-rag", {"sentence_solver": "median"}, "sentence_solver must be one of 'avg', 'max', 'min', got 'median'"),
    ("flare", {"query_formulation": "real_words"}, "query_formulation must be one of 'implicit', 'explicit'"),
    ("flare", {"retrieve_first": 1}, "retrieve_first must be true or false, got 1"),
    ("flare", {"theta": True}, r"theta must be a number in \[0, 1\], got True"),
    ("wo-rag", {"fewshot": 99}, "fewshot is 99 but hotpotqa has only 8 exemplars"),
    ("sr-rag", {"generate_max_length": None}, "generate_max_length"),
    ("flare-instruct", {"max_searches": -1}, "max_searches"),
])
def test_bad_config_values_name_the_field(method, over, msg):
    with pytest.raises(ConfigError, match=msg):
        method_config(method, "hotpotqa", overrides=over)


@pytest.mark.parametrize("over, msg", [
    ({"stream_attention": "decode"}, "stream_attention must be one of 'in-context', 'pass', got 'decode'"),
    ({"stream_chunk_tokens": 0}, "stream_chunk_tokens"),
])
def test_bad_streaming_options_name_the_field(tmp_path, over, msg):
    import json

    from fastrag.methods.registry import get_method

    p = tmp_path / "DRAGIN.json"
    p.write_text(json.dumps({"method": "attn_entropy", "hallucination_threshold": 1.2, **over}))
    with pytest.raises(ConfigError, match=msg) as err:
        get_method("dragin-streaming").make_config("hotpotqa", str(p))
    assert str(err.value).startswith(f"{p}: ")  # the file is named, as for every other field of it
    ok = get_method("dragin-streaming").make_config("hotpotqa", None)
    assert ok.stream_attention == "in-context" and ok.stream_chunk_tokens == 16


@pytest.mark.parametrize("method", ["dragin", "dragin-streaming", "wo-rag", "token-rag", "flare", "beamsearchqa"])
def test_an_empty_config_path_is_refused(method):
    """`--config "$UNSET"` gives the path "": dragin ran the paper's defaults as if no file had been given (and
    the other methods said "'.': Is a directory")."""
    from fastrag.methods.registry import get_method

    with pytest.raises(ValueError, match="the config file's path is empty"):
        get_method(method).make_config("hotpotqa", "")


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        method_config("flare", "hotpotqa", tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{theta: 1")
    with pytest.raises(ConfigError, match="not valid JSON"):
        method_config("flare", "hotpotqa", bad)
    with pytest.raises(ConfigError, match="dataset"):
        method_config("flare", "squad/v2")  # (no dataset name: "squad" itself runs as generic QA)
    with pytest.raises(ConfigError, match="did you mean 'hotpotqa'"):
        method_config("flare", "hotpotq")


def test_paper_defaults_per_dataset():
    # FLARE paper: theta 0.8 (2Wiki) / 0.4 (StrategyQA), beta 0.4; published FL-RAG n: 16 (2Wiki) / 32
    assert (method_config("flare", "2wikimultihopqa").theta, method_config("flare", "strategyqa").theta) == (0.8, 0.4)
    assert method_config("flare", "hotpotqa").beta == 0.4
    assert method_config("flare-explicit", "hotpotqa").query_formulation == "explicit"
    assert method_config("fl-rag", "2wikimultihopqa").fix_length == 16
    assert method_config("fl-rag", "hotpotqa").fix_length == 32
    assert method_config("token-rag", "strategyqa").hallucination_threshold == 0.06
    assert method_config("wo-rag", "hotpotqa").generate_max_length == 100


def test_every_method_is_registered():
    from fastrag.methods.registry import available

    assert {"wo-rag", "sr-rag", "fl-rag", "fs-rag", "token-rag", "flare", "flare-explicit", "flare-instruct",
            "dragin-streaming", "dragin"} <= set(available())


def test_retrieval_wait_overlaps_the_other_questions_decoding(tok):
    """A slow search for one question: the other keeps decoding meanwhile; the waiting one resumes (rebuild) and
    finishes; its wait is counted."""
    import time

    slow = [(" Paris", LOW, 2.0), (" is in France.", HIGH, 0.1), (" So the answer is France.", HIGH, 0.1), None]
    fast = [(f" Step {i} is done.", HIGH, 0.1) for i in range(8)] + [(" So the answer is Lyon.", HIGH, 0.1), None]

    def world(p):
        return continuation(p, fast if "Question: Fast?" in p else slow)

    cfg = method_config("flare", "2wikimultihopqa", overrides={"fewshot": 0, "retrieve_first": False,
                                                                 "generate_max_length": 200})
    from fastrag.methods.flare import FlareDirect

    eng = ScriptEngine(tok, world)

    class Slow(Retriever):
        def search(self, queries, k):
            self.during = [len(eng.prompts)]
            time.sleep(0.5)
            self.during.append(len(eng.prompts))
            return super().search(queries, k)

    ret, out = Slow(), []
    QuestionLoop(eng, ret, FlareDirect(cfg, tok), max_inflight=2).run([Ex("s", "Slow?"), Ex("f", "Fast?")],
                                                                     out.append)
    by = {r.qid: r for r in out}
    assert by["s"].error is None and by["f"].error is None
    assert ret.during[1] > ret.during[0]  # generations were served while the search ran
    assert by["s"].counters["retrieval_wait_s"] >= 0.5 and by["s"].retrievals == 1
    assert by["f"].retrievals == 0 and by["f"].text.endswith("So the answer is Lyon.")
    assert by["s"].text == "Paris is in France. So the answer is France."


def test_flare_instruct_stop_rule_reads_the_text_without_its_calls(tok):
    """A call whose query holds "the answer is" does not end the question before the documents are used."""
    answer = [(" Paris is big. [Search(what the answer is)]", HIGH, 0.1), None]
    after = [(" It lies in France. So the answer is France.", HIGH, 0.1), None]

    def world(p):
        return after if "Context:" in p else continuation(p, answer)

    r, eng, ret = run("flare-instruct", tok, world)
    assert ret.queries == ["what the answer is"]
    assert [p for p, _ in eng.prompts if "Context:" in p], "the served search's documents were never used"
    assert r.prediction.endswith("So the answer is France.")


@pytest.mark.parametrize("blank", ["\n\n\n", "\n", " "])
def test_dragin_blank_generation_has_no_trigger(tok, blank):
    """A round whose text is blank has no sentence: no trigger, no retrieval (the oracle's rule), not an error."""
    import dataclasses

    from fastrag.config import dragin_config
    from fastrag.methods.dragin import DraginReference

    cfg = dataclasses.replace(dragin_config("2wikimultihopqa"), generate_max_length=24, fewshot=0,
                              hallucination_threshold=0.0)
    eng, ret = ScriptEngine(tok, lambda p: [(blank, 0.5, 5.0), None]), Retriever()
    out = []
    QuestionLoop(eng, ret, DraginReference(cfg, tok), max_inflight=2).run([Ex("1", "Where is Paris?")], out.append)
    assert out[0].error is None, out[0].error
    assert ret.queries == []


def test_oracle_rind_with_zero_attention_finds_no_hit():
    from fastrag.oracle.decisions import rind_trigger

    assert rind_trigger([0.0, 0.0, 0.0], [5.0, 5.0, 5.0], [(0, 3)], 0.5) is None
    assert rind_trigger([0.0, 0.0, 1.0], [5.0, 5.0, 5.0], [(0, 3)], 0.5).raw_hits == [False, False, True]


# SmolLM2 has tokens that end one sentence and open the next: spaCy splits '... France).__ So ...' after ")." and
# makes the "__" a sentence of its own, so the token ").__" starts in s^ and ends in the second sentence.
SPANNING = ").__"
REST = " So the answer is France."


@pytest.mark.parametrize("head", [" Paris is in France", ""])
def test_flare_look_ahead_keeps_the_token_that_ends_its_sentence(tok, head):
    """s^'s confidence test sees the token holding its last character, even when that token runs into the next
    sentence; a look-ahead that opens with such a token has one token in s^, not none (it never retrieved)."""
    assert len(tok.encode(SPANNING)) == 1, "the tokenizer no longer has the spanning token this test needs"
    pieces = ([(head, HIGH, 0.1)] if head else []) + [(SPANNING, LOW, 2.0), (REST, HIGH, 0.1), None]

    def world(p):  # the first look-ahead (also after a retrieval), then the conclusion
        tail = p[p.rindex("Answer:") + len("Answer:"):]
        if not tail.strip():
            return pieces
        return [None] if "answer is" in tail else [(REST, HIGH, 0.1), None]

    r, eng, ret = run("flare", tok, world, retrieve_first=False, theta=0.8, beta=0.4)
    assert r.error is None, r.error
    assert r.rounds[0].trigger_sentence == (head + ").").strip()
    # implicit query: s^ without its tokens of p <= beta; nothing left with no head: an empty query, no search
    if head:
        assert ret.queries[0] == head.strip() and r.rounds[0].query == head.strip()
    else:
        assert r.rounds[0].query is None and ret.queries == []


@pytest.mark.parametrize("head", [" Paris is in France", ""])
def test_flare_oracle_look_ahead_keeps_the_token_that_ends_its_sentence(tok, head):
    from fastrag.oracle.flare import FlareOracle

    oracle = FlareOracle.__new__(FlareOracle)
    oracle.tokenizer = tok
    ids = tok.encode(head) + tok.encode(SPANNING) + tok.encode(REST)
    sent, n = oracle.first_sentence_tokens(ids)
    assert sent == (head + ").").strip() and n == len(tok.encode(head)) + 1


def test_flare_instruct_call_parsing():
    from fastrag.methods.flare import call_query, scan_calls, strip_search_calls

    t = "A [Search(capital of [Search(France)])] is B. [Search(river)] C [Search(open"
    calls, open_at = scan_calls(t)
    assert [t[a:b] for a, b in calls] == ["[Search(capital of [Search(France)])]", "[Search(river)]"]
    assert t[open_at:] == "[Search(open"
    assert call_query(t[calls[0][0]:calls[0][1]]) == "capital of France"
    assert strip_search_calls(t) == "A is B. C open"
    assert strip_search_calls("x )] y [Search(") == "x )] y"  # a lone ")]" may be text; a lone opener is not
    assert scan_calls("no call") == ([], -1)


def test_flare_instruct_nested_call_is_one_call(tok):
    answer = [(" The capital is [Search(capital of [Search(France)])]", HIGH, 0.1), (" Paris.", HIGH, 0.1), None]
    after = [(" Paris. So the answer is Paris.", HIGH, 0.1), None]

    def world(p):
        return after if "Context:" in p else continuation(p, answer)

    r, eng, ret = run("flare-instruct", tok, world)
    assert ret.queries == ["capital of France"]
    resumed = [p for p, _ in eng.prompts if "Context:" in p]
    assert resumed and resumed[0].endswith("Answer: The capital is [Search(capital of [Search(France)])]")
    assert r.prediction == "The capital is Paris. So the answer is Paris."


def test_flare_instruct_call_left_open_by_an_ended_generation_keeps_its_text(tok):
    """A look-ahead that ends (EOS) inside an unclosed call can never close it: the opener is dropped, the text
    after it kept (it used to be cut, and the question ended at the call)."""
    answer = [(" Paris is [Search(big. It lies in France. So the answer is France.", HIGH, 0.1), None]
    r, eng, ret = run("flare-instruct", tok, lambda p: continuation(p, answer))
    assert r.error is None, r.error
    assert ret.queries == []
    assert r.prediction == "Paris is big. It lies in France. So the answer is France."


def test_flare_instruct_call_cut_by_the_budget_is_written_whole_next(tok):
    head, call = " Paris is big.", " [Search(capital of France)]"
    n = len(tok.encode(head + " [Search(capital"))  # the budget ends inside the call
    assert len(tok.encode(call)) <= n
    answer = [(head, HIGH, 0.1), (call, HIGH, 0.1), (" It lies in France.", HIGH, 0.1),
              (" So the answer is France.", HIGH, 0.1), None]
    r, eng, ret = run("flare-instruct", tok, lambda p: continuation(p, answer), look_ahead_tokens=n)
    assert ret.queries == ["capital of France"]
    assert r.prediction == "Paris is big. It lies in France. So the answer is France."


def test_flare_whitespace_after_the_sentence_is_not_tested(tok):
    """s^'s tokens stop at its last character: a low-probability newline between two sentences is no trigger."""
    pieces = [(" Paris is in France.", HIGH, 0.1), ("\n", LOW, 2.0), (" So the answer is France.", HIGH, 0.1), None]
    r, eng, ret = run("flare", tok, lambda p: continuation(p, pieces), retrieve_first=False, theta=0.8)
    assert r.error is None and r.rounds[0].trigger_sentence is None, r.rounds
    assert "Paris is in France." not in ret.queries  # (the next look-ahead opens with the newline: it is tested there)


def test_flare_masked_runs_keep_the_pieces_apart(tok):
    """Each masked run becomes a space (published FLARE): " Hyp" + [masked "ocr"] + "ite" reads "Hyp ite", not the
    glued "Hypite" that BM25 would not match; engine and oracle alike; all masked: ""."""
    from fastrag.methods.flare import FlareDirect
    from fastrag.oracle.flare import FlareOracle

    cfg = method_config("flare", "2wikimultihopqa", overrides={"fewshot": 0, "beta": 0.4})
    ids = [tok.encode(x)[0] for x in (" Hyp", "ocr", "ite", " is", " big")]
    assert all(len(tok.encode(x)) == 1 for x in (" Hyp", "ocr", "ite", " is", " big"))
    p = [HIGH, LOW, HIGH, LOW, HIGH]
    oracle = FlareOracle.__new__(FlareOracle)
    oracle.tokenizer, oracle.config = tok, cfg
    policy = FlareDirect(cfg, tok)
    assert policy.implicit_query(ids, p) == oracle.implicit(ids, p) == "Hyp ite big"
    assert policy.implicit_query(ids, [LOW] * 5) == oracle.implicit(ids, [LOW] * 5) == ""


@pytest.mark.parametrize("formulation", ["implicit", "explicit"])
def test_flare_theta_and_beta_bounds_are_inclusive(tok, formulation):
    """A token at p = theta exactly triggers (the rule is p <= theta) and one at p = beta exactly is masked or, for
    explicit queries, joins a low span (p <= beta). The two tokens of " is in" have p = 0.25 (exact through
    exp(log p)), every other token more: with theta = beta = 0.25 they trigger, the implicit query is "Paris
    France." and the explicit one the question asked about "is in"; with theta = 0.2499 nothing triggers. Engine
    policy and oracle alike."""
    from fastrag.data.exemplars import demo_text
    from fastrag.oracle.flare import FlareOracle

    answer = [(" Paris", 0.5, 0.1), (" is in", 0.25, 0.1), (" France.", HIGH, 0.1),
              (" So the answer is France.", HIGH, 0.1), None]

    def world(prompt):
        if "Ask a question to which the answer is" in prompt:
            return [(' What does "is in" mean?', HIGH, 0.1), None] if prompt.endswith('"is in".\nQuestion:') else [None]
        return continuation(prompt, answer)

    for theta, query in ((0.25, "Paris France." if formulation == "implicit" else 'What does "is in" mean?'),
                         (0.2499, None)):
        over = {"fewshot": 0, "retrieve_first": False, "theta": theta, "beta": 0.25,
                "query_formulation": formulation}
        r, _, ret = run("flare", tok, world, **over)
        assert r.error is None, r.error
        assert r.rounds[0].query == query and ret.queries == ([query] if query else [])
        assert r.rounds[0].trigger_sentence == ("Paris is in France." if query else None)
        oracle = FlareOracle.__new__(FlareOracle)
        oracle.tokenizer, oracle.retriever = tok, Retriever()
        oracle.config = method_config("flare", "2wikimultihopqa", overrides=over)
        oracle.demos = demo_text("2wikimultihopqa", 0)
        oracle.generate = lambda prompt, n: scripted(tok, world(prompt), n)[:2]
        rec = oracle.run("1", "Where is Paris?", ["France"])
        assert [(x.trigger_sentence, x.query) for x in rec.rounds] == [(x.trigger_sentence, x.query) for x in r.rounds]
        assert oracle.retriever.queries == ret.queries
        assert rec.text == r.text == "Paris is in France. So the answer is France."


def test_dragin_qfs_hit_flags_line_up_with_the_written_words(tok):
    """A trigger sentence whose words end with an empty one (a newline's) writes only its non-empty words into the
    QFS text: the hit flags must line up with those (the hit on "Paris." landed on "is", and "Paris." became a
    query word). Engine policy and oracle alike."""
    from fastrag.config import dragin_config
    from fastrag.methods.common import join
    from fastrag.methods.dragin import DraginReference
    from fastrag.oracle.dragin import DraginOracle
    from fastrag.text.realwords import real_words

    import dataclasses

    cfg = dataclasses.replace(dragin_config("2wikimultihopqa"), fewshot=0, retrieve_keep_top_k=20)
    q, text, kept = "Where is the Louvre?", "The Louvre is a museum.", ""
    curr = ["So", "the", "answer", "is", "Paris.", ""]
    hits = [False, False, False, False, True, False]
    all_text = join(q, text, kept) + " " + " ".join(w for w in curr if w)
    policy = DraginReference(cfg, tok)
    ids = tok.encode(all_text)
    T = len(ids)
    rows = torch.tril(torch.ones(T, T, dtype=torch.float64))
    rows = rows / rows.sum(-1, keepdim=True)
    query = policy.qfs(all_text, ids, rows, curr, hits, real_words(all_text))
    assert "Paris" not in query and "Louvre" in query, query

    oracle = DraginOracle.__new__(DraginOracle)
    oracle.tokenizer, oracle.config = tok, cfg
    oracle.words = policy.words
    oracle.last_layer_attention = lambda x: rows[None].expand(2, -1, -1)
    oq = oracle.qfs(q, text, kept, curr, hits)
    assert "Paris" not in oq and "Louvre" in oq, oq


def _scripted_dragin_oracle(tok, policy, world):
    """The per-question DRAGIN oracle with `policy`'s config, its generations from `world` and a uniform
    last-layer attention (as ScriptEngine's)."""
    from fastrag.oracle.dragin import DraginOracle, Generation as OracleGeneration

    oracle = DraginOracle.__new__(DraginOracle)
    oracle.tokenizer, oracle.config, oracle.words, oracle.demos = tok, policy.cfg, policy.words, policy.demos
    oracle.retriever, oracle._prefill, oracle._decode, oracle._calls = Retriever(), 0, 0, 0

    def generate(prompt, n, scores=True):
        ids, _, h, _ = scripted(tok, world(prompt), n)
        return OracleGeneration(ids=ids, text=tok.decode(ids, skip_special_tokens=True),
                                entropy=torch.tensor(h, dtype=torch.float64))

    oracle.generate = generate
    oracle.last_layer_attention = lambda ids: torch.full((2, len(ids), len(ids)), 1.0 / len(ids), dtype=torch.float64)
    return oracle


def test_dragin_reference_round_by_hand(tok):
    """One DRAGIN round worked out by hand. The scripted engine's attention is uniform: a word's attention a_w is
    its token count, and in QFS every word row attends alike, so a candidate's score is its token count.

    RIND (threshold 0.6): "The Louvre museum holds the Mona Lisa." has 7 words and 10 tokens; " Louvre" is 2
    tokens of entropy 0.3, so its score is 2/10 * 0.3 (the mean of its tokens' entropy) * 7 = 0.42: no hit (the
    sum of its entropies would make it 0.84). "It was painted by the Quattrocento master Leonardo." has 8 words and
    13 tokens; " the" (1 token) and " Leonardo." (2) have entropy 2.0: 1/13 * 2 * 8 = 1.23 and 2.46 (without the
    word count, 0.15 and 0.31: no hit). "the" is no real word (a determiner), so "Leonardo." is the one hit word.
    QFS (keep the top 2) over "question + kept sentence + the sentence's words": the candidates with most tokens
    are "Quattrocento" (5) and the question's "Gioconda" (3); the query lists them in text order. After the
    retrieval only the first sentence of the new generation is kept; the next round is confident and says "the
    answer is", which ends the question. The per-question oracle, on the same script, decides the same."""
    question, kept = "Where does the Gioconda hang?", "The Louvre museum holds the Mona Lisa."
    round1 = [(" The", HIGH, 0.01), (" Louvre", HIGH, 0.3), (" museum holds the Mona Lisa.", HIGH, 0.01),
              (" It was painted by", HIGH, 0.01), (" the", HIGH, 2.0), (" Quattrocento master", HIGH, 0.01),
              (" Leonardo.", HIGH, 2.0), None]

    def world(prompt):
        if "Context:" in prompt:
            return [(" He painted it in Florence.", HIGH, 0.01), (" It is famous.", HIGH, 0.01), None]
        tail = prompt[prompt.rindex("Answer:") + len("Answer:"):]
        return [(" So the answer is the Louvre.", HIGH, 0.01), None] if tail else round1

    policy = _policy("dragin", tok, fewshot=0, hallucination_threshold=0.6, retrieve_keep_top_k=2)
    eng, ret, out = ScriptEngine(tok, world), Retriever(), []
    QuestionLoop(eng, ret, policy, max_inflight=1).run([Ex("1", question)], out.append)
    res = out[0]
    assert res.error is None, res.error
    first, second = res.rounds
    assert (first.trigger_sentence, first.hit_words, first.query) == \
        ("It was painted by the Quattrocento master Leonardo.", ["Leonardo."], "Gioconda Quattrocento")
    assert ret.queries == ["Gioconda Quattrocento"] and len(first.doc_ids) == 3
    assert (second.trigger_sentence, second.query) == (None, None)
    case = f"Question: {question}\nAnswer:"
    rag = "Context:\n" + listed("Gioconda Quattrocento") + "Answer in the same format as before.\n" + case + " " + kept
    assert [p for p, _ in eng.prompts] == [case, rag, case + " " + kept + " He painted it in Florence."]
    assert res.text == res.prediction == kept + " He painted it in Florence. So the answer is the Louvre."
    oracle = _scripted_dragin_oracle(tok, policy, world)  # on the same script, the same decisions
    rec = oracle.run("1", question, ["Louvre"])
    assert [(r.trigger_sentence, r.hit_words, r.query) for r in rec.rounds] == \
        [(r.trigger_sentence, r.hit_words, r.query) for r in res.rounds]
    assert rec.text == res.text and oracle.retriever.queries == ret.queries
    found = [Doc(id="", title="", text=f"doc {i} about Gioconda Quattrocento") for i in range(3)]
    assert oracle.retrieval_prompt(question, "", kept, found) == rag


def test_dragin_stops_past_l_tokens_not_at_l(tok):
    """DRAGIN's stop rule counts the answer's tokens: at exactly L it goes on (engine and oracle alike). With L = 5,
    "Paris is in France." (5 tokens) takes a second round, cut at 5 tokens: "So the answer is France"."""
    first = "Paris is in France."

    def world(prompt):
        if prompt.endswith(" So the answer is "):  # (the evaluator's answer generation, were it asked for)
            return [(" France.", HIGH, 0.01), None]
        tail = prompt[prompt.rindex("Answer:") + len("Answer:"):]
        return [(" So the answer is France.", HIGH, 0.01), None] if tail else [(" " + first, HIGH, 0.01), None]

    L = len(tok.encode(first))
    assert L == len(tok.encode(" " + first)) == 5
    policy = _policy("dragin", tok, fewshot=0, generate_max_length=L)
    out = []
    QuestionLoop(ScriptEngine(tok, world), Retriever(), policy, max_inflight=1).run([Ex("1", "Where is Paris?")],
                                                                                 out.append)
    rec = _scripted_dragin_oracle(tok, policy, world).run("1", "Where is Paris?", ["France"])
    for r in (out[0], rec):
        assert r.error is None and r.text == first + " So the answer is France" and len(r.rounds) == 2, r.text


EVERY_METHOD = ("beamsearchqa", "dragin", "dragin-published", "dragin-streaming", "etc", "fl-rag", "flare", "flare-explicit",
                "flare-instruct", "fs-rag", "ircot", "iter-retgen", "seakr", "self-ask", "sr-rag", "token-rag", "wo-rag")
OWN_PROMPTS = ("beamsearchqa", "self-ask")  # methods whose prompts are not the datasets' few-shot demos


def test_every_method_is_every_registered_method():
    """The rules below cover a method registered later too: the list is the registry."""
    from fastrag.methods.registry import available

    assert sorted(EVERY_METHOD) == available()


def _policy(method, tok, **over):
    """`method`'s policy on its 2WikiMultihopQA defaults, with `over` applied to the fields its config has."""
    import dataclasses

    from fastrag.methods.registry import get_method

    spec = get_method(method)
    cfg = spec.make_config("2wikimultihopqa", None)
    names = {f.name for f in dataclasses.fields(cfg)}
    return spec.make_policy(dataclasses.replace(cfg, **{k: v for k, v in over.items() if k in names}), tok)


@pytest.mark.parametrize("method", EVERY_METHOD)
def test_every_method_refuses_a_blank_question_before_any_request(tok, method):
    """A question of whitespace only is that question's error ("empty question"), raised before the policy asks the
    engine or the retriever for anything."""
    eng, ret, out = ScriptEngine(tok, lambda p: ANSWER), Retriever(), []
    QuestionLoop(eng, ret, _policy(method, tok), max_inflight=1).run([Ex("blank", " \t\n ")], out.append)
    assert [r.qid for r in out] == ["blank"]
    assert out[0].error is not None and "empty question" in out[0].error, out[0].error
    assert eng.prompts == [] and ret.queries == []


@pytest.mark.parametrize("method", EVERY_METHOD)
def test_every_prompt_starts_with_the_shared_prefix(tok, method):
    """The KV contract of methods/common.py: every prompt a policy sends starts with its `shared_prefix` (computed
    once a run: the demos, flare-instruct's whole head, BeamSearchQA's chat header), and the record keeps the
    question as given, trailing spaces included; so do the few-shot methods' prompts."""
    from fastrag.data.exemplars import demo_text, published_demo_text
    from fastrag.methods.common import FewShotMethod

    policy = _policy(method, tok, fewshot=2, generate_max_length=24)
    if method not in OWN_PROMPTS:
        demos = (published_demo_text if method == "dragin-published" else demo_text)("2wikimultihopqa", 2)
        assert isinstance(policy, FewShotMethod) and demos.count("Question:") == 2 and demos in policy.shared_prefix
    world = (lambda p: continuation(p, ANSWER)) if method not in OWN_PROMPTS else (lambda p: ANSWER)
    eng, out = ScriptEngine(tok, world), []
    QuestionLoop(eng, Retriever(), policy, max_inflight=1).run([Ex("1", "Where is Paris?  ")], out.append)
    assert out[0].error is None, out[0].error
    assert out[0].question == "Where is Paris?  "
    assert eng.prompts and all(p.startswith(policy.shared_prefix) for p, _ in eng.prompts), \
        [p[:120] for p, _ in eng.prompts if not p.startswith(policy.shared_prefix)]
    asked = "Where is Paris?\n" if method == "beamsearchqa" else "Where is Paris?  "  # its template strips it
    assert all(asked in p for p, _ in eng.prompts), [p[-160:] for p, _ in eng.prompts if asked not in p]


@pytest.mark.parametrize("method", ["dragin", "dragin-streaming"])
def test_dragin_retrieval_with_no_document_keeps_the_context_header(tok, method):
    """DRAGIN's retrieval prompt is the published one whatever comes back: with no passage it still holds the
    `Context:` line and the instruction (engine and oracle alike, docs/dragin-reference.md), where the other
    methods leave the block out (test_short_or_empty_retrieval_is_defined)."""
    from fastrag.oracle.dragin import DraginOracle

    answer = [(" Paris", LOW, 5.0), (" is in France.", LOW, 5.0), (" So the answer is France.", HIGH, 0.1), None]
    policy = _policy(method, tok, fewshot=0, generate_max_length=24, hallucination_threshold=0.0)
    eng, ret, out = ScriptEngine(tok, lambda p: continuation(p, answer)), Retriever(n=0), []
    QuestionLoop(eng, ret, policy, max_inflight=1).run([Ex("1", "Where is Paris?")], out.append)
    assert out[0].error is None, out[0].error
    assert ret.queries, "the script never triggered a retrieval"
    header = "Context:\nAnswer in the same format as before.\n"
    rag = [p for p, _ in eng.prompts if "Context:" in p]
    assert rag and all(header in p for p in rag), [p[-200:] for p in rag]
    oracle = DraginOracle.__new__(DraginOracle)
    oracle.demos, oracle.config = policy.demos, policy.cfg
    case = "Question: Where is Paris?\nAnswer:"
    assert oracle.retrieval_prompt("Where is Paris?", "", "", []) == policy.demos + header + case
