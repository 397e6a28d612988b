"""Single-chain verifiers: SpS and ASpS (placeholder; being implemented)."""


def sps(key, draft_tokens, draft_logprobs, target_logprobs, draft_length):
    raise NotImplementedError("sps is not implemented yet")


def asps(key, draft_tokens, draft_logprobs, target_logprobs, draft_length):
    raise NotImplementedError("asps is not implemented yet")
