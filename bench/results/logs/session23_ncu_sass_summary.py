"""Session 23: Nsight Compute's per-SASS-instruction warp-stall samples of the role-split kernel's
stream role (``session23_ncu_stream_sass_h200.csv.gz``, from ``ncu -i rep --page source
--print-source sass --csv``; see ``session23_prof_stream.py``) summed by opcode and by the part
of a stream step they belong to.  Run from the repository root; output in
``session23_ncu_sass_summary.txt``."""
import collections
import csv
import gzip
import re

PATH = "bench/results/logs/session23_ncu_stream_sass_h200.csv.gz"
# A worker step covers one 64-key K/V tile of one (sequence, kv head): B * Hkv * S / 64 = 8192.
STEPS = 512 * 8 * (128 // 64)
GROUPS = {
    "column max chain (FMNMX, SHFL, BAR, STS, LDS, MEMBAR)": ("FMNMX", "SHFL", "BAR", "STS", "LDS", "MEMBAR"),
    "wgmma issue and waits (HGMMA, WARPGROUP)": ("HGMMA", "WARPGROUP"),
    "uniform-datapath scalar work (U*, R2UR)": None,   # opcodes starting with U, and R2UR
    "branches and TMA barrier waits (BRA, SYNCS)": ("BRA", "SYNCS"),
    "exp2 and softmax arithmetic (MUFU, FMUL, FFMA, FADD, FSEL)": ("MUFU", "FMUL", "FFMA", "FADD", "FSEL"),
}

with gzip.open(PATH, "rt") as f:
    head = f.readline().rstrip()     # "# commit ..., device, versions, command"
    rows = list(csv.reader(f))
hdr, data = rows[1], rows[2:]
print(head)
i_s = hdr.index("Warp Stall Sampling (All Samples)")
i_e = hdr.index("Instructions Executed")
samp, ex = collections.Counter(), collections.Counter()
for r in data:
    src = re.sub(r"^@!?U?P\w+\s+", "", r[1].strip())
    op = (src.split()[0] if src else "?").split(".")[0]
    samp[op] += int(r[i_s] or 0)
    ex[op] += int(r[i_e] or 0)
tot_s, tot_e = sum(samp.values()), sum(ex.values())
print(f"{tot_s} stall samples, {tot_e} warp instructions executed, "
      f"{tot_e / STEPS / 4:.0f} per warp per 64-key step ({STEPS} steps)")
for name, ops in GROUPS.items():
    sel = [o for o in samp if (o.startswith("U") or o == "R2UR")] if ops is None else ops
    print(f"{name:62s} {100 * sum(samp[o] for o in sel) / tot_s:5.1f}% of samples, "
          f"{100 * sum(ex[o] for o in sel) / tot_e:5.1f}% of instructions")
print("\nopcode       samples          executed")
for op, c in samp.most_common(20):
    print(f"{op:12s} {c:5d} ({100 * c / tot_s:4.1f}%)  {ex[op]:9d} ({100 * ex[op] / tot_e:4.1f}%)")
