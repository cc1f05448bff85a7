"""Directed checks: short fixed scenarios with exact expectations, one module per concern.

``checks`` holds the registry ``DIRECTED`` that conform turns into table columns; ``common`` is
what every check shares (the run a check is in, "not applicable", how a broken promise is told).
"""
