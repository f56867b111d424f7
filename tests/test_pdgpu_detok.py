"""Output text token by token (pdgpu/serve/detok.py, openai_api.Output) over trained byte-level
BPE tokenizers and token sequences that split or never finish characters: every piece is final,
nothing is held back longer than it may change, and the pieces join to the tokenizer's decode."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from pdgpu.serve.detok import REPLACEMENT, Detokenizer  # noqa: E402
from pdgpu.serve.openai_api import Ask, Output  # noqa: E402
from pdgpu.serve.texts import Texts  # noqa: E402

CORPORA = ("héllo wörld ñandú 日本語 hello world roots",
           "日本語のテキスト 🙂🙃 emoji ÀÉÎÕÜ ascii words and more words",
           "plain english text only, with some punctuation!")


@functools.cache
def byte_level(corpus: int, vocab: int) -> Texts:
    """A byte-level BPE tokenizer trained on one corpus (every byte is a token, so any id
    sequence may end inside a character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train_from_iterator([CORPORA[corpus]], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Texts(tok)


@st.composite
def outputs(draw):
    """(texts, ids): a tokenizer and output ids, often ending mid-character."""
    texts = byte_level(draw(st.integers(0, len(CORPORA) - 1)), draw(st.sampled_from([260, 300])))
    vocab = texts.tokenizer.get_vocab_size()
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24))
    return texts, ids


def settled(texts: Texts, ids: list[int]) -> str:
    """The decode of `ids` without a last U+FFFD (the only character that may still change)."""
    text = texts.decode(ids)
    return text[:-1] if text.endswith(REPLACEMENT) else text


@settings(max_examples=150)
@given(outputs())
def test_pieces_are_final_at_once_and_join_to_the_decode(case):
    """After each token the text given is exactly the decode so far less a last U+FFFD; after
    the flush, the tokenizer's whole decode (replacement characters included)."""
    texts, ids = case
    detok, given_text = Detokenizer(texts), ""
    for k, token in enumerate(ids):
        given_text += detok.add(token)
        assert given_text == settled(texts, ids[:k + 1])
    assert given_text + detok.flush() == texts.decode(ids)


def test_the_issue_examples_keep_their_replacement_characters():
    """Lone bytes at the end are given as the tokenizer decodes them (issue 39: 32 x a lone
    byte gave '', and 'roots' x 5 + 3 lone bytes lost the three U+FFFD)."""
    texts = byte_level(0, 300)
    lone = next(i for i in range(texts.tokenizer.get_vocab_size())
                if texts.decode([i]) == REPLACEMENT)
    roots = texts.encode("roots", special=False)
    for ids in ([lone] * 32, roots * 5 + [lone] * 3):
        detok = Detokenizer(texts)
        out = "".join(detok.add(i) for i in ids) + detok.flush()
        assert out == texts.decode(ids) and out.endswith(REPLACEMENT * 3)


@st.composite
def stopped_outputs(draw):
    """(texts, ids, stop strings): stops taken from the decoded text or absent from it."""
    texts, ids = draw(outputs())
    whole = texts.decode(ids)
    stops = draw(st.lists(st.one_of(
        st.builds(lambda a, n: whole[a:a + n], st.integers(0, max(0, len(whole) - 1)),
                  st.integers(1, 4)),
        st.text(min_size=1, max_size=3)), max_size=2).filter(lambda s: all(s)))
    return texts, ids, tuple(stops)


def stopped_text(texts: Texts, ids: list[int], stops: tuple[str, ...]) -> str:
    """The text as the stream ends it: at the first token whose settled text holds a stop
    string (or the whole decode, flushed), cut where the earliest one there begins."""
    for text in [settled(texts, ids[:k]) for k in range(1, len(ids) + 1)] + \
            [texts.decode(ids)]:
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            return text[:min(cuts)]
    return texts.decode(ids)


@settings(max_examples=150)
@given(stopped_outputs())
def test_stop_strings_cut_and_hold_back_no_more_than_the_longest_stop(case):
    """Output cuts the text before the first stop string it completes and, before that,
    gives all but the longest stop's length - 1 settled characters after every token."""
    texts, ids, stops = case
    final = stopped_text(texts, ids, stops)
    out = Output(Ask((1,), 100, False, False, frozenset(), stops), texts)
    hold = max((len(s) for s in stops), default=1) - 1
    given_text = ""
    for k, token in enumerate(ids):
        given_text += out.add(token)
        assert final.startswith(given_text)
        assert len(given_text) >= min(len(final), len(settled(texts, ids[:k + 1])) - hold)
    given_text += out.finish()
    assert given_text == final and out.stopped == (final != texts.decode(ids))


@settings(max_examples=60)
@given(outputs(), st.data())
def test_a_stop_token_ends_the_text_before_it(case, data):
    """A stop token's own text is not output; the text before it is, held-back tail too."""
    texts, ids = case
    at = data.draw(st.integers(0, len(ids) - 1))
    stop = ids[at]
    first = ids.index(stop)
    out = Output(Ask((1,), 100, False, False, frozenset({stop}), ()), texts)
    text = "".join(out.add(i) for i in ids) + out.finish()
    assert text == texts.decode(ids[:first]) and out.tokens == ids[:first + 1]


def test_two_stops_completed_by_one_token_cut_at_the_earlier_start():
    """Stops '"' and '!"' both complete at '"': the text ends before '!' (found by
    Hypothesis: the first stop in the list cut at '"' and left '!')."""
    texts = byte_level(2, 300)
    ids = texts.encode('ab!"', special=False)
    out = Output(Ask((1,), 100, False, False, frozenset(), ('"', '!"')), texts)
    whole = texts.decode(ids)
    assert "".join(out.add(i) for i in ids) + out.finish() == whole[:whole.index('!"')]
