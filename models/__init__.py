"""The bundled models as package data: installed as ``asps_jax._models`` (pyproject.toml maps this
folder onto that name), one folder per alias (card.json; config, tokenizer and weights where the
checkpoint is bundled). asps_jax.models.cards finds them through importlib.resources."""
