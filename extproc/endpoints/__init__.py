"""Request parsers of the model-addressed endpoints beyond chat and completions, and the table of every path
poolgate routes.

Each family module (``responses``, ``pooling``, ``tokenizer``, ``audio``) turns one request body into the
``RequestFacts`` routing needs (the model, the text to estimate, streaming) plus an ``EndpointCost`` saying
how its tokens are counted; ``table`` maps method and path to a parser, and answers unknown ``/v1/`` paths
with a 404. Pure functions only: no I/O, no clock. This ``__init__`` imports nothing, so ``request`` can use
``cost`` without a cycle.
"""
