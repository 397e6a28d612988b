"""The drafters: who proposes the draft tree each step, one file each behind one protocol.

* :mod:`~asps_jax.drafters.base`: the :class:`Drafter` protocol and the :class:`Proposal` it
  returns (read it first: the host questions and the six device methods);
* :mod:`~asps_jax.drafters.model`: a separate draft model with K cache replicas per row
  (``draft=<Model>``), its rollout and the confidence stop (``draft_stop``);
* :mod:`~asps_jax.drafters.self_layers`: the target's first L layers (``draft="self:L"``),
  reading the target's cache where its layers allow;
* :mod:`~asps_jax.drafters.lookup`: prompt lookup (``draft="lookup"``), chains copied from the
  row's own text;
* ``draft="quant:int8"`` / ``"quant:int4[:G]"``: the target's own weights quantized
  (:func:`asps_jax.models.quant.quantized_copy`) as a draft model of its own cache;
* :mod:`~asps_jax.drafters.head`: a learned EAGLE-3 head on the target's own features
  (``draft="eagle3:PATH"``), trained by :mod:`~asps_jax.drafters.train`;
* :mod:`~asps_jax.drafters.block`: a parallel block drafter on the target's features
  (``draft="block:PATH"``): all n draft laws from one forward, trained by
  :mod:`~asps_jax.drafters.block_train`.

:func:`resolve` is the one reader of the ``draft=`` argument. A drafter is a frozen value, static
under jit (a field of :class:`~asps_jax.decode.Decoder`), so a user can also build one of their
own and pass it as ``draft=``: subclass :class:`Drafter` as a frozen dataclass and implement
``propose`` (and ``init`` / ``prefill`` / ``refill`` / ``commit`` if it keeps a state); a drafter
with logits of its own reports them with :func:`finite_laws` (``Proposal.finite_BKD``), so a NaN
or ``+inf`` draft law raises ``NonFiniteLogitsError`` like a draft model's. Adding a drafter to the
package is one file and one line in :func:`resolve`.
"""

from __future__ import annotations

from asps_jax.checks import check_int
from asps_jax.drafters import block, head, self_layers
from asps_jax.drafters.base import Drafter, Proposal, chain_keys, finite_laws, step_keys
from asps_jax.drafters.lookup import DEFAULT_NGRAM, Lookup
from asps_jax.drafters.model import ModelDraft
from asps_jax.drafters.self_layers import PREFIX as SELF_PREFIX
from asps_jax.drafters.self_layers import SelfDraft, SharedLayers
from asps_jax.models import quant

NAMES = (
    "lookup",
    SELF_PREFIX + "L",
    quant.PREFIX + "int8",
    quant.PREFIX + "int4",
    head.PREFIX + "PATH",
    block.PREFIX + "PATH",
)
"""The drafters named by a string ``draft`` argument (a model object is the draft model)."""

OPTIONS = ("lookup_ngram", "lookup_max", "draft_stop")
"""The drafters' keyword arguments of ``sample`` / ``Session`` (:func:`resolve` checks each
against the drafter it belongs to)."""

__all__ = [
    "NAMES",
    "OPTIONS",
    "Drafter",
    "Lookup",
    "ModelDraft",
    "Proposal",
    "SelfDraft",
    "SharedLayers",
    "chain_keys",
    "finite_laws",
    "is_named",
    "longest_draft",
    "options",
    "own_weights",
    "parse_draft_stop",
    "resolve",
    "step_keys",
]


def is_named(draft) -> bool:
    """Whether ``draft`` names a drafter (``"lookup"``, ``"self:L"``, ``"quant:int8"``,
    ``"eagle3:PATH"``, ``"block:PATH"``) rather than a model or a checkpoint (what the command
    line loads)."""
    prefixes = (SELF_PREFIX, quant.PREFIX, head.PREFIX, block.PREFIX)
    return isinstance(draft, str) and (draft == "lookup" or draft.startswith(prefixes))


def draft_model(target, draft):
    """The draft :class:`~asps_jax.models.Model` that ``draft`` names or is (a self-draft's is
    built from the target), None for ``"lookup"``, None, or a :class:`Drafter` value; a one-line
    error for an unknown name."""
    if isinstance(draft, Drafter) or draft is None or draft == "lookup":
        return None
    if not isinstance(draft, str):
        return draft
    if draft.startswith(SELF_PREFIX):
        return self_layers.self_draft(target, draft)
    if draft.startswith(quant.PREFIX):
        return quant.quantized_copy(target, draft)
    if draft.startswith(head.PREFIX):
        return head.head_for(target, draft)
    if draft.startswith(block.PREFIX):
        return block.block_for(target, draft)
    raise ValueError(
        f"draft: unknown drafter {draft!r}; give a draft model, 'lookup', 'self:L' (the "
        "target's first L layers), 'quant:int8' / 'quant:int4' (the target quantized), "
        "'eagle3:PATH' (a learned head), 'block:PATH' (a block drafter), or None (method 'ar')"
    )


def parse_draft_stop(draft_stop) -> float:
    """``"confidence:τ"`` (or the number τ) -> τ in [0, 1]."""
    text = draft_stop
    if isinstance(draft_stop, str):
        kind, _, text = draft_stop.partition(":")
        if kind != "confidence" or not text:
            raise ValueError(
                f"draft_stop must be 'confidence:τ' with τ in [0, 1], got {draft_stop!r}"
            )
    try:
        tau = float(text)
    except (TypeError, ValueError):
        tau = float("nan")
    if isinstance(draft_stop, bool) or not 0.0 <= tau <= 1.0:
        raise ValueError(f"draft_stop must be 'confidence:τ' with τ in [0, 1], got {draft_stop!r}")
    return tau


def _options(draft, uses_draft: bool, context: int, lookup_ngram, lookup_max, draft_stop):
    """The drafter options checked against the drafter they belong to: ``(ngram, cap, τ)``."""
    given = [
        name
        for name, value in (
            ("lookup_ngram", lookup_ngram),
            ("lookup_max", lookup_max),
            ("draft_stop", draft_stop),
        )
        if value is not None
    ]
    if not uses_draft and given:
        raise ValueError(
            f"{given[0]}: method 'ar' uses no draft, so no drafter option; drop {given[0]}"
        )
    lookup = draft == "lookup"
    for name in ("lookup_ngram", "lookup_max"):
        if name in given and not lookup:
            raise ValueError(f"{name} is an option of draft='lookup', not of a draft model")
    tau = None if draft_stop is None else parse_draft_stop(draft_stop)
    if tau is not None and (lookup or isinstance(draft, Drafter)):
        raise ValueError(
            "draft_stop: a lookup draft has no draft law to be unsure of (its chains end "
            "where the match ends); drop draft_stop"
            if lookup
            else "draft_stop: the confidence stop is an option of a draft model's rollout"
        )
    ngram = check_int("lookup_ngram", DEFAULT_NGRAM if lookup_ngram is None else lookup_ngram, 1)
    if ngram > context:
        raise ValueError(
            f"lookup_ngram={ngram} is longer than the model context of {context} positions: "
            "no suffix that long can ever match; use a few tokens (default 3)"
        )
    cap = 0 if lookup_max is None else check_int("lookup_max", lookup_max, 1)
    return ngram, cap, tau


def options(kwargs: dict) -> dict:
    """The drafters' options taken out of a call's keyword arguments (the rest stays)."""
    return {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}


def longest_draft(options: dict) -> int:
    """The longest draft a calibration of ``num_draft_tokens="auto"`` tries: a lookup's cap,
    else 8."""
    return options.get("lookup_max") or 8


def own_weights(model):
    """The draft model whose weights count apart from the target's (a self-draft's are views of
    the target's: None)."""
    return None if isinstance(model, SelfDraft) else model


def resolve(
    draft,
    target,
    *,
    uses_draft: bool = True,
    widths: tuple = (),
    mesh=None,
    lookup_ngram=None,
    lookup_max=None,
    draft_stop=None,
):
    """The one reader of ``draft=``: ``(target, drafter, draft model, τ)``.

    ``draft``: a :class:`~asps_jax.models.Model` (a separate draft model), ``"self:L"`` (the
    target's first L layers), ``"lookup"`` (prompt lookup), a :class:`Drafter` value (one of
    the user's own), or None (``method="ar"``; ``uses_draft`` False: no drafter). The draft
    model is the one whose parameters the loop takes as ``draft_params`` (None without one); a
    separate one is checked against the target and both are viewed on their shared vocabulary
    (:func:`~asps_jax.models.vocab.align_vocabularies`, hence the target returned). ``τ`` is the
    confidence stop (``draft_stop``), None without it. The drafter options (``lookup_ngram``,
    ``lookup_max``, ``draft_stop``) are checked against the drafter they belong to, each a
    one-line ``ValueError``.
    """
    from asps_jax.models.vocab import align_vocabularies, check_compatible

    model = draft_model(target, draft)
    context = target.config.max_position_embeddings
    ngram, cap, tau = _options(draft, uses_draft, context, lookup_ngram, lookup_max, draft_stop)
    if tau is not None and widths:
        raise ValueError("draft_stop: confidence-stopped chains need K chains, not tree=")
    if not uses_draft:
        return target, None, None, None
    if isinstance(draft, Drafter):
        return target, draft, None, None
    if draft == "lookup":
        return target, Lookup(ngram=ngram, cap=cap), None, None
    if model is None:
        return target, None, None, tau
    if isinstance(model, head.Head):
        return (
            target,
            head.drafter(model, target, mesh=mesh, confidence_stop=tau is not None),
            model,
            tau,
        )
    if isinstance(model, block.Block):
        drafter = block.drafter(model, target, mesh=mesh, confidence_stop=tau is not None)
        return target, drafter, model, tau
    target, model = align_vocabularies(target, model)  # padded embeddings of one tokenizer
    check_compatible(target, model)
    if isinstance(model, SelfDraft):
        drafter = self_layers.drafter(model, mesh=mesh, confidence_stop=tau is not None)
    else:
        drafter = ModelDraft(model.config, confidence_stop=tau is not None)
    return target, drafter, model, tau
