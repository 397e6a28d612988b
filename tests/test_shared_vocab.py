"""One tokenizer, two embedding row counts (Qwen2.5-7B's 152064 against Qwen2.5-0.5B's 151936, in
miniature): the padding rows are masked out of both laws (``asps_jax/models/vocab.py``).

The expected law is transformers' target with the padding ids suppressed, enumerated exactly; the
target is built to put most of its mass on padding rows, so forgetting the mask cannot pass.
"""

import jax
import numpy as np
import pytest
import torch
from hf_checkpoints import tiny_llama
from scipy import stats as sps_stats
from test_loader import tiny_tokenizer

import asps_jax
from asps_jax.models import IncompatibleModelsError, check_compatible, load_model

N_IDS = 40  # test_loader.tiny_tokenizer's ids
PROMPT = [1, 5, 3]
ROWS = 4000
MAX_NEW = 4


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    target = tiny_llama(seed=0, vocab_size=N_IDS + 8, initializer_range=0.3)
    with torch.no_grad():  # the padding rows would win: the mask must remove them
        target.lm_head.weight[N_IDS:] = 3 * target.lm_head.weight[:8]
    draft = tiny_llama(seed=1, vocab_size=N_IDS + 2, initializer_range=0.3)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return target, load_model(root / "target"), load_model(root / "draft")


def _masked_probs(hf, seqs):
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits[:, -1].double()
    logits[:, N_IDS:] = -torch.inf
    return torch.softmax(logits, -1).numpy()[:, :N_IDS]


@pytest.mark.slow
def test_padding_rows_pair_and_are_masked(padded_pair):
    """One compiled call: ROWS law rows at temperature 1 and a greedy row at temperature 0."""
    hf, target, draft = padded_pair
    check_compatible(target, draft)  # one tokenizer; 48 and 42 rows
    with torch.no_grad():
        unmasked = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1], -1)
    assert unmasked[N_IDS:].sum() > 0.5  # most mass on padding: the mask is what is tested
    out = asps_jax.sample(
        target,
        draft,
        [PROMPT] * (ROWS + 1),
        method="sps",
        key=jax.random.key(7),
        max_new_tokens=MAX_NEW,
        num_draft_tokens=2,
        eos_token_id=-1,
        temperature=np.append(np.ones(ROWS), 0.0),
    )
    tokens = np.asarray(out.tokens)
    assert tokens.max() < N_IDS
    seq = list(PROMPT)  # greedy: the argmax over the tokenizer's ids
    for _ in range(MAX_NEW):
        seq.append(int(_masked_probs(hf, [seq])[0].argmax()))
    assert tokens[ROWS].tolist() == seq[len(PROMPT) :]
    first = _masked_probs(hf, [PROMPT])[0]
    second = _masked_probs(hf, [PROMPT + [x] for x in range(N_IDS)])
    law = (first[:, None] * second).reshape(-1)
    counts = np.zeros(N_IDS * N_IDS)
    np.add.at(counts, tokens[:ROWS, 0] * N_IDS + tokens[:ROWS, 1], 1)
    expected = law * ROWS
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    pvalue = sps_stats.chisquare(obs[keep], exp[keep]).pvalue
    assert pvalue > 1e-3, pvalue
    assert np.asarray(out.stats["tokens_per_step"])[:ROWS].mean() > 1.05  # drafts accepted


def test_padded_pair_refusals(padded_pair, tmp_path):
    _, target, draft = padded_pair
    bare = type(draft)(**{**draft.__dict__, "tokenizer": None})
    with pytest.raises(IncompatibleModelsError, match="without both tokenizers"):
        check_compatible(target, bare)
    small = tmp_path / "small"
    tiny_llama(seed=2, vocab_size=N_IDS - 4).save_pretrained(small)
    tiny_tokenizer().save_pretrained(small)
    with pytest.raises(IncompatibleModelsError, match="tokenizer has 40 ids, more than"):
        check_compatible(target, load_model(small))
