"""What a round should be: the measured costs (costs.py and the fits it prices by, fits.py; measure.py,
calibration.py) corrected by what steps realized (corrections.py), one K for the batch (k_choice.py)
or a K per request (per_request.py), chain or tree (shape_choice.py) and a tree's width (tree_width.py)."""
