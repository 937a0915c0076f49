"""Reward functions that misbehave, for the prime manager's tests: a light module, as a
worker process imports it."""

import re
import subprocess
import sys
import threading


def score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("bad program")
    if solution_str == "hang":
        threading.Event().wait()
    if solution_str == "spin":  # never returns, never releases its thread
        while True:
            pass
    if solution_str == "regex":  # holds the GIL in C far past any deadline
        return float(re.match(r"(a+)+$", "a" * 40 + "b") is None)
    if solution_str == "grandchild":  # leaves a process of its own behind, then hangs
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(ground_truth, "w") as f:
            f.write(str(child.pid))
        threading.Event().wait()
    if solution_str == "exit":
        import os
        os._exit(3)
    if solution_str == "dict":
        return {"score": 0.5, "acc": True}
    if solution_str == "numpy":
        import numpy as np
        return {"score": np.float32(0.25), "acc": np.bool_(True)}
    return float(solution_str == ground_truth)
