"""Scorers: one module each, each rating candidates in [0, 1] with the formula in its docstring."""
