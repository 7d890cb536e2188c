"""``posttrain compare``: runs that differ in one setting, side by side (``run``), its command line
(``args``, importable without torch) and its summary table (``summary``).
"""
