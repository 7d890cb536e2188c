"""The built-in demos behind ``posttrain demo``: arithmetic (the default), ``--agent`` and ``--real``."""
