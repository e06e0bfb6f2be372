"""Scorers: one module each, each rating candidates in [0, 1] with the formula in its docstring.

A module here that declares ``PLUGIN = ScorerPlugin(...)`` is registered by ``registry`` under that name,
with its own settings model and default weight; nothing else names it.
"""
