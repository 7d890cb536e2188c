"""The RL loop alone: its phases (``rl.py``), the state a checkpoint carries between steps
(``loop_state.py``), and what it logs beside the metrics (``diagnose.py``, ``prompt_stats.py``).
"""
