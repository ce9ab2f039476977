"""The published DRAGIN code's text rules (fastrag.methods.published), on inputs worked out by hand.

Each expected value below follows from the published code's loops, not from our functions: the module's docstring
states each rule, and these cases are the ones where it departs from reference mode (raw token strings, "</s>",
a sentence with a newline inside, NaN scores, negative hit indices, the query round trip).
"""

from __future__ import annotations

import math

import pytest
import torch

from fastrag.methods import published as P
from fastrag.methods.common import join, stop

SP = P.TokenSpelling(space="Ġ", newline_id=198)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from fastrag.model.loading import load_tokenizer

    return load_tokenizer("smollm2")


def test_words_are_raw_token_strings_with_only_the_marker_removed():
    tokens = ["The", "Ġanswer", "Ġis", "Ċ", "1", ".", "<|im_end|>", "Ġcaf", "Ã©", "</s>", "x"]
    ids = [10, 11, 12, 198, 13, 14, 2, 15, 16, 17, 18]
    spans = P.word_spans(tokens, ids, SP)
    # a word starts at token 0, at "Ġ...", at the newline id, and after "</s>"
    assert spans == [(0, 1), (1, 2), (2, 3), (3, 7), (7, 10), (10, 11)]
    assert P.word_texts(tokens, spans, SP) == ["The", "answer", "is", "Ċ1.<|im_end|>", "cafÃ©</s>", "x"]
    # the query pass's merge has no "</s>" test
    assert P.word_spans(tokens, ids, SP, after_eos=False)[-1] == (7, 11)


def test_sentences_are_found_among_the_words_by_substring_search():
    words = ["Ċ<|im_start|>assistant", "Ċ1.", "The", "woman", "was", "Tell.", "Ċ2.", "She", "won."]
    sents = ["<|im_start|>assistant\n1.", "The woman was Tell.", "2.", "She won."]
    # the first sentence holds a newline ("Ċ" among the words): no run of words contains it, so it gets no words and
    # the next search starts where it started; "2." is found in the run that ends with "Ċ2." (a substring of it)
    assert P.align_sentences(sents, words) == [(0, 0), (0, 6), (6, 7), (7, 9)]
    # the last sentence takes every word left, found or not
    assert P.align_sentences(["x y", "zzz"], ["x", "y", "q", "r"]) == [(0, 2), (2, 4)]


def test_rind_scores_words_and_divides_as_numpy_does():
    sents = ["A b.", "C d e."]
    words = ["A", "b.", "C", "d", "e."]
    # sentence 0: attention 0 everywhere: 0/0 is NaN, NaN > threshold is false, so no hit there
    # sentence 1: a = [0.5, 0.25, 0.25] of its sum, entropy [1, 4, 0.1], 3 words: scores 1.5, 3.0, 0.075
    hit = P.rind(sents, words, [0, 0, 2.0, 1.0, 1.0], [9, 9, 1.0, 4.0, 0.1], threshold=2.0)
    assert hit == (1, (2, 5), [False, True, False])
    assert P.rind(sents, words, [0, 0, 2.0, 1.0, 1.0], [9, 9, 1.0, 4.0, 0.1], threshold=3.0) is None
    assert P.filter_real(["Ċ1.", "Paris,"], [True, True], {"Paris"}) == [False, True]


def test_query_word_attention_uses_the_previous_rows_before_the_word():
    # 4 tokens, words [0,1) [1,3) [3,4); head-mean attention rows (causal)
    m = torch.tensor([[1.0, 0, 0, 0],
                      [0.6, 0.4, 0, 0],
                      [0.2, 0.3, 0.5, 0],
                      [0.1, 0.2, 0.3, 0.4]])
    w = P.qfs_word_attention(m, [(0, 1), (1, 3), (3, 4)])
    # word 0: its only token is token 0, skipped: zeros
    assert w[0].tolist() == [0.0, 0.0, 0.0]
    # word 1 (tokens 1, 2; columns before it: [0]): row 0 -> [1], row 1 -> [0.6] renormalised -> [1]; (1+1)/2 = 1
    assert w[1].tolist() == pytest.approx([1.0, 0.0, 0.0])
    # word 2 (token 3; columns [0, 3)): row 2 = [0.2, 0.3, 0.5] (already sums to 1) -> words [0.2, 0.8, 0]
    assert w[2].tolist() == pytest.approx([0.2, 0.8, 0.0])


def test_query_selection_follows_the_published_indices_and_order():
    words = ["Who", "wrote", "Evolution", "Nicolas", "Cage"]
    att = torch.zeros(5, 5, dtype=torch.float64)
    att[3] = torch.tensor([0.1, 0.5, 0.2, 0.0, 0.0], dtype=torch.float64)  # "Nicolas" attends to "wrote" most
    att[4] = torch.tensor([0.3, 0.1, 0.4, 0.0, 0.0], dtype=torch.float64)
    real = {"wrote", "Evolution", "Nicolas", "Cage", "Who"}
    # the last two words are the sentence's, "Nicolas" the hit: fwd = att[3]; candidates exclude the hit
    assert P.qfs_select(words, att, 2, [True, False], real, top_k=2) == "wrote Evolution"
    assert P.qfs_select(words, att, 2, [True, False], real, top_k=1) == "wrote"
    # both hit: fwd = mean(att[3], att[4]) = [0.2, 0.3, 0.3]: ties keep text order, top 2 in text order
    assert P.qfs_select(words, att, 2, [True, True], real, top_k=2) == "wrote Evolution"
    # no hit: 0/0, NaN scores compare false: the first k candidates in text order
    assert P.qfs_select(words, att, 2, [False, False], real, top_k=3) == "Who wrote Evolution"
    # more sentence words than the pass found: the published code's negative index reads from the end
    assert P.qfs_select(words[:2], att[:2, :2], 3, [True, False, False], {"Who"}, top_k=1) == "Who"
    with pytest.raises(IndexError, match="outside the query pass"):
        P.qfs_select(words[:1], att[:1, :1], 3, [True, False, False], {"Who"}, top_k=1)


def test_texts_join_as_published():
    assert P.plain_join("", "A.") == " A."  # a leading space when the text was empty
    assert P.plain_join(" A.", "  ") == "A. "  # a blank generation still grows the text by its space
    assert join("", "A.", "", "B.") == "A. B."
    assert P.qfs_text("Q?", "", "", ["w1", "w2"]) == "Q?   w1 w2"
    # the stop rule (fastrag.methods.common.stop, shared with reference mode), as the published loop calls it
    assert stop("so the answer is x", 0, 3, 100) and not stop("So The Answer Is x", 0, 3, 100)
    assert stop("abc", 0, 101, 100) and stop("abc", 3, 3, 100)


def test_passages_are_padded_and_numbered():
    assert P.context_block(P.pad_passages(["one"], 3)) == (
        "Context:\n[1] one\n[2] \n[3] \nAnswer in the same format as before.\n")


def test_search_query_always_round_trips_without_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    q = "Kiss Tell? <|im_start|>assistant Ċ1."
    # even a short query loses its special tokens on the way to the retriever
    assert "<|im_start|>" not in P.search_query(tok, q, 64) and P.search_query(tok, q, 64).endswith("assistant Ċ1.")
    long = " ".join(f"w{i}" for i in range(100))
    cut = P.search_query(tok, long, 64)
    assert len(tok.encode(cut, add_special_tokens=False)) == 64 and cut.endswith("w99")
    sp = P.TokenSpelling.of(tok)
    assert sp.space == "Ġ" and tok.convert_ids_to_tokens([sp.newline_id]) == ["Ċ"]


def test_published_demos_are_the_published_codes():
    from fastrag.data.exemplars import demo_text, published_demo_text, published_exemplar_count

    pub = published_demo_text("hotpotqa", 8)
    assert "So the answer is The Phantom Hour..\n" in pub and pub != demo_text("hotpotqa", 8)
    assert published_exemplar_count("2wikimultihopqa") == 8 and published_exemplar_count("nq") == 11
    assert pub.startswith("Question: ") and pub.count("\nAnswer: ") == 8
    with pytest.raises(ValueError, match="published hotpotqa exemplars are 11"):
        published_demo_text("hotpotqa", 12)


def test_ratio_is_numpys():
    assert math.isnan(P._ratio(0.0, 0.0)) and P._ratio(1.0, 0.0) == math.inf and P._ratio(1.0, 4.0) == 0.25


def test_token_modifier_finds_tokens_as_the_published_code_does():
    lp = [math.log(p) for p in (0.99, 0.5, 0.99, 0.99, 0.99, 0.3, 0.99)]
    sents = ["Paris is big.", "It is old."]
    tokens = ["Paris", " is", " big", ".", " It", " is", " old."]
    # sentence 0: "Paris" found at 0 (pos 5); " is" at 0 of sent[5:] (pos = 0 + 3 = 3: the published position is the
    # offset within the slice); " big" at 2 of sent[3:] (pos 6); "." at 5 of sent[6:] (pos 6); " It" not in sent[6:]:
    # tr = 4, and the range runs one token past it (tokens 0..4, " It" included): 1 - p = .01 .5 .01 .01 .01, mean
    # 0.108. Sentence 1 starts at token 5: " is", " old." found; tokens 5..6: 1 - p = .7, .01, mean 0.355
    assert P.token_modifier(sents, tokens, lp, 0.15, "avg") == ("Paris is big.", "It[xxx] old.")
    assert P.token_modifier(sents, tokens, lp, 0.4, "avg") is None
    # max: sentence 0's 0.5 > 0.4 triggers; " is" (0.5) is masked, " It" (beyond the sentence's text) is not found
    # in it and changes nothing
    assert P.token_modifier(sents, tokens, lp, 0.4, "max") == ("", "Paris[xxx] big.")
    # past the last token: the mean of nothing is NaN (no trigger); max and min of nothing fail, as published
    assert P.token_modifier(["a.", "b.", "c."], ["a."], [0.0], 0.1, "avg") is None
    with pytest.raises(ValueError, match="max of no token probabilities"):
        P.token_modifier(["a.", "b.", "c."], ["a."], [0.0], 0.1, "max")
    assert P.token_query("direct", "Q?", "t", "k", "Paris[xxx] big.") == "Paris big."
    assert P.token_query("forward_all", "Q?", "", "k", "x") == "Q? k"
