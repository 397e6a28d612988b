"""Back ends of other frameworks that sample with asps_jax.

Each module imports its framework when it is imported itself, never from here:
``asps_jax.integrations.tunix`` (google-tunix's ``BaseSampler`` and RL rollout engine).
"""
