"""What a round should be: the measured costs (costs.py, measure.py, calibration.py), K from them and
each request's acceptance (k_choice.py), chain or tree (shape_choice.py) and a tree's width (tree_width.py)."""
