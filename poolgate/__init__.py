"""poolgate core shared by extproc and the controller: configuration, fleet state schema, the CLI.

It holds no request-path logic (that is ``extproc``) and no fleet actions (that is ``controller``).
"""
