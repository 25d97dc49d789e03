"""Speculative decoding: proposers/ (what to guess), policy/ (how much to guess), verify/ (exact
acceptance), and the round that runs them: planner.py plans it (each request's k and why) and
step.py executes it (propose -> verify -> accept -> commit, round_stats.py)."""
