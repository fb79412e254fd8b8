"""Session 18: print the variables and constraints Mosaic GPU's layout inference leaves unsolved (wraps find_assignments_for), then run the bisect script."""
import sys, runpy
from jax.experimental.mosaic.gpu import layout_inference as li
from jax.experimental.mosaic.gpu import constraints as cs
orig = li.find_assignments_for
depth = [0]
def wrapped(unknowns, constraint_system, *a, **k):
    if depth[0] == 0:
        r = cs.reduce(constraint_system)
        if not isinstance(r, cs.Unsatisfiable):
            rem = [u for u in unknowns if u not in r.assignments.keys()]
            print("REMAINING UNKNOWNS", len(rem), "of", len(unknowns))
            for u in rem[:25]:
                print("  ", str(u)[:200])
                k = u.key
                op = getattr(k, "operation", None)
                if op is not None:
                    print("      op:", str(op).replace("\n", " ")[:600])
            print("CONSTRAINTS", len(r.constraints))
            for c in list(r.constraints)[:25]:
                print("  C", str(c)[:300])
    depth[0] += 1
    try:
        return orig(unknowns, constraint_system, *a, **k)
    finally:
        depth[0] -= 1
li.find_assignments_for = wrapped
sys.argv = ["x"] + sys.argv[1:]
runpy.run_path("bench/results/logs/session18_decoupled_lower_bisect.py", run_name="__main__")
