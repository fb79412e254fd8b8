"""Session 15: the cost model's shared/flat choice evaluated offline against every measured pair of
times (H200 and H100 grids, the session-11/12 and session-15 out-of-sample sets), as committed and
over a scan of its latency/parallelism constants.  Run from the repository root (CPU)."""
import json, itertools, importlib
import jax_prefix_attn.cost_model as cm
D = {}
for name in ['h200','h100']:
    d = json.load(open(f'bench/results/shared_prefix_{name}.json'))
    D[name] = [r for r in d['results'] if 'status' not in r and isinstance(r.get('flat_ms'), float) and isinstance(r.get('shared_ms'), float)]
def evaluate(verbose=False):
    out = {}
    for name, rs in D.items():
        miss = []; worst = 1
        for r in rs:
            e = cm.estimate(batch=r['batch'],tq=1,heads_q=r['heads_q'],heads_kv=r['heads_kv'],head_dim=128,groups=1,prefix_len=r['prefix'],suffix_len=r['suffix'],itemsize=2)
            t = r['shared_ms'] if e.choice == 'shared' else r['flat_ms']
            ratio = t / min(r['shared_ms'], r['flat_ms'])
            worst = max(worst, ratio)
            if ratio > 1.05: miss.append((r['heads_q'], r['batch'], r['prefix'], r['suffix'], round(ratio,3)))
        out[name] = (len(rs) - len(miss), len(rs), round(worst,3), miss if verbose else None)
    return out
print(evaluate(True))
base = {k: getattr(cm, k) for k in ['SLOTS','T_LAUNCH','T_KEY','T_KEY_FLAT','BW']}
res = []
for slots, tl, tk, tkf in itertools.product([132, 198, 264, 396], [2.5e-6, 3e-6, 3.5e-6, 4e-6], [2e-8, 3e-8, 4e-8], [3e-8, 4e-8, 5e-8]):
    cm.SLOTS, cm.T_LAUNCH, cm.T_KEY, cm.T_KEY_FLAT = slots, tl, tk, tkf
    e = evaluate()
    res.append((e['h200'][0] + e['h100'][0], e['h200'][0], e['h100'][0], max(e['h200'][2], e['h100'][2]), slots, tl, tk, tkf))
for k, v in base.items(): setattr(cm, k, v)
res.sort(key=lambda x: (-x[0], x[3]))
for r in res[:15]: print(r)

import statistics
def val(f):
    d=json.load(open(f)); rs=d['results'] if isinstance(d,dict) else d
    n=ok=0; worst=1; misses=[]
    for r in rs:
        if r.get('in_grid'): continue
        sh = statistics.median(r['shared_us']) if isinstance(r['shared_us'], list) else r['shared_us']
        fl = statistics.median(r['flat_us']) if isinstance(r['flat_us'], list) else r['flat_us']
        if not (isinstance(sh,(int,float)) and isinstance(fl,(int,float))): continue
        e = cm.estimate(batch=r['b'],tq=1,heads_q=r['hq'],heads_kv=r['hkv'],head_dim=128,groups=1,prefix_len=r['p'],suffix_len=r['s'],itemsize=2)
        t = sh if e.choice=='shared' else fl
        ratio = t/min(sh,fl); worst=max(worst,ratio); n+=1; ok+= ratio<=1.05
        if ratio>1.05: misses.append((r['hq'],r['b'],r['p'],r['s'],round(ratio,3)))
    return ok, n, round(worst,3), misses
VAL = ['bench/results/logs/session12_validate_auto12_h200.json','bench/results/logs/session11_validate_auto11_h200.json']
print('current', [val(f) for f in VAL])
for setting in [(132, 3.5e-6, 4e-8, 4e-8), (132, 3.5e-6, 3e-8, 3e-8), (132, 3e-6, 4e-8, 4e-8)]:
    cm.SLOTS, cm.T_LAUNCH, cm.T_KEY, cm.T_KEY_FLAT = setting
    print(setting, evaluate(True), [val(f) for f in VAL])
for k, v in base.items(): setattr(cm, k, v)

V15 = [json.loads(l) for l in open('bench/results/logs/session15_validate_auto15_h200.jsonl') if '"b"' in l]
def val15():
    ok=0; worst=1; miss=[]
    for r in V15:
        e = cm.estimate(batch=r['b'],tq=1,heads_q=r['hq'],heads_kv=r['hkv'],head_dim=128,groups=1,prefix_len=r['p'],suffix_len=r['s'],itemsize=2)
        t = r['shared_med'] if e.choice=='shared' else r['flat_med']
        ratio = t/min(r['shared_med'], r['flat_med']); worst=max(worst,ratio); ok += ratio<=1.05
        if ratio>1.05: miss.append((r['hq'],r['b'],r['p'],r['s'],round(ratio,3)))
    return ok, len(V15), round(worst,3), miss
print('V15 current', val15())
for setting in [(132, 3.5e-6, 4e-8, 4e-8), (132, 3.5e-6, 3e-8, 3e-8)]:
    cm.SLOTS, cm.T_LAUNCH, cm.T_KEY, cm.T_KEY_FLAT = setting
    print('V15', setting, val15())
for k, v in base.items(): setattr(cm, k, v)
print('--- scan')
rows=[]
for slots, tk, tkf, tl in itertools.product([33, 50, 66, 99, 132, 198], [2e-8, 3e-8, 4e-8], [3e-8, 4e-8, 5e-8], [3e-6, 3.5e-6]):
    cm.SLOTS, cm.T_KEY, cm.T_KEY_FLAT, cm.T_LAUNCH = slots, tk, tkf, tl
    e = evaluate(); v = val15(); v12 = val(VAL[0]); v11 = val(VAL[1])
    tot = e['h200'][0] + e['h100'][0] + v[0] + v12[0] + v11[0]
    rows.append((tot, e['h200'][0], e['h100'][0], v[0], v12[0], v11[0], max(e['h200'][2], e['h100'][2], v[2]), slots, tk, tkf, tl))
for k, v in base.items(): setattr(cm, k, v)
rows.sort(key=lambda x: (-x[0], x[6]))
print('max possible', 78+63+18+14+15)
for r in rows[:12]: print(r)
cur = [r for r in rows if r[7]==198 and r[8]==3e-8 and r[9]==4e-8 and r[10]==3.5e-6]
print('current', cur)
