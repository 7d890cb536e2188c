"""What fits and what scales: the memory planner (``posttrain plan``) and the cost model of a step
at scale.
"""
