"""Session 12 diagnostic: the kernels (fusions, custom calls) of the compiled shared / flat call at
some points, from the optimized HLO (no timing)."""
import re, sys, os
sys.path.insert(0, os.getcwd())
import jax
from bench.shared_prefix import make_inputs, ours

PTS = [(256, 16384, 64, 8), (256, 16384, 1024, 8), (1024, 16384, 256, 8), (256, 4096, 64, 8),
       (256, 4096, 64, 32), (1024, 16384, 256, 32), (16, 4096, 256, 8)]
for b, p, s, hq in PTS:
    hkv = 8 if hq == 32 else 1
    args = make_inputs(b, p, s, hkv, hq, 128)
    for impl in (("shared", "flat") if b == 16 else ("shared",)):
        txt = jax.jit(ours(impl)).lower(*args).compile().as_text()
        comps = {}
        cur = None
        for line in txt.splitlines():
            m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
            if m:
                cur = m.group(2); comps[cur] = []
                if m.group(1): entry = cur
                continue
            if cur is not None:
                comps[cur].append(line)
        print(f"== B={b} P={p} S={s} Hq={hq} {impl}")
        for line in comps[entry]:
            line = line.strip()
            if " fusion(" in line or "custom-call(" in line or "copy(" in line or " reduce(" in line:
                name = line.split(" = ")[0]
                shape = line.split(" = ")[1].split(" ")[0][:80]
                calls = re.search(r"calls=%?([\w.\-]+)", line)
                tgt = re.search(r'custom_call_target="([^"]+)"', line)
                root = ""
                if calls and calls.group(1) in comps:
                    body = comps[calls.group(1)]
                    roots = [l for l in body if "ROOT" in l]
                    ops = sorted(set(re.findall(r"= \S+ (\w[\w\-]*)\(", "\n".join(body))))
                    root = (roots[0].split(" = ")[1][:90] if roots else "") + " ops=" + ",".join(ops)[:200]
                print("  ", name[:40], shape, (tgt.group(1) if tgt else ""), root)
