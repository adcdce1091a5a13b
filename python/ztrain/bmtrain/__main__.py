"""python3 -m ztrain.bmtrain SCRIPT [ARGS...]: runs a BMTrain training script as it is, on ztrain.

For the script, `import bmtrain` and its submodules (`bmtrain.nn`, `bmtrain.global_var`, …) are
ztrain.bmtrain's; the script runs as `python3 SCRIPT ARGS...` would run it (as __main__, its
folder first on sys.path). Launch: mpirun -np 4 python3 -m ztrain.bmtrain train.py.
"""
import importlib
import os
import runpy
import sys

import ztrain.bmtrain as bmt

SUBMODULES = ("distributed", "global_var", "inspect", "layer", "loss", "lr_scheduler", "nn", "optim", "utils")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: python3 -m ztrain.bmtrain SCRIPT [ARGS...]")
    sys.modules["bmtrain"] = bmt
    for name in SUBMODULES:
        sys.modules["bmtrain." + name] = importlib.import_module("ztrain.bmtrain." + name)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
