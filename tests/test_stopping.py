"""Stop strings (asps_jax/controls/stopping.py and the decode loop's stop cut).

Expected values: ``tokenizer.decode`` (transformers / tokenizers) for the token byte tables,
literals and a plain-Python ``bytes`` search for the matcher, an exact enumeration of AR sampling
stopped at a stop string (NumPy float64) for the law, and, end to end, the tokens of the same run
without stop strings cut where ``tokenizer.decode`` of the prefix first contains a stop string.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode import MAX_NEW, METHOD_OPTIONS, N_DRAFT, PROMPT, VOCAB, write_pair
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import asps_jax
from asps_jax import decode
from asps_jax.controls import stopping

CORPUS = [
    "the cat sat on the mat",
    "hello world, hello there",
    "stop here. stop there!",
    "a b c d e f g",
] * 5
# Multi-byte characters the tiny vocabularies below do not hold whole: split across tokens.
TEXTS = ["hello é 日本 🙂 stop", "the mat\n\tsat, ÿ€", "stop! ab-cd  éé", "x"]


def _search(text: bytes, strings) -> int | None:
    """The end (exclusive) of the first occurrence of any of ``strings`` in ``text``."""
    ends = [text.find(s) + len(s) for s in strings if s in text]
    return min(ends) if ends else None


def _reference_cut(pieces, tokens, strings) -> int | None:
    """Tokens kept: the first token whose text (the concatenation of ``pieces``) reaches the
    end of the first stop-string occurrence; None when none occurs."""
    text = b"".join(pieces[t] for t in tokens)
    end = _search(text, strings)
    if end is None:
        return None
    return int(np.searchsorted(np.cumsum([len(pieces[t]) for t in tokens]), end)) + 1


# --------------------------------------------------------------------------------------------
# Token byte tables against tokenizer.decode


def gpt2_like_tokenizer():
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained offline on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def llama_like_tokenizer():
    """A SentencePiece-style BPE as Llama's tokenizer.json: ``▁`` for spaces, the 256
    ``<0xNN>`` byte-fallback tokens in the vocabulary, Llama's decoder sequence."""
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE())
    base.normalizer = norm
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=80, show_progress=False))
    learned = json.loads(base.to_str())["model"]
    special = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(special + [f"<0x{b:02X}>" for b in range(256)])}
    for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = norm
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def bundled_tokenizer():
    from transformers import AutoTokenizer

    from asps_jax.models import cards

    return AutoTokenizer.from_pretrained(str(cards.resolve("tinyshakespeare-target").path))


TOKENIZERS = {
    "bundled": bundled_tokenizer,
    "gpt2": gpt2_like_tokenizer,
    "llama": llama_like_tokenizer,
}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_token_bytes_concatenate_to_the_decoded_text(name):
    tok = TOKENIZERS[name]()
    vocab = len(tok) + 3  # a model vocabulary may be larger than the tokenizer's: empty ids
    pieces = stopping.token_bytes(tok, vocab)
    assert len(pieces) == vocab and pieces[-3:] == [b"", b"", b""]
    for i in tok.all_special_ids:
        assert pieces[i] == b""
    # A token with no leading space: SentencePiece's decoder strips the text's first space.
    lead = tok.convert_tokens_to_ids("<0x41>") if name == "llama" else tok.encode("A")[-1]
    rng = np.random.default_rng(0)
    alphabet = list("abcdehlmorst ,.!\n\t") + ["é", "ÿ", "€", "日", "本", "🙂"]
    texts = TEXTS + ["".join(rng.choice(alphabet, 12)) for _ in range(200)]
    sequences = [tok.encode(t, add_special_tokens=False) for t in texts]
    # Random ids too, where their bytes are valid UTF-8 (else decoders differ in where they put
    # U+FFFD) and hold no special token (the slow path of decode, checked above on its own).
    for ids in rng.integers(0, len(tok), (400, 5)).tolist():
        if _valid(b"".join(pieces[i] for i in ids)):
            sequences.append(ids)
    assert len(sequences) > len(texts) + 20
    for ids in sequences:
        got = b"".join(pieces[i] for i in [lead] + ids)
        want = tok.decode([lead] + ids, skip_special_tokens=True)
        assert got.decode("utf-8") == want, (ids, got, want)
    for text in TEXTS[:2]:  # the multi-byte characters above are split across tokens
        ids = tok.encode(text, add_special_tokens=False)
        assert any(not _valid(pieces[i]) for i in ids), text
    table, lengths = stopping.token_byte_table(pieces)
    assert table.shape[1] % 8 == 0 and table.shape[1] >= max(map(len, pieces))
    for i in rng.integers(0, vocab, 50):
        assert bytes(table[i, : lengths[i]]) == pieces[i]


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_character_level_vocabulary_falls_back_to_decoding_each_token():
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "é": 3, " ": 4}, "<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert stopping.token_bytes(fast, 5) == [b"", b"a", b"b", "é".encode(), b" "]


# --------------------------------------------------------------------------------------------
# The matcher, on a hand-made byte table

PIECES = [b"", b"a", b"b", b"st", b"op", b"stop", b"xstopx", b"\xc3", b"\xa9", b"ab", b"cd", b"c"]
A, B, ST, OP, STOP, XSTOPX, E1, E2, AB, CD, C = range(1, 12)


def _state(strings, batch=1):
    table = stopping.token_byte_table(PIECES)
    return stopping.stop_strings(table, stopping.validate_stop(strings), batch)


def _run(strings, steps):
    """Feed ``steps`` (a list of blocks, each a list of tokens, all emitted) through one row;
    returns the tokens kept and whether a stop string hit."""
    stop = _state(strings)
    advance = jax.jit(stopping.advance)
    kept = []
    for block in steps:
        width = 5
        padded = jnp.asarray([block + [-1] * (width - len(block))], jnp.int32)
        num, hit, stop = advance(stop, padded, jnp.asarray([len(block)], jnp.int32))
        kept += block[: int(num[0])]
        if bool(hit[0]):
            return kept, True
    return kept, False


@pytest.mark.parametrize(
    "strings, steps, kept, hit",
    [
        (["stop"], [[A, ST, OP, B]], [A, ST, OP], True),  # spans a token boundary
        (["stop"], [[A, B, ST], [OP, A, B]], [A, B, ST, OP], True),  # spans two steps
        (["stop"], [[A, ST], [B, OP]], [A, ST, B, OP], False),  # "stbop": no occurrence
        (["stop"], [[A, B, A, ST, OP], [A]], [A, B, A, ST, OP], True),  # the block's last token
        (["top"], [[A, XSTOPX, B, B]], [A, XSTOPX], True),  # ends partway into a token
        (["stop"], [[STOP, A, A]], [STOP], True),  # the very first token
        (["a"], [[A, B]], [A], True),
        (["é"], [[A, E1], [E2, B]], [A, E1, E2], True),  # a character split across tokens
        (["abcc", "bc"], [[A, B, C, C, A]], [A, B, C], True),  # the earliest end wins
        (["bc", "abcd"], [[AB, CD, A]], [AB, CD], True),
        (["opa", "ba"], [[ST, OP], [A, B, A]], [ST, OP, A], True),
        (["zz"], [[A, B, ST], [OP, A], [XSTOPX]], [A, B, ST, OP, A, XSTOPX], False),
        (["stop"], [[], [ST], [], [OP]], [ST, OP], True),  # steps that emit nothing
    ],
)
def test_matcher(strings, steps, kept, hit):
    assert _run(strings, steps) == (kept, hit)
    # The same tokens one per step, and in one block: the cut does not depend on the steps.
    flat = [t for block in steps for t in block]
    assert _run(strings, [[t] for t in flat]) == (kept, hit)


def test_matcher_reads_only_the_emitted_tokens_and_carries_the_tail():
    stop = _state(["stop", "é"], batch=3)
    block = jnp.asarray([[A, ST, OP, B], [ST, OP, A, A], [XSTOPX, A, A, A]], jnp.int32)
    num, hit, stop = jax.jit(stopping.advance)(stop, block, jnp.asarray([2, 0, 4], jnp.int32))
    np.testing.assert_array_equal(num, [2, 0, 1])  # row 0's "op" is not emitted; row 1 is idle
    np.testing.assert_array_equal(hit, [False, False, True])
    tail = np.asarray(stop.tail)
    assert tail.shape == (3, 7)  # Ls = 8 bytes: the last 7 are carried
    assert tail[0].tolist() == [-1] * 4 + list(b"ast") and tail[1].tolist() == [-1] * 7
    assert tail[2].tolist() == [-1] + list(b"xstopx")  # up to the kept token's end


def test_matches_ending_before_the_first_counted_token_are_skipped():
    """``first_B`` (min_tokens): a stop string ending in an earlier token does not count (a
    later occurrence does), one ending in that token or after does."""
    stop = _state(["stop"], batch=5)
    block = jnp.asarray([[A, ST, OP, B]] * 3 + [[ST, OP, ST, OP]] * 2, jnp.int32)
    num, hit, _ = jax.jit(stopping.advance)(
        stop, block, jnp.full((5,), 4, jnp.int32), jnp.asarray([2, 3, 9, 2, 0], jnp.int32)
    )
    np.testing.assert_array_equal(num, [3, 4, 4, 4, 2])
    np.testing.assert_array_equal(hit, [True, False, False, True, True])


def test_random_token_streams_against_a_bytes_search():
    """Random texts, stop strings and step splits in one jitted call per split pattern."""
    rng = np.random.default_rng(1)
    rows, length, width = 256, 12, 4
    tokens = rng.integers(0, len(PIECES), (rows, length))
    strings = [b"ab", b"top", b"\xc3\xa9a", b"bst"]
    stop = _state([s.decode() for s in strings], batch=rows)
    advance = jax.jit(stopping.advance)
    for trial in range(3):
        cuts = np.sort(rng.choice(np.arange(1, length), size=3 + trial, replace=False))
        bounds = [0, *cuts.tolist(), length]
        state, kept, done = stop, np.zeros(rows, int), np.zeros(rows, bool)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            for s in range(lo, hi, width):  # a block of at most `width` tokens
                e = min(s + width, hi)
                block = np.full((rows, width), -1)
                block[:, : e - s] = tokens[:, s:e]
                num = np.where(done, 0, e - s)
                num, hit, state = advance(state, jnp.asarray(block), jnp.asarray(num))
                kept += np.asarray(num)
                done |= np.asarray(hit)
        for r in range(rows):
            ref = _reference_cut(PIECES, tokens[r].tolist(), strings)
            assert (kept[r], done[r]) == ((length, False) if ref is None else (ref, True)), r


def test_law_of_the_stopped_text_is_ar_stopped_at_the_stop_string():
    """Exact enumeration on a tabular model (V = 5 tokens with small byte strings, M = 5):
    the law of what the loop emits — the full draw of M tokens, cut by the device matcher over
    steps of random lengths — equals the law of AR sampling that stops at the stop string,
    computed token by token (a different computation: a recursion over unstopped prefixes)."""
    pieces = [b"a", b"b", b"ab", b"ba", b"\xc3"]
    strings = (b"aba", b"bb")
    vocab, length = len(pieces), 5
    rng = np.random.default_rng(2)
    laws = [rng.dirichlet(np.ones(vocab), size=(vocab,) * i) for i in range(length)]

    # AR stopped at the stop string: a recursion over prefixes that have not stopped.
    ar = {}

    def walk(prefix, prob):
        law = laws[len(prefix)][tuple(prefix)]
        for y in range(vocab):
            seq = prefix + [y]
            text = b"".join(pieces[t] for t in seq)
            if any(s in text for s in strings) or len(seq) == length:
                ar[tuple(seq)] = ar.get(tuple(seq), 0.0) + prob * law[y]
            else:
                walk(seq, prob * law[y])

    walk([], 1.0)

    # The loop: every full draw, cut by the device matcher, weighted by its probability.
    grids = np.stack(np.meshgrid(*[np.arange(vocab)] * length, indexing="ij"), -1)
    full = grids.reshape(-1, length)
    prob = np.ones(len(full))
    for i in range(length):
        rows_law = (
            laws[i][tuple(full[:, :i].T)] if i else np.broadcast_to(laws[0], (len(full), vocab))
        )
        prob *= rows_law[np.arange(len(full)), full[:, i]]
    table = stopping.token_byte_table(pieces)
    state = stopping.stop_strings(table, strings, len(full))
    steps = rng.integers(1, 4, size=(len(full), length))  # each row its own step lengths
    advance = jax.jit(stopping.advance)
    pos, done = np.zeros(len(full), int), np.zeros(len(full), bool)
    for s in range(length):
        take = np.where(done, 0, np.minimum(steps[:, s], length - pos))
        block = np.take_along_axis(full, np.minimum(pos[:, None] + np.arange(3), length - 1), 1)
        num, hit, state = advance(state, jnp.asarray(block), jnp.asarray(take))
        pos += np.asarray(num)
        done |= np.asarray(hit) | (pos == length)
    assert done.all()
    loop = {}
    for row, p, n in zip(full, prob, pos):
        loop[tuple(row[:n])] = loop.get(tuple(row[:n]), 0.0) + p
    assert set(loop) == set(ar)
    np.testing.assert_allclose([loop[k] for k in ar], list(ar.values()), rtol=1e-9, atol=1e-15)
    assert any(len(k) < length for k in ar) and any(len(k) == length for k in ar)


# --------------------------------------------------------------------------------------------
# End to end: the decode loop with stop strings on tiny Llama checkpoints


def tiny_byte_tokenizer():
    """A 12-token byte-level vocabulary for the tiny checkpoints (VOCAB = 12): single letters,
    pairs, a space, a newline and the two bytes of ``é``; token 0 the special EOS."""
    tokens = ["<|endoftext|>", "a", "b", "ab", "ba", "Ġ", "Ċ", "Ã", "©", "Ġab", "c", "bc"]
    assert len(tokens) == VOCAB
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, "<|endoftext|>"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def models_with_tokenizer(tmp_path_factory):
    _, target, draft = write_pair(tmp_path_factory.mktemp("ckpt"))
    tok = tiny_byte_tokenizer()
    return dataclasses.replace(target, tokenizer=tok), draft, tok


PROMPTS = [PROMPT, [4, 7, 9, 1, 0, 11, 6], [2], [5, 5], [8, 3, 1], [10], [6, 2, 2, 9], [1, 1]]
METHODS = ["ar", "sps", "asps", "specinfer", "tv"]


def _sample(target, draft, method, temperature, **kw):
    kw.update(METHOD_OPTIONS.get(method, {}))
    kw.setdefault("eos_token_id", -1)
    return asps_jax.sample(
        target,
        None if method == "ar" else draft,
        PROMPTS,
        method=method,
        key=jax.random.key(5),
        max_new_tokens=MAX_NEW,
        num_draft_tokens=N_DRAFT,
        num_drafts=2 if method in ("specinfer", "tv") else 1,
        diagnostics=True,  # the compiled loop of test_decode.py
        temperature=temperature,
        **kw,
    )


def _decoded_cut(tok, tokens, strings) -> int:
    """The first prefix whose decoded text holds a stop string (all tokens if none does)."""
    for k in range(1, len(tokens) + 1):
        if any(s in tok.decode(tokens[:k], skip_special_tokens=True) for s in strings):
            return k
    return len(tokens)


def _pick_stops(tok, rows) -> list[str]:
    """Stop strings from the middle of the rows' texts, spanning a token boundary there."""
    picks = []
    for row in rows:
        for k in range(2, len(row)):
            a = tok.decode(row[: k - 1], skip_special_tokens=True)
            b = tok.decode(row[:k], skip_special_tokens=True)
            if "\ufffd" in b or len(a) < 1 or len(b) <= len(a):
                continue
            cand = a[-1:] + b[len(a) : len(a) + 1]  # last char of token k-1, first of token k
            if cand.strip() and cand not in picks:
                picks.append(cand)
                break
    return picks[:4]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_stop_cuts_the_same_run_where_the_decoded_text_first_holds_a_stop_string(
    models_with_tokenizer, method
):
    """Pathwise, not only in law: stopping reads only the emitted text, and the step keys are
    ``fold_in(row key, tokens generated so far)``. Before the stop step the run with stop strings
    has the same state as the run without (nothing was cut), so its drafts, verdicts and keys are
    the same; in the stop step the same block is cut. Hence the tokens with stop strings equal the
    tokens without, cut at the first decoded prefix holding one (greedy and sampling alike)."""
    target, draft, tok = models_with_tokenizer
    for temperature in (0.0, 1.0):
        base = _sample(target, draft, method, temperature)
        rows = [np.asarray(base.tokens[b]).tolist() for b in range(len(PROMPTS))]
        strings = _pick_stops(tok, rows)
        assert len(strings) >= 2, strings
        out = _sample(target, draft, method, temperature, stop=strings)
        cut_rows = 0
        for b, row in enumerate(rows):
            cut = _decoded_cut(tok, row, strings)
            cut_rows += cut < MAX_NEW
            assert int(out.lengths[b]) == cut, (b, row, strings)
            got = np.asarray(out.tokens[b]).tolist()
            assert got == row[:cut] + [-1] * (MAX_NEW - cut), (b, row, strings)
        assert cut_rows >= 2


@pytest.mark.slow
def test_stop_and_eos_whichever_comes_first(models_with_tokenizer):
    target, draft, tok = models_with_tokenizer
    base = _sample(target, draft, "asps", 0.0)
    rows = [np.asarray(base.tokens[b]).tolist() for b in range(len(PROMPTS))]
    strings = _pick_stops(tok, rows)[:2]
    cuts = [_decoded_cut(tok, row, strings) for row in rows]
    # An EOS id that some rows emit before their stop string and others after it.
    orders = {}
    for eos in range(1, VOCAB):
        firsts = [row.index(eos) + 1 if eos in row else MAX_NEW + 1 for row in rows]
        orders[eos] = {np.sign(f - c) for f, c in zip(firsts, cuts) if min(f, c) <= MAX_NEW}
    eos = next(e for e, o in orders.items() if {-1, 1} <= o)
    out = _sample(target, draft, "asps", 0.0, stop=strings, eos_token_id=eos)
    for b, (row, cut) in enumerate(zip(rows, cuts)):
        want = min(cut, row.index(eos) + 1 if eos in row else MAX_NEW)
        assert int(out.lengths[b]) == want, (b, row, strings, eos)
        assert np.asarray(out.tokens[b]).tolist() == row[:want] + [-1] * (MAX_NEW - want)


def _decoded_cut_from(tok, tokens, strings, first) -> int:
    """vLLM's min_tokens: the first prefix of at least ``first`` tokens whose decoded text holds
    a stop string ending after the text of the first ``first - 1`` tokens."""
    before = len(tok.decode(tokens[: first - 1], skip_special_tokens=True)) if first > 1 else 0
    for k in range(max(first, 1), len(tokens) + 1):
        text = tok.decode(tokens[:k], skip_special_tokens=True)
        if any(text.find(s, max(before - len(s) + 1, 0)) >= 0 for s in strings):
            return k
    return len(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "asps"])
def test_min_tokens_holds_off_stop_strings(models_with_tokenizer, method):
    """Pathwise as above: with ``min_tokens`` (and no EOS, so the laws are unchanged) the run is
    the one without stop strings, cut at the first stop string that ends in the row's
    min_tokens-th token or later; rows whose earlier stop string is skipped run on past it."""
    target, draft, tok = models_with_tokenizer
    base = _sample(target, draft, method, 1.0)
    rows = [np.asarray(base.tokens[b]).tolist() for b in range(len(PROMPTS))]
    strings = _pick_stops(tok, rows)
    plain = [_decoded_cut(tok, row, strings) for row in rows]
    firsts = [min(c + 1, MAX_NEW) if b % 2 else 0 for b, c in enumerate(plain)]
    out = _sample(target, draft, method, 1.0, stop=strings, min_tokens=firsts)
    later = 0
    for b, (row, first) in enumerate(zip(rows, firsts)):
        cut = _decoded_cut_from(tok, row, strings, first)
        later += cut > plain[b]
        assert int(out.lengths[b]) == cut, (b, row, strings, first)
        assert np.asarray(out.tokens[b]).tolist() == row[:cut] + [-1] * (MAX_NEW - cut)
    assert later >= 2


@pytest.mark.slow
def test_changing_stop_strings_does_not_recompile(models_with_tokenizer):
    target, draft, _ = models_with_tokenizer
    out = _sample(target, draft, "asps", 1.0, stop=["ab", "c"])
    before = decode.generate._cache_size()
    again = _sample(target, draft, "asps", 1.0, stop=["ba", "é", "\n", "bb"])  # same bucket
    assert decode.generate._cache_size() == before
    assert not np.array_equal(np.asarray(out.lengths), np.asarray(again.lengths))


@pytest.mark.slow
def test_stream_stops_where_sample_does(models_with_tokenizer):
    target, _, _ = models_with_tokenizer
    out = _sample(target, None, "ar", 1.0, stop=["ab", "c"])
    gen = asps_jax.stream(
        target,
        None,
        PROMPTS,
        method="ar",
        key=jax.random.key(5),
        max_new_tokens=MAX_NEW,
        eos_token_id=-1,
        temperature=1.0,
        stop=["ab", "c"],
    )
    rows = [[] for _ in PROMPTS]
    while True:
        try:
            for b, new in enumerate(next(gen)):
                rows[b].extend(new)
        except StopIteration as final:
            result = final.value
            break
    for b in range(len(PROMPTS)):
        n = int(out.lengths[b])
        assert rows[b] == np.asarray(out.tokens[b]).tolist()[:n]
    np.testing.assert_array_equal(np.asarray(result.tokens), np.asarray(out.tokens))


@pytest.mark.parametrize(
    "stop, match",
    [
        ([""], r"stop\[0\] is empty"),
        (["ok", 3], r"stop\[1\] must be a string"),
        (b"ab", "stop must be a list of strings"),
        (["x" * 65], r"stop\[0\] is 65 bytes long in UTF-8; at most 64"),
        (["é" * 33], r"stop\[0\] is 66 bytes"),
        ([str(i) for i in range(17)], "17 distinct stop strings; at most 16"),
        (["\ud800"], "lone surrogate"),
    ],
)
def test_bad_stop_strings_are_one_line_errors(models_with_tokenizer, stop, match):
    target, draft, _ = models_with_tokenizer
    with pytest.raises(ValueError, match=match) as info:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2, stop=stop)
    assert "\n" not in str(info.value)


def test_stop_needs_a_tokenizer(models_with_tokenizer):
    _, draft, _ = models_with_tokenizer
    with pytest.raises(ValueError, match="stop: .* without a tokenizer"):
        asps_jax.sample(draft, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2, stop="a")


def test_bounds_and_buckets():
    assert stopping.validate_stop(["ab", "ab", "c"]) == (b"ab", b"c")
    assert stopping.validate_stop("ab") == (b"ab",) and stopping.validate_stop(None) == ()
    table = stopping.token_byte_table(PIECES)
    for strings, shape in (
        ([b"a"], (4, 8)),
        ([b"a"] * 0 + [b"x" * 9], (4, 16)),
        ([bytes([65 + i]) for i in range(5)], (8, 8)),
        ([b"x" * 64] * 1 + [bytes([65 + i]) for i in range(15)], (16, 64)),
    ):
        assert stopping.stop_strings(table, tuple(strings), 2).strings.shape == shape


@pytest.mark.parametrize("name", sorted(TOKENIZERS) + ["added"])
def test_constraints_and_stop_strings_read_one_token_text(name):
    """One table per tokenizer: a constraint sees the bytes a stop string sees (None only where
    a constraint never allows the id). They used to differ on an added token of byte-level
    alphabet characters ('ÿé', 'aĠb'): the constraints read the byte-level bytes (ff e9, 'a b'),
    as the fast tokenizer's decode does, the stop strings the content's UTF-8 (c3 bf c3 a9)."""
    from asps_jax.controls import constraints

    if name == "added":
        tok = gpt2_like_tokenizer()
        tok.add_tokens(["ÿé", "aĠb", "hello world", "日本"])
    else:
        tok = TOKENIZERS[name]()
    vocab = len(tok) + 2
    text = stopping.token_bytes(tok, vocab)
    allowed = constraints.token_bytes(tok, vocab)
    assert [b if b is not None else b"" for b in allowed] == text
    for i in tok.all_special_ids:
        assert allowed[i] is None
    if name == "added":  # decode's text, an added token alone and after another token
        ids = tok.convert_tokens_to_ids(["ÿé", "aĠb", "hello world", "日本"])
        assert [text[i] for i in ids] == [b"\xff\xe9", b"a b", b"hello world", "日本".encode()]
        for i in ids[1:]:
            lead = tok.encode("x")[-1]
            assert (text[lead] + text[i]).decode() == tok.decode([lead, i])
