"""Adapters that run real engines' prefix caches, from their released packages, under ``kvstate conform``."""
