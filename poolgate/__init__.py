"""poolgate's application layer: the ``poolgate`` CLI, ``poolgate up``, ``status`` and the docs generators.

It wires the programs together (``extproc``, ``controller``, ``agent``, ``simworker``) and is the only
layer that may import all of them. The shared kernel below every program is ``poolgate.kernel``.
"""
