"""``posttrain serve``: the policy behind an OpenAI-compatible HTTP API (``server.py``: ``ServeApp``,
``ServeSettings``, ``start``), its wire format (``protocol.py``), the engine thread that batches requests
(``batching.py``) and the command that loads a model, checkpoint or run directory for it (``command.py``).

Nothing is imported here, so that ``posttrain --help`` (which builds ``serve``'s arguments) stays quick.
"""
