"""The command line of ``scripts/sample.py`` as the library sees it: the parser (its flags in
groups, in the order ``--help`` lists them), the checks across flags that argparse cannot make
(one-line errors, exit status 2), and the flags as the library's arguments (``Session``'s keyword
arguments, the size check made before anything is built).
"""

from __future__ import annotations

import argparse
import math

from asps_jax import sampler
from asps_jax.cli import flags
from asps_jax.controls import Sampling, validate_stop
from asps_jax.verify.api import TREE_METHODS
from asps_jax.verify.registry import DEFAULT_METHOD, REFERENCE_METHODS, describe

DEFAULT_TARGET = "tinyshakespeare-target"
DEFAULT_DRAFT = "tinyshakespeare-draft"
DEFAULT_PROMPT = "ROMEO:\nBut soft, what light"
DTYPES = {"f32": "float32", "bf16": "bfloat16"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# --help's sections, in order, and the flags each lists (every flag is in one: tests/test_cli.py).
GROUPS = {
    "models": ("--target", "--draft", "--dtype", "--quantize", "--draft-quantize"),
    "method and tree": ("--method", "--num-draft-tokens", "--num-drafts", "--tree"),
    "drafting": ("--draft-temperature", "--lookup-ngram", "--lookup-max", "--draft-stop"),
    "prompts": ("--prompt", "--max-new-tokens", "--batch-size", "--n", "--seed"),
    "sampling controls": (
        "--temperature", "--top-k", "--top-p", "--min-p", "--typical-p", "--repetition-penalty",
        "--presence-penalty", "--frequency-penalty", "--no-repeat-ngram-size", "--logit-bias",
        "--bad-words", "--min-tokens", "--stop",
    ),
    "constraints": ("--regex", "--json-schema"),
    "prompt sets": ("--prompts",),
    "output": ("--json", "--top-logprobs"),
    "performance": ("--no-compile-cache",),
    "devices and processes": (
        "--mesh", "--distributed", "--coordinator", "--num-processes", "--process-id",
    ),
}  # fmt: skip


class _Sections:
    """``add_argument`` that files each flag under its :data:`GROUPS` section."""

    def __init__(self, parser: argparse.ArgumentParser):
        groups = {title: parser.add_argument_group(title) for title in GROUPS}
        self._group = {flag: groups[title] for title, flags in GROUPS.items() for flag in flags}

    def add_argument(self, flag, *args, **kwargs):
        if flag not in self._group:
            raise KeyError(f"{flag}: add it to a section of asps_jax.cli.args.GROUPS")
        return self._group[flag].add_argument(flag, *args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="sample.py",
        description="Exact speculative sampling with a draft and a target model. With no "
        "arguments it runs the bundled tiny Shakespeare pair on a default prompt.",
    )
    sections = _Sections(p)
    for add in (_models, _method, _sampling, _penalties, _run, _devices, _output):
        add(sections)
    # The usage synopsis lists the flags in the order of --help's sections (argparse writes it in
    # the order they were added); parsing does not depend on this order.
    rank = {flag: i for i, flag in enumerate(f for flags in GROUPS.values() for f in flags)}
    p._actions.sort(key=lambda a: min((rank[o] for o in a.option_strings if o in rank), default=-1))
    return p


def _models(p: argparse.ArgumentParser) -> None:
    """The target, the draft (a checkpoint or a drafter's name) and the drafters' options."""
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="target model: an alias from models/ (e.g. llama7b), a checkpoint "
        "directory, or a Hugging Face repo id, found in the Hugging Face cache or downloaded "
        f"when online (default {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"draft model, same forms as --target (default {DEFAULT_DRAFT}); or 'lookup': "
        "prompt lookup, the continuation of the last --lookup-ngram tokens' most recent earlier "
        "occurrence in the prompt + generated text (no draft model); or self:L, the target's "
        "first L layers with its final norm and head (self-drafting); or quant:int8 / "
        "quant:int4[:G], the target's own weights quantized (no second checkpoint); or "
        "eagle3:PATH, a learned EAGLE-3 head on the target's hidden states (a folder in the "
        "EAGLE-3 layout; eagle3:tinyshakespeare-eagle3 is bundled); or block:PATH, a parallel "
        "block drafter, all n draft laws from one forward (block:tinyshakespeare-block is "
        "bundled); ignored by --method ar",
    )
    p.add_argument(
        "--lookup-ngram",
        type=flags.positive_int,
        default=None,
        metavar="m",
        help="--draft lookup: the suffix length searched for (default 3)",
    )
    p.add_argument(
        "--lookup-max",
        type=flags.positive_int,
        default=None,
        metavar="N",
        help="--draft lookup: the longest chain copied (default: --num-draft-tokens)",
    )
    p.add_argument(
        "--draft-stop",
        type=flags.draft_stop,
        default=None,
        metavar="confidence:TAU",
        help="a draft chain stops growing at the first draft law whose top probability is below "
        "TAU (the draft loop exits once every chain stopped; exact, docs/algorithms.md §10)",
    )


def _method(p: argparse.ArgumentParser) -> None:
    """The prompts, the verification method and the draft's shape (n, K or a tree)."""
    p.add_argument(
        "--prompt",
        action="append",
        type=flags.text,
        default=None,
        metavar="TEXT",
        help="prompt text; repeat the flag for several prompts (default: a line of "
        "Romeo and Juliet)",
    )
    # The reference constructions ("optimal") are available from Python (asps_jax.sample,
    # verify_drafts): their per-node fit costs several decode steps' worth (docs/benchmarks.md).
    methods = tuple(m for m in sampler.METHODS if m not in REFERENCE_METHODS)
    p.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        choices=methods,
        help=f"verification method: ar = target alone; {describe(methods[1:])} "
        f"(default {DEFAULT_METHOD})",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=flags.num_draft_tokens,
        default=None,
        metavar="n",
        help="draft tokens proposed per target call (default 8), or 'auto': chosen by a short "
        "measured calibration (acceptance by depth, draft / target cost), printed",
    )
    p.add_argument(
        "--num-drafts",
        type=flags.positive_int,
        default=None,
        metavar="K",
        help="draft chains per step, for multi-draft methods: independent, or with their roots "
        "drawn without replacement under specinfer_wor (default 1)",
    )
    p.add_argument(
        "--tree",
        type=flags.widths,
        default=None,
        metavar="W1,W2,...",
        help="tv / tv_wr / is_bv: draft a branching tree instead of K chains, W_d children per "
        "node at depth d (e.g. 4,2,1,1; siblings without replacement for tv); sets n = the "
        "depth (the number of widths) and K = the leaves, the product of the widths (4,2,1,1: "
        "n = 4, K = 8 root paths, one draft cache replica each)",
    )


def _sampling(p: argparse.ArgumentParser) -> None:
    """Temperatures, truncation (top-k, top-p, min-p, typical-p) and stop strings."""
    p.add_argument(
        "--temperature",
        type=flags.non_negative_float,
        default=1.0,
        metavar="T",
        help="target sampling temperature; 0 = greedy (default 1.0)",
    )
    p.add_argument(
        "--draft-temperature",
        type=flags.non_negative_float,
        default=None,
        metavar="T",
        help="temperature the draft samples at (default: --temperature); output law "
        "stays the target's either way",
    )
    p.add_argument(
        "--top-k",
        type=flags.positive_int,
        default=None,
        metavar="k",
        help="keep only the k most likely tokens (default: off)",
    )
    p.add_argument(
        "--top-p",
        type=flags.top_p,
        default=None,
        metavar="p",
        help="nucleus sampling mass in (0, 1] (default: off)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop a row after the first occurrence of STR in its generated text (kept); "
        "repeatable, at most 16 strings of 1 to 64 UTF-8 bytes (default: none)",
    )
    p.add_argument(
        "--min-p",
        type=flags.unit_float,
        default=None,
        metavar="p",
        help="drop tokens less likely than p times the most likely one, after top-k / top-p "
        "(default: off)",
    )
    p.add_argument(
        "--typical-p",
        type=flags.checked(float, lambda v: 0.0 < v <= 1.0, "a typical-p mass in (0, 1]"),
        default=None,
        metavar="p",
        help="locally typical sampling: keep the tokens whose surprisal is closest to the "
        "entropy, up to mass p, after min-p (transformers' typical_p; default: off)",
    )


def _penalties(p: argparse.ArgumentParser) -> None:
    """Path-dependent controls: the penalties, no-repeat n-grams, the logit bias, bad words and
    min_tokens."""
    p.add_argument(
        "--repetition-penalty",
        type=flags.positive_float,
        default=None,
        metavar="θ",
        help="transformers' repetition penalty over the prompt and the generated tokens: a "
        "logit l of a token already there becomes l/θ if l > 0 else l*θ (default: off, 1)",
    )
    p.add_argument(
        "--presence-penalty",
        type=flags.finite_float,
        default=None,
        metavar="a",
        help="OpenAI's presence penalty: logit -= a for every token generated before "
        "(default: off, 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=flags.finite_float,
        default=None,
        metavar="b",
        help="OpenAI's frequency penalty: logit -= b * (times the token was generated) "
        "(default: off, 0)",
    )
    p.add_argument(
        "--no-repeat-ngram-size",
        type=flags.non_negative_int,
        default=None,
        metavar="n",
        help="never complete an n-gram already in the prompt and generated text (default: off)",
    )
    p.add_argument(
        "--logit-bias",
        type=flags.bias,
        action="append",
        default=None,
        metavar="ID=BIAS",
        help="add BIAS to token ID's logit before anything else; -inf bans it; repeatable",
    )
    p.add_argument(
        "--bad-words",
        action="append",
        default=None,
        metavar="WORD",
        help="never generate WORD (vLLM's bad_words: tokenized alone and after a space, the "
        "last token of each banned wherever the text ends with the others); repeatable",
    )
    p.add_argument(
        "--min-tokens",
        type=flags.non_negative_int,
        default=None,
        metavar="m",
        help="no EOS and no stop string before the m-th generated token (vLLM's min_tokens; "
        "default: off, 0)",
    )


def _run(p: argparse.ArgumentParser) -> None:
    """What is generated and returned: log-probabilities, the prompt set, sizes, the seed."""
    p.add_argument(
        "--top-logprobs",
        type=flags.non_negative_int,
        default=None,
        metavar="k",
        help="with --json: the k most likely tokens and their log-probabilities at each "
        "generated position (default: off)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help='a prompt set: one prompt per line, or JSON lines with "prompt" and an optional '
        '"max_new_tokens"; sampled through --batch-size slots (default 8) with continuous '
        "batching, printed as JSON lines in prompt order (per prompt, then the pooled statistics)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=flags.positive_int,
        default=200,
        metavar="M",
        help="tokens to generate per prompt (default 200)",
    )
    p.add_argument(
        "--batch-size",
        type=flags.positive_int,
        default=None,
        metavar="B",
        help="rows sampled together, at least the number of prompts; the prompts are repeated "
        "to fill it (default: one row per prompt)",
    )
    p.add_argument(
        "--n",
        type=flags.positive_int,
        default=1,
        metavar="N",
        help="samples per row (default 1): row r gives N rows, r*N+i its sample i, each an "
        "independent draw keyed by the row's key and i (not with --prompts)",
    )
    p.add_argument(
        "--seed",
        type=flags.seed,
        default=0,
        help="random seed, an integer in [0, 2**63) (default 0)",
    )


def _devices(p: argparse.ArgumentParser) -> None:
    """Parameter dtype, the device mesh and a multi-process run."""
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="f32",
        help="parameter dtype: f32 or bf16 (default f32)",
    )
    p.add_argument(
        "--quantize",
        type=flags.quantize,
        default=None,
        metavar="int8|int4[:G]",
        help="store the target's matrices as int8 (per channel) or int4 (per group of G inputs, "
        "default 128) weights; the embedding, norms and head stay --dtype (default: off)",
    )
    p.add_argument(
        "--draft-quantize",
        type=flags.quantize,
        default=None,
        metavar="int8|int4[:G]",
        help="the same for the --draft checkpoint (for the target's own quantized copy as the "
        "draft, give --draft quant:int8)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help="shard over a device mesh: batch rows along data, attention heads / MLP / "
        "vocabulary along model; D*M devices must exist (default: one device)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="one of several processes (multi-host): join them with jax.distributed.initialize, "
        "which finds the coordinator, process count and id itself on a TPU pod slice, Slurm or "
        "Open MPI; elsewhere give --coordinator, --num-processes and --process-id",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0 for a multi-process run (default: $JAX_COORDINATOR_ADDRESS "
        "or detected); implies --distributed",
    )
    p.add_argument(
        "--num-processes",
        type=flags.positive_int,
        default=None,
        metavar="N",
        help="number of processes of a multi-process run; implies --distributed",
    )
    p.add_argument(
        "--process-id",
        type=flags.non_negative_int,
        default=None,
        metavar="I",
        help="this process's id in [0, N) in a multi-process run; implies --distributed",
    )


def _output(p: argparse.ArgumentParser) -> None:
    """Constraints on the text, the output form and the compilation cache."""
    p.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help="constrain the generated text to match PATTERN in full (every method, exact: the "
        "law of constrained sampling from the target; needs the target's tokenizer)",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain the generated text to JSON valid under the schema in FILE (supported "
        "keywords: docs/api.md)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, the target's log-probability of each token, "
        "statistics) instead of streaming",
    )
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use the on-disk compilation cache (default: on, in $ASPS_JAX_CACHE_DIR if "
        "set, else $XDG_CACHE_HOME/asps_jax/jax, ~/.cache/asps_jax/jax when XDG_CACHE_HOME is "
        "unset; ASPS_JAX_NO_CACHE=1 also turns it off)",
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks across flags, after parsing (``parser.error`` on the first that fails); fills in
    the draft's shape: ``--tree`` sets n and K, else n defaults to 8 (``--lookup-max`` for a
    lookup) and K to 1."""
    if args.tree is not None:
        _apply_tree(parser, args)
    if args.num_draft_tokens is None:  # a lookup's chains are at most --lookup-max long
        args.num_draft_tokens = args.lookup_max if args.draft == "lookup" and args.lookup_max else 8
    args.num_drafts = 1 if args.num_drafts is None else args.num_drafts
    if args.regex is not None and args.json_schema is not None:
        parser.error("--regex and --json-schema: give at most one constraint")
    if args.top_logprobs and not args.json:
        parser.error("--top-logprobs needs --json (the log-probabilities are in its output)")
    if args.prompts is not None and args.prompt:
        parser.error("--prompts and --prompt: give the prompts one way")
    if args.prompts is not None and args.n != 1:
        parser.error("--n: not with --prompts (each line is one sample); repeat its lines instead")
    if args.prompts is not None and args.top_logprobs:
        parser.error("--top-logprobs: not with --prompts (per-prompt lines carry no log-probs)")
    prompts = len(args.prompt or [DEFAULT_PROMPT])
    if args.prompts is None and args.batch_size is not None and args.batch_size < prompts:
        parser.error(
            f"--batch-size {args.batch_size} is smaller than the {prompts} prompts given; raise "
            "it or drop it (default: one row per prompt)"
        )
    if args.stop:
        try:
            validate_stop(args.stop, name="--stop")
        except ValueError as err:
            parser.error(str(err))


def _apply_tree(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--tree``: a tree method, and the n and K it implies (a given one must agree)."""
    if args.method not in TREE_METHODS:  # before --tree sets --num-drafts, which ar refuses
        does = "uses no draft" if args.method == "ar" else "verifies draft chains"
        parser.error(
            f"--tree drafts a branching tree, which the tree methods "
            f"({', '.join(TREE_METHODS)}) verify; --method {args.method} {does} (drop --tree)"
        )
    implied = {"num_drafts": math.prod(args.tree), "num_draft_tokens": len(args.tree)}
    for name, value in implied.items():
        given = getattr(args, name)
        if given is not None and given != value:
            flag = "--" + name.replace("_", "-")
            parser.error(f"--tree {args.tree} implies {flag} {value}; drop {flag} {given}")
        setattr(args, name, value)


def sampling_kwargs(args) -> dict:
    """The arguments of ``sample`` / ``Session`` that come straight from the flags: the method, the
    draft shape, the sampling arguments (:class:`asps_jax.controls.sampling.Sampling`, one flag
    each), the stop strings and the drafter's options (one list for the single batch and for
    ``--prompts``)."""
    sampling = {name: getattr(args, name) for name in Sampling.names() if hasattr(args, name)}
    sampling.update(
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
        json_schema=read_schema(args.json_schema),
    )
    return dict(
        method=args.method,
        num_draft_tokens=args.num_draft_tokens,
        num_drafts=args.num_drafts,
        tree=args.tree,
        stop=args.stop,
        **sampling,
        **_drafter_options(args),
    )


def _drafter_options(args) -> dict:
    """The drafter's options given on the command line (the library checks them)."""
    names = ("lookup_ngram", "lookup_max", "draft_stop")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def check_sizes(args, target, draft, encoded, mesh) -> None:
    """Refuse, before the batch is built or anything compiled, sizes the models or the device
    cannot take (one-line errors naming the flag to lower)."""
    if args.method == "ar":
        if args.num_drafts != 1:
            raise ValueError(
                f"--num-drafts {args.num_drafts} is for multi-draft methods; --method ar uses no "
                "draft (drop --num-drafts)"
            )
        n = k = 1
    else:
        n, k = args.num_draft_tokens, args.num_drafts
        if n == "auto":
            n = args.lookup_max or 8  # the longest the calibration tries
        context = target.config.max_position_embeddings
        if not isinstance(draft, str):
            context = min(context, draft.config.max_position_embeddings)
        if n >= context:
            raise ValueError(
                f"--num-draft-tokens {n} does not fit the model context of {context} positions; "
                "lower --num-draft-tokens"
            )
    sampler.check_memory(
        target,
        draft,  # a model, None, or a drafter's name ("lookup", "self:L")
        batch=args.batch_size * args.n,
        prompt_len=max(len(e) for e in encoded),
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=n,
        num_drafts=k,
        mesh=mesh,
        method=args.method,
        widths=args.tree if args.method != "ar" and args.tree else (),
    )


def read_schema(path):
    """The text of the --json-schema file (None without the flag)."""
    if path is None:
        return None
    try:  # a UTF-8 byte-order mark opening the file is not part of the schema
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ValueError(f"--json-schema: cannot read {path} ({why})") from None
