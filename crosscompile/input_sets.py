"""Input sets kept in a folder, as `tether quantize --calibrate DIR` and
`tether check --inputs DIR` take them: an .npz per set keyed by input name,
or an .npy per set for a model with one input; read in file-name order.

>>> read_input_sets("samples/", ["input"])             # doctest: +SKIP
[('samples/cat.npy', {'input': array(...)}), ...]
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

InputSet = Dict[str, np.ndarray]


def read_input_sets(folder: str, names: Sequence[str]) -> List[Tuple[str, InputSet]]:
    """(path, {input name: array}) of every set in ``folder``; ValueError names
    the folder or file at fault and what it should hold."""
    files = sorted(glob.glob(os.path.join(folder, "*.npz")) + glob.glob(os.path.join(folder, "*.npy")))
    if not os.path.isdir(folder) or not files:
        raise ValueError(f"{folder!r} holds no .npy or .npz samples; give a folder of input sets "
                         "(an .npz per set keyed by input name, or an .npy per set for a model "
                         "with one input)")
    sets = []
    for path in files:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as archive:
                one = {k: archive[k] for k in archive.files}
        elif len(names) == 1:
            one = {names[0]: np.load(path, allow_pickle=False)}
        else:
            raise ValueError(f"{path}: an .npy is one input, and the model has {list(names)}; "
                             "give an .npz per set keyed by input name")
        if set(one) != set(names):
            raise ValueError(f"{path}: holds {sorted(one)}, the model's inputs are {sorted(names)}")
        sets.append((path, one))
    return sets
