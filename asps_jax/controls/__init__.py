"""The sampling controls under one roof: the per-row processor and its parameters
(:mod:`~asps_jax.controls.processors`), the typed sampling arguments
(:mod:`~asps_jax.controls.sampling`), the path-dependent controls and the row history
(:mod:`~asps_jax.controls.penalties`), regex / JSON-schema constraints
(:mod:`~asps_jax.controls.constraints`, their DFA child :mod:`~asps_jax.controls.dfa_worker`),
stop strings (:mod:`~asps_jax.controls.stopping`) and the token-bytes table both read
(:mod:`~asps_jax.controls.tokenbytes`)."""
