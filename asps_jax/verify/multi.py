"""Multi-draft verifiers (placeholder; being implemented)."""

METHODS: dict = {}
