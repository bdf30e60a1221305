"""Recipes: models and data modules that follow lightning_parallel.protocol."""
