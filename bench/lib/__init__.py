"""Helper modules of the side-by-side benchmarks (not scripts): ``lockstep`` runs the two sides in
lockstep (its ``--side`` entry point is what ``run_lockstep`` spawns), ``report`` prints their figures.
"""
