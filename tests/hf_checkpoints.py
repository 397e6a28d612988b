"""Tiny random transformers models (Llama, OPT, GPT-2, GPT-Neo, Qwen2, Qwen3, Mistral, Gemma 2,
Gemma 3) and checkpoints for the tests.

transformers is the independent reference: tests load what ``save_pretrained`` writes with our
loader and compare against the PyTorch model. Every model is built under ``torch.manual_seed(seed)``
and perturbed in a fixed order afterwards, so a given set of arguments always writes the same bytes.
"""

from __future__ import annotations

import copy

import torch
import transformers

# The shapes of test_decode.py and test_sharding.py; tests override any of them by keyword.
TINY_CONFIG = {
    "vocab_size": 12,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def tiny_llama(
    *,
    seed: int,
    norm_noise: float = 0.0,
    noise_from: transformers.LlamaForCausalLM | None = None,
    nan: bool = False,
    nan_token: int | None = None,
    **config,
) -> transformers.LlamaForCausalLM:
    """A random float32 Llama in eval mode with eager attention.

    Args:
      seed: ``torch.manual_seed`` before the weights are drawn.
      norm_noise: when > 0, add ``norm_noise * N(0, 1)`` to every norm weight (they start at 1,
        so without it their loading is not checked).
      noise_from: a model of the same shapes; copy its weights plus Gaussian noise of 0.35 times
        each tensor's std, giving a draft correlated with that target.
      nan: fill ``lm_head`` with NaN (a broken checkpoint).
      nan_token: fill that token's embedding row with NaN, so the logits turn NaN only once the
        token is in the context (set after ``noise_from``).
      **config: ``transformers.LlamaConfig`` fields over :data:`TINY_CONFIG` (``vocab_size``,
        ``initializer_range``, ``rope_parameters``, ...).
    """
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**TINY_CONFIG, **config})
    # sdpa is ~50x slower on CPU at these sizes; not written to config.json, so the checkpoint
    # is the same either way.
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        if norm_noise:
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(norm_noise * torch.randn_like(p))
        if noise_from is not None:
            for (_, p), (_, q) in zip(model.named_parameters(), noise_from.named_parameters()):
                p.copy_(q + 0.35 * q.std() * torch.randn_like(q))
        if nan:
            model.lm_head.weight.fill_(float("nan"))
        if nan_token is not None:
            model.model.embed_tokens.weight[nan_token].fill_(float("nan"))
    return model


def write_tiny_llama(path, **kwargs) -> transformers.LlamaForCausalLM:
    """:func:`tiny_llama` (same keyword arguments) saved to ``path``; returns the model."""
    model = tiny_llama(**kwargs)
    model.save_pretrained(path)
    return model


def load_tiny_pair(root, vocab_size: int = 12):
    """A tiny Llama target (seed 0) and draft (seed 1) written under ``root`` and loaded
    through asps_jax's loader: ``(target, draft)``."""
    import asps_jax

    write_tiny_llama(root / "target", seed=0, vocab_size=vocab_size)
    write_tiny_llama(root / "draft", seed=1, vocab_size=vocab_size)
    return asps_jax.load_model(str(root / "target")), asps_jax.load_model(str(root / "draft"))


def char_tokenizer(chars: str) -> transformers.PreTrainedTokenizerFast:
    """One character per token: id 0 is ``</s>`` (the EOS), ids 1.. the characters of ``chars``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"</s>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")


def write_peaked_pair(root, vocab_size: int = 12):
    """A target with large weights (``initializer_range`` 0.4: peaked laws, so drafts are sometimes
    rejected) and a draft that is a noisy copy of it, written under ``root`` and loaded:
    ``(transformers target, target, draft)``."""
    import asps_jax

    kw = dict(vocab_size=vocab_size, initializer_range=0.4)
    hf_target = write_tiny_llama(root / "target", seed=0, **kw)
    write_tiny_llama(root / "draft", seed=1, noise_from=hf_target, **kw)
    target = asps_jax.load_model(str(root / "target"))
    return hf_target, target, asps_jax.load_model(str(root / "draft"))


# The learned-position families: tiny shapes (tests override any of them by keyword). GPT-Neo's
# window of 4 is shorter than the tests' sequences, so its local layers are exercised. Weights of
# std 0.2 (not HF's 0.02) give logits of order 1, so a 1e-4 tolerance is a tight check.
FAMILY_CONFIGS = {
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {"vocab_size": 96, "hidden_size": 32, "ffn_dim": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 64, "init_std": 0.2},
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"vocab_size": 96, "n_embd": 32, "n_inner": 48, "n_layer": 2, "n_head": 4,
         "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.2},
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2,
         "num_heads": 4, "attention_types": [[["global", "local"], 1]], "window_size": 4,
         "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0,
         "initializer_range": 0.2},
    ),
}  # fmt: skip

# The RoPE-decoder families: every special feature on by default. Windows of 4 (shorter than the
# tests' sequences); head_dim decoupled from hidden / heads (16 vs 8); Gemma's query scalar unlike
# head_dim, and soft-caps (2 on the scores, 3 on the logits) below the uncapped values (up to
# ~4 with std-0.2 weights), so capping changes every logit; Gemma 3's global layers with a linear
# RoPE scaling and a base unlike the local layers'.
_ROPE_DECODER = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.2,
}
FAMILY_CONFIGS.update({
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_ROPE_DECODER)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_ROPE_DECODER, head_dim=16)),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(_ROPE_DECODER, head_dim=16, sliding_window=4),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(_ROPE_DECODER, head_dim=8, query_pre_attn_scalar=12, sliding_window=4,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(_ROPE_DECODER, head_dim=16, query_pre_attn_scalar=10, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
             }),
    ),
})  # fmt: skip


def tiny_family(
    family: str,
    *,
    seed: int,
    noise: float = 0.1,
    noise_from: torch.nn.Module | None = None,
    **config,
) -> torch.nn.Module:
    """A random float32 causal LM of a family of :data:`FAMILY_CONFIGS`, in eval mode with eager
    attention.

    Args:
      family: a key of :data:`FAMILY_CONFIGS` (``"opt"``, ``"gemma2"``, ...).
      seed: ``torch.manual_seed`` before the weights are drawn.
      noise: add ``noise * N(0, 1)`` to every bias and norm parameter (they start at 0 or 1,
        so without it their loading is not checked).
      noise_from: a model of the same shapes; copy its weights plus Gaussian noise of 0.35 times
        each tensor's std, giving a draft correlated with that target.
      **config: fields of the family's transformers config over :data:`FAMILY_CONFIGS`.
    """
    config_name, model_name, defaults = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_name)(**copy.deepcopy({**defaults, **config}))
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if noise and (name.endswith("bias") or "norm" in name or ".ln_" in name):
                p.add_(noise * torch.randn_like(p))
        if noise_from is not None:
            for (_, p), (_, q) in zip(model.named_parameters(), noise_from.named_parameters()):
                p.copy_(q + 0.35 * q.std() * torch.randn_like(q))
    return model


def write_tiny_family(path, family: str, **kwargs) -> torch.nn.Module:
    """:func:`tiny_family` (same arguments) saved to ``path``; returns the model."""
    model = tiny_family(family, **kwargs)
    model.save_pretrained(path)
    return model
